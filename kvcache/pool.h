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
  uint32_t *free_stack; /* free_stack[0..n_free-1] are the free ids */
  /* Position of each id in free_stack; DSV4_POOL_USED while used, DSV4_POOL_DEFERRED once freed
   * while pinned (still unavailable: it returns to the stack at its last unpin). */
  uint32_t *where;
  uint8_t *pins;           /* pin count of each id */
  uint32_t n_deferred;     /* ids freed while pinned, not yet back on the stack */
  uint32_t published_free; /* atomic mirror of n_free for other threads */
} dsv4_pool_t;

#define DSV4_POOL_USED UINT32_MAX
#define DSV4_POOL_DEFERRED (UINT32_MAX - 1)
/* Pins one id may carry at once. */
#define DSV4_POOL_MAX_PINS 255

int dsv4_pool_init(dsv4_pool_t *p, uint32_t n_blocks);
void dsv4_pool_destroy(dsv4_pool_t *p);
/* Take one free id; DSV4_ENOSPC when none is left. */
int dsv4_pool_alloc(dsv4_pool_t *p, uint32_t *id);
/* Return a used id. Freeing a free or out-of-range id is a bug (asserted). A pinned id is not
 * reusable until its last unpin: it stays out of the free stack (and counts as used) till then. */
void dsv4_pool_free(dsv4_pool_t *p, uint32_t id);
/*
 * Pin a used id so that its bytes stay as they are while a reader (an admin dump) holds it: a free
 * while pinned is deferred to the last unpin. DSV4_EINVAL for an id that is not used, DSV4_ENOSPC
 * past DSV4_POOL_MAX_PINS.
 */
int dsv4_pool_pin(dsv4_pool_t *p, uint32_t id);
void dsv4_pool_unpin(dsv4_pool_t *p, uint32_t id);
/* 1 for an id that is allocated or freed-but-pinned (either way, not available). */
int dsv4_pool_is_used(const dsv4_pool_t *p, uint32_t id);
uint32_t dsv4_pool_free_count(const dsv4_pool_t *p);
/* Any thread: the last published free count. */
uint32_t dsv4_pool_free_count_relaxed(const dsv4_pool_t *p);

#endif /* DSV4_KVCACHE_POOL_H */
