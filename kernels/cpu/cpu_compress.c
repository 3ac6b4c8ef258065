/*
 * The compressed branch on the CPU (SPEC §8.3, §8.5): the compressor, which turns ring rows into
 * compressed records and index records, and the indexer, which selects the entries a ratio-4 query
 * attends to. The math is kernels/dsv4-compress.h's and, for the 584-byte record, the §2.2 KV path
 * of cpu_kernels.c with the compressor's norm weight; this file gathers rows, walks block tables
 * and hands work to the pool. Every level gives the same bytes: the level-dependent calls are
 * dsv4__cpu_kv_token, the pooling and the indexer's queries and scores (cpu_compress_avx2.c,
 * cpu_compress_avx512.c), whose levels are byte-identical.
 *
 * The compressor's contract reads token by token (a row enters the ring, then an emission pools the
 * ring's rows), but a prefill chunk emits hundreds of entries and a ring of 8 rows cannot hold them
 * all. So a launch runs in two passes that give the same bytes: first every emission, each taking
 * the rows of this batch's tokens straight from the inputs (the same single rounding of gate + ape
 * that the ring would have stored) and older rows from the ring, which nothing writes during that
 * pass; then the ring rows, each written by the last token of its segment that maps to it. Both
 * passes run in parallel on the pool and the join orders them.
 *
 * Every argument, every block an emission writes or a selection reads, and every RoPE row is
 * checked before the first byte is written, so a refused launch changes nothing.
 */
#include "cpu-internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-compress.h"

/* As in cpu_attention.c: the scalar code cloned for x86-64-v3, where fmaf is one instruction. The
 * bytes are the same either way. */
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

/* The compressor's pooled channels (SPEC §8.3): 512 for the main record, 128 for the index key. */
#define POOL_MAX_CHANNELS DSV4_HEAD_DIM
/* Rows of one pooling: 128 at ratio 128, 4 + 4 at ratio 4. */
#define POOL_MAX_ROWS 128

/* ---- the entry tables (the same layout for compress and indexer) ---- */

typedef struct {
  const int64_t *seg_first_lb;
  const uint32_t *seg_bt_off;
  const uint32_t *seg_bt_len;
  const int32_t *table;
  uint32_t bt_entries;
  uint32_t n_blocks;
  uint32_t block_size;
} ctable_t;

/* The table fields of a dsv4_compress_args_t or a dsv4_indexer_args_t (the same names in both). */
#define CTABLE_OF(a)                                                                               \
  ((ctable_t){.seg_first_lb = (a)->seg_c_first_lb,                                                 \
              .seg_bt_off = (a)->seg_cbt_off,                                                      \
              .seg_bt_len = (a)->seg_cbt_len,                                                      \
              .table = (a)->c_block_table,                                                         \
              .bt_entries = (a)->c_bt_entries,                                                     \
              .n_blocks = (a)->c_n_blocks,                                                         \
              .block_size = (a)->block_size})

/* Every segment's table lies within bt_entries, when that is given. */
static int ctable_segments_ok(const ctable_t *ct, uint32_t n_segments) {
  for (uint32_t s = 0; s < n_segments; s++)
    if (ct->bt_entries && (uint64_t)ct->seg_bt_off[s] + ct->seg_bt_len[s] > ct->bt_entries)
      return 0;
  return 1;
}

/* The physical block of logical block lb of segment s, or -1 when the table has none in range. */
static int32_t ctable_lb_block(const ctable_t *ct, uint32_t s, int64_t lb) {
  int64_t idx = lb - ct->seg_first_lb[s];
  if (idx < 0 || idx >= (int64_t)ct->seg_bt_len[s])
    return -1;
  int32_t b = ct->table[(uint64_t)ct->seg_bt_off[s] + (uint64_t)idx];
  return b >= 0 && (uint32_t)b < ct->n_blocks ? b : -1;
}

/* The block of entry j of segment s, or -1. */
static int32_t ctable_block(const ctable_t *ct, uint32_t s, int64_t j) {
  return ctable_lb_block(ct, s, j / ct->block_size);
}

/* Whether the RoPE row of pos exists and is materialised. */
static int rope_row_ready(const dsv4_rope_table_t *rope, int64_t pos) {
  return pos >= 0 && pos < dsv4_rope_table_positions(rope) &&
         dsv4_rope_table_chunk(rope, pos / DSV4_ROPE_CHUNK_ROWS, NULL) != NULL;
}

/* ---- compress ---- */

