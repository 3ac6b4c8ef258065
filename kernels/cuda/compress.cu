/*
 * The compressor of a compressed layer (SPEC §8.3, and the indexer's keys of §8.5 at ratio 4),
 * exact mode, computing exactly the CPU reference's bytes (cpu_compress.c): the same two passes,
 * each a kernel, after a check.
 *
 *   check    one CTA over every token: segments, positions, one run of consecutive positions per
 *            segment, one state slot per segment, the entry block of every emission. It zeroes its
 *            bitmaps of segments and slots in shared memory, so nothing outside the launch needs
 *            clearing first. A failure sets bits of the caller's error word; the other kernels read
 *            the word after their dependency wait and then write nothing (a refused launch changes
 *            nothing, backend.h).
 *   emit     one CTA per token (those that emit nothing leave at once): the entry of a token with
 *            (p + 1) % ratio == 0. Thread c pools channel c over the row list R (SPEC §8.3: the
 * max, then the in-order sums, then one divide), reading each row from the launch's inputs (kv, and
 * gate + ape rounded once, the value the ring would hold) when its token is in the batch, else from
 * the ring, which no kernel of the launch has written yet. The 584-byte record follows the SPEC
 * §2.2 KV path with the compressor's norm weight (the canonical sum of squares, the RoPE row of
 * position ratio * j, the seven UE8M0 tiles), each output byte stored by one thread. At ratio 4
 * threads 0..127 pool the index key's channels the same way and one thread computes its 68-byte
 * record with dsv4_index_key (dsv4-compress.h, the CPU's own code). ring     one CTA per token
 * whose row stays in the ring (the last RING_ROWS tokens of its segment, as on the CPU): kv copied,
 * s = gate + ape.
 *
 * The emissions read ring rows that the ring kernel overwrites, so the ring kernel waits for the
 * emission grid (griddepcontrol.wait), which waited for the check. Ordering (SPEC §5.2): every CTA
 * of every kernel executes the wait before it reads anything but its parameters, and before any
 * early return.
 */
#include "cuda-internal.cuh"

#include "dsv4-compress.h"
#include "dsv4-error.h"
#include "dsv4-numerics.h"

#define CHECK_THREADS 1024
#define EMIT_THREADS DSV4_HEAD_DIM /* one thread per channel of the main record */
#define RING_THREADS 256
#define POOL_ROWS 128 /* the longest row list: ratio 128 */
/* The bitmaps of the check live in shared memory: at most this many segments and slots together. */
#define CHECK_MAX_BITS (46u * 1024u * 8u)

typedef struct {
  const int64_t *pos;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  const uint32_t *seg_slot;
  const float *ckv; /* [n_tokens, 2 * main width] */
  const float *ikv; /* [n_tokens, 512] at ratio 4 */
  float *ring;
  const float *ape;
  const float *norm_w;
  const float *i_ape;
  const float *i_norm_w;
  const float *rope; /* rows of 64 floats by position */
  const int64_t *seg_c_first_lb;
  const uint32_t *seg_cbt_off;
  const uint32_t *seg_cbt_len;
  const int32_t *c_bt;
  uint8_t *c_cache;
  uint8_t *i_cache;
  uint32_t *err;
  uint64_t stride;
  int64_t max_pos;
  float eps;
  uint32_t ratio, n_tokens, n_segments, n_slots, c_bt_entries, c_n_blocks, bs_shift;
} comp_params_t;

static_assert(sizeof(comp_params_t) % 4 == 0, "parameter block of whole words");

/* The row geometry of one compressor: the main one, or the indexer's at ratio 4 (cpu_compress.c's
 * comp_geom_t). */
typedef struct {
  uint32_t width;    /* W: kv floats of a row; the scores follow */
  uint32_t channels; /* pooled channels */
  const float *in;   /* [n_tokens, 2W] */
  const float *ape;  /* [ratio, W] */
  uint64_t ring_off; /* floats from a slot's ring start to this compressor's row 0 */
} geom_t;

static __device__ __forceinline__ uint32_t ring_rows(uint32_t ratio) {
  return DSV4_RING_ROWS(ratio);
}

static __device__ geom_t geom_main(const comp_params_t &p) {
  geom_t g;
  g.width = (p.ratio == 4u ? 2u : 1u) * DSV4_HEAD_DIM;
  g.channels = DSV4_HEAD_DIM;
  g.in = p.ckv;
  g.ape = p.ape;
  g.ring_off = 0;
  return g;
}

