/*
 * The Level Zero glue (kernels/level_zero/lz_backend.c) over the test double (fake_ze.c), on the
 * paths a daemon takes after a batch goes wrong, each checked against the CPU backend:
 *   - stale:  a batch that fails before its sync (a position of -1: the insert refuses it) must not
 *             leave its error word for the next batch, which must succeed with the CPU's bytes;
 *   - oom:    the host running out of memory while the RoPE row buffers grow refuses that batch
 *             with DSV4_ENOMEM and leaves the backend usable (zeMemAllocHost fails once, injected
 *             with the linker's --wrap);
 *   - attention with a candidate's block missing from the segment's table (SPEC §7): the launch is
 *             accepted, sync() answers DSV4_EINVAL, attn and lse keep their bytes, and the next
 *             batch's attention is accepted and written (its bytes against the CPU backend are
 *             lz_kernels_test's level-zero-attention);
 *   - compress oom: the host running out of memory while the compressor's emission staging grows
 *             refuses that launch with DSV4_ENOMEM; the same launch then runs, without an insert
 *             before it (the glue reads the positions back itself), and writes the CPU backend's
 *             entries and ring (the compressed branch's batches are lz_compress_test's).
 */
#include <level_zero/ze_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "rope.h"

static int host_alloc_fail_in; /* fail the Nth zeMemAllocHost from now (0 = never) */

ze_result_t __real_zeMemAllocHost(ze_context_handle_t c, const ze_host_mem_alloc_desc_t *d,
                                  size_t s, size_t a, void **p);
ze_result_t __wrap_zeMemAllocHost(ze_context_handle_t c, const ze_host_mem_alloc_desc_t *d,
                                  size_t s, size_t a, void **p);
ze_result_t __wrap_zeMemAllocHost(ze_context_handle_t c, const ze_host_mem_alloc_desc_t *d,
                                  size_t s, size_t a, void **p) {
  if (host_alloc_fail_in && --host_alloc_fail_in == 0)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  return __real_zeMemAllocHost(c, d, s, a, p);
}

#define BS 16
#define NBLK 32
#define HEADS 2
#define MAXT 300

static int failures;
#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                  \
      printf(__VA_ARGS__);                                                                         \
      printf("\n");                                                                                \
      failures++;                                                                                  \
    }                                                                                              \
  } while (0)

typedef struct {
  uint32_t n, nbt;
  int64_t pos[MAXT];
  int32_t seg[MAXT], bt[MAXT / BS + 2];
  int64_t first_lb;
  uint32_t off, len;
} batch_t;

typedef struct {
  int map_rc, ins_rc, sync_rc;
  uint8_t *cache;
  uint16_t *q_out;
} result_t;

static uint16_t q[MAXT * HEADS * 512], kv[MAXT * 512];

static size_t cache_bytes(void) {
  return (size_t)NBLK * DSV4_BLOCK_STRIDE(BS);
}

/* n tokens of one sequence from position start, its blocks 0, 1, 2, ... */
static void one_seq(batch_t *b, uint32_t n, int64_t start) {
  memset(b, 0, sizeof(*b));
  b->n = n;
  for (uint32_t t = 0; t < n; t++)
    b->pos[t] = start + t;
  b->first_lb = start / BS;
  b->len = b->nbt = (uint32_t)((start + n - 1) / BS - start / BS + 1);
  for (uint32_t i = 0; i < b->nbt; i++)
    b->bt[i] = (int32_t)i;
}

/* A batch as the engine runs it (map, insert, and sync only when both were accepted), on a zeroed
 * cache in fresh device buffers. */
