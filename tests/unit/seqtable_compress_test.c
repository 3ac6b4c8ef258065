/*
 * The sequence table's part of the compressed branch (SPEC §8.7): state slots, the c4 and c128
 * entry block pools, all-or-nothing allocation across the pools, the per-segment entry tables a
 * plan hands to the kernels, and release only when the sequence leaves.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "seqtable.h"

/* Served layers: 0 SWA only, 1 ratio 4, 2 ratio 128, 3 ratio 4 (shares the c4 pool with 1). */
static const uint32_t RATIO[4] = {0, 4, 128, 4};
#define BS 16

typedef struct {
  dsv4_pool_t swa, c4, c128;
  dsv4_seqtable_t *st;
  dsv4_plan_t plan;
} fx_t;

static void fx_open(fx_t *f, uint32_t swa, uint32_t c4, uint32_t c128, uint32_t max_seqs) {
  memset(f, 0, sizeof(*f));
  dsv4_seqtable_config_t cfg = {
      .n_layers = 4, .block_size = BS, .max_position = 1 << 20, .max_sequences = max_seqs};
  assert_int_equal(dsv4_pool_init(&f->swa, swa), 0);
  assert_int_equal(dsv4_pool_init(&f->c4, c4), 0);
  assert_int_equal(dsv4_pool_init(&f->c128, c128), 0);
  assert_int_equal(dsv4_seqtable_create(&cfg, &f->swa, &f->st), 0);
  assert_int_equal(dsv4_seqtable_attach_compressed(f->st, RATIO, &f->c4, &f->c128), 0);
  dsv4_plan_init(&f->plan);
}

static void fx_close(fx_t *f) {
  dsv4_plan_free(&f->plan);
  dsv4_seqtable_destroy(f->st);
  /* Destroying the table returns every block of every pool. */
  assert_int_equal(dsv4_pool_free_count(&f->swa), f->swa.n_blocks);
  assert_int_equal(dsv4_pool_free_count(&f->c4), f->c4.n_blocks);
  assert_int_equal(dsv4_pool_free_count(&f->c128), f->c128.n_blocks);
  dsv4_pool_destroy(&f->swa);
  dsv4_pool_destroy(&f->c4);
  dsv4_pool_destroy(&f->c128);
}

static dsv4_seg_req_t seg(const char *name, int64_t start, uint32_t len, int is_new) {
  return (dsv4_seg_req_t){.name = name,
                          .name_len = (uint32_t)strlen(name),
                          .start = start,
                          .len = len,
                          .is_new = is_new,
                          .hash = (uint64_t)start * 31u + len};
}

static int plan1(fx_t *f, uint32_t layer, const char *name, int64_t start, uint32_t len,
                 int is_new) {
  dsv4_seg_req_t s = seg(name, start, len, is_new);
  return dsv4_seqtable_plan(f->st, layer, &s, 1, 0, &f->plan);
}

static int step1(fx_t *f, uint32_t layer, const char *name, int64_t start, uint32_t len,
                 int is_new) {
  int rc = plan1(f, layer, name, start, len, is_new);
  if (rc == 0)
    dsv4_seqtable_commit(f->st, &f->plan, 0);
  return rc;
}

static uint32_t used(const dsv4_pool_t *p) {
  return p->n_blocks - dsv4_pool_free_count(p);
}

static void test_attach_refusals(void **state) {
  (void)state;
  dsv4_pool_t swa, c4;
  dsv4_seqtable_t *st;
  dsv4_seqtable_config_t cfg = {
      .n_layers = 4, .block_size = BS, .max_position = 1 << 20, .max_sequences = 0};
  assert_int_equal(dsv4_pool_init(&swa, 4), 0);
  assert_int_equal(dsv4_pool_init(&c4, 4), 0);
  assert_int_equal(dsv4_seqtable_create(&cfg, &swa, &st), 0);
  /* Slots need a bound. */
  assert_int_equal(dsv4_seqtable_attach_compressed(st, RATIO, &c4, &c4), DSV4_EINVAL);
  dsv4_seqtable_destroy(st);
  cfg.max_sequences = 2;
  assert_int_equal(dsv4_seqtable_create(&cfg, &swa, &st), 0);
  /* A ratio-128 layer without its pool, and a ratio the branch does not know. */
  assert_int_equal(dsv4_seqtable_attach_compressed(st, RATIO, &c4, NULL), DSV4_EINVAL);
  const uint32_t odd[4] = {0, 8, 0, 0};
  assert_int_equal(dsv4_seqtable_attach_compressed(st, odd, &c4, &c4), DSV4_EINVAL);
  dsv4_seqtable_destroy(st);
  dsv4_pool_destroy(&swa);
  dsv4_pool_destroy(&c4);
}