static __device__ geom_t geom_index(const comp_params_t &p) {
  geom_t g;
  g.width = 2u * DSV4_INDEX_DIM;
  g.channels = DSV4_INDEX_DIM;
  g.in = p.ikv;
  g.ape = p.i_ape;
  g.ring_off = (uint64_t)ring_rows(4u) * 2u * (2u * DSV4_HEAD_DIM);
  return g;
}

/* The physical block of entry j of segment s, or -1 when its table has none in range. */
static __device__ __forceinline__ int32_t entry_block(const comp_params_t &p, uint32_t s,
                                                      int64_t j) {
  return dsv4__entry_block(p, s, j >> p.bs_shift);
}

/* ---- check ---- */

/* 0, or the error bits of token t (cpu_compress.c's compress_validate, token by token). */
static __device__ uint32_t check_token(const comp_params_t &p, uint32_t t, uint32_t *seen,
                                       uint32_t *used) {
  const int32_t s = p.tok_seg[t];
  if (s < 0 || (uint32_t)s >= p.n_segments)
    return DSV4_CUDA_ERR_SEGMENT;
  const int64_t pos = p.pos[t], p0 = p.seg_p0[s];
  if (p0 < 0 || pos < p0 || pos >= p.max_pos)
    return DSV4_CUDA_ERR_POSITION;
  if (t > 0 && p.tok_seg[t - 1] == s) {
    if (pos != p.pos[t - 1] + 1)
      return DSV4_CUDA_ERR_POSITION;
  } else {
    /* The first token of a run of segment s: no other run of s, and a slot of its own. */
    const uint32_t sb = 1u << (s & 31), slot = p.seg_slot[s];
    if (atomicOr(&seen[s >> 5], sb) & sb)
      return DSV4_CUDA_ERR_SEGMENT;
    if (slot >= p.n_slots)
      return DSV4_CUDA_ERR_SLOT;
    const uint32_t ub = 1u << (slot & 31);
    if (atomicOr(&used[slot >> 5], ub) & ub)
      return DSV4_CUDA_ERR_SLOT;
  }
  if ((pos + 1) % p.ratio == 0 && entry_block(p, (uint32_t)s, pos / p.ratio) < 0)
    return DSV4_CUDA_ERR_BLOCK;
  return 0;
}

__global__ void __launch_bounds__(CHECK_THREADS) dsv4__compress_check_kernel(comp_params_t p) {
  extern __shared__ uint32_t bits[];
  __shared__ uint32_t found;
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  const uint32_t tid = threadIdx.x, seg_words = (p.n_segments + 31) / 32;
  const uint32_t words = seg_words + (p.n_slots + 31) / 32;
  for (uint32_t i = tid; i < words; i += CHECK_THREADS)
    bits[i] = 0;
  if (tid == 0)
    found = 0;
  __syncthreads();
  uint32_t e = 0;
  /* Every segment's table within the entries given (as the CPU's ctable_segments_ok). */
  for (uint32_t s = tid; s < p.n_segments; s += CHECK_THREADS)
    if (p.c_bt_entries && (uint64_t)p.seg_cbt_off[s] + p.seg_cbt_len[s] > p.c_bt_entries)
      e |= DSV4_CUDA_ERR_BLOCK;
  for (uint32_t t = tid; t < p.n_tokens; t += CHECK_THREADS)
    e |= check_token(p, t, bits, bits + seg_words);
  if (e)
    atomicOr(&found, e);
  __syncthreads();
  if (tid == 0 && found)
    atomicOr(p.err, found);
}

/* ---- emit ---- */

/* One row of the list R: its kv and score pointers at the half's first channel, and the ape row
 * to add (NULL for a ring row, which holds the sum). */
typedef struct {
  const float *kv;
  const float *s;
  const float *ape;
} row_t;

static __device__ __forceinline__ float row_score(const row_t &r, uint32_t c) {
  return r.ape ? r.s[c] + r.ape[c] : r.s[c];
}

/* Row k of the list of token t's entry, at position q and channel offset off (cpu_compress.c's
 * add_rows): from the inputs when q's token is in the batch, else from the ring. */
