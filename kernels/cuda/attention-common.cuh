#ifndef DSV4_KERNELS_CUDA_ATTENTION_COMMON_CUH
#define DSV4_KERNELS_CUDA_ATTENTION_COMMON_CUH
/*
 * What the attention kernels of both modes share (SPEC §7): the launch parameters, the per-CTA
 * facts, a token's window and the launch checks, the exact dequantisation of records to bf16, the
 * query load, the setup after the dependency wait and the staging of records into shared memory.
 * Included by attention.cu (exact mode, the union, the launches) and attention_fast.cu (fast mode).
 */
#include "cuda-internal.cuh"
#include "q-norm.cuh"

#include "dsv4-error.h"
#include "dsv4-numerics.h"

#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / 32)
#define FULL 0xffffffffu
#define OCT 8            /* heads per warp (an octet) */
#define QUAD 4           /* candidates per pass-1 step: OCT x QUAD = 32 values, one per lane */
#define K_ROW 1024       /* bytes of one candidate's 512 bf16 values in shared memory */
#define T_STRIDE 36      /* floats per lane row of a warp's transposition buffer (conflict-free) */
#define NOPE_PIECES 56   /* 8-dim pieces of the NoPE part; pieces 56..63 are the RoPE part */
#define MAX_WIN_BLOCKS 9 /* DSV4_WINDOW / DSV4_MIN_BLOCK_SIZE + 1 */
/* Launches of at most this many tokens (cuda-kernels.h) are checked whole by every CTA (below);
 * larger ones by a separate kernel before the attention kernel. A union launch (its tokens'
 * entries too) up to UNION_CHECK_ALL_MAX tokens: a warp per token, one or two rounds of the CTA's
 * warps, or, split (fast mode), by each CTA for what it reads (attention-union.cuh). */
#define CHECK_ALL_MAX DSV4_CUDA_ATTN_CHECK_ALL_MAX
#define UNION_CHECK_ALL_MAX DSV4_CUDA_UNION_CHECK_ALL_MAX
/* Error bits that are not reported: the launch stopped because another token failed. */
#define ERR_EARLIER 0x80000000u
#define ERR_REPORTED                                                                               \
  (DSV4_CUDA_ATTN_ERR_SEGMENT | DSV4_CUDA_ATTN_ERR_POSITION | DSV4_CUDA_ATTN_ERR_BLOCK |           \
   DSV4_CUDA_ERR_ENTRY)

static_assert(MAX_WIN_BLOCKS == DSV4_WINDOW / DSV4_MIN_BLOCK_SIZE + 1, "window blocks");

typedef struct {
  const uint4 *q; /* [n_tokens, heads, 64] uint4: bf16 q_out rows, or the raw q with q_raw */
  const int64_t *pos;
  const int32_t *tok_seg;
  const int64_t *seg_p0;
  const int64_t *seg_first_lb;
  const uint32_t *seg_bt_off;
  const uint32_t *seg_bt_len;
  const int32_t *bt;
  const uint4 *win; /* [n_tokens, 4]: the engine's windows (dsv4_attn_win_t), or NULL */
  const uint8_t *cache;
  const float *sink;  /* [heads] or NULL */
  const float4 *rope; /* 16 float4 per row: cos 0..7, sin 8..15 */
  uint4 *out;
  float *lse; /* or NULL */
  uint32_t *err;
  uint64_t stride;
  int64_t max_pos;
  uint32_t n_tokens, n_segments, heads, groups;
  uint32_t bt_entries, n_blocks, bs_shift, check_all;
  /* The compressed entries (SPEC §8.6), c_cache NULL on an SWA-only launch (backend.h). */
  const uint8_t *c_cache;
  const int64_t *seg_c_first_lb;
  const uint32_t *seg_cbt_off;
  const uint32_t *seg_cbt_len;
  const int32_t *c_bt;
  const int32_t *c_sel; /* [n_tokens, c_sel_stride], or NULL: every visible entry */
  uint32_t c_sel_stride, c_bt_entries, c_n_blocks, ratio;
  /* The fused decode path (backend.h): q holds the raw rows, normalised and rotated here. */
  uint32_t q_raw;
  float eps;
  /* Fast mode's split union (attention_fast_union.cu): nsplit > 1 splits of each token's list
   * write their partial states into part (attention-split.h), which a combine kernel merges. */
  float *part;
  uint32_t nsplit;
} attn_params_t;

