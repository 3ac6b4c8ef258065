#ifndef DSV4_TESTS_GPU_GPU_SELECT_MODEL_H
#define DSV4_TESTS_GPU_GPU_SELECT_MODEL_H

/*
 * The indexer's selection by a plain sort, for the GPU tests of the select kernel (SPEC §8.5): of
 * n > topk keys, the topk largest under (key descending, entry ascending), listed in increasing
 * entry. And keys as a token's scores give them: dsv4_index_score_key of a hump of finite floats.
 */

#include <stdint.h>
#include <stdlib.h>

#include "dsv4-compress.h"
#include "gpu_common.h"

/* A sum of three uniforms: a hump, as a token's scores over its entries are. */
static inline float gpu_select_score(uint64_t *rng, float scale) {
  float u = 0.0f;
  for (int i = 0; i < 3; i++)
    u += (float)gpu_below(rng, 1u << 20) * 0x1p-20f;
  return (u - 1.2f) * scale;
}

static const uint32_t *gpu_select_sort_keys;

static inline int gpu_select_by_key(const void *a, const void *b) {
  const uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
  const uint32_t *k = gpu_select_sort_keys;
  if (k[i] != k[j])
    return k[i] > k[j] ? -1 : 1;
  return i < j ? -1 : i > j;
}

static inline int gpu_select_by_entry(const void *a, const void *b) {
  const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
  return (i > j) - (i < j);
}

/* The selection of the n > topk keys k as entries 0.. into list[0..topk); returns the topk-th
 * largest key, T. */
static inline uint32_t gpu_select_ref(const uint32_t *k, uint32_t n, uint32_t topk, int32_t *list) {
  uint32_t *idx = gpu_host_alloc(sizeof(uint32_t) * n);
  for (uint32_t i = 0; i < n; i++)
    idx[i] = i;
  gpu_select_sort_keys = k;
  qsort(idx, n, sizeof(uint32_t), gpu_select_by_key);
  const uint32_t T = k[idx[topk - 1]];
  for (uint32_t i = 0; i < topk; i++)
    list[i] = (int32_t)idx[i];
  qsort(list, topk, sizeof(int32_t), gpu_select_by_entry);
  free(idx);
  return T;
}

#endif /* DSV4_TESTS_GPU_GPU_SELECT_MODEL_H */