static __device__ row_t make_row(const comp_params_t &p, const geom_t &g, uint32_t t, int64_t q,
                                 uint32_t off) {
  const int32_t s = p.tok_seg[t];
  const int64_t back = p.pos[t] - q;
  const uint64_t w2 = 2u * (uint64_t)g.width;
  row_t r;
  if (back <= (int64_t)t && p.tok_seg[t - back] == s) {
    const float *in = g.in + (uint64_t)(t - back) * w2;
    r.kv = in + off;
    r.s = in + g.width + off;
    r.ape = g.ape + (uint64_t)(q % p.ratio) * g.width + off;
  } else {
    const float *row = p.ring + (uint64_t)p.seg_slot[s] * DSV4_RING_FLOATS(p.ratio) + g.ring_off +
                       (uint64_t)(q % ring_rows(p.ratio)) * w2;
    r.kv = row + off;
    r.s = row + g.width + off;
    r.ape = NULL;
  }
  return r;
}

/* The row list R of the entry token t emits, into rows[] (thread k builds row k); returns its
 * length. Ratio 4: half A of the previous window, then half B of its own; positions >= p0 only. */
static __device__ uint32_t gather_rows(const comp_params_t &p, const geom_t &g, uint32_t t,
                                       row_t *rows) {
  const int64_t pos = p.pos[t], lo = p.seg_p0[p.tok_seg[t]];
  const int64_t first = pos / p.ratio * p.ratio;
  int64_t a0 = first - 4, a1 = first - 1, b0 = first;
  if (p.ratio != 4u) {
    a0 = 0;
    a1 = -1; /* no half A */
  }
  a0 = a0 > lo ? a0 : lo;
  b0 = b0 > lo ? b0 : lo;
  const uint32_t na = a1 >= a0 ? (uint32_t)(a1 - a0 + 1) : 0u;
  const uint32_t nb = (uint32_t)(pos - b0 + 1);
  const uint32_t k = threadIdx.x;
  if (k < na)
    rows[k] = make_row(p, g, t, a0 + k, 0);
  else if (k < na + nb)
    rows[k] = make_row(p, g, t, b0 + (k - na), p.ratio == 4u ? g.channels : 0u);
  return na + nb;
}

/* Channel c pooled over rows[0..n) (dsv4-compress.h): the max, the in-order sums, one divide. */
static __device__ float pool_channel(const row_t *rows, uint32_t n, uint32_t c) {
  float m = row_score(rows[0], c);
  for (uint32_t k = 1; k < n; k++)
    m = dsv4_pool_max(m, row_score(rows[k], c));
  float sum = 0.0f, num = 0.0f;
  for (uint32_t k = 0; k < n; k++)
    dsv4_pool_add(row_score(rows[k], c), rows[k].kv[c], m, &sum, &num);
  return num / sum;
}

/* Shared memory of an emitting CTA. */
typedef struct {
  row_t rows[POOL_ROWS];
  float x[DSV4_HEAD_DIM];    /* the pooled z as bf16 values, then the normed record values */
  float part[32];            /* the canonical partials of the sum of squares */
  float r;                   /* the RMS factor */
  float scale[DSV4_NTILES];  /* 2^-e of each tile */
  uint8_t code[DSV4_NTILES]; /* e + 127 of each tile */
  float zi[DSV4_INDEX_DIM];  /* the index key's pooled channels */
} emit_smem_t;

/*
 * The 584-byte record of the pooled x (bf16 values as fp32) into data and scales: the SPEC §2.2
 * KV path with kv_norm = fused (cpu_kernels.c's kv_token_scalar). Thread c owns dim c.
 */