/* The row geometry of one compressor of a launch: the main one, or the indexer's at ratio 4. */
typedef struct {
  uint32_t width;    /* W: kv floats of a row (coff * 512, or 256); the scores follow */
  uint32_t channels; /* pooled channels: W at ratio 128, W / 2 (one half) at ratio 4 */
  const float *in;   /* [n_tokens, 2W]: kv then gate */
  const float *ape;  /* [ratio, W] */
  uint64_t ring_off; /* floats from a slot's ring start to this compressor's row 0 */
} comp_geom_t;

typedef struct {
  const dsv4_compress_args_t *a;
  int isa;
  ctable_t ct;
  comp_geom_t main, index;
  const uint32_t *emit; /* the tokens that emit an entry, in batch order */
} compress_job_t;

/* The rows of a pooling (cpu-internal.h). */
typedef dsv4__cpu_pool_row_t pool_row_t;

static inline float row_score(const pool_row_t *r, uint32_t c) {
  return r->ape ? r->s[c] + r->ape[c] : r->s[c];
}

/*
 * Appends the rows of positions max(from, lo)..to at channel offset off. A position whose token is
 * in this batch is read from the inputs: tokens of a segment are consecutive positions in batch
 * order (checked by the launch), so it is token t - (p - q) when that token belongs to segment s.
 */
static uint32_t add_rows(const compress_job_t *j, const comp_geom_t *g, uint32_t t, int64_t from,
                         int64_t to, int64_t lo, uint32_t off, pool_row_t *rows, uint32_t n) {
  const dsv4_compress_args_t *a = j->a;
  const int32_t s = a->tok_seg[t];
  const int64_t p = a->positions[t];
  const uint64_t w2 = 2u * (uint64_t)g->width;
  const float *ring = a->ring + (uint64_t)a->seg_slot[s] * DSV4_RING_FLOATS(a->ratio) + g->ring_off;
  for (int64_t q = from > lo ? from : lo; q <= to; q++, n++) {
    int64_t back = p - q;
    if (back <= (int64_t)t && a->tok_seg[t - back] == s) {
      const float *in = g->in + (uint64_t)(t - back) * w2;
      rows[n].kv = in + off;
      rows[n].s = in + g->width + off;
      rows[n].ape = g->ape + (uint64_t)(q % a->ratio) * g->width + off;
    } else {
      const float *row = ring + (uint64_t)(q % DSV4_RING_ROWS(a->ratio)) * w2;
      rows[n].kv = row + off;
      rows[n].s = row + g->width + off;
      rows[n].ape = NULL;
    }
  }
  return n;
}

/* The row list R of the entry that token t emits (SPEC §8.3): ratio 4 takes half A of the previous
 * window, then half B of its own; only positions >= max(0, p0) exist. */
static uint32_t gather_rows(const compress_job_t *j, const comp_geom_t *g, uint32_t t,
                            pool_row_t *rows) {
  const dsv4_compress_args_t *a = j->a;
  const int64_t p = a->positions[t];
  const int64_t lo = a->seg_p0[a->tok_seg[t]]; /* >= 0, checked by the launch */
  const int64_t first = p / a->ratio * a->ratio;
  if (a->ratio != 4u)
    return add_rows(j, g, t, first, p, lo, 0, rows, 0);
  uint32_t n = add_rows(j, g, t, first - 4, first - 1, lo, 0, rows, 0);
  return add_rows(j, g, t, first, p, lo, g->channels, rows, n);
}

/* z[c] for c < channels: the max, then the in-order sums, then one divide (dsv4-compress.h). Rows
 * run in the outer loop, so each channel still sees R in order. */
SCALAR_CLONES static void pool_rows_scalar(const pool_row_t *rows, uint32_t n, uint32_t channels,
                                           float *z) {
  float m[POOL_MAX_CHANNELS], sum[POOL_MAX_CHANNELS], num[POOL_MAX_CHANNELS];
  for (uint32_t c = 0; c < channels; c++) {
    m[c] = row_score(&rows[0], c);
    sum[c] = 0.0f;
    num[c] = 0.0f;
  }
  for (uint32_t k = 1; k < n; k++)
    for (uint32_t c = 0; c < channels; c++)
      m[c] = dsv4_pool_max(m[c], row_score(&rows[k], c));
  for (uint32_t k = 0; k < n; k++)
    for (uint32_t c = 0; c < channels; c++)
      dsv4_pool_add(row_score(&rows[k], c), rows[k].kv[c], m[c], &sum[c], &num[c]);
  for (uint32_t c = 0; c < channels; c++)
    z[c] = num[c] / sum[c];
}

