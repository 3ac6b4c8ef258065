#ifndef DSV4_TESTS_BENCH_BENCH_FORWARD_H
#define DSV4_TESTS_BENCH_BENCH_FORWARD_H

/*
 * What the forward-path benchmarks (http_bench, shm_bench) share: the decode batches' tensor bytes,
 * the HTTP request that carries one batch, and the CPU op alone (the CPU backend's map_slots +
 * qkv_insert called in-process on the same batch), the ceiling for the work.
 *
 * A batch is the decode shape: N sequences of one token each, H heads, every sequence at the same
 * position, which advances every step. Link dsv4_kernels.
 */

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsv4-layout.h"
#include "rope.h"

#define BENCH_BLOCK_SIZE 64

static uint64_t bench_rng_state = 0x9E3779B97F4A7C15ull;

static inline uint32_t bench_rng_next(void) {
  /* xorshift64*: fast and good enough for test values. */
  bench_rng_state ^= bench_rng_state >> 12;
  bench_rng_state ^= bench_rng_state << 25;
  bench_rng_state ^= bench_rng_state >> 27;
  return (uint32_t)((bench_rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

/* A bf16 of magnitude in [2^-8, 2) with a random sign: well inside the daemon's range check. */
static inline uint16_t bench_rand_bf16(void) {
  uint32_t r = bench_rng_next();
  uint32_t exp = 119u + (r % 8u); /* 2^-8 .. 2^0 */
  uint32_t mant = (r >> 8) & 0x7Fu;
  uint32_t sign = (r >> 16) & 1u;
  return (uint16_t)((sign << 15) | (exp << 7) | mant);
}

/* Fill q [n, heads, 512] then kv [n, 512], both bf16, as a body lays them out. */
static inline void bench_fill_tensors(uint8_t *dst, uint32_t n, uint32_t heads) {
  size_t elems = (size_t)n * heads * DSV4_HEAD_DIM + (size_t)n * DSV4_HEAD_DIM;
  uint16_t *v = (uint16_t *)(void *)dst;
  for (size_t i = 0; i < elems; i++)
    v[i] = bench_rand_bf16(); /* little-endian hosts only, like the daemon */
}

/* The tensor bytes of one batch in a fresh buffer (NULL when out of memory). */
static inline uint8_t *bench_make_tensors(uint32_t n, uint32_t heads, size_t *len) {
  *len = ((size_t)n * heads * DSV4_HEAD_DIM + (size_t)n * DSV4_HEAD_DIM) * 2;
  uint8_t *v = malloc(*len);
  if (v)
    bench_fill_tensors(v, n, heads);
  return v;
}

/*
 * The head of POST /v1/forward for one batch, in front of its tensor bytes: the HTTP head, the
 * 8-byte length and the safetensors header, contiguous at buf. Sequence i is named seq_prefix
 * followed by "s" and i; meta_extra (or NULL) is appended to the __metadata__ object as it is,
 * for instance ,"outputs":"attn". Returns the head's length, or 0 when buf is too small (at least
 * 1024 + 96 N bytes are enough).
 */
static inline size_t bench_forward_head(char *buf, size_t cap, const char *seq_prefix, uint32_t n,
                                        uint32_t heads, int layer, int64_t pos, int is_new,
                                        size_t tensors_len, size_t resp_bytes,
                                        const char *meta_extra) {
  size_t qbytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
  if (cap < 1024)
    return 0;
  /* The safetensors header goes after the HTTP head and the 8-byte length; write it first. */
  char *json = buf + 512 + 8;
  size_t room = cap - 512 - 8;
  size_t j = 0;
  j += (size_t)snprintf(json + j, room - j, "{\"__metadata__\":{\"layer\":\"%d\",\"segments\":\"[",
                        layer);
  for (uint32_t i = 0; i < n && j < room; i++)
    j += (size_t)snprintf(json + j, room - j,
                          "%s{\\\"seq\\\":\\\"%ss%u\\\",\\\"start\\\":%" PRId64 ",\\\"len\\\":1%s}",
                          i ? "," : "", seq_prefix, i, pos, is_new ? ",\\\"new\\\":true" : "");
  if (j < room)
    j += (size_t)snprintf(
        json + j, room - j,
        "]\"%s},\"q\":{\"dtype\":\"BF16\",\"shape\":[%u,%u,512],\"data_offsets\":[0,"
        "%zu]},\"kv\":{\"dtype\":\"BF16\",\"shape\":[%u,512],\"data_offsets\":[%zu,"
        "%zu]}}",
        meta_extra ? meta_extra : "", n, heads, qbytes, n, qbytes, tensors_len);
  if (j + 8 >= room)
    return 0;
  while (j % 8)
    json[j++] = ' ';
  uint64_t hl = j;
  size_t body = 8 + j + tensors_len;

  char http[512];
  int h = snprintf(http, sizeof(http),
                   "POST /v1/forward HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   "Content-Type: application/octet-stream\r\nContent-Length: %zu\r\n"
                   "Bench-Response-Bytes: %zu\r\n\r\n",
                   body, resp_bytes);
  /* Slide the HTTP head against the length prefix so the request is one contiguous buffer. */
  char *start = buf + 512 - h;
  memcpy(start, http, (size_t)h);
  for (int b = 0; b < 8; b++)
    buf[512 + b] = (char)((hl >> (8 * b)) & 0xFF);
  memmove(buf, start, (size_t)h + 8 + j);
  return (size_t)h + 8 + j;
}

/*
 * The CPU op alone: map_slots + qkv_insert (and, when opened with attention, the exact attention
 * over each token's window with a sink per head) through the CPU backend on the batches the daemon
 * gets, every sequence cycling through three blocks of its own as its position advances: a
 * window of 128 positions spans at most three 64-token blocks, so the block table lists the
 * sequence's last three logical blocks. Rope rows are ensured inside each step, as the daemon's
 * executor does for each batch.
 */
typedef struct {
  dsv4_backend_t *be;
  dsv4_rope_table_t *rope;
  dsv4_devbuf_t cache;
  uint32_t n, heads, n_blocks;
  uint64_t stride;
  uint16_t *q_out;
  int64_t *pos, *slots, *first_lb;
  int32_t *tok_seg, *bt;
  uint32_t *bt_off, *bt_len;
  /* With attention: the sequences' first position, the output and the sinks. */
  int attn;
  int64_t p0;
  int64_t *seg_p0;
  uint16_t *out;
  float *sink;
} bench_cpu_op_t;

static inline void bench_cpu_op_close(bench_cpu_op_t *op) {
  free(op->q_out);
  free(op->pos);
  free(op->slots);
  free(op->tok_seg);
  free(op->first_lb);
  free(op->bt_off);
  free(op->bt_len);
  free(op->bt);
  free(op->seg_p0);
  free(op->out);
  free(op->sink);
  if (op->cache.ptr)
    op->be->ops->buf_free(op->be, &op->cache);
  dsv4_rope_table_destroy(op->rope);
  if (op->be)
    dsv4_backend_close(op->be);
  memset(op, 0, sizeof(*op));
}

/* 0, or -1 with the reason printed after prog. With attn, every token also attends over its
 * sequence's positions from p0 on (its first position in the daemon), sinks spread over [-2, 2]. */
static inline int bench_cpu_op_open(bench_cpu_op_t *op, uint32_t n, uint32_t heads,
                                    unsigned threads, const char *prog, int attn, int64_t p0) {
  memset(op, 0, sizeof(*op));
  op->n = n;
  op->heads = heads;
  op->attn = attn;
  op->p0 = p0;
  dsv4_backend_options_t bo = {.threads = threads};
  char why[256];
  if (dsv4_backend_open("cpu", &bo, &op->be, why, sizeof(why))) {
    fprintf(stderr, "%s: cpu backend: %s\n", prog, why);
    op->be = NULL;
    return -1;
  }
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, inv_freq);
  int rc = dsv4_rope_table_create(inv_freq, DSV4_MAX_POSITION_DEFAULT, &op->rope);
  op->n_blocks = 3 * n;
  op->stride = DSV4_BLOCK_STRIDE(BENCH_BLOCK_SIZE);
  if (rc == 0)
    rc = op->be->ops->buf_alloc(op->be, (size_t)op->n_blocks * op->stride, &op->cache);
  size_t qn = (size_t)n * heads * DSV4_HEAD_DIM;
  /* 64-byte aligned as the daemon's output buffers are, so the same store paths are taken. */
  op->q_out = aligned_alloc(64, (qn * 2 + 63) & ~(size_t)63);
  op->pos = malloc(n * sizeof(*op->pos));
  op->slots = malloc(n * sizeof(*op->slots));
  op->tok_seg = malloc(n * sizeof(*op->tok_seg));
  op->first_lb = malloc(n * sizeof(*op->first_lb));
  op->bt_off = malloc(n * sizeof(*op->bt_off));
  op->bt_len = malloc(n * sizeof(*op->bt_len));
  op->bt = malloc(3 * n * sizeof(*op->bt));
  if (attn) {
    op->seg_p0 = malloc(n * sizeof(*op->seg_p0));
    op->out = aligned_alloc(64, (qn * 2 + 63) & ~(size_t)63);
    op->sink = malloc(heads * sizeof(*op->sink));
    if (!op->seg_p0 || !op->out || !op->sink)
      rc = -1;
    for (uint32_t h = 0; rc == 0 && h < heads; h++)
      op->sink[h] = heads > 1 ? -2.0f + 4.0f * (float)h / (float)(heads - 1) : 0.0f;
  }
  if (rc || !op->q_out || !op->pos || !op->slots || !op->tok_seg || !op->first_lb || !op->bt_off ||
      !op->bt_len || !op->bt) {
    fprintf(stderr, "%s: cpu op setup failed\n", prog);
    bench_cpu_op_close(op);
    return -1;
  }
  return 0;
}

/* One batch at position p on tensors laid out as bench_fill_tensors writes them; 0 or an error. */
static inline int bench_cpu_op_step(bench_cpu_op_t *op, const uint8_t *tensors, int64_t p) {
  uint32_t n = op->n;
  size_t qn = (size_t)n * op->heads * DSV4_HEAD_DIM;
  const int64_t lb = p / BENCH_BLOCK_SIZE, lb0 = lb >= 2 ? lb - 2 : 0;
  for (uint32_t i = 0; i < n; i++) {
    op->pos[i] = p;
    op->tok_seg[i] = (int32_t)i;
    op->first_lb[i] = lb0;
    op->bt_off[i] = 3 * i;
    op->bt_len[i] = (uint32_t)(lb - lb0 + 1);
    for (int64_t b = lb0; b <= lb; b++)
      op->bt[3 * i + (uint32_t)(b - lb0)] = (int32_t)(3 * i + (uint32_t)(b % 3));
    if (op->attn)
      op->seg_p0[i] = op->p0;
  }
  dsv4_map_args_t ma = {.n_tokens = n,
                        .n_segments = n,
                        .block_size = BENCH_BLOCK_SIZE,
                        .n_blocks = op->n_blocks,
                        .positions = op->pos,
                        .tok_seg = op->tok_seg,
                        .seg_first_lb = op->first_lb,
                        .seg_bt_off = op->bt_off,
                        .seg_bt_len = op->bt_len,
                        .block_table = op->bt,
                        .slots = op->slots};
  dsv4_insert_args_t ia = {.n_tokens = n,
                           .heads = op->heads,
                           .q = (const uint16_t *)(const void *)tensors,
                           .kv = (const uint16_t *)(const void *)(tensors + qn * 2),
                           .positions = op->pos,
                           .slots = op->slots,
                           .rope = op->rope,
                           .kv_norm_weight = NULL,
                           .eps = 1e-6f,
                           .write_kv = 1,
                           .q_out = op->q_out,
                           .cache = op->cache.ptr,
                           .block_size = BENCH_BLOCK_SIZE,
                           .n_blocks = op->n_blocks,
                           .stride = op->stride};
  dsv4_attn_args_t aa = {.n_tokens = n,
                         .n_segments = n,
                         .heads = op->heads,
                         .q = op->q_out,
                         .positions = op->pos,
                         .tok_seg = op->tok_seg,
                         .seg_p0 = op->seg_p0,
                         .seg_first_lb = op->first_lb,
                         .seg_bt_off = op->bt_off,
                         .seg_bt_len = op->bt_len,
                         .block_table = op->bt,
                         .bt_entries = 3 * n,
                         .cache = op->cache.ptr,
                         .block_size = BENCH_BLOCK_SIZE,
                         .n_blocks = op->n_blocks,
                         .stride = op->stride,
                         .sink = op->sink,
                         .rope = op->rope,
                         .out = op->out};
  ma.bt_entries = 3 * n;
  int rc = dsv4_rope_table_ensure(op->rope, op->pos, n);
  if (rc == 0)
    rc = op->be->ops->map_slots(op->be, &ma);
  if (rc == 0)
    rc = op->be->ops->qkv_insert(op->be, &ia);
  if (rc == 0 && op->attn)
    rc = op->be->ops->attention(op->be, &aa);
  if (rc == 0)
    rc = op->be->ops->sync(op->be);
  return rc;
}

#endif /* DSV4_TESTS_BENCH_BENCH_FORWARD_H */