static void run(dsv4_backend_t *be, const batch_t *b, dsv4_rope_table_t *rope, result_t *r) {
  const void *src[9] = {b->pos, b->seg, &b->first_lb, &b->off, &b->len, b->bt, q, kv, NULL};
  const size_t sz[11] = {b->n * 8,
                         b->n * 4,
                         8,
                         4,
                         4,
                         b->nbt * 4,
                         b->n * HEADS * 1024,
                         b->n * 1024,
                         cache_bytes(),
                         b->n * 8,
                         b->n * HEADS * 1024};
  dsv4_devbuf_t d[11] = {{0}};
  for (int i = 0; i < 11; i++) {
    if (be->ops->buf_alloc(be, sz[i], &d[i]) != 0 ||
        (i < 9 && src[i] && be->ops->upload(be, &d[i], 0, src[i], sz[i]) != 0)) {
      printf("FAIL: device buffer %d\n", i);
      exit(1);
    }
  }
  dsv4_map_args_t m = {.n_tokens = b->n,
                       .n_segments = 1,
                       .block_size = BS,
                       .n_blocks = NBLK,
                       .positions = d[0].ptr,
                       .tok_seg = d[1].ptr,
                       .seg_first_lb = d[2].ptr,
                       .seg_bt_off = d[3].ptr,
                       .seg_bt_len = d[4].ptr,
                       .block_table = d[5].ptr,
                       .slots = d[9].ptr};
  dsv4_insert_args_t a = {.n_tokens = b->n,
                          .heads = HEADS,
                          .q = d[6].ptr,
                          .kv = d[7].ptr,
                          .positions = d[0].ptr,
                          .slots = d[9].ptr,
                          .rope = rope,
                          .eps = 1e-6f,
                          .write_kv = 1,
                          .q_out = d[10].ptr,
                          .cache = d[8].ptr,
                          .block_size = BS,
                          .n_blocks = NBLK,
                          .stride = DSV4_BLOCK_STRIDE(BS)};
  r->ins_rc = r->sync_rc = 1;
  r->map_rc = be->ops->map_slots(be, &m);
  if (r->map_rc == 0) {
    if (be->ops->caps & DSV4_BE_HOST_MEMORY) /* the engine materialises rows for the CPU */
      (void)dsv4_rope_table_ensure(rope, b->pos, b->n);
    r->ins_rc = be->ops->qkv_insert(be, &a);
  }
  if (r->map_rc == 0 && r->ins_rc == 0)
    r->sync_rc = be->ops->sync(be);
  r->cache = malloc(cache_bytes());
  r->q_out = malloc(sz[10]);
  if (!r->cache || !r->q_out || be->ops->download(be, r->cache, &d[8], 0, cache_bytes()) != 0 ||
      be->ops->download(be, r->q_out, &d[10], 0, sz[10]) != 0) {
    printf("FAIL: download\n");
    exit(1);
  }
  for (int i = 0; i < 11; i++)
    be->ops->buf_free(be, &d[i]);
}

/* The bytes attn and lse start as, so that a launch that writes nothing shows. */
#define JUNK 0x5A

typedef struct {
  int map_rc, ins_rc, attn_rc, sync_rc;
  uint8_t *out, *lse; /* what the device's attn and lse hold afterwards */
} attn_result_t;

/* map_slots, qkv_insert and attention of a batch of one sequence that starts at p0, as the engine
 * runs them (sync after all three were accepted), in fresh device buffers. */