static_assert(sizeof(attn_params_t) % 4 == 0, "parameter block of whole words");

/* Per-CTA facts, in static shared memory (16-byte aligned: the RoPE row is stored as float4). */
typedef struct alignas(16) {
  float rope[DSV4_ROPE_ROW_FLOATS]; /* cos then sin at the query's position */
  float m[64];                      /* each head's maximum logit */
  float d[64];                      /* each head's denominator D */
  const uint8_t *rec[DSV4_WINDOW];  /* the staged candidates' 576 data bytes (stage_records) */
  const uint8_t *scl[DSV4_WINDOW];  /* and their 8 scale bytes */
  int32_t blk[MAX_WIN_BLOCKS + 3];  /* physical blocks of the window's logical blocks */
  int64_t lo;                       /* the first candidate's position */
  uint32_t n;                       /* candidates */
} attn_misc_t;

/* Dynamic shared memory of a CTA of hg heads: the window (bf16), the logits and weights, and one
 * transposition buffer per warp. */
static constexpr size_t attn_smem_bytes(int hg) {
  return (size_t)DSV4_WINDOW * K_ROW + (size_t)DSV4_WINDOW * (hg + 4) * sizeof(float) +
         (size_t)ATTN_WARPS * 32 * T_STRIDE * sizeof(float);
}

/* ---- the window of a token, from its segment's block table ---- */

typedef struct {
  int64_t pos, lo; /* the query's position and the first candidate's */
  int64_t first;   /* the logical block that entry `off` maps */
  uint32_t off, len;
} window_t;

/* Token t's window in p.win (dsv4_attn_win_t), four uint4: lo, n and the reserved word in the
 * first, the blocks from the second on (returned here). */
static __device__ __forceinline__ const int32_t *win_blocks(const attn_params_t &p, uint32_t t) {
  return reinterpret_cast<const int32_t *>(p.win + 4 * (uint64_t)t) + 4;
}

/* The first candidate's position in the head h of an engine's window. */
static __device__ __forceinline__ int64_t win_lo(uint4 h) {
  return (int64_t)(((uint64_t)h.y << 32) | h.x);
}

/* 0, or the error bits of the head h of an engine's window (lo, n): a window that is empty,
 * longer than DSV4_WINDOW or below position 0, or whose last position has no RoPE row; w->pos
 * and w->lo on success. */
static __device__ __forceinline__ uint32_t win_head(const attn_params_t &p, uint4 h, window_t *w) {
  const int64_t lo = win_lo(h);
  /* lo + n - 1 >= max_pos, without an overflow for any lo */
  if (lo < 0 || h.z == 0 || h.z > DSV4_WINDOW || lo > p.max_pos - (int64_t)h.z)
    return DSV4_CUDA_ATTN_ERR_POSITION;
  w->lo = lo;
  w->pos = lo + (int64_t)h.z - 1;
  return 0;
}

/* The query position of token t: the last of its engine's window with p.win (which the launch's
 * check has found to have a RoPE row), else its entry in the positions array. */
static __device__ __forceinline__ int64_t token_pos(const attn_params_t &p, uint32_t t) {
  if (!p.win)
    return p.pos[t];
  const uint4 h = p.win[4 * (uint64_t)t];
  return win_lo(h) + (int64_t)h.z - 1;
}

/* The error bit of physical block b of an engine's window: outside the pool. */
static __device__ __forceinline__ uint32_t win_block_bits(const attn_params_t &p, int32_t b) {
  return b < 0 || (uint32_t)b >= p.n_blocks ? DSV4_CUDA_ATTN_ERR_BLOCK : 0u;
}

/* 0, or the error bits of a token of segment seg at position pos, as loaded from the launch's
 * arrays (SPEC §7: p0 <= p, a RoPE row for p). */
static __device__ uint32_t token_window_of(const attn_params_t &p, int32_t seg, int64_t pos,
                                           window_t *w) {
  if (seg < 0 || (uint32_t)seg >= p.n_segments)
    return DSV4_CUDA_ATTN_ERR_SEGMENT;
  /* the segment's facts in one round of loads, before the checks that need only p0 */
  const int64_t p0 = p.seg_p0[seg], first = p.seg_first_lb[seg];
  const uint32_t off = p.seg_bt_off[seg], len = p.seg_bt_len[seg];
  if (p0 < 0 || pos < p0 || pos >= p.max_pos)
    return DSV4_CUDA_ATTN_ERR_POSITION;
  w->pos = pos;
  w->lo = DSV4_WINDOW_LO(pos, p0);
  w->first = first;
  w->off = off;
  w->len = len;
  return 0;
}

