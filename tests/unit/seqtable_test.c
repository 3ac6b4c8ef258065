#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "seqtable.h"

/* A table plus its pool, built per test. */
typedef struct {
  dsv4_pool_t pool;
  dsv4_seqtable_t *st;
  dsv4_plan_t plan;
  dsv4_seqtable_config_t cfg;
} fx_t;

static void fx_open(fx_t *f, uint32_t n_layers, uint32_t bs, uint32_t n_blocks) {
  memset(f, 0, sizeof(*f));
  f->cfg.n_layers = n_layers;
  f->cfg.block_size = bs;
  f->cfg.max_position = 1 << 20;
  f->cfg.max_sequences = 1000;
  f->cfg.idle_timeout_ns = 0;
  assert_int_equal(dsv4_pool_init(&f->pool, n_blocks), 0);
  assert_int_equal(dsv4_seqtable_create(&f->cfg, &f->pool, &f->st), 0);
  dsv4_plan_init(&f->plan);
}

static void fx_reopen(fx_t *f) {
  dsv4_seqtable_destroy(f->st);
  assert_int_equal(dsv4_pool_free_count(&f->pool), f->pool.n_blocks);
  assert_int_equal(dsv4_seqtable_create(&f->cfg, &f->pool, &f->st), 0);
}

static void fx_close(fx_t *f) {
  dsv4_plan_free(&f->plan);
  dsv4_seqtable_destroy(f->st);
  /* Destroying the table returns every block. */
  assert_int_equal(dsv4_pool_free_count(&f->pool), f->pool.n_blocks);
  dsv4_pool_destroy(&f->pool);
}

static dsv4_seg_req_t seg(const char *name, int64_t start, uint32_t len, int is_new, uint64_t h) {
  dsv4_seg_req_t r;
  r.name = name;
  r.name_len = (uint32_t)strlen(name);
  r.start = start;
  r.len = len;
  r.is_new = is_new;
  r.hash = h;
  return r;
}

/* Plan and commit one batch; returns the plan's result. */
static int step(fx_t *f, uint32_t layer, const dsv4_seg_req_t *s, uint32_t n, uint64_t now) {
  int rc = dsv4_seqtable_plan(f->st, layer, s, n, now, &f->plan);
  if (rc == 0)
    dsv4_seqtable_commit(f->st, &f->plan, now);
  return rc;
}

static int step1(fx_t *f, uint32_t layer, const char *name, int64_t start, uint32_t len, int is_new,
                 uint64_t h) {
  dsv4_seg_req_t s = seg(name, start, len, is_new, h);
  return step(f, layer, &s, 1, 0);
}

static void get_info(fx_t *f, const char *name, dsv4_seq_info_t *info) {
  assert_int_equal(dsv4_seqtable_info(f->st, name, (uint32_t)strlen(name), info), 0);
}

static uint32_t used(fx_t *f) {
  return f->pool.n_blocks - dsv4_pool_free_count(&f->pool);
}

static void test_name_valid(void **state) {
  (void)state;
  char n128[129], n129[130];
  memset(n128, 'a', 128);
  n128[128] = 0;
  memset(n129, 'a', 129);
  n129[129] = 0;
  assert_true(dsv4_seq_name_valid("a", 1));
  assert_true(dsv4_seq_name_valid("Az09._:-", 8));
  assert_true(dsv4_seq_name_valid("a.", 2));
  assert_true(dsv4_seq_name_valid(n128, 128));
  assert_false(dsv4_seq_name_valid(n129, 129));
  assert_false(dsv4_seq_name_valid("", 0));
  assert_false(dsv4_seq_name_valid(".a", 2));
  assert_false(dsv4_seq_name_valid("a b", 3));
  assert_false(dsv4_seq_name_valid("a/b", 3));
  assert_false(dsv4_seq_name_valid("a\0b", 3));
  assert_false(dsv4_seq_name_valid("\xc3\xa9", 2));
  assert_false(dsv4_seq_name_valid(NULL, 0));
}

static void test_create_and_block_table(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 16, 64);
  /* Two new sequences in one batch, one starting at p0 = 40 (block 2, offset 8). */
  dsv4_seg_req_t s[2] = {seg("a", 0, 20, 1, 1), seg("b", 40, 30, 1, 2)};
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, s, 2, 5, &f.plan), 0);
  assert_int_equal(f.plan.n_segments, 2);
  assert_false(f.plan.replay);
  /* a covers positions 0..19: blocks 0 and 1; b covers 40..69: blocks 2..4. */
  assert_int_equal(f.plan.segs[0].first_lb, 0);
  assert_int_equal(f.plan.segs[0].bt_len, 2);
  assert_int_equal(f.plan.segs[1].first_lb, 2);
  assert_int_equal(f.plan.segs[1].bt_len, 3);
  assert_int_equal(f.plan.bt_len, 5);
  assert_int_equal(used(&f), 5);
  assert_int_equal(dsv4_seqtable_count(f.st), 2);
  assert_int_equal(dsv4_seqtable_count_relaxed(f.st), 2);
  /* Every physical id differs. */
  for (uint32_t i = 0; i < 5; i++)
    for (uint32_t j = i + 1; j < 5; j++)
      assert_int_not_equal(f.plan.block_table[i], f.plan.block_table[j]);
  int32_t bt[5];
  memcpy(bt, f.plan.block_table, sizeof(bt));
  dsv4_seqtable_commit(f.st, &f.plan, 7);

  dsv4_seq_info_t info;
  get_info(&f, "b", &info);
  assert_int_equal(info.p0, 40);
  assert_int_equal(info.next[0], 70);
  assert_int_equal(info.next[1], 40);
  assert_int_equal(info.last_start[0], 40);
  assert_int_equal(info.last_start[1], 40);
  assert_int_equal(info.first_lb, 2);
  assert_int_equal(info.n_blocks_held, 3);
  assert_memory_equal(info.blocks, bt + 2, 3 * sizeof(int32_t));
  assert_int_equal(info.last_used_ns, 7);
  dsv4_seq_info_free(&info);

  /* Layer 1 writes the same positions: it shares the blocks and allocates nothing. */
  dsv4_seg_req_t s1 = seg("b", 40, 30, 0, 3);
  assert_int_equal(dsv4_seqtable_plan(f.st, 1, &s1, 1, 8, &f.plan), 0);
  assert_int_equal(used(&f), 5);
  assert_memory_equal(f.plan.block_table, bt + 2, 3 * sizeof(int32_t));
  dsv4_seqtable_commit(f.st, &f.plan, 8);

  /* The next layer-0 segment of a (20..99) maps its window from 0 and allocates blocks 2..6. */
  dsv4_seg_req_t s2 = seg("a", 20, 80, 0, 4);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, &s2, 1, 9, &f.plan), 0);
  assert_int_equal(used(&f), 10);
  assert_int_equal(f.plan.segs[0].first_lb, 0);
  assert_int_equal(f.plan.segs[0].bt_len, 7);
  assert_int_equal(f.plan.block_table[0], bt[0]);
  assert_int_equal(f.plan.block_table[1], bt[1]);
  dsv4_seqtable_commit(f.st, &f.plan, 9);
  fx_close(&f);
}

