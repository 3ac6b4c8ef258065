#include "pool.h"

#include <assert.h>
#include <stdlib.h>

#include "dsv4-error.h"

/*
 * The free ids live on a stack; where[id] is the id's index in that stack (a marker while used),
 * so alloc pops, free pushes and is_used reads one word: every operation is O(1).
 */

static void publish(dsv4_pool_t *p) {
  __atomic_store_n(&p->published_free, p->n_free, __ATOMIC_RELAXED);
}

int dsv4_pool_init(dsv4_pool_t *p, uint32_t n_blocks) {
  p->n_blocks = 0;
  p->n_free = 0;
  p->free_stack = NULL;
  p->where = NULL;
  p->pins = NULL;
  p->n_deferred = 0;
  p->published_free = 0;
  /* Block ids travel as int32 in block tables and slots, so UINT32_MAX (the used marker) is never
   * an id. */
  if (n_blocks == 0 || n_blocks > (uint32_t)INT32_MAX)
    return DSV4_EINVAL;
  p->free_stack = malloc((size_t)n_blocks * sizeof(uint32_t));
  p->where = malloc((size_t)n_blocks * sizeof(uint32_t));
  p->pins = calloc(n_blocks, 1);
  if (p->free_stack == NULL || p->where == NULL || p->pins == NULL) {
    free(p->free_stack);
    free(p->where);
    free(p->pins);
    p->free_stack = NULL;
    p->where = NULL;
    p->pins = NULL;
    return DSV4_ENOMEM;
  }
  /* The lowest ids sit on top, so a fresh pool hands out 0, 1, 2, ... (easier to read in dumps). */
  for (uint32_t i = 0; i < n_blocks; i++) {
    p->free_stack[i] = n_blocks - 1 - i;
    p->where[n_blocks - 1 - i] = i;
  }
  p->n_blocks = n_blocks;
  p->n_free = n_blocks;
  publish(p);
  return 0;
}

void dsv4_pool_destroy(dsv4_pool_t *p) {
  free(p->free_stack);
  free(p->where);
  free(p->pins);
  p->free_stack = NULL;
  p->where = NULL;
  p->pins = NULL;
  p->n_deferred = 0;
  p->n_blocks = 0;
  p->n_free = 0;
  publish(p);
}

int dsv4_pool_alloc(dsv4_pool_t *p, uint32_t *id) {
  if (p->n_free == 0)
    return DSV4_ENOSPC;
  uint32_t b = p->free_stack[--p->n_free];
  p->where[b] = DSV4_POOL_USED;
  *id = b;
  publish(p);
  return 0;
}

static void push_free(dsv4_pool_t *p, uint32_t id) {
  p->where[id] = p->n_free;
  p->free_stack[p->n_free++] = id;
  publish(p);
}

void dsv4_pool_free(dsv4_pool_t *p, uint32_t id) {
  assert(id < p->n_blocks);
  assert(p->where[id] == DSV4_POOL_USED);
  if (p->pins[id] > 0) {
    /* A reader still needs these bytes: no allocation may hand the id out before the last unpin. */
    p->where[id] = DSV4_POOL_DEFERRED;
    p->n_deferred++;
    return;
  }
  push_free(p, id);
}

int dsv4_pool_pin(dsv4_pool_t *p, uint32_t id) {
  if (id >= p->n_blocks || p->where[id] != DSV4_POOL_USED)
    return DSV4_EINVAL;
  if (p->pins[id] == DSV4_POOL_MAX_PINS)
    return DSV4_ENOSPC;
  p->pins[id]++;
  return 0;
}

void dsv4_pool_unpin(dsv4_pool_t *p, uint32_t id) {
  assert(id < p->n_blocks && p->pins[id] > 0);
  if (--p->pins[id] == 0 && p->where[id] == DSV4_POOL_DEFERRED) {
    p->n_deferred--;
    push_free(p, id);
  }
}

int dsv4_pool_is_used(const dsv4_pool_t *p, uint32_t id) {
  return id < p->n_blocks && p->where[id] >= DSV4_POOL_DEFERRED;
}

uint32_t dsv4_pool_free_count(const dsv4_pool_t *p) {
  return p->n_free;
}

uint32_t dsv4_pool_free_count_relaxed(const dsv4_pool_t *p) {
  return __atomic_load_n(&p->published_free, __ATOMIC_RELAXED);
}
