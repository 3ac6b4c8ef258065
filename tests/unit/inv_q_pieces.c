/*
 * SPEC §5.2 for q's half of the insert in pieces: a batch that the backend reads in place, with
 * 256 KiB of q or more and no attention, launches its q half ahead of its validation
 * (server/engine/engine.c, q_early_launch), in pieces of q_piece_bytes on a backend that marks its
 * launches (backend.h, mark and download_marked). Each piece's q_out is downloaded once the batch
 * is accepted, waiting for that piece's launch only, so a download ordered before the launch that
 * writes its bytes would copy what staging held before.
 *
 * Batches of q alone, of different lengths (so that the last piece is short), run alone and two
 * at a time (dsv4_engine_forward_begin/end), their buffers registered with the engine as the
 * daemon's pool and shared regions are; every q_out and slot must equal the CPU backend's answer
 * to the same batch, then every cache byte. The backend under test is argv[1]: "cpu_staged_overlap"
 * by default (the staged CPU backend, whose marked downloads deliver 0xa5 bytes when their mark
 * does not follow every launch that wrote the bytes they copy), or a device backend such as cuda.
 * The broken build (DSV4_TEST_BROKEN_MARK_EARLY in server/engine/engine.c) marks each piece before
 * its launch.
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
#define N_BATCHES 8
/* 8 tokens of 8 heads a piece: a 33-token batch (264 KiB of q) goes in 5 launches. */
#define PIECE_BYTES (64u << 10)

static const char *backend = "cpu_staged_overlap";
static dsv4_model_t model;
static const uint32_t served[1] = {0};

static dsv4_engine_t *open_engine(const char *name, uint32_t piece) {
  dsv4_engine_params_t p = {
      .backend = name,
      .threads = 2,
      .block_size = BS,
      .kv_blocks = BLOCKS,
      .heads = HEADS,
      .model = &model,
      .served_layers = served,
      .n_served = 1,
      .max_sequences = 8,
      .q_piece_bytes = piece,
  };
  dsv4_engine_t *e = NULL;
  char why[256] = "";
  if (dsv4_engine_create(&p, &e, why, sizeof(why)))
    fail_msg("engine on %s: %s", name, why);
  return e;
}

static uint16_t val(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 31;
  return (uint16_t)(((x & 1) << 15) | ((0x7C + (x >> 8) % 6) << 7) | ((x >> 16) & 0x7F));
}

/* One q-only batch of one segment: q, kv, q_out and slots in one page-aligned allocation, which
 * the engine under test has registered (reg) so that its launches read and write it in place. */
typedef struct {
  dsv4_engine_t *reg;
  uint8_t *mem;
  size_t bytes;
  uint32_t n;
  dsv4_seg_req_t seg;
  dsv4_forward_t f;
} batch_t;

static void batch_make(batch_t *b, uint64_t seed, const char *name, int64_t start, uint32_t len) {
  memset(b, 0, sizeof(*b));
  const size_t nq = (size_t)len * HEADS * DSV4_HEAD_DIM, nk = (size_t)len * DSV4_HEAD_DIM;
  b->n = len;
  b->bytes = ((2 * nq + nk) * 2 + len * sizeof(int64_t) + 4095) / 4096 * 4096;
  assert_int_equal(posix_memalign((void **)&b->mem, 4096, b->bytes), 0);
  uint16_t *q = (uint16_t *)b->mem, *kv = q + nq, *q_out = kv + nk;
  for (size_t i = 0; i < nq; i++)
    q[i] = val(seed, i);
  for (size_t i = 0; i < nk; i++)
    kv[i] = val(seed ^ 0xABCDEF, i);
  b->seg = (dsv4_seg_req_t){
      .name = name, .name_len = (uint32_t)strlen(name), .start = start, .len = len};
  b->seg.is_new = start == 0;
  b->f = (dsv4_forward_t){.layer = served[0],
                          .n_tokens = len,
                          .q = q,
                          .kv = kv,
                          .segs = &b->seg,
                          .n_segs = 1,
                          .q_out = q_out,
                          .slots = (int64_t *)(q_out + nq)};
}

static void batch_free(batch_t *b) {
  if (b->reg)
    dsv4_engine_host_unregister(b->reg, b->mem);
  dsv4_forward_release(&b->f);
  free(b->mem);
}

/* The first violation found, reported once everything is freed. */
static char violation[512];