static void test_errors(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 16, 8);
  assert_int_equal(step1(&f, 0, "x", 0, 10, 1, 1), 0);
  uint32_t u = used(&f);
  dsv4_seg_req_t s[3];

  assert_int_equal(step1(&f, 2, "x", 10, 1, 0, 1), DSV4_ELAYER);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, s, 0, 0, &f.plan), DSV4_EINVAL);

  s[0] = seg("x", 10, 1, 0, 1);
  s[1] = seg(".bad", 0, 1, 1, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EINVAL);
  assert_int_equal(f.plan.error.segment, 1);
  s[1] = seg("y", 0, 0, 1, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EINVAL);
  assert_int_equal(f.plan.error.segment, 1);

  s[1] = seg("y", -1, 1, 1, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EPOSRANGE);
  assert_int_equal(f.plan.error.segment, 1);
  /* The last position must be below max_position: start + len = max is fine, one more is not. */
  f.cfg.max_position = 100;
  fx_reopen(&f);
  assert_int_equal(step1(&f, 0, "x", 0, 10, 1, 1), 0);
  assert_int_equal(step1(&f, 0, "y", 90, 11, 1, 1), DSV4_EPOSRANGE);
  assert_int_equal(step1(&f, 0, "y", 100, 1, 1, 1), DSV4_EPOSRANGE);
  assert_int_equal(step1(&f, 0, "y", 90, 10, 1, 1), 0);
  assert_int_equal(step1(&f, 0, "y", 100, 1, 0, 1), DSV4_EPOSRANGE);
  u = used(&f);

  s[0] = seg("z", 0, 1, 1, 1);
  s[1] = seg("x", 10, 1, 0, 1);
  s[2] = seg("z", 0, 1, 1, 1);
  assert_int_equal(step(&f, 0, s, 3, 0), DSV4_EDUPSEQ);
  assert_int_equal(f.plan.error.segment, 2);

  s[0] = seg("x", 10, 1, 0, 1);
  s[1] = seg("nobody", 0, 1, 0, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_ENOSEQ);
  assert_int_equal(f.plan.error.segment, 1);

  s[1] = seg("x", 10, 1, 1, 1); /* duplicate too, but test EEXIST alone below */
  s[0] = seg("y", 100, 1, 1, 1);
  assert_int_equal(step(&f, 0, s, 1, 0), DSV4_EPOSRANGE);
  s[0] = seg("z", 0, 2, 1, 1);
  s[1] = seg("x", 10, 1, 1, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EEXIST);
  assert_int_equal(f.plan.error.segment, 1);
  assert_int_equal(f.plan.error.expected, 10);
  /* At a layer not yet written, the expected position is p0. */
  s[1] = seg("x", 0, 1, 1, 1);
  assert_int_equal(step(&f, 1, s, 2, 0), DSV4_EEXIST);
  assert_int_equal(f.plan.error.expected, 0);

  s[1] = seg("x", 11, 1, 0, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EPOSITION);
  assert_int_equal(f.plan.error.segment, 1);
  assert_int_equal(f.plan.error.expected, 10);
  s[1] = seg("x", 9, 1, 0, 1);
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_EPOSITION);
  assert_int_equal(f.plan.error.expected, 10);
  s[1] = seg("x", 5, 1, 0, 1);
  assert_int_equal(step(&f, 1, s, 2, 0), DSV4_EPOSITION);
  assert_int_equal(f.plan.error.expected, 0);

  /* None of the refused batches changed anything: z was never created. */
  assert_int_equal(used(&f), u);
  assert_int_equal(dsv4_seqtable_count(f.st), 2);
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_seqtable_info(f.st, "z", 1, &info), DSV4_ENOSEQ);
  get_info(&f, "x", &info);
  assert_int_equal(info.next[0], 10);
  assert_int_equal(info.next[1], 0);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