/* z at the job's level: the vector levels pool one channel per lane, in the same order. */
static void pool_rows(int isa, const pool_row_t *rows, uint32_t n, uint32_t channels, float *z) {
#if defined(__x86_64__)
  if (isa == DSV4__CPU_ISA_AVX512) {
    dsv4__cpu_pool_rows_avx512(rows, n, channels, z);
    return;
  }
  if (isa == DSV4__CPU_ISA_AVX2) {
    dsv4__cpu_pool_rows_avx2(rows, n, channels, z);
    return;
  }
#endif
  pool_rows_scalar(rows, n, channels, z);
}

/* dsv4_index_key, cloned like the scalar kernels so that its fmas are instructions. */
SCALAR_CLONES static void index_key(const float *z, const float *w, float eps,
                                    const float *rope_row, uint8_t *vals, uint8_t *codes) {
  dsv4_index_key(z, w, eps, rope_row, vals, codes);
}

/* The entry of token t: its 584-byte record and, at ratio 4, its 68-byte index record. */
static void emit_entry(const compress_job_t *j, uint32_t t) {
  const dsv4_compress_args_t *a = j->a;
  const uint32_t s = (uint32_t)a->tok_seg[t];
  const int64_t entry = a->positions[t] / a->ratio;
  const uint64_t b = (uint64_t)ctable_block(&j->ct, s, entry); /* checked by the launch */
  const uint64_t o = (uint64_t)(entry % a->block_size);
  const float *rope_row = dsv4_rope_table_row(a->rope, entry * a->ratio);
  pool_row_t rows[POOL_MAX_ROWS];
  float z[POOL_MAX_CHANNELS];
  uint16_t zb[DSV4_HEAD_DIM];
  uint32_t n = gather_rows(j, &j->main, t, rows);
  pool_rows(j->isa, rows, n, j->main.channels, z);
  for (int c = 0; c < DSV4_HEAD_DIM; c++)
    zb[c] = dsv4_f32_to_bf16(z[c]);
  uint8_t *base = a->c_cache + b * a->stride;
  dsv4__cpu_kv_token(j->isa, zb, rope_row, a->norm_weight, a->eps, base + DSV4_TOKEN_DATA_OFFSET(o),
                     base + DSV4_SCALE_OFFSET(a->block_size, o));
  if (a->ratio != 4u)
    return;
  n = gather_rows(j, &j->index, t, rows);
  pool_rows(j->isa, rows, n, j->index.channels, z);
  uint8_t vals[DSV4_INDEX_VALUE_BYTES], codes[DSV4_MXFP4_BLOCKS];
  index_key(z, a->i_norm_weight, a->eps, rope_row, vals, codes);
  uint8_t *ib = a->i_cache + b * DSV4_INDEX_BLOCK_BYTES(a->block_size);
  memcpy(ib + DSV4_INDEX_VALUE_BYTES * o, vals, sizeof(vals));
  DSV4__COUNT_STORE(ib + DSV4_INDEX_VALUE_BYTES * o, sizeof(vals));
  uint8_t *cb = ib + (uint64_t)DSV4_INDEX_VALUE_BYTES * a->block_size + DSV4_MXFP4_BLOCKS * o;
  memcpy(cb, codes, sizeof(codes));
  DSV4__COUNT_STORE(cb, sizeof(codes));
}

static void emit_items(void *varg, size_t first, size_t last) {
  const compress_job_t *j = varg;
  for (size_t i = first; i < last; i++)
    emit_entry(j, j->emit[i]);
}

/* Token t's row into its ring: kv copied, s = gate + ape[p mod ratio] rounded once. */
static void ring_write(const dsv4_compress_args_t *a, const comp_geom_t *g, uint32_t t) {
  const int64_t p = a->positions[t];
  const uint64_t w = g->width;
  float *row = a->ring + (uint64_t)a->seg_slot[a->tok_seg[t]] * DSV4_RING_FLOATS(a->ratio) +
               g->ring_off + (uint64_t)(p % DSV4_RING_ROWS(a->ratio)) * 2u * w;
  const float *in = g->in + (uint64_t)t * 2u * w;
  const float *ape = g->ape + (uint64_t)(p % a->ratio) * w;
  memcpy(row, in, w * sizeof(float));
  for (uint64_t c = 0; c < w; c++)
    row[w + c] = in[w + c] + ape[c];
}

/* The ring rows: a token whose segment has a token RING_ROWS positions later leaves its row to
 * that token, so every row is written once, by the last token that maps to it. */
static void ring_items(void *varg, size_t first, size_t last) {
  const compress_job_t *j = varg;
  const dsv4_compress_args_t *a = j->a;
  const size_t rr = DSV4_RING_ROWS(a->ratio);
  for (size_t t = first; t < last; t++) {
    if (t + rr < a->n_tokens && a->tok_seg[t + rr] == a->tok_seg[t])
      continue;
    ring_write(a, &j->main, (uint32_t)t);
    if (a->ratio == 4u)
      ring_write(a, &j->index, (uint32_t)t);
  }
}