static void run_attn(dsv4_backend_t *be, const batch_t *b, int64_t p0, dsv4_rope_table_t *rope,
                     attn_result_t *r) {
  static float sink[HEADS] = {0.25f, -1.5f};
  size_t q_bytes = (size_t)b->n * HEADS * 1024, lse_bytes = (size_t)b->n * HEADS * 4;
  uint8_t *junk = malloc(q_bytes);
  if (!junk)
    exit(1);
  memset(junk, JUNK, q_bytes);
  enum { POS, SEG, FIRST, OFF, LEN, BT, Q, KV, CACHE, SLOTS, QOUT, P0, SINK, OUT, LSE, N_BUF };
  const void *src[N_BUF] = {b->pos, b->seg, &b->first_lb, &b->off, &b->len, b->bt, q,   kv,
                            NULL,   NULL,   NULL,         &p0,     sink,    junk,  junk};
  const size_t sz[N_BUF] = {b->n * 8,    b->n * 4,      8,        4,       4, b->nbt * 4,   q_bytes,
                            b->n * 1024, cache_bytes(), b->n * 8, q_bytes, 8, sizeof(sink), q_bytes,
                            lse_bytes};
  dsv4_devbuf_t d[N_BUF] = {{0}};
  for (int i = 0; i < N_BUF; i++)
    if (be->ops->buf_alloc(be, sz[i], &d[i]) != 0 ||
        (src[i] && be->ops->upload(be, &d[i], 0, src[i], sz[i]) != 0)) {
      printf("FAIL: device buffer %d\n", i);
      exit(1);
    }
  dsv4_map_args_t m = {.n_tokens = b->n,
                       .n_segments = 1,
                       .block_size = BS,
                       .n_blocks = NBLK,
                       .positions = d[POS].ptr,
                       .tok_seg = d[SEG].ptr,
                       .seg_first_lb = d[FIRST].ptr,
                       .seg_bt_off = d[OFF].ptr,
                       .seg_bt_len = d[LEN].ptr,
                       .block_table = d[BT].ptr,
                       .slots = d[SLOTS].ptr,
                       .bt_entries = b->nbt};
  dsv4_insert_args_t a = {.n_tokens = b->n,
                          .heads = HEADS,
                          .q = d[Q].ptr,
                          .kv = d[KV].ptr,
                          .positions = d[POS].ptr,
                          .slots = d[SLOTS].ptr,
                          .rope = rope,
                          .eps = 1e-6f,
                          .write_kv = 1,
                          .q_out = d[QOUT].ptr,
                          .cache = d[CACHE].ptr,
                          .block_size = BS,
                          .n_blocks = NBLK,
                          .stride = DSV4_BLOCK_STRIDE(BS)};
  dsv4_attn_args_t aa = {.n_tokens = b->n,
                         .n_segments = 1,
                         .heads = HEADS,
                         .q = d[QOUT].ptr,
                         .positions = d[POS].ptr,
                         .tok_seg = d[SEG].ptr,
                         .seg_p0 = d[P0].ptr,
                         .seg_first_lb = d[FIRST].ptr,
                         .seg_bt_off = d[OFF].ptr,
                         .seg_bt_len = d[LEN].ptr,
                         .block_table = d[BT].ptr,
                         .bt_entries = b->nbt,
                         .cache = d[CACHE].ptr,
                         .block_size = BS,
                         .n_blocks = NBLK,
                         .stride = DSV4_BLOCK_STRIDE(BS),
                         .sink = d[SINK].ptr,
                         .rope = rope,
                         .out = d[OUT].ptr,
                         .lse = d[LSE].ptr};
  r->ins_rc = r->attn_rc = r->sync_rc = 1;
  r->map_rc = be->ops->map_slots(be, &m);
  if (r->map_rc == 0)
    r->ins_rc = be->ops->qkv_insert(be, &a);
  if (r->ins_rc == 0)
    r->attn_rc = be->ops->attention(be, &aa);
  if (r->attn_rc == 0)
    r->sync_rc = be->ops->sync(be);
  r->out = malloc(q_bytes);
  r->lse = malloc(lse_bytes);
  if (!r->out || !r->lse || be->ops->download(be, r->out, &d[OUT], 0, q_bytes) != 0 ||
      be->ops->download(be, r->lse, &d[LSE], 0, lse_bytes) != 0) {
    printf("FAIL: download\n");
    exit(1);
  }
  for (int i = 0; i < N_BUF; i++)
    be->ops->buf_free(be, &d[i]);
  free(junk);
}

/* How many of the n bytes at p are not JUNK. */
static size_t written(const uint8_t *p, size_t n) {
  size_t w = 0;
  for (size_t i = 0; i < n; i++)
    w += p[i] != JUNK;
  return w;
}

/* A candidate's block missing from the table refuses the batch at sync and writes nothing; the
 * next batch is accepted (no error word left behind) and written. */
