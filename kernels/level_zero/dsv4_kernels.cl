/*
 * The Level Zero backend's kernels in OpenCL C (SPEC §2-3, §5, §7): the slot map producer, the
 * fused Q/KV norm + RoPE + fp8 insert consumer, and exact-mode attention after the insert. The
 * build compiles this file to SPIR-V for Intel GPUs; the tests build the same file with PoCL and
 * compare it with the CPU reference byte for byte.
 *
 * Build options (the same everywhere): -cl-fp32-correctly-rounded-divide-sqrt, -I <kernels/>, and
 * never -cl-denorms-are-zero, -cl-mad-enable or -cl-fast-relaxed-math.
 *
 * Test-only macros (never set in the daemon's SPIR-V):
 *   DSV4_CL_COUNT_STORES       every global store of the slot map and the insert also increments
 *                              one counter per stored byte (extra kernel arguments), so a test can
 *                              prove SPEC §5.1.
 *   DSV4_CL_BROKEN_BULK_STORE  the vLLM XPU bug on purpose: lanes 0..3 of a KV row store the
 *                              unrotated RoPE values while lanes 28..31 store the rotated ones over
 *                              the same bytes, with nothing ordering the two.
 * DSV4_CL_RMS_FP64 selects the SPEC §2 double-precision divide and sqrt (the RMS factor and
 * attention's quotient), for devices whose fp32 divide and sqrt are not correctly rounded.
 *
 * Thread mapping of dsv4_qkv_insert (lz_kernels.h): one row of 512 values per 32 lanes, lane l
 * owning dims 16l..16l+15, 8 rows per work-group. A lane computes the canonical partial of its 16
 * dims; the 32 partials meet in local memory and every lane folds them in the canonical order, so
 * each lane holds the RMS factor without a second barrier. The four lanes of a 64-value scale tile
 * meet once more in local memory for the tile maximum. Every output byte has one owning lane,
 * which computes its final value in registers and stores it once: NoPE fp8 bytes and Q dims by
 * their lane, RoPE bf16 by lanes 28..31, scale code j by lane 4j, the scale pad byte by lane 28.
 */
#pragma OPENCL FP_CONTRACT OFF

#include "dsv4-numerics.h"
#include "level_zero/lz_kernels.h"

#ifndef __ENDIAN_LITTLE__
#error "the cache stores bf16 little-endian: this device is big-endian"
#endif

#ifdef DSV4_CL_RMS_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
/* SPEC §2: (float)sqrt((double)v) and (float)(1.0 / (double)s) equal the correctly rounded fp32
 * results, for devices whose fp32 divide and sqrt are not. */
static float rms_factor(float ss, float eps) {
  float t = ss * 0x1p-9f;
  t = t + eps;
  float s = (float)sqrt((double)t);
  return (float)(1.0 / (double)s);
}
#else
#define rms_factor dsv4_rms_factor
#endif

#ifdef DSV4_CL_COUNT_STORES
#define MAP_COUNT_ARGS , __global uint *slot_count
#define INSERT_COUNT_ARGS , __global uint *q_count, __global uint *cache_count
#define CACHE_COUNT_ARG , __global uint *cache_count
#define CACHE_COUNT_PASS , cache_count
/* n bytes stored at byte offset off of the region whose counters are cnt. */
#define COUNT(cnt, off, n)                                                                         \
  do {                                                                                             \
    for (uint k_ = 0; k_ < (uint)(n); k_++)                                                        \
      atomic_inc(&(cnt)[(off) + k_]);                                                              \
  } while (0)
#else
#define MAP_COUNT_ARGS
#define INSERT_COUNT_ARGS
#define CACHE_COUNT_ARG
#define CACHE_COUNT_PASS
#define COUNT(cnt, off, n) ((void)0)
#endif

/* Every global store of the launch goes through one of these. Offsets are in elements of the
 * destination (slots, q_out) or in bytes (cache). */
