/*
 * The compressed branch on the Level Zero backend (SPEC §8.3-§8.6), included by dsv4_kernels.cl
 * (one module): the compressor with its check, the indexer with its check, and the check of the
 * compressed candidates of attention. The math is kernels/dsv4-compress.h's, the same functions
 * the CPU backend (cpu_compress.c) and the CUDA backend (compress.cu, indexer.cu) call, in the same
 * order, so the records, the index records and the selections are the CPU's bytes.
 *
 * Thread mapping of dsv4_compress_emit: one work-group of 256 work-items per emission. Work-item k
 * < |R| first describes row k of the row list R in local memory (where its kv and score live: the
 * launch's inputs when its token is in the batch, else the ring, which nothing writes during this
 * launch). Then work-item c pools channels c and c + 256 over R in R's order (the max, the sums,
 * one divide), and the record follows the SPEC §2.2 KV path (kv_norm = fused) with one owner per
 * output byte: the 32 canonical partials of the sum of squares by work-items 0..31, the tile
 * maxima by work-items 0..6, the NoPE byte and the RoPE pair of each dim by the work-item that
 * owns the dim, the scale bytes by work-items 0..7. At ratio 4 work-items 0..127 pool the index
 * key's channels the same way and work-item 0 computes its 68-byte record.
 *
 * dsv4_index_select: one work-group of 256 per token in turn. A token that sees more than topk
 * entries computes q^ of every head (one work-item per head) and the weights into its group's
 * scratch, then one work-item per entry its score key (dsv4_index_score_key) into the group's key
 * scratch; a radix select (8 bits at a time from the top, a local histogram per round) finds the
 * k-th largest key T and how many keys equal to T are taken, and a last pass in entry order, 256
 * keys at a time with two work-group prefix sums, lists every key above T and the first of those
 * equal to it: cpu_compress.c's select_topk, whose result depends on the keys alone.
 */

#ifndef DSV4_KERNELS_LEVEL_ZERO_DSV4_COMPRESS_CL
#define DSV4_KERNELS_LEVEL_ZERO_DSV4_COMPRESS_CL

#include "dsv4-compress.h"

/*
 * Functions that take a kernel's __local arrays are always inlined. A call that is not inlined and
 * always passes the same array lets an optimiser bind the array into the callee (interprocedural
 * constant propagation); PoCL then gives the kernel's work-groups their own local memory but
 * leaves the callee reading the module's one copy (seen with PoCL 3.1: every row descriptor read
 * back as another work-group's).
 */
#define LOCAL_FN static inline __attribute__((always_inline))

#ifdef DSV4_CL_RMS_FP64
/* The index key's RMS factor (dsv4_index_rms_factor) with SPEC §2's double-precision sqrt and
 * divide, which give the correctly rounded fp32 results. */
static float index_rms_factor(float ss, float eps) {
  float t = ss * 0x1p-7f;
  t = t + eps;
  float s = (float)sqrt((double)t);
  return (float)(1.0 / (double)s);
}
#else
#define index_rms_factor dsv4_index_rms_factor
#endif

/* dsv4_index_key with the module's RMS factor: the same operations in the same order. */
static void index_key(const float *z, const float *w, float eps, const float *rope_row, uchar *vals,
                      uchar *codes) {
  float y[DSV4_INDEX_DIM];
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    y[d] = dsv4_round_bf16(z[d]);
  float r = index_rms_factor(dsv4_sumsq128(y), eps);
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    y[d] = dsv4_round_bf16((y[d] * r) * w[d]);
  dsv4_index_rope(y, rope_row);
  dsv4_hadamard128(y);
  dsv4_mxfp4_quant128(y, vals, codes);
}

/*
 * The error bits of logical block lb of a segment whose table starts at entry bt_off with bt_len
 * entries for logical blocks first_lb..: 0 when it maps to a block of the pool. Nothing is read
 * past bt_entries (when that is not 0).
 */
static uint block_bits(long lb, long first_lb, uint bt_off, uint bt_len, __global const int *table,
                       uint bt_entries, uint n_blocks) {
  long idx = lb - first_lb;
  if (idx < 0 || idx >= (long)bt_len)
    return DSV4_LZ_ERR_MISSING;
  ulong e = (ulong)bt_off + (ulong)idx;
  if (bt_entries && e >= bt_entries)
    return DSV4_LZ_ERR_TABLE;
  int b = table[e];
  if (b < 0)
    return DSV4_LZ_ERR_MISSING;
  return (uint)b >= n_blocks ? DSV4_LZ_ERR_BLOCK : 0u;
}