static void check_attn_missing(dsv4_backend_t *lz, dsv4_rope_table_t *rope) {
  batch_t b;
  attn_result_t r;
  /* Positions 130..133 of a sequence from p0 = 0 attend back to positions 3..6, in logical block
   * 0; the table holds only block 8, where the tokens themselves are (so the insert writes them).
   */
  one_seq(&b, 4, 130);
  run_attn(lz, &b, 0, rope, &r);
  size_t q_bytes = (size_t)b.n * HEADS * 1024, lse_bytes = (size_t)b.n * HEADS * 4;
  CHECK(r.map_rc == 0 && r.ins_rc == 0 && r.attn_rc == 0 && r.sync_rc == DSV4_EINVAL,
        "missing block: map %d insert %d attention %d sync %d, expected 0 0 0 and DSV4_EINVAL (%d)",
        r.map_rc, r.ins_rc, r.attn_rc, r.sync_rc, DSV4_EINVAL);
  CHECK(written(r.out, q_bytes) == 0 && written(r.lse, lse_bytes) == 0,
        "missing block: %zu bytes of attn and %zu of lse were written", written(r.out, q_bytes),
        written(r.lse, lse_bytes));
  printf("missing block: attention %d, sync %d, attn and lse untouched\n", r.attn_rc, r.sync_rc);
  free(r.out);
  free(r.lse);
  /* The same positions from p0 = 128: every candidate's block is in the table. */
  run_attn(lz, &b, 128, rope, &r);
  CHECK(r.map_rc == 0 && r.ins_rc == 0 && r.attn_rc == 0 && r.sync_rc == 0,
        "missing block: the valid batch after it: map %d insert %d attention %d sync %d", r.map_rc,
        r.ins_rc, r.attn_rc, r.sync_rc);
  CHECK(written(r.out, q_bytes) > q_bytes / 2 && written(r.lse, lse_bytes) > lse_bytes / 2,
        "missing block: the valid batch after it wrote %zu bytes of attn and %zu of lse",
        written(r.out, q_bytes), written(r.lse, lse_bytes));
  printf("missing block: the valid batch after it: sync %d, attn and lse written\n", r.sync_rc);
  free(r.out);
  free(r.lse);
}

/* SPEC §8.3 at ratio 128 on one sequence from position 0: 130 tokens, one emission (p = 127). */
#define C_N 130
#define C_W 512

typedef struct {
  int64_t pos[C_N], p0, first_lb;
  int32_t seg[C_N], bt[2];
  uint32_t slot, off, len;
  float ckv[C_N * 2 * C_W], ape[128 * C_W], norm[C_W];
} c_batch_t;

/* The compress op of the batch on be, from device copies (or, on the CPU, host memory); ring and
 * entries start as zeros. rc: the first launch's answer; then, with rc 0, sync's. */
static int run_compress(dsv4_backend_t *be, const c_batch_t *b, dsv4_rope_table_t *rope,
                        int *sync_rc, float *ring, uint8_t *c_cache) {
  const size_t ring_bytes = DSV4_RING_FLOATS(128u) * sizeof(float);
  const size_t c_bytes = 2 * DSV4_BLOCK_STRIDE(BS);
  enum { POS, SEG, P0, SLOT, FLB, OFF, LEN, BT, CKV, APE, NORM, RING, CACHE, N_BUF };
  const void *src[N_BUF] = {b->pos, b->seg, &b->p0, &b->slot, &b->first_lb, &b->off, &b->len,
                            b->bt,  b->ckv, b->ape, b->norm,  NULL,         NULL};
  const size_t sz[N_BUF] = {
      sizeof(b->pos), sizeof(b->seg),  8,          4,      8, 4, 4, 8, sizeof(b->ckv),
      sizeof(b->ape), sizeof(b->norm), ring_bytes, c_bytes};
  dsv4_devbuf_t d[N_BUF] = {{0}};
  const void *p[N_BUF];
  for (int i = 0; i < N_BUF; i++) {
    if (be->ops->buf_alloc(be, sz[i], &d[i]) != 0 ||
        (src[i] && be->ops->upload(be, &d[i], 0, src[i], sz[i]) != 0)) {
      printf("FAIL: device buffer %d\n", i);
      exit(1);
    }
    p[i] = d[i].ptr;
  }
  dsv4_compress_args_t a = {.ratio = 128,
                            .n_tokens = C_N,
                            .n_segments = 1,
                            .positions = p[POS],
                            .tok_seg = p[SEG],
                            .seg_p0 = p[P0],
                            .seg_slot = p[SLOT],
                            .ckv = p[CKV],
                            .ring = d[RING].ptr,
                            .n_slots = 1,
                            .ape = p[APE],
                            .norm_weight = p[NORM],
                            .eps = 1e-6f,
                            .rope = rope,
                            .seg_c_first_lb = p[FLB],
                            .seg_cbt_off = p[OFF],
                            .seg_cbt_len = p[LEN],
                            .c_block_table = p[BT],
                            .c_bt_entries = 2,
                            .c_cache = d[CACHE].ptr,
                            .c_n_blocks = 2,
                            .block_size = BS,
                            .stride = DSV4_BLOCK_STRIDE(BS)};
  int rc = be->ops->compress(be, &a);
  *sync_rc = rc ? 1 : be->ops->sync(be);
  if (be->ops->download(be, ring, &d[RING], 0, ring_bytes) != 0 ||
      be->ops->download(be, c_cache, &d[CACHE], 0, c_bytes) != 0) {
    printf("FAIL: download\n");
    exit(1);
  }
  for (int i = 0; i < N_BUF; i++)
    be->ops->buf_free(be, &d[i]);
  return rc;
}

