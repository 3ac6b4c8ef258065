/*
 * SPEC §2 and §5.4 on the GPU: the CUDA kernels give the CPU reference's bytes. Each case makes a
 * random batch (H 8, 64 and 128; N from 1 to 16384; segments over scattered blocks with slot -1
 * rows; plain and YaRN tables; positions up to 1,048,575; prenormed and fused kv_norm; replays
 * that write no cache; block sizes 16, 64 and 256), runs it through the CPU backend (opened by name
 * through dsv4_backend_open) and through the CUDA producer and consumer launched back to back on
 * one stream, and compares the slots, q_out and every byte of the cache, which starts as the same
 * random bytes on both sides. One case is then run 20 more times on the GPU, each run compared
 * with the first; the SPEC §2 subnormal test vector is checked on its own.
 *
 * Usage: gpu_identity_test [quick]   (quick: the small cases only, for compute-sanitizer)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_common.h"

#define MAX_POS DSV4_MAX_POSITION_DEFAULT

typedef struct {
  uint32_t heads, n, segs, bs;
  int yarn, fused, write_kv, pdl;
  int centre, spread;
  int bt_unknown; /* the producer is not told the block table's length (bt_entries = 0) */
} case_t;

typedef struct {
  dsv4_backend_t *cpu;
  dsv4_rope_table_t *rope[2]; /* plain, YaRN */
  float *mirror[2];
  cudaStream_t stream;
  uint64_t rng;
  int failures;
} ctx_t;

typedef struct {
  uint8_t *cache;  /* GPU result */
  uint16_t *q_out; /* GPU result */
  int64_t *slots;  /* GPU result */
} gpu_result_t;

/* Run the plan on the GPU from cache0; results into r (host). */
static void run_gpu(ctx_t *c, const case_t *k, const gpu_plan_t *p, const uint16_t *q,
                    const uint16_t *kv, const float *w, const uint8_t *cache0, size_t cache_bytes,
                    gpu_result_t *r) {
  size_t q_bytes = (size_t)p->n * k->heads * DSV4_HEAD_DIM * 2;
  gpu_plan_dev_t d;
  gpu_plan_upload(p, &d);
  uint16_t *dq = gpu_dev_alloc(q_bytes), *dq_out = gpu_dev_alloc(q_bytes);
  uint16_t *dkv = gpu_dev_alloc((size_t)p->n * DSV4_HEAD_DIM * 2);
  int64_t *dslots = gpu_dev_alloc(sizeof(int64_t) * p->n);
  uint8_t *dcache = gpu_dev_alloc(cache_bytes);
  float *dw = NULL;
  CK(cudaMemcpy(dq, q, q_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dkv, kv, (size_t)p->n * DSV4_HEAD_DIM * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcache, cache0, cache_bytes, cudaMemcpyHostToDevice));
  /* Bytes the kernels must overwrite start as a pattern that no valid output equals everywhere. */
  CK(cudaMemset(dq_out, 0xA5, q_bytes));
  CK(cudaMemset(dslots, 0x5A, sizeof(int64_t) * p->n));
  if (w) {
    dw = gpu_dev_alloc(DSV4_HEAD_DIM * sizeof(float));
    CK(cudaMemcpy(dw, w, DSV4_HEAD_DIM * sizeof(float), cudaMemcpyHostToDevice));
  }
  /* The copies and memsets above run on the legacy stream, which the non-blocking stream of the
   * launches does not wait for. */
  CK(cudaDeviceSynchronize());
  dsv4_map_args_t ma = gpu_plan_map_args(p, d.pos, d.tok_seg, d.seg_first_lb, d.seg_bt_off,
                                         d.seg_bt_len, d.block_table, dslots);
  if (k->bt_unknown)
    ma.bt_entries = 0;
  dsv4_insert_args_t ia = {
      .n_tokens = p->n,
      .heads = k->heads,
      .q = dq,
      .kv = dkv,
      .positions = d.pos,
      .slots = dslots,
      .kv_norm_weight = dw,
      .eps = 1e-6f,
      .write_kv = k->write_kv,
      .q_out = dq_out,
      .cache = dcache,
      .block_size = p->bs,
      .n_blocks = p->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(p->bs),
  };
  CKD(dsv4__cuda_map_slots(&ma, c->stream, k->pdl));
  CKD(dsv4__cuda_qkv_insert(&ia, c->mirror[k->yarn], MAX_POS, c->stream, k->pdl));
  CK(cudaStreamSynchronize(c->stream));
  CK(cudaGetLastError());
  CK(cudaMemcpy(r->q_out, dq_out, q_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r->cache, dcache, cache_bytes, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r->slots, dslots, sizeof(int64_t) * p->n, cudaMemcpyDeviceToHost));
  cudaFree(dq);
  cudaFree(dq_out);
  cudaFree(dkv);
  cudaFree(dslots);
  cudaFree(dcache);
  cudaFree(dw);
  gpu_plan_dev_free(&d);
}

