/*
 * Property test of the sequence table and SWA slot mapper: random batches, replays, deletes, device
 * failures, expiries and refusals against a model written here from SPEC §4 alone. After every step
 * the table must agree with the model and the pool must account for every block.
 *
 * DSV4_PROP_SEED overrides the seed, DSV4_PROP_STEPS the number of steps per configuration.
 */
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

#define NAMES 24
#define MAXL 4
#define MAXSEG 6
#define WIN 128

static unsigned long long g_seed;
static int g_step;
static const char *g_cfgname;

#define CHECK(c)                                                                                   \
  do {                                                                                             \
    if (!(c))                                                                                      \
      fail_msg("seed %llu config %s step %d: %s (line %d)", g_seed, g_cfgname, g_step, #c,         \
               __LINE__);                                                                          \
  } while (0)
#define CHECK_EQ(a, b)                                                                             \
  do {                                                                                             \
    long long a_ = (long long)(a), b_ = (long long)(b);                                            \
    if (a_ != b_)                                                                                  \
      fail_msg("seed %llu config %s step %d: %s = %lld, expected %s = %lld (line %d)", g_seed,     \
               g_cfgname, g_step, #a, a_, #b, b_, __LINE__);                                       \
  } while (0)

static uint64_t rng_state;
static uint64_t rnd(void) {
  /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint32_t rn(uint32_t n) {
  return (uint32_t)(rnd() % n);
}

/* ---- the model ---- */

enum { M_NONE, M_LIVE, M_EXPIRED };

typedef struct {
  int state;
  uint64_t t; /* live: last batch; expired: when it expired */
  int64_t p0;
  int64_t next[MAXL], s[MAXL];
  int has_last[MAXL];
  int64_t last_start[MAXL];
  uint32_t last_len[MAXL];
  uint64_t last_hash[MAXL];
  unsigned gen; /* bumps on every creation, to track physical ids per incarnation */
  /* Physical ids observed last step: lb -> id for [obs_first, obs_first + obs_n). */
  unsigned obs_gen;
  int64_t obs_first;
  uint32_t obs_n;
  int32_t obs[4096];
} mseq_t;

typedef struct {
  const char *name;
  uint32_t n_layers, bs, n_blocks, max_sequences;
  int implicit_create;
  uint64_t timeout;
  int64_t max_position;
} pcfg_t;

static int g_bound_checks, g_bound_excess, g_one_token_checks;
static mseq_t M[NAMES];
static char NAMESTR[NAMES][8];
static pcfg_t C;

static int64_t imax(int64_t a, int64_t b) {
  return a > b ? a : b;
}
static int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

/* The end (exclusive) of the logical blocks ever written: any layer writing a position allocates.
 */
static int64_t m_alloc_end(const mseq_t *m) {
  int64_t hi = m->p0;
  for (uint32_t l = 0; l < C.n_layers; l++)
    hi = imax(hi, m->next[l]);
  return hi > m->p0 ? (hi - 1) / C.bs + 1 : m->p0 / C.bs;
}

/* SPEC §4, literally: block b is released once, for every layer, max(p0, s_L - 127) > (b+1)bs - 1.
 */
static int m_released(const mseq_t *m, int64_t b) {
  for (uint32_t l = 0; l < C.n_layers; l++)
    if (!(imax(m->p0, m->s[l] - 127) > (b + 1) * (int64_t)C.bs - 1))
      return 0;
  return 1;
}

static int m_held(const mseq_t *m, int64_t b) {
  return b >= m->p0 / (int64_t)C.bs && b < m_alloc_end(m) && !m_released(m, b);
}

static uint32_t m_held_count(const mseq_t *m) {
  uint32_t n = 0;
  for (int64_t b = m->p0 / C.bs; b < m_alloc_end(m); b++)
    n += (uint32_t)m_held(m, b);
  return n;
}

static uint32_t m_live(void) {
  uint32_t n = 0;
  for (int i = 0; i < NAMES; i++)
    n += M[i].state == M_LIVE;
  return n;
}

static int name_id(const dsv4_seg_req_t *r) {
  for (int i = 0; i < NAMES; i++)
    if (r->name == NAMESTR[i])
      return i;
  return -1;
}

static int m_valid_name(const char *s, uint32_t n) {
  if (n < 1 || n > 128 || s[0] == '.')
    return 0;
  for (uint32_t i = 0; i < n; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          strchr("._:-", c) != NULL) ||
        c == 0)
      return 0;
  }
  return 1;
}