/* 0, or the error bits of token t's segment and position (token_window_of). */
static __device__ uint32_t token_window(const attn_params_t &p, uint32_t t, window_t *w) {
  const int32_t seg = p.tok_seg[t];
  if (seg < 0 || (uint32_t)seg >= p.n_segments)
    return DSV4_CUDA_ATTN_ERR_SEGMENT;
  return token_window_of(p, seg, p.pos[t], w);
}

/* The logical blocks the window spans (1..MAX_WIN_BLOCKS). */
static __device__ __forceinline__ uint32_t window_blocks(const attn_params_t &p,
                                                         const window_t &w) {
  return (uint32_t)((w.pos >> p.bs_shift) - (w.lo >> p.bs_shift)) + 1u;
}

/* The physical block of the window's k-th logical block, or -1 with the error bit set when it is
 * outside the segment's table (or past bt_entries), < 0, or outside the pool. */
static __device__ int32_t window_block(const attn_params_t &p, const window_t &w, uint32_t k,
                                       uint32_t *bits) {
  const int64_t idx = (w.lo >> p.bs_shift) + (int64_t)k - w.first;
  if (idx < 0 || idx >= (int64_t)w.len) {
    *bits |= DSV4_CUDA_ATTN_ERR_BLOCK;
    return -1;
  }
  const uint64_t e = (uint64_t)w.off + (uint64_t)idx;
  if (p.bt_entries && e >= p.bt_entries) {
    *bits |= DSV4_CUDA_ATTN_ERR_BLOCK;
    return -1;
  }
  const int32_t b = p.bt[e];
  if (b < 0 || (uint32_t)b >= p.n_blocks) {
    *bits |= DSV4_CUDA_ATTN_ERR_BLOCK;
    return -1;
  }
  return b;
}

/* The physical block of logical entry block lb of segment s, or -1 when it is outside the
 * segment's table (or past c_bt_entries), < 0, or outside the pool. */
static __device__ __forceinline__ int32_t entry_block(const attn_params_t &p, uint32_t s,
                                                      int64_t lb) {
  return dsv4__entry_block(p, s, lb);
}

/* No event in a part of a token's entries (entries_event). */
#define NO_EVENT (~0ull)

/*
 * The first event of entries k0..k0 + 31 of token t's selection row (SPEC §8.4, backend.h; p.c_sel
 * set), for a warp, every lane calling with its lane number: NO_EVENT, or (k << 32) | ev for the
 * first entry k of them that ends the list (ev = 1: a -1) or fails (ev: the bits of its first
 * failing check: visible, above the one before, its block). The first event of all parts in list
 * order decides the token (entries_event_bits), as a walk of the list from its start would.
 */
static __device__ uint64_t entries_event(const attn_params_t &p, uint32_t t, uint32_t s,
                                         int64_t pos, uint32_t k0, uint32_t lane) {
  const int64_t j_lo = p.seg_p0[s] / p.ratio, j_hi = (pos + 1) / p.ratio;
  const int32_t *row = p.c_sel + (uint64_t)t * p.c_sel_stride;
  const uint32_t k = k0 + lane;
  uint32_t ev = 0;
  if (k < p.c_sel_stride) {
    const int64_t j = row[k], prev = k ? row[k - 1] : -1;
    if (j == -1)
      ev = 1;
    else if (j < j_lo || j >= j_hi || (k && j <= prev))
      ev = DSV4_CUDA_ERR_ENTRY;
    else if ((!k || (j >> p.bs_shift) != (prev >> p.bs_shift)) &&
             entry_block(p, s, j >> p.bs_shift) < 0)
      ev = DSV4_CUDA_ATTN_ERR_BLOCK;
  }
  const uint32_t any = __ballot_sync(0xffffffffu, ev != 0);
  if (!any)
    return NO_EVENT;
  const uint32_t f = __ffs(any) - 1;
  return ((uint64_t)(k0 + f) << 32) | __shfl_sync(0xffffffffu, ev, f);
}