/* The error bit of a segment whose table runs past bt_entries (when that is not 0). */
static uint table_bits(uint s, __global const uint *bt_off, __global const uint *bt_len,
                       uint bt_entries) {
  return bt_entries && (ulong)bt_off[s] + bt_len[s] > bt_entries ? DSV4_LZ_ERR_TABLE : 0u;
}

/* ---- the compressor (SPEC §8.3) ---- */

/*
 * One work-item per token (and at least one per segment), as cpu_compress.c's compress_validate:
 * each segment's table within c_bt_entries; a token's segment in range, its position p0 <= p <
 * max_pos with p0 >= 0, one past its predecessor's when that is of the same segment; a segment's
 * tokens one run (seen[s] counts its runs) with a state slot of its own (seen[n_segments + slot]
 * counts the segments on it); and the block of every emitted entry.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_MAP_GROUP_SIZE, 1, 1))) void
dsv4_compress_check(uint n_tokens, uint n_segments, uint ratio, uint block_size, uint n_slots,
                    uint c_n_blocks, uint c_bt_entries, long max_pos,
                    __global const long *positions, __global const int *tok_seg,
                    __global const long *seg_p0, __global const uint *seg_slot,
                    __global const long *seg_c_first_lb, __global const uint *seg_cbt_off,
                    __global const uint *seg_cbt_len, __global const int *c_block_table,
                    __global uint *seen, __global uint *err) {
  size_t t = get_global_id(0);
  uint bits = 0;
  if (t < n_segments)
    bits |= table_bits((uint)t, seg_cbt_off, seg_cbt_len, c_bt_entries);
  if (t < n_tokens) {
    int s = tok_seg[t];
    long p = positions[t], p0 = 0;
    if (s < 0 || (uint)s >= n_segments) {
      bits |= DSV4_LZ_ERR_SEGMENT;
    } else if ((p0 = seg_p0[s]) < 0 || p < p0 || p >= max_pos) {
      bits |= DSV4_LZ_ERR_POSITION;
    } else {
      if (t > 0 && tok_seg[t - 1] == s) {
        if (p != positions[t - 1] + 1)
          bits |= DSV4_LZ_ERR_POSITION;
      } else if (atomic_inc(&seen[s]) != 0) {
        bits |= DSV4_LZ_ERR_SEGMENT; /* a second run of the segment */
      } else if (seg_slot[s] >= n_slots || atomic_inc(&seen[n_segments + seg_slot[s]]) != 0) {
        bits |= DSV4_LZ_ERR_STATE;
      }
      if ((p + 1) % ratio == 0)
        bits |= block_bits(p / ratio / block_size, seg_c_first_lb[s], seg_cbt_off[s],
                           seg_cbt_len[s], c_block_table, c_bt_entries, c_n_blocks);
    }
  }
  if (bits)
    atomic_or(err, bits);
}

/* The row geometry of one compressor: the main one, or the indexer's at ratio 4 (cpu_compress.c's
 * comp_geom_t). */
typedef struct {
  uint width;                 /* W: kv floats of a row; the scores follow */
  uint channels;              /* pooled channels: W at ratio 128, W / 2 (one half) at ratio 4 */
  __global const float *in;   /* [n_tokens, 2W]: kv then gate */
  __global const float *ape;  /* [ratio, W] */
  __global const float *ring; /* this compressor's row 0 in the segment's state slot */
} geom_t;

/* What the local memory says of row k of R: src >= 0 is the batch token whose inputs hold it,
 * src < 0 the ring row -1 - src; q its position; off its channel offset (half B at ratio 4). */
typedef struct {
  __global const float *kv, *s, *ape; /* ape NULL: a ring row, which holds the score's sum */
} row_t;

static row_t row_of(const geom_t *g, long src, long q, uint off, uint ratio) {
  row_t r;
  if (src >= 0) {
    __global const float *in = g->in + (ulong)src * 2u * g->width;
    r.kv = in + off;
    r.s = in + g->width + off;
    r.ape = g->ape + (ulong)(q % (long)ratio) * g->width + off;
  } else {
    __global const float *row = g->ring + (ulong)(-1 - src) * 2u * g->width;
    r.kv = row + off;
    r.s = row + g->width + off;
    r.ape = 0;
  }
  return r;
}