static void test_pool_exhausted(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 1, 16, 6);
  assert_int_equal(step1(&f, 0, "a", 0, 16 * 3, 1, 1), 0); /* 3 blocks */
  dsv4_seg_req_t s[2] = {seg("a", 48, 17, 0, 2), seg("b", 0, 17, 1, 3)};
  /* a needs 2 more (48..64 spans blocks 3 and 4), b needs 2: 4 > 3 free. */
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_ENOSPC);
  assert_int_equal(f.plan.error.needed, 4);
  assert_int_equal(f.plan.error.free, 3);
  assert_false(f.plan.error.sequences_full);
  assert_int_equal(used(&f), 3);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  /* Exactly what is free is enough. */
  s[1] = seg("b", 0, 16, 1, 3);
  assert_int_equal(step(&f, 0, s, 2, 0), 0);
  assert_int_equal(dsv4_pool_free_count(&f.pool), 0);
  fx_close(&f);
}

static void test_max_sequences(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  f.cfg.max_sequences = 2;
  fx_reopen(&f);
  assert_int_equal(step1(&f, 0, "a", 0, 1, 1, 1), 0);
  dsv4_seg_req_t s[2] = {seg("b", 0, 1, 1, 1), seg("c", 0, 1, 1, 1)};
  assert_int_equal(step(&f, 0, s, 2, 0), DSV4_ENOSPC);
  assert_true(f.plan.error.sequences_full);
  assert_int_equal(f.plan.error.new_sequences, 2);
  assert_int_equal(f.plan.error.free_sequences, 1);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(used(&f), 1);
  assert_int_equal(step(&f, 0, s, 1, 0), 0);
  int existed;
  assert_int_equal(dsv4_seqtable_delete(f.st, "a", 1, &existed), 0);
  assert_int_equal(step(&f, 0, s + 1, 1, 0), 0);
  fx_close(&f);
}

static void test_replay(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 16, 64);
  dsv4_seg_req_t s[2] = {seg("a", 0, 40, 1, 11), seg("b", 5, 3, 1, 22)};
  assert_int_equal(step(&f, 0, s, 2, 1), 0);
  uint32_t u = used(&f);
  /* The same batch again, "new" and all: a replay, mapped over the positions it covers. */
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, s, 2, 2, &f.plan), 0);
  assert_true(f.plan.replay);
  assert_int_equal(f.plan.segs[0].first_lb, 0);
  assert_int_equal(f.plan.segs[0].bt_len, 3);
  assert_int_equal(f.plan.segs[1].bt_len, 1);
  assert_int_equal(used(&f), u);
  dsv4_seqtable_commit(f.st, &f.plan, 2);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.next[0], 40);
  assert_int_equal(info.last_used_ns, 2);
  dsv4_seq_info_free(&info);
  /* Without "new", one segment of the batch: still a replay. */
  s[0].is_new = 0;
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, s, 1, 3, &f.plan), 0);
  assert_true(f.plan.replay);
  dsv4_seqtable_commit(f.st, &f.plan, 3);
  /* A different hash, length or start is not a replay. */
  s[0].hash = 12;
  assert_int_equal(step(&f, 0, s, 1, 0), DSV4_EPOSITION);
  assert_int_equal(f.plan.error.expected, 40);
  s[0].hash = 11;
  s[0].len = 39;
  assert_int_equal(step(&f, 0, s, 1, 0), DSV4_EPOSITION);
  s[0].len = 40;
  /* Not a replay at another layer. */
  assert_int_equal(step(&f, 1, s, 1, 0), 0);
  assert_int_equal(step(&f, 1, s, 1, 0), 0);
  assert_true(f.plan.replay);
  /* Mixing a replay with a fresh segment: the replayed one fails its position check. */
  dsv4_seg_req_t m[2] = {seg("a", 40, 1, 0, 5), seg("b", 5, 3, 0, 22)};
  assert_int_equal(step(&f, 0, m, 2, 0), DSV4_EPOSITION);
  assert_int_equal(f.plan.error.segment, 1);
  assert_int_equal(f.plan.error.expected, 8);
  m[1].is_new = 1;
  assert_int_equal(step(&f, 0, m, 2, 0), DSV4_EEXIST);
  assert_int_equal(f.plan.error.segment, 1);
  assert_int_equal(used(&f), u);
  /* After a fresh segment the old one is no longer a replay. */
  assert_int_equal(step(&f, 0, m, 1, 0), 0);
  assert_int_equal(step(&f, 0, s, 1, 0), DSV4_EPOSITION);
  assert_int_equal(step(&f, 0, m, 1, 0), 0);
  assert_true(f.plan.replay);
  fx_close(&f);
}

static uint32_t ceil_div(uint32_t a, uint32_t b) {
  return (a + b - 1) / b;
}

/* One-token decode from p0 = 0: block 0 goes exactly when the step at position bs + 127 commits. */
static void release_boundaries(uint32_t bs) {
  fx_t f;
  fx_open(&f, 1, bs, 64);
  assert_int_equal(step1(&f, 0, "a", 0, 1, 1, 0), 0);
  uint32_t most = 0;
  for (int64_t p = 1; p < 4 * (int64_t)bs + 300; p++) {
    assert_int_equal(step1(&f, 0, "a", p, 1, 0, (uint64_t)p), 0);
    dsv4_seq_info_t info;
    get_info(&f, "a", &info);
    /* Written positions max(0, p - 127)..p stay; the first held block is the one holding p - 127.
     */
    int64_t lo = p - 127 < 0 ? 0 : p - 127;
    assert_int_equal(info.first_lb, lo / bs);
    assert_int_equal(info.first_lb + info.n_blocks_held, p / bs + 1);
    if (p == (int64_t)bs + 126)
      assert_int_equal(info.first_lb, 0);
    if (p == (int64_t)bs + 127)
      assert_int_equal(info.first_lb, 1);
    assert_true(info.n_blocks_held <= ceil_div(127, bs) + 1);
    if (info.n_blocks_held > most)
      most = info.n_blocks_held;
    assert_int_equal(used(&f), info.n_blocks_held);
    dsv4_seq_info_free(&info);
  }
  /* The bound of SPEC §4 is reached. */
  assert_int_equal(most, ceil_div(127, bs) + 1);
  fx_close(&f);
}

