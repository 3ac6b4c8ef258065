/*
 * Exact-mode attention on the CPU (SPEC §7), the reference every backend matches byte for byte.
 *
 * A work item is a group of heads of one token. Its window (the candidates max(p0, p - 127)..p) is
 * dequantised once into the participant's workspace, then each head runs the SPEC's steps in the
 * SPEC's order: canonical dot products, one scale product, the max, dsv4_expf weights, the sums
 * S and D, the fma chains of N, o = N / D, the inverse rotation at p, one bf16 rounding. Vector
 * levels (cpu_attention_avx2.c, cpu_attention_avx512.c) perform the same operations on several
 * independent chains at once and store the same bytes.
 *
 * Every argument, every candidate's block and every query's RoPE row is checked before the first
 * byte is written, so a launch that fails leaves its outputs untouched and never reads a block
 * that is not in the table.
 */
#include "cpu-internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-numerics.h"

#if defined(__x86_64__)
#define HAVE_VECTOR_LEVELS 1
#endif

/* As in cpu_kernels.c: the scalar level cloned for x86-64-v3, where fmaf is one instruction
 * (flatten, where the compiler allows it with clones: the shared routines are inlined into the
 * clone rather than called in their default build). The bytes are the same either way. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones) && !defined(__SANITIZE_ADDRESS__) &&                            \
    !defined(__SANITIZE_THREAD__)
#if defined(__clang__) /* clang does not combine flatten with target_clones */
#define SCALAR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SCALAR_CLONES __attribute__((flatten, target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#endif
#ifndef SCALAR_CLONES
#define SCALAR_CLONES
#endif

/* The fewest heads in a work item when a batch's tokens are split by heads (see the launch). */
#define ATTN_MIN_GROUP 16

struct dsv4__cpu_attn_scratch {
  unsigned n;
  atomic_int *busy;
  float **work;
};

/* The 512 fp32 values of one record (SPEC §3, §7): e4m3 * 2^(code - 127) and the bf16 RoPE
 * values, all exact. */
static void dequant_record(const uint8_t *data, const uint8_t *scales, float *k) {
  for (int j = 0; j < DSV4_NTILES; j++) {
    float sc = dsv4_ue8m0_scale(scales[j]);
    for (int i = 0; i < DSV4_TILE; i++)
      k[DSV4_TILE * j + i] = dsv4_e4m3_to_f32(data[DSV4_TILE * j + i]) * sc;
  }
  for (int d = 0; d < DSV4_ROPE_DIM; d++) {
    const uint8_t *b = data + DSV4_NOPE_DIM + 2 * d;
    k[DSV4_NOPE_DIM + d] = dsv4_bf16_to_f32((uint16_t)(b[0] | (b[1] << 8)));
  }
}

/* One head over the dequantised window k[nc][512]; l and n are workspaces of 128 and 512 floats. */
static void attn_head_scalar(const dsv4__cpu_attn_item_t *it, uint32_t h, const float *k, float *l,
                             float *n) {
  const uint32_t nc = it->nc;
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  float q[DSV4_HEAD_DIM];
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    q[d] = dsv4_bf16_to_f32(it->q[(size_t)h * DSV4_HEAD_DIM + d]);
  for (uint32_t s = 0; s < nc; s++)
    l[s] = dsv4_dot512(q, k + (size_t)s * DSV4_HEAD_DIM) * scale;
  float m = l[0];
  for (uint32_t s = 1; s < nc; s++)
    m = l[s] > m ? l[s] : m;
  /* l becomes the weights; S is their sum in order from +0, D adds the sink last. */
  float sum = 0.0f;
  for (uint32_t s = 0; s < nc; s++) {
    l[s] = dsv4_expf(l[s] - m);
    sum = sum + l[s];
  }
  float den = sum;
  if (it->sink)
    den = den + dsv4_expf(it->sink[h] - m);
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    n[d] = 0.0f;
  for (uint32_t s = 0; s < nc; s++) {
    const float *ks = k + (size_t)s * DSV4_HEAD_DIM;
    for (int d = 0; d < DSV4_HEAD_DIM; d++)
      n[d] = fmaf(l[s], ks[d], n[d]);
  }
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    n[d] = n[d] / den;
  uint16_t *out = it->out + (size_t)h * DSV4_HEAD_DIM;
  for (int d = 0; d < DSV4_NOPE_DIM; d++)
    out[d] = dsv4_f32_to_bf16(n[d]);
  const float *cs = it->rope_row;
  for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
    float e = n[DSV4_NOPE_DIM + 2 * i], o = n[DSV4_NOPE_DIM + 2 * i + 1];
    float c = cs[i], sn = cs[DSV4_ROPE_PAIRS + i];
    out[DSV4_NOPE_DIM + 2 * i] = dsv4_f32_to_bf16(dsv4_rope_inv_even(e, o, c, sn));
    out[DSV4_NOPE_DIM + 2 * i + 1] = dsv4_f32_to_bf16(dsv4_rope_inv_odd(e, o, c, sn));
  }
  if (it->lse)
    it->lse[h] = m + dsv4_logf(sum);
}