/* Entries are emitted at r*j + r - 1: a prefill of 100 positions at ratio 4 emits 25 entries, two
 * blocks of 16; at ratio 128 none. The SWA layer takes a slot but no entry block. */
static void test_entry_blocks_and_tables(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 8, 8, 4);
  assert_int_equal(step1(&f, 0, "a", 0, 100, 1), 0);
  assert_int_equal(used(&f.c4), 0);
  assert_int_equal(f.plan.segs[0].slot, 0);
  assert_int_equal(plan1(&f, 1, "a", 0, 100, 0), 0);
  assert_int_equal(used(&f.c4), 2);
  assert_int_equal(f.plan.c_bt_len, 2);
  assert_int_equal(f.plan.segs[0].c_first_lb, 0);
  assert_int_equal(f.plan.segs[0].c_bt_len, 2);
  assert_int_equal(f.plan.segs[0].slot, 0);
  int32_t first = f.plan.c_block_table[0];
  dsv4_seqtable_commit(f.st, &f.plan, 0);
  /* Layer 3 shares the pool: it reuses the blocks layer 1 allocated. */
  assert_int_equal(step1(&f, 3, "a", 0, 100, 0), 0);
  assert_int_equal(used(&f.c4), 2);
  assert_int_equal(f.plan.c_block_table[0], first);
  /* 28 more positions: entries 25..31 fit the second block; position 128 starts a third. */
  assert_int_equal(step1(&f, 1, "a", 100, 28, 0), 0);
  assert_int_equal(used(&f.c4), 2);
  assert_int_equal(step1(&f, 1, "a", 128, 1, 0), 0);
  assert_int_equal(used(&f.c4), 2); /* entry 32 is emitted at position 131, not 128 */
  assert_int_equal(step1(&f, 1, "a", 129, 3, 0), 0);
  assert_int_equal(used(&f.c4), 3);
  assert_int_equal(f.plan.segs[0].c_bt_len, 3);
  /* Ratio 128: entry 0 at position 127. */
  assert_int_equal(step1(&f, 2, "a", 0, 127, 0), 0);
  assert_int_equal(used(&f.c128), 0);
  assert_int_equal(step1(&f, 2, "a", 127, 1, 0), 0);
  assert_int_equal(used(&f.c128), 1);
  /* Delete frees every entry block and the slot. */
  int existed;
  assert_int_equal(dsv4_seqtable_delete(f.st, "a", 1, &existed), 0);
  assert_int_equal(existed, 1);
  assert_int_equal(used(&f.c4), 0);
  assert_int_equal(used(&f.c128), 0);
  fx_close(&f);
}

/* A sequence created at p0 > 0: its table starts at the block of entry floor(p0 / r). */
static void test_p0_offset(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 8, 8, 4);
  assert_int_equal(step1(&f, 1, "b", 4 * BS * 3 + 5, 64, 1), 0);
  assert_int_equal(f.plan.segs[0].c_first_lb, 3);
  assert_int_equal(f.plan.segs[0].c_bt_len, 2); /* entries 49..64: blocks 3 and 4 */
  assert_int_equal(used(&f.c4), 2);
  fx_close(&f);
}

/* A pool without room refuses the batch with the pool named, and nothing changes: no sequence, no
 * SWA block, no slot. */
static void test_all_or_nothing(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 1, 8, 4);
  assert_int_equal(plan1(&f, 1, "c", 0, 4 * BS + 4, 1), DSV4_ENOSPC);
  assert_string_equal(f.plan.error.pool, "c4");
  assert_int_equal(f.plan.error.needed, 2);
  assert_int_equal(f.plan.error.free, 1);
  assert_int_equal(used(&f.swa), 0);
  assert_int_equal(used(&f.c4), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 0);
  /* The SWA pool is named when it is the one without room. */
  assert_int_equal(plan1(&f, 1, "c", 0, 64 * BS + 1, 1), DSV4_ENOSPC);
  assert_string_equal(f.plan.error.pool, "swa");
  fx_close(&f);
}

/* max_sequences slots: the fifth creation is refused (sequences_full); a delete frees a slot for a
 * new sequence, which reuses it. */