static void test_release_bs16(void **state) {
  (void)state;
  release_boundaries(16);
}
static void test_release_bs64(void **state) {
  (void)state;
  release_boundaries(64);
}
static void test_release_bs256(void **state) {
  (void)state;
  release_boundaries(256);
}

static void test_release_uses_segment_start(void **state) {
  (void)state;
  /* s_L is the start of the last segment, not the next position: a long segment keeps its window.
   */
  fx_t f;
  fx_open(&f, 1, 16, 128);
  assert_int_equal(step1(&f, 0, "a", 0, 200, 1, 0), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 0);
  assert_int_equal(info.n_blocks_held, 13);
  dsv4_seq_info_free(&info);
  assert_int_equal(step1(&f, 0, "a", 200, 300, 0, 0), 0);
  get_info(&f, "a", &info);
  /* max(0, 200 - 127) = 73: blocks 0..3 (positions up to 63) go, block 4 (64..79) stays. */
  assert_int_equal(info.first_lb, 4);
  assert_int_equal(info.first_lb + info.n_blocks_held, 32);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

static void test_release_p0(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 64, 16);
  assert_int_equal(step1(&f, 0, "a", 1000, 1, 1, 0), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 1000 / 64);
  assert_int_equal(info.n_blocks_held, 1);
  dsv4_seq_info_free(&info);
  for (int64_t p = 1001; p < 1300; p++) {
    assert_int_equal(step1(&f, 0, "a", p, 1, 0, 0), 0);
    assert_int_equal(step1(&f, 1, "a", p - 1, 1, 0, 0), 0);
    get_info(&f, "a", &info);
    int64_t lo = p - 1 - 127 < 1000 ? 1000 : p - 1 - 127;
    assert_int_equal(info.first_lb, lo / 64);
    /* Ties (both windows clamped at p0) name the lowest layer. */
    assert_int_equal(info.holding_layer, p - 127 > 1000 ? 1 : 0);
    dsv4_seq_info_free(&info);
  }
  fx_close(&f);
}

static void test_multilayer_holds_back(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 3, 16, 256);
  assert_int_equal(step1(&f, 0, "a", 0, 100, 1, 0), 0);
  assert_int_equal(step1(&f, 1, "a", 0, 100, 0, 0), 0);
  /* Layer 0 runs far ahead; layer 2 never wrote, so its window is at p0 and keeps every block. */
  for (int64_t p = 100; p < 600; p += 50)
    assert_int_equal(step1(&f, 0, "a", p, 50, 0, 0), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 0);
  assert_int_equal(info.n_blocks_held, 600 / 16 + 1);
  assert_true(info.holding_layer == 1 || info.holding_layer == 2);
  dsv4_seq_info_free(&info);
  /* Layer 2 catches up in one segment 0..399: layer 1 (s = 0) still holds everything. */
  assert_int_equal(step1(&f, 2, "a", 0, 400, 0, 0), 0);
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 0);
  assert_int_equal(info.holding_layer, 1);
  dsv4_seq_info_free(&info);
  /* Layer 1 moves to s = 300: now layer 2 (s = 0) holds. */
  assert_int_equal(step1(&f, 1, "a", 100, 200, 0, 0), 0);
  assert_int_equal(step1(&f, 1, "a", 300, 1, 0, 0), 0);
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 0);
  assert_int_equal(info.holding_layer, 2);
  dsv4_seq_info_free(&info);
  /* Layer 2 to s = 400: the lowest window start is layer 1's 300 - 127 = 173, block 10. */
  assert_int_equal(step1(&f, 2, "a", 400, 10, 0, 0), 0);
  get_info(&f, "a", &info);
  assert_int_equal(info.first_lb, 173 / 16);
  assert_int_equal(info.holding_layer, 1);
  assert_int_equal(used(&f), info.n_blocks_held);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

static void test_expiry(void **state) {
  (void)state;
  const uint64_t T = 1000;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  f.cfg.idle_timeout_ns = T;
  fx_reopen(&f);
  dsv4_seg_req_t a = seg("a", 0, 20, 1, 1), b = seg("b", 0, 20, 1, 1);
  assert_int_equal(step(&f, 0, &a, 1, 100), 0);
  assert_int_equal(step(&f, 0, &b, 1, 600), 0);
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + T - 1), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 2);
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + T), 1);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(dsv4_seqtable_count_relaxed(f.st), 1);
  assert_int_equal(used(&f), 2);
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_EEXPIRED);
  a = seg("a", 20, 1, 0, 2);
  assert_int_equal(step(&f, 0, &a, 1, 100 + T), DSV4_EEXPIRED);
  assert_int_equal(step(&f, 0, &a, 1, 100 + 2 * T - 1), DSV4_EEXPIRED);
  /* One period after expiry it is unknown, whether or not the sweep has run. */
  assert_int_equal(step(&f, 0, &a, 1, 100 + 2 * T), DSV4_ENOSEQ);
  /* b was used at 600: a batch at 1500 keeps it alive past 1600. */
  b = seg("b", 20, 1, 0, 2);
  assert_int_equal(step(&f, 0, &b, 1, 1500), 0);
  assert_int_equal(dsv4_seqtable_expire(f.st, 1600), 0);
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_EEXPIRED);
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + 2 * T), 0);
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_ENOSEQ);

  /* Creating an expired name anew clears the tombstone. */
  assert_int_equal(dsv4_seqtable_expire(f.st, 1500 + T), 1);
  assert_int_equal(dsv4_seqtable_info(f.st, "b", 1, &info), DSV4_EEXPIRED);
  assert_int_equal(used(&f), 0);
  b = seg("b", 7, 1, 1, 3);
  assert_int_equal(step(&f, 0, &b, 1, 1500 + T), 0);
  get_info(&f, "b", &info);
  assert_int_equal(info.p0, 7);
  dsv4_seq_info_free(&info);
  int existed = -1;
  assert_int_equal(dsv4_seqtable_delete(f.st, "b", 1, &existed), 0);
  assert_int_equal(existed, 1);
  assert_int_equal(dsv4_seqtable_info(f.st, "b", 1, &info), DSV4_ENOSEQ);
  fx_close(&f);
}

