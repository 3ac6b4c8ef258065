/*
 * The indexer's selection on the GPU (indexer.cu, SPEC §8.5) against a plain model: of n keys, the
 * topk largest under (key descending, entry ascending), listed in increasing entry. The kernel's
 * radix select counts 8 bits a round over the keys still in the race. A token of at most 16384
 * keys has them in registers; a larger one reads them from global memory and copies them into
 * shared memory in the first round where the race fits its 8192 slots (the second or the third:
 * the first round's race is every key). The problems here take the registers (up to the last key
 * they hold), the copy in each round it can happen, and no copy at all (ties that keep more than
 * 8192 keys in the race to the end); the model's race sizes say which is which, so that a change
 * of either capacity cannot leave a path untested. Keys come from the daemon's own order of
 * scores (dsv4_index_score_key of finite floats: the top bytes of real keys crowd into few
 * buckets), from the whole 32-bit range, from a handful of values, and from keys whose low 16 bits
 * are zero: a round whose bucket is taken whole ends the select with the bucket's least key as
 * the threshold, and only keys equal to it tell whether the listing takes every one of them (some
 * problem must end so, or the test fails).
 *
 * Usage: gpu_select_test
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-compress.h"
#include "gpu_common.h"
#include "gpu_select_model.h"

#define TOPK 512
#define CAND 8192      /* indexer.cu's SEL_CAND */
#define REG_KEYS 16384 /* indexer.cu's REG_KEYS */
#define MAX_N 60000

typedef struct {
  const char *name;
  uint32_t n;
  int kind; /* how the keys are drawn */
} problem_t;

enum { K_SCORES, K_WIDE_SCORES, K_UNIFORM, K_FEW, K_EQUAL, K_TIES_AT_T, K_ROUND };

static void make_keys(uint64_t *rng, const problem_t *pb, uint32_t *k) {
  for (uint32_t i = 0; i < pb->n; i++) {
    switch (pb->kind) {
    case K_SCORES:
      k[i] = dsv4_index_score_key(gpu_select_score(rng, 3.0f));
      break;
    case K_WIDE_SCORES:
      k[i] = dsv4_index_score_key(gpu_select_score(rng, 3.0f) * (float)(1u << gpu_below(rng, 20)));
      break;
    case K_UNIFORM:
      k[i] = (uint32_t)gpu_rnd(rng);
      break;
    case K_FEW:
      k[i] = 0x80000000u + 0x1000u * gpu_below(rng, 5);
      break;
    case K_EQUAL:
      k[i] = 0x80000000u; /* every score 0 (the ReLU of negative dot products) */
      break;
    case K_TIES_AT_T: /* about 300 keys above, the rest equal to the 512th */
      k[i] = gpu_below(rng, 1000) < 6 ? 0xC0000000u + gpu_below(rng, 1000) : 0x9000ABCDu;
      break;
    default: /* K_ROUND: the low 16 bits zero, so a bucket taken whole holds its least key */
      k[i] = (uint32_t)gpu_below(rng, 1u << 16) << 16;
      break;
    }
  }
}

/* Whether the kernel's select ends early (a round's bucket of the k-th largest, T's, taken whole)
 * at a threshold that keys of the race equal: the round's bucket floor, T's bits from the round's
 * up and zeros below, itself a key. */
static int ends_at_a_key(const uint32_t *k, uint32_t n, uint32_t T) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    const uint32_t hi = ~0u << shift, floor = T & hi;
    uint32_t above = 0, in = 0, at_floor = 0;
    for (uint32_t i = 0; i < n; i++) {
      above += (k[i] & hi) > floor;
      in += (k[i] & hi) == floor;
      at_floor += k[i] == floor;
    }
    if (in == TOPK - above)
      return at_floor > 0;
  }
  return 0;
}

/* The model's list, and the kernel's path: 0 the keys in registers; 1, 2 the round (0-based) whose
 * race first fits CAND; 3 never. */
static int model(const uint32_t *k, uint32_t n, int32_t *list, int *at_key) {
  const uint32_t T = gpu_select_ref(k, n, TOPK, list);
  *at_key = ends_at_a_key(k, n, T);
  if (n <= REG_KEYS)
    return 0;
  /* Round r counts the keys that share T's top 8r bits; rounds 1 and 2 may copy them (round 0's
   * race, all n keys, cannot fit). */
  for (int r = 1; r < 3; r++) {
    const uint32_t mask = r ? ~0u << (32 - 8 * r) : 0u;
    uint32_t race = 0;
    for (uint32_t i = 0; i < n; i++)
      race += (k[i] & mask) == (T & mask);
    if (race <= CAND)
      return r;
  }
  return 3;
}

