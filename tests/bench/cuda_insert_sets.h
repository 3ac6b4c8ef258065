#ifndef DSV4_TESTS_BENCH_CUDA_INSERT_SETS_H
#define DSV4_TESTS_BENCH_CUDA_INSERT_SETS_H

/*
 * The CUDA forward step's GPU time (slot-map producer + insert consumer, PDL) from CUDA-graph
 * replays, shared by cuda_insert_bench (its table) and shm_bench (the device time of its batch).
 * A batch of n tokens in min(n, 64) segments, block size 64, over rotating input sets whose total
 * is at least twice the L2, so that no forward finds its inputs in the cache. Include after
 * tests/gpu/gpu_common.h and cuda_bench_common.h.
 *
 * The environment tunes it for diagnosis: DSV4_BENCH_SETS=k forces k input sets (1 leaves
 * everything in the L2); DSV4_BENCH_NO_TABLE_LENGTH=1 keeps the producer from staging the block
 * table in shared memory; DSV4_BENCH_UPLOAD=1 puts a copy of each forward's metadata from pinned
 * host memory in front of its producer, as the daemon runs a forward.
 */

#define INSERT_MAX_POS 65536
#define INSERT_BS 64

typedef struct {
  gpu_plan_dev_t d;
  uint16_t *q, *kv, *q_out;
  int64_t *slots;
  uint8_t *cache;
  dsv4_map_args_t ma;
  dsv4_insert_args_t ia;
  void *pin_meta; /* DSV4_BENCH_UPLOAD: the packed metadata in pinned host memory */
} insert_set_t;

typedef struct {
  uint32_t heads, n;
  double bytes; /* the minimal bytes of one forward */
  uint32_t sets, per_graph;
  int upload;
  gpu_plan_t p;
  insert_set_t *st;
  uint16_t *hq, *hkv;
} insert_sets_t;

static void insert_sets_make(insert_sets_t *x, uint32_t heads, uint32_t n, float *mirror,
                             dsv4_rope_table_t *rope) {
  memset(x, 0, sizeof(*x));
  x->heads = heads;
  x->n = n;
  uint64_t rng = 0x3C6EF372FE94F82Bull ^ ((uint64_t)n << 8) ^ heads;
  x->bytes =
      (double)n * ((double)heads * DSV4_HEAD_DIM * 4 + DSV4_HEAD_DIM * 2 + DSV4_RECORD_BYTES + 16);
  /* Input sets: together at least twice the 60 MB of L2 (counting the minimal bytes), at least 2.
   */
  uint32_t sets = (uint32_t)(120e6 / x->bytes) + 1;
  sets = sets < 2 ? 2 : sets;
  const char *force = getenv("DSV4_BENCH_SETS");
  if (force && strtoul(force, NULL, 10) > 0)
    sets = (uint32_t)strtoul(force, NULL, 10);
  x->sets = sets;
  /* Forwards per graph: every set at least once and at least 64 in all. */
  x->per_graph = sets * ((64 + sets - 1) / sets);
  x->st = calloc(sets, sizeof(*x->st));
  gpu_plan_t *p = &x->p;
  gpu_plan_make(&rng, p, n, n < 64 ? n : 64, INSERT_BS, INSERT_MAX_POS, 0);
  gpu_rope_upload(rope, mirror, INSERT_MAX_POS, p->pos, n);
  size_t q_bytes = (size_t)n * heads * DSV4_HEAD_DIM * 2;
  uint64_t stride = DSV4_BLOCK_STRIDE(INSERT_BS);
  x->hq = gpu_host_alloc(q_bytes);
  x->hkv = gpu_host_alloc((size_t)n * 1024);
  gpu_fill_bf16(&rng, x->hq, q_bytes / 2, 127, 6);
  gpu_fill_bf16(&rng, x->hkv, (size_t)n * DSV4_HEAD_DIM, 127, 6);
  for (uint32_t i = 0; i < sets; i++) {
    insert_set_t *e = &x->st[i];
    gpu_plan_upload_packed(p, &e->d); /* one allocation per set, as the daemon stages it */
    e->q = gpu_dev_alloc(q_bytes);
    e->q_out = gpu_dev_alloc(q_bytes);
    e->kv = gpu_dev_alloc((size_t)n * 1024);
    e->slots = gpu_dev_alloc(sizeof(int64_t) * n);
    e->cache = gpu_dev_alloc((size_t)p->n_blocks * stride);
    CK(cudaMemcpy(e->q, x->hq, q_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(e->kv, x->hkv, (size_t)n * 1024, cudaMemcpyHostToDevice));
    CK(cudaMemset(e->cache, 0, (size_t)p->n_blocks * stride));
    e->ma = gpu_plan_map_args(p, e->d.pos, e->d.tok_seg, e->d.seg_first_lb, e->d.seg_bt_off,
                              e->d.seg_bt_len, e->d.block_table, e->slots);
    if (getenv("DSV4_BENCH_NO_TABLE_LENGTH"))
      e->ma.bt_entries = 0; /* the producer reads the block table from global memory */
    dsv4_insert_args_t ia = {.n_tokens = n,
                             .heads = heads,
                             .q = e->q,
                             .kv = e->kv,
                             .positions = e->d.pos,
                             .slots = e->slots,
                             .eps = 1e-6f,
                             .write_kv = 1,
                             .q_out = e->q_out,
                             .cache = e->cache,
                             .block_size = INSERT_BS,
                             .n_blocks = p->n_blocks,
                             .stride = stride};
    e->ia = ia;
  }
  x->upload = getenv("DSV4_BENCH_UPLOAD") != NULL;
  for (uint32_t i = 0; x->upload && i < sets; i++) {
    CK(cudaMallocHost(&x->st[i].pin_meta, x->st[i].d.arena_bytes));
    CK(cudaMemcpy(x->st[i].pin_meta, x->st[i].d.arena, x->st[i].d.arena_bytes,
                  cudaMemcpyDeviceToHost));
  }
  CK(cudaDeviceSynchronize());
}

/*
 * GPU time per forward in microseconds. mode 0: a forward (producer + consumer, PDL); 1: the
 * producer alone; 2: the consumer alone; 3: a forward launched in plain stream order.
 */
static double insert_sets_us(insert_sets_t *x, int mode, float *mirror, cudaStream_t s) {
  int pdl = mode != 3;
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (uint32_t k = 0; k < x->per_graph; k++) {
    insert_set_t *e = &x->st[k % x->sets];
    if (x->upload && mode != 2)
      CK(cudaMemcpyAsync(e->d.arena, e->pin_meta, e->d.arena_bytes, cudaMemcpyHostToDevice, s));
    if (mode != 2)
      CKD(dsv4__cuda_map_slots(&e->ma, s, pdl));
    if (mode != 1)
      CKD(dsv4__cuda_qkv_insert(&e->ia, mirror, INSERT_MAX_POS, s, pdl));
  }
  CK(cudaStreamEndCapture(s, &g));
  return replay_us(s, g, x->per_graph);
}

static void insert_sets_free(insert_sets_t *x) {
  for (uint32_t i = 0; i < x->sets; i++) {
    insert_set_t *e = &x->st[i];
    gpu_plan_dev_free(&e->d);
    if (e->pin_meta)
      cudaFreeHost(e->pin_meta);
    cudaFree(e->q);
    cudaFree(e->q_out);
    cudaFree(e->kv);
    cudaFree(e->slots);
    cudaFree(e->cache);
  }
  free(x->st);
  free(x->hq);
  free(x->hkv);
  gpu_plan_free(&x->p);
}

#endif /* DSV4_TESTS_BENCH_CUDA_INSERT_SETS_H */