static int same_answer(const batch_t *r, const batch_t *b, int j, const char *how) {
  const size_t nq = (size_t)r->n * HEADS * DSV4_HEAD_DIM * 2;
  const char *what = memcmp(r->f.q_out, b->f.q_out, nq)                       ? "q_out"
                     : memcmp(r->f.slots, b->f.slots, r->n * sizeof(int64_t)) ? "slots"
                                                                              : NULL;
  if (!what)
    return 1;
  snprintf(violation, sizeof(violation),
           "invariant violated: SPEC 5.2: q half in pieces: batch %d (%u tokens, %s): its %s "
           "differs from the CPU backend's (a piece downloaded before its launch wrote it)",
           j, r->n, how, what);
  return 0;
}

/* Batch j's length: at least 32 tokens (256 KiB of q, so that its q half goes first), not a
 * multiple of the piece's 8 tokens but for the first. */
static uint32_t batch_len(int j) {
  static const uint32_t len[N_BATCHES] = {64, 33, 47, 100, 41, 35, 62, 57};
  return len[j];
}

static void test_q_pieces_match_cpu(void **state) {
  (void)state;
  dsv4_engine_t *a = open_engine("cpu", 0), *b = open_engine(backend, PIECE_BYTES);
  batch_t ra[N_BATCHES], rb[N_BATCHES];
  const char *names[2] = {"x", "y"};
  int64_t next[2] = {0, 0};
  int ok = 1;
  /* Made, registered and answered by the CPU engine before the first begins (page-locking waits
   * for the device's work on CUDA: nothing would overlap otherwise). */
  for (int j = 0; j < N_BATCHES; j++) {
    const int s = j % 2;
    batch_make(&ra[j], 500 + (uint64_t)j, names[s], next[s], batch_len(j));
    batch_make(&rb[j], 500 + (uint64_t)j, names[s], next[s], batch_len(j));
    assert_int_equal(dsv4_engine_host_register(b, rb[j].mem, rb[j].bytes), 0);
    rb[j].reg = b;
    assert_int_equal(dsv4_engine_forward(a, &ra[j].f), 0);
    next[s] += batch_len(j);
  }
  /* The first half alone, the second two at a time where the backend overlaps batches. */
  for (int j = 0; j < N_BATCHES / 2; j++) {
    assert_int_equal(dsv4_engine_forward(b, &rb[j].f), 0);
    ok = ok && same_answer(&ra[j], &rb[j], j, "alone");
  }
  for (int j = N_BATCHES / 2; j < N_BATCHES; j += 2) {
    assert_int_equal(dsv4_engine_forward_begin(b, &rb[j].f), 0);
    assert_int_equal(dsv4_engine_forward_begin(b, &rb[j + 1].f), 0);
    for (int k = j; k < j + 2; k++) {
      if (rb[k].f.in_flight)
        assert_int_equal(dsv4_engine_forward_end(b, &rb[k].f), 0);
      ok = ok && same_answer(&ra[k], &rb[k], k, "beside another");
    }
  }
  /* A device backend that overlaps batches marks its launches: the pieces ran there too. */
  if (b->be->ops->caps & DSV4_BE_OVERLAP)
    assert_true(b->be->ops->mark && b->be->ops->download_marked);
  if (!strncmp(backend, "cpu_staged", 10)) {
    dsv4_test_cpu_staged_stats_t st;
    dsv4_test_cpu_staged_stats(b->be, &st);
    assert_true(st.marked_downloads >= 5 * N_BATCHES); /* the batches went in pieces */
    if (strstr(backend, "overlap"))
      assert_int_equal(st.overlapped, N_BATCHES / 4); /* and two at a time did overlap */
  }
  for (int j = 0; j < N_BATCHES; j++) {
    batch_free(&ra[j]);
    batch_free(&rb[j]);
  }
  if (ok) {
    const size_t per = (size_t)BLOCKS * DSV4_BLOCK_STRIDE(BS);
    uint8_t *ca = malloc(per), *cb = malloc(per);
    assert_true(ca && cb);
    assert_int_equal(dsv4__engine_cache_read(a, 0, 0, per, ca), 0);
    assert_int_equal(dsv4__engine_cache_read(b, 0, 0, per, cb), 0);
    ok = !memcmp(ca, cb, per);
    if (!ok)
      snprintf(violation, sizeof(violation),
               "invariant violated: SPEC 5.2: q half in pieces: the cache differs from the CPU "
               "backend's");
    free(ca);
    free(cb);
  }
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
  printf("backend under test: %s\n", backend);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_q_pieces_match_cpu),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  dsv4_model_free(&model);
  return rc;
}