/*
 * Everything the launch reads or writes, before anything is written: segments in range, each one's
 * tokens contiguous in the batch at consecutive positions p0 <= p within the RoPE table, one state
 * slot per segment, and for every emission its block and its RoPE row. seen and slot_used are
 * zeroed scratch of n_segments and n_slots bytes.
 */
static int compress_validate(const compress_job_t *j, uint8_t *seen, uint8_t *slot_used,
                             uint32_t *n_emit) {
  const dsv4_compress_args_t *a = j->a;
  const int64_t rope_rows = dsv4_rope_table_positions(a->rope);
  if (!ctable_segments_ok(&j->ct, a->n_segments))
    return DSV4_EINVAL;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int32_t s = a->tok_seg[t];
    if (s < 0 || (uint32_t)s >= a->n_segments)
      return DSV4_EINVAL;
    int64_t p = a->positions[t], p0 = a->seg_p0[s];
    if (p0 < 0 || p < p0 || p >= rope_rows)
      return DSV4_EINVAL;
    if (t > 0 && a->tok_seg[t - 1] == s) {
      if (p != a->positions[t - 1] + 1)
        return DSV4_EINVAL;
    } else {
      uint32_t slot = a->seg_slot[s];
      if (seen[s] || slot >= a->n_slots || slot_used[slot])
        return DSV4_EINVAL;
      seen[s] = 1;
      slot_used[slot] = 1;
    }
    if ((p + 1) % a->ratio == 0) {
      int64_t entry = p / a->ratio;
      if (ctable_block(&j->ct, (uint32_t)s, entry) < 0 ||
          !rope_row_ready(a->rope, entry * a->ratio))
        return DSV4_EINVAL;
      (*n_emit)++;
    }
  }
  return 0;
}

static void compress_job_init(compress_job_t *j, const dsv4_compress_args_t *a, int isa) {
  memset(j, 0, sizeof(*j));
  j->a = a;
  j->isa = isa;
  j->ct = CTABLE_OF(a);
  const uint32_t coff = a->ratio == 4u ? 2u : 1u;
  j->main.width = coff * DSV4_HEAD_DIM;
  j->main.channels = DSV4_HEAD_DIM;
  j->main.in = a->ckv;
  j->main.ape = a->ape;
  j->main.ring_off = 0;
  if (a->ratio == 4u) {
    j->index.width = 2u * DSV4_INDEX_DIM;
    j->index.channels = DSV4_INDEX_DIM;
    j->index.in = a->ikv;
    j->index.ape = a->i_ape;
    j->index.ring_off = (uint64_t)DSV4_RING_ROWS(4u) * 2u * j->main.width;
  }
}

int dsv4__cpu_compress(dsv4_host_pool_t *pool, int isa, const dsv4_compress_args_t *a) {
  int rc = dsv4_backend_check_compress_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  compress_job_t j;
  compress_job_init(&j, a, isa);
  uint8_t *seen = calloc((size_t)a->n_segments + a->n_slots, 1);
  if (!seen)
    return DSV4_ENOMEM;
  uint32_t n_emit = 0;
  rc = compress_validate(&j, seen, seen + a->n_segments, &n_emit);
  free(seen);
  if (rc)
    return rc;
  uint32_t *emit = malloc(((size_t)n_emit + 1) * sizeof(uint32_t));
  if (!emit)
    return DSV4_ENOMEM;
  for (uint32_t t = 0, i = 0; t < a->n_tokens; t++)
    if ((a->positions[t] + 1) % a->ratio == 0)
      emit[i++] = t;
  j.emit = emit;
  dsv4_host_pool_run_balanced(pool, emit_items, &j, n_emit);
  dsv4_host_pool_run_balanced(pool, ring_items, &j, a->n_tokens);
  free(emit);
  return 0;
}

/* ---- indexer ---- */

struct dsv4__cpu_index_scratch {
  unsigned n;
  size_t bytes; /* of each workspace */
  atomic_int *busy;
  void **work;
  uint32_t *keys; /* the keys of a launch whose tokens are scored in pieces (index_piece_items) */
  size_t keys_bytes;
};

void dsv4__cpu_index_scratch_free(dsv4__cpu_index_scratch_t *s) {
  if (!s)
    return;
  for (unsigned i = 0; i < s->n; i++)
    free(s->work[i]);
  free(s->work);
  free(s->busy);
  free(s->keys);
  free(s);
}

