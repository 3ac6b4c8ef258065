/*
 * SPEC §5.3, slots are unique within a launch for real tokens. A random driver sends multi-sequence
 * batches (new sequences, continuations, one-token steps, two layers, deletes, and a pool small
 * enough that blocks are released and reused) through the sequence table, runs the CPU backend's
 * map_slots on each plan, and checks that every token of the launch has a slot, that the slots are
 * pairwise distinct, and that each slot lies in the block that the token's own sequence holds for
 * the token's logical block, a block no other sequence (and no other logical block) holds.
 *
 * Built again with DSV4_TEST_BROKEN_SHARED_BLOCK (kvcache/seqtable.c hands out a block id without
 * taking it from the pool, so it is handed out again), this test must fail (ctest:
 * inv_unique_slots_broken_shared_block).
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
#include "cpu/cpu_backend.h"
#include "dsv4-error.h"
#include "inv_common.h"
#include "pool.h"
#include "seqtable.h"

#define NAMES 10
#define LAYERS 2
#define BS 16
#define POOL_BLOCKS 48
#define STEPS 600
#define MAX_SEG 4
#define MAX_LEN 40
#define MAX_TOKENS (MAX_SEG * MAX_LEN)

typedef struct {
  int live;
  int64_t next[LAYERS];
} mseq_t;

typedef struct {
  mseq_t seq[NAMES];
  char name[NAMES][4];
  int32_t owner[POOL_BLOCKS];    /* sequence holding each block id, -1 for none */
  int64_t owner_lb[POOL_BLOCKS]; /* the logical block it holds it for */
  int violations;
  int step;
  int launches, refused; /* plans mapped, plans refused for lack of blocks */
  long tokens;
} driver_t;

static int violation(driver_t *d) {
  return d->violations++ < 8;
}

/* Records which sequence holds each block id; a second holder is a violation. */
static int collect_owner(const char *name, uint32_t name_len, const dsv4_seq_info_t *info,
                         void *arg) {
  driver_t *d = arg;
  int idx = -1;
  for (int i = 0; i < NAMES; i++)
    if (strlen(d->name[i]) == name_len && memcmp(d->name[i], name, name_len) == 0)
      idx = i;
  if (idx < 0)
    return -1;
  for (uint32_t k = 0; k < info->n_blocks_held; k++) {
    int32_t b = info->blocks[k];
    if (b < 0)
      continue;
    if (b >= POOL_BLOCKS)
      return -1;
    if (d->owner[b] >= 0) {
      if (violation(d))
        INV_REPORT(3,
                   "block %d is held by sequence %s (logical block %lld) and by sequence %s "
                   "(logical block %lld) [step %d]",
                   b, d->name[d->owner[b]], (long long)d->owner_lb[b], d->name[idx],
                   (long long)(info->first_lb + k), d->step);
      continue;
    }
    d->owner[b] = idx;
    d->owner_lb[b] = info->first_lb + k;
  }
  return 0;
}

/* Deletes one live sequence (chosen at random), if any. */
static void delete_one(driver_t *d, dsv4_seqtable_t *st) {
  int live[NAMES], n = 0;
  for (int i = 0; i < NAMES; i++)
    if (d->seq[i].live)
      live[n++] = i;
  if (n == 0)
    return;
  int i = live[inv_below((uint32_t)n)];
  int existed = 0;
  assert_int_equal(dsv4_seqtable_delete(st, d->name[i], (uint32_t)strlen(d->name[i]), &existed), 0);
  assert_int_equal(existed, 1);
  d->seq[i].live = 0;
}