#define STORE_SLOT(t, v)                                                                           \
  do {                                                                                             \
    slots[(t)] = (v);                                                                              \
    COUNT(slot_count, (size_t)(t)*8u, 8u);                                                         \
  } while (0)
#define STORE_Q16(idx, arr)                                                                        \
  do {                                                                                             \
    vstore16(vload16(0, (arr)), 0, q_out + (idx));                                                 \
    COUNT(q_count, (size_t)(idx)*2u, 32u);                                                         \
  } while (0)
#define STORE_CACHE_U8X16(off, arr)                                                                \
  do {                                                                                             \
    vstore16(vload16(0, (arr)), 0, cache + (off));                                                 \
    COUNT(cache_count, (off), 16u);                                                                \
  } while (0)
#define STORE_CACHE_BF16X16(off, arr)                                                              \
  do {                                                                                             \
    vstore16(vload16(0, (arr)), 0, (__global ushort *)(cache + (off)));                            \
    COUNT(cache_count, (off), 32u);                                                                \
  } while (0)
#define STORE_CACHE_U8(off, v)                                                                     \
  do {                                                                                             \
    cache[(off)] = (v);                                                                            \
    COUNT(cache_count, (off), 1u);                                                                 \
  } while (0)

/*
 * The producer: one work-item per token (and at least one per segment). A token whose logical
 * block is not in its segment's block table (or maps to a negative id) gets slot -1. Arguments the
 * CPU backend would refuse (a segment index out of range, a negative position, a block id beyond
 * the pool, a segment whose table runs past bt_entries when that is not 0) set a bit of *err and
 * give slot -1, so the launch never reads or writes out of bounds; the host turns the bits into an
 * error.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_MAP_GROUP_SIZE, 1, 1))) void
dsv4_map_slots(uint n_tokens, uint block_size, uint n_blocks, __global const long *positions,
               __global const int *tok_seg, __global const long *seg_first_lb,
               __global const uint *seg_bt_off, __global const uint *seg_bt_len,
               __global const int *block_table, uint n_segments, __global long *slots,
               __global uint *err, uint bt_entries MAP_COUNT_ARGS) {
  size_t t = get_global_id(0);
  if (bt_entries && t < n_segments && (ulong)seg_bt_off[t] + seg_bt_len[t] > bt_entries)
    atomic_or(err, DSV4_LZ_ERR_TABLE);
  if (t >= n_tokens)
    return;
  int s = tok_seg[t];
  long pos = positions[t];
  long slot = -1;
  if (s < 0 || (uint)s >= n_segments) {
    atomic_or(err, DSV4_LZ_ERR_SEGMENT);
  } else if (pos < 0) {
    atomic_or(err, DSV4_LZ_ERR_POSITION);
  } else {
    long bs = (long)block_size;
    long idx = pos / bs - seg_first_lb[s];
    ulong e = (ulong)seg_bt_off[s] + (ulong)idx;
    if (idx >= 0 && idx < (long)seg_bt_len[s] && bt_entries && e >= bt_entries) {
      /* past the table: not read (the segment's own check has set the bit too) */
      atomic_or(err, DSV4_LZ_ERR_TABLE);
    } else if (idx >= 0 && idx < (long)seg_bt_len[s]) {
      int b = block_table[e];
      if (b >= 0 && (uint)b >= n_blocks)
        atomic_or(err, DSV4_LZ_ERR_BLOCK);
      else if (b >= 0)
        slot = (long)b * bs + pos % bs;
    }
  }
  STORE_SLOT(t, slot);
}

/*
 * The KV row's stores (SPEC §2.2), lane `lane` of the row of token t: its slot's record, the RoPE
 * lanes their rotated bf16 values bf, the others their tile's scale (from the lanes' maxima
 * lane_max) and their 16 fp8 values of x; a slot past the pool sets the error word instead.
 */