static float row_score(row_t r, uint c) {
  return r.ape ? r.s[c] + r.ape[c] : r.s[c];
}

/*
 * The row list R of token t's entry into src[] and q[] (work-item k describes row k): ratio 4
 * takes half A of the previous window, then half B of its own; only positions >= max(0, p0) exist.
 * Returns |R|; *na receives the rows of half A.
 */
LOCAL_FN uint gather_rows(uint t, long p, long lo, int s, uint ratio, __global const int *tok_seg,
                          __local long *src, __local long *qs, uint *na) {
  long first = p / ratio * ratio;
  long a0 = max(first - 4, lo), a1 = ratio == 4u ? first - 1 : a0 - 1;
  long b0 = max(first, lo);
  *na = a1 >= a0 ? (uint)(a1 - a0 + 1) : 0u;
  uint n = *na + (uint)(p - b0 + 1);
  uint k = (uint)get_local_id(0);
  if (k < n) {
    long q = k < *na ? a0 + k : b0 + (k - *na);
    long back = p - q;
    src[k] = back <= (long)t && tok_seg[t - back] == s ? (long)t - back
                                                       : -1 - q % (long)DSV4_RING_ROWS(ratio);
    qs[k] = q;
  }
  return n;
}

/* Channel c pooled over R (dsv4-compress.h): the max, the in-order sums, one divide. */
LOCAL_FN float pool_channel(const geom_t *g, __local const long *src, __local const long *qs,
                            uint n, uint na, uint ratio, uint c) {
  uint off_b = ratio == 4u ? g->channels : 0u;
  float m = row_score(row_of(g, src[0], qs[0], na ? 0u : off_b, ratio), c);
  for (uint k = 1; k < n; k++)
    m = dsv4_pool_max(m, row_score(row_of(g, src[k], qs[k], k < na ? 0u : off_b, ratio), c));
  float sum = 0.0f, num = 0.0f;
  for (uint k = 0; k < n; k++) {
    row_t r = row_of(g, src[k], qs[k], k < na ? 0u : off_b, ratio);
    dsv4_pool_add(row_score(r, c), r.kv[c], m, &sum, &num);
  }
  return quotient(num, sum);
}

/*
 * The 584-byte record of x (the pooled z rounded to bf16, in local memory) into data and scales:
 * the SPEC §2.2 KV path with kv_norm = fused, as cpu_kernels.c's kv_token_scalar computes it.
 * Every work-item of the group calls it (it holds barriers); work-item c owns dims c and c + 256.
 */