/* The shared keys of a launch scored in pieces: at least bytes, kept for later launches. */
static int index_scratch_keys(dsv4__cpu_index_scratch_t *s, size_t bytes) {
  if (s->keys_bytes >= bytes)
    return 0;
  free(s->keys);
  s->keys_bytes = 0;
  s->keys = malloc(bytes);
  if (!s->keys)
    return DSV4_ENOMEM;
  s->keys_bytes = bytes;
  return 0;
}

/* n workspaces of at least bytes each; a launch that needs more than the last replaces them. */
static int index_scratch_reserve(dsv4__cpu_index_scratch_t **sp, unsigned n, size_t bytes) {
  dsv4__cpu_index_scratch_t *s = *sp;
  if (s && s->n == n && s->bytes >= bytes)
    return 0;
  dsv4__cpu_index_scratch_free(s);
  *sp = NULL;
  s = calloc(1, sizeof(*s));
  if (!s)
    return DSV4_ENOMEM;
  s->busy = calloc(n, sizeof(*s->busy));
  s->work = calloc(n, sizeof(*s->work));
  if (!s->busy || !s->work) {
    dsv4__cpu_index_scratch_free(s);
    return DSV4_ENOMEM;
  }
  s->bytes = (bytes + 63) / 64 * 64;
  for (; s->n < n; s->n++) {
    atomic_init(&s->busy[s->n], 0);
    s->work[s->n] = aligned_alloc(64, s->bytes);
    if (!s->work[s->n]) {
      dsv4__cpu_index_scratch_free(s);
      return DSV4_ENOMEM;
    }
  }
  *sp = s;
  return 0;
}

/* At most one call of the job per participant runs at a time, so a free workspace always exists. */
static void *index_scratch_claim(dsv4__cpu_index_scratch_t *s, unsigned *slot) {
  for (;;)
    for (unsigned i = 0; i < s->n; i++)
      if (atomic_exchange_explicit(&s->busy[i], 1, memory_order_acquire) == 0) {
        *slot = i;
        return s->work[i];
      }
}

typedef struct {
  const dsv4_indexer_args_t *a;
  int isa;
  ctable_t ct;
  dsv4__cpu_index_scratch_t *scratch;
  uint64_t max_visible; /* the most entries one token scores */
  uint32_t pieces;      /* items per token (index_piece_items), 1 when every token is one item */
} indexer_job_t;

/* A participant's workspace, carved from one allocation of index_work_bytes. */
typedef struct {
  float *q;      /* q^: [n_heads, 128] at the scalar level, DSV4__CPU_INDEX_QHEADS else */
  float *w;      /* [n_heads] the scaled weights */
  float *level;  /* DSV4__CPU_INDEX_WORK_FLOATS for the vector levels */
  uint32_t *key; /* [max_visible] */
  dsv4__cpu_index_group_t *groups; /* max_visible / 16 + 2 */
} index_work_t;

#define ALIGN64(n) (((n) + 63) / 64 * 64)

static size_t index_work_bytes(uint64_t max_visible) {
  return ALIGN64((size_t)DSV4_MAX_HEADS * DSV4_INDEX_DIM * sizeof(float)) +
         ALIGN64((size_t)DSV4_MAX_HEADS * sizeof(float)) +
         ALIGN64((size_t)DSV4__CPU_INDEX_WORK_FLOATS * sizeof(float)) +
         ALIGN64((size_t)max_visible * sizeof(uint32_t)) +
         (size_t)(max_visible / DSV4__CPU_INDEX_GROUP + 2) * sizeof(dsv4__cpu_index_group_t);
}

static index_work_t index_work_at(void *base, uint64_t max_visible) {
  char *p = base;
  index_work_t wk;
  wk.q = (float *)p;
  p += ALIGN64((size_t)DSV4_MAX_HEADS * DSV4_INDEX_DIM * sizeof(float));
  wk.w = (float *)p;
  p += ALIGN64((size_t)DSV4_MAX_HEADS * sizeof(float));
  wk.level = (float *)p;
  p += ALIGN64((size_t)DSV4__CPU_INDEX_WORK_FLOATS * sizeof(float));
  wk.key = (uint32_t *)p;
  p += ALIGN64((size_t)max_visible * sizeof(uint32_t));
  wk.groups = (dsv4__cpu_index_group_t *)p;
  return wk;
}

SCALAR_CLONES static void index_queries_scalar(const uint16_t *iq, uint32_t n_heads,
                                               const float *rope_row, float *qhat) {
  for (uint32_t h = 0; h < n_heads; h++)
    dsv4_index_query(iq + (size_t)h * DSV4_INDEX_DIM, rope_row, qhat + (size_t)h * DSV4_INDEX_DIM);
}

