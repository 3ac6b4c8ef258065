#ifndef DSV4_KERNELS_CUDA_ATTENTION_UNION_CUH
#define DSV4_KERNELS_CUDA_ATTENTION_UNION_CUH
/*
 * What the union kernels of both modes share (SPEC §8.6): the per-CTA facts of a token's list of
 * candidates (the window, then its compressed entries), the setup after the dependency wait and
 * the record addresses of a tile of the list. Included by attention.cu (exact mode) and
 * attention_fast_union.cu (fast mode).
 */
#include "attention-common.cuh"

/* A token's check in shared memory, made of parts (union_check_part): its window's error bits
 * (or-ed) and its entries' first event (atomicMin, NO_EVENT before the first). */
typedef struct {
  unsigned long long ev;
  uint32_t wb;
} union_tok_check_t;

/*
 * Part c of token u's check (SPEC §8.4), for a warp (every lane calling with its lane number):
 * part 0 checks the token's segment, position and window (token_check), every part the segment and
 * position (token_window) and, when they hold, its part of the entries (entries_check_part).
 */
static __device__ __forceinline__ void union_check_part(const attn_params_t &p, uint32_t u,
                                                        uint32_t c, uint32_t lane,
                                                        union_tok_check_t &r) {
  window_t w;
  const uint32_t tb = c == 0 ? token_check(p, u, &w) : token_window(p, u, &w);
  if (tb) {
    if (lane == 0)
      atomicOr(&r.wb, tb);
    return;
  }
  const uint64_t e = entries_check_part(p, u, (uint32_t)p.tok_seg[u], w.pos, c, lane);
  if (lane == 0 && e != NO_EVENT)
    atomicMin(&r.ev, (unsigned long long)e);
}

/* A token's error bits once every part of its check is in r: its window's, else its entries'. */
static __device__ __forceinline__ uint32_t union_check_bits(const union_tok_check_t &r) {
  return r.wb ? r.wb : entries_event_bits(r.ev);
}

/* Per-CTA facts of the union kernel, beyond attn_misc_t (whose m holds the running maximum). */
typedef struct {
  float s[64];            /* each head's sum S, continued tile by tile */
  const int32_t *sel;     /* the token's selection row, or NULL */
  int64_t j_lo, j_hi;     /* the visible entries */
  uint32_t nw, nc;        /* window candidates; all candidates */
  dsv4__seg_table_t ctab; /* the token's segment's entry table */
  uint32_t ne;            /* entries listed: the first -1 of the row (atomicMin), or c_sel_stride */
  uint32_t bad;           /* the error bits of entries found wrong (union_addrs' CHECK) */
  union_tok_check_t chk[UNION_CHECK_ALL_MAX]; /* a small launch's tokens (union_check_all) */
} union_misc_t;

/* This thread's first entry of a selection row (row[threadIdx.x], or 0 past its end or without
 * one), for union_scan_row. */
static __device__ __forceinline__ int32_t union_row_first(const int32_t *row, uint32_t stride) {
  return row && threadIdx.x < stride ? row[threadIdx.x] : 0;
}

/* The entries the token's selection row lists: every thread scans its part of the row (entry
 * threadIdx.x, loaded as v by union_row_first, then every blockDim.x-th after it) for a -1 and
 * lowers um.ne to the first one found (complete after the next barrier). */
static __device__ __forceinline__ void union_scan_row(const int32_t *row, uint32_t stride,
                                                      int32_t v, union_misc_t &um) {
  if (!row || threadIdx.x >= stride)
    return;
  if (v == -1) { /* the thread's later entries come after it */
    atomicMin(&um.ne, threadIdx.x);
    return;
  }
  for (uint32_t k = threadIdx.x + blockDim.x; k < stride; k += blockDim.x)
    if (row[k] == -1)
      atomicMin(&um.ne, k);
}

#ifdef DSV4_TEST_BROKEN_UNION_EARLY_READ
/*
 * Test-only breakage of SPEC §5.2 (tests/gpu/gpu_inv_union_wait.c): the entries the token's
 * selection row lists are counted before the wait, while the grid before this one (the indexer)
 * may still be writing the row; union_setup keeps that count.
 */
static __device__ void union_early_count(const attn_params_t &p, uint32_t t, union_misc_t &um) {
  if (threadIdx.x == 0)
    um.ne = p.c_sel ? p.c_sel_stride : 0u;
  __syncthreads();
  const int32_t *row = p.c_sel ? p.c_sel + (uint64_t)t * p.c_sel_stride : NULL;
  union_scan_row(row, p.c_sel_stride, union_row_first(row, p.c_sel_stride), um);
}
#endif

