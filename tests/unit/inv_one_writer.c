/*
 * SPEC §5.1, one writer per byte. This test is linked against a build of the CPU backend made with
 * DSV4_TEST_COUNT_STORES, where every store into q_out or the cache also reports its address and
 * length to dsv4__test_count_store below. A shadow array holds one counter per output byte; after
 * each qkv_insert every byte of q_out and of each written token's 584-byte record must have been
 * stored exactly once, and every other cache byte (other tokens' records, the records of slot -1
 * rows, the scale pad of unwritten tokens, block padding) never.
 *
 * Built again with DSV4_TEST_BROKEN_BULK_STORE (the KV path stores all 512 values unrotated, then
 * the rotated RoPE values over bytes 448..575: the vLLM XPU bug), this test must fail and name the
 * bytes that were written twice (ctest: inv_one_writer_broken_bulk_store), at every kernel level.
 *
 * Usage: inv_one_writer [level]. With a level name ("scalar", "avx2", "avx512") only that level
 * runs, and the test fails if this machine cannot run it; without one, every level it can run.
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

#ifndef DSV4_TEST_COUNT_STORES
#error "inv_one_writer needs the CPU backend built with DSV4_TEST_COUNT_STORES"
#endif

/* ---- the shadow counters ---- */

typedef struct {
  const uint8_t *base;
  size_t size;
  uint8_t *count; /* one counter per byte of [base, base + size) */
} region_t;

enum { R_QOUT, R_CACHE, R_COUNT };

static region_t regions[R_COUNT];
static size_t stray_stores; /* stores outside q_out and the cache */

void dsv4__test_count_store(const void *p, size_t n) {
  const uint8_t *b = p;
  for (int r = 0; r < R_COUNT; r++) {
    const region_t *g = &regions[r];
    if (g->base && b >= g->base && n <= g->size && (size_t)(b - g->base) <= g->size - n) {
      size_t off = (size_t)(b - g->base);
      /* Several workers store at once; a lost increment would hide a double store. */
      for (size_t i = 0; i < n; i++)
        __atomic_fetch_add(&g->count[off + i], 1, __ATOMIC_RELAXED);
      return;
    }
  }
  __atomic_fetch_add(&stray_stores, 1, __ATOMIC_RELAXED);
}

/* ---- one case ---- */

typedef struct {
  uint32_t heads, n_tokens, threads;
  int fused;    /* kv_norm = fused */
  int write_kv; /* 0: a replayed batch, the cache must not be touched */
  int stream;   /* force non-temporal q_out stores */
  uint32_t neg_pct;
} case_t;

/* The one level to run, or -1 for every level the machine supports (main's argument). */
static int only_isa = -1;

/* Reports runs of equal wrong counts; returns the number of wrong bytes. */
static size_t check_counts(const uint8_t *count, const uint8_t *expect, size_t n, const char *what,
                           const case_t *c, int isa, uint32_t bs, uint64_t stride, int *reports) {
  size_t wrong = 0;
  for (size_t i = 0; i < n;) {
    if (count[i] == expect[i]) {
      i++;
      continue;
    }
    size_t j = i;
    while (j < n && count[j] == count[i] && expect[j] == expect[i])
      j++;
    wrong += j - i;
    if ((*reports)++ < 3) {
      char where[160];
      if (stride == 0) {
        size_t head_bytes = DSV4_HEAD_DIM * 2;
        snprintf(where, sizeof(where), "q_out token %zu head %zu bytes %zu..%zu",
                 i / head_bytes / c->heads, i / head_bytes % c->heads, i % head_bytes,
                 (j - 1) % head_bytes);
      } else {
        inv_describe_cache(where, sizeof(where), i, j - 1, bs);
      }
      INV_REPORT(1,
                 "one writer per byte: %s (%zu bytes) stored %u times, expected %u "
                 "[%s, %s H=%u N=%u threads=%u bs=%u%s%s]",
                 where, j - i, count[i], expect[i], what, dsv4__cpu_isa_name(isa), c->heads,
                 c->n_tokens, c->threads, bs, c->write_kv ? "" : " replay",
                 c->stream ? " stream" : "");
    }
    i = j;
  }
  return wrong;
}