/* One random batch through plan, map_slots and commit, with the checks of SPEC §5.3. */
static void step(driver_t *d, dsv4_seqtable_t *st, dsv4_backend_t *be, dsv4_plan_t *plan,
                 uint64_t now) {
  uint32_t layer = inv_below(LAYERS);
  uint32_t n_seg = 1 + inv_below(MAX_SEG);
  int pick[NAMES];
  for (int i = 0; i < NAMES; i++)
    pick[i] = i;
  dsv4_seg_req_t segs[MAX_SEG];
  int seg_of[MAX_SEG];
  for (uint32_t s = 0; s < n_seg; s++) {
    uint32_t j = s + inv_below(NAMES - s);
    int i = pick[j];
    pick[j] = pick[s];
    pick[s] = i;
    seg_of[s] = i;
    const mseq_t *m = &d->seq[i];
    dsv4_seg_req_t *r = &segs[s];
    memset(r, 0, sizeof(*r));
    r->name = d->name[i];
    r->name_len = (uint32_t)strlen(d->name[i]);
    r->is_new = !m->live;
    r->start = m->live ? m->next[layer] : (int64_t)inv_below(200);
    /* Half the segments are one-token decode steps. */
    r->len = inv_below(2) ? 1 : 1 + inv_below(MAX_LEN);
    r->hash = inv_rnd();
  }
  int rc = dsv4_seqtable_plan(st, layer, segs, n_seg, now, plan);
  if (rc == DSV4_ENOSPC) {
    d->refused++;
    delete_one(d, st);
    return;
  }
  assert_int_equal(rc, 0);
  assert_false(plan->replay);

  int64_t pos[MAX_TOKENS], slots[MAX_TOKENS], first_lb[MAX_SEG];
  int32_t tok_seg[MAX_TOKENS];
  uint32_t bt_off[MAX_SEG], bt_len[MAX_SEG], n = 0;
  for (uint32_t s = 0; s < n_seg; s++) {
    for (uint32_t k = 0; k < segs[s].len; k++) {
      pos[n] = segs[s].start + k;
      tok_seg[n++] = (int32_t)s;
    }
    first_lb[s] = plan->segs[s].first_lb;
    bt_off[s] = plan->segs[s].bt_off;
    bt_len[s] = plan->segs[s].bt_len;
  }
  dsv4_map_args_t ma = {
      .n_tokens = n,
      .n_segments = n_seg,
      .block_size = BS,
      .n_blocks = POOL_BLOCKS,
      .positions = pos,
      .tok_seg = tok_seg,
      .seg_first_lb = first_lb,
      .seg_bt_off = bt_off,
      .seg_bt_len = bt_len,
      .block_table = plan->block_table,
      .slots = slots,
  };
  assert_int_equal(be->ops->map_slots(be, &ma), 0);
  assert_int_equal(be->ops->sync(be), 0);
  d->launches++;
  d->tokens += n;

  /* Who holds which block after the plan (blocks the batch writes are allocated by now). */
  for (int b = 0; b < POOL_BLOCKS; b++)
    d->owner[b] = -1;
  assert_int_equal(dsv4_seqtable_foreach(st, collect_owner, d), 0);

  uint32_t user[POOL_BLOCKS * BS];
  for (uint32_t i = 0; i < POOL_BLOCKS * BS; i++)
    user[i] = UINT32_MAX;
  for (uint32_t t = 0; t < n; t++) {
    int seq = seg_of[tok_seg[t]];
    if (slots[t] < 0 || slots[t] >= POOL_BLOCKS * BS) {
      if (violation(d))
        INV_REPORT(3, "token %u (sequence %s position %lld) got slot %lld [step %d]", t,
                   d->name[seq], (long long)pos[t], (long long)slots[t], d->step);
      continue;
    }
    uint32_t u = user[slots[t]];
    if (u != UINT32_MAX) {
      if (violation(d))
        INV_REPORT(3,
                   "slot %lld is written twice in one launch: token %u (sequence %s position "
                   "%lld) and token %u (sequence %s position %lld) [step %d]",
                   (long long)slots[t], u, d->name[seg_of[tok_seg[u]]], (long long)pos[u], t,
                   d->name[seq], (long long)pos[t], d->step);
      continue;
    }
    user[slots[t]] = t;
    int64_t b = slots[t] / BS;
    if (slots[t] % BS != pos[t] % BS || d->owner[b] != seq || d->owner_lb[b] != pos[t] / BS) {
      if (violation(d))
        INV_REPORT(3,
                   "token %u (sequence %s position %lld) got slot %lld in block %lld, which "
                   "its sequence does not hold for logical block %lld [step %d]",
                   t, d->name[seq], (long long)pos[t], (long long)slots[t], (long long)b,
                   (long long)(pos[t] / BS), d->step);
    }
  }
  dsv4_seqtable_commit(st, plan, now);
  for (uint32_t s = 0; s < n_seg; s++) {
    mseq_t *m = &d->seq[seg_of[s]];
    if (!m->live)
      for (int l = 0; l < LAYERS; l++)
        m->next[l] = segs[s].start;
    m->live = 1;
    m->next[layer] = segs[s].start + segs[s].len;
  }
}

static void test_slots_unique_per_launch(void **state) {
  (void)state;
  static driver_t d;
  memset(&d, 0, sizeof(d));
  for (int i = 0; i < NAMES; i++)
    snprintf(d.name[i], sizeof(d.name[i]), "s%d", i);
  dsv4_pool_t pool;
  assert_int_equal(dsv4_pool_init(&pool, POOL_BLOCKS), 0);
  dsv4_seqtable_config_t cfg = {
      .n_layers = LAYERS,
      .block_size = BS,
      .max_position = DSV4_MAX_POSITION_DEFAULT,
  };
  dsv4_seqtable_t *st = NULL;
  assert_int_equal(dsv4_seqtable_create(&cfg, &pool, &st), 0);
  dsv4_backend_options_t opt = {.threads = 2};
  dsv4_backend_t *be = NULL;
  char why[128];
  assert_int_equal(dsv4_cpu_backend_open(&opt, &be, why, sizeof(why)), 0);
  dsv4_plan_t plan;
  dsv4_plan_init(&plan);
  for (d.step = 0; d.step < STEPS; d.step++) {
    if (inv_below(20) == 0)
      delete_one(&d, st);
    else
      step(&d, st, be, &plan, (uint64_t)d.step + 1);
  }
  dsv4_plan_free(&plan);
  dsv4_backend_close(be);
  dsv4_seqtable_destroy(st);
  dsv4_pool_destroy(&pool);
  printf("unique slots: %d launches (%ld tokens), %d plans refused for lack of blocks, %d "
         "violations\n",
         d.launches, d.tokens, d.refused, d.violations);
  /* The pool must have run full, so that released blocks were handed out again. */
  assert_true(d.refused > 0);
  assert_int_equal(d.violations, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_slots_unique_per_launch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