LOCAL_FN void emit_record(__local float *x, __local float *part, __local float *tscale,
                          __local uchar *tcode, __global const float *norm_w, float eps,
                          __global const float *cs, __global uchar *data, __global uchar *scales) {
  uint c = (uint)get_local_id(0);
  if (c < DSV4_LZ_LANES) {
    float acc = 0.0f;
    for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
      acc = fma(x[16 * c + k], x[16 * c + k], acc);
    part[c] = acc;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  float p[DSV4_LZ_LANES];
  for (int l = 0; l < DSV4_LZ_LANES; l++)
    p[l] = part[l];
  float r = rms_factor(dsv4_fold32(p), eps);
  float y0 = dsv4_round_bf16((x[c] * r) * norm_w[c]);
  float y1 = dsv4_round_bf16((x[c + 256] * r) * norm_w[c + 256]);
  barrier(CLK_LOCAL_MEM_FENCE); /* every work-item has read x */
  x[c] = y0;
  x[c + 256] = y1;
  barrier(CLK_LOCAL_MEM_FENCE);
  if (c < DSV4_NTILES) {
    float amax = DSV4_AMAX_FLOOR;
    for (int k = 0; k < DSV4_TILE; k++) {
      float a = fabs(x[DSV4_TILE * c + k]);
      amax = a > amax ? a : amax;
    }
    dsv4_i32 e = dsv4_ue8m0_exponent(amax);
    tscale[c] = dsv4_pow2_neg(e);
    tcode[c] = (uchar)(e + DSV4_UE8M0_BIAS);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint d = c; d < DSV4_HEAD_DIM; d += 256) {
    if (d < DSV4_NOPE_DIM) {
      data[d] = dsv4_f32_to_e4m3(x[d] * tscale[d / DSV4_TILE]);
    } else if ((d & 1u) == 0) {
      uint i = (d - DSV4_NOPE_DIM) / 2;
      float e = x[d], o = x[d + 1], co = cs[i], sn = cs[DSV4_ROPE_PAIRS + i];
      ushort be = dsv4_f32_to_bf16(dsv4_rope_even(e, o, co, sn));
      ushort bo = dsv4_f32_to_bf16(dsv4_rope_odd(e, o, co, sn));
      /* Little-endian bf16, the pair at bytes 448 + 4i. */
      data[DSV4_NOPE_DIM + 4 * i] = (uchar)(be & 0xffu);
      data[DSV4_NOPE_DIM + 4 * i + 1] = (uchar)(be >> 8);
      data[DSV4_NOPE_DIM + 4 * i + 2] = (uchar)(bo & 0xffu);
      data[DSV4_NOPE_DIM + 4 * i + 3] = (uchar)(bo >> 8);
    }
  }
  if (c < DSV4_SCALE_BYTES)
    scales[c] = c < DSV4_NTILES ? tcode[c] : (uchar)0;
}

/* The 68-byte index record of the pooled zi (local) into the entry's place in the index block:
 * one work-item, in private memory, as dsv4_index_key wants it. */
LOCAL_FN void emit_index(__local const float *zi, __global const float *i_norm_w, float eps,
                         __global const float *cs, __global uchar *ib, ulong o, uint block_size) {
  float z[DSV4_INDEX_DIM], w[DSV4_INDEX_DIM], row[DSV4_ROPE_ROW_FLOATS];
  uchar vals[DSV4_INDEX_VALUE_BYTES], codes[DSV4_MXFP4_BLOCKS];
  for (int d = 0; d < DSV4_INDEX_DIM; d++) {
    z[d] = zi[d];
    w[d] = i_norm_w[d];
  }
  for (int i = 0; i < DSV4_ROPE_ROW_FLOATS; i++)
    row[i] = cs[i];
  index_key(z, w, eps, row, vals, codes);
  for (int k = 0; k < DSV4_INDEX_VALUE_BYTES; k++)
    ib[DSV4_INDEX_VALUE_BYTES * o + k] = vals[k];
  for (int k = 0; k < DSV4_MXFP4_BLOCKS; k++)
    ib[(ulong)DSV4_INDEX_VALUE_BYTES * block_size + DSV4_MXFP4_BLOCKS * o + k] = codes[k];
}

/* The ring of a segment's state slot, and the indexer's rows in it (at ratio 4). */
static __global float *ring_of(__global float *ring, uint slot, uint ratio) {
  return ring + (ulong)slot * DSV4_RING_FLOATS(ratio);
}
#define INDEX_RING_OFF (DSV4_RING_ROWS(4u) * 2u * (2u * DSV4_HEAD_DIM))

__kernel __attribute__((reqd_work_group_size(DSV4_LZ_GROUP_SIZE, 1, 1))) void dsv4_compress_emit(
    uint e0, uint n_emit, __global const uint *emit_tok, __global const float *emit_rope,
    uint ratio, __global const long *positions, __global const int *tok_seg,
    __global const long *seg_p0, __global const uint *seg_slot, __global const float *ckv,
    __global const float *ikv, __global float *ring, __global const float *ape,
    __global const float *norm_w, __global const float *i_ape, __global const float *i_norm_w,
    float eps, __global const long *seg_c_first_lb, __global const uint *seg_cbt_off,
    __global const int *c_block_table, uint c_n_blocks, __global uchar *c_cache,
    __global uchar *i_cache, uint block_size, ulong stride, __global const uint *err) {
  __local long src[DSV4_LZ_POOL_ROWS], qs[DSV4_LZ_POOL_ROWS];
  __local float x[DSV4_HEAD_DIM], zi[DSV4_INDEX_DIM], part[DSV4_LZ_LANES];
  __local float tscale[DSV4_NTILES];
  __local uchar tcode[DSV4_NTILES];
  ulong e = (ulong)e0 + get_group_id(0);
  uint c = (uint)get_local_id(0);
  /* The check (or an earlier launch of the batch) failed: write nothing. */
  if (*err || e >= n_emit)
    return;
  uint t = emit_tok[e];
  int s = tok_seg[t];
  long p = positions[t], j = p / ratio;
  long idx = j / block_size - seg_c_first_lb[s];
  int b = c_block_table[seg_cbt_off[s] + idx]; /* checked by dsv4_compress_check */
  if ((p + 1) % ratio != 0 || b < 0 || (uint)b >= c_n_blocks)
    return; /* never with a checked launch; nothing is written out of bounds anyway */
  ulong o = (ulong)(j % block_size);
  __global const float *cs = emit_rope + e * DSV4_ROPE_ROW_FLOATS;
  __global float *slot_ring = ring_of(ring, seg_slot[s], ratio);
  geom_t gm = {(ratio == 4u ? 2u : 1u) * DSV4_HEAD_DIM, DSV4_HEAD_DIM, ckv, ape, slot_ring};
  uint na, n = gather_rows(t, p, seg_p0[s], s, ratio, tok_seg, src, qs, &na);
  barrier(CLK_LOCAL_MEM_FENCE);
  x[c] = dsv4_round_bf16(pool_channel(&gm, src, qs, n, na, ratio, c));
  x[c + 256] = dsv4_round_bf16(pool_channel(&gm, src, qs, n, na, ratio, c + 256));
  barrier(CLK_LOCAL_MEM_FENCE);
  __global uchar *base = c_cache + (ulong)b * stride;
  emit_record(x, part, tscale, tcode, norm_w, eps, cs, base + DSV4_TOKEN_DATA_OFFSET(o),
              base + DSV4_SCALE_OFFSET(block_size, o));
  if (ratio != 4u)
    return;
  barrier(CLK_LOCAL_MEM_FENCE); /* the main list's rows are no longer read */
  geom_t gi = {2u * DSV4_INDEX_DIM, DSV4_INDEX_DIM, ikv, i_ape, slot_ring + INDEX_RING_OFF};
  n = gather_rows(t, p, seg_p0[s], s, ratio, tok_seg, src, qs, &na);
  barrier(CLK_LOCAL_MEM_FENCE);
  if (c < DSV4_INDEX_DIM)
    zi[c] = pool_channel(&gi, src, qs, n, na, ratio, c);
  barrier(CLK_LOCAL_MEM_FENCE);
  if (c == 0)
    emit_index(zi, i_norm_w, eps, cs, i_cache + (ulong)b * DSV4_INDEX_BLOCK_BYTES(block_size), o,
               block_size);
}

/* Token t's row of one compressor into its ring: kv copied, s = gate + ape[p mod ratio]. */
static void ring_write(const geom_t *g, __global float *slot_ring, uint t, long p, uint ratio) {
  __global float *row = slot_ring + (ulong)(p % (long)DSV4_RING_ROWS(ratio)) * 2u * g->width;
  __global const float *in = g->in + (ulong)t * 2u * g->width;
  __global const float *a = g->ape + (ulong)(p % (long)ratio) * g->width;
  for (uint c = (uint)get_local_id(0); c < g->width; c += DSV4_LZ_GROUP_SIZE) {
    row[c] = in[c];
    row[g->width + c] = in[g->width + c] + a[c];
  }
}

/* The ring rows: a token whose segment has a token DSV4_RING_ROWS positions later leaves its row
 * to that token, so every row is written once, by the last token that maps to it. */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_GROUP_SIZE, 1, 1))) void