static void test_delete(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 16, 64);
  assert_int_equal(step1(&f, 0, "a", 0, 100, 1, 0), 0);
  assert_int_equal(step1(&f, 0, "b", 0, 10, 1, 0), 0);
  assert_int_equal(used(&f), 8);
  int existed = -1;
  assert_int_equal(dsv4_seqtable_delete(f.st, "a", 1, &existed), 0);
  assert_int_equal(existed, 1);
  assert_int_equal(used(&f), 1);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(dsv4_seqtable_delete(f.st, "a", 1, &existed), 0);
  assert_int_equal(existed, 0);
  assert_int_equal(dsv4_seqtable_delete(f.st, ".a", 2, &existed), DSV4_EINVAL);
  assert_int_equal(existed, 0);
  /* The name can be created again, with a different p0. */
  assert_int_equal(step1(&f, 0, "a", 0, 1, 0, 0), DSV4_ENOSEQ);
  assert_int_equal(step1(&f, 1, "a", 50, 1, 1, 0), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.p0, 50);
  assert_int_equal(info.next[0], 50);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

static void test_fail_drops_batch(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  assert_int_equal(step1(&f, 0, "a", 0, 30, 1, 0), 0);
  assert_int_equal(step1(&f, 0, "keep", 0, 30, 1, 0), 0);
  dsv4_seg_req_t s[2] = {seg("a", 30, 40, 0, 1), seg("n", 0, 5, 1, 1)};
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, s, 2, 0, &f.plan), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 3);
  dsv4_seqtable_fail(f.st, &f.plan);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(dsv4_seqtable_count_relaxed(f.st), 1);
  assert_int_equal(used(&f), 2);
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_ENOSEQ);
  assert_int_equal(dsv4_seqtable_info(f.st, "n", 1, &info), DSV4_ENOSEQ);
  get_info(&f, "keep", &info);
  assert_int_equal(info.next[0], 30);
  dsv4_seq_info_free(&info);
  /* A failed replay drops the sequence too. */
  assert_int_equal(step1(&f, 0, "keep", 0, 30, 0, 0), 0);
  assert_true(f.plan.replay);
  dsv4_seg_req_t k = seg("keep", 0, 30, 0, 0);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, &k, 1, 0, &f.plan), 0);
  dsv4_seqtable_fail(f.st, &f.plan);
  assert_int_equal(used(&f), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 0);
  fx_close(&f);
}

/*
 * A prefill's plan stays open while a batch of other sequences is planned and committed (the decode
 * run between two of its chunks): the blocks go in plan order, the inner batch sees the open plan's
 * new sequence and blocks as taken, and the outer commit then lands as if alone.
 */
static void test_plan_between_chunks(void **state) {
  (void)state;
  fx_t f;
  dsv4_plan_t inner;
  fx_open(&f, 1, 16, 8);
  f.cfg.idle_timeout_ns = 1000;
  fx_reopen(&f);
  dsv4_plan_init(&inner);
  assert_int_equal(step1(&f, 0, "d", 0, 3, 1, 0), 0);
  dsv4_seg_req_t p = seg("p", 0, 100, 1, 7);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, &p, 1, 10, &f.plan), 0);
  assert_int_equal(used(&f), 1 + 7);
  /* The decode between chunks: expiry of its own names first, then its plan and commit. */
  dsv4_seg_req_t d = seg("d", 3, 1, 0, 8);
  assert_int_equal(dsv4_seqtable_expire_named(f.st, &d, 1, 20), 0);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, &d, 1, 20, &inner), 0);
  dsv4_seqtable_commit(f.st, &inner, 20);
  /* The pool is full: a new sequence between chunks is refused and changes nothing. */
  dsv4_seg_req_t n = seg("n", 0, 1, 1, 9);
  assert_int_equal(dsv4_seqtable_plan(f.st, 0, &n, 1, 20, &inner), DSV4_ENOSPC);
  assert_int_equal(inner.error.free, 0);
  dsv4_seqtable_commit(f.st, &f.plan, 30);
  dsv4_seq_info_t info;
  get_info(&f, "p", &info);
  assert_int_equal(info.next[0], 100);
  assert_int_equal(info.n_blocks_held, 7);
  dsv4_seq_info_free(&info);
  get_info(&f, "d", &info);
  assert_int_equal(info.next[0], 4);
  dsv4_seq_info_free(&info);
  assert_int_equal(step1(&f, 0, "p", 0, 100, 0, 7), 0);
  assert_true(f.plan.replay);
  assert_int_equal(dsv4_seqtable_count(f.st), 2);
  dsv4_plan_free(&inner);
  fx_close(&f);
}

static void test_implicit_create(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  f.cfg.implicit_create = 1;
  fx_reopen(&f);
  assert_int_equal(step1(&f, 0, "a", 33, 2, 0, 0), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.p0, 33);
  assert_int_equal(info.next[0], 35);
  dsv4_seq_info_free(&info);
  /* The flag does not relax "new" for an existing sequence. */
  assert_int_equal(step1(&f, 0, "a", 35, 1, 1, 0), DSV4_EEXIST);
  fx_close(&f);
}