int main(void) {
  if (!gpu_available("gpu_select_test"))
    return GPU_SKIP;
  static const problem_t pbs[] = {
      {"2,048 scores (a C4 layer at 8K)", 2048, K_SCORES},
      {"8,192 uniform keys", 8192, K_UNIFORM},
      {"16,384 scores (64K)", 16384, K_SCORES},
      {"16,385 scores", 16385, K_SCORES},
      {"60,000 scores over 20 octaves", MAX_N, K_WIDE_SCORES},
      {"40,000 uniform keys", 40000, K_UNIFORM},
      {"60,000 scores (240K)", MAX_N, K_SCORES},
      {"20,000 keys of 5 values", 20000, K_FEW},
      {"9,000 equal keys", 9000, K_EQUAL},
      {"6,000 equal keys", 6000, K_EQUAL},
      {"16,000 keys of 5 values", 16000, K_FEW},
      {"50,000 keys, thousands tied at the 512th", 50000, K_TIES_AT_T},
      {"513 scores", 513, K_SCORES},
      {"10,000 keys of zero low bits", 10000, K_ROUND},
      {"30,000 keys of zero low bits", 30000, K_ROUND},
  };
  const uint32_t count = (uint32_t)(sizeof(pbs) / sizeof(pbs[0]));
  uint64_t rng = 0x243F6A8885A308D3ull;
  uint32_t *keys = gpu_host_alloc(sizeof(uint32_t) * MAX_N * count), n[16];
  int32_t *want = gpu_host_alloc(sizeof(int32_t) * TOPK * count);
  int32_t *got = gpu_host_alloc(sizeof(int32_t) * TOPK * count);
  int round[16], rounds_seen = 0, failures = 0, at_key = 0;
  for (uint32_t b = 0; b < count; b++) {
    n[b] = pbs[b].n;
    make_keys(&rng, &pbs[b], keys + (size_t)b * MAX_N);
    int early = 0;
    round[b] = model(keys + (size_t)b * MAX_N, n[b], want + (size_t)b * TOPK, &early);
    rounds_seen |= 1 << round[b];
    at_key += early;
  }
  uint32_t *d_keys = gpu_dev_alloc(sizeof(uint32_t) * MAX_N * count), *d_n = gpu_dev_alloc(64);
  int32_t *d_out = gpu_dev_alloc(sizeof(int32_t) * TOPK * count);
  CK(cudaMemcpy(d_keys, keys, sizeof(uint32_t) * MAX_N * count, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_n, n, sizeof(uint32_t) * count, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_out, 0xff, sizeof(int32_t) * TOPK * count));
  CKD(dsv4__cuda_test_select(d_keys, MAX_N, d_n, count, TOPK, d_out));
  CK(cudaMemcpy(got, d_out, sizeof(int32_t) * TOPK * count, cudaMemcpyDeviceToHost));
  static const char *const when[4] = {"held in registers", "copied in round 2", "copied in round 3",
                                      "never copied"};
  for (uint32_t b = 0; b < count; b++) {
    const int32_t *g = got + (size_t)b * TOPK, *w = want + (size_t)b * TOPK;
    uint32_t i = 0;
    while (i < TOPK && g[i] == w[i])
      i++;
    if (i < TOPK) {
      fprintf(stderr, "FAIL %s (%s): place %u lists entry %d, the model %d\n", pbs[b].name,
              when[round[b]], i, g[i], w[i]);
      failures++;
    } else {
      printf("ok   %s: the model's %u entries (keys %s)\n", pbs[b].name, TOPK, when[round[b]]);
    }
  }
  for (int r = 0; r < 4; r++)
    if (!(rounds_seen & (1 << r))) {
      fprintf(stderr, "FAIL no problem has its keys %s\n", when[r]);
      failures++;
    }
  if (!at_key) {
    fprintf(stderr, "FAIL no problem ends its select early at a threshold that keys equal\n");
    failures++;
  } else {
    printf("ok   %d problems end their select early at a threshold that keys equal\n", at_key);
  }
  CK(cudaFree(d_keys));
  CK(cudaFree(d_n));
  CK(cudaFree(d_out));
  free(keys);
  free(want);
  free(got);
  if (failures) {
    printf("gpu_select_test: %d check(s) FAILED\n", failures);
    return 1;
  }
  printf("gpu_select_test: every selection the model's\n");
  return 0;
}