dsv4_compress_ring(uint t0, uint n_tokens, uint ratio, __global const long *positions,
                   __global const int *tok_seg, __global const uint *seg_slot,
                   __global const float *ckv, __global const float *ikv, __global float *ring,
                   __global const float *ape, __global const float *i_ape,
                   __global const uint *err) {
  ulong t = (ulong)t0 + get_group_id(0);
  ulong rr = DSV4_RING_ROWS(ratio);
  if (*err || t >= n_tokens || (t + rr < n_tokens && tok_seg[t + rr] == tok_seg[t]))
    return;
  long p = positions[t];
  __global float *slot_ring = ring_of(ring, seg_slot[tok_seg[t]], ratio);
  geom_t gm = {(ratio == 4u ? 2u : 1u) * DSV4_HEAD_DIM, DSV4_HEAD_DIM, ckv, ape, 0};
  ring_write(&gm, slot_ring, (uint)t, p, ratio);
  if (ratio != 4u)
    return;
  geom_t gi = {2u * DSV4_INDEX_DIM, DSV4_INDEX_DIM, ikv, i_ape, 0};
  ring_write(&gi, slot_ring + INDEX_RING_OFF, (uint)t, p, ratio);
}

/* ---- the indexer (SPEC §8.5) ---- */

/*
 * One work-item per token (and at least one per segment), as cpu_compress.c's indexer_validate:
 * each segment's table within c_bt_entries, a token's segment and position, and for a token that
 * scores (more than topk visible entries) the block of every visible entry. A token whose
 * predecessor of the same segment, one position before, also scored checks only the blocks past
 * the predecessor's last one: the two see entries from the same first one.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_MAP_GROUP_SIZE, 1, 1))) void
dsv4_index_check(uint n_tokens, uint n_segments, uint topk, uint block_size, uint c_n_blocks,
                 uint c_bt_entries, long max_pos, __global const long *positions,
                 __global const int *tok_seg, __global const long *seg_p0,
                 __global const long *seg_c_first_lb, __global const uint *seg_cbt_off,
                 __global const uint *seg_cbt_len, __global const int *c_block_table,
                 __global uint *err) {
  size_t t = get_global_id(0);
  uint bits = 0;
  if (t < n_segments)
    bits |= table_bits((uint)t, seg_cbt_off, seg_cbt_len, c_bt_entries);
  if (t < n_tokens) {
    int s = tok_seg[t];
    long p = positions[t], p0 = 0;
    if (s < 0 || (uint)s >= n_segments) {
      bits |= DSV4_LZ_ERR_SEGMENT;
    } else if ((p0 = seg_p0[s]) < 0 || p < p0 || p >= max_pos) {
      bits |= DSV4_LZ_ERR_POSITION;
    } else if ((p + 1) / 4 - p0 / 4 > (long)topk) {
      long jlo = p0 / 4, lb = jlo / block_size, lb_hi = ((p + 1) / 4 - 1) / block_size;
      if (t > 0 && tok_seg[t - 1] == s && positions[t - 1] == p - 1 && p / 4 - jlo > (long)topk)
        lb = max(lb, (p / 4 - 1) / (long)block_size);
      for (; lb <= lb_hi && !bits; lb++)
        bits |= block_bits(lb, seg_c_first_lb[s], seg_cbt_off[s], seg_cbt_len[s], c_block_table,
                           c_bt_entries, c_n_blocks);
    }
  }
  if (bits)
    atomic_or(err, bits);
}

/* dsv4_dot128 with q^ in global memory: the same 8 fma chains of 16 and the same fold. */
static float dot128_g(__global const float *q, const float *k) {
  float p[8];
  for (int l = 0; l < 8; l++) {
    float acc = 0.0f;
    for (int i = 0; i < 16; i++)
      acc = fma(q[16 * l + i], k[16 * l + i], acc);
    p[l] = acc;
  }
  return dsv4_fold8(p);
}