/*
 * A batch arriving after a sequence's idle timeout but before any sweep: the engine brings the
 * sequences it names up to date first (dsv4_seqtable_expire_named), so the batch is refused as
 * expired exactly as after a sweep, and the name's 410 period runs from the moment it expired, not
 * from when it was noticed.
 */
static void test_expiry_without_sweep(void **state) {
  (void)state;
  const uint64_t T = 1000;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  f.cfg.idle_timeout_ns = T;
  fx_reopen(&f);
  dsv4_seg_req_t a = seg("a", 0, 20, 1, 1), b = seg("b", 0, 20, 1, 1);
  assert_int_equal(step(&f, 0, &a, 1, 100), 0);
  assert_int_equal(step(&f, 0, &b, 1, 100 + T / 2), 0);
  /* One tick short of the timeout: nothing happens. */
  a = seg("a", 20, 1, 0, 2);
  assert_int_equal(dsv4_seqtable_expire_named(f.st, &a, 1, 100 + T - 1), 0);
  assert_int_equal(dsv4_seqtable_count(f.st), 2);
  /* Half a period late, no sweep in between: only the named sequence expires, and its blocks go. */
  uint64_t late = 100 + T + T / 2;
  assert_int_equal(dsv4_seqtable_expire_named(f.st, &a, 1, late), 1);
  assert_int_equal(step(&f, 0, &a, 1, late), DSV4_EEXPIRED);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  assert_int_equal(used(&f), 2);
  /* Its 410 period ends one timeout after it expired (100 + 2T), not after it was noticed. */
  assert_int_equal(step(&f, 0, &a, 1, 100 + 2 * T - 1), DSV4_EEXPIRED);
  /* The sweep then: b (idle since 100 + T/2) expires, a is forgotten. */
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + 2 * T), 1);
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_ENOSEQ);
  assert_int_equal(dsv4_seqtable_info(f.st, "b", 1, &info), DSV4_EEXPIRED);
  /* Noticed two periods late: expired and forgotten at once. */
  dsv4_seg_req_t c = seg("c", 0, 5, 1, 4);
  assert_int_equal(step(&f, 0, &c, 1, 5000), 0);
  c = seg("c", 5, 1, 0, 5);
  assert_int_equal(dsv4_seqtable_expire_named(f.st, &c, 1, 5000 + 2 * T), 1);
  assert_int_equal(dsv4_seqtable_info(f.st, "c", 1, &info), DSV4_ENOSEQ);
  assert_int_equal(used(&f), 0);
  fx_close(&f);
}

static void test_implicit_create_expired(void **state) {
  (void)state;
  /* SPEC §4: an expired sequence answers 410 for one more period; implicit_create only concerns
   * unknown names, so it must not recreate the sequence at the continuing position. */
  const uint64_t T = 1000;
  fx_t f;
  fx_open(&f, 1, 16, 64);
  f.cfg.implicit_create = 1;
  f.cfg.idle_timeout_ns = T;
  fx_reopen(&f);
  dsv4_seg_req_t a = seg("a", 0, 20, 0, 1);
  assert_int_equal(step(&f, 0, &a, 1, 100), 0);
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + T), 1);
  a = seg("a", 20, 1, 0, 2);
  assert_int_equal(step(&f, 0, &a, 1, 100 + T), DSV4_EEXPIRED);
  assert_int_equal(dsv4_seqtable_count(f.st), 0);
  assert_int_equal(used(&f), 0);
  /* "new" recreates it within the period. */
  a = seg("a", 0, 5, 1, 3);
  assert_int_equal(step(&f, 0, &a, 1, 100 + T + 1), 0);
  dsv4_seq_info_t info;
  get_info(&f, "a", &info);
  assert_int_equal(info.p0, 0);
  assert_int_equal(info.next[0], 5);
  dsv4_seq_info_free(&info);
  /* After the period an expired name is unknown, and implicit_create accepts it again. */
  assert_int_equal(dsv4_seqtable_expire(f.st, 100 + 2 * T + 1), 1);
  a = seg("a", 5, 1, 0, 4);
  assert_int_equal(step(&f, 0, &a, 1, 100 + 3 * T + 1), 0);
  get_info(&f, "a", &info);
  assert_int_equal(info.p0, 5);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

static int visit(const char *name, uint32_t len, const dsv4_seq_info_t *info, void *arg) {
  int *seen = arg;
  assert_int_equal(len, 2);
  int i = name[1] - '0';
  assert_int_equal(info->p0, i);
  seen[i]++;
  return 0;
}

static int visit_stop(const char *name, uint32_t len, const dsv4_seq_info_t *info, void *arg) {
  (void)name;
  (void)len;
  (void)info;
  ++*(int *)arg;
  return 42;
}

