/*
 * SPEC §5.4, determinism: the same batch from the same state gives byte-identical q_out and cache
 * bytes on every run. Each batch runs 20 times on CPU backends of 1, 2 and 4 threads (which split
 * the work differently, down to groups of heads), from a fresh zeroed cache each time and from a
 * cache full of earlier bytes, at every kernel level the machine has; every run must equal the
 * first single-threaded run, and the kernel levels must equal each other.
 *
 * Built again with DSV4_TEST_BROKEN_ORDER (worker threads sum the squares of the RMS norm in index
 * order instead of the canonical chains and fold, so the bytes depend on which thread computed a
 * head), this test must fail (ctest: inv_determinism_broken_order).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu/cpu-internal.h"
#include "cpu/cpu_backend.h"
#include "inv_common.h"

#define RUNS 20
#define NONZERO_RUNS 3
#define BS 64

static const uint32_t thread_counts[] = {1, 2, 4};
#define N_THREAD_COUNTS (sizeof(thread_counts) / sizeof(thread_counts[0]))

typedef struct {
  const char *name;
  uint32_t n, heads, n_blocks;
  int fused;
  uint16_t *q, *kv;
  int64_t *pos, *slots;
  float w[DSV4_HEAD_DIM];
  size_t q_bytes, cache_bytes;
} batch_t;

/*
 * One 512-vector per call of inv_fill_bf16 (each with its own range of magnitudes), and in one
 * vector of four a spike 2^12 times larger than the rest, whose square absorbs the small squares
 * in a way that depends on the summation order: any change of order shows in the bytes.
 */
static void fill_rows(uint16_t *v, size_t rows) {
  for (size_t r = 0; r < rows; r++) {
    uint16_t *x = v + r * DSV4_HEAD_DIM;
    inv_fill_bf16(x, DSV4_HEAD_DIM);
    if (inv_below(4) != 0)
      continue;
    unsigned emax = 0;
    for (int d = 0; d < DSV4_HEAD_DIM; d++)
      emax = ((x[d] >> 7) & 0xff) > emax ? (x[d] >> 7) & 0xff : emax;
    unsigned e = emax + 12 < 127 + 58 ? emax + 12 : 127 + 58;
    uint16_t *spike = &x[inv_below(DSV4_HEAD_DIM)];
    *spike = (uint16_t)((*spike & 0x807fu) | (e << 7));
  }
}

static void batch_make(batch_t *b, const char *name, uint32_t n, uint32_t heads, int fused,
                       dsv4_rope_table_t *rope) {
  memset(b, 0, sizeof(*b));
  b->name = name;
  b->n = n;
  b->heads = heads;
  b->fused = fused;
  b->n_blocks = (n + BS - 1) / BS * 2 + 1;
  b->q_bytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
  b->cache_bytes = (size_t)b->n_blocks * DSV4_BLOCK_STRIDE(BS);
  b->q = inv_alloc(b->q_bytes);
  b->kv = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2);
  b->pos = inv_alloc(n * sizeof(int64_t));
  b->slots = inv_alloc(n * sizeof(int64_t));
  fill_rows(b->q, (size_t)n * heads);
  fill_rows(b->kv, n);
  inv_fill_weight(b->w);
  /* Distinct slots in a shuffled order, one row in eight without a slot. */
  uint64_t n_slots = (uint64_t)b->n_blocks * BS;
  uint32_t *perm = inv_alloc(n_slots * sizeof(uint32_t));
  for (uint32_t i = 0; i < n_slots; i++)
    perm[i] = i;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t j = i + inv_below((uint32_t)(n_slots - i));
    uint32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
    b->slots[i] = inv_below(8) == 0 ? -1 : (int64_t)perm[i];
    b->pos[i] = inv_below(1u << 20);
  }
  free(perm);
  assert_int_equal(dsv4_rope_table_ensure(rope, b->pos, n), 0);
}

static void batch_free(batch_t *b) {
  free(b->q);
  free(b->kv);
  free(b->pos);
  free(b->slots);
}

/* One launch from the cache state `start` (NULL: zeroed); q_out starts as junk. */
static void run(dsv4_backend_t *be, dsv4_rope_table_t *rope, const batch_t *b, const uint8_t *start,
                uint16_t *q_out, uint8_t *cache) {
  memset(q_out, 0xCD, b->q_bytes);
  if (start)
    memcpy(cache, start, b->cache_bytes);
  else
    memset(cache, 0, b->cache_bytes);
  dsv4_insert_args_t a = {
      .n_tokens = b->n,
      .heads = b->heads,
      .q = b->q,
      .kv = b->kv,
      .positions = b->pos,
      .slots = b->slots,
      .rope = rope,
      .kv_norm_weight = b->fused ? b->w : NULL,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = q_out,
      .cache = cache,
      .block_size = BS,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(BS),
  };
  assert_int_equal(be->ops->qkv_insert(be, &a), 0);
  assert_int_equal(be->ops->sync(be), 0);
}

static size_t count_diff(const uint8_t *x, const uint8_t *y, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++)
    d += x[i] != y[i];
  return d;
}

typedef struct {
  dsv4_backend_t *be[N_THREAD_COUNTS];
  dsv4_rope_table_t *rope;
  int violations;
} fixture_t;