SCALAR_CLONES static void attn_item_scalar(const dsv4__cpu_attn_item_t *it) {
  float *k = it->work;
  for (uint32_t s = 0; s < it->nc; s++)
    dequant_record(it->data[s], it->scales[s], k + (size_t)s * DSV4_HEAD_DIM);
  float *l = k + (size_t)DSV4_WINDOW * DSV4_HEAD_DIM;
  float *n = l + DSV4_HEAD_DIM;
  for (uint32_t h = 0; h < it->nh; h++)
    attn_head_scalar(it, h, k, l, n);
}

void dsv4__cpu_attn_item(int isa, const dsv4__cpu_attn_item_t *it) {
#ifdef HAVE_VECTOR_LEVELS
  if (isa == DSV4__CPU_ISA_AVX512) {
    dsv4__cpu_attn_item_avx512(it);
    return;
  }
  if (isa == DSV4__CPU_ISA_AVX2) {
    dsv4__cpu_attn_item_avx2(it);
    return;
  }
#endif
  (void)isa;
  attn_item_scalar(it);
}

/* ---- the launch ---- */

void dsv4__cpu_attn_scratch_free(dsv4__cpu_attn_scratch_t *s) {
  if (!s)
    return;
  for (unsigned i = 0; i < s->n; i++)
    free(s->work[i]);
  free(s->work);
  free(s->busy);
  free(s);
}

static int scratch_create(unsigned n, dsv4__cpu_attn_scratch_t **out) {
  dsv4__cpu_attn_scratch_t *s = calloc(1, sizeof(*s));
  if (!s)
    return DSV4_ENOMEM;
  s->busy = calloc(n, sizeof(*s->busy));
  s->work = calloc(n, sizeof(*s->work));
  if (!s->busy || !s->work) {
    dsv4__cpu_attn_scratch_free(s);
    return DSV4_ENOMEM;
  }
  for (; s->n < n; s->n++) {
    atomic_init(&s->busy[s->n], 0);
    s->work[s->n] = aligned_alloc(64, DSV4__CPU_ATTN_WORK_FLOATS * sizeof(float));
    if (!s->work[s->n]) {
      dsv4__cpu_attn_scratch_free(s);
      return DSV4_ENOMEM;
    }
  }
  *out = s;
  return 0;
}

/* At most one call of the job per participant runs at a time, so a free workspace always exists. */
static unsigned scratch_claim(dsv4__cpu_attn_scratch_t *s) {
  for (;;)
    for (unsigned i = 0; i < s->n; i++)
      if (atomic_exchange_explicit(&s->busy[i], 1, memory_order_acquire) == 0)
        return i;
}

static void scratch_release(dsv4__cpu_attn_scratch_t *s, unsigned i) {
  atomic_store_explicit(&s->busy[i], 0, memory_order_release);
}

typedef struct {
  const dsv4_attn_args_t *a;
  int isa;
  uint32_t groups;          /* work items per token */
  uint32_t heads_per_group; /* the last group of a token may hold fewer */
  dsv4__cpu_attn_scratch_t *scratch;
} attn_job_t;

/* The item's candidates: positions max(p0, p - 127)..p through the segment's block table. */
static void item_window(const dsv4_attn_args_t *a, uint32_t t, dsv4__cpu_attn_item_t *it) {
  uint32_t s = (uint32_t)a->tok_seg[t];
  int64_t p = a->positions[t], bs = a->block_size;
  int64_t lo = p - (DSV4_WINDOW - 1) > a->seg_p0[s] ? p - (DSV4_WINDOW - 1) : a->seg_p0[s];
  it->nc = (uint32_t)(p - lo + 1);
  for (uint32_t i = 0; i < it->nc; i++) {
    int64_t pos = lo + i;
    int64_t idx = pos / bs - a->seg_first_lb[s];
    int32_t b = a->block_table[(uint64_t)a->seg_bt_off[s] + (uint64_t)idx];
    const uint8_t *base = a->cache + (uint64_t)b * a->stride;
    it->data[i] = base + DSV4_TOKEN_DATA_OFFSET(pos % bs);
    it->scales[i] = base + DSV4_SCALE_OFFSET(bs, pos % bs);
  }
}