static void test_foreach_and_many(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 1, 16, 4096);
  f.cfg.max_sequences = 0; /* no limit */
  fx_reopen(&f);
  char name[16];
  /* Enough names to grow the map several times, with deletes mixed in. */
  for (int i = 0; i < 3000; i++) {
    snprintf(name, sizeof(name), "s%d", i);
    assert_int_equal(step1(&f, 0, name, i, 1, 1, 0), 0);
    if (i % 3 == 0) {
      int existed;
      assert_int_equal(dsv4_seqtable_delete(f.st, name, (uint32_t)strlen(name), &existed), 0);
      assert_int_equal(existed, 1);
    }
  }
  assert_int_equal(dsv4_seqtable_count(f.st), 2000);
  for (int i = 0; i < 3000; i++) {
    snprintf(name, sizeof(name), "s%d", i);
    dsv4_seq_info_t info;
    int rc = dsv4_seqtable_info(f.st, name, (uint32_t)strlen(name), &info);
    if (i % 3 == 0) {
      assert_int_equal(rc, DSV4_ENOSEQ);
    } else {
      assert_int_equal(rc, 0);
      assert_int_equal(info.p0, i);
      dsv4_seq_info_free(&info);
    }
  }
  for (int i = 0; i < 3000; i++) {
    snprintf(name, sizeof(name), "s%d", i);
    int existed;
    assert_int_equal(dsv4_seqtable_delete(f.st, name, (uint32_t)strlen(name), &existed), 0);
  }
  assert_int_equal(step1(&f, 0, "s1", 1, 1, 1, 0), 0);
  assert_int_equal(step1(&f, 0, "s7", 7, 1, 1, 0), 0);
  int seen[10] = {0};
  assert_int_equal(dsv4_seqtable_foreach(f.st, visit, seen), 0);
  assert_int_equal(seen[1], 1);
  assert_int_equal(seen[7], 1);
  int calls = 0;
  assert_int_equal(dsv4_seqtable_foreach(f.st, visit_stop, &calls), 42);
  assert_int_equal(calls, 1);
  fx_close(&f);
}

/* ---- restore: state export and insert ---- */

/* Take n blocks of f's pool for an insert (the caller's part of a restore). */
static void take_blocks(fx_t *f, int32_t *ids, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    uint32_t id;
    assert_int_equal(dsv4_pool_alloc(&f->pool, &id), 0);
    ids[i] = (int32_t)id;
  }
}

static void test_state_insert_roundtrip(void **state) {
  (void)state;
  fx_t a, b;
  fx_open(&a, 2, 16, 64);
  fx_open(&b, 2, 16, 64);
  /* Layer 0 well ahead of layer 1, so layer 1's window holds the release back; p0 = 5. */
  assert_int_equal(step1(&a, 0, "s", 5, 100, 1, 11), 0);
  assert_int_equal(step1(&a, 1, "s", 5, 60, 0, 12), 0);
  assert_int_equal(step1(&a, 0, "s", 105, 150, 0, 13), 0);
  assert_int_equal(step1(&a, 0, "s", 255, 1, 0, 14), 0);
  dsv4_seq_layer_state_t ls[2];
  dsv4_seq_state_t st = {0, ls};
  assert_int_equal(dsv4_seqtable_state(a.st, "s", 1, &st), 0);
  assert_int_equal(st.p0, 5);
  assert_int_equal(ls[0].next, 256);
  assert_int_equal(ls[0].last_start, 255);
  assert_int_equal(ls[0].last_len, 1);
  assert_int_equal(ls[0].last_hash, 14);
  assert_int_equal(ls[1].next, 65);
  assert_int_equal(ls[1].last_start, 5);
  assert_int_equal(ls[1].last_hash, 12);
  int64_t low;
  assert_int_equal(dsv4_seqtable_state_low(&a.cfg, &st, &low), 0);
  assert_int_equal(low, 5);
  dsv4_seq_info_t ia, ib;
  get_info(&a, "s", &ia);
  assert_int_equal(ia.first_lb, 0);

  int32_t ids[32];
  take_blocks(&b, ids, ia.n_blocks_held);
  dsv4_plan_error_t err;
  assert_int_equal(
      dsv4_seqtable_insert(b.st, "s", 1, &st, ia.first_lb, ids, ia.n_blocks_held, 0, 77, &err), 0);
  get_info(&b, "s", &ib);
  assert_int_equal(ib.p0, ia.p0);
  assert_int_equal(ib.first_lb, ia.first_lb);
  assert_int_equal(ib.n_blocks_held, ia.n_blocks_held);
  assert_memory_equal(ib.next, ia.next, 2 * sizeof(int64_t));
  assert_memory_equal(ib.last_start, ia.last_start, 2 * sizeof(int64_t));
  assert_memory_equal(ib.blocks, ids, ia.n_blocks_held * sizeof(int32_t));
  assert_int_equal(ib.last_used_ns, 77);
  assert_int_equal(dsv4_seqtable_count(b.st), 1);
  dsv4_seq_info_free(&ia);
  dsv4_seq_info_free(&ib);

  /* The last segment of each layer replays on the restored table as on the original. */
  dsv4_seg_req_t r = seg("s", 255, 1, 0, 14);
  assert_int_equal(dsv4_seqtable_plan(b.st, 0, &r, 1, 78, &b.plan), 0);
  assert_true(b.plan.replay);
  dsv4_seqtable_commit(b.st, &b.plan, 78);
  /* The same next batches give the same release on both tables. */
  for (int64_t p = 65; p < 256; p += 20) {
    uint32_t n = p + 20 > 256 ? (uint32_t)(256 - p) : 20;
    assert_int_equal(step1(&a, 1, "s", p, n, 0, 20), 0);
    assert_int_equal(step1(&b, 1, "s", p, n, 0, 20), 0);
    get_info(&a, "s", &ia);
    get_info(&b, "s", &ib);
    assert_int_equal(ib.first_lb, ia.first_lb);
    assert_int_equal(ib.n_blocks_held, ia.n_blocks_held);
    dsv4_seq_info_free(&ia);
    dsv4_seq_info_free(&ib);
  }
  assert_int_equal(used(&b), used(&a));
  fx_close(&a);
  fx_close(&b);
}