/* Runs one random batch; returns the number of wrongly counted bytes. */
static size_t run_case(dsv4_backend_t *be, dsv4_rope_table_t *rope, int isa, const case_t *c,
                       int *reports) {
  static const uint32_t sizes[] = {16, 64, 256};
  uint32_t bs = sizes[inv_below(3)];
  uint32_t n = c->n_tokens, h = c->heads;
  uint32_t n_blocks = (n + bs - 1) / bs * 2 + 2;
  uint64_t stride = DSV4_BLOCK_STRIDE(bs);
  size_t q_elems = (size_t)n * h * DSV4_HEAD_DIM, cache_bytes = (size_t)n_blocks * stride;

  uint16_t *q = inv_alloc(q_elems * 2);
  /* 64-byte aligned, as the daemon's q_out is, so that the non-temporal path really runs. */
  uint16_t *q_out = aligned_alloc(64, q_elems * 2);
  assert_non_null(q_out);
  uint16_t *kv = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2);
  int64_t *pos = inv_alloc(n * sizeof(int64_t)), *slots = inv_alloc(n * sizeof(int64_t));
  uint8_t *cache = calloc(1, cache_bytes);
  uint8_t *qcount = calloc(1, q_elems * 2), *ccount = calloc(1, cache_bytes);
  uint8_t *qexpect = inv_alloc(q_elems * 2), *cexpect = calloc(1, cache_bytes);
  float w[DSV4_HEAD_DIM];
  assert_non_null(cache);
  assert_non_null(qcount);
  assert_non_null(ccount);
  assert_non_null(cexpect);

  inv_fill_bf16(q, q_elems);
  inv_fill_bf16(kv, (size_t)n * DSV4_HEAD_DIM);
  inv_fill_weight(w);
  /* Distinct slots (SPEC §5.3) anywhere in the pool, some rows without one. */
  uint64_t n_slots = (uint64_t)n_blocks * bs;
  uint8_t *taken = calloc(1, n_slots);
  assert_non_null(taken);
  for (uint32_t t = 0; t < n; t++) {
    pos[t] = (int64_t)inv_below(1u << 20);
    if (inv_below(100) < c->neg_pct) {
      slots[t] = -1;
      continue;
    }
    uint64_t s;
    do
      s = inv_rnd() % n_slots;
    while (taken[s]);
    taken[s] = 1;
    slots[t] = (int64_t)s;
  }
  free(taken);
  assert_int_equal(dsv4_rope_table_ensure(rope, pos, n), 0);

  memset(qexpect, 1, q_elems * 2);
  for (uint32_t t = 0; t < n && c->write_kv; t++) {
    if (slots[t] < 0)
      continue;
    uint8_t *blk = cexpect + (uint64_t)slots[t] / bs * stride;
    uint64_t o = (uint64_t)slots[t] % bs;
    memset(blk + DSV4_TOKEN_DATA_OFFSET(o), 1, DSV4_TOKEN_DATA_BYTES);
    memset(blk + DSV4_SCALE_OFFSET(bs, o), 1, DSV4_SCALE_BYTES);
  }

  regions[R_QOUT] = (region_t){(const uint8_t *)q_out, q_elems * 2, qcount};
  regions[R_CACHE] = (region_t){cache, cache_bytes, ccount};
  stray_stores = 0;
  dsv4__cpu_backend_set_stream_bytes(be, c->stream ? 0 : UINT64_MAX);
  dsv4_insert_args_t a = {
      .n_tokens = n,
      .heads = h,
      .q = q,
      .kv = kv,
      .positions = pos,
      .slots = slots,
      .rope = rope,
      .kv_norm_weight = c->fused ? w : NULL,
      .eps = 1e-6f,
      .write_kv = c->write_kv,
      .q_out = q_out,
      .cache = cache,
      .block_size = bs,
      .n_blocks = n_blocks,
      .stride = stride,
  };
  int rc = be->ops->qkv_insert(be, &a);
  if (rc == 0)
    rc = be->ops->sync(be);
  memset(regions, 0, sizeof(regions));

  size_t wrong = 0;
  if (rc == 0) {
    wrong += check_counts(qcount, qexpect, q_elems * 2, "q_out", c, isa, bs, 0, reports);
    wrong += check_counts(ccount, cexpect, cache_bytes, "cache", c, isa, bs, stride, reports);
    if (stray_stores)
      INV_REPORT(1, "one writer per byte: %zu stores outside q_out and the cache", stray_stores);
    wrong += stray_stores;
  }
  free(q);
  free(q_out);
  free(kv);
  free(pos);
  free(slots);
  free(cache);
  free(qcount);
  free(ccount);
  free(qexpect);
  free(cexpect);
  assert_int_equal(rc, 0);
  return wrong;
}