/* The error bits a token's first event gives (entries_event): 0 for none or the list's end. */
static __device__ __forceinline__ uint32_t entries_event_bits(uint64_t e) {
  return e == NO_EVENT || (uint32_t)e == 1u ? 0u : (uint32_t)e;
}

/* The parts a token's entries check is cut into (entries_check_part): its selection row's 32
 * entries at a time; without a selection one, its visible entries' blocks. */
static __device__ __forceinline__ uint32_t entries_parts(const attn_params_t &p) {
  return p.c_sel ? (p.c_sel_stride + 31) / 32 : 1u;
}

/*
 * Part c of token t's entries check, for a warp (every lane calling with its lane number): with a
 * selection entries_event of its entries 32 c..; without one every visible entry's block (one part:
 * NO_EVENT, or an event at entry 0 with the block bit).
 */
static __device__ uint64_t entries_check_part(const attn_params_t &p, uint32_t t, uint32_t s,
                                              int64_t pos, uint32_t c, uint32_t lane) {
  if (p.c_sel)
    return entries_event(p, t, s, pos, 32 * c, lane);
  const int64_t j_lo = p.seg_p0[s] / p.ratio, j_hi = (pos + 1) / p.ratio;
  uint32_t bad = 0;
  for (int64_t lb = (j_lo >> p.bs_shift) + lane; j_hi > j_lo && lb <= (j_hi - 1) >> p.bs_shift;
       lb += 32)
    bad |= entry_block(p, s, lb) < 0;
  return __any_sync(0xffffffffu, bad) ? (uint64_t)DSV4_CUDA_ATTN_ERR_BLOCK : NO_EVENT;
}

/* 0, or the error bits of token t: its segment, position and every block of its window (and its
 * window's facts in *w); with the engine's windows (p.win) those of its window (win_head, and each
 * block within the pool), which stand for the segment and the positions array. */
static __device__ uint32_t token_check(const attn_params_t &p, uint32_t t, window_t *w) {
  if (p.win) { /* the engine's window: its 64 bytes in one round of loads */
    const uint4 *d = p.win + 4 * (uint64_t)t;
    const uint4 h = d[0], b[3] = {d[1], d[2], d[3]};
    const uint32_t bits = win_head(p, h, w);
    if (bits)
      return bits;
    const uint32_t nb = window_blocks(p, *w);
    uint32_t out = 0;
#pragma unroll
    for (int k = 0; k < 3; k++) {
      const uint32_t v[4] = {b[k].x, b[k].y, b[k].z, b[k].w};
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (4u * k + j < nb)
          out |= win_block_bits(p, (int32_t)v[j]);
    }
    return out;
  }
  uint32_t bits = token_window(p, t, w);
  if (bits)
    return bits;
  const uint32_t nb = window_blocks(p, *w);
  for (uint32_t k = 0; k < nb; k++)
    (void)window_block(p, *w, k, &bits);
  return bits;
}

/* 0, or the error bits of segment s of a launch with compressed entries: the checks the CPU backend
 * makes of every segment (p0 >= 0, the tables within the entries given). */
static __device__ uint32_t segment_check(const attn_params_t &p, uint32_t s) {
  if (p.seg_p0[s] < 0)
    return DSV4_CUDA_ATTN_ERR_POSITION;
  if ((p.bt_entries && (uint64_t)p.seg_bt_off[s] + p.seg_bt_len[s] > p.bt_entries) ||
      (p.c_bt_entries && (uint64_t)p.seg_cbt_off[s] + p.seg_cbt_len[s] > p.c_bt_entries))
    return DSV4_CUDA_ATTN_ERR_BLOCK;
  return 0;
}

/* ---- numerics on packed bf16 ---- */