static void test_insert_refusals(void **state) {
  (void)state;
  fx_t f;
  fx_open(&f, 2, 16, 16);
  dsv4_seq_layer_state_t ls[2] = {{40, 30, 10, 7}, {20, 20, 0, 0}};
  dsv4_seq_state_t st = {20, ls};
  dsv4_plan_error_t err;
  int32_t ids[4];
  take_blocks(&f, ids, 4);
  uint32_t u = used(&f);
  /* Layer 1 never wrote: its window is at p0 = 20 and holds block 1 on; next 40 ends in block 2. */
  assert_int_equal(dsv4_seqtable_insert(f.st, ".x", 2, &st, 1, ids, 2, 0, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 0, ids, 3, 0, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 2, ids, 1, 0, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 1, 0, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 3, 0, 0, &err), DSV4_EINVAL);
  ls[0].next = 41; /* start + len is not next */
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 2, 0, 0, &err), DSV4_EINVAL);
  ls[0].next = 40;
  ls[1].next = 21; /* a layer without a segment that moved */
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 2, 0, 0, &err), DSV4_EINVAL);
  ls[1].next = 20;
  ls[0].last_start = 19; /* a segment below p0 */
  ls[0].last_len = 21;
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 2, 0, 0, &err), DSV4_EINVAL);
  ls[0].last_start = 30;
  ls[0].last_len = 10;
  int32_t bad[2] = {ids[0], 15}; /* block 15 is not taken from the pool */
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, bad, 2, 0, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_count(f.st), 0);
  assert_int_equal(used(&f), u);

  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids, 2, 0, 0, &err), 0);
  /* An existing name: refused without replace, nothing changes; with it, the old blocks go. */
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids + 2, 2, 0, 0, &err), DSV4_EEXIST);
  assert_int_equal(used(&f), u);
  assert_int_equal(dsv4_seqtable_insert(f.st, "x", 1, &st, 1, ids + 2, 2, 1, 0, &err), 0);
  assert_int_equal(used(&f), u - 2);
  assert_int_equal(dsv4_seqtable_count(f.st), 1);
  dsv4_seq_info_t info;
  get_info(&f, "x", &info);
  assert_memory_equal(info.blocks, ids + 2, 2 * sizeof(int32_t));
  dsv4_seq_info_free(&info);
  /* The restored sequence continues like any other: layer 1 from p0, layer 0 from 40. */
  assert_int_equal(step1(&f, 1, "x", 20, 5, 0, 1), 0);
  assert_int_equal(step1(&f, 0, "x", 40, 1, 0, 1), 0);
  assert_int_equal(step1(&f, 0, "x", 42, 1, 0, 1), DSV4_EPOSITION);
  fx_close(&f);
}

static void test_insert_limits_and_expired(void **state) {
  (void)state;
  const uint64_t T = 1000;
  fx_t f;
  fx_open(&f, 1, 16, 16);
  f.cfg.max_sequences = 1;
  f.cfg.idle_timeout_ns = T;
  fx_reopen(&f);
  dsv4_seq_layer_state_t ls[1] = {{3, 0, 3, 9}};
  dsv4_seq_state_t st = {0, ls};
  dsv4_plan_error_t err;
  int32_t ids[2];
  take_blocks(&f, ids, 2);
  assert_int_equal(dsv4_seqtable_insert(f.st, "a", 1, &st, 0, ids, 1, 0, 0, &err), 0);
  /* max_sequences: a second name is refused, and says so. */
  assert_int_equal(dsv4_seqtable_insert(f.st, "b", 1, &st, 0, ids + 1, 1, 0, 0, &err), DSV4_ENOSPC);
  assert_true(err.sequences_full);
  /* Nothing written: no blocks at all. */
  ls[0] = (dsv4_seq_layer_state_t){0, 0, 0, 0};
  assert_int_equal(dsv4_seqtable_insert(f.st, "a", 1, &st, 0, ids + 1, 1, 1, 0, &err), DSV4_EINVAL);
  assert_int_equal(dsv4_seqtable_insert(f.st, "a", 1, &st, 0, NULL, 0, 1, 0, &err), 0);
  assert_int_equal(used(&f), 1);
  /* An expired name is replaced without replace (as "new": true recreates it). */
  assert_int_equal(dsv4_seqtable_expire(f.st, T), 1);
  dsv4_seq_info_t info;
  assert_int_equal(dsv4_seqtable_info(f.st, "a", 1, &info), DSV4_EEXPIRED);
  ls[0] = (dsv4_seq_layer_state_t){3, 0, 3, 9};
  assert_int_equal(dsv4_seqtable_insert(f.st, "a", 1, &st, 0, ids + 1, 1, 0, T + 1, &err), 0);
  get_info(&f, "a", &info);
  assert_int_equal(info.next[0], 3);
  dsv4_seq_info_free(&info);
  fx_close(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_name_valid),
      cmocka_unit_test(test_create_and_block_table),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_pool_exhausted),
      cmocka_unit_test(test_max_sequences),
      cmocka_unit_test(test_replay),
      cmocka_unit_test(test_release_bs16),
      cmocka_unit_test(test_release_bs64),
      cmocka_unit_test(test_release_bs256),
      cmocka_unit_test(test_release_uses_segment_start),
      cmocka_unit_test(test_release_p0),
      cmocka_unit_test(test_multilayer_holds_back),
      cmocka_unit_test(test_expiry),
      cmocka_unit_test(test_delete),
      cmocka_unit_test(test_fail_drops_batch),
      cmocka_unit_test(test_implicit_create),
      cmocka_unit_test(test_expiry_without_sweep),
      cmocka_unit_test(test_implicit_create_expired),
      cmocka_unit_test(test_foreach_and_many),
      cmocka_unit_test(test_plan_between_chunks),
      cmocka_unit_test(test_state_insert_roundtrip),
      cmocka_unit_test(test_insert_refusals),
      cmocka_unit_test(test_insert_limits_and_expired),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