static __device__ void emit_record(const comp_params_t &p, emit_smem_t &sm, const float *cs,
                                   uint8_t *data, uint8_t *scales) {
  const uint32_t c = threadIdx.x;
  if (c < 32) {
    float acc = 0.0f;
    for (int k = 0; k < 16; k++)
      acc = __fmaf_rn(sm.x[16 * c + k], sm.x[16 * c + k], acc);
    sm.part[c] = acc;
  }
  __syncthreads();
  if (c == 0)
    sm.r = dsv4_rms_factor(dsv4_fold32(sm.part), p.eps);
  __syncthreads();
  const float y = dsv4_round_bf16(__fmul_rn(__fmul_rn(sm.x[c], sm.r), p.norm_w[c]));
  __syncthreads(); /* every thread has read x[c] and r */
  sm.x[c] = y;
  __syncthreads();
  if (c < DSV4_NTILES) {
    float amax = DSV4_AMAX_FLOOR;
    for (int k = 0; k < DSV4_TILE; k++) {
      const float a = fabsf(sm.x[DSV4_TILE * c + k]);
      amax = a > amax ? a : amax;
    }
    const dsv4_i32 e = dsv4_ue8m0_exponent(amax);
    sm.scale[c] = dsv4_pow2_neg(e);
    sm.code[c] = (uint8_t)(e + DSV4_UE8M0_BIAS);
  }
  __syncthreads();
  if (c < DSV4_NOPE_DIM) {
    data[c] = dsv4_f32_to_e4m3(__fmul_rn(y, sm.scale[c / DSV4_TILE]));
  } else if ((c & 1u) == 0) {
    const uint32_t i = (c - DSV4_NOPE_DIM) / 2;
    const float e = y, o = sm.x[c + 1], co = cs[i], sn = cs[DSV4_ROPE_PAIRS + i];
    const uint32_t be = dsv4_f32_to_bf16(dsv4_rope_even(e, o, co, sn));
    const uint32_t bo = dsv4_f32_to_bf16(dsv4_rope_odd(e, o, co, sn));
    /* Little-endian bf16 pair at byte 448 + 4i (4-byte aligned: records are 576 bytes apart). */
    *reinterpret_cast<uint32_t *>(data + DSV4_NOPE_DIM + 4 * i) = be | (bo << 16);
  }
  if (c < DSV4_SCALE_BYTES)
    scales[c] = c < DSV4_NTILES ? sm.code[c] : 0;
}

__global__ void __launch_bounds__(EMIT_THREADS) dsv4__compress_emit_kernel(comp_params_t p) {
  __shared__ emit_smem_t sm;
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  const uint32_t t = blockIdx.x, c = threadIdx.x;
  if (__ldcg(p.err) != 0)
    return; /* the check (or an earlier launch of the batch) failed: write nothing */
  const int64_t pos = p.pos[t];
  if ((pos + 1) % p.ratio != 0)
    return;
  const uint32_t s = (uint32_t)p.tok_seg[t];
  const int64_t j = pos / p.ratio;
  const uint64_t b = (uint64_t)entry_block(p, s, j); /* checked */
  const uint64_t o = (uint64_t)(j & (((int64_t)1 << p.bs_shift) - 1));
  const float *cs = p.rope + (uint64_t)(j * p.ratio) * DSV4_ROPE_ROW_FLOATS;
  const geom_t gm = geom_main(p);
  uint32_t n = gather_rows(p, gm, t, sm.rows);
  __syncthreads();
  const float z = pool_channel(sm.rows, n, c);
  sm.x[c] = dsv4_round_bf16(z);
  __syncthreads();
  uint8_t *base = p.c_cache + b * p.stride;
  emit_record(p, sm, cs, base + DSV4_TOKEN_DATA_OFFSET(o),
              base + DSV4_SCALE_OFFSET(1u << p.bs_shift, o));
  if (p.ratio != 4u)
    return;
  __syncthreads(); /* the rows of the main list are no longer read */
  const geom_t gi = geom_index(p);
  n = gather_rows(p, gi, t, sm.rows);
  __syncthreads();
  if (c < DSV4_INDEX_DIM)
    sm.zi[c] = pool_channel(sm.rows, n, c);
  __syncthreads();
  if (c == 0) {
    const uint64_t bs = 1u << p.bs_shift;
    uint8_t vals[DSV4_INDEX_VALUE_BYTES], codes[DSV4_MXFP4_BLOCKS];
    dsv4_index_key(sm.zi, p.i_norm_w, p.eps, cs, vals, codes);
    uint8_t *ib = p.i_cache + b * DSV4_INDEX_BLOCK_BYTES(bs);
    for (int k = 0; k < DSV4_INDEX_VALUE_BYTES; k++)
      ib[DSV4_INDEX_VALUE_BYTES * o + k] = vals[k];
    for (int k = 0; k < DSV4_MXFP4_BLOCKS; k++)
      ib[DSV4_INDEX_VALUE_BYTES * bs + DSV4_MXFP4_BLOCKS * o + k] = codes[k];
  }
}

/* ---- ring ---- */