/* Names the first difference of q_out or the cache. Returns 1 when they differ. */
static int report(const case_t *k, const char *what, const gpu_plan_t *p, const gpu_result_t *a,
                  const gpu_result_t *b, size_t cache_bytes) {
  size_t q_bytes = (size_t)p->n * k->heads * DSV4_HEAD_DIM * 2;
  int bad = 0;
  for (uint32_t t = 0; t < p->n; t++)
    if (a->slots[t] != b->slots[t]) {
      fprintf(stderr, "FAIL %s: token %u slot %lld, expected %lld\n", what, t,
              (long long)a->slots[t], (long long)b->slots[t]);
      bad = 1;
      break;
    }
  long long i = gpu_first_diff(a->q_out, b->q_out, q_bytes);
  if (i >= 0) {
    size_t el = (size_t)i / 2;
    fprintf(stderr,
            "FAIL %s: q_out differs first at token %zu head %zu dim %zu: %04x, expected %04x\n",
            what, el / DSV4_HEAD_DIM / k->heads, el / DSV4_HEAD_DIM % k->heads, el % DSV4_HEAD_DIM,
            a->q_out[el], b->q_out[el]);
    bad = 1;
  }
  i = gpu_first_diff(a->cache, b->cache, cache_bytes);
  if (i >= 0) {
    uint64_t stride = DSV4_BLOCK_STRIDE(p->bs);
    uint64_t off = (uint64_t)i % stride;
    fprintf(stderr,
            "FAIL %s: cache differs first at block %llu byte %llu (%s): %02x, expected %02x\n",
            what, (unsigned long long)((uint64_t)i / stride), (unsigned long long)off,
            off < (uint64_t)DSV4_TOKEN_DATA_BYTES * p->bs ? "token data" : "scales or padding",
            a->cache[i], b->cache[i]);
    bad = 1;
  }
  return bad;
}