typedef struct {
  int rc;
  uint32_t segment;
  int64_t expected;
  uint32_t needed, free;
  int replay;
  int seq_full;
} pred_t;

static pred_t predict(uint32_t layer, const dsv4_seg_req_t *g, uint32_t n, uint64_t now,
                      uint32_t pool_free) {
  pred_t p;
  memset(&p, 0, sizeof(p));
  for (uint32_t i = 0; i < n; i++) {
    p.segment = i;
    if (!m_valid_name(g[i].name, g[i].name_len) || g[i].len == 0) {
      p.rc = DSV4_EINVAL;
      return p;
    }
    if (g[i].start < 0 || g[i].start + (int64_t)g[i].len > C.max_position) {
      p.rc = DSV4_EPOSRANGE;
      return p;
    }
    for (uint32_t j = 0; j < i; j++)
      if (g[j].name_len == g[i].name_len && memcmp(g[j].name, g[i].name, g[i].name_len) == 0) {
        p.rc = DSV4_EDUPSEQ;
        return p;
      }
  }
  int all = 1;
  for (uint32_t i = 0; i < n; i++) {
    const mseq_t *m = &M[name_id(&g[i])];
    all &= m->state == M_LIVE && m->has_last[layer] && m->last_start[layer] == g[i].start &&
           m->last_len[layer] == g[i].len && m->last_hash[layer] == g[i].hash;
  }
  if (all) {
    p.replay = 1;
    return p;
  }
  uint64_t need = 0;
  uint32_t creates = 0;
  for (uint32_t i = 0; i < n; i++) {
    const mseq_t *m = &M[name_id(&g[i])];
    p.segment = i;
    int64_t last_lb = (g[i].start + g[i].len - 1) / C.bs;
    if (m->state == M_LIVE) {
      if (g[i].is_new) {
        p.rc = DSV4_EEXIST;
        p.expected = m->next[layer];
        return p;
      }
      if (g[i].start != m->next[layer]) {
        p.rc = DSV4_EPOSITION;
        p.expected = m->next[layer];
        return p;
      }
      int64_t end = m_alloc_end(m);
      need += last_lb >= end ? (uint64_t)(last_lb - end + 1) : 0;
    } else {
      if (!g[i].is_new && m->state == M_EXPIRED && now - m->t < C.timeout) {
        p.rc = DSV4_EEXPIRED;
        return p;
      }
      if (!g[i].is_new && !C.implicit_create) {
        p.rc = DSV4_ENOSEQ;
        return p;
      }
      creates++;
      need += (uint64_t)(last_lb - g[i].start / C.bs + 1);
    }
  }
  p.segment = 0;
  if (C.max_sequences && m_live() + creates > C.max_sequences) {
    p.rc = DSV4_ENOSPC;
    p.seq_full = 1;
    return p;
  }
  if (need > pool_free) {
    p.rc = DSV4_ENOSPC;
    p.needed = (uint32_t)need;
    p.free = pool_free;
  }
  return p;
}

/* The clock on one modelled sequence (dsv4_seqtable_expire): returns 1 when a live one expired.
 * An expired name's t is when it expired (last batch + timeout). */
static int m_expire(mseq_t *m, uint64_t now) {
  if (C.timeout == 0 || m->state == M_NONE || now - m->t < C.timeout)
    return 0;
  if (m->state == M_EXPIRED) {
    m->state = M_NONE;
    return 0;
  }
  m->state = M_EXPIRED;
  m->t += C.timeout;
  if (now - m->t >= C.timeout)
    m->state = M_NONE;
  return 1;
}

static void m_commit(uint32_t layer, const dsv4_seg_req_t *g, uint32_t n, int replay,
                     uint64_t now) {
  for (uint32_t i = 0; i < n; i++) {
    mseq_t *m = &M[name_id(&g[i])];
    if (m->state != M_LIVE) {
      m->state = M_LIVE;
      m->gen++;
      m->p0 = g[i].start;
      for (uint32_t l = 0; l < C.n_layers; l++) {
        m->next[l] = m->s[l] = m->p0;
        m->has_last[l] = 0;
      }
    }
    m->t = now;
    if (replay)
      continue;
    m->next[layer] = g[i].start + g[i].len;
    m->s[layer] = g[i].start;
    m->has_last[layer] = 1;
    m->last_start[layer] = g[i].start;
    m->last_len[layer] = g[i].len;
    m->last_hash[layer] = g[i].hash;
  }
}

