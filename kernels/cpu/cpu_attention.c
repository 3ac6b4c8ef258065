/*
 * Exact-mode attention on the CPU (SPEC §7 and §8.6), the reference every backend matches byte for
 * byte.
 *
 * A work item is a group of heads of one token. Its candidate list is the window (positions
 * max(p0, p - 127)..p) and, on a compressed layer, then its compressed entries: up to 8192 at
 * ratio 128, index_topk at ratio 4. The list passes through the participant's workspace in tiles
 * of DSV4__CPU_ATTN_TILE dequantised records, twice: once for the logits of every head (kept for
 * the whole list: 4 bytes per candidate and head), once for the fma chains of N, which continue
 * from tile to tile. Between the passes each head takes the max, the dsv4_expf weights and the sums
 * S and D over the whole list; then o = N / D, the inverse rotation at p and one bf16 rounding. The
 * order of every operation is the SPEC's, whatever the tiling: a window-only list is one tile and
 * gives the bytes it always gave. Vector levels (cpu_attention_avx2.c, cpu_attention_avx512.c)
 * perform the same operations on several independent chains at once and store the same bytes.
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

/* The most logit floats an item's heads keep (1 MiB): a long list gets smaller head groups. */
#define ATTN_LOGIT_FLOATS (256u * 1024u)