static void kv_store(ulong t, uint lane, const float *x, const ushort *bf,
                     __local const float *lane_max, __global const long *slots,
                     __global const ushort *kv, __global uchar *cache, uint block_size,
                     uint n_blocks, ulong stride, __global uint *err CACHE_COUNT_ARG) {
  const int rope_lane = lane >= DSV4_LZ_ROPE_LANE0;
  const uint d0 = lane * DSV4_LZ_DIMS_PER_LANE;
  long slot = slots[t];
  ulong n_slots = (ulong)n_blocks * block_size;
  if (slot < 0)
    return;
  if ((ulong)slot >= n_slots) {
    if (lane == 0)
      atomic_or(err, DSV4_LZ_ERR_SLOT);
    return;
  }
  ulong o = (ulong)slot % block_size;
  ulong base = (ulong)slot / block_size * stride;
  ulong rec = base + DSV4_TOKEN_DATA_OFFSET(o);
  ulong sc = base + DSV4_SCALE_OFFSET(block_size, o);

  if (rope_lane) {
    STORE_CACHE_BF16X16(rec + DSV4_NOPE_DIM + 2 * (d0 - DSV4_NOPE_DIM), bf);
    if (lane == DSV4_LZ_ROPE_LANE0)
      STORE_CACHE_U8(sc + DSV4_NTILES, (uchar)0);
    return;
  }

  uint j = lane / DSV4_LZ_TILE_LANES, first = j * DSV4_LZ_TILE_LANES;
  float amax = lane_max[first];
  for (uint l = first + 1; l < first + DSV4_LZ_TILE_LANES; l++)
    amax = lane_max[l] > amax ? lane_max[l] : amax;
  dsv4_i32 e = dsv4_ue8m0_exponent(amax);
  float scale = dsv4_pow2_neg(e);
  uchar f8[DSV4_LZ_DIMS_PER_LANE];
  for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
    f8[k] = dsv4_f32_to_e4m3(x[k] * scale);
  STORE_CACHE_U8X16(rec + d0, f8);
  if (lane == first)
    STORE_CACHE_U8(sc + j, (uchar)(e + DSV4_UE8M0_BIAS));
#ifdef DSV4_CL_BROKEN_BULK_STORE
  /* Test-only: the unmasked bulk store. Lanes 0..3 also store the unrotated bf16 RoPE values of
   * lanes 28..31, racing with their rotated stores above. */
  if (lane < DSV4_LZ_LANES - DSV4_LZ_ROPE_LANE0) {
    ulong d = DSV4_NOPE_DIM + lane * DSV4_LZ_DIMS_PER_LANE;
    ushort raw[DSV4_LZ_DIMS_PER_LANE];
    for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
      raw[k] = kv[t * DSV4_HEAD_DIM + d + (ulong)k];
    STORE_CACHE_BF16X16(rec + DSV4_NOPE_DIM + 2 * (d - DSV4_NOPE_DIM), raw);
  }
#endif
}