/* q^ and the scaled weight of every head of token t, q^ in the level's layout: [n_heads, 128] at
 * the scalar level, DSV4__CPU_INDEX_QHEADS at the vector levels. */
static void index_queries(const indexer_job_t *j, uint32_t t, const index_work_t *wk) {
  const dsv4_indexer_args_t *a = j->a;
  const float *rope_row = dsv4_rope_table_row(a->rope, a->positions[t]);
  const uint16_t *iq = a->iq + (size_t)t * a->n_heads * DSV4_INDEX_DIM;
  for (uint32_t h = 0; h < a->n_heads; h++)
    wk->w[h] = a->iw[(size_t)t * a->n_heads + h] * a->w_scale;
#if defined(__x86_64__)
  if (j->isa == DSV4__CPU_ISA_AVX512) {
    dsv4__cpu_index_queries_avx512(iq, a->n_heads, rope_row, wk->q);
    return;
  }
  if (j->isa == DSV4__CPU_ISA_AVX2) {
    dsv4__cpu_index_queries_avx2(iq, a->n_heads, rope_row, wk->q);
    return;
  }
#endif
  index_queries_scalar(iq, a->n_heads, rope_row, wk->q);
}

/* The key of every entry e0..e0+n-1 of segment s (SPEC §8.5 scores): the scalar level, one entry
 * at a time, each record dequantised once for all heads. */
SCALAR_CLONES static void index_scores(const indexer_job_t *j, uint32_t s, int64_t e0, uint32_t n,
                                       const float *qhat, const float *w, uint32_t *key) {
  const dsv4_indexer_args_t *a = j->a;
  const uint64_t bs = a->block_size;
  float k[DSV4_INDEX_DIM];
  for (uint32_t i = 0; i < n; i++) {
    int64_t entry = e0 + i;
    uint64_t o = (uint64_t)entry % bs;
    const uint8_t *blk =
        a->i_cache + (uint64_t)ctable_block(&j->ct, s, entry) * DSV4_INDEX_BLOCK_BYTES(bs);
    dsv4_mxfp4_dequant128(blk + DSV4_INDEX_VALUE_BYTES * o,
                          blk + DSV4_INDEX_VALUE_BYTES * bs + DSV4_MXFP4_BLOCKS * o, k);
    float acc = 0.0f;
    for (uint32_t h = 0; h < a->n_heads; h++)
      acc = dsv4_index_score_add(w[h], dsv4_dot128(qhat + (size_t)h * DSV4_INDEX_DIM, k), acc);
    key[i] = dsv4_index_score_key(acc);
  }
}

/*
 * The keys of entries e0..e0+n-1 of segment s at the job's level. The vector levels take groups of
 * 16 entries starting at multiples of 16 (each within one block, as block sizes are multiples of
 * 16), write the scores as floats into key[], which then become keys in place.
 */
static void index_scan(const indexer_job_t *j, uint32_t s, int64_t e0, uint32_t n,
                       const index_work_t *wk, uint32_t *key) {
#if defined(__x86_64__)
  if (j->isa != DSV4__CPU_ISA_SCALAR) {
    const dsv4_indexer_args_t *a = j->a;
    const uint64_t bs = a->block_size;
    const int64_t first = e0 - e0 % DSV4__CPU_INDEX_GROUP;
    const uint32_t lead = (uint32_t)(e0 - first);
    for (uint32_t g = 0; g * DSV4__CPU_INDEX_GROUP < lead + n; g++) {
      int64_t entry = first + (int64_t)g * DSV4__CPU_INDEX_GROUP;
      /* The group's first visible entry names its block (checked by the launch). */
      const uint8_t *blk = a->i_cache + (uint64_t)ctable_block(&j->ct, s, entry > e0 ? entry : e0) *
                                            DSV4_INDEX_BLOCK_BYTES(bs);
      uint64_t o = (uint64_t)entry % bs;
      wk->groups[g].vals = blk + DSV4_INDEX_VALUE_BYTES * o;
      wk->groups[g].codes = blk + DSV4_INDEX_VALUE_BYTES * bs + DSV4_MXFP4_BLOCKS * o;
    }
    dsv4__cpu_index_scan_t scan = {.qt = wk->q,
                                   .w = wk->w,
                                   .n_heads = a->n_heads,
                                   .groups = wk->groups,
                                   .lead = lead,
                                   .n = n,
                                   .scores = (float *)key,
                                   .work = wk->level};
    if (j->isa == DSV4__CPU_ISA_AVX512)
      dsv4__cpu_index_scan_avx512(&scan);
    else
      dsv4__cpu_index_scan_avx2(&scan);
    for (uint32_t i = 0; i < n; i++) {
      float score;
      memcpy(&score, &key[i], sizeof(score));
      key[i] = dsv4_index_score_key(score);
    }
    return;
  }
#endif
  index_scores(j, s, e0, n, wk->q, wk->w, key);
}