static void run_case(ctx_t *c, const case_t *k, int repeats) {
  char name[160];
  snprintf(name, sizeof(name), "H=%u N=%u segs=%u bs=%u %s %s%s%s%s", k->heads, k->n, k->segs,
           k->bs, k->yarn ? "yarn" : "plain", k->fused ? "fused" : "prenormed",
           k->write_kv ? "" : " replay", k->pdl ? "" : " no-pdl",
           k->bt_unknown ? " table-length-unknown" : "");
  gpu_plan_t p;
  gpu_plan_make(&c->rng, &p, k->n, k->segs, k->bs, MAX_POS, 6);
  size_t q_elems = (size_t)p.n * k->heads * DSV4_HEAD_DIM;
  size_t cache_bytes = (size_t)p.n_blocks * DSV4_BLOCK_STRIDE(p.bs);
  uint16_t *q = gpu_host_alloc(q_elems * 2), *kv = gpu_host_alloc((size_t)p.n * DSV4_HEAD_DIM * 2);
  gpu_fill_bf16(&c->rng, q, q_elems, k->centre, k->spread);
  gpu_fill_bf16(&c->rng, kv, (size_t)p.n * DSV4_HEAD_DIM, k->centre, k->spread);
  float w[DSV4_HEAD_DIM];
  for (int d = 0; d < DSV4_HEAD_DIM; d++)
    w[d] = 0.5f + (float)gpu_below(&c->rng, 1u << 20) * 0x1p-20f;
  uint8_t *cache0 = gpu_host_alloc(cache_bytes);
  for (size_t i = 0; i < cache_bytes; i += 8) {
    uint64_t r = gpu_rnd(&c->rng);
    memcpy(cache0 + i, &r, cache_bytes - i < 8 ? cache_bytes - i : 8);
  }
  gpu_rope_upload(c->rope[k->yarn], c->mirror[k->yarn], MAX_POS, p.pos, p.n);

  /* The reference: the CPU backend on the same inputs. */
  gpu_result_t ref = {gpu_host_alloc(cache_bytes), gpu_host_alloc(q_elems * 2),
                      gpu_host_alloc(sizeof(int64_t) * p.n)};
  memcpy(ref.cache, cache0, cache_bytes);
  dsv4_map_args_t ma = gpu_plan_map_args(&p, p.pos, p.tok_seg, p.seg_first_lb, p.seg_bt_off,
                                         p.seg_bt_len, p.block_table, ref.slots);
  dsv4_insert_args_t ia = {
      .n_tokens = p.n,
      .heads = k->heads,
      .q = q,
      .kv = kv,
      .positions = p.pos,
      .slots = ref.slots,
      .rope = c->rope[k->yarn],
      .kv_norm_weight = k->fused ? w : NULL,
      .eps = 1e-6f,
      .write_kv = k->write_kv,
      .q_out = ref.q_out,
      .cache = ref.cache,
      .block_size = p.bs,
      .n_blocks = p.n_blocks,
      .stride = DSV4_BLOCK_STRIDE(p.bs),
  };
  CKD(c->cpu->ops->map_slots(c->cpu, &ma));
  CKD(c->cpu->ops->qkv_insert(c->cpu, &ia));
  CKD(c->cpu->ops->sync(c->cpu));

  gpu_result_t first = {gpu_host_alloc(cache_bytes), gpu_host_alloc(q_elems * 2),
                        gpu_host_alloc(sizeof(int64_t) * p.n)};
  run_gpu(c, k, &p, q, kv, k->fused ? w : NULL, cache0, cache_bytes, &first);
  int bad = report(k, name, &p, &first, &ref, cache_bytes);
  size_t written = 0;
  for (uint32_t t = 0; t < p.n; t++)
    written += ref.slots[t] >= 0;
  if (!bad && repeats) {
    gpu_result_t again = {gpu_host_alloc(cache_bytes), gpu_host_alloc(q_elems * 2),
                          gpu_host_alloc(sizeof(int64_t) * p.n)};
    for (int rep = 0; rep < repeats && !bad; rep++) {
      run_gpu(c, k, &p, q, kv, k->fused ? w : NULL, cache0, cache_bytes, &again);
      char what[200];
      snprintf(what, sizeof(what), "%s, repeated run %d vs the first", name, rep + 1);
      bad = report(k, what, &p, &again, &first, cache_bytes);
    }
    free(again.cache);
    free(again.q_out);
    free(again.slots);
  }
  printf("%s %s: %zu of %u tokens with a slot, a table of %u entries%s\n", bad ? "FAIL" : "ok  ",
         name, written, p.n, p.bt_len, repeats && !bad ? ", 20 more runs identical" : "");
  c->failures += bad;
  free(first.cache);
  free(first.q_out);
  free(first.slots);
  free(ref.cache);
  free(ref.q_out);
  free(ref.slots);
  free(q);
  free(kv);
  free(cache0);
  gpu_plan_free(&p);
}

/* SPEC §2: one head (0x0001, 0x8001, 0x0080, 0, ...) at position 5 of a plain layer. */
static void subnormal_vector(ctx_t *c) {
  uint16_t q[DSV4_HEAD_DIM] = {0x0001, 0x8001, 0x0080}, out[DSV4_HEAD_DIM];
  int64_t pos = 5, slot = -1;
  gpu_rope_upload(c->rope[0], c->mirror[0], MAX_POS, &pos, 1);
  uint16_t *dq = gpu_dev_alloc(sizeof(q)), *dout = gpu_dev_alloc(sizeof(q));
  uint16_t *dkv = gpu_dev_alloc(sizeof(q));
  int64_t *dpos = gpu_dev_alloc(8), *dslot = gpu_dev_alloc(8);
  CK(cudaMemcpy(dq, q, sizeof(q), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dkv, q, sizeof(q), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dpos, &pos, 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dslot, &slot, 8, cudaMemcpyHostToDevice));
  dsv4_insert_args_t ia = {.n_tokens = 1,
                           .heads = 1,
                           .q = dq,
                           .kv = dkv,
                           .positions = dpos,
                           .slots = dslot,
                           .eps = 1e-6f,
                           .q_out = dout};
  CK(cudaDeviceSynchronize());
  CKD(dsv4__cuda_qkv_insert(&ia, c->mirror[0], MAX_POS, c->stream, 1));
  CK(cudaStreamSynchronize(c->stream));
  CK(cudaMemcpy(out, dout, sizeof(out), cudaMemcpyDeviceToHost));
  int bad = out[0] != 0x01FA || out[1] != 0x81FA || out[2] != 0x057A;
  printf("%s subnormal test vector: q_out[0..2] = %04x %04x %04x (expected 01fa 81fa 057a)\n",
         bad ? "FAIL" : "ok  ", out[0], out[1], out[2]);
  c->failures += bad;
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dkv);
  cudaFree(dpos);
  cudaFree(dslot);
}

