/*
 * SPEC §5 across batches that overlap (dsv4_engine_forward_begin/end on a DSV4_BE_OVERLAP backend):
 * a batch submitted while another is in flight stages through buffers of its own, so neither
 * batch's uploads nor launches overwrite what the other still reads, and every answer and cache
 * byte is the one the batches give run one at a time.
 *
 * Two sequences, x and y, take turns: batch k + 1 begins before batch k ends, at most two in
 * flight, and each batch's q_out, slots, attention and lse are compared with the CPU backend's
 * answer to the same batch run alone, then every cache byte; y's decode steps do not want q, so on
 * a backend with the fused decode path they run it beside x's unfused batches. A batch refused
 * beside one in flight changes nothing. The backend under test is argv[1]:
 * "cpu_staged_overlap" by default (the staged CPU backend, whose batch downloads read their
 * sources only when the batch is waited for, the latest moment the backend contract allows), or a
 * device backend such as cuda (tests/gpu runs it so). The broken build
 * (DSV4_TEST_BROKEN_ONE_STAGING_HALF in server/engine/engine.c) stages every batch through one
 * half, so batch k's downloads read what batch k + 1 wrote.
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
#include "cpu_staged.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "engine-internal.h"
#include "engine.h"
#include "model.h"

#define HEADS 8
#define BLOCKS 32
#define BS 64
#define ROUNDS 12

static const char *backend = "cpu_staged_overlap";
static dsv4_model_t model;
static const uint32_t served[2] = {0, 2}; /* a plain and a YaRN layer of V4-Flash */
static float sinks[2 * HEADS];

static dsv4_engine_t *open_engine(const char *name) {
  dsv4_engine_params_t p = {
      .backend = name,
      .threads = 2,
      .block_size = BS,
      .kv_blocks = BLOCKS,
      .heads = HEADS,
      .model = &model,
      .served_layers = served,
      .n_served = 2,
      .max_sequences = 8,
      .attn_sinks = sinks,
      .attention_mode = DSV4_ATTENTION_EXACT,
  };
  dsv4_engine_t *e = NULL;
  char why[256] = "";
  int rc = dsv4_engine_create(&p, &e, why, sizeof(why));
  if (rc)
    fail_msg("engine on %s: %s", name, why);
  return e;
}

static uint16_t val(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  return (uint16_t)(((x & 1) << 15) | ((0x7C + (x >> 8) % 6) << 7) | ((x >> 16) & 0x7F));
}

/* Page-aligned memory, so that a device backend may register it (cudaHostRegister). */
static void *page_alloc(size_t n) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, (n + 4095) / 4096 * 4096))
    return NULL;
  return p;
}

/* One batch of one segment, with every output. On the engine under test its buffers are
 * registered with the backend (as the daemon's pinned pool is), so a device backend copies from and
 * to them in place, on its copy streams: the overlap the test is about. */
typedef struct {
  dsv4_engine_t *reg; /* the engine they are registered with, or NULL */
  uint32_t n;
  uint16_t *q, *kv, *q_out, *attn;
  float *lse;
  int64_t *slots;
  dsv4_seg_req_t seg;
  dsv4_forward_t f;
} batch_t;

static void batch_make(batch_t *b, uint32_t layer, uint64_t seed, const char *name, int64_t start,
                       uint32_t len) {
  memset(b, 0, sizeof(*b));
  b->n = len;
  b->seg = (dsv4_seg_req_t){
      .name = name, .name_len = (uint32_t)strlen(name), .start = start, .len = len};
  size_t nq = (size_t)len * HEADS * DSV4_HEAD_DIM, nk = (size_t)len * DSV4_HEAD_DIM;
  b->q = page_alloc(nq * 2);
  b->kv = page_alloc(nk * 2);
  b->q_out = page_alloc(nq * 2);
  b->attn = page_alloc(nq * 2);
  b->lse = page_alloc((size_t)len * HEADS * sizeof(float));
  b->slots = page_alloc(len * sizeof(int64_t));
  assert_true(b->q && b->kv && b->q_out && b->attn && b->lse && b->slots);
  for (size_t i = 0; i < nq; i++)
    b->q[i] = val(seed, i);
  for (size_t i = 0; i < nk; i++)
    b->kv[i] = val(seed ^ 0xABCDEF, i);
  b->f = (dsv4_forward_t){.layer = layer,
                          .n_tokens = len,
                          .q = b->q,
                          .kv = b->kv,
                          .segs = &b->seg,
                          .n_segs = 1,
                          .q_out = b->q_out,
                          .slots = b->slots,
                          .attn = b->attn,
                          .lse = b->lse,
                          .attention = DSV4_ATTENTION_EXACT};
}