/* Token t's row of one compressor into its ring: kv copied, s = gate + ape[p mod ratio]. */
static __device__ void ring_write(const comp_params_t &p, const geom_t &g, uint32_t t) {
  const int64_t pos = p.pos[t];
  const uint64_t w = g.width;
  float *row = p.ring + (uint64_t)p.seg_slot[p.tok_seg[t]] * DSV4_RING_FLOATS(p.ratio) +
               g.ring_off + (uint64_t)(pos % ring_rows(p.ratio)) * 2u * w;
  const float *in = g.in + (uint64_t)t * 2u * w;
  const float *ape = g.ape + (uint64_t)(pos % p.ratio) * w;
  for (uint32_t c = threadIdx.x; c < w; c += RING_THREADS) {
    row[c] = in[c];
    row[w + c] = in[w + c] + ape[c];
  }
}

__global__ void __launch_bounds__(RING_THREADS) dsv4__compress_ring_kernel(comp_params_t p) {
  dsv4__dep_wait_params(p);
  dsv4__dep_trigger();
  const uint32_t t = blockIdx.x, rr = ring_rows(p.ratio);
  if (__ldcg(p.err) != 0)
    return;
  /* A later token of the segment maps to the same row: it writes it (one writer per row). */
  if (t + rr < p.n_tokens && p.tok_seg[t + rr] == p.tok_seg[t])
    return;
  ring_write(p, geom_main(p), t);
  if (p.ratio == 4u)
    ring_write(p, geom_index(p), t);
}

/* ---- the launch ---- */

extern "C" int dsv4__cuda_compress(const dsv4_compress_args_t *a, const float *rope_rows_dev,
                                   int64_t max_positions, uint32_t *err_dev, cudaStream_t s,
                                   int pdl) {
  int rc = dsv4_backend_check_compress_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  if (!rope_rows_dev || max_positions <= 0 || !err_dev)
    return DSV4_EINVAL;
  const uint64_t check_bits = (uint64_t)a->n_segments + a->n_slots + 64;
  if (check_bits > CHECK_MAX_BITS || a->n_tokens > 0x7fffffffu)
    return DSV4_EINVAL;
  dsv4__cuda_dev_t dev;
  int err = dsv4__cuda_dev_info(&dev);
  if (err)
    return err;
  comp_params_t p = {};
  p.pos = a->positions;
  p.tok_seg = a->tok_seg;
  p.seg_p0 = a->seg_p0;
  p.seg_slot = a->seg_slot;
  p.ckv = a->ckv;
  p.ikv = a->ikv;
  p.ring = a->ring;
  p.ape = a->ape;
  p.norm_w = a->norm_weight;
  p.i_ape = a->i_ape;
  p.i_norm_w = a->i_norm_weight;
  p.rope = rope_rows_dev;
  p.seg_c_first_lb = a->seg_c_first_lb;
  p.seg_cbt_off = a->seg_cbt_off;
  p.seg_cbt_len = a->seg_cbt_len;
  p.c_bt = a->c_block_table;
  p.c_cache = a->c_cache;
  p.i_cache = a->i_cache;
  p.err = err_dev;
  p.stride = a->stride;
  p.max_pos = max_positions;
  p.eps = a->eps;
  p.ratio = a->ratio;
  p.n_tokens = a->n_tokens;
  p.n_segments = a->n_segments;
  p.n_slots = a->n_slots;
  p.c_bt_entries = a->c_bt_entries;
  p.c_n_blocks = a->c_n_blocks;
  while ((1u << p.bs_shift) < a->block_size)
    p.bs_shift++;
  pdl = pdl && dev.pdl;
  const size_t words = (a->n_segments + 31) / 32 + (a->n_slots + 31) / 32;
  cudaError_t e = dsv4__cuda_launch_smem(dsv4__compress_check_kernel, 1, CHECK_THREADS,
                                         words * sizeof(uint32_t), s, pdl, p);
  if (e == cudaSuccess)
    e = dsv4__cuda_launch(dsv4__compress_emit_kernel, a->n_tokens, EMIT_THREADS, s, pdl, p);
  if (e == cudaSuccess)
    e = dsv4__cuda_launch(dsv4__compress_ring_kernel, a->n_tokens, RING_THREADS, s, pdl, p);
  return dsv4__cuda_err(e);
}