static void check_compress_oom(dsv4_backend_t *lz, dsv4_backend_t *cpu, dsv4_rope_table_t *rope) {
  static c_batch_t b;
  for (uint32_t t = 0; t < C_N; t++) {
    b.pos[t] = t;
    b.seg[t] = 0;
  }
  b.bt[0] = 1; /* entries 0..15: block 1 of 2 */
  b.bt[1] = 0;
  b.len = 2;
  for (size_t i = 0; i < sizeof(b.ckv) / sizeof(float); i++)
    b.ckv[i] = (float)((int)((i * 2654435761u) % 2001u) - 1000) * 0x1p-8f;
  for (size_t i = 0; i < sizeof(b.ape) / sizeof(float); i++)
    b.ape[i] = (float)((int)((i * 40503u) % 101u) - 50) * 0x1p-7f;
  for (int i = 0; i < C_W; i++)
    b.norm[i] = 1.0f + (float)(i % 7) * 0x1p-4f;
  /* The engine materialises the rows of the batch and of its entries' first positions. */
  (void)dsv4_rope_table_ensure(rope, b.pos, C_N);
  const size_t ring_bytes = DSV4_RING_FLOATS(128u) * sizeof(float);
  const size_t c_bytes = 2 * DSV4_BLOCK_STRIDE(BS);
  float *ring_l = malloc(ring_bytes), *ring_c = malloc(ring_bytes);
  uint8_t *c_l = malloc(c_bytes), *c_c = malloc(c_bytes);
  if (!ring_l || !ring_c || !c_l || !c_c)
    exit(1);
  int sync_rc;
  host_alloc_fail_in = 1;
  int rc = run_compress(lz, &b, rope, &sync_rc, ring_l, c_l);
  CHECK(host_alloc_fail_in == 0, "compress oom: no host allocation was made");
  CHECK(rc == DSV4_ENOMEM, "compress oom: compress answered %d, expected DSV4_ENOMEM (%d)", rc,
        DSV4_ENOMEM);
  host_alloc_fail_in = 0;
  rc = run_compress(lz, &b, rope, &sync_rc, ring_l, c_l);
  CHECK(rc == 0 && sync_rc == 0, "compress oom: the launch after it: compress %d sync %d", rc,
        sync_rc);
  rc = run_compress(cpu, &b, rope, &sync_rc, ring_c, c_c);
  CHECK(rc == 0 && sync_rc == 0, "compress oom: the CPU backend refused the batch");
  CHECK(memcmp(ring_l, ring_c, ring_bytes) == 0, "compress oom: the ring differs from the CPU's");
  CHECK(memcmp(c_l, c_c, c_bytes) == 0, "compress oom: the entries differ from the CPU's");
  printf("compress oom: DSV4_ENOMEM, then the launch runs with the CPU's entry and ring\n");
  free(ring_l);
  free(ring_c);
  free(c_l);
  free(c_c);
}