/*
 * The consumer (SPEC §2.1-2.2). Rows row0.. of this launch, n_rows rows in the whole batch. Every
 * work-item reaches both barriers, whatever its row, so that rows past the end and KV rows without
 * a slot never leave a barrier unmatched.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_GROUP_SIZE, 1, 1))) void
dsv4_qkv_insert(uint row0, uint n_rows, uint n_tokens, uint heads, uint write_kv,
                __global const ushort *q, __global const ushort *kv, __global const long *slots,
                __global const float *rope_rows, __global const float *kv_w, uint fused, float eps,
                __global ushort *q_out, __global uchar *cache, uint block_size, uint n_blocks,
                ulong stride, __global uint *err INSERT_COUNT_ARGS) {
  __local float partial[DSV4_LZ_ROWS_PER_GROUP][DSV4_LZ_LANES];
  __local float lane_max[DSV4_LZ_ROWS_PER_GROUP][DSV4_LZ_LANES];
  uint lid = (uint)get_local_id(0);
  uint r_in = lid / DSV4_LZ_LANES, lane = lid % DSV4_LZ_LANES;
  ulong row = (ulong)row0 + (ulong)get_group_id(0) * DSV4_LZ_ROWS_PER_GROUP + r_in;
  ulong nq = (ulong)n_tokens * heads;
  int live = row < (ulong)n_rows && (row < nq || write_kv);
  int is_kv = live && write_kv && row >= nq;
  int norm = live && (!is_kv || fused); /* this row's values are scaled by an RMS factor */
  ulong t = !live ? 0 : is_kv ? row - nq : row / heads;
  uint d0 = lane * DSV4_LZ_DIMS_PER_LANE;
  int rope_lane = lane >= DSV4_LZ_ROPE_LANE0;

  float x[DSV4_LZ_DIMS_PER_LANE];
  ushort in[DSV4_LZ_DIMS_PER_LANE];
  float acc = 0.0f;
  if (live) {
    __global const ushort *src = is_kv ? kv + t * DSV4_HEAD_DIM : q + row * DSV4_HEAD_DIM;
    vstore16(vload16(0, src + d0), 0, in);
    for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
      x[k] = dsv4_bf16_to_f32(in[k]);
    /* This lane's canonical partial: an fma chain over its 16 dims in index order from +0.0f. */
    if (norm)
      for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
        acc = fma(x[k], x[k], acc);
  }
  partial[r_in][lane] = acc;
  barrier(CLK_LOCAL_MEM_FENCE);

  float r = 1.0f;
  if (norm) {
    float p[DSV4_LZ_LANES];
    for (int l = 0; l < DSV4_LZ_LANES; l++)
      p[l] = partial[r_in][l];
    r = rms_factor(dsv4_fold32(p), eps);
  }

  /* KV: the stored values z (after the fused norm, rounded to bf16), this lane's tile maximum. */
  float tmax = DSV4_AMAX_FLOOR;
  if (is_kv) {
    if (fused)
      for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
        x[k] = dsv4_bf16_to_f32(dsv4_f32_to_bf16((x[k] * r) * kv_w[d0 + k]));
    if (!rope_lane)
      for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++) {
        float a = fabs(x[k]);
        tmax = a > tmax ? a : tmax;
      }
  }
  lane_max[r_in][lane] = tmax;
  barrier(CLK_LOCAL_MEM_FENCE);
  if (!live)
    return;

  /* RoPE lanes: 8 pairs (448 + 2i, 449 + 2i), i = 8 * (lane - 28) .. + 7. */
  ushort bf[DSV4_LZ_DIMS_PER_LANE];
  if (rope_lane) {
    __global const float *cs = rope_rows + t * DSV4_ROPE_ROW_FLOATS;
    for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k += 2) {
      uint i = (lane - DSV4_LZ_ROPE_LANE0) * (DSV4_LZ_DIMS_PER_LANE / 2) + (uint)k / 2;
      float e = is_kv ? x[k] : x[k] * r;
      float o = is_kv ? x[k + 1] : x[k + 1] * r;
      float c = cs[i], s = cs[DSV4_ROPE_PAIRS + i];
      bf[k] = dsv4_f32_to_bf16(dsv4_rope_even(e, o, c, s));
      bf[k + 1] = dsv4_f32_to_bf16(dsv4_rope_odd(e, o, c, s));
    }
  }

  if (!is_kv) {
    if (!rope_lane)
      for (int k = 0; k < DSV4_LZ_DIMS_PER_LANE; k++)
        bf[k] = dsv4_f32_to_bf16(x[k] * r);
    STORE_Q16(row * DSV4_HEAD_DIM + d0, bf);
    return;
  }

  kv_store(t, lane, x, bf, lane_max[r_in], slots, kv, cache, block_size, n_blocks, stride,
           err CACHE_COUNT_PASS);
}