/* Compares one run with the reference; returns 1 when they differ. */
static int compare(fixture_t *f, const batch_t *b, const char *isa, uint32_t threads, int r,
                   const char *state, const uint16_t *q_ref, const uint8_t *c_ref,
                   const uint16_t *q_out, const uint8_t *cache) {
  size_t dq = count_diff((const uint8_t *)q_ref, (const uint8_t *)q_out, b->q_bytes);
  size_t dc = count_diff(c_ref, cache, b->cache_bytes);
  if (dq == 0 && dc == 0)
    return 0;
  if (f->violations++ < 8)
    INV_REPORT(4,
               "determinism: batch %s (%u tokens x %u heads) on %s with %u threads, run %d from "
               "a %s cache: %zu q_out bytes and %zu cache bytes differ from the 1-thread run",
               b->name, b->n, b->heads, isa, threads, r, state, dq, dc);
  return 1;
}

static void check_batch(fixture_t *f, const batch_t *b, int isa, int *have_first, uint16_t *q_first,
                        uint8_t *c_first) {
  const char *isa_name = dsv4__cpu_isa_name(isa);
  uint16_t *q_ref = inv_alloc(b->q_bytes), *q_out = inv_alloc(b->q_bytes);
  uint8_t *c_ref = inv_alloc(b->cache_bytes), *cache = inv_alloc(b->cache_bytes);
  uint8_t *start = inv_alloc(b->cache_bytes);
  for (size_t i = 0; i < N_THREAD_COUNTS; i++)
    assert_int_equal(dsv4__cpu_backend_set_isa(f->be[i], isa), 0);

  /* From zeroed caches: the reference is the first single-threaded run. */
  run(f->be[0], f->rope, b, NULL, q_ref, c_ref);
  if (!*have_first) {
    *have_first = 1;
    memcpy(q_first, q_ref, b->q_bytes);
    memcpy(c_first, c_ref, b->cache_bytes);
  } else {
    /* Every kernel level gives the same bytes (SPEC §2). */
    compare(f, b, isa_name, 1, 0, "zeroed (level against scalar)", q_first, c_first, q_ref, c_ref);
  }
  for (size_t i = 0; i < N_THREAD_COUNTS; i++)
    for (int r = 0; r < RUNS; r++) {
      run(f->be[i], f->rope, b, NULL, q_out, cache);
      compare(f, b, isa_name, thread_counts[i], r, "zeroed", q_ref, c_ref, q_out, cache);
    }

  /* From a cache full of earlier bytes: unwritten records must keep them, the rest as before. */
  for (size_t i = 0; i < b->cache_bytes; i++)
    start[i] = (uint8_t)inv_rnd();
  run(f->be[0], f->rope, b, start, q_ref, c_ref);
  for (size_t i = 0; i < N_THREAD_COUNTS; i++)
    for (int r = 0; r < NONZERO_RUNS; r++) {
      run(f->be[i], f->rope, b, start, q_out, cache);
      compare(f, b, isa_name, thread_counts[i], r, "non-zero", q_ref, c_ref, q_out, cache);
    }
  free(q_ref);
  free(q_out);
  free(c_ref);
  free(cache);
  free(start);
}

static void test_same_batch_same_bytes(void **state) {
  (void)state;
  fixture_t f = {0};
  char why[128];
  for (size_t i = 0; i < N_THREAD_COUNTS; i++) {
    dsv4_backend_options_t opt = {.threads = thread_counts[i]};
    assert_int_equal(dsv4_cpu_backend_open(&opt, &f.be[i], why, sizeof(why)), 0);
  }
  f.rope = inv_rope_plain();
  assert_non_null(f.rope);
  /* Many tokens (split by token), and few tokens with many heads (split into head groups), each
   * large enough for the backend to spread it over its workers. */
  batch_t batches[2];
  batch_make(&batches[0], "tokens", 64, 8, 1, f.rope);
  batch_make(&batches[1], "heads", 3, 128, 0, f.rope);
#ifdef DSV4__CPU_INLINE_Q_BYTES
  /* Smaller launches run on the calling thread alone and would not test the split at all. */
  for (size_t k = 0; k < 2; k++)
    assert_true(batches[k].q_bytes >= DSV4__CPU_INLINE_Q_BYTES);
#endif
  int levels = 0, per_batch[2];
  for (size_t k = 0; k < 2; k++) {
    int before = f.violations;
    uint16_t *q_first = inv_alloc(batches[k].q_bytes);
    uint8_t *c_first = inv_alloc(batches[k].cache_bytes);
    int have_first = 0;
    levels = 0;
    for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++) {
      if (!dsv4__cpu_isa_supported(isa))
        continue;
      check_batch(&f, &batches[k], isa, &have_first, q_first, c_first);
      levels++;
    }
    per_batch[k] = f.violations - before;
    free(q_first);
    free(c_first);
    batch_free(&batches[k]);
  }
  for (size_t i = 0; i < N_THREAD_COUNTS; i++)
    dsv4_backend_close(f.be[i]);
  dsv4_rope_table_destroy(f.rope);
  printf("determinism: 2 batches, %d kernel levels, threads 1/2/4 x %d runs: %d violations "
         "(%d by token, %d by head group)\n",
         levels, RUNS, f.violations, per_batch[0], per_batch[1]);
  assert_int_equal(f.violations, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_same_batch_same_bytes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