/*
 * The k largest keys of n > k, ties to the lower entry, listed by entry: a radix select (8 bits at
 * a time, from the top) finds the k-th largest key T and how many keys equal to T are taken; one
 * pass in entry order then lists every key above T and the first of those equal to it.
 */
static void select_topk(const uint32_t *key, uint32_t n, uint32_t k, int64_t jlo, int32_t *sel) {
  uint32_t prefix = 0, mask = 0, need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    uint32_t hist[256] = {0};
    for (uint32_t i = 0; i < n; i++)
      if ((key[i] & mask) == prefix)
        hist[(key[i] >> shift) & 255u]++;
    /* The keys matching prefix number at least need, so some bucket reaches it. */
    uint32_t b = 255;
    while (hist[b] < need) {
      need -= hist[b];
      b--;
    }
    prefix |= b << shift;
    mask |= 255u << shift;
  }
  uint32_t m = 0;
  for (uint32_t i = 0; i < n; i++) {
    if (key[i] > prefix) {
      sel[m++] = (int32_t)(jlo + i);
    } else if (key[i] == prefix && need > 0) {
      sel[m++] = (int32_t)(jlo + i);
      need--;
    }
  }
}

/* The visible entries jlo..jlo+n-1 of token t (SPEC §8.4). */
static int64_t index_span(const dsv4_indexer_args_t *a, uint32_t t, int64_t *jlo) {
  const int64_t jhi = (a->positions[t] + 1) / 4;
  *jlo = a->seg_p0[a->tok_seg[t]] / 4;
  return jhi > *jlo ? jhi - *jlo : 0;
}

/* A token with at most topk visible entries selects them all, then -1 padding; returns 1 then. */
static int index_select_all(const dsv4_indexer_args_t *a, uint32_t t) {
  int64_t jlo, n = index_span(a, t, &jlo);
  if (n > (int64_t)a->topk)
    return 0;
  int32_t *sel = a->sel + (size_t)t * a->topk;
  for (uint32_t k = 0; k < a->topk; k++)
    sel[k] = k < n ? (int32_t)(jlo + k) : -1;
  return 1;
}

static void indexer_token(const indexer_job_t *j, uint32_t t, const index_work_t *wk) {
  const dsv4_indexer_args_t *a = j->a;
  if (index_select_all(a, t))
    return;
  int64_t jlo, n = index_span(a, t, &jlo);
  index_queries(j, t, wk);
  index_scan(j, (uint32_t)a->tok_seg[t], jlo, (uint32_t)n, wk, wk->key);
  select_topk(wk->key, (uint32_t)n, a->topk, jlo, a->sel + (size_t)t * a->topk);
}

static void indexer_items(void *varg, size_t first, size_t last) {
  const indexer_job_t *j = varg;
  unsigned slot = 0;
  /* Without scratch no token scores, and none reads the workspace. */
  index_work_t wk = {0};
  if (j->scratch)
    wk = index_work_at(index_scratch_claim(j->scratch, &slot), j->max_visible);
  for (size_t t = first; t < last; t++)
    indexer_token(j, (uint32_t)t, &wk);
  if (j->scratch)
    atomic_store_explicit(&j->scratch->busy[slot], 0, memory_order_release);
}

/*
 * A batch of fewer tokens than threads (a decode step) scores each token in pieces, so that every
 * thread has work: item t * pieces + c scores piece c of token t's entries into the launch's keys
 * (each piece computes the token's queries itself), and a second pass selects per token. Pieces
 * start at multiples of 16 entries, the vector levels' groups. A score does not depend on the
 * piece that computes it, so the selection is the same as from one item.
 */
static int64_t index_piece_start(int64_t jlo, int64_t n, uint32_t c, uint32_t pieces) {
  if (c == pieces)
    return jlo + n;
  int64_t e = jlo + n * c / pieces;
  e -= e % DSV4__CPU_INDEX_GROUP;
  return e > jlo ? e : jlo;
}

static void index_piece_items(void *varg, size_t first, size_t last) {
  const indexer_job_t *j = varg;
  const dsv4_indexer_args_t *a = j->a;
  unsigned slot = 0;
  index_work_t wk = index_work_at(index_scratch_claim(j->scratch, &slot), j->max_visible);
  for (size_t i = first; i < last; i++) {
    const uint32_t t = (uint32_t)(i / j->pieces), c = (uint32_t)(i % j->pieces);
    int64_t jlo, n = index_span(a, t, &jlo);
    if (n <= (int64_t)a->topk)
      continue;
    int64_t lo = index_piece_start(jlo, n, c, j->pieces);
    int64_t hi = index_piece_start(jlo, n, c + 1, j->pieces);
    if (lo == hi)
      continue;
    index_queries(j, t, &wk);
    index_scan(j, (uint32_t)a->tok_seg[t], lo, (uint32_t)(hi - lo), &wk,
               j->scratch->keys + t * j->max_visible + (lo - jlo));
  }
  atomic_store_explicit(&j->scratch->busy[slot], 0, memory_order_release);
}