static __device__ __forceinline__ void unpack8(uint4 v, float *x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; k++) {
    x[2 * k] = __uint_as_float(w[k] << 16);
    x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

/*
 * Two E4M3FN bytes (lo in the low byte) as fp32: one instruction to an f16 pair on sm_89+, where
 * every E4M3FN value is an f16 value, so the conversion is exact, then two exact widenings; below,
 * dsv4_e4m3_to_f32 of each byte. Both give dsv4_e4m3_to_f32 for every byte but the two NaN codes,
 * which the insert never writes (the CPU reference computes with dsv4_e4m3_to_f32 too).
 */
static __device__ __forceinline__ void e4m3x2_to_f32(uint32_t pair, float *lo, float *hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((uint16_t)pair));
  asm("cvt.f32.f16 %0, %1;" : "=f"(*lo) : "h"((uint16_t)(h2 & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(*hi) : "h"((uint16_t)(h2 >> 16)));
#else
  *lo = dsv4_e4m3_to_f32((dsv4_u8)(pair & 0xffu));
  *hi = dsv4_e4m3_to_f32((dsv4_u8)((pair >> 8) & 0xffu));
#endif
}

/*
 * Eight NoPE values of a record (8 E4M3FN bytes in w0, w1) dequantised exactly (SPEC §2.2:
 * e4m3 * 2^(code - 127)) and stored as bf16. The product has at most 4 significant bits and, for
 * every code an insert writes (105..247, or 0 in a zero-filled record), is a normal fp32 or zero,
 * so its bf16 is its upper half, exactly dsv4_f32_to_bf16 of it: nothing is rounded, and the
 * kernel later reads back the very fp32 value the CPU reference computes.
 */
static __device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, uint32_t code) {
  const float sc = dsv4_ue8m0_scale((dsv4_u8)code);
  const uint32_t pairs[4] = {w0 & 0xffffu, w0 >> 16, w1 & 0xffffu, w1 >> 16};
  uint32_t o[4];
#pragma unroll
  for (int k = 0; k < 4; k++) {
    float a, b;
    e4m3x2_to_f32(pairs[k], &a, &b);
    o[k] =
        __byte_perm(__float_as_uint(__fmul_rn(a, sc)), __float_as_uint(__fmul_rn(b, sc)), 0x7632);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/* ---- the phases of a CTA ---- */

/* The eight heads h0.. of token t that this lane's queries cover: dims 16 lane .. 16 lane + 15. */
static __device__ __forceinline__ void load_q(const attn_params_t &p, uint32_t t, uint32_t h0,
                                              uint32_t lane, uint4 (&qraw)[OCT][2]) {
#pragma unroll
  for (int hh = 0; hh < OCT; hh++) {
    if (h0 + hh < p.heads) {
      const uint4 *row = p.q + ((uint64_t)t * p.heads + h0 + hh) * 64;
      qraw[hh][0] = row[2 * lane];
      qraw[hh][1] = row[2 * lane + 1];
    } else {
      qraw[hh][0] = qraw[hh][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

/*
 * On the fused decode path (p.q_raw), the raw rows load_q put in qraw become the bf16 values the
 * insert would have written to q_out (q-norm.cuh, whose run layout is load_q's), with rope the
 * query position's RoPE row (ms.rope, after the setup). Called by whole warps: an octet's heads,
 * and so the rows normalised, are the same for every lane.
 */
static __device__ __forceinline__ void norm_q(const attn_params_t &p, uint32_t h0, uint32_t lane,
                                              const float *rope, uint4 (&qraw)[OCT][2]) {
  if (!p.q_raw)
    return;
#pragma unroll
  for (int hh = 0; hh < OCT; hh++)
    if (h0 + hh < p.heads)
      qn_row_run(lane, rope, p.eps, qraw[hh][0], qraw[hh][1]);
}

/* The first round of a token's window loads with the engine's windows (p.win): its head and the
 * calling thread's block, loaded by attn_window_first before the CTA's other loads (q's rows), so
 * that they do not wait behind them; `loaded` false (win_first_t{}): attn_window loads them. */
typedef struct {
  uint4 h;
  int32_t b;
  bool loaded;
} win_first_t;

static __device__ __forceinline__ win_first_t attn_window_first(const attn_params_t &p,
                                                                uint32_t t) {
  win_first_t f = {make_uint4(0, 0, 0, 0), 0, true};
  if (p.win) {
    f.h = p.win[4 * (uint64_t)t];
    if (threadIdx.x < MAX_WIN_BLOCKS)
      f.b = win_blocks(p, t)[threadIdx.x];
  }
  return f;
}

/*
 * The query's window (after the dependency wait): the physical blocks of the window into ms.blk,
 * the RoPE row into ms.rope, ms.lo and ms.n (f: attn_window_first's loads). Returns the calling
 * thread's error bits (a thread checks one block): once or-ed over the CTA, 0 when the window's
 * blocks may be read, and then ms holds them after a barrier.
 */
static __device__ uint32_t attn_window(const attn_params_t &p, uint32_t t, attn_misc_t &ms,
                                       const win_first_t &f) {
  const uint32_t tid = threadIdx.x;
  window_t w;
  uint32_t bits;
  if (p.win) { /* the engine's window: its head and a block each in one round of loads */
    const win_first_t g = f.loaded ? f : attn_window_first(p, t);
    bits = win_head(p, g.h, &w);
    if (!bits && tid < window_blocks(p, w)) {
      bits = win_block_bits(p, g.b);
      ms.blk[tid] = g.b;
    }
  } else {
    bits = token_window(p, t, &w);
    if (!bits && tid < window_blocks(p, w))
      ms.blk[tid] = window_block(p, w, tid, &bits);
  }
  if (!bits) {
    if (tid >= 32 && tid < 48)
      reinterpret_cast<float4 *>(ms.rope)[tid - 32] = p.rope[(uint64_t)w.pos * 16 + (tid - 32)];
    if (tid == 0) {
      ms.lo = w.lo;
      ms.n = (uint32_t)(w.pos - w.lo + 1);
    }
  }
  return bits;
}

/*
 * The launch's check, after attn_window gave this thread's bits: with check_all, every token of the
 * launch is checked here, else by the check kernel that ran before. On both paths the error word is
 * read: the check kernel's bits, or those of an earlier kernel of the batch (cuda-kernels.h: once
 * the word is set, every later kernel of the batch writes nothing), as union_setup and the combine
 * kernel read it. Returns 0 when the CTA may go on; otherwise every thread of it returns before
 * writing anything (SPEC §7: a failed launch writes nothing), and the error bits have been
 * reported. A barrier.
 */
static __device__ int attn_check(const attn_params_t &p, uint32_t bits) {
  const uint32_t tid = threadIdx.x;
  if (p.check_all) {
    window_t wu; /* a launch without compressed entries: its windows' checks are all */
    for (uint32_t u = tid; u < p.n_tokens; u += blockDim.x)
      bits |= token_check(p, u, &wu);
  }
  if (tid == 0 && __ldcg(p.err) != 0)
    bits |= ERR_EARLIER;
  /* With check_all every CTA finds every error: those of the first column (each split of token 0's
   * first head group) report them, the same bits. */
  if ((bits & ERR_REPORTED) && (!p.check_all || blockIdx.x == 0))
    atomicOr(p.err, bits & ERR_REPORTED);
  return __syncthreads_or(bits != 0);
}

/*
 * Candidate i's record, at slot o of the block whose bytes begin at base: its addresses into ms.rec
 * and ms.scl for stage_records, and an L2 prefetch of every line of them (the records are
 * scattered over blocks, and every round of the staging's loads would otherwise wait for the
 * DRAM): the five lines of its 576 data bytes (the fifth also holds part of the next record) and
 * the line of its scales. The thread that computes a candidate's addresses does this once, so the
 * staging's loads need only an offset each. Without PREFETCH the addresses only: the caller copies
 * the records at once (fast_copy_record).
 */
template <bool PREFETCH = true>
static __device__ __forceinline__ void
put_record_addr(attn_misc_t &ms, uint32_t i, const uint8_t *base, int64_t o, uint32_t bs_shift) {
  const uint8_t *rec = base + (uint64_t)o * DSV4_TOKEN_DATA_BYTES;
  const uint8_t *scl =
      base + ((uint64_t)DSV4_TOKEN_DATA_BYTES << bs_shift) + (uint64_t)o * DSV4_SCALE_BYTES;
  ms.rec[i] = rec;
  ms.scl[i] = scl;
  if (PREFETCH) {
    for (int line = 0; line < 5; line++)
      dsv4__prefetch_l2(rec + 128 * line);
    dsv4__prefetch_l2(scl);
  }
}

/*
 * n records, whose addresses ms.rec and ms.scl hold (put_record_addr, before a barrier),
 * dequantised into shared memory as bf16 (exact, see dequant8). Piece c of a candidate (dims
 * 8c..8c+7, 16 bytes) lies at byte (c & 1) * 512 + (c >> 1) * 16 of its row, so that the two
 * 16-byte pieces a lane reads for its 16 dims (pieces 2 lane and 2 lane + 1) are, over the warp,
 * two contiguous 512-byte runs. Of a CTA of T threads, thread x stages piece x & 63 of the
 * candidates x / 64 + j T / 64, sixteen candidates' loads in flight at a time. (The fast
 * kernels copy their records instead: fast_copy_record.)
 */
template <int THREADS = ATTN_THREADS>
static __device__ void stage_records(uint32_t n, uint8_t *sk, const attn_misc_t &ms) {
  constexpr int BATCH = 16, ROWS = THREADS / 64;
  const uint32_t c = threadIdx.x & 63;
  const bool nope = c < NOPE_PIECES;
  /* The piece's bytes in a record: 8 E4M3FN bytes of the NoPE part, or 16 of the RoPE part. */
  const uint32_t off = nope ? 8 * c : DSV4_NOPE_DIM + 16 * (c - NOPE_PIECES);
  uint8_t *dst = sk + (c & 1) * 512 + (c >> 1) * 16;
  for (uint32_t s0 = threadIdx.x >> 6; s0 < n; s0 += ROWS * BATCH) {
    uint4 raw[BATCH];
    uint32_t code[BATCH];
#pragma unroll
    for (int j = 0; j < BATCH; j++) {
      const uint32_t s = s0 + ROWS * j;
      raw[j] = make_uint4(0, 0, 0, 0);
      code[j] = 0;
      if (s < n) {
        const uint8_t *piece = ms.rec[s] + off;
        if (nope) {
          const uint2 v = *reinterpret_cast<const uint2 *>(piece);
          raw[j].x = v.x;
          raw[j].y = v.y;
          code[j] = ms.scl[s][c >> 3];
        } else {
          raw[j] = *reinterpret_cast<const uint4 *>(piece);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < BATCH; j++) {
      const uint32_t s = s0 + ROWS * j;
      if (s < n)
        *reinterpret_cast<uint4 *>(dst + (size_t)s * K_ROW) =
            nope ? dequant8(raw[j].x, raw[j].y, code[j]) : raw[j];
    }
  }
}

/* The addresses of the window's ms.n records (the exact window kernel's only candidates), through
 * the blocks in ms.blk, a thread each, with their L2 prefetches (put_record_addr): stage_records
 * may read them after a barrier. */
static __device__ void attn_addrs(const attn_params_t &p, attn_misc_t &ms) {
  const uint32_t n = ms.n;
  const int64_t lo = ms.lo, lb0 = lo >> p.bs_shift;
  const int64_t mask = ((int64_t)1 << p.bs_shift) - 1;
  for (uint32_t i = threadIdx.x; i < n; i += ATTN_THREADS) {
    const int64_t pos = lo + i;
    put_record_addr(ms, i, p.cache + (uint64_t)ms.blk[(pos >> p.bs_shift) - lb0] * p.stride,
                    pos & mask, p.bs_shift);
  }
}

/* Fast mode (attention_fast.cu): the kernel for the launch's shape, after the launch's check (the
 * check kernel has been queued before it unless p.check_all). Sets p.groups and p.nsplit itself;
 * with more than one split, p.part must hold dsv4__union_part_floats of the launch. */
cudaError_t dsv4__attention_fast_launch(attn_params_t p, int sms, cudaStream_t s, int pdl);
/* The splits of each token's window in that launch on a device of sms SMs (attention-split.h). */
uint32_t dsv4__attention_fast_splits(uint32_t n_tokens, uint32_t heads, int sms);
/* The combine kernel of a split fast launch (attention_fast_union.cu), window or union: one CTA
 * per output row, after the splits on the same stream. */
cudaError_t dsv4__attention_fast_combine_launch(const attn_params_t &p, cudaStream_t s, int pdl);
/* Fast mode over the union of the window and the compressed entries (attention_fast_union.cu),
 * after the check kernel has been queued (unless p.check_all: a launch of at most
 * UNION_CHECK_ALL_MAX tokens, which its CTAs check). Sets p.groups and p.nsplit itself; with more
 * than one split, p.part must hold dsv4__union_part_floats of the launch. */
cudaError_t dsv4__attention_fast_union_launch(attn_params_t p, int sms, cudaStream_t s, int pdl);
/* The splits of that launch on a device of sms SMs (attention-split.h). */
uint32_t dsv4__attention_fast_union_splits(uint32_t n_tokens, uint32_t heads, int sms);

#endif /* DSV4_KERNELS_CUDA_ATTENTION_COMMON_CUH */