/* The sizes of the buffers of batch b, in the order of batch_bufs. */
static void batch_bufs(batch_t *b, void *p[6], size_t n[6]) {
  size_t nq = (size_t)b->n * HEADS * DSV4_HEAD_DIM * 2;
  void *pp[6] = {b->q, b->kv, b->q_out, b->attn, b->lse, b->slots};
  size_t nn[6] = {nq, (size_t)b->n * DSV4_HEAD_DIM * 2, nq,
                  nq, (size_t)b->n * HEADS * 4,         (size_t)b->n * 8};
  memcpy(p, pp, sizeof(pp));
  memcpy(n, nn, sizeof(nn));
}

static void batch_register(batch_t *b, dsv4_engine_t *e) {
  void *p[6];
  size_t n[6];
  batch_bufs(b, p, n);
  for (int i = 0; i < 6; i++)
    assert_int_equal(dsv4_engine_host_register(e, p[i], n[i]), 0);
  b->reg = e;
}

static void batch_free(batch_t *b) {
  if (b->reg) {
    void *p[6];
    size_t n[6];
    batch_bufs(b, p, n);
    for (int i = 0; i < 6; i++)
      dsv4_engine_host_unregister(b->reg, p[i]);
  }
  dsv4_forward_release(&b->f);
  free(b->q);
  free(b->kv);
  free(b->q_out);
  free(b->attn);
  free(b->lse);
  free(b->slots);
}

/* The first violation found, reported once everything is freed. */
static char violation[512];

/* Whether batch b (on the engine under test) answered what r (the same batch on the CPU backend,
 * alone) did; else the violation is written. */
static int same_answer(const batch_t *r, const batch_t *b, int round) {
  size_t nq = (size_t)r->n * HEADS * DSV4_HEAD_DIM;
  /* A batch that did not want q (the fused decode path where the backend offers it) has none. */
  const char *what = !b->f.q_unwanted && memcmp(r->q_out, b->q_out, nq * 2)         ? "q_out"
                     : memcmp(r->slots, b->slots, r->n * sizeof(int64_t))           ? "slots"
                     : memcmp(r->attn, b->attn, nq * 2)                             ? "attention"
                     : memcmp(r->lse, b->lse, (size_t)r->n * HEADS * sizeof(float)) ? "lse"
                                                                                    : NULL;
  if (!what)
    return 1;
  snprintf(violation, sizeof(violation),
           "invariant violated: SPEC 5: overlapped batches: round %d, sequence %s (%u tokens from "
           "%lld): its %s differs from the batch run alone (a later batch wrote its staging "
           "before its downloads ran)",
           round, r->seg.name, r->n, (long long)r->seg.start, what);
  return 0;
}

static uint8_t *cache_bytes(dsv4_engine_t *e) {
  size_t per = (size_t)BLOCKS * DSV4_BLOCK_STRIDE(BS);
  uint8_t *all = malloc(per * 2);
  assert_non_null(all);
  for (uint32_t i = 0; i < 2; i++)
    assert_int_equal(dsv4__engine_cache_read(e, i, 0, per, all + i * per), 0);
  return all;
}

/* The lengths of round k's batches of x and y: prefills of different sizes (so the two halves
 * grow apart), then decode steps. The first x is long and the first y short: on a device, x's last
 * download (its slots, behind 12 MiB of q_out) then comes well after y's slot mapper has run, so a
 * y staged in x's half overwrites x's slots before they are read, whatever the timing. */