/* q^ of head h of token t (dsv4_index_query, in private memory) into qh, and its weight. */
static void index_head(__global const ushort *iq, __global const float *cs, __global float *qh) {
  ushort x[DSV4_INDEX_DIM];
  float row[DSV4_ROPE_ROW_FLOATS], q[DSV4_INDEX_DIM];
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    x[d] = iq[d];
  for (int i = 0; i < DSV4_ROPE_ROW_FLOATS; i++)
    row[i] = cs[i];
  dsv4_index_query(x, row, q);
  for (int d = 0; d < DSV4_INDEX_DIM; d++)
    qh[d] = q[d];
}

/* The score key of entry j (SPEC §8.5): its record dequantised once, the heads in order. */
static uint entry_key(long j, __global const int *table, long lb0, __global const uchar *i_cache,
                      uint block_size, uint n_heads, __global const float *qg,
                      __global const float *wg) {
  ulong bs = block_size, o = (ulong)(j % (long)bs);
  __global const uchar *blk =
      i_cache + (ulong)table[j / (long)bs - lb0] * DSV4_INDEX_BLOCK_BYTES(bs);
  uchar vals[DSV4_INDEX_VALUE_BYTES], codes[DSV4_MXFP4_BLOCKS];
  float k[DSV4_INDEX_DIM];
  for (int i = 0; i < DSV4_INDEX_VALUE_BYTES; i++)
    vals[i] = blk[DSV4_INDEX_VALUE_BYTES * o + i];
  for (int i = 0; i < DSV4_MXFP4_BLOCKS; i++)
    codes[i] = blk[DSV4_INDEX_VALUE_BYTES * bs + DSV4_MXFP4_BLOCKS * o + i];
  dsv4_mxfp4_dequant128(vals, codes, k);
  float acc = 0.0f;
  for (uint h = 0; h < n_heads; h++)
    acc = dsv4_index_score_add(wg[h], dot128_g(qg + (ulong)h * DSV4_INDEX_DIM, k), acc);
  return dsv4_index_score_key(acc);
}