/* ---- the system under test ---- */

static dsv4_pool_t pool;
static dsv4_seqtable_t *st;
static dsv4_plan_t plan;

/* Everything observable, for "a refused batch changed nothing". */
typedef struct {
  uint32_t free, count;
  uint8_t used[4096];
  int rc[NAMES];
  int64_t p0[NAMES], first_lb[NAMES], next[NAMES][MAXL], last[NAMES][MAXL];
  uint32_t nb[NAMES], holding[NAMES];
  uint64_t t[NAMES];
  int32_t blocks[NAMES][512];
} snap_t;

static void snapshot(snap_t *s) {
  memset(s, 0, sizeof(*s));
  s->free = dsv4_pool_free_count(&pool);
  s->count = dsv4_seqtable_count(st);
  for (uint32_t b = 0; b < C.n_blocks; b++)
    s->used[b] = (uint8_t)dsv4_pool_is_used(&pool, b);
  for (int i = 0; i < NAMES; i++) {
    dsv4_seq_info_t in;
    s->rc[i] = dsv4_seqtable_info(st, NAMESTR[i], (uint32_t)strlen(NAMESTR[i]), &in);
    if (s->rc[i] != 0)
      continue;
    s->p0[i] = in.p0;
    s->first_lb[i] = in.first_lb;
    s->nb[i] = in.n_blocks_held;
    s->holding[i] = in.holding_layer;
    s->t[i] = in.last_used_ns;
    for (uint32_t l = 0; l < C.n_layers; l++) {
      s->next[i][l] = in.next[l];
      s->last[i][l] = in.last_start[l];
    }
    CHECK(in.n_blocks_held <= 512);
    memcpy(s->blocks[i], in.blocks, in.n_blocks_held * sizeof(int32_t));
    dsv4_seq_info_free(&in);
  }
}

typedef struct {
  uint8_t owner[4096];
  uint32_t held;
} own_t;

static int visit(const char *name, uint32_t len, const dsv4_seq_info_t *in, void *arg) {
  own_t *o = arg;
  CHECK(len < 8);
  int id = -1;
  for (int i = 0; i < NAMES; i++)
    if (strlen(NAMESTR[i]) == len && memcmp(NAMESTR[i], name, len) == 0)
      id = i;
  CHECK(id >= 0);
  CHECK_EQ(M[id].state, M_LIVE);
  for (uint32_t k = 0; k < in->n_blocks_held; k++) {
    int32_t b = in->blocks[k];
    CHECK(b >= 0 && (uint32_t)b < C.n_blocks);
    CHECK_EQ(o->owner[b], 0); /* no block owned twice */
    o->owner[b] = (uint8_t)(id + 1);
    CHECK(dsv4_pool_is_used(&pool, (uint32_t)b));
  }
  o->held += in->n_blocks_held;
  return 0;
}