static void attn_items(void *varg, size_t first, size_t last) {
  const attn_job_t *j = varg;
  const dsv4_attn_args_t *a = j->a;
  unsigned slot = scratch_claim(j->scratch);
  dsv4__cpu_attn_item_t it;
  it.work = j->scratch->work[slot];
  size_t prev_t = SIZE_MAX;
  for (size_t item = first; item < last; item++) {
    size_t t = item / j->groups;
    uint32_t h0 = (uint32_t)(item % j->groups) * j->heads_per_group;
    if (t != prev_t) {
      item_window(a, (uint32_t)t, &it);
      it.rope_row = dsv4_rope_table_row(a->rope, a->positions[t]);
      prev_t = t;
    }
    it.nh = a->heads - h0 < j->heads_per_group ? a->heads - h0 : j->heads_per_group;
    size_t row = t * a->heads + h0;
    it.q = a->q + row * DSV4_HEAD_DIM;
    it.out = a->out + row * DSV4_HEAD_DIM;
    it.lse = a->lse ? a->lse + row : NULL;
    it.sink = a->sink ? a->sink + h0 : NULL;
    dsv4__cpu_attn_item(j->isa, &it);
  }
  scratch_release(j->scratch, slot);
}

/* Everything the launch will read, checked before anything is written (backend.h). */
static int attn_validate(const dsv4_attn_args_t *a) {
  const int64_t bs = a->block_size;
  const int64_t rope_rows = dsv4_rope_table_positions(a->rope);
  for (uint32_t s = 0; s < a->n_segments; s++) {
    if (a->seg_p0[s] < 0 ||
        (a->bt_entries && (uint64_t)a->seg_bt_off[s] + a->seg_bt_len[s] > a->bt_entries))
      return DSV4_EINVAL;
  }
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int32_t s = a->tok_seg[t];
    if (s < 0 || (uint32_t)s >= a->n_segments)
      return DSV4_EINVAL;
    int64_t p = a->positions[t], p0 = a->seg_p0[s];
    if (p < p0 || p >= rope_rows || !dsv4_rope_table_chunk(a->rope, p / DSV4_ROPE_CHUNK_ROWS, NULL))
      return DSV4_EINVAL;
    int64_t lo = p - (DSV4_WINDOW - 1) > p0 ? p - (DSV4_WINDOW - 1) : p0;
    for (int64_t lb = lo / bs; lb <= p / bs; lb++) {
      int64_t idx = lb - a->seg_first_lb[s];
      if (idx < 0 || idx >= (int64_t)a->seg_bt_len[s])
        return DSV4_EINVAL;
      int32_t b = a->block_table[(uint64_t)a->seg_bt_off[s] + (uint64_t)idx];
      if (b < 0 || (uint32_t)b >= a->n_blocks)
        return DSV4_EINVAL;
    }
  }
  return 0;
}

int dsv4__cpu_attention(dsv4_host_pool_t *pool, int isa, dsv4__cpu_attn_scratch_t **scratch,
                        const dsv4_attn_args_t *a) {
  int rc = dsv4_backend_check_attn_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  rc = attn_validate(a);
  if (rc)
    return rc;
  unsigned threads = dsv4_host_pool_threads(pool);
  if (!*scratch) {
    rc = scratch_create(threads, scratch);
    if (rc)
      return rc;
  }
  /*
   * Work items: a token, or a group of its heads when there are too few tokens to keep every
   * participant busy. The window is dequantised once per item (about the cost of four heads), so
   * a group keeps at least ATTN_MIN_GROUP heads. The split only changes which thread computes a
   * value, never the value.
   */
  attn_job_t j = {.a = a, .isa = isa, .scratch = *scratch};
  uint32_t groups = 1;
  if (threads > 1 && a->n_tokens < 2u * threads) {
    groups = (2u * threads + a->n_tokens - 1) / a->n_tokens;
    uint32_t most = (a->heads + ATTN_MIN_GROUP - 1) / ATTN_MIN_GROUP;
    if (groups > most)
      groups = most;
  }
  j.heads_per_group = (a->heads + groups - 1) / groups;
  j.groups = (a->heads + j.heads_per_group - 1) / j.heads_per_group;
  size_t items = (size_t)a->n_tokens * j.groups;
  size_t chunk = items / ((size_t)threads * 8);
  dsv4_host_pool_run(pool, attn_items, &j, items, chunk ? chunk : 1);
  return 0;
}
