/*
 * The Level Zero glue (kernels/level_zero/lz_backend.c) over the test double (fake_ze.c), on the
 * paths a daemon takes after a batch goes wrong, each checked against the CPU backend:
 *   - stale:  a batch that fails before its sync (a position of -1: the insert refuses it) must not
 *             leave its error word for the next batch, which must succeed with the CPU's bytes;
 *   - oom:    the host running out of memory while the RoPE row buffers grow refuses that batch
 *             with DSV4_ENOMEM and leaves the backend usable (zeMemAllocHost fails once, injected
 *             with the linker's --wrap).
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

  dsv4_backend_close(lz);
  dsv4_backend_close(cpu);
  dsv4_rope_table_destroy(rope);
  if (failures) {
    printf("%d checks failed\n", failures);
    return 1;
  }
  printf("PASS: a failed batch leaves no error word behind; out of memory refuses one batch\n");
  return 0;
}