/*
 * The correctly rounded fp32 quotient of attention's o = N / D (SPEC §2): the fp32 divide where the
 * device rounds it correctly, else the quotient of the two values as doubles rounded once to fp32,
 * which is the same value (53 >= 2 * 24 + 2 bits: the double rounding is innocuous).
 */
#ifdef DSV4_CL_RMS_FP64
static float quotient(float n, float d) {
  return (float)((double)n / (double)d);
}
#else
static float quotient(float n, float d) {
  return n / d;
}
#endif

/*
 * Attention, first launch: one work-item per token (and at least one per segment). Every block a
 * token's candidates max(p0, p - 127)..p live in must be in its segment's table with an id in
 * 0..n_blocks-1; anything else sets a bit of *err, and dsv4_attention, ordered after this launch,
 * then writes nothing. A segment whose table runs past bt_entries (when that is not 0) is refused
 * as dsv4_map_slots refuses it. Nothing is read past a table.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_MAP_GROUP_SIZE, 1, 1))) void
dsv4_attn_check(uint n_tokens, uint n_segments, uint block_size, uint n_blocks,
                __global const long *positions, __global const int *tok_seg,
                __global const long *seg_p0, __global const long *seg_first_lb,
                __global const uint *seg_bt_off, __global const uint *seg_bt_len,
                __global const int *block_table, uint bt_entries, __global uint *err) {
  size_t t = get_global_id(0);
  if (bt_entries && t < n_segments && (ulong)seg_bt_off[t] + seg_bt_len[t] > bt_entries)
    atomic_or(err, DSV4_LZ_ERR_TABLE);
  if (t >= n_tokens)
    return;
  int s = tok_seg[t];
  if (s < 0 || (uint)s >= n_segments) {
    atomic_or(err, DSV4_LZ_ERR_SEGMENT);
    return;
  }
  long p = positions[t], p0 = seg_p0[s];
  if (p0 < 0 || p < p0) {
    atomic_or(err, DSV4_LZ_ERR_POSITION);
    return;
  }
  long bs = (long)block_size, first = DSV4_WINDOW_LO(p, p0);
  uint bits = 0;
  for (long lb = first / bs; lb <= p / bs; lb++) {
    long idx = lb - seg_first_lb[s];
    if (idx < 0 || idx >= (long)seg_bt_len[s]) {
      bits |= DSV4_LZ_ERR_MISSING;
      continue;
    }
    ulong e = (ulong)seg_bt_off[s] + (ulong)idx;
    if (bt_entries && e >= bt_entries) {
      bits |= DSV4_LZ_ERR_TABLE; /* past the table: not read */
      continue;
    }
    int b = block_table[e];
    if (b < 0)
      bits |= DSV4_LZ_ERR_MISSING;
    else if ((uint)b >= n_blocks)
      bits |= DSV4_LZ_ERR_BLOCK;
  }
  if (bits)
    atomic_or(err, bits);
}

/* The cache bytes of candidate position pos: its record and its scale codes. */
typedef struct {
  __global const uchar *rec, *sc;
} cand_t;

static cand_t candidate(long pos, __global const int *table, long lb0, uint block_size,
                        __global const uchar *cache, ulong stride) {
  long bs = (long)block_size;
  ulong base = (ulong)table[pos / bs - lb0] * stride, o = (ulong)(pos % bs);
  cand_t c = {cache + base + DSV4_TOKEN_DATA_OFFSET(o), cache + base + DSV4_SCALE_OFFSET(bs, o)};
  return c;
}

/* The 16 dequantised values of dims 16l..16l+15 of a record (SPEC §7: NoPE e4m3 times
 * 2^(code - 127), RoPE bf16; both exact in fp32). */
