//go:build ucx

#include "ucx.h"







void moex_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
	moex_ep_state *st = (moex_ep_state *)arg;
	st->status = status;
	__atomic_store_n(&st->failed, 1, __ATOMIC_RELEASE);
}

int moex_ep_failed(moex_ep_state *st) { return __atomic_load_n(&st->failed, __ATOMIC_ACQUIRE); }

ucs_status_t moex_init(ucp_context_h *ctx, ucp_worker_h *w, int wakeup) {
	ucp_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
	// RMA and 64-bit atomics for the one-sided windows (window.go): where a transport
	// lacks them UCX emulates them over active messages.
	p.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_AMO64 | (wakeup ? UCP_FEATURE_WAKEUP : 0);
	p.mt_workers_shared = 1;
	ucp_config_t *cfg;
	ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
	if (s != UCS_OK) return s;
	// A dead peer must fail pending operations quickly: probe connections every second
	// (UCX's default is much longer), unless the user chose.
	if (getenv("UCX_KEEPALIVE_INTERVAL") == NULL) ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1s");
	s = ucp_init(&p, cfg, ctx);
	ucp_config_release(cfg);
	if (s != UCS_OK) return s;
	ucp_worker_params_t wp;
	memset(&wp, 0, sizeof wp);
	wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	wp.thread_mode = UCS_THREAD_MODE_MULTI;
	s = ucp_worker_create(*ctx, &wp, w);
	if (s != UCS_OK) ucp_cleanup(*ctx);
	return s;
}

ucs_status_t moex_address(ucp_worker_h w, void **addr, size_t *len) {
	return ucp_worker_get_address(w, (ucp_address_t **)addr, len);
}

ucs_status_t moex_ep_create(ucp_worker_h w, void *addr, moex_ep_state *st, int peer_errors, ucp_ep_h *ep) {
	ucp_ep_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = (const ucp_address_t *)addr;
	p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
	p.err_handler.cb = moex_err_cb;
	p.err_handler.arg = st;
	if (!peer_errors) return ucp_ep_create(w, &p, ep);
	// Asking for peer-failure reports is a probe: shared-memory lanes cannot give
	// them and UCX logs that as an error before returning UNREACHABLE, which the
	// caller answers by connecting without. Keep the probe quiet.
	ucs_log_level_t saved = ucs_global_opts.log_component.log_level;
	if (saved < UCS_LOG_LEVEL_DEBUG) ucs_global_opts.log_component.log_level = UCS_LOG_LEVEL_FATAL;
	ucs_status_t s = ucp_ep_create(w, &p, ep);
	ucs_global_opts.log_component.log_level = saved;
	return s;
}

// kind: 0 completed at once, 1 request pending (in *req), 2 error (in *st).
int moex_ptr(ucs_status_ptr_t p, void **req, ucs_status_t *st) {
	if (p == NULL) return 0;
	if (UCS_PTR_IS_ERR(p)) { *st = UCS_PTR_STATUS(p); return 2; }
	*req = p;
	return 1;
}

int moex_send(ucp_ep_h ep, const void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	if (iov) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE; p.datatype = ucp_dt_make_iov(); }
	if (memtype >= 0) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE; p.memory_type = (ucs_memory_type_t)memtype; }
	if (memh != NULL) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH; p.memh = memh; }
	return moex_ptr(ucp_tag_send_nbx(ep, buf, count, tag, &p), req, st);
}

int moex_recv(ucp_worker_h w, void *buf, size_t count, int iov, uint64_t tag, int memtype, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL; // always a request: its test gives the length
	if (iov) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE; p.datatype = ucp_dt_make_iov(); }
	if (memtype >= 0) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE; p.memory_type = (ucs_memory_type_t)memtype; }
	if (memh != NULL) { p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH; p.memh = memh; }
	return moex_ptr(ucp_tag_recv_nbx(w, buf, count, tag, (ucp_tag_t)-1, &p), req, st);
}

ucs_status_t moex_recv_test(void *req, size_t *len) {
	ucp_tag_recv_info_t info;
	memset(&info, 0, sizeof info);
	ucs_status_t s = ucp_tag_recv_request_test(req, &info);
	*len = info.length;
	return s;
}

char *moex_ep_info(ucp_ep_h ep) {
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	if (f == NULL) return NULL;
	ucp_ep_print_info(ep, f);
	fclose(f);
	return buf;
}