static void test_slots(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 8, 8, 4);
  const char *names[4] = {"s0", "s1", "s2", "s3"};
  uint32_t seen = 0;
  for (int i = 0; i < 4; i++) {
    assert_int_equal(step1(&f, 0, names[i], 0, 1, 1), 0);
    seen |= 1u << f.plan.segs[0].slot;
  }
  assert_int_equal(seen, 0xf); /* four distinct slots */
  assert_int_equal(plan1(&f, 0, "s4", 0, 1, 1), DSV4_ENOSPC);
  assert_true(f.plan.error.sequences_full);
  int existed;
  assert_int_equal(dsv4_seqtable_delete(f.st, "s2", 2, &existed), 0);
  assert_int_equal(step1(&f, 0, "s4", 0, 1, 1), 0);
  assert_int_equal(f.plan.segs[0].slot, 2);
  fx_close(&f);
}

/* A failed batch drops its sequences with their entry blocks; a replay allocates nothing and still
 * hands the kernels the entry table. */
static void test_fail_and_replay(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 8, 8, 4);
  assert_int_equal(step1(&f, 1, "d", 0, 40, 1), 0);
  assert_int_equal(used(&f.c4), 1);
  assert_int_equal(plan1(&f, 1, "d", 0, 40, 0), 0);
  assert_true(f.plan.replay);
  assert_int_equal(f.plan.segs[0].c_bt_len, 1);
  assert_int_equal(used(&f.c4), 1);
  dsv4_seqtable_commit(f.st, &f.plan, 0);
  assert_int_equal(plan1(&f, 1, "d", 40, 40, 0), 0);
  assert_int_equal(used(&f.c4), 2);
  dsv4_seqtable_fail(f.st, &f.plan);
  assert_int_equal(used(&f.c4), 0);
  assert_int_equal(used(&f.swa), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 0);
  fx_close(&f);
}

/* Idle expiry frees the entry blocks and the slot too. */
static void test_expiry(void **state) {
  (void)state;
  fx_t f;
  memset(&f, 0, sizeof(f));
  dsv4_seqtable_config_t cfg = {.n_layers = 4,
                                .block_size = BS,
                                .max_position = 1 << 20,
                                .max_sequences = 1,
                                .idle_timeout_ns = 100};
  assert_int_equal(dsv4_pool_init(&f.swa, 8), 0);
  assert_int_equal(dsv4_pool_init(&f.c4, 8), 0);
  assert_int_equal(dsv4_pool_init(&f.c128, 8), 0);
  assert_int_equal(dsv4_seqtable_create(&cfg, &f.swa, &f.st), 0);
  assert_int_equal(dsv4_seqtable_attach_compressed(f.st, RATIO, &f.c4, &f.c128), 0);
  dsv4_plan_init(&f.plan);
  dsv4_seg_req_t s = seg("e", 0, 8, 1);
  assert_int_equal(dsv4_seqtable_plan(f.st, 1, &s, 1, 0, &f.plan), 0);
  dsv4_seqtable_commit(f.st, &f.plan, 0);
  assert_int_equal(used(&f.c4), 1);
  assert_int_equal(dsv4_seqtable_expire(f.st, 1000), 1);
  assert_int_equal(used(&f.c4), 0);
  /* The one slot is free again. */
  s = seg("g", 0, 8, 1);
  assert_int_equal(dsv4_seqtable_plan(f.st, 1, &s, 1, 1000, &f.plan), 0);
  dsv4_seqtable_commit(f.st, &f.plan, 1000);
  fx_close(&f);
}

/* Take n blocks of a pool into ids. */
static void take(dsv4_pool_t *p, int32_t *ids, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    uint32_t id;
    assert_int_equal(dsv4_pool_alloc(p, &id), 0);
    ids[i] = (int32_t)id;
  }
}

/* A restore's insert (dsv4_seqtable_insert_c): the state slot the caller wrote and its entry
 * blocks enter the table, refusals change nothing, and the plan path continues from them. */