static void result_free(result_t *r) {
  free(r->cache);
  free(r->q_out);
}

/* A valid batch gives the CPU backend's bytes. */
static void check_valid(dsv4_backend_t *lz, dsv4_backend_t *cpu, dsv4_rope_table_t *rope,
                        uint32_t n, const char *what) {
  batch_t b;
  result_t rl, rc;
  one_seq(&b, n, 5);
  run(lz, &b, rope, &rl);
  run(cpu, &b, rope, &rc);
  CHECK(rl.map_rc == 0 && rl.ins_rc == 0 && rl.sync_rc == 0,
        "%s: map %d insert %d sync %d, expected 0 0 0", what, rl.map_rc, rl.ins_rc, rl.sync_rc);
  CHECK(rc.sync_rc == 0, "%s: the CPU backend refused the batch", what);
  CHECK(memcmp(rl.cache, rc.cache, cache_bytes()) == 0, "%s: cache differs from the CPU's", what);
  CHECK(memcmp(rl.q_out, rc.q_out, (size_t)n * HEADS * 1024) == 0,
        "%s: q_out differs from the CPU's", what);
  result_free(&rl);
  result_free(&rc);
}

int main(void) {
  char why[256];
  dsv4_backend_t *lz = NULL, *cpu = NULL;
  dsv4_backend_options_t opt = {.threads = 1};
  if (dsv4_backend_open("level_zero", NULL, &lz, why, sizeof(why)) != 0) {
    printf("FAIL: the level_zero backend over the test double did not open: %s\n", why);
    return 1;
  }
  if (dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)) != 0) {
    printf("FAIL: cpu backend: %s\n", why);
    return 1;
  }
  float inv[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv);
  dsv4_rope_table_t *rope = NULL;
  if (dsv4_rope_table_create(inv, DSV4_MAX_POSITION_DEFAULT, &rope) != 0)
    return 1;
  for (size_t i = 0; i < sizeof(q) / 2; i++)
    q[i] = (uint16_t)(0x3f00 + (i * 7919) % 255);
  for (size_t i = 0; i < sizeof(kv) / 2; i++)
    kv[i] = (uint16_t)(0x3e00 + (i * 104729) % 511);

  /* stale */
  batch_t b;
  result_t r;
  one_seq(&b, 2, 0);
  b.pos[1] = -1;
  run(lz, &b, rope, &r);
  CHECK(r.map_rc != 0 || r.ins_rc != 0 || r.sync_rc != 0,
        "stale: a batch with position -1 was accepted (map %d insert %d sync %d)", r.map_rc,
        r.ins_rc, r.sync_rc);
  printf("stale: the bad batch: map %d, insert %d, sync %d\n", r.map_rc, r.ins_rc, r.sync_rc);
  result_free(&r);
  check_valid(lz, cpu, rope, 4, "stale: the valid batch after it");

  /* oom: the first host allocation from here on is the RoPE row buffers growing past 256 rows. */
  one_seq(&b, MAXT, 0);
  host_alloc_fail_in = 1;
  run(lz, &b, rope, &r);
  CHECK(host_alloc_fail_in == 0, "oom: no host allocation was made");
  CHECK(r.map_rc == 0 && r.ins_rc == DSV4_ENOMEM,
        "oom: map %d insert %d, expected 0 and DSV4_ENOMEM (%d)", r.map_rc, r.ins_rc, DSV4_ENOMEM);
  result_free(&r);
  host_alloc_fail_in = 0;
  check_valid(lz, cpu, rope, MAXT, "oom: the same size of batch after it");

  check_attn_missing(lz, rope);
  check_compress_oom(lz, cpu, rope);

  dsv4_backend_close(lz);
  dsv4_backend_close(cpu);
  dsv4_rope_table_destroy(rope);
  if (failures) {
    printf("%d checks failed\n", failures);
    return 1;
  }
  printf("PASS: a failed batch leaves no error word behind; out of memory refuses one batch (and "
         "one compress); a missing block refuses attention without writing\n");
  return 0;
}