static void check_invariants(void) {
  static own_t o;
  memset(&o, 0, sizeof(o));
  CHECK_EQ(dsv4_seqtable_foreach(st, visit, &o), 0);
  uint32_t used = 0;
  for (uint32_t b = 0; b < C.n_blocks; b++) {
    used += (uint32_t)dsv4_pool_is_used(&pool, b);
    /* Every used block is someone's: no leak. */
    CHECK(!dsv4_pool_is_used(&pool, b) || o.owner[b] != 0);
  }
  CHECK_EQ(dsv4_pool_free_count(&pool) + used, C.n_blocks);
  CHECK_EQ(dsv4_pool_free_count_relaxed(&pool), dsv4_pool_free_count(&pool));
  CHECK_EQ(used, o.held);
  CHECK_EQ(dsv4_seqtable_count(st), m_live());
  CHECK_EQ(dsv4_seqtable_count_relaxed(st), m_live());

  for (int i = 0; i < NAMES; i++) {
    mseq_t *m = &M[i];
    dsv4_seq_info_t in;
    int rc = dsv4_seqtable_info(st, NAMESTR[i], (uint32_t)strlen(NAMESTR[i]), &in);
    if (m->state != M_LIVE) {
      CHECK_EQ(rc, m->state == M_EXPIRED ? DSV4_EEXPIRED : DSV4_ENOSEQ);
      continue;
    }
    CHECK_EQ(rc, 0);
    CHECK_EQ(in.p0, m->p0);
    CHECK_EQ(in.last_used_ns, m->t);
    int64_t low = INT64_MAX;
    uint32_t hold = 0;
    for (uint32_t l = 0; l < C.n_layers; l++) {
      CHECK_EQ(in.next[l], m->next[l]);
      CHECK_EQ(in.last_start[l], m->s[l]);
      if (imax(m->p0, m->s[l] - 127) < low) {
        low = imax(m->p0, m->s[l] - 127);
        hold = l;
      }
    }
    CHECK_EQ(in.holding_layer, hold);
    /* Held logical blocks are exactly those the rule keeps: every reachable block held, nothing
     * released still held. */
    CHECK_EQ(in.n_blocks_held, m_held_count(m));
    for (uint32_t k = 0; k < in.n_blocks_held; k++) {
      CHECK(m_held(m, in.first_lb + k));
      CHECK(in.blocks[k] >= 0);
    }
    /* A held block keeps its physical id for as long as it is held. */
    if (m->obs_gen == m->gen) {
      for (uint32_t k = 0; k < in.n_blocks_held; k++) {
        int64_t lb = in.first_lb + k;
        if (lb >= m->obs_first && lb < m->obs_first + m->obs_n)
          CHECK_EQ(in.blocks[k], m->obs[lb - m->obs_first]);
      }
    }
    m->obs_gen = m->gen;
    m->obs_first = in.first_lb;
    m->obs_n = in.n_blocks_held;
    CHECK(in.n_blocks_held <= 4096);
    memcpy(m->obs, in.blocks, in.n_blocks_held * sizeof(int32_t));
    /* SPEC §4: between one-token steps a sequence holds at most ceil(127/bs) + 1 blocks. */
    int one_token = 1;
    for (uint32_t l = 0; l < C.n_layers; l++)
      one_token &= m->has_last[l] && m->last_len[l] == 1 && m->s[l] == m->s[0];
    if (one_token) {
      CHECK(in.n_blocks_held <= ceil_div(127, C.bs) + 1);
      g_one_token_checks++;
    }
    dsv4_seq_info_free(&in);
  }
}

/* ---- batch generation ---- */

typedef struct {
  dsv4_seg_req_t seg[MAXSEG];
  uint32_t n;
} batch_t;

static batch_t last_batch[MAXL]; /* the last committed fresh batch per layer, for whole replays */
static int have_last_batch[MAXL];
static const char BAD1[] = ".x", BAD2[] = "a b";

static int pick_state(int state) {
  int ids[NAMES], k = 0;
  for (int i = 0; i < NAMES; i++)
    if ((state == M_LIVE) == (M[i].state == M_LIVE))
      ids[k++] = i;
  return k ? ids[rn((uint32_t)k)] : -1;
}

static uint32_t rand_len(void) {
  uint32_t r = rn(10);
  if (r < 6)
    return 1;
  if (r < 8)
    return 1 + rn(8);
  return 1 + rn(300);
}

static void gen_segment(dsv4_seg_req_t *g, uint32_t layer, const batch_t *b) {
  memset(g, 0, sizeof(*g));
  g->hash = rnd();
  uint32_t r = rn(100);
  int id = -1;
  if (r < 55 && (id = pick_state(M_LIVE)) >= 0) {
    g->start = M[id].next[layer];
    g->len = rand_len();
    g->is_new = rn(40) == 0;
  } else if (r < 62 && (id = pick_state(M_LIVE)) >= 0) {
    const mseq_t *m = &M[id];
    g->start = m->has_last[layer] ? m->last_start[layer] : m->p0;
    g->len = m->has_last[layer] ? m->last_len[layer] : 1;
    g->hash = m->has_last[layer] ? m->last_hash[layer] : 0;
    g->is_new = (int)rn(2);
  } else if (r < 80 && (id = pick_state(M_NONE)) >= 0) {
    g->is_new = 1;
    g->start = rn(3) ? 0 : rn(2000);
    g->len = rn(2) ? 1 + rn(300) : rand_len();
  } else if (r < 85 && (id = pick_state(M_NONE)) >= 0) {
    g->start = rn(100);
    g->len = rand_len();
  } else if (r < 90 && (id = pick_state(M_LIVE)) >= 0) {
    int64_t d = (int64_t)rn(7) - 3;
    g->start = imax(0, M[id].next[layer] + (d ? d : 130));
    g->len = rand_len();
  } else if (r < 93 && b->n > 0) {
    *g = b->seg[rn(b->n)];
    g->hash = rnd();
    return;
  } else if (r < 96) {
    id = (int)rn(NAMES);
    uint32_t k = rn(4);
    g->len = rand_len();
    if (k == 0) {
      g->name = BAD1;
      g->name_len = 2;
      return;
    }
    if (k == 1) {
      g->name = BAD2;
      g->name_len = 3;
      return;
    }
    if (k == 2)
      g->len = 0;
    else
      g->start = C.max_position - rn(4);
  } else {
    id = (int)rn(NAMES);
    g->start = M[id].state == M_LIVE ? M[id].next[layer] : 0;
    g->len = 1;
    g->is_new = M[id].state != M_LIVE;
  }
  g->name = NAMESTR[id];
  g->name_len = (uint32_t)strlen(NAMESTR[id]);
}

