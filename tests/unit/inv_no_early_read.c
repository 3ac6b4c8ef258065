/*
 * SPEC §5.2, nothing touches mutable memory before the dependency wait: on the CPU the producer
 * (map_slots) and its consumer (qkv_insert) are separated by a join. This test is linked against a
 * build of the CPU backend made with DSV4_TEST_DELAY_PRODUCER, whose map_slots hands its tokens to
 * producer threads that sleep before they write their slots. The slot buffer is reused from batch
 * to batch and starts each batch holding slots of a canary block; after map_slots and qkv_insert
 * the canary block must be untouched, every slot must be the one the block table gives, and the
 * cache must equal a reference cache written from slots the test computed itself.
 *
 * Built again with DSV4_TEST_BROKEN_NO_JOIN (map_slots returns before its producers finish), the
 * consumer reads the stale canary slots and this test must fail (ctest:
 * inv_no_early_read_broken_no_join).
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

#ifndef DSV4_TEST_DELAY_PRODUCER
#error "inv_no_early_read needs the CPU backend built with DSV4_TEST_DELAY_PRODUCER"
#endif

#define N_BLOCKS 12
#define CANARY_BLOCK (N_BLOCKS - 1)
#define MAX_TOKENS 64
#define MAX_SEGS 3
#define MAX_BT 4

typedef struct {
  uint32_t n, heads, bs, n_segs;
  int64_t pos[MAX_TOKENS];
  int32_t tok_seg[MAX_TOKENS];
  int64_t expect[MAX_TOKENS]; /* the slot the block table gives each token */
  int64_t seg_first_lb[MAX_SEGS];
  uint32_t seg_bt_off[MAX_SEGS], seg_bt_len[MAX_SEGS];
  int32_t block_table[MAX_SEGS * MAX_BT];
} plan_t;

/* Segments over distinct blocks other than the canary block; some entries have no block. */
static void random_plan(plan_t *p) {
  static const uint32_t sizes[] = {16, 64};
  memset(p, 0, sizeof(*p));
  p->bs = sizes[inv_below(2)];
  p->heads = 1 + inv_below(16);
  p->n_segs = 1 + inv_below(MAX_SEGS);
  int used[N_BLOCKS] = {0};
  uint32_t off = 0;
  for (uint32_t s = 0; s < p->n_segs; s++) {
    uint32_t len = 1 + inv_below(MAX_BT);
    p->seg_first_lb[s] = inv_below(1000);
    p->seg_bt_off[s] = off;
    p->seg_bt_len[s] = len;
    for (uint32_t k = 0; k < len; k++) {
      int32_t b = -1;
      if (inv_below(5) != 0) {
        do
          b = (int32_t)inv_below(CANARY_BLOCK);
        while (used[b]);
        used[b] = 1;
      }
      p->block_table[off + k] = b;
    }
    off += len;
    /* The segment's tokens: contiguous positions inside the blocks its table maps. */
    uint64_t first = (uint64_t)p->seg_first_lb[s] * p->bs;
    uint64_t span = (uint64_t)len * p->bs;
    uint32_t want = 1 + inv_below(MAX_TOKENS / MAX_SEGS);
    uint64_t start = first + inv_rnd() % span;
    for (uint32_t i = 0; i < want && start + i < first + span; i++) {
      uint32_t t = p->n++;
      int64_t pos = (int64_t)(start + i);
      p->pos[t] = pos;
      p->tok_seg[t] = (int32_t)s;
      int32_t b = p->block_table[p->seg_bt_off[s] + (uint64_t)pos / p->bs - p->seg_first_lb[s]];
      p->expect[t] = b < 0 ? -1 : (int64_t)b * p->bs + pos % p->bs;
    }
  }
}

typedef struct {
  dsv4_backend_t *be;
  dsv4_rope_table_t *rope;
  int64_t *slots; /* reused by every batch, as the daemon reuses its slot buffer */
} fixture_t;