static void test_one_writer_per_byte(void **state) {
  (void)state;
  static const case_t cases[] = {
      {.heads = 1, .n_tokens = 1, .write_kv = 1},
      {.heads = 3, .n_tokens = 7, .write_kv = 1, .neg_pct = 30},
      {.heads = 8, .n_tokens = 37, .write_kv = 1, .neg_pct = 20, .fused = 1},
      {.heads = 64, .n_tokens = 5, .write_kv = 1, .neg_pct = 20},
      {.heads = 128, .n_tokens = 3, .write_kv = 1, .fused = 1, .stream = 1},
      {.heads = 16, .n_tokens = 100, .write_kv = 1, .neg_pct = 10, .stream = 1},
      {.heads = 5, .n_tokens = 300, .write_kv = 1, .neg_pct = 50},
      {.heads = 32, .n_tokens = 9, .write_kv = 0},
  };
  static const uint32_t thread_counts[] = {1, 3};
  dsv4_rope_table_t *rope = inv_rope_plain();
  assert_non_null(rope);
  size_t wrong = 0, launches = 0, wrong_at[DSV4__CPU_ISA_COUNT] = {0};
  for (size_t ti = 0; ti < sizeof(thread_counts) / sizeof(thread_counts[0]); ti++) {
    dsv4_backend_options_t opt = {.threads = thread_counts[ti]};
    dsv4_backend_t *be = NULL;
    char why[128];
    assert_int_equal(dsv4_cpu_backend_open(&opt, &be, why, sizeof(why)), 0);
    for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++) {
      if (!dsv4__cpu_isa_supported(isa) || (only_isa >= 0 && isa != only_isa))
        continue;
      assert_int_equal(dsv4__cpu_backend_set_isa(be, isa), 0);
      for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        case_t c = cases[ci];
        c.threads = thread_counts[ti];
        int reports = 0;
        size_t w = run_case(be, rope, isa, &c, &reports);
        wrong += w;
        wrong_at[isa] += w;
        launches++;
      }
    }
    dsv4_backend_close(be);
  }
  dsv4_rope_table_destroy(rope);
  printf("one writer per byte: %zu launches, %zu wrongly stored bytes (", launches, wrong);
  const char *sep = "";
  for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++)
    if (dsv4__cpu_isa_supported(isa) && (only_isa < 0 || isa == only_isa)) {
      printf("%s%s %zu", sep, dsv4__cpu_isa_name(isa), wrong_at[isa]);
      sep = ", ";
    }
  printf(")\n");
  assert_int_equal(wrong, 0);
}

int main(int argc, char **argv) {
  if (argc > 1) {
    for (int isa = DSV4__CPU_ISA_SCALAR; isa < DSV4__CPU_ISA_COUNT; isa++)
      if (strcmp(argv[1], dsv4__cpu_isa_name(isa)) == 0)
        only_isa = isa;
    if (only_isa < 0) {
      fprintf(stderr, "inv_one_writer: unknown kernel level '%s'\n", argv[1]);
      return 2;
    }
    if (!dsv4__cpu_isa_supported(only_isa)) {
      /* ctest's SKIP_RETURN_CODE: hardware this machine lacks, as for a GPU test. */
      printf("skipped: this machine cannot run kernel level '%s'\n", argv[1]);
      return 77;
    }
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_writer_per_byte),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
