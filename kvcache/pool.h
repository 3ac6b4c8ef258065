#ifndef DSV4_KVCACHE_POOL_H
#define DSV4_KVCACHE_POOL_H

/*
 * The block-id allocator: O(1) allocate and free over a fixed number of block ids. Block ids are
 * shared by every served layer (SPEC §3): block b is the same tokens in every layer's buffer.
 *
 * Thread affinity: the executor thread only. used/free counts are also published with relaxed
 * atomics so that the loop thread can read them for /metrics.
 */

#include <stdint.h>

typedef struct {
  uint32_t n_blocks;
  uint32_t n_free;
  uint32_t *free_stack;    /* free_stack[0..n_free-1] are the free ids */
  uint32_t *where;         /* position of each id in free_stack, or UINT32_MAX when used */
  uint32_t published_free; /* atomic mirror of n_free for other threads */
} dsv4_pool_t;

int dsv4_pool_init(dsv4_pool_t *p, uint32_t n_blocks);
void dsv4_pool_destroy(dsv4_pool_t *p);
/* Take one free id; DSV4_ENOSPC when none is left. */
int dsv4_pool_alloc(dsv4_pool_t *p, uint32_t *id);
/* Return a used id. Freeing a free or out-of-range id is a bug (asserted). */
void dsv4_pool_free(dsv4_pool_t *p, uint32_t id);
int dsv4_pool_is_used(const dsv4_pool_t *p, uint32_t id);
uint32_t dsv4_pool_free_count(const dsv4_pool_t *p);
/* Any thread: the last published free count. */
uint32_t dsv4_pool_free_count_relaxed(const dsv4_pool_t *p);

#endif /* DSV4_KVCACHE_POOL_H */