/* The exclusive prefix sum of v over the work-group (in work-item order), and the total. */
LOCAL_FN uint group_scan(uint v, __local uint *sc, uint *total) {
  uint lid = (uint)get_local_id(0);
  sc[lid] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint off = 1; off < DSV4_LZ_GROUP_SIZE; off <<= 1) {
    uint add = lid >= off ? sc[lid - off] : 0u;
    barrier(CLK_LOCAL_MEM_FENCE);
    sc[lid] += add;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  uint incl = sc[lid];
  *total = sc[DSV4_LZ_GROUP_SIZE - 1];
  barrier(CLK_LOCAL_MEM_FENCE); /* sc is rewritten by the next scan */
  return incl - v;
}

/* The k-th largest of the n keys, T, and in *need how many keys equal to T the top k take:
 * cpu_compress.c's select_topk, one local histogram per 8 bits. */
LOCAL_FN uint radix_select(__global const uint *keys, uint n, uint k, __local uint *hist,
                           __local uint *shared2, uint *need_out) {
  uint lid = (uint)get_local_id(0), prefix = 0, mask = 0, need = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[lid] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint i = lid; i < n; i += DSV4_LZ_GROUP_SIZE)
      if ((keys[i] & mask) == prefix)
        atomic_inc(&hist[(keys[i] >> shift) & 255u]);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
      /* The keys matching prefix number at least need, so some bucket reaches it. */
      uint b = 255;
      while (hist[b] < need) {
        need -= hist[b];
        b--;
      }
      shared2[0] = prefix | (b << shift);
      shared2[1] = need;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    prefix = shared2[0];
    need = shared2[1];
    mask |= 255u << shift;
    barrier(CLK_LOCAL_MEM_FENCE); /* shared2 and hist are rewritten by the next round */
  }
  *need_out = need;
  return prefix;
}

/* Every key above T and the first need keys equal to T, in entry order, into out[0..k). */
LOCAL_FN void list_selected(__global const uint *keys, uint n, uint T, uint need, long jlo,
                            __global int *out, __local uint *sc) {
  uint lid = (uint)get_local_id(0), taken = 0, ties = 0;
  for (uint base = 0; base < n; base += DSV4_LZ_GROUP_SIZE) {
    uint i = base + lid;
    uint key = i < n ? keys[i] : 0u;
    uint eq = i < n && key == T ? 1u : 0u, n_eq, n_take;
    uint eq_before = group_scan(eq, sc, &n_eq);
    uint take = (i < n && key > T) || (eq && ties + eq_before < need) ? 1u : 0u;
    uint at = group_scan(take, sc, &n_take);
    if (take)
      out[taken + at] = (int)(jlo + i);
    taken += n_take;
    ties += n_eq;
  }
}