static uint32_t round_len(int k, int seq) {
  static const uint32_t x[ROUNDS] = {1536, 33, 1, 1, 12, 1, 1, 1, 5, 1, 1, 1};
  static const uint32_t y[ROUNDS] = {9, 1, 40, 1, 1, 3, 1, 64, 1, 1, 2, 1};
  return seq ? y[k] : x[k];
}

static void test_overlapped_batches_match_alone(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine("cpu"), *b = open_engine(backend);
  batch_t *ra = calloc(2 * ROUNDS, sizeof(batch_t)), *rb = calloc(2 * ROUNDS, sizeof(batch_t));
  int64_t next[2][2] = {{0, 0}, {0, 0}}; /* [sequence][served layer] */
  int ok = 1;
  const char *names[2] = {"x", "y"};
  const int overlap = strstr(backend, "cpu_staged") == NULL || strstr(backend, "overlap") != NULL;
  assert_non_null(ra);
  assert_non_null(rb);
  /*
   * Batch j is round j / 2 of sequence j % 2; the rounds alternate between the two served layers,
   * each continuing its own positions. Every batch is made, registered and answered by the CPU
   * reference before the first begins, so that nothing on the host stands between two batches
   * but their own begin: page-locking host memory (or unlocking it) waits for the device's work on
   * CUDA, and a reference forward between two begins would outlast the first batch's device work,
   * so in either case nothing would overlap.
   */
  for (int j = 0; j < 2 * ROUNDS; j++) {
    int s = j % 2, li = (j / 2) % 2;
    uint32_t len = round_len(j / 2, s);
    batch_make(&ra[j], served[li], 100 + (uint64_t)j, names[s], next[s][li], len);
    batch_make(&rb[j], served[li], 100 + (uint64_t)j, names[s], next[s][li], len);
    ra[j].seg.is_new = rb[j].seg.is_new = j < 2;
    /* y's decode steps do not want q: on a backend with DSV4_BE_ATTN_FUSED_Q they run fused (no
     * q_out staged or downloaded) between and beside x's unfused batches. */
    rb[j].f.q_unwanted = s == 1 && len == 1;
    batch_register(&rb[j], b);
    assert_int_equal(dsv4_engine_forward(a, &ra[j].f), 0);
    next[s][li] += len;
  }
  /* Batch j begins, then batch j - 1 ends: two in flight between. */
  for (int j = 0; j < 2 * ROUNDS + 1; j++) {
    if (j < 2 * ROUNDS) {
      assert_int_equal(dsv4_engine_can_overlap(b, &rb[j].f), overlap);
      assert_int_equal(dsv4_engine_forward_begin(b, &rb[j].f), 0);
      assert_int_equal(rb[j].f.in_flight, overlap);
    }
    if (j > 0) {
      if (rb[j - 1].f.in_flight)
        assert_int_equal(dsv4_engine_forward_end(b, &rb[j - 1].f), 0);
      if (ok)
        ok = same_answer(&ra[j - 1], &rb[j - 1], (j - 1) / 2);
    }
  }
  for (int j = 0; j < 2 * ROUNDS; j++) {
    batch_free(&ra[j]);
    batch_free(&rb[j]);
  }
  free(ra);
  free(rb);
  assert_int_equal(dsv4_engine_in_flight(b), 0);
  if (ok) {
    uint8_t *ca = cache_bytes(a), *cb = cache_bytes(b);
    size_t per = (size_t)BLOCKS * DSV4_BLOCK_STRIDE(BS);
    if (memcmp(ca, cb, 2 * per))
      snprintf(violation, sizeof(violation),
               "invariant violated: SPEC 5: overlapped batches: the cache differs from the one the "
               "batches write run alone");
    ok = !memcmp(ca, cb, 2 * per);
    free(ca);
    free(cb);
  }
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
  if (!ok)
    fail_msg("%s", violation);
}

/* While a batch is in flight, a batch that cannot overlap (it wants the digest) is refused and
 * changes nothing; once the first has ended it runs. */
