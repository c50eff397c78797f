// The C side of the UCX transport: the calls into libucp that take structures or return
// status pointers, which cgo cannot express directly. ucx.c defines them.

#ifndef MOEX_UCX_H
#define MOEX_UCX_H

#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

typedef struct {
	uint32_t comm, seq, tag, sig, src, flags;
	uint64_t len;
} moex_hdr;

typedef struct {
	moex_hdr hdr;
	ucp_dt_iov_t iov[2];
} moex_op;

typedef struct {
	int failed;
	int status;
} moex_ep_state;

void moex_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status);
int moex_ep_failed(moex_ep_state *st);
ucs_status_t moex_init(ucp_context_h *ctx, ucp_worker_h *w, int wakeup);
ucs_status_t moex_address(ucp_worker_h w, void **addr, size_t *len);
ucs_status_t moex_ep_create(ucp_worker_h w, void *addr, moex_ep_state *st, int peer_errors, ucp_ep_h *ep);
int moex_ptr(ucs_status_ptr_t p, void **req, ucs_status_t *st);
int moex_send(ucp_ep_h ep, const void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st);
int moex_recv(ucp_worker_h w, void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st);
ucs_status_t moex_recv_test(void *req, size_t *len);
char *moex_ep_info(ucp_ep_h ep);
void moex_ep_close(ucp_worker_h w, ucp_ep_h ep, int force, int spins);
uint64_t moex_mem_types(ucp_context_h ctx);
ucs_status_t moex_ep_flush(ucp_ep_h ep, void **req);
ucs_status_t moex_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh);
const char *moex_version(void);
void moex_set_iov(moex_op *op, int i, void *p, size_t len);
void *moex_devptr(uintptr_t p);
ucs_status_t moex_mem_alloc(ucp_context_h ctx, size_t len, ucp_mem_h *memh, void **addr, size_t *got);
ucs_status_t moex_rkey_pack(ucp_context_h ctx, ucp_mem_h memh, void **buf, size_t *len);
int moex_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey, ucp_mem_h memh, void **req, ucs_status_t *st);
int moex_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey, ucp_mem_h memh, void **req, ucs_status_t *st);
int moex_add64(ucp_ep_h ep, uint64_t *val, uint64_t raddr, ucp_rkey_h rkey, void **req, ucs_status_t *st);

#endif