void moex_ep_close(ucp_worker_h w, ucp_ep_h ep, int force, int spins) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
	p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
	ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
	if (r == NULL || UCS_PTR_IS_ERR(r)) return;
	for (int i = 0; i < spins && ucp_request_check_status(r) == UCS_INPROGRESS; i++) ucp_worker_progress(w);
	if (ucp_request_check_status(r) == UCS_INPROGRESS) {
		ucp_request_cancel(w, r);
		while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(w);
	}
	ucp_request_free(r);
}

uint64_t moex_mem_types(ucp_context_h ctx) {
	ucp_context_attr_t a;
	memset(&a, 0, sizeof a);
	a.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
	if (ucp_context_query(ctx, &a) != UCS_OK) return 1u << UCS_MEMORY_TYPE_HOST;
	return a.memory_types;
}

// moex_ep_flush starts a flush of ep: *req is the request to poll (NULL: done).
ucs_status_t moex_ep_flush(ucp_ep_h ep, void **req) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &p);
	*req = NULL;
	if (r == NULL) return UCS_OK;
	if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
	*req = r;
	return UCS_INPROGRESS;
}

ucs_status_t moex_mem_map(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
	p.address = addr;
	p.length = len;
	return ucp_mem_map(ctx, &p, memh);
}

const char *moex_version(void) { return ucp_get_version_string(); }

// The iov slots are set from C: Go code storing a (pinned) Go pointer into C memory would
// run the write barrier over the stale pointer the slot held from an earlier request.
void moex_set_iov(moex_op *op, int i, void *p, size_t len) { op->iov[i].buffer = p; op->iov[i].length = len; }

// A device address is not Go memory: it becomes a pointer on the C side.
void *moex_devptr(uintptr_t p) { return (void *)p; }

// moex_rkey_pack packs memh's remote key; the caller frees *buf with ucp_rkey_buffer_release.
ucs_status_t moex_rkey_pack(ucp_context_h ctx, ucp_mem_h memh, void **buf, size_t *len) {
	return ucp_rkey_pack(ctx, memh, buf, len);
}

static void rma_param(ucp_request_param_t *p, ucp_mem_h memh) {
	memset(p, 0, sizeof *p);
	if (memh != NULL) { p->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH; p->memh = memh; }
}

// moex_put writes len bytes of buf at raddr of the peer's memory behind rkey (kind as moex_ptr).
// Fast local completion lets UCX pick the protocols that are done with buf soonest:
// over shared memory a store straight into the peer's window, at any size, where a put
// past 32 KiB would otherwise be emulated with active messages (UCX 1.13).
int moex_put(ucp_ep_h ep, const void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	rma_param(&p, memh);
	p.op_attr_mask |= UCP_OP_ATTR_FLAG_FAST_CMPL;
	return moex_ptr(ucp_put_nbx(ep, buf, len, raddr, rkey, &p), req, st);
}

// moex_get reads len bytes at raddr of the peer's memory behind rkey into buf.
int moex_get(ucp_ep_h ep, void *buf, size_t len, uint64_t raddr, ucp_rkey_h rkey, ucp_mem_h memh, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	rma_param(&p, memh);
	return moex_ptr(ucp_get_nbx(ep, buf, len, raddr, rkey, &p), req, st);
}

// moex_add64 adds *val to the 64-bit word at raddr, atomically, with no reply: the
// signal a receiver polls in its own memory. *val must stay put until the request ends.
int moex_add64(ucp_ep_h ep, uint64_t *val, uint64_t raddr, ucp_rkey_h rkey, void **req, ucs_status_t *st) {
	ucp_request_param_t p;
	memset(&p, 0, sizeof p);
	p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
	p.datatype = ucp_dt_make_contig(8);
	return moex_ptr(ucp_atomic_op_nbx(ep, UCP_ATOMIC_OP_ADD, val, 1, raddr, rkey, &p), req, st);
}

// moex_mem_alloc has UCX allocate and register len bytes (UCP_MEM_MAP_ALLOCATE): memory
// of the kind its transports can reach directly (shared memory for posix and sysv).
ucs_status_t moex_mem_alloc(ucp_context_h ctx, size_t len, ucp_mem_h *memh, void **addr, size_t *got) {
	ucp_mem_map_params_t p;
	memset(&p, 0, sizeof p);
	p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
	p.address = NULL;
	p.length = len;
	p.flags = UCP_MEM_MAP_ALLOCATE;
	ucs_status_t s = ucp_mem_map(ctx, &p, memh);
	if (s != UCS_OK) return s;
	ucp_mem_attr_t a;
	memset(&a, 0, sizeof a);
	a.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
	s = ucp_mem_query(*memh, &a);
	if (s != UCS_OK) { ucp_mem_unmap(ctx, *memh); return s; }
	*addr = a.address;
	*got = a.length;
	return UCS_OK;
}