static void test_insert_with_entries(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 64, 8, 8, 2);
  assert_int_equal(step1(&f, 1, "a", 0, 40, 1), 0); /* slot 0, one c4 block */
  dsv4_seq_centries_t ca;
  assert_int_equal(dsv4_seqtable_centries(f.st, "a", 1, &ca), 0);
  assert_int_equal(ca.slot, 0);
  assert_int_equal(ca.n[0], 1);
  assert_int_equal(ca.n[1], 0);
  assert_int_equal(ca.first_lb[0], 0);
  /* "b" at layer 1 up to 40 (entries 0..9), in 3 SWA blocks and 1 c4 block. */
  dsv4_seq_layer_state_t ls[4] = {{0, 0, 0, 0}, {40, 0, 40, 7}, {0, 0, 0, 0}, {0, 0, 0, 0}};
  dsv4_seq_state_t st = {0, ls};
  int32_t swa[3], c4[1];
  take(&f.swa, swa, 3);
  take(&f.c4, c4, 1);
  dsv4_seq_centries_t cb = {.first_lb = {0, 0}, .n = {1, 0}, .ids = {c4, NULL}};
  int taken = -1;
  assert_int_equal(dsv4_seqtable_c_next_slot(f.st, "b", 1, &cb.slot, &taken), 0);
  assert_int_equal(cb.slot, 1);
  assert_int_equal(taken, 0);
  dsv4_plan_error_t err;
  /* Refused: a's slot, entry blocks where the plan path would not put them, a free block id. */
  dsv4_seq_centries_t bad = cb;
  bad.slot = 0;
  assert_int_equal(dsv4_seqtable_insert_c(f.st, "b", 1, &st, 0, swa, 3, &bad, 0, 0, &err),
                   DSV4_EINVAL);
  bad = cb;
  bad.first_lb[0] = 1;
  assert_int_equal(dsv4_seqtable_insert_c(f.st, "b", 1, &st, 0, swa, 3, &bad, 0, 0, &err),
                   DSV4_EINVAL);
  int32_t free_id = (int32_t)(c4[0] + 1 < 8 ? c4[0] + 1 : 0);
  while (dsv4_pool_is_used(&f.c4, (uint32_t)free_id))
    free_id = (free_id + 1) % 8;
  bad = cb;
  bad.ids[0] = &free_id;
  assert_int_equal(dsv4_seqtable_insert_c(f.st, "b", 1, &st, 0, swa, 3, &bad, 0, 0, &err),
                   DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(dsv4_seqtable_insert_c(f.st, "b", 1, &st, 0, swa, 3, &cb, 0, 0, &err), 0);
  dsv4_seq_centries_t got;
  assert_int_equal(dsv4_seqtable_centries(f.st, "b", 1, &got), 0);
  assert_int_equal(got.slot, 1);
  assert_int_equal(got.n[0], 1);
  assert_int_equal(got.ids[0][0], c4[0]);
  dsv4_seq_centries_free(&got);
  /* The plan path continues: entries 10..16 reach logical block 1, and the segment has slot 1. */
  assert_int_equal(step1(&f, 1, "b", 40, 30, 0), 0);
  assert_int_equal(f.plan.segs[0].slot, 1);
  assert_int_equal(f.plan.segs[0].c_bt_len, 2);
  assert_int_equal(f.plan.c_block_table[f.plan.segs[0].c_bt_off], c4[0]);
  assert_int_equal(used(&f.c4), 3);
  /* Every slot taken: a new name has none, a live one offers its own (to be dropped first). */
  uint32_t slot;
  assert_int_equal(dsv4_seqtable_c_next_slot(f.st, "c", 1, &slot, &taken), DSV4_ENOSPC);
  assert_int_equal(dsv4_seqtable_c_next_slot(f.st, "b", 1, &slot, &taken), 0);
  assert_int_equal(slot, 1);
  assert_int_equal(taken, 1);
  /* A replace into b's own slot gives back b's blocks. */
  take(&f.swa, swa, 3);
  take(&f.c4, c4, 1);
  cb.slot = 1;
  assert_int_equal(dsv4_seqtable_insert_c(f.st, "b", 1, &st, 0, swa, 3, &cb, 1, 0, &err), 0);
  assert_int_equal(used(&f.c4), 2); /* a's and the new b's */
  int existed;
  assert_int_equal(dsv4_seqtable_delete(f.st, "b", 1, &existed), 0);
  assert_int_equal(dsv4_seqtable_delete(f.st, "a", 1, &existed), 0);
  assert_int_equal(used(&f.c4), 0);
  dsv4_seq_centries_free(&ca);
  fx_close(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_attach_refusals), cmocka_unit_test(test_entry_blocks_and_tables),
      cmocka_unit_test(test_p0_offset),       cmocka_unit_test(test_all_or_nothing),
      cmocka_unit_test(test_slots),           cmocka_unit_test(test_fail_and_replay),
      cmocka_unit_test(test_expiry),          cmocka_unit_test(test_insert_with_entries),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