static void test_non_overlapping_batch_waits(void **state) {
  (void)state;
  dsv4_engine_t *b = open_engine(backend);
  batch_t x, y;
  batch_make(&x, served[0], 1, "x", 0, 20);
  batch_make(&y, served[0], 2, "y", 0, 20);
  x.seg.is_new = y.seg.is_new = 1;
  y.f.want_digest = 1;
  assert_int_equal(dsv4_engine_forward_begin(b, &x.f), 0);
  if (x.f.in_flight) {
    assert_false(dsv4_engine_can_overlap(b, &y.f));
    assert_int_equal(dsv4_engine_forward_begin(b, &y.f), DSV4_EINVAL);
    assert_int_equal(dsv4_engine_sequences(b), 1);
    assert_int_equal(dsv4_engine_forward_end(b, &x.f), 0);
  }
  assert_int_equal(dsv4_engine_forward(b, &y.f), 0);
  assert_int_equal(dsv4_engine_sequences(b), 2);
  batch_free(&x);
  batch_free(&y);
  dsv4_engine_destroy(b);
}

/* While a batch is in flight, a batch that could overlap but is refused (its position does not
 * continue its sequence) changes nothing: the one in flight ends and answers as it would have, and
 * the next batch overlaps as ever. */
static void test_refused_beside_one_in_flight(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine("cpu"), *b = open_engine(backend);
  batch_t rx, x, bad, ry, y;
  batch_make(&rx, served[0], 1, "x", 0, 20);
  batch_make(&x, served[0], 1, "x", 0, 20);
  batch_make(&bad, served[0], 2, "y", 5, 3); /* y is unknown and not new */
  batch_make(&ry, served[0], 3, "y", 0, 7);
  batch_make(&y, served[0], 3, "y", 0, 7);
  rx.seg.is_new = x.seg.is_new = ry.seg.is_new = y.seg.is_new = 1;
  assert_int_equal(dsv4_engine_forward(a, &rx.f), 0);
  assert_int_equal(dsv4_engine_forward(a, &ry.f), 0);
  batch_register(&x, b);
  batch_register(&y, b);
  assert_int_equal(dsv4_engine_forward_begin(b, &x.f), 0);
  const uint32_t free0 = dsv4_engine_blocks_free(b);
  assert_int_not_equal(dsv4_engine_forward_begin(b, &bad.f), 0);
  assert_false(bad.f.in_flight);
  assert_int_equal(dsv4_engine_blocks_free(b), free0);
  assert_int_equal(dsv4_engine_in_flight(b), x.f.in_flight);
  assert_int_equal(dsv4_engine_forward_begin(b, &y.f), 0);
  if (x.f.in_flight)
    assert_int_equal(dsv4_engine_forward_end(b, &x.f), 0);
  if (y.f.in_flight)
    assert_int_equal(dsv4_engine_forward_end(b, &y.f), 0);
  int ok = same_answer(&rx, &x, 0) && same_answer(&ry, &y, 1);
  assert_int_equal(dsv4_engine_sequences(b), 2);
  assert_int_equal(dsv4_engine_in_flight(b), 0);
  batch_t *all[] = {&rx, &x, &bad, &ry, &y};
  for (int i = 0; i < 5; i++)
    batch_free(all[i]);
  dsv4_engine_destroy(a);
  dsv4_engine_destroy(b);
  if (!ok)
    fail_msg("%s", violation);
}

int main(int argc, char **argv) {
  int skip = dsv4_test_backend_from_args(argc, argv, &backend);
  if (skip)
    return skip;
  if (dsv4_model_builtin_flash(&model) != 0)
    return 1;
  for (int i = 0; i < 2 * HEADS; i++)
    sinks[i] = -1.0f + 0.25f * (float)i;
  printf("backend under test: %s\n", backend);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_overlapped_batches_match_alone),
      cmocka_unit_test(test_non_overlapping_batch_waits),
      cmocka_unit_test(test_refused_beside_one_in_flight),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  dsv4_model_free(&model);
  return rc;
}