struct dsv4__cpu_attn_scratch {
  unsigned n;
  size_t floats; /* the size of each workspace */
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

/* ---- the candidate list ---- */

void dsv4__cpu_attn_records(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count,
                            const uint8_t **data, const uint8_t **scales) {
  const dsv4_attn_args_t *a = it->a;
  const uint32_t s = it->seg;
  const int64_t bs = a->block_size;
  for (uint32_t i = 0; i < count; i++) {
    uint32_t c = first + i;
    const uint8_t *base;
    int64_t off;
    if (c < it->nw) {
      int64_t pos = it->lo + c;
      int64_t idx = pos / bs - a->seg_first_lb[s];
      int32_t b = a->block_table[(uint64_t)a->seg_bt_off[s] + (uint64_t)idx];
      base = a->cache + (uint64_t)b * a->stride;
      off = pos % bs;
    } else {
      int64_t j = it->sel ? it->sel[c - it->nw] : it->j_lo + (c - it->nw);
      int64_t idx = j / bs - a->seg_c_first_lb[s];
      int32_t b = a->c_block_table[(uint64_t)a->seg_cbt_off[s] + (uint64_t)idx];
      base = a->c_cache + (uint64_t)b * a->stride;
      off = j % bs;
    }
    data[i] = base + DSV4_TOKEN_DATA_OFFSET(off);
    scales[i] = base + DSV4_SCALE_OFFSET(bs, off);
  }
}

/* ---- the scalar level ---- */

/* Candidates first..first + count - 1 dequantised into it->tile[count][512]. */
static void tile_load(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  const uint8_t *data[DSV4__CPU_ATTN_TILE], *scales[DSV4__CPU_ATTN_TILE];
  dsv4__cpu_attn_records(it, first, count, data, scales);
  for (uint32_t s = 0; s < count; s++)
    dequant_record(data[s], scales[s], it->tile + (size_t)s * DSV4_HEAD_DIM);
}

/* The logits of every head for the tile's candidates, into l[h * l_stride + first + s]. */
static void tile_logits(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  const float scale = dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
  for (uint32_t h = 0; h < it->nh; h++) {
    const float *q = it->qf + (size_t)h * DSV4_HEAD_DIM;
    float *l = it->l + (size_t)h * it->l_stride + first;
    for (uint32_t s = 0; s < count; s++)
      l[s] = dsv4_dot512(q, it->tile + (size_t)s * DSV4_HEAD_DIM) * scale;
  }
}

/* The max m of head h's logits over the whole list, the weights in their place, and their sum S
 * in list order from +0. */
static void head_weights(const dsv4__cpu_attn_item_t *it, uint32_t h, float *m_out,
                         float *sum_out) {
  float *l = it->l + (size_t)h * it->l_stride;
  const uint32_t nc = it->nc;
  float m = l[0];
  for (uint32_t s = 1; s < nc; s++)
    m = l[s] > m ? l[s] : m;
  float sum = 0.0f;
  for (uint32_t s = 0; s < nc; s++) {
    l[s] = dsv4_expf(l[s] - m);
    sum = sum + l[s];
  }
  *m_out = m;
  *sum_out = sum;
}

/* Every head's chains N continued over the tile's candidates, in list order. */
static void tile_accumulate(const dsv4__cpu_attn_item_t *it, uint32_t first, uint32_t count) {
  for (uint32_t h = 0; h < it->nh; h++) {
    const float *w = it->l + (size_t)h * it->l_stride + first;
    float *n = it->n + (size_t)h * DSV4_HEAD_DIM;
    for (uint32_t s = 0; s < count; s++) {
      const float *ks = it->tile + (size_t)s * DSV4_HEAD_DIM;
      for (int d = 0; d < DSV4_HEAD_DIM; d++)
        n[d] = fmaf(w[s], ks[d], n[d]);
    }
  }
}

/* o = N / D with the sink in D only, the inverse rotation at p, one bf16 rounding; lse. */
static void head_finish(const dsv4__cpu_attn_item_t *it, uint32_t h, float m, float sum) {
  float *n = it->n + (size_t)h * DSV4_HEAD_DIM;
  float den = sum;
  if (it->sink)
    den = den + dsv4_expf(it->sink[h] - m);
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

/* Candidates of the tile that starts at first. */
static uint32_t tile_count(const dsv4__cpu_attn_item_t *it, uint32_t first) {
  return it->nc - first < DSV4__CPU_ATTN_TILE ? it->nc - first : DSV4__CPU_ATTN_TILE;
}

SCALAR_CLONES static void attn_item_scalar(const dsv4__cpu_attn_item_t *it) {
  const uint32_t tiles = (it->nc + DSV4__CPU_ATTN_TILE - 1) / DSV4__CPU_ATTN_TILE;
  for (size_t i = 0; i < (size_t)it->nh * DSV4_HEAD_DIM; i++)
    it->qf[i] = dsv4_bf16_to_f32(it->q[i]);
  /* The logits tile by tile from the last, so that the first tile is still in the workspace when
   * the chains N begin. */
  for (uint32_t k = tiles; k-- > 0;) {
    uint32_t first = k * DSV4__CPU_ATTN_TILE;
    tile_load(it, first, tile_count(it, first));
    tile_logits(it, first, tile_count(it, first));
  }
  float m[DSV4_MAX_HEADS], sum[DSV4_MAX_HEADS];
  for (uint32_t h = 0; h < it->nh; h++)
    head_weights(it, h, &m[h], &sum[h]);
  for (size_t i = 0; i < (size_t)it->nh * DSV4_HEAD_DIM; i++)
    it->n[i] = 0.0f;
  for (uint32_t k = 0; k < tiles; k++) {
    uint32_t first = k * DSV4__CPU_ATTN_TILE;
    if (k)
      tile_load(it, first, tile_count(it, first));
    tile_accumulate(it, first, tile_count(it, first));
  }
  for (uint32_t h = 0; h < it->nh; h++)
    head_finish(it, h, m[h], sum[h]);
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
  for (; s->n < n; s->n++)
    atomic_init(&s->busy[s->n], 0);
  *out = s;
  return 0;
}

/* Every workspace holds at least floats (a multiple of 16); a larger one is kept. On failure no
 * workspace is left, and the next launch allocates them again. */
static int scratch_reserve(dsv4__cpu_attn_scratch_t *s, size_t floats) {
  if (floats <= s->floats)
    return 0;
  for (unsigned i = 0; i < s->n; i++) {
    free(s->work[i]);
    s->work[i] = NULL;
  }
  s->floats = 0;
  for (unsigned i = 0; i < s->n; i++) {
    /* aligned_alloc takes a multiple of the alignment (C11 7.22.3.1). */
    s->work[i] = aligned_alloc(64, (floats * sizeof(float) + 63) & ~(size_t)63);
    if (!s->work[i]) {
      for (unsigned k = 0; k < i; k++) {
        free(s->work[k]);
        s->work[k] = NULL;
      }
      return DSV4_ENOMEM;
    }
  }
  s->floats = floats;
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
  uint32_t l_stride;        /* floats per head of the logits: the longest list, rounded up */
  dsv4__cpu_attn_scratch_t *scratch;
} attn_job_t;

/* The compressed entries token t sees (SPEC §8.4): with c_sel, the listed ones, which end at the
 * first -1 or after c_sel_stride; else floor(p0 / ratio) <= j < floor((p + 1) / ratio). *j_lo is
 * the first visible entry either way, *j_hi one past the last. */
static int64_t entry_count(const dsv4_attn_args_t *a, uint32_t t, int64_t *j_lo, int64_t *j_hi) {
  const int64_t r = a->ratio;
  *j_lo = a->seg_p0[a->tok_seg[t]] / r;
  *j_hi = (a->positions[t] + 1) / r;
  if (!a->c_sel)
    return *j_hi > *j_lo ? *j_hi - *j_lo : 0;
  const int32_t *row = a->c_sel + (size_t)t * a->c_sel_stride;
  uint32_t k = 0;
  while (k < a->c_sel_stride && row[k] != -1)
    k++;
  return k;
}

/* The item's candidate list: positions max(p0, p - 127)..p, then the compressed entries. */
static void item_list(const dsv4_attn_args_t *a, uint32_t t, dsv4__cpu_attn_item_t *it) {
  it->a = a;
  it->seg = (uint32_t)a->tok_seg[t];
  int64_t p = a->positions[t];
  it->lo = DSV4_WINDOW_LO(p, a->seg_p0[it->seg]);
  it->nw = (uint32_t)(p - it->lo + 1);
  it->nc = it->nw;
  it->sel = NULL;
  it->j_lo = 0;
  if (a->c_cache) {
    int64_t j_hi;
    it->nc += (uint32_t)entry_count(a, t, &it->j_lo, &j_hi);
    it->sel = a->c_sel ? a->c_sel + (size_t)t * a->c_sel_stride : NULL;
  }
}

/* The workspace's parts for an item of nh heads (DSV4__CPU_ATTN_WORK_FLOATS). */
static void item_work(float *work, uint32_t nh, uint32_t l_stride, dsv4__cpu_attn_item_t *it) {
  const size_t h4 = DSV4__CPU_ATTN_HEADS4(nh);
  it->tile = work;
  it->qf = it->tile + (size_t)DSV4__CPU_ATTN_TILE * DSV4_HEAD_DIM;
  it->n = it->qf + h4 * DSV4_HEAD_DIM;
  it->l = it->n + h4 * DSV4_HEAD_DIM;
  it->l_stride = l_stride;
}

static void attn_items(void *varg, size_t first, size_t last) {
  const attn_job_t *j = varg;
  const dsv4_attn_args_t *a = j->a;
  unsigned slot = scratch_claim(j->scratch);
  dsv4__cpu_attn_item_t it;
  size_t prev_t = SIZE_MAX;
  for (size_t item = first; item < last; item++) {
    size_t t = item / j->groups;
    uint32_t h0 = (uint32_t)(item % j->groups) * j->heads_per_group;
    if (t != prev_t) {
      item_list(a, (uint32_t)t, &it);
      it.rope_row = dsv4_rope_table_row(a->rope, a->positions[t]);
      prev_t = t;
    }
    it.nh = a->heads - h0 < j->heads_per_group ? a->heads - h0 : j->heads_per_group;
    item_work(j->scratch->work[slot], it.nh, j->l_stride, &it);
    size_t row = t * a->heads + h0;
    it.q = a->q + row * DSV4_HEAD_DIM;
    it.out = a->out + row * DSV4_HEAD_DIM;
    it.lse = a->lse ? a->lse + row : NULL;
    it.sink = a->sink ? a->sink + h0 : NULL;
    dsv4__cpu_attn_item(j->isa, &it);
  }
  scratch_release(j->scratch, slot);
}

/* Whether logical block lb of segment s maps through its table (SWA or compressed) to a block of
 * the pool. */
static int block_ok(const int64_t *first_lb, const uint32_t *bt_off, const uint32_t *bt_len,
                    const int32_t *table, uint32_t n_blocks, uint32_t s, int64_t lb) {
  int64_t idx = lb - first_lb[s];
  if (idx < 0 || idx >= (int64_t)bt_len[s])
    return 0;
  int32_t b = table[(uint64_t)bt_off[s] + (uint64_t)idx];
  return b >= 0 && (uint32_t)b < n_blocks;
}

static int c_block_ok(const dsv4_attn_args_t *a, uint32_t s, int64_t j) {
  return block_ok(a->seg_c_first_lb, a->seg_cbt_off, a->seg_cbt_len, a->c_block_table,
                  a->c_n_blocks, s, j / (int64_t)a->block_size);
}

/* Token t's compressed entries: each visible (and, listed, increasing) with its block in the
 * segment's table; *count receives how many there are. */
static int validate_entries(const dsv4_attn_args_t *a, uint32_t t, int64_t *count) {
  const uint32_t s = (uint32_t)a->tok_seg[t];
  const int64_t bs = a->block_size;
  int64_t j_lo, j_hi;
  *count = entry_count(a, t, &j_lo, &j_hi);
  if (!a->c_sel) {
    for (int64_t lb = j_lo / bs; *count && lb <= (j_hi - 1) / bs; lb++)
      if (!c_block_ok(a, s, lb * bs))
        return DSV4_EINVAL;
    return 0;
  }
  const int32_t *row = a->c_sel + (size_t)t * a->c_sel_stride;
  for (int64_t k = 0; k < *count; k++) {
    int64_t j = row[k];
    if (j < j_lo || j >= j_hi || (k && j <= row[k - 1]))
      return DSV4_EINVAL;
    if ((!k || j / bs != row[k - 1] / bs) && !c_block_ok(a, s, j))
      return DSV4_EINVAL;
  }
  return 0;
}

/* Token t: its segment, its position (and the RoPE row there), its window's blocks and its
 * compressed entries; *nc receives its candidate count. */
static int validate_token(const dsv4_attn_args_t *a, uint32_t t, int64_t rope_rows, int64_t *nc) {
  const int64_t bs = a->block_size;
  int32_t s = a->tok_seg[t];
  if (s < 0 || (uint32_t)s >= a->n_segments)
    return DSV4_EINVAL;
  int64_t p = a->positions[t], p0 = a->seg_p0[s];
  if (p < p0 || p >= rope_rows || !dsv4_rope_table_chunk(a->rope, p / DSV4_ROPE_CHUNK_ROWS, NULL))
    return DSV4_EINVAL;
  int64_t lo = DSV4_WINDOW_LO(p, p0);
  for (int64_t lb = lo / bs; lb <= p / bs; lb++)
    if (!block_ok(a->seg_first_lb, a->seg_bt_off, a->seg_bt_len, a->block_table, a->n_blocks,
                  (uint32_t)s, lb))
      return DSV4_EINVAL;
  int64_t entries = 0;
  if (a->c_cache) {
    int rc = validate_entries(a, t, &entries);
    if (rc)
      return rc;
  }
  *nc = p - lo + 1 + entries;
  return 0;
}

/* Everything the launch will read, checked before anything is written (backend.h); *nc_max
 * receives the longest candidate list. */
static int attn_validate(const dsv4_attn_args_t *a, int64_t *nc_max) {
  const int64_t rope_rows = dsv4_rope_table_positions(a->rope);
  for (uint32_t s = 0; s < a->n_segments; s++) {
    if (a->seg_p0[s] < 0 ||
        (a->bt_entries && (uint64_t)a->seg_bt_off[s] + a->seg_bt_len[s] > a->bt_entries))
      return DSV4_EINVAL;
    if (a->c_cache && a->c_bt_entries &&
        (uint64_t)a->seg_cbt_off[s] + a->seg_cbt_len[s] > a->c_bt_entries)
      return DSV4_EINVAL;
  }
  *nc_max = 0;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int64_t nc;
    int rc = validate_token(a, t, rope_rows, &nc);
    if (rc)
      return rc;
    *nc_max = nc > *nc_max ? nc : *nc_max;
  }
  return *nc_max <= UINT32_MAX - 16 ? 0 : DSV4_EINVAL;
}

/*
 * Work items: a token, or a group of its heads when there are too few tokens to keep every
 * participant busy. A tile is dequantised once per item (about the cost of four heads), so a group
 * keeps at least ATTN_MIN_GROUP heads. The logits of long lists bound a group's heads as well
 * (ATTN_LOGIT_FLOATS, at least one head). The split only changes which thread computes a value,
 * never the value.
 */
static void plan_items(const dsv4_attn_args_t *a, unsigned threads, attn_job_t *j) {
  uint32_t groups = 1;
  if (threads > 1 && a->n_tokens < 2u * threads) {
    groups = (2u * threads + a->n_tokens - 1) / a->n_tokens;
    uint32_t most = (a->heads + ATTN_MIN_GROUP - 1) / ATTN_MIN_GROUP;
    if (groups > most)
      groups = most;
  }
  uint32_t hp = (a->heads + groups - 1) / groups;
  uint32_t cap = ATTN_LOGIT_FLOATS / j->l_stride;
  cap = cap >= 4 ? cap & ~3u : cap ? cap : 1;
  if (hp > cap) {
    groups = (a->heads + cap - 1) / cap;
    hp = DSV4__CPU_ATTN_HEADS4((a->heads + groups - 1) / groups);
    hp = hp < cap ? hp : cap;
  }
  j->heads_per_group = hp;
  j->groups = (a->heads + hp - 1) / hp;
}

int dsv4__cpu_attention(dsv4_host_pool_t *pool, int isa, dsv4__cpu_attn_scratch_t **scratch,
                        const dsv4_attn_args_t *a) {
  int rc = dsv4_backend_check_attn_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  int64_t nc_max;
  rc = attn_validate(a, &nc_max);
  if (rc)
    return rc;
  unsigned threads = dsv4_host_pool_threads(pool);
  if (!*scratch) {
    rc = scratch_create(threads, scratch);
    if (rc)
      return rc;
  }
  attn_job_t j = {.a = a, .isa = isa, .scratch = *scratch};
  j.l_stride = (uint32_t)((nc_max + 15) & ~(int64_t)15);
  plan_items(a, threads, &j);
  rc = scratch_reserve(*scratch, DSV4__CPU_ATTN_WORK_FLOATS(j.heads_per_group, j.l_stride));
  if (rc)
    return rc;
  size_t items = (size_t)a->n_tokens * j.groups;
  size_t chunk = items / ((size_t)threads * 8);
  dsv4_host_pool_run(pool, attn_items, &j, items, chunk ? chunk : 1);
  return 0;
}
