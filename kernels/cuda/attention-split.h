#ifndef DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H
#define DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H
/*
 * The split of fast mode's union attention at small batches (attention_fast_union.cu), in plain C
 * so that the host's choices are tested without a device (tests/unit/union_split_test.c): how many
 * splits a launch gets, and the size and layout of the partial states the splits leave for the
 * combine kernel. Split s of nsplit takes tiles s, s + nsplit, s + 2 nsplit, ... of its token's
 * list (tile k: candidates 128 k..128 k + 127), in that order.
 */
#include <stdint.h>

/* The most splits of one token's list: 8 tiles of 128 candidates cover the window and a selection
 * of 896 entries, past V4-Flash's 512. */
#define DSV4_UNION_MAX_SPLITS 8u
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
 * The floats of partial state a launch of n_tokens tokens, `heads` heads and nsplit splits writes
 * (0 when it does not split). Layout: N of (token t, head h, split s) at ((t heads + h) nsplit + s)
 * 512, then after every N the pairs (m, S) at 512 n_tokens heads nsplit + 2 ((t heads + h) nsplit +
 * s).
 */
static inline uint64_t dsv4__union_part_floats(uint32_t n_tokens, uint32_t heads, uint32_t nsplit) {
  return nsplit > 1 ? (uint64_t)n_tokens * heads * nsplit * DSV4_UNION_PART_FLOATS : 0;
}

#endif /* DSV4_KERNELS_CUDA_ATTENTION_SPLIT_H */
