#ifndef DSV4_TESTS_GPU_GPU_COMMON_H
#define DSV4_TESTS_GPU_GPU_COMMON_H

/*
 * Shared pieces of the GPU tests (tests/gpu): the device check that turns a machine without a CUDA
 * device into "skipped" (exit 77), checked CUDA calls, fast random inputs, and batch plans with
 * their block tables. Plain C on the CUDA runtime API; no cmocka, so a -DDSV4_SERVER=OFF tree on a
 * machine with only the CUDA toolkit builds and runs them.
 */

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda-kernels.h"
#include "gpu_check.h"
#include "dsv4-layout.h"
#include "rope.h"

#define CKD(call)                                                                                  \
  do {                                                                                             \
    int ckd_rc_ = (call);                                                                          \
    if (ckd_rc_ != 0) {                                                                            \
      fprintf(stderr, "%s:%d: %s: %s (%d)\n", __FILE__, __LINE__, #call, dsv4_strerror(ckd_rc_),   \
              ckd_rc_);                                                                            \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

static inline void *gpu_host_alloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

static inline void *gpu_dev_alloc(size_t n) {
  void *p = NULL;
  CK(cudaMalloc(&p, n ? n : 16));
  return p;
}

/* splitmix64: deterministic, so a failure reproduces. */
static inline uint64_t gpu_rnd(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline uint32_t gpu_below(uint64_t *s, uint32_t n) {
  return (uint32_t)(gpu_rnd(s) % n);
}

/* Distinct ids 0..n-1 (n >= 1) in a random order (Fisher-Yates), in host memory the caller frees.
 */
static inline uint32_t *gpu_perm(uint64_t *s, uint32_t n) {
  uint32_t *p = gpu_host_alloc(sizeof(uint32_t) * n);
  for (uint32_t i = 0; i < n; i++)
    p[i] = i;
  for (uint32_t i = n - 1; i > 0; i--) {
    uint32_t j = gpu_below(s, i + 1), x = p[i];
    p[i] = p[j];
    p[j] = x;
  }
  return p;
}

/*
 * bf16 values whose biased exponents spread over 2*spread+1 octaves around centre (clamped to
 * 0..185, so |x| < 2^59 as the daemon admits; exponent 0 gives subnormals), about 1 in 16 zero.
 * Four values per random draw: fast enough for the gigabyte inputs of the large cases.
 */
static inline void gpu_fill_bf16(uint64_t *s, uint16_t *v, size_t n, int centre, int spread) {
  for (size_t i = 0; i < n; i += 4) {
    uint64_t r = gpu_rnd(s);
    for (size_t k = 0; k < 4 && i + k < n; k++, r >>= 16) {
      uint16_t sign = (uint16_t)(r & 0x8000u);
      uint16_t man = (uint16_t)(r & 0x7fu);
      if (((r >> 7) & 15u) == 0) {
        v[i + k] = sign;
        continue;
      }
      int e = centre + (int)((r >> 11) % (uint64_t)(2 * spread + 1)) - spread;
      e = e < 0 ? 0 : e > 185 ? 185 : e;
      v[i + k] = (uint16_t)(sign | ((uint16_t)e << 7) | man);
    }
  }
}

/* ---- batch plans: segments of contiguous positions over block tables ---- */

typedef struct {
  uint32_t n, n_segs, bs, n_blocks, bt_len;
  int64_t *pos;          /* [n] */
  int32_t *tok_seg;      /* [n] */
  int64_t *seg_first_lb; /* [n_segs] */
  uint32_t *seg_bt_off, *seg_bt_len;
  int32_t *block_table; /* [bt_len] */
} gpu_plan_t;

/*
 * n tokens in n_segs segments (n_segs <= n), each starting at a random position so that its last
 * position is at most max_pos - 1 (one segment ends exactly there), over distinct physical blocks
 * out of n_blocks (returned: the blocks used plus spare ones, so that block ids are scattered).
 * About one table entry in no_block_in has no block (-1): the tokens there get slot -1.
 */
static inline void gpu_plan_make(uint64_t *s, gpu_plan_t *p, uint32_t n, uint32_t n_segs,
                                 uint32_t bs, int64_t max_pos, uint32_t no_block_in) {
  memset(p, 0, sizeof(*p));
  p->n = n;
  p->n_segs = n_segs;
  p->bs = bs;
  p->pos = gpu_host_alloc(sizeof(int64_t) * n);
  p->tok_seg = gpu_host_alloc(sizeof(int32_t) * n);
  p->seg_first_lb = gpu_host_alloc(sizeof(int64_t) * n_segs);
  p->seg_bt_off = gpu_host_alloc(sizeof(uint32_t) * n_segs);
  p->seg_bt_len = gpu_host_alloc(sizeof(uint32_t) * n_segs);
  /* Each segment's table covers its blocks; the sum is at most n / bs + 2 per segment. */
  size_t bt_cap = (size_t)n / bs + 2u * n_segs + 2u;
  p->block_table = gpu_host_alloc(sizeof(int32_t) * bt_cap);
  uint32_t t = 0, off = 0;
  for (uint32_t g = 0; g < n_segs; g++) {
    uint32_t len = g + 1 == n_segs ? n - t : (n - t) / (n_segs - g);
    if (len == 0)
      len = 1;
    int64_t start;
    if (g == 0)
      start = max_pos - len; /* the last position of the table */
    else
      start = (int64_t)(gpu_rnd(s) % (uint64_t)(max_pos - len + 1));
    int64_t lb0 = start / bs, lb1 = (start + len - 1) / bs;
    p->seg_first_lb[g] = lb0;
    p->seg_bt_off[g] = off;
    p->seg_bt_len[g] = (uint32_t)(lb1 - lb0 + 1);
    for (int64_t lb = lb0; lb <= lb1; lb++)
      p->block_table[off++] = 0; /* ids below */
    for (uint32_t k = 0; k < len; k++) {
      p->pos[t] = start + k;
      p->tok_seg[t] = (int32_t)g;
      t++;
    }
  }
  p->bt_len = off;
  /* Distinct block ids in a random order, with spare ids in between. */
  p->n_blocks = off + off / 2 + 2;
  uint32_t *perm = gpu_perm(s, p->n_blocks);
  for (uint32_t i = 0; i < off; i++)
    p->block_table[i] = no_block_in && gpu_below(s, no_block_in) == 0 ? -1 : (int32_t)perm[i];
  free(perm);
}

static inline void gpu_plan_free(gpu_plan_t *p) {
  free(p->pos);
  free(p->tok_seg);
  free(p->seg_first_lb);
  free(p->seg_bt_off);
  free(p->seg_bt_len);
  free(p->block_table);
}

/* A plan's arrays on the device. */
typedef struct {
  int64_t *pos;
  int32_t *tok_seg;
  int64_t *seg_first_lb;
  uint32_t *seg_bt_off, *seg_bt_len;
  int32_t *block_table;
  void *arena; /* gpu_plan_upload_packed: the one allocation holding them all */
  size_t arena_bytes;
} gpu_plan_dev_t;

#define GPU_PLAN_ARRAYS 6

/* The plan's metadata arrays, in the order gpu_plan_dev_set takes them: host copies and sizes. */
static inline void gpu_plan_arrays(const gpu_plan_t *p, const void *src[GPU_PLAN_ARRAYS],
                                   size_t sizes[GPU_PLAN_ARRAYS]) {
  const void *s[GPU_PLAN_ARRAYS] = {p->pos,        p->tok_seg,    p->seg_first_lb,
                                    p->seg_bt_off, p->seg_bt_len, p->block_table};
  const size_t n[GPU_PLAN_ARRAYS] = {sizeof(int64_t) * p->n,       sizeof(int32_t) * p->n,
                                     sizeof(int64_t) * p->n_segs,  sizeof(uint32_t) * p->n_segs,
                                     sizeof(uint32_t) * p->n_segs, sizeof(int32_t) * p->bt_len};
  memcpy(src, s, sizeof(s));
  memcpy(sizes, n, sizeof(n));
}

static inline void gpu_plan_dev_set(gpu_plan_dev_t *d, uint8_t *const a[GPU_PLAN_ARRAYS]) {
  d->pos = (int64_t *)a[0];
  d->tok_seg = (int32_t *)a[1];
  d->seg_first_lb = (int64_t *)a[2];
  d->seg_bt_off = (uint32_t *)a[3];
  d->seg_bt_len = (uint32_t *)a[4];
  d->block_table = (int32_t *)a[5];
}

/* Each array in an allocation of its own size (an empty one gets 1 byte). */
static inline void gpu_plan_upload(const gpu_plan_t *p, gpu_plan_dev_t *d) {
  const void *src[GPU_PLAN_ARRAYS];
  size_t sizes[GPU_PLAN_ARRAYS];
  uint8_t *a[GPU_PLAN_ARRAYS];
  gpu_plan_arrays(p, src, sizes);
  for (int i = 0; i < GPU_PLAN_ARRAYS; i++) {
    a[i] = gpu_dev_alloc(sizes[i] ? sizes[i] : 1);
    if (sizes[i])
      CK(cudaMemcpy(a[i], src[i], sizes[i], cudaMemcpyHostToDevice));
  }
  d->arena = NULL;
  d->arena_bytes = 0;
  gpu_plan_dev_set(d, a);
}

/*
 * The same arrays packed one after the other (16-byte aligned) in one device allocation, as an
 * engine stages a batch's metadata, for the benchmark. The tests keep gpu_plan_upload's separate
 * allocations, where compute-sanitizer sees a read past the end of any one array.
 */
static inline void gpu_plan_upload_packed(const gpu_plan_t *p, gpu_plan_dev_t *d) {
  const void *src[GPU_PLAN_ARRAYS];
  size_t sizes[GPU_PLAN_ARRAYS], off[GPU_PLAN_ARRAYS], total = 0;
  gpu_plan_arrays(p, src, sizes);
  for (int i = 0; i < GPU_PLAN_ARRAYS; i++) {
    off[i] = total;
    total += (sizes[i] + 15) & ~(size_t)15;
  }
  uint8_t *host = gpu_host_alloc(total ? total : 16), *base = gpu_dev_alloc(total ? total : 16);
  memset(host, 0, total);
  uint8_t *a[GPU_PLAN_ARRAYS];
  for (int i = 0; i < GPU_PLAN_ARRAYS; i++) {
    if (sizes[i])
      memcpy(host + off[i], src[i], sizes[i]);
    a[i] = base + off[i];
  }
  CK(cudaMemcpy(base, host, total, cudaMemcpyHostToDevice));
  free(host);
  d->arena = base;
  d->arena_bytes = total ? total : 16;
  gpu_plan_dev_set(d, a);
}

static inline void gpu_plan_dev_free(gpu_plan_dev_t *d) {
  if (d->arena) {
    cudaFree(d->arena);
    return;
  }
  cudaFree(d->pos);
  cudaFree(d->tok_seg);
  cudaFree(d->seg_first_lb);
  cudaFree(d->seg_bt_off);
  cudaFree(d->seg_bt_len);
  cudaFree(d->block_table);
}

/* The plan's map arguments over host (or, with the dev_* pointers, device) arrays. */
static inline dsv4_map_args_t gpu_plan_map_args(const gpu_plan_t *p, const int64_t *pos,
                                                const int32_t *tok_seg, const int64_t *first_lb,
                                                const uint32_t *bt_off, const uint32_t *bt_len,
                                                const int32_t *bt, int64_t *slots) {
  dsv4_map_args_t a = {
      .n_tokens = p->n,
      .n_segments = p->n_segs,
      .block_size = p->bs,
      .n_blocks = p->n_blocks,
      .positions = pos,
      .tok_seg = tok_seg,
      .seg_first_lb = first_lb,
      .seg_bt_off = bt_off,
      .seg_bt_len = bt_len,
      .block_table = bt,
      .slots = slots,
      .bt_entries = p->bt_len,
  };
  return a;
}

/*
 * A host RoPE table for params and its device mirror as cuda-kernels.h describes it: max_pos rows
 * of 64 floats, of which gpu_rope_upload copies the chunks holding a plan's positions.
 */
static inline dsv4_rope_table_t *gpu_rope_open(const dsv4_rope_params_t *params, int64_t max_pos,
                                               float **mirror) {
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *t = NULL;
  dsv4_rope_inv_freq(params, f);
  CKD(dsv4_rope_table_create(f, max_pos, &t));
  *mirror = gpu_dev_alloc((size_t)max_pos * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  return t;
}

static inline void gpu_rope_upload(dsv4_rope_table_t *t, float *mirror, int64_t max_pos,
                                   const int64_t *pos, uint32_t n) {
  CKD(dsv4_rope_table_ensure(t, pos, n));
  int64_t last_chunk = -1;
  for (uint32_t k = 0; k < n; k++) {
    int64_t c = pos[k] / DSV4_ROPE_CHUNK_ROWS;
    if (c == last_chunk)
      continue;
    last_chunk = c;
    int64_t first = c * DSV4_ROPE_CHUNK_ROWS;
    int64_t rows = max_pos - first < DSV4_ROPE_CHUNK_ROWS ? max_pos - first : DSV4_ROPE_CHUNK_ROWS;
    CK(cudaMemcpy(mirror + first * DSV4_ROPE_ROW_FLOATS, dsv4_rope_table_row(t, first),
                  (size_t)rows * DSV4_ROPE_ROW_FLOATS * sizeof(float), cudaMemcpyHostToDevice));
  }
}

/* The first index where two byte arrays differ, or -1. */
static inline long long gpu_first_diff(const void *a, const void *b, size_t n) {
  if (memcmp(a, b, n) == 0)
    return -1;
  const uint8_t *x = a, *y = b;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i])
      return (long long)i;
  return -1;
}

#endif /* DSV4_TESTS_GPU_GPU_COMMON_H */
