#ifndef DSV4_SERVER_PINNED_POOL_H
#define DSV4_SERVER_PINNED_POOL_H

/*
 * A bounded pool of host memory for request bodies and the tensors of answers: one arena mapped at
 * start-up, which the daemon registers once with a backend that copies faster from registered
 * (page-locked) memory, so that a device upload reads a body where the socket wrote it and a
 * download writes an answer where the socket sends it from. The pool itself knows nothing about
 * devices: it hands out 64-byte aligned blocks of its arena, first fit, and coalesces a freed block
 * with free neighbours so the arena does not fragment into pieces too small for the next body.
 *
 * When the arena has no room, callers fall back to the heap (dsv4_pinned_alloc): the pool is an
 * accelerator, never a limit.
 *
 * Thread affinity: any thread. One mutex guards the arena's bookkeeping; the blocks themselves
 * belong to whoever allocated them.
 */

#include <stddef.h>

typedef struct dsv4_pinned_pool dsv4_pinned_pool_t;

/* Every block starts on a multiple of this, and its size is rounded up to one. */
#define DSV4_PINNED_ALIGN 64

typedef struct {
  size_t total;        /* arena bytes */
  size_t used;         /* bytes of live blocks, each rounded up to DSV4_PINNED_ALIGN */
  size_t blocks;       /* live blocks */
  size_t free_extents; /* runs of free bytes (1 when nothing is allocated: coalescing works) */
  size_t largest_free; /* the largest block an allocation could get now */
} dsv4_pinned_stats_t;

/* Where the arena's pages lie, as the kernel reports them (dsv4_pinned_pool_placement). */
typedef struct {
  int first_node, last_node; /* NUMA nodes of the arena's first and last pages; -1 if unknown */
  size_t huge_bytes; /* bytes of the arena in transparent huge pages (smaps AnonHugePages) */
} dsv4_pinned_placement_t;

/*
 * An arena of at least `bytes` (rounded up to whole pages), on a transparent huge page boundary and
 * advised to use huge pages where the kernel has them (page-aligned and plain with
 * DSV4_POOL_NO_HUGEPAGE=1), mapped but not yet touched: 0, DSV4_EINVAL for 0 bytes, or
 * DSV4_ENOMEM when it cannot be mapped.
 */
int dsv4_pinned_pool_create(size_t bytes, dsv4_pinned_pool_t **out);
/* Unmap the arena. Every block must have been freed, and the arena unregistered, before. */
void dsv4_pinned_pool_destroy(dsv4_pinned_pool_t *p);
/* The arena (what the daemon registers with the backend) and its size in bytes. */
void *dsv4_pinned_pool_base(const dsv4_pinned_pool_t *p);
size_t dsv4_pinned_pool_bytes(const dsv4_pinned_pool_t *p);

/* A block of at least n bytes (n > 0), 64-byte aligned, or NULL when no free run is that large. */
void *dsv4_pinned_pool_alloc(dsv4_pinned_pool_t *p, size_t n);
/*
 * Give back a block: 0; DSV4_ENOTFOUND when ptr lies outside the arena (it is not the pool's: free
 * it elsewhere); DSV4_EINVAL when it lies inside but is not the start of a live block (a double
 * free or a stray pointer: nothing changes).
 */
int dsv4_pinned_pool_free(dsv4_pinned_pool_t *p, void *ptr);
/* 1 when ptr lies inside the arena. */
int dsv4_pinned_pool_owns(const dsv4_pinned_pool_t *p, const void *ptr);
void dsv4_pinned_pool_stats(dsv4_pinned_pool_t *p, dsv4_pinned_stats_t *out);
/* Where the arena's pages lie; call once they are committed (after registration), for the log. */
void dsv4_pinned_pool_placement(const dsv4_pinned_pool_t *p, dsv4_pinned_placement_t *out);

/*
 * n bytes (n rounded up to 64, at least 64), 64-byte aligned: from the pool when p is not NULL and
 * has room, else from the heap (aligned_alloc). *fell_back is set to 1 when the pool was asked and
 * had no room, else 0 (a NULL pool is no fallback: the pool is off). NULL only when the heap fails.
 */
void *dsv4_pinned_alloc(dsv4_pinned_pool_t *p, size_t n, int *fell_back);
/* Free a block from dsv4_pinned_alloc, or any heap pointer, to where it came from. NULL is a no-op.
 */
void dsv4_pinned_free(dsv4_pinned_pool_t *p, void *ptr);

#endif /* DSV4_SERVER_PINNED_POOL_H */