__kernel __attribute__((reqd_work_group_size(DSV4_LZ_GROUP_SIZE, 1, 1))) void dsv4_index_select(
    uint n_tokens, uint topk, uint n_heads, float w_scale, __global const long *positions,
    __global const int *tok_seg, __global const long *seg_p0, __global const ushort *iq,
    __global const float *iw, __global const float *rope_rows, __global const long *seg_c_first_lb,
    __global const uint *seg_cbt_off, __global const int *c_block_table,
    __global const uchar *i_cache, uint block_size, __global int *sel, __global uint *keys,
    ulong keys_per_group, __global float *qhat, __global const uint *err) {
  __local uint hist[DSV4_LZ_GROUP_SIZE], sc[DSV4_LZ_GROUP_SIZE], shared2[2];
  if (*err)
    return; /* the check (or an earlier launch of the batch) failed: write nothing */
  uint lid = (uint)get_local_id(0);
  ulong g = get_group_id(0), ng = get_num_groups(0);
  __global uint *key = keys + g * keys_per_group;
  __global float *qg = qhat + g * DSV4_LZ_QHAT_FLOATS(n_heads);
  __global float *wg = qg + (ulong)n_heads * DSV4_INDEX_DIM;
  for (ulong t = g; t < n_tokens; t += ng) {
    int s = tok_seg[t];
    long p = positions[t], jlo = seg_p0[s] / 4, jhi = (p + 1) / 4;
    long n = jhi > jlo ? jhi - jlo : 0;
    __global int *out = sel + t * topk;
    if (n <= (long)topk || (ulong)n > keys_per_group) { /* the second never with a checked launch */
      for (uint k = lid; k < topk; k += DSV4_LZ_GROUP_SIZE)
        out[k] = k < n ? (int)(jlo + k) : -1;
      continue;
    }
    for (uint h = lid; h < n_heads; h += DSV4_LZ_GROUP_SIZE) {
      ulong r = t * n_heads + h;
      index_head(iq + r * DSV4_INDEX_DIM, rope_rows + t * DSV4_ROPE_ROW_FLOATS,
                 qg + (ulong)h * DSV4_INDEX_DIM);
      wg[h] = iw[r] * w_scale;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    __global const int *table = c_block_table + seg_cbt_off[s];
    for (uint i = lid; i < (uint)n; i += DSV4_LZ_GROUP_SIZE)
      key[i] = entry_key(jlo + i, table, seg_c_first_lb[s], i_cache, block_size, n_heads, qg, wg);
    barrier(CLK_GLOBAL_MEM_FENCE);
    uint need, T = radix_select(key, (uint)n, topk, hist, shared2, &need);
    list_selected(key, (uint)n, T, need, jlo, out, sc);
    barrier(CLK_GLOBAL_MEM_FENCE); /* q^ and the keys are rewritten for the next token */
  }
}

/* ---- attention's compressed candidates (SPEC §8.6) ---- */

/*
 * One work-item per token (and at least one per segment), after dsv4_attn_check: each segment's
 * compressed table within c_bt_entries, and every compressed candidate of a token
 * (cpu_attention.c's validate_entries): in the range form the blocks of its visible entries; with a
 * selection, every listed entry visible and above the one before, and its block. A token whose
 * segment or position dsv4_attn_check refuses is left to it.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_MAP_GROUP_SIZE, 1, 1))) void
dsv4_attn_c_check(uint n_tokens, uint n_segments, uint ratio, uint block_size, uint c_n_blocks,
                  uint c_bt_entries, __global const long *positions, __global const int *tok_seg,
                  __global const long *seg_p0, __global const long *seg_c_first_lb,
                  __global const uint *seg_cbt_off, __global const uint *seg_cbt_len,
                  __global const int *c_block_table, __global const int *c_sel, uint c_sel_stride,
                  __global uint *err) {
  size_t t = get_global_id(0);
  uint bits = 0;
  if (t < n_segments)
    bits |= table_bits((uint)t, seg_cbt_off, seg_cbt_len, c_bt_entries);
  int s = t < n_tokens ? tok_seg[t] : -1;
  if (s >= 0 && (uint)s < n_segments && seg_p0[s] >= 0 && positions[t] >= seg_p0[s]) {
    long bs = (long)block_size, j_lo = seg_p0[s] / ratio, j_hi = (positions[t] + 1) / ratio;
    long first_lb = seg_c_first_lb[s];
    uint off = seg_cbt_off[s], len = seg_cbt_len[s];
    if (!c_sel_stride) {
      for (long lb = j_lo / bs; j_hi > j_lo && lb <= (j_hi - 1) / bs && !bits; lb++)
        bits |= block_bits(lb, first_lb, off, len, c_block_table, c_bt_entries, c_n_blocks);
    } else {
      __global const int *row = c_sel + t * c_sel_stride;
      for (uint k = 0; k < c_sel_stride && row[k] != -1 && !bits; k++) {
        long j = row[k];
        if (j < j_lo || j >= j_hi || (k && j <= row[k - 1]))
          bits |= DSV4_LZ_ERR_ENTRY;
        else if (!k || j / bs != row[k - 1] / bs)
          bits |= block_bits(j / bs, first_lb, off, len, c_block_table, c_bt_entries, c_n_blocks);
      }
    }
  }
  if (bits)
    atomic_or(err, bits);
}

#endif /* DSV4_KERNELS_LEVEL_ZERO_DSV4_COMPRESS_CL */