/* Check a successful plan's maps against the table right after planning. */
static void check_plan(uint32_t layer, const batch_t *b, int fresh_one_token[]) {
  static uint8_t seen[4096];
  memset(seen, 0, sizeof(seen));
  CHECK_EQ(plan.n_segments, b->n);
  CHECK_EQ(plan.layer, layer);
  for (uint32_t i = 0; i < b->n; i++) {
    const dsv4_seg_req_t *g = &b->seg[i];
    const dsv4_seg_map_t *sm = &plan.segs[i];
    dsv4_seq_info_t in;
    CHECK_EQ(dsv4_seqtable_info(st, g->name, g->name_len, &in), 0);
    /* SPEC §4: a batch adding k positions touches at most ceil((126 + k)/bs) + 1 blocks. */
    CHECK(sm->bt_len <= ceil_div(126 + g->len, C.bs) + 1);
    /* The sequence itself may hold one block more until commit: the previous step's window began
     * one position earlier, and its blocks go only once this batch has completed (SPEC §4). */
    if (fresh_one_token[i]) {
      CHECK(in.n_blocks_held <= ceil_div(127 + g->len, C.bs) + 1);
      g_bound_checks++;
      if (in.n_blocks_held > ceil_div(126 + g->len, C.bs) + 1)
        g_bound_excess++;
    }
    CHECK((uint64_t)sm->bt_off + sm->bt_len <= plan.bt_len);
    int64_t lo = imax(in.p0, g->start - (WIN - 1));
    for (int64_t pos = lo; pos < g->start + (int64_t)g->len; pos++) {
      int64_t lb = pos / C.bs;
      CHECK(lb >= sm->first_lb && lb - sm->first_lb < sm->bt_len);
      int32_t phys = plan.block_table[sm->bt_off + (lb - sm->first_lb)];
      /* The sequence holds that block, at that logical index. */
      CHECK(lb >= in.first_lb && lb < in.first_lb + in.n_blocks_held);
      CHECK_EQ(phys, in.blocks[lb - in.first_lb]);
      CHECK(dsv4_pool_is_used(&pool, (uint32_t)phys));
    }
    /* Different sequences never share a block. */
    for (uint32_t k = 0; k < sm->bt_len; k++) {
      int32_t phys = plan.block_table[sm->bt_off + k];
      CHECK(phys >= 0 && (uint32_t)phys < C.n_blocks);
      if (k == 0 || phys != plan.block_table[sm->bt_off + k - 1]) {
        CHECK_EQ(seen[phys], 0);
        seen[phys] = 1;
      }
    }
    dsv4_seq_info_free(&in);
  }
}

static int g_counts[16];
enum {
  C_OK,
  C_REPLAY,
  C_FAIL,
  C_NOSPC,
  C_SEQFULL,
  C_POS,
  C_EXIST,
  C_NOSEQ,
  C_EXPIRED,
  C_DUP,
  C_INVAL,
  C_RANGE,
  C_DELETE,
  C_EXPIRE
};