static void index_select_items(void *varg, size_t first, size_t last) {
  const indexer_job_t *j = varg;
  const dsv4_indexer_args_t *a = j->a;
  for (size_t t = first; t < last; t++) {
    if (index_select_all(a, (uint32_t)t))
      continue;
    int64_t jlo, n = index_span(a, (uint32_t)t, &jlo);
    select_topk(j->scratch->keys + t * j->max_visible, (uint32_t)n, a->topk, jlo,
                a->sel + t * a->topk);
  }
}

/*
 * Everything a selection reads, before anything is written: segments and positions, and for every
 * token that must score (more than topk visible entries) its RoPE row and the block of each visible
 * entry. A segment's tokens see entries from the same first one, so the blocks checked for the
 * previous token of the segment are not checked again. *max_visible: the most entries one token
 * scores (0 when none does).
 */
static int indexer_validate(const indexer_job_t *j, uint64_t *max_visible) {
  const dsv4_indexer_args_t *a = j->a;
  const int64_t bs = a->block_size;
  const int64_t rope_rows = dsv4_rope_table_positions(a->rope);
  if (!ctable_segments_ok(&j->ct, a->n_segments))
    return DSV4_EINVAL;
  int64_t prev_s = -1, done_lb = -1;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int32_t s = a->tok_seg[t];
    if (s < 0 || (uint32_t)s >= a->n_segments)
      return DSV4_EINVAL;
    int64_t p = a->positions[t], p0 = a->seg_p0[s];
    if (p0 < 0 || p < p0 || p >= rope_rows)
      return DSV4_EINVAL;
    int64_t jlo = p0 / 4, jhi = (p + 1) / 4;
    if (jhi - jlo <= (int64_t)a->topk)
      continue;
    if (!rope_row_ready(a->rope, p))
      return DSV4_EINVAL;
    int64_t lb = jlo / bs, lb_hi = (jhi - 1) / bs;
    if (s == prev_s && done_lb + 1 > lb)
      lb = done_lb + 1;
    for (; lb <= lb_hi; lb++)
      if (ctable_lb_block(&j->ct, (uint32_t)s, lb) < 0)
        return DSV4_EINVAL;
    done_lb = s == prev_s && done_lb > lb_hi ? done_lb : lb_hi;
    prev_s = s;
    if ((uint64_t)(jhi - jlo) > *max_visible)
      *max_visible = (uint64_t)(jhi - jlo);
  }
  return 0;
}

/* Pieces of at least this many entries: a piece also computes its token's queries. */
#define INDEX_PIECE_MIN 512

int dsv4__cpu_indexer(dsv4_host_pool_t *pool, int isa, dsv4__cpu_index_scratch_t **scratch,
                      const dsv4_indexer_args_t *a) {
  int rc = dsv4_backend_check_indexer_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  indexer_job_t j = {.a = a, .isa = isa, .pieces = 1};
  j.ct = CTABLE_OF(a);
  rc = indexer_validate(&j, &j.max_visible);
  if (rc)
    return rc;
  const unsigned threads = dsv4_host_pool_threads(pool);
  if (j.max_visible) {
    rc = index_scratch_reserve(scratch, threads, index_work_bytes(j.max_visible));
    if (rc)
      return rc;
    j.scratch = *scratch;
  }
  if (j.max_visible >= 2 * INDEX_PIECE_MIN && a->n_tokens < threads) {
    j.pieces = (threads + a->n_tokens - 1) / a->n_tokens;
    if (j.pieces > j.max_visible / INDEX_PIECE_MIN)
      j.pieces = (uint32_t)(j.max_visible / INDEX_PIECE_MIN);
    rc = index_scratch_keys(j.scratch, (size_t)a->n_tokens * j.max_visible * sizeof(uint32_t));
    if (rc)
      return rc;
    dsv4_host_pool_run(pool, index_piece_items, &j, (size_t)a->n_tokens * j.pieces, 1);
    dsv4_host_pool_run(pool, index_select_items, &j, a->n_tokens, 1);
    return 0;
  }
  dsv4_host_pool_run_balanced(pool, indexer_items, &j, a->n_tokens);
  return 0;
}