/* 0, or the error bits of the launch's segments (segment_check), a thread each. */
static __device__ __forceinline__ uint32_t union_check_segments(const attn_params_t &p) {
  uint32_t bits = 0;
  for (uint32_t s = threadIdx.x; s < p.n_segments; s += blockDim.x)
    bits |= segment_check(p, s);
  return bits;
}

/*
 * 0, or the error bits of a whole small union launch (p.check_all; um.chk cleared before a
 * barrier): every segment (a thread each) and every part of every token's check (a warp each,
 * union_check_part: a selection of 512 is 16 parts, which the CTA's warps take side by side), the
 * checks of the check kernel, which such a launch does not run. A barrier, unless every token is
 * one part (no selection).
 */
static __device__ uint32_t union_check_all(const attn_params_t &p, union_misc_t &um) {
  const uint32_t tid = threadIdx.x, parts = entries_parts(p);
  uint32_t bits = union_check_segments(p);
  if (parts == 1) { /* a part a token: a warp's bits are the token's, with no barrier */
    for (uint32_t u = tid >> 5; u < p.n_tokens; u += blockDim.x >> 5) { /* warp-uniform */
      window_t w;
      uint32_t tb = token_check(p, u, &w);
      if (!tb)
        tb = entries_event_bits(
            entries_check_part(p, u, (uint32_t)p.tok_seg[u], w.pos, 0, tid & 31));
      bits |= tb;
    }
    return bits;
  }
  for (uint32_t i = tid >> 5; i < p.n_tokens * parts; i += blockDim.x >> 5) /* warp-uniform */
    union_check_part(p, i / parts, i % parts, tid & 31, um.chk[i / parts]);
  __syncthreads();
  for (uint32_t u = tid; u < p.n_tokens; u += blockDim.x)
    bits |= union_check_bits(um.chk[u]);
  return bits;
}

/*
 * The union kernel's setup (after the dependency wait): the window's blocks and the RoPE row as
 * attn_window, the running maxima and sums, the candidate count and the segment's entry table. The
 * launch was checked by the check kernel before, or, for a small launch (p.check_all), here:
 *   unsplit  every CTA checks all of it (the first one reports the errors): it writes its output,
 *            so it must know that no token of the launch is wrong
 *   split    (fast mode, p.nsplit > 1) a CTA writes only its partial state, and the combine
 *            kernel, after its wait, writes nothing once the error word is set; so a CTA checks
 *            the segments, its token's window here and, as union_addrs resolves them, the entries
 *            it reads (CHECK), and sets the error word instead of writing its partial state when
 *            one is wrong (split_checks: a kernel built to, attention_fast_union.cu). The token's
 * entries are its list's (before the row's first -1), each in one split's span, so the launch is
 * refused exactly when one is wrong. A CTA that finds the error word set, or an error, returns
 * before writing anything, every thread of it. At one decode token the setup is a chain of
 * dependent loads, so each is issued as soon as its address is known: the token's segment and
 * position, the selection row and the error word first (an earlier kernel's error is final after
 * the wait; one of this launch only spares the CTA's work), then the segment's tables and the RoPE
 * row, then the blocks.
 */