static void dequant16(cand_t c, uint l, float *k) {
  if (l < DSV4_LZ_ROPE_LANE0) {
    float scale = dsv4_ue8m0_scale(c.sc[l / (DSV4_TILE / DSV4_LZ_DIMS_PER_LANE)]);
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
      k[i] = dsv4_e4m3_to_f32(c.rec[l * DSV4_LZ_DIMS_PER_LANE + i]) * scale;
  } else {
    __global const ushort *r = (__global const ushort *)(c.rec + DSV4_NOPE_DIM);
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
      k[i] = dsv4_bf16_to_f32(r[(l - DSV4_LZ_ROPE_LANE0) * DSV4_LZ_DIMS_PER_LANE + i]);
  }
}

/* The canonical logit of one candidate (SPEC §7): the 512-long dot product of q (local, fp32) with
 * the dequantised record, 32 fma partials of 16 dims and the fold, then the softmax scale. */
static float logit_of(__local const float *qv, cand_t c) {
  float part[DSV4_LZ_LANES], k[DSV4_LZ_DIMS_PER_LANE];
  for (uint l = 0; l < DSV4_LZ_LANES; l++) {
    dequant16(c, l, k);
    float acc = 0.0f;
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
      acc = fma(qv[l * DSV4_LZ_DIMS_PER_LANE + i], k[i], acc);
    part[l] = acc;
  }
  return dsv4_fold32(part) * dsv4_u2f(DSV4_SOFTMAX_SCALE_BITS);
}

/*
 * A row's candidate list (SPEC §7, §8.6): nw window positions lo.., then the compressed entries,
 * j_lo, j_lo + 1, .. or the listed ones sel[0..], through their own table and cache.
 */
typedef struct {
  long lo, lb0, nw, n;
  __global const int *table;
  __global const uchar *cache;
  long j_lo, clb0;
  __global const int *sel; /* NULL: the range form */
  __global const int *ctable;
  __global const uchar *c_cache;
} clist_t;

static cand_t list_at(const clist_t *L, long i, uint block_size, ulong stride) {
  if (i < L->nw)
    return candidate(L->lo + i, L->table, L->lb0, block_size, L->cache, stride);
  long j = L->sel ? (long)L->sel[i - L->nw] : L->j_lo + (i - L->nw);
  return candidate(j, L->ctable, L->clb0, block_size, L->c_cache, stride);
}

/* The compressed entries of token t after its window (SPEC §8.4): with a selection, its listed
 * entries up to the first -1; else floor(p0 / ratio) <= j < floor((p + 1) / ratio). */
static long c_entries(uint ratio, long p0, long p, __global const int *sel_row, uint sel_stride,
                      long *j_lo) {
  *j_lo = p0 / (long)ratio;
  if (!sel_row) {
    long j_hi = (p + 1) / (long)ratio;
    return j_hi > *j_lo ? j_hi - *j_lo : 0;
  }
  uint k = 0;
  while (k < sel_stride && sel_row[k] != -1)
    k++;
  return (long)k;
}

/*
 * Attention, second launch (SPEC §7, §8.6, exact mode): rows row0.. of this launch, row = t * H +
 * h, in the thread layout of dsv4_qkv_insert (32 lanes per row, 8 rows per work-group). The
 * candidates are the window and, on a compressed layer (ratio != 0), the compressed entries after
 * it, taken in chunks of DSV4_LZ_ATTN_CHUNK. Lane j computes the logits of candidates j, j + 32,
 * .. of a chunk (each a whole canonical dot product) into local memory, and every lane continues
 * the max over the chunk in list order. Then, chunk by chunk again, lane j computes the weights of
 * its candidates (the first chunk's logits were kept; later chunks compute theirs once more, the
 * same values), and every lane continues the sum in list order while lane l continues the fma
 * chains of its dims 16l..16l+15. So every value is the CPU's, in the CPU's order, whatever the
 * length of the list; a window-only list is one chunk. Each lane stores its dims once (lanes
 * 28..31 after the inverse RoPE); lane 0 stores lse.
 *
 * Nothing is written when the error word is not zero: dsv4_attn_check (or the batch's slot map,
 * insert, compressor or indexer) found something the CPU backend refuses. Every work-item reads
 * the same word, so a group returns as a whole, before its first barrier. Every work-item runs the
 * group's largest chunk count, so every barrier is reached by all of them.
 */