/* One batch; returns the number of violations found. */
static int run_batch(fixture_t *f, int batch) {
  plan_t p;
  random_plan(&p);
  uint64_t stride = DSV4_BLOCK_STRIDE(p.bs);
  size_t cache_bytes = (size_t)N_BLOCKS * stride;
  size_t q_elems = (size_t)p.n * p.heads * DSV4_HEAD_DIM;
  uint8_t *cache = calloc(1, cache_bytes), *ref = calloc(1, cache_bytes);
  uint16_t *q = inv_alloc(q_elems * 2), *q_out = inv_alloc(q_elems * 2);
  uint16_t *ref_q_out = inv_alloc(q_elems * 2), *kv = inv_alloc((size_t)p.n * DSV4_HEAD_DIM * 2);
  assert_non_null(cache);
  assert_non_null(ref);
  inv_fill_bf16(q, q_elems);
  inv_fill_bf16(kv, (size_t)p.n * DSV4_HEAD_DIM);
  assert_int_equal(dsv4_rope_table_ensure(f->rope, p.pos, p.n), 0);
  /* Stale slots from "the previous batch": all in the canary block. */
  for (uint32_t t = 0; t < MAX_TOKENS; t++)
    f->slots[t] = (int64_t)CANARY_BLOCK * p.bs + t % p.bs;

  const dsv4_backend_ops_t *ops = f->be->ops;
  dsv4_map_args_t ma = {
      .n_tokens = p.n,
      .n_segments = p.n_segs,
      .block_size = p.bs,
      .n_blocks = N_BLOCKS,
      .positions = p.pos,
      .tok_seg = p.tok_seg,
      .seg_first_lb = p.seg_first_lb,
      .seg_bt_off = p.seg_bt_off,
      .seg_bt_len = p.seg_bt_len,
      .block_table = p.block_table,
      .slots = f->slots,
  };
  dsv4_insert_args_t ia = {
      .n_tokens = p.n,
      .heads = p.heads,
      .q = q,
      .kv = kv,
      .positions = p.pos,
      .slots = f->slots,
      .rope = f->rope,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = q_out,
      .cache = cache,
      .block_size = p.bs,
      .n_blocks = N_BLOCKS,
      .stride = stride,
  };
  /* The engine's order: map_slots, qkv_insert, sync. */
  int rc = ops->map_slots(f->be, &ma);
  if (rc == 0)
    rc = ops->qkv_insert(f->be, &ia);
  if (rc == 0)
    rc = ops->sync(f->be);

  int bad = 0;
  if (rc == 0) {
    /* What the consumer saw, read before anything waits for a late producer. */
    int64_t seen[MAX_TOKENS];
    memcpy(seen, f->slots, sizeof(seen[0]) * p.n);
    size_t touched = 0;
    const uint8_t *canary = cache + (size_t)CANARY_BLOCK * stride;
    for (uint64_t i = 0; i < stride; i++)
      touched += canary[i] != 0;
    if (touched) {
      INV_REPORT(2,
                 "the consumer wrote %zu bytes of canary block %d: qkv_insert read slots "
                 "before map_slots had written them [batch %d, %u tokens, bs %u]",
                 touched, CANARY_BLOCK, batch, p.n, p.bs);
      bad++;
    }
    for (uint32_t t = 0; t < p.n; t++)
      if (seen[t] != p.expect[t]) {
        INV_REPORT(2, "token %u has slot %lld once map_slots returned, expected %lld [batch %d]", t,
                   (long long)seen[t], (long long)p.expect[t], batch);
        bad++;
        break;
      }
    /* The reference: the same batch from the slots the test computed. */
    ia.slots = p.expect;
    ia.cache = ref;
    ia.q_out = ref_q_out;
    rc = ops->qkv_insert(f->be, &ia);
    if (rc == 0)
      rc = ops->sync(f->be);
    if (rc == 0) {
      for (uint32_t t = 0; t < p.n; t++) {
        if (p.expect[t] < 0)
          continue;
        size_t blk = (size_t)((uint64_t)p.expect[t] / p.bs * stride);
        uint64_t o = (uint64_t)p.expect[t] % p.bs;
        if (memcmp(cache + blk + DSV4_TOKEN_DATA_OFFSET(o), ref + blk + DSV4_TOKEN_DATA_OFFSET(o),
                   DSV4_TOKEN_DATA_BYTES) != 0 ||
            memcmp(cache + blk + DSV4_SCALE_OFFSET(p.bs, o), ref + blk + DSV4_SCALE_OFFSET(p.bs, o),
                   DSV4_SCALE_BYTES) != 0) {
          INV_REPORT(2, "the record of token %u is not at its slot %lld [batch %d]", t,
                     (long long)p.expect[t], batch);
          bad++;
          break;
        }
      }
      if (memcmp(cache, ref, cache_bytes) != 0) {
        INV_REPORT(2, "the cache differs from the reference written from the true slots [batch %d]",
                   batch);
        bad++;
      }
      if (memcmp(q_out, ref_q_out, q_elems * 2) != 0) {
        INV_REPORT(2, "q_out differs from the reference [batch %d]", batch);
        bad++;
      }
    }
  }
  /* A broken producer may still be running: it must be done before its buffers go away. */
  dsv4__cpu_backend_test_drain(f->be);
  free(cache);
  free(ref);
  free(q);
  free(q_out);
  free(ref_q_out);
  free(kv);
  assert_int_equal(rc, 0);
  return bad;
}

static void test_consumer_waits_for_producer(void **state) {
  (void)state;
  fixture_t f = {0};
  dsv4_backend_options_t opt = {.threads = 2};
  char why[128];
  assert_int_equal(dsv4_cpu_backend_open(&opt, &f.be, why, sizeof(why)), 0);
  f.rope = inv_rope_plain();
  assert_non_null(f.rope);
  f.slots = inv_alloc(MAX_TOKENS * sizeof(int64_t));
  int bad = 0, batches = 8;
  for (int b = 0; b < batches; b++)
    bad += run_batch(&f, b);
  free(f.slots);
  dsv4_rope_table_destroy(f.rope);
  dsv4_backend_close(f.be);
  printf("producer/consumer join: %d batches, %d violations\n", batches, bad);
  assert_int_equal(bad, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_consumer_waits_for_producer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