static void run_config(const pcfg_t *cfg, int steps) {
  static snap_t before, after;
  C = *cfg;
  g_cfgname = cfg->name;
  memset(M, 0, sizeof(M));
  memset(have_last_batch, 0, sizeof(have_last_batch));
  memset(g_counts, 0, sizeof(g_counts));
  g_bound_checks = g_bound_excess = g_one_token_checks = 0;
  dsv4_seqtable_config_t sc = {C.n_layers,        C.bs,     C.max_position, C.max_sequences,
                               C.implicit_create, C.timeout};
  assert_int_equal(dsv4_pool_init(&pool, C.n_blocks), 0);
  assert_int_equal(dsv4_seqtable_create(&sc, &pool, &st), 0);
  dsv4_plan_init(&plan);
  uint64_t now = 1;

  for (g_step = 0; g_step < steps; g_step++) {
    /* Whole twentieths of the timeout, so that expiry boundaries are hit exactly. */
    now += C.timeout ? (C.timeout / 20) * rn(3) : rn(50);
    uint32_t r = rn(100);
    if (r < 4) {
      int id = (int)rn(NAMES);
      int existed = -1;
      CHECK_EQ(dsv4_seqtable_delete(st, NAMESTR[id], (uint32_t)strlen(NAMESTR[id]), &existed), 0);
      CHECK_EQ(existed, M[id].state == M_LIVE);
      M[id].state = M_NONE;
      g_counts[C_DELETE]++;
    } else if (r < 8) {
      uint32_t want = 0;
      for (int i = 0; i < NAMES; i++)
        want += (uint32_t)m_expire(&M[i], now);
      CHECK_EQ(dsv4_seqtable_expire(st, now), want);
      g_counts[C_EXPIRE] += (int)want;
    } else {
      uint32_t layer = rn(C.n_layers);
      batch_t b;
      if (have_last_batch[layer] && rn(10) == 0) {
        b = last_batch[layer];
      } else {
        b.n = 1 + (rn(3) ? rn(2) : rn(MAXSEG));
        for (uint32_t i = 0; i < b.n; i++) {
          batch_t partial = b;
          partial.n = i;
          gen_segment(&b.seg[i], layer, &partial);
        }
      }
      /* As the engine does before planning, half the time: the named sequences against the clock
       * (the other half leaves them to the sweeps, which the plan must handle too). */
      if (rn(2)) {
        uint32_t want = 0;
        for (uint32_t i = 0; i < b.n; i++) {
          int id = name_id(&b.seg[i]);
          if (id >= 0)
            want += (uint32_t)m_expire(&M[id], now);
        }
        CHECK_EQ(dsv4_seqtable_expire_named(st, b.seg, b.n, now), want);
      }
      int fresh_one_token[MAXSEG] = {0};
      for (uint32_t i = 0; i < b.n; i++) {
        int id = name_id(&b.seg[i]);
        if (id < 0 || M[id].state != M_LIVE)
          continue;
        const mseq_t *m = &M[id];
        int ok = b.seg[i].start == m->s[0] + 1;
        for (uint32_t l = 0; l < C.n_layers; l++)
          ok &= m->has_last[l] && m->last_len[l] == 1 && m->s[l] == m->s[0];
        fresh_one_token[i] = ok;
      }
      pred_t p = predict(layer, b.seg, b.n, now, dsv4_pool_free_count(&pool));
      snapshot(&before);
      int rc = dsv4_seqtable_plan(st, layer, b.seg, b.n, now, &plan);
      CHECK_EQ(rc, p.rc);
      if (rc != 0) {
        CHECK_EQ(plan.error.segment, p.segment);
        if (rc == DSV4_EPOSITION || rc == DSV4_EEXIST)
          CHECK_EQ(plan.error.expected, p.expected);
        if (rc == DSV4_ENOSPC) {
          CHECK_EQ(plan.error.sequences_full, p.seq_full);
          if (!p.seq_full) {
            CHECK_EQ(plan.error.needed, p.needed);
            CHECK_EQ(plan.error.free, p.free);
          }
          g_counts[p.seq_full ? C_SEQFULL : C_NOSPC]++;
        }
        g_counts[rc == DSV4_EPOSITION   ? C_POS
                 : rc == DSV4_EEXIST    ? C_EXIST
                 : rc == DSV4_ENOSEQ    ? C_NOSEQ
                 : rc == DSV4_EEXPIRED  ? C_EXPIRED
                 : rc == DSV4_EDUPSEQ   ? C_DUP
                 : rc == DSV4_EINVAL    ? C_INVAL
                 : rc == DSV4_EPOSRANGE ? C_RANGE
                                        : C_OK]++;
        /* A refused batch changed nothing. */
        snapshot(&after);
        CHECK(memcmp(&before, &after, sizeof(before)) == 0);
      } else {
        CHECK_EQ(plan.replay, p.replay);
        check_plan(layer, &b, fresh_one_token);
        if (rn(25) == 0) {
          dsv4_seqtable_fail(st, &plan);
          for (uint32_t i = 0; i < b.n; i++)
            M[name_id(&b.seg[i])].state = M_NONE;
          g_counts[C_FAIL]++;
        } else {
          dsv4_seqtable_commit(st, &plan, now);
          m_commit(layer, b.seg, b.n, p.replay, now);
          if (!p.replay) {
            last_batch[layer] = b;
            have_last_batch[layer] = 1;
          }
          g_counts[p.replay ? C_REPLAY : C_OK]++;
        }
      }
    }
    check_invariants();
  }
  print_message("%s: seed %llu, %d steps: ok %d replay %d fail %d nospc %d seqfull %d pos %d "
                "exist %d noseq %d expired %d dup %d inval %d range %d delete %d expire %d\n",
                cfg->name, g_seed, steps, g_counts[C_OK], g_counts[C_REPLAY], g_counts[C_FAIL],
                g_counts[C_NOSPC], g_counts[C_SEQFULL], g_counts[C_POS], g_counts[C_EXIST],
                g_counts[C_NOSEQ], g_counts[C_EXPIRED], g_counts[C_DUP], g_counts[C_INVAL],
                g_counts[C_RANGE], g_counts[C_DELETE], g_counts[C_EXPIRE]);
  print_message("%s: one-token bound checked %d times, batch bound %d times (%d at one above "
                "ceil((126+k)/bs)+1 before commit)\n",
                cfg->name, g_one_token_checks, g_bound_checks, g_bound_excess);
  /* The random walk must have exercised the interesting paths, or it proves little. */
  CHECK(g_counts[C_OK] > steps / 10);
  CHECK(g_counts[C_REPLAY] > 0);
  CHECK(g_counts[C_FAIL] > 0);
  CHECK(g_counts[C_POS] > 0 && g_counts[C_DUP] > 0 && g_counts[C_INVAL] > 0);
  CHECK(cfg->n_blocks > 400 || g_counts[C_NOSPC] > 0);
  CHECK(cfg->timeout == 0 || (g_counts[C_EXPIRE] > 0 && g_counts[C_EXPIRED] > 0));
  dsv4_plan_free(&plan);
  dsv4_seqtable_destroy(st);
  CHECK_EQ(dsv4_pool_free_count(&pool), C.n_blocks);
  dsv4_pool_destroy(&pool);
}