__kernel __attribute__((reqd_work_group_size(DSV4_LZ_GROUP_SIZE, 1, 1))) void dsv4_attention(
    uint row0, uint n_rows, uint heads, __global const ushort *q, __global const long *positions,
    __global const int *tok_seg, __global const long *seg_p0, __global const long *seg_first_lb,
    __global const uint *seg_bt_off, __global const int *block_table, __global const uchar *cache,
    uint block_size, ulong stride, __global const float *sink, uint has_sink,
    __global const float *rope_rows, __global ushort *out, __global float *lse, uint want_lse,
    __global const uint *err, uint ratio, __global const uchar *c_cache,
    __global const long *seg_c_first_lb, __global const uint *seg_cbt_off,
    __global const int *c_block_table, __global const int *c_sel, uint c_sel_stride) {
  __local float qv[DSV4_LZ_ROWS_PER_GROUP][DSV4_HEAD_DIM];
  __local float logit[DSV4_LZ_ROWS_PER_GROUP][DSV4_LZ_ATTN_CHUNK];
  __local float wt[DSV4_LZ_ROWS_PER_GROUP][DSV4_LZ_ATTN_CHUNK];
  __local int chunks_of[DSV4_LZ_ROWS_PER_GROUP];
  if (*err)
    return;
  uint lid = (uint)get_local_id(0);
  uint r_in = lid / DSV4_LZ_LANES, lane = lid % DSV4_LZ_LANES;
  ulong row = (ulong)row0 + (ulong)get_group_id(0) * DSV4_LZ_ROWS_PER_GROUP + r_in;
  int live = row < (ulong)n_rows;
  ulong t = live ? row / heads : 0;
  uint d0 = lane * DSV4_LZ_DIMS_PER_LANE;
  clist_t L = {0, 0, 0, 0, block_table, cache, 0, 0, 0, c_block_table, c_cache};
  if (live) {
    int s = tok_seg[t];
    long p = positions[t];
    L.lo = DSV4_WINDOW_LO(p, seg_p0[s]);
    L.nw = p - L.lo + 1;
    L.lb0 = seg_first_lb[s];
    L.table = block_table + seg_bt_off[s];
    L.n = L.nw;
    if (ratio) {
      L.sel = c_sel_stride ? c_sel + t * c_sel_stride : 0;
      L.n += c_entries(ratio, seg_p0[s], p, L.sel, c_sel_stride, &L.j_lo);
      L.clb0 = seg_c_first_lb[s];
      L.ctable = c_block_table + seg_cbt_off[s];
    }
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
      qv[r_in][d0 + i] = dsv4_bf16_to_f32(q[row * DSV4_HEAD_DIM + d0 + i]);
  }
  if (lane == 0)
    chunks_of[r_in] = (int)((L.n + DSV4_LZ_ATTN_CHUNK - 1) / DSV4_LZ_ATTN_CHUNK);
  barrier(CLK_LOCAL_MEM_FENCE);
  int chunks = 0;
  for (int r = 0; r < DSV4_LZ_ROWS_PER_GROUP; r++)
    chunks = max(chunks, chunks_of[r]);

  /* m = the max in list order, chunk by chunk (the first chunk's logits stay in logit[], later
   * ones pass through wt[]). */
  float m = 0.0f;
  for (int ch = 0; ch < chunks; ch++) {
    long base = (long)ch * DSV4_LZ_ATTN_CHUNK;
    int cnt = (int)clamp(L.n - base, 0L, (long)DSV4_LZ_ATTN_CHUNK);
    __local float *l = ch == 0 ? logit[r_in] : wt[r_in];
    for (int i = (int)lane; i < cnt; i += DSV4_LZ_LANES)
      l[i] = logit_of(qv[r_in], list_at(&L, base + i, block_size, stride));
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = 0; i < cnt; i++)
      m = (ch == 0 && i == 0) || l[i] > m ? l[i] : m;
    barrier(CLK_LOCAL_MEM_FENCE); /* wt[] is rewritten by the next chunk */
  }

  /* S (the weights in list order from +0, the sink excluded) and the chains N. */
  float sum = 0.0f, acc[DSV4_LZ_DIMS_PER_LANE], k[DSV4_LZ_DIMS_PER_LANE];
  for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
    acc[i] = 0.0f;
  for (int ch = 0; ch < chunks; ch++) {
    long base = (long)ch * DSV4_LZ_ATTN_CHUNK;
    int cnt = (int)clamp(L.n - base, 0L, (long)DSV4_LZ_ATTN_CHUNK);
    for (int i = (int)lane; i < cnt; i += DSV4_LZ_LANES) {
      float l =
          ch == 0 ? logit[r_in][i] : logit_of(qv[r_in], list_at(&L, base + i, block_size, stride));
      wt[r_in][i] = dsv4_expf(l - m);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = 0; j < cnt; j++) {
      float w = wt[r_in][j];
      sum = sum + w;
      dequant16(list_at(&L, base + j, block_size, stride), lane, k);
      for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
        acc[i] = fma(w, k[i], acc[i]);
    }
    barrier(CLK_LOCAL_MEM_FENCE); /* wt[] is rewritten by the next chunk */
  }
  if (!live)
    return;

  float den = sum;
  if (has_sink)
    den = den + dsv4_expf(sink[row % heads] - m);
  for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
    acc[i] = quotient(acc[i], den);

  ushort bf[DSV4_LZ_DIMS_PER_LANE];
  if (lane >= DSV4_LZ_ROPE_LANE0) {
    /* The inverse RoPE at the query's position: pairs (448 + 2i, 449 + 2i), the inner product
     * rounded first, then one fma. */
    __global const float *cs = rope_rows + t * DSV4_ROPE_ROW_FLOATS;
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i += 2) {
      uint pr = (lane - DSV4_LZ_ROPE_LANE0) * (DSV4_LZ_DIMS_PER_LANE / 2) + (uint)i / 2;
      float e = acc[i], o = acc[i + 1], c = cs[pr], sn = cs[DSV4_ROPE_PAIRS + pr];
      bf[i] = dsv4_f32_to_bf16(fma(e, c, o * sn));
      bf[i + 1] = dsv4_f32_to_bf16(fma(-e, sn, o * c));
    }
  } else {
    for (int i = 0; i < DSV4_LZ_DIMS_PER_LANE; i++)
      bf[i] = dsv4_f32_to_bf16(acc[i]);
  }
  vstore16(vload16(0, bf), 0, out + row * DSV4_HEAD_DIM + d0);
  if (want_lse && lane == 0)
    lse[row] = m + dsv4_logf(sum);
}

/* The compressed branch's kernels (SPEC §8.3-§8.6). */
#include "level_zero/dsv4_compress.cl"

/*
 * SPEC §2's device checks, run by the backend when it opens a device (lz_probe.h): out[0] = a * b +
 * c as written must not be contracted into an fma ((1 + 2^-12)^2 - (1 + 2^-11) gives +0), out[1] =
 * a product in the subnormal range must not be flushed to zero, and the RMS factors (multiply, add,
 * sqrt, divide) must be the correctly rounded ones the host computes.
 */
__kernel void dsv4_fp_probe(__global const float *in, __global float *out) {
  out[0] = in[0] * in[1] + in[2];
  out[1] = in[3] * in[4];
  for (int i = 0; i < DSV4_LZ_PROBE_RMS; i++)
    out[2 + i] = rms_factor(in[5 + i], dsv4_u2f(DSV4_RMS_EPS_BITS));
}
