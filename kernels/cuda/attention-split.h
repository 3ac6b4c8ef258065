#ifndef DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H
#define DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H
/*
 * The split of fast mode's attention at small batches, in plain C so that the host's choices are
 * tested without a device (tests/unit/union_split_test.c): how many splits a launch gets, the size
 * and layout of the partial states the splits leave for the combine kernel, and how many heads a
 * union CTA takes. Over the union
 * (attention_fast_union.cu) split s of nsplit takes the candidates s span.. of its token's list
 * (dsv4__union_split_span), in tiles of at most 128; over the window alone (attention_fast.cu) it
 * takes the window's candidates 128 s / nsplit.. (128 / nsplit of them).
 */
#include <stdint.h>

/* The span of a split is computed by the union kernel too: host and device code under CUDA. */
#ifdef __CUDACC__
#define DSV4_SPLIT_FN static inline __host__ __device__
#else
#define DSV4_SPLIT_FN static inline
#endif

/* The most splits of one token's list: at one decode token of 64 heads (4 CTAs of 16) on a device
 * of 132 SMs, 32 splits; over the window and a selection of 512 (640 candidates) their span is 32
 * (20 rounded up to 16), so 20 of them take 32 candidates each and 12 none. */
#define DSV4_UNION_MAX_SPLITS 32u
/* Floats of one partial state: the unnormalised sum N (512), then the maximum m and the sum S. */
#define DSV4_UNION_PART_FLOATS 514u

/*
 * Splits of a launch of `ctas` CTAs (query tokens times head groups) on a device of `sms` SMs: 1
 * once the CTAs fill half the device, else as many as fit on it beside each other (one CTA per SM),
 * at most DSV4_UNION_MAX_SPLITS. It depends on the launch's shape only, so a batch gets the same
 * split, and the same bytes, on every run.
 */
static inline uint32_t dsv4__union_splits(uint64_t ctas, int sms) {
  if (ctas == 0 || sms <= 0 || 2 * ctas >= (uint64_t)sms)
    return 1;
  const uint64_t k = (uint64_t)sms / ctas;
  return k > DSV4_UNION_MAX_SPLITS ? DSV4_UNION_MAX_SPLITS : (uint32_t)k;
}

/*
 * The candidates of each split of a list of nc candidates in nsplit splits: nc / nsplit rounded up
 * to a multiple of 16 (whole m16n8k16 tiles), the last splits taking what is left or nothing; the
 * whole list without a split. Split 0 always holds the list's first candidate.
 */
DSV4_SPLIT_FN uint32_t dsv4__union_split_span(uint32_t nc, uint32_t nsplit) {
  if (nsplit <= 1)
    return nc;
  return ((nc + nsplit - 1) / nsplit + 15u) & ~15u;
}

/* A count of splits k as a window launch takes it: rounded down to 1, 2, 4 or 8. */
static inline uint32_t dsv4__window_split_count(uint32_t k) {
  return k >= 8 ? 8 : k >= 4 ? 4 : k >= 2 ? 2 : 1;
}

/*
 * Splits of a fast window launch (attention_fast.cu) of `ctas` CTAs: the union's count rounded down
 * to a power of two (at most 8), so that split s of n takes the window's candidates s 128 / n..
 * (128 / n of them, a multiple of 16: whole m16n8k16 tiles).
 */
static inline uint32_t dsv4__window_splits(uint64_t ctas, int sms) {
  return dsv4__window_split_count(dsv4__union_splits(ctas, sms));
}

/*
 * The heads a fast union CTA takes (16 MT: MT 1, 2, or 4 for the warpgroup kernel, which `wg` says
 * the device runs for this launch: sm_90a, more than 32 heads): the fewest waves of CTAs (one an
 * SM) times a CTA's cost, ties to larger CTAs. The costs: a CTA of 16 heads 2, of 32 heads 3 (a
 * staging and an m-tile each, as the window's choose_mt), of 64 heads on warpgroup MMAs 3.5, from a
 * CTA's walk of 640 candidates on an H100 (C4 8K: 32 heads about 60 µs, 64 heads about 70;
 * tests/bench/NOTES.md). So a decode step of 64 heads takes 64-head CTAs from 67 tokens on 132
 * SMs, where 32-head CTAs would need a second wave.
 */
static inline int dsv4__union_choose_mt(uint32_t n_tokens, uint32_t heads, int sms, int wg) {
  static const uint32_t cost10[3] = {20, 30, 35}; /* tenths, by log2 MT */
  uint64_t best = UINT64_MAX;
  int best_mt = 1;
  if (heads == 0)
    heads = 1;
  if (sms <= 0)
    sms = 1;
  for (int lg = wg ? 2 : 1; lg >= 0; lg--) {
    const uint64_t groups = (heads + (16u << lg) - 1) / (16u << lg);
    const uint64_t waves = ((uint64_t)n_tokens * groups + (uint64_t)sms - 1) / (uint64_t)sms;
    if (waves * cost10[lg] < best) {
      best = waves * cost10[lg];
      best_mt = 1 << lg;
    }
  }
  return best_mt;
}

/*
 * The floats of partial state a launch of n_tokens tokens, `heads` heads and nsplit splits writes
 * (0 when it does not split). Layout: N of (token t, head h, split s) at ((t heads + h) nsplit + s)
 * 512, then after every N the pairs (m, S) at 512 n_tokens heads nsplit + 2 ((t heads + h) nsplit +
 * s).
 */
static inline uint64_t dsv4__union_part_floats(uint32_t n_tokens, uint32_t heads, uint32_t nsplit) {
  return nsplit > 1 ? (uint64_t)n_tokens * heads * nsplit * DSV4_UNION_PART_FLOATS : 0;
}

#endif /* DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H */