static int g_steps;

static void run_seeded(const pcfg_t *cfg, uint64_t salt) {
  rng_state = g_seed ^ salt;
  run_config(cfg, g_steps);
}

static void test_bs16_one_layer(void **state) {
  (void)state;
  pcfg_t c = {"bs16-L1", 1, 16, 96, 10, 0, 0, 1 << 20};
  run_seeded(&c, 1);
}
static void test_bs16_three_layers(void **state) {
  (void)state;
  pcfg_t c = {"bs16-L3", 3, 16, 160, 12, 0, 4000, 1 << 20};
  run_seeded(&c, 2);
}
static void test_bs64_four_layers(void **state) {
  (void)state;
  pcfg_t c = {"bs64-L4", 4, 64, 48, 16, 0, 3000, 1 << 20};
  run_seeded(&c, 3);
}
static void test_bs256_two_layers(void **state) {
  (void)state;
  pcfg_t c = {"bs256-L2", 2, 256, 20, 0, 0, 2000, 1 << 20};
  run_seeded(&c, 4);
}
static void test_bs32_implicit(void **state) {
  (void)state;
  pcfg_t c = {"bs32-L2-implicit", 2, 32, 2000, 8, 1, 0, 5000};
  run_seeded(&c, 5);
}

int main(void) {
  const char *s = getenv("DSV4_PROP_SEED");
  g_seed = s ? strtoull(s, NULL, 0) : 20240611ull;
  const char *n = getenv("DSV4_PROP_STEPS");
  g_steps = n ? atoi(n) : 20000;
  for (int i = 0; i < NAMES; i++)
    snprintf(NAMESTR[i], sizeof(NAMESTR[i]), "s%d", i);
  print_message("seqtable property test: seed %llu (DSV4_PROP_SEED overrides)\n", g_seed);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bs16_one_layer),   cmocka_unit_test(test_bs16_three_layers),
      cmocka_unit_test(test_bs64_four_layers), cmocka_unit_test(test_bs256_two_layers),
      cmocka_unit_test(test_bs32_implicit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