int main(int argc, char **argv) {
  int quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  if (!gpu_available("gpu_identity_test"))
    return GPU_SKIP;
  ctx_t c = {.rng = 0x243F6A8885A308D3ull};
  char why[256];
  dsv4_backend_options_t opt = {.threads = 0};
  CKD(dsv4_backend_open("cpu", &opt, &c.cpu, why, sizeof(why)));
  c.rope[0] = gpu_rope_open(&dsv4_rope_plain_default, MAX_POS, &c.mirror[0]);
  c.rope[1] = gpu_rope_open(&dsv4_rope_yarn_default, MAX_POS, &c.mirror[1]);
  CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));

  subnormal_vector(&c);
  /* heads, n, segs, bs, yarn, fused, write_kv, pdl, centre, spread, bt_unknown. The producer
   * stages the block table in shared memory when it is told its length and it has at most 1024
   * entries (all but the cases with bt_unknown and the 16384-token, 40-segment one), and each
   * segment's entry up to 256 segments (all but the 300-segment case). */
  static const case_t small[] = {
      {8, 1, 1, 64, 0, 0, 1, 1, 127, 6, 0},   {8, 7, 3, 16, 1, 1, 1, 1, 127, 10, 0},
      {64, 1, 1, 64, 1, 0, 1, 1, 127, 6, 0},  {64, 5, 2, 256, 0, 1, 1, 0, 120, 20, 0},
      {128, 3, 3, 64, 1, 1, 1, 1, 127, 4, 0}, {64, 16, 4, 64, 0, 0, 0, 1, 127, 6, 0},
      {8, 40, 5, 16, 0, 0, 1, 1, 3, 3, 0},    {16, 33, 3, 64, 1, 1, 1, 1, 175, 8, 0},
      {64, 20, 4, 16, 0, 0, 1, 1, 127, 6, 1},
  };
  static const case_t large[] = {
      {8, 300, 7, 64, 1, 1, 1, 1, 127, 12, 0},
      {64, 64, 8, 64, 0, 0, 1, 1, 127, 6, 0},
      {64, 1000, 16, 64, 1, 1, 1, 1, 110, 30, 0},
      {128, 257, 9, 256, 0, 1, 1, 1, 127, 6, 0},
      {64, 4096, 64, 64, 0, 0, 1, 1, 127, 6, 0},
      {128, 2048, 32, 16, 1, 0, 1, 1, 127, 8, 0},
      {8, 16384, 128, 64, 1, 1, 1, 1, 127, 6, 0},
      {8, 16384, 1, 256, 0, 0, 1, 1, 127, 6, 0},
      {64, 16384, 200, 64, 1, 0, 1, 1, 127, 6, 0},
      {128, 4096, 16, 64, 1, 1, 0, 1, 127, 6, 0},
      /* A table of more than 1024 entries; more than 256 segments (a staged table of about 470
       * entries); a table whose length is not given. */
      {8, 16384, 40, 16, 0, 1, 1, 1, 127, 6, 0},
      {8, 3000, 300, 16, 1, 0, 1, 1, 127, 6, 0},
      {8, 4096, 16, 16, 0, 0, 1, 1, 127, 6, 1},
  };
  for (size_t i = 0; i < sizeof(small) / sizeof(small[0]); i++)
    run_case(&c, &small[i], 0);
  if (!quick) {
    for (size_t i = 0; i < sizeof(large) / sizeof(large[0]); i++)
      run_case(&c, &large[i], 0);
    /* SPEC §5.4: the same batch 20 more times. */
    static const case_t rep = {64, 4096, 64, 64, 1, 1, 1, 1, 127, 6, 0};
    run_case(&c, &rep, 20);
  } else {
    static const case_t rep = {64, 64, 4, 64, 1, 1, 1, 1, 127, 6, 0};
    run_case(&c, &rep, 20);
  }
  cudaStreamDestroy(c.stream);
  cudaFree(c.mirror[0]);
  cudaFree(c.mirror[1]);
  dsv4_rope_table_destroy(c.rope[0]);
  dsv4_rope_table_destroy(c.rope[1]);
  dsv4_backend_close(c.cpu);
  if (c.failures) {
    printf("gpu_identity_test: %d case(s) FAILED\n", c.failures);
    return 1;
  }
  printf("gpu_identity_test: all cases byte-identical to the CPU backend\n");
  return 0;
}
