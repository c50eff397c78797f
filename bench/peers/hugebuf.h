/* Buffers for the MPI peers of bench/peers: malloc'd, or on 2 MiB pages (a mapping 2 MiB
 * aligned, MADV_HUGEPAGE), as moex's obuf gives its buffers from 256 KiB, for the
 * comparisons on equal pages. */
#ifndef MOEX_HUGEBUF_H
#define MOEX_HUGEBUF_H

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)

/* buffer returns n bytes: malloc'd, or with huge a mapping of 2 MiB pages (NULL when
 * none can be made). */
static inline void *buffer(size_t n, int huge) {
    if (!huge) return malloc(n);
    size_t len = (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    char *raw = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    munmap(p + len, (size_t)(raw + len + HUGE_PAGE - p - len));
    madvise(p, len, MADV_HUGEPAGE);
    return p;
}

/* unbuffer frees a buffer of n bytes. */
static inline void unbuffer(void *p, size_t n, int huge) {
    if (!huge) {
        free(p);
        return;
    }
    if (p) munmap(p, (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
}

/* rebuffer replaces p, of old bytes, with a buffer of n bytes; what p held is not kept
 * (its callers write the new buffer whole). */
static inline void *rebuffer(void *p, size_t old, size_t n, int huge) {
    unbuffer(p, old, huge);
    return buffer(n, huge);
}

#endif