static __device__ int union_setup(const attn_params_t &p, uint32_t t, attn_misc_t &ms,
                                  union_misc_t &um, bool split_checks = false) {
  const uint32_t tid = threadIdx.x;
  const int32_t *row = p.c_sel ? p.c_sel + (uint64_t)t * p.c_sel_stride : NULL;
  const int32_t seg = p.tok_seg[t];
  const int64_t pos = p.pos[t];
  const uint32_t earlier = tid == 0 ? __ldcg(p.err) : 0u;
#ifndef DSV4_TEST_BROKEN_UNION_EARLY_READ
  const int32_t v = union_row_first(row, p.c_sel_stride);
  if (tid == 0)
    um.ne = p.c_sel ? p.c_sel_stride : 0u;
#endif
  if (tid == 0)
    um.bad = 0;
  if (tid < 64) {
    ms.m[tid] = -INFINITY;
    um.s[tid] = 0.0f;
  }
  if (tid < UNION_CHECK_ALL_MAX) {
    um.chk[tid].ev = NO_EVENT;
    um.chk[tid].wb = 0;
  }
  __syncthreads();
  /* the RoPE chunks and the entry table, beside the segment's loads (used once it checks out) */
  float4 rope = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (tid >= 32 && tid < 48 && pos >= 0 && pos < p.max_pos)
    rope = p.rope[(uint64_t)pos * 16 + (tid - 32)];
  dsv4__seg_table_t ctab = {0, 0, 0};
  if (tid == 0 && seg >= 0 && (uint32_t)seg < p.n_segments)
    ctab = dsv4__seg_table(p, (uint32_t)seg);
  window_t w;
  uint32_t bits = token_window_of(p, seg, pos, &w);
#ifndef DSV4_TEST_BROKEN_UNION_EARLY_READ
  union_scan_row(row, p.c_sel_stride, v, um);
#endif
  if (!bits) {
    const uint32_t nb = window_blocks(p, w);
    if (tid < nb)
      ms.blk[tid] = window_block(p, w, tid, &bits);
    if (tid >= 32 && tid < 48)
      reinterpret_cast<float4 *>(ms.rope)[tid - 32] = rope;
    if (tid == 0) {
      const int64_t j_lo = p.seg_p0[seg] / p.ratio, j_hi = (w.pos + 1) / p.ratio;
      ms.lo = w.lo;
      um.nw = (uint32_t)(w.pos - w.lo + 1);
      um.ctab = ctab;
      um.j_lo = j_lo;
      um.j_hi = j_hi;
      um.sel = row;
      if (!row)
        um.ne = j_hi > j_lo ? (uint32_t)(j_hi - j_lo) : 0u;
    }
  }
  split_checks = split_checks && p.check_all && p.nsplit > 1;
  if (split_checks)
    bits |= union_check_segments(p);
  else if (p.check_all)
    bits |= union_check_all(p, um);
  if (earlier != 0)
    bits |= ERR_EARLIER;
  if ((bits & ERR_REPORTED) &&
      (!p.check_all || split_checks || (blockIdx.x == 0 && blockIdx.y == 0)))
    atomicOr(p.err, bits & ERR_REPORTED);
  if (__syncthreads_or(bits != 0))
    return 1;
  if (tid == 0)
    um.nc = um.nw + um.ne;
  __syncthreads();
  return 0;
}

/* The error bits of the token's entry k (SPEC §8.4, as entries_event checks it) whose block the
 * entry table gives as b: not visible, not above the one before, or no block. */
static __device__ __forceinline__ uint32_t union_entry_bits(const union_misc_t &um, uint32_t k,
                                                            int64_t j, int32_t b) {
  if (um.sel && (j < um.j_lo || j >= um.j_hi || (k && j <= (int64_t)um.sel[k - 1])))
    return DSV4_CUDA_ERR_ENTRY;
  return b < 0 ? DSV4_CUDA_ATTN_ERR_BLOCK : 0u;
}

/* The record addresses of candidates first..first + nt - 1 (one thread each: the caller's i, by
 * default its thread index) into ms.rec and ms.scl from slot0 on (put_record_addr, with its L2
 * prefetch unless the caller copies them at once): window positions through ms.blk, then entries
 * through the segment's entry table. CHECK (a split CTA that checks what it reads, union_setup): an
 * entry found wrong (union_entry_bits) adds its bits to *bad and reads the query's own record
 * instead, which the setup has checked. */
template <bool PREFETCH = true, bool CHECK = false>
static __device__ void union_addrs(const attn_params_t &p, attn_misc_t &ms, const union_misc_t &um,
                                   uint32_t first, uint32_t nt, uint32_t *bad = NULL,
                                   uint32_t i = UINT32_MAX, uint32_t slot0 = 0) {
  if (i == UINT32_MAX)
    i = threadIdx.x;
  if (i >= nt)
    return;
  const uint32_t c = first + i;
  const int64_t mask = ((int64_t)1 << p.bs_shift) - 1;
  const uint8_t *base;
  int64_t o;
  if (c < um.nw) {
    const int64_t pos = ms.lo + c;
    base = p.cache + (uint64_t)ms.blk[(pos >> p.bs_shift) - (ms.lo >> p.bs_shift)] * p.stride;
    o = pos & mask;
  } else {
    const int64_t j = um.sel ? (int64_t)um.sel[c - um.nw] : um.j_lo + (c - um.nw);
    const int32_t b = dsv4__table_block(p, um.ctab, j >> p.bs_shift);
    base = p.c_cache + (uint64_t)b * p.stride;
    o = j & mask;
    const uint32_t wrong = CHECK ? union_entry_bits(um, c - um.nw, j, b) : 0u;
    if (wrong) {
      const int64_t pos = ms.lo + um.nw - 1;
      atomicOr(bad, wrong);
      base = p.cache + (uint64_t)ms.blk[(pos >> p.bs_shift) - (ms.lo >> p.bs_shift)] * p.stride;
      o = pos & mask;
    }
  }
  put_record_addr<PREFETCH>(ms, slot0 + i, base, o, p.bs_shift);
}

#endif /* DSV4_KERNELS_CUDA_ATTENTION_UNION_CUH */
