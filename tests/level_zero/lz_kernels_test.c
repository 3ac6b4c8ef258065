/*
 * The Level Zero backend's kernels (kernels/level_zero/dsv4_kernels.cl) against the CPU reference
 * backend, byte for byte: executed for real on the CPU through OpenCL (PoCL), and on an Intel GPU
 * through the backend itself where one is present.
 *
 * The OpenCL modes build the same .cl source the daemon's SPIR-V is made from, with the same
 * options (-cl-fp32-correctly-rounded-divide-sqrt and the include directory), then for random
 * batches (several head counts, block sizes, plain and YaRN RoPE, prenormed and fused kv_norm, slot
 * -1 rows, replays, zeroed and random initial caches) run the producer (dsv4_map_slots) and then
 * the consumer (dsv4_qkv_insert) on one in-order queue with a barrier between them, and compare
 * slots, q_out and every cache byte with the CPU backend's map_slots + qkv_insert.
 *
 * Usage: lz_kernels_test <mode>
 *   identity          byte identity with the CPU backend, each batch 20 times (SPEC §2, §5.4),
 *                     and the error bits for arguments the CPU backend refuses
 *   identity-fp64     the same with the double-precision divide/sqrt (DSV4_CL_RMS_FP64)
 *   one-writer        a build where every global store counts its bytes (DSV4_CL_COUNT_STORES):
 *                     every output byte stored exactly once, every other byte never (SPEC §5.1)
 *   one-writer-broken the same with DSV4_CL_BROKEN_BULK_STORE; must fail with "invariant violated"
 *   identity-broken   the broken build without counters, through the identity check (to see
 *                     whether repeated runs alone would notice the race on this device)
 *   level-zero        the identity batches through the "level_zero" backend (upload, map_slots,
 *                     qkv_insert, sync, download) on a Level Zero GPU
 *   no-driver         where zeInit finds no driver: opening "level_zero" fails with DSV4_ENODEV and
 *                     "zeInit found no driver (ZE_RESULT_...)", and "auto" opens the CPU backend
 *                     naming that reason
 *   attention         exact-mode attention (SPEC §7): the attention kernels on the CPU backend's
 *                     q_out and cache, attn and lse byte-identical to the CPU backend's attention,
 *                     each batch twice
 *   attention-fp64    the same with the double-precision divide (DSV4_CL_RMS_FP64)
 *   attention-errors  a candidate's block missing from its table (and each other argument the CPU
 *                     backend refuses) sets an error bit and leaves attn and lse unwritten
 *   level-zero-attention  the attention batches through the "level_zero" backend (map_slots,
 *                     qkv_insert, attention, sync): attn, lse, q_out and the cache
 * Exit status: 0 pass, 1 fail, 77 skipped (no OpenCL platform or device, no fp64 for
 * identity-fp64, no Level Zero GPU for level-zero, a Level Zero driver present for no-driver, no
 * attention op in the CPU backend for the attention comparisons).
 */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/inv_common.h"
#include "backend.h"
#include "dsv4-numerics.h"
#include "level_zero/lz_kernels.h"
#include "level_zero/lz_probe.h"
#include "rope.h"
#ifdef DSV4_LZ_FAKE_ZE
#include <level_zero/ze_api.h>

#include "fake_ze.h"
#endif

#define RUNS 20
#define RANDOM_SHAPES 16

__attribute__((noreturn, format(printf, 1, 2))) static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("lz_kernels_test: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

static void check_cl(cl_int err, const char *what) {
  if (err != CL_SUCCESS)
    die("%s failed (OpenCL error %d)", what, (int)err);
}

/* ---- the OpenCL side ---- */

typedef struct {
  cl_device_id dev;
  cl_context ctx;
  cl_command_queue queue;
  cl_program prog;
  cl_kernel map, insert, probe, attn_check, attn;
  int counting;
} clrt_t;

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    die("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = inv_alloc((size_t)n + 1);
  if (n < 0 || fread(s, 1, (size_t)n, f) != (size_t)n)
    die("cannot read %s", path);
  s[n] = '\0';
  fclose(f);
  *len = (size_t)n;
  return s;
}

/* 0 on success, 77 when there is no OpenCL platform or device to run on. */
static int clrt_open(clrt_t *rt, const char *defines, int need_fp64) {
  cl_platform_id plats[8];
  cl_uint n_plats = 0;
  cl_int err = clGetPlatformIDs(8, plats, &n_plats);
  if (err != CL_SUCCESS || n_plats == 0) {
    printf("skipped: no OpenCL platform (clGetPlatformIDs: %d)\n", (int)err);
    return 77;
  }
  cl_uint n_dev = 0;
  for (cl_uint i = 0; i < n_plats && n_dev == 0; i++)
    if (clGetDeviceIDs(plats[i], CL_DEVICE_TYPE_ALL, 1, &rt->dev, &n_dev) != CL_SUCCESS)
      n_dev = 0;
  if (n_dev == 0) {
    printf("skipped: no OpenCL device\n");
    return 77;
  }
  char name[256] = "", version[256] = "";
  cl_device_fp_config fp = 0, fp64 = 0;
  check_cl(clGetDeviceInfo(rt->dev, CL_DEVICE_NAME, sizeof(name), name, NULL), "device name");
  check_cl(clGetDeviceInfo(rt->dev, CL_DEVICE_VERSION, sizeof(version), version, NULL), "version");
  check_cl(clGetDeviceInfo(rt->dev, CL_DEVICE_SINGLE_FP_CONFIG, sizeof(fp), &fp, NULL),
           "fp config");
  (void)clGetDeviceInfo(rt->dev, CL_DEVICE_DOUBLE_FP_CONFIG, sizeof(fp64), &fp64, NULL);
  printf("device: %s (%s); fp32 denormals %s, correctly rounded divide/sqrt %s, fp64 %s\n", name,
         version, fp & CL_FP_DENORM ? "yes" : "no",
         fp & CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT ? "yes" : "no", fp64 ? "yes" : "no");
  /* SPEC §2: subnormals are honoured; a device that flushes them cannot be byte-identical. */
  if (!(fp & CL_FP_DENORM))
    die("the OpenCL device does not support fp32 denormals (SPEC §2 needs them)");
  if (need_fp64 && !fp64) {
    printf("skipped: the OpenCL device has no fp64\n");
    return 77;
  }
  rt->ctx = clCreateContext(NULL, 1, &rt->dev, NULL, NULL, &err);
  check_cl(err, "clCreateContext");
  rt->queue = clCreateCommandQueue(rt->ctx, rt->dev, 0, &err); /* in-order */
  check_cl(err, "clCreateCommandQueue");

  size_t len;
  char *src = read_file(DSV4_LZ_CL_SOURCE, &len);
  const char *srcs[] = {src};
  rt->prog = clCreateProgramWithSource(rt->ctx, 1, srcs, &len, &err);
  check_cl(err, "clCreateProgramWithSource");
  char opts[1024];
  snprintf(opts, sizeof(opts), "-cl-std=CL1.2 -cl-fp32-correctly-rounded-divide-sqrt -I%s %s",
           DSV4_LZ_KERNELS_DIR, defines);
  err = clBuildProgram(rt->prog, 1, &rt->dev, opts, NULL, NULL);
  if (err != CL_SUCCESS) {
    size_t log_len = 0;
    clGetProgramBuildInfo(rt->prog, rt->dev, CL_PROGRAM_BUILD_LOG, 0, NULL, &log_len);
    char *log = inv_alloc(log_len + 1);
    clGetProgramBuildInfo(rt->prog, rt->dev, CL_PROGRAM_BUILD_LOG, log_len, log, NULL);
    log[log_len] = '\0';
    die("clBuildProgram (%s) failed (%d):\n%s", opts, (int)err, log);
  }
  printf("built %s with: %s\n", DSV4_LZ_CL_SOURCE, opts);
  free(src);
  rt->map = clCreateKernel(rt->prog, DSV4_LZ_MAP_KERNEL, &err);
  check_cl(err, "clCreateKernel map");
  rt->insert = clCreateKernel(rt->prog, DSV4_LZ_INSERT_KERNEL, &err);
  check_cl(err, "clCreateKernel insert");
  rt->probe = clCreateKernel(rt->prog, DSV4_LZ_PROBE_KERNEL, &err);
  check_cl(err, "clCreateKernel probe");
  rt->attn_check = clCreateKernel(rt->prog, DSV4_LZ_ATTN_CHECK_KERNEL, &err);
  check_cl(err, "clCreateKernel attention check");
  rt->attn = clCreateKernel(rt->prog, DSV4_LZ_ATTN_KERNEL, &err);
  check_cl(err, "clCreateKernel attention");
  rt->counting = strstr(defines, "DSV4_CL_COUNT_STORES") != NULL;
  return 0;
}

static void clrt_close(clrt_t *rt) {
  clReleaseKernel(rt->attn);
  clReleaseKernel(rt->attn_check);
  clReleaseKernel(rt->probe);
  clReleaseKernel(rt->insert);
  clReleaseKernel(rt->map);
  clReleaseProgram(rt->prog);
  clReleaseCommandQueue(rt->queue);
  clReleaseContext(rt->ctx);
}

static cl_mem buf_from(clrt_t *rt, const void *host, size_t n) {
  cl_int err;
  int copy = host && n;
  cl_mem m = clCreateBuffer(rt->ctx, CL_MEM_READ_WRITE | (copy ? CL_MEM_COPY_HOST_PTR : 0),
                            n ? n : 1, copy ? (void *)host : NULL, &err);
  check_cl(err, "clCreateBuffer");
  return m;
}

static cl_mem buf_zero(clrt_t *rt, size_t n) {
  void *z = calloc(1, n ? n : 1);
  if (!z)
    die("out of memory");
  cl_mem m = buf_from(rt, z, n ? n : 1);
  free(z);
  return m;
}

static void set_arg(cl_kernel k, cl_uint i, size_t size, const void *v) {
  char what[64];
  snprintf(what, sizeof(what), "clSetKernelArg %u", i);
  check_cl(clSetKernelArg(k, i, size, v), what);
}

/* SPEC §2 on the device (lz_probe.h): no contraction, no subnormal flush, correctly rounded
 * divide and sqrt in the RMS factor. */
static void check_fp_probe(clrt_t *rt) {
  float in[DSV4_LZ_PROBE_IN], out[DSV4_LZ_PROBE_OUT];
  dsv4__lz_probe_inputs(in);
  cl_mem bin = buf_from(rt, in, sizeof(in)), bout = buf_zero(rt, sizeof(out));
  set_arg(rt->probe, 0, sizeof(cl_mem), &bin);
  set_arg(rt->probe, 1, sizeof(cl_mem), &bout);
  size_t one = 1;
  check_cl(clEnqueueNDRangeKernel(rt->queue, rt->probe, 1, NULL, &one, &one, 0, NULL, NULL),
           "probe launch");
  check_cl(clEnqueueReadBuffer(rt->queue, bout, CL_TRUE, 0, sizeof(out), out, 0, NULL, NULL),
           "probe read");
  clReleaseMemObject(bin);
  clReleaseMemObject(bout);
  char why[192];
  if (dsv4__lz_probe_check(in, out, why, sizeof(why)) != 0)
    die("fp probe: %s", why);
  printf("fp probe: a*b+c = +0 (not contracted), 2^-70*2^-70 = 0x00000200 (subnormal kept), %d "
         "RMS factors correctly rounded\n",
         DSV4_LZ_PROBE_RMS);
}

/* ---- one batch ---- */

typedef struct {
  uint32_t heads, n_tokens, bs;
  int yarn, fused, replay, random_cache; /* replay: q_out only, the cache untouched */
  uint32_t neg_pct;                      /* block table entries that are -1 */
} shape_t;

typedef struct {
  shape_t s;
  uint32_t n_blocks, n_seg, n_bt;
  uint16_t *q, *kv;
  int64_t *pos, *seg_first_lb;
  int32_t *tok_seg, *bt;
  uint32_t *bt_off, *bt_len;
  float w[DSV4_HEAD_DIM];
  float *rope_rows; /* [N, 64] */
  uint8_t *cache0;
  size_t cache_bytes, q_bytes;
  uint32_t insert_blocks; /* n_blocks as qkv_insert is told (0: the same as map_slots) */
  uint32_t bt_entries;    /* the table length map_slots is told (make_batch: n_bt) */
} batch_t;

typedef struct {
  int64_t *slots;
  uint16_t *q_out;
  uint8_t *cache;
  uint32_t err;
  /* Store counters (counting builds): one per byte. */
  uint32_t *slot_count, *q_count, *cache_count;
} result_t;

/*
 * Segments of contiguous positions, each with a block table of distinct physical ids (no id is in
 * two tables, so slots are unique, SPEC §5.3). A table may start one logical block early or end
 * short, and some entries are -1, so some tokens get slot -1.
 */
static void make_batch(batch_t *b, const shape_t *s, dsv4_rope_table_t *rope) {
  memset(b, 0, sizeof(*b));
  b->s = *s;
  uint32_t n = s->n_tokens, bs = s->bs;
  b->n_seg = 1 + inv_below(n < 5 ? n : 5);
  b->tok_seg = inv_alloc(n * sizeof(int32_t));
  b->pos = inv_alloc(n * sizeof(int64_t));
  b->seg_first_lb = inv_alloc(b->n_seg * sizeof(int64_t));
  b->bt_off = inv_alloc(b->n_seg * sizeof(uint32_t));
  b->bt_len = inv_alloc(b->n_seg * sizeof(uint32_t));
  b->bt = inv_alloc(((size_t)n / bs + 3) * b->n_seg * sizeof(int32_t));
  b->n_blocks = (n / bs + 3) * b->n_seg + 4;
  uint32_t *perm = inv_alloc(b->n_blocks * sizeof(uint32_t));
  for (uint32_t i = 0; i < b->n_blocks; i++)
    perm[i] = i;
  for (uint32_t i = b->n_blocks - 1; i > 0; i--) {
    uint32_t j = inv_below(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  uint32_t t = 0, next_id = 0;
  for (uint32_t sg = 0; sg < b->n_seg; sg++) {
    uint32_t len = sg + 1 == b->n_seg ? n - t : 1 + inv_below(n - t - (b->n_seg - sg - 1));
    int64_t start = (int64_t)inv_below(DSV4_MAX_POSITION_DEFAULT - len);
    for (uint32_t k = 0; k < len; k++, t++) {
      b->tok_seg[t] = (int32_t)sg;
      b->pos[t] = start + k;
    }
    int64_t lb0 = start / bs, lb1 = (start + len - 1) / bs;
    b->seg_first_lb[sg] = lb0 + (inv_below(8) == 0 ? 1 : 0);
    uint32_t entries = (uint32_t)(lb1 - b->seg_first_lb[sg] + 1);
    if (entries > 1 && inv_below(8) == 0)
      entries--;
    b->bt_off[sg] = b->n_bt;
    b->bt_len[sg] = entries;
    for (uint32_t e = 0; e < entries; e++)
      b->bt[b->n_bt++] = inv_below(100) < s->neg_pct ? -1 : (int32_t)perm[next_id++];
  }
  b->bt_entries = b->n_bt;
  free(perm);

  b->q_bytes = (size_t)n * s->heads * DSV4_HEAD_DIM * 2;
  b->q = inv_alloc(b->q_bytes);
  b->kv = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2);
  inv_fill_bf16(b->q, b->q_bytes / 2);
  inv_fill_bf16(b->kv, (size_t)n * DSV4_HEAD_DIM);
  inv_fill_weight(b->w);
  b->cache_bytes = (size_t)b->n_blocks * DSV4_BLOCK_STRIDE(bs);
  b->cache0 = calloc(1, b->cache_bytes);
  if (!b->cache0)
    die("out of memory");
  if (s->random_cache)
    for (size_t i = 0; i < b->cache_bytes; i++)
      b->cache0[i] = (uint8_t)inv_rnd();
  if (dsv4_rope_table_ensure(rope, b->pos, n) != 0)
    die("rope rows");
  b->rope_rows = inv_alloc((size_t)n * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  for (uint32_t k = 0; k < n; k++)
    memcpy(b->rope_rows + (size_t)k * DSV4_ROPE_ROW_FLOATS, dsv4_rope_table_row(rope, b->pos[k]),
           DSV4_ROPE_ROW_FLOATS * sizeof(float));
}

static void free_batch(batch_t *b) {
  free(b->q);
  free(b->kv);
  free(b->pos);
  free(b->seg_first_lb);
  free(b->tok_seg);
  free(b->bt);
  free(b->bt_off);
  free(b->bt_len);
  free(b->rope_rows);
  free(b->cache0);
}

static void alloc_result(result_t *r, const batch_t *b, int counting) {
  memset(r, 0, sizeof(*r));
  r->slots = inv_alloc(b->s.n_tokens * sizeof(int64_t));
  r->q_out = inv_alloc(b->q_bytes);
  r->cache = inv_alloc(b->cache_bytes);
  if (counting) {
    r->slot_count = inv_alloc(b->s.n_tokens * sizeof(int64_t) * sizeof(uint32_t));
    r->q_count = inv_alloc(b->q_bytes * sizeof(uint32_t));
    r->cache_count = inv_alloc(b->cache_bytes * sizeof(uint32_t));
  }
}

static void free_result(result_t *r) {
  free(r->slots);
  free(r->q_out);
  free(r->cache);
  free(r->slot_count);
  free(r->q_count);
  free(r->cache_count);
}

/* The reference: the CPU backend's producer and consumer on host memory. */
static void run_cpu(dsv4_backend_t *be, const batch_t *b, dsv4_rope_table_t *rope, result_t *r) {
  const shape_t *s = &b->s;
  dsv4_map_args_t m = {
      .n_tokens = s->n_tokens,
      .n_segments = b->n_seg,
      .block_size = s->bs,
      .n_blocks = b->n_blocks,
      .positions = b->pos,
      .tok_seg = b->tok_seg,
      .seg_first_lb = b->seg_first_lb,
      .seg_bt_off = b->bt_off,
      .seg_bt_len = b->bt_len,
      .block_table = b->bt,
      .slots = r->slots,
      .bt_entries = b->bt_entries,
  };
  if (be->ops->map_slots(be, &m) != 0)
    die("cpu map_slots refused the batch");
  memcpy(r->cache, b->cache0, b->cache_bytes);
  dsv4_insert_args_t a = {
      .n_tokens = s->n_tokens,
      .heads = s->heads,
      .q = b->q,
      .kv = b->kv,
      .positions = b->pos,
      .slots = r->slots,
      .rope = rope,
      .kv_norm_weight = s->fused ? b->w : NULL,
      .eps = 1e-6f,
      .write_kv = !s->replay,
      .q_out = r->q_out,
      .cache = r->cache,
      .block_size = s->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(s->bs),
  };
  if (be->ops->qkv_insert(be, &a) != 0 || be->ops->sync(be) != 0)
    die("cpu qkv_insert refused the batch");
}

/*
 * The kernels: map_slots, a barrier, then qkv_insert in launches of at most max_rows rows (a
 * multiple of the rows per work-group), all on one in-order queue; the slots never leave the
 * device between producer and consumer.
 */
static void run_cl(clrt_t *rt, const batch_t *b, uint32_t max_rows, result_t *r) {
  const shape_t *s = &b->s;
  uint32_t n = s->n_tokens;
  cl_mem pos = buf_from(rt, b->pos, n * sizeof(int64_t));
  cl_mem tok_seg = buf_from(rt, b->tok_seg, n * sizeof(int32_t));
  cl_mem first_lb = buf_from(rt, b->seg_first_lb, b->n_seg * sizeof(int64_t));
  cl_mem bt_off = buf_from(rt, b->bt_off, b->n_seg * sizeof(uint32_t));
  cl_mem bt_len = buf_from(rt, b->bt_len, b->n_seg * sizeof(uint32_t));
  cl_mem bt = buf_from(rt, b->bt, b->n_bt * sizeof(int32_t));
  /* The slot buffer starts as garbage, as a reused device buffer would. */
  int64_t *junk = inv_alloc(n * sizeof(int64_t));
  for (uint32_t i = 0; i < n; i++)
    junk[i] = (int64_t)inv_rnd();
  cl_mem slots = buf_from(rt, junk, n * sizeof(int64_t));
  free(junk);
  cl_mem err = buf_zero(rt, sizeof(cl_uint));
  cl_mem q = buf_from(rt, b->q, b->q_bytes);
  cl_mem kv = buf_from(rt, b->kv, (size_t)n * DSV4_HEAD_DIM * 2);
  cl_mem rope = buf_from(rt, b->rope_rows, (size_t)n * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  cl_mem w = buf_from(rt, b->w, sizeof(b->w));
  cl_mem q_out = buf_zero(rt, b->q_bytes);
  cl_mem cache = buf_from(rt, b->cache0, b->cache_bytes);
  cl_mem c_slot = NULL, c_q = NULL, c_cache = NULL;
  if (rt->counting) {
    c_slot = buf_zero(rt, (size_t)n * 8 * sizeof(cl_uint));
    c_q = buf_zero(rt, b->q_bytes * sizeof(cl_uint));
    c_cache = buf_zero(rt, b->cache_bytes * sizeof(cl_uint));
  }

  cl_uint u_n = n, u_bs = s->bs, u_nb = b->n_blocks, u_nseg = b->n_seg, u_nbt = b->bt_entries;
  set_arg(rt->map, 0, sizeof(cl_uint), &u_n);
  set_arg(rt->map, 1, sizeof(cl_uint), &u_bs);
  set_arg(rt->map, 2, sizeof(cl_uint), &u_nb);
  set_arg(rt->map, 3, sizeof(cl_mem), &pos);
  set_arg(rt->map, 4, sizeof(cl_mem), &tok_seg);
  set_arg(rt->map, 5, sizeof(cl_mem), &first_lb);
  set_arg(rt->map, 6, sizeof(cl_mem), &bt_off);
  set_arg(rt->map, 7, sizeof(cl_mem), &bt_len);
  set_arg(rt->map, 8, sizeof(cl_mem), &bt);
  set_arg(rt->map, 9, sizeof(cl_uint), &u_nseg);
  set_arg(rt->map, 10, sizeof(cl_mem), &slots);
  set_arg(rt->map, 11, sizeof(cl_mem), &err);
  set_arg(rt->map, 12, sizeof(cl_uint), &u_nbt);
  if (rt->counting)
    set_arg(rt->map, DSV4_LZ_MAP_NARGS, sizeof(cl_mem), &c_slot);
  size_t local = DSV4_LZ_MAP_GROUP_SIZE, items = n > b->n_seg ? n : b->n_seg;
  size_t global = (items + local - 1) / local * local;
  check_cl(clEnqueueNDRangeKernel(rt->queue, rt->map, 1, NULL, &global, &local, 0, NULL, NULL),
           "map launch");
  /* The producer/consumer ordering (SPEC §5.2): the queue is in order, and the barrier says so. */
  check_cl(clEnqueueBarrierWithWaitList(rt->queue, 0, NULL, NULL), "barrier");

  uint64_t rows = (uint64_t)n * s->heads + (s->replay ? 0 : n);
  cl_uint u_rows = (cl_uint)rows, u_h = s->heads, u_wkv = (cl_uint)!s->replay;
  cl_uint u_inb = b->insert_blocks ? b->insert_blocks : b->n_blocks;
  cl_uint u_fused = (cl_uint)s->fused;
  cl_float eps = 1e-6f;
  cl_ulong stride = DSV4_BLOCK_STRIDE(s->bs);
  set_arg(rt->insert, 1, sizeof(cl_uint), &u_rows);
  set_arg(rt->insert, 2, sizeof(cl_uint), &u_n);
  set_arg(rt->insert, 3, sizeof(cl_uint), &u_h);
  set_arg(rt->insert, 4, sizeof(cl_uint), &u_wkv);
  set_arg(rt->insert, 5, sizeof(cl_mem), &q);
  set_arg(rt->insert, 6, sizeof(cl_mem), &kv);
  set_arg(rt->insert, 7, sizeof(cl_mem), &slots);
  set_arg(rt->insert, 8, sizeof(cl_mem), &rope);
  /* A NULL weight for prenormed rows, as the daemon passes for kv_norm = prenormed. */
  set_arg(rt->insert, 9, sizeof(cl_mem), s->fused ? &w : NULL);
  set_arg(rt->insert, 10, sizeof(cl_uint), &u_fused);
  set_arg(rt->insert, 11, sizeof(cl_float), &eps);
  set_arg(rt->insert, 12, sizeof(cl_mem), &q_out);
  set_arg(rt->insert, 13, sizeof(cl_mem), &cache);
  set_arg(rt->insert, 14, sizeof(cl_uint), &u_bs);
  set_arg(rt->insert, 15, sizeof(cl_uint), &u_inb);
  set_arg(rt->insert, 16, sizeof(cl_ulong), &stride);
  set_arg(rt->insert, 17, sizeof(cl_mem), &err);
  if (rt->counting) {
    set_arg(rt->insert, DSV4_LZ_INSERT_NARGS, sizeof(cl_mem), &c_q);
    set_arg(rt->insert, DSV4_LZ_INSERT_NARGS + 1, sizeof(cl_mem), &c_cache);
  }
  for (uint64_t row0 = 0; row0 < rows; row0 += max_rows) {
    uint64_t chunk = rows - row0 < max_rows ? rows - row0 : max_rows;
    cl_uint u_row0 = (cl_uint)row0;
    set_arg(rt->insert, 0, sizeof(cl_uint), &u_row0);
    size_t lsz = DSV4_LZ_GROUP_SIZE;
    size_t gsz = (size_t)((chunk + DSV4_LZ_ROWS_PER_GROUP - 1) / DSV4_LZ_ROWS_PER_GROUP) * lsz;
    check_cl(clEnqueueNDRangeKernel(rt->queue, rt->insert, 1, NULL, &gsz, &lsz, 0, NULL, NULL),
             "insert launch");
  }
  check_cl(clEnqueueReadBuffer(rt->queue, slots, CL_FALSE, 0, n * sizeof(int64_t), r->slots, 0,
                               NULL, NULL),
           "read slots");
  check_cl(clEnqueueReadBuffer(rt->queue, q_out, CL_FALSE, 0, b->q_bytes, r->q_out, 0, NULL, NULL),
           "read q_out");
  check_cl(
      clEnqueueReadBuffer(rt->queue, cache, CL_FALSE, 0, b->cache_bytes, r->cache, 0, NULL, NULL),
      "read cache");
  check_cl(
      clEnqueueReadBuffer(rt->queue, err, CL_FALSE, 0, sizeof(cl_uint), &r->err, 0, NULL, NULL),
      "read err");
  if (rt->counting) {
    check_cl(clEnqueueReadBuffer(rt->queue, c_slot, CL_FALSE, 0, (size_t)n * 8 * sizeof(cl_uint),
                                 r->slot_count, 0, NULL, NULL),
             "read slot counters");
    check_cl(clEnqueueReadBuffer(rt->queue, c_q, CL_FALSE, 0, b->q_bytes * sizeof(cl_uint),
                                 r->q_count, 0, NULL, NULL),
             "read q counters");
    check_cl(clEnqueueReadBuffer(rt->queue, c_cache, CL_FALSE, 0, b->cache_bytes * sizeof(cl_uint),
                                 r->cache_count, 0, NULL, NULL),
             "read cache counters");
  }
  check_cl(clFinish(rt->queue), "clFinish");
  cl_mem all[] = {pos, tok_seg, first_lb, bt_off, bt_len, bt,     slots, err,    q,
                  kv,  rope,    w,        q_out,  cache,  c_slot, c_q,   c_cache};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    if (all[i])
      clReleaseMemObject(all[i]);
}

static const char *shape_str(const shape_t *s, char *buf, size_t len) {
  snprintf(buf, len, "H=%u N=%u bs=%u %s %s%s%s", s->heads, s->n_tokens, s->bs,
           s->yarn ? "yarn" : "plain", s->fused ? "fused" : "prenormed", s->replay ? " replay" : "",
           s->random_cache ? " random-cache" : "");
  return buf;
}

/* The kernels through the "level_zero" backend: device buffers, uploads, the two launches, sync. */
static void run_lz(dsv4_backend_t *be, const batch_t *b, dsv4_rope_table_t *rope, result_t *r) {
  const shape_t *s = &b->s;
  uint32_t n = s->n_tokens;
  struct {
    const void *src;
    size_t size;
    dsv4_devbuf_t buf;
  } in[] = {
      {b->pos, n * sizeof(int64_t), {0}},
      {b->tok_seg, n * sizeof(int32_t), {0}},
      {b->seg_first_lb, b->n_seg * 8u, {0}},
      {b->bt_off, b->n_seg * 4u, {0}},
      {b->bt_len, b->n_seg * 4u, {0}},
      {b->bt, b->n_bt * 4u, {0}},
      {b->q, b->q_bytes, {0}},
      {b->kv, (size_t)n * DSV4_HEAD_DIM * 2, {0}},
      {b->w, sizeof(b->w), {0}},
      {b->cache0, b->cache_bytes, {0}},
      {NULL, n * sizeof(int64_t), {0}} /* slots */,
      {NULL, b->q_bytes, {0}} /* q_out */,
  };
  enum { POS, SEG, FIRST, OFF, LEN, BT, Q, KV, W, CACHE, SLOTS, QOUT, N_IN };
  for (int i = 0; i < N_IN; i++) {
    if (be->ops->buf_alloc(be, in[i].size, &in[i].buf) != 0)
      die("level_zero buf_alloc(%zu)", in[i].size);
    if (in[i].src && be->ops->upload(be, &in[i].buf, 0, in[i].src, in[i].size) != 0)
      die("level_zero upload");
  }
  dsv4_map_args_t m = {
      .n_tokens = n,
      .n_segments = b->n_seg,
      .block_size = s->bs,
      .n_blocks = b->n_blocks,
      .positions = in[POS].buf.ptr,
      .tok_seg = in[SEG].buf.ptr,
      .seg_first_lb = in[FIRST].buf.ptr,
      .seg_bt_off = in[OFF].buf.ptr,
      .seg_bt_len = in[LEN].buf.ptr,
      .block_table = in[BT].buf.ptr,
      .slots = in[SLOTS].buf.ptr,
      .bt_entries = b->bt_entries,
  };
  dsv4_insert_args_t a = {
      .n_tokens = n,
      .heads = s->heads,
      .q = in[Q].buf.ptr,
      .kv = in[KV].buf.ptr,
      .positions = in[POS].buf.ptr,
      .slots = in[SLOTS].buf.ptr,
      .rope = rope,
      .kv_norm_weight = s->fused ? in[W].buf.ptr : NULL,
      .eps = 1e-6f,
      .write_kv = !s->replay,
      .q_out = in[QOUT].buf.ptr,
      .cache = in[CACHE].buf.ptr,
      .block_size = s->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(s->bs),
  };
  int rc = be->ops->map_slots(be, &m);
  if (rc == 0)
    rc = be->ops->qkv_insert(be, &a);
  if (rc == 0)
    rc = be->ops->sync(be);
  if (rc != 0)
    die("level_zero launch failed: %s", dsv4_strerror(rc));
  r->err = 0;
  if (be->ops->download(be, r->slots, &in[SLOTS].buf, 0, in[SLOTS].size) != 0 ||
      be->ops->download(be, r->q_out, &in[QOUT].buf, 0, in[QOUT].size) != 0 ||
      be->ops->download(be, r->cache, &in[CACHE].buf, 0, in[CACHE].size) != 0)
    die("level_zero download");
  for (int i = 0; i < N_IN; i++)
    be->ops->buf_free(be, &in[i].buf);
}

/* Where the kernels run: OpenCL (PoCL) or the level_zero backend. */
typedef struct {
  clrt_t *cl;
  dsv4_backend_t *lz;
} device_t;

static void run_dev(const device_t *d, const batch_t *b, dsv4_rope_table_t *rope, uint32_t max_rows,
                    result_t *r) {
  if (d->cl)
    run_cl(d->cl, b, max_rows, r);
  else
    run_lz(d->lz, b, rope, r);
}

/* Returns the number of differing bytes, reporting the first. */
static size_t diff_bytes(const void *got, const void *want, size_t n, const char *what,
                         const char *shape, int run) {
  const uint8_t *g = got, *w = want;
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < n; i++)
    if (g[i] != w[i] && bad++ == 0)
      first = i;
  if (bad)
    fprintf(stderr,
            "MISMATCH [%s] run %d: %s differs from the CPU backend in %zu of %zu bytes, first at "
            "byte %zu (got 0x%02x, cpu 0x%02x)\n",
            shape, run, what, bad, n, first, g[first], w[first]);
  return bad;
}

/* ---- the single-writer check (SPEC §5.1) ---- */

/* Reports runs of equal wrong counts in the format of tests/unit/inv_one_writer.c. */
static size_t check_counts(const uint32_t *count, const uint8_t *expect, size_t n,
                           const char *region, const batch_t *b, const char *shape) {
  size_t wrong = 0;
  int reports = 0;
  for (size_t i = 0; i < n;) {
    if (count[i] == expect[i]) {
      i++;
      continue;
    }
    size_t j = i;
    while (j < n && count[j] == count[i] && expect[j] == expect[i])
      j++;
    wrong += j - i;
    if (reports++ < 3) {
      char where[160];
      if (strcmp(region, "cache") != 0)
        snprintf(where, sizeof(where), "%s bytes %zu..%zu", region, i, j - 1);
      else
        inv_describe_cache(where, sizeof(where), i, j - 1, b->s.bs);
      INV_REPORT(1, "one writer per byte: %s (%zu bytes) stored %u times, expected %u [opencl %s]",
                 where, j - i, count[i], expect[i], shape);
    }
    i = j;
  }
  return wrong;
}

static size_t check_one_writer(const batch_t *b, const result_t *r, const char *shape) {
  uint32_t n = b->s.n_tokens, bs = b->s.bs;
  size_t stride = DSV4_BLOCK_STRIDE(bs);
  uint8_t *qe = inv_alloc(b->q_bytes), *se = inv_alloc((size_t)n * 8);
  uint8_t *ce = calloc(1, b->cache_bytes);
  if (!ce)
    die("out of memory");
  memset(qe, 1, b->q_bytes);
  memset(se, 1, (size_t)n * 8);
  for (uint32_t t = 0; t < n && !b->s.replay; t++) {
    if (r->slots[t] < 0)
      continue;
    uint8_t *blk = ce + (size_t)r->slots[t] / bs * stride;
    size_t o = (size_t)r->slots[t] % bs;
    memset(blk + DSV4_TOKEN_DATA_OFFSET(o), 1, DSV4_TOKEN_DATA_BYTES);
    memset(blk + DSV4_SCALE_OFFSET(bs, o), 1, DSV4_SCALE_BYTES);
  }
  size_t wrong = check_counts(r->slot_count, se, (size_t)n * 8, "slots", b, shape);
  wrong += check_counts(r->q_count, qe, b->q_bytes, "q_out", b, shape);
  wrong += check_counts(r->cache_count, ce, b->cache_bytes, "cache", b, shape);
  free(qe);
  free(se);
  free(ce);
  return wrong;
}

/* ---- the cases ---- */

static const shape_t shapes[] = {
    {.heads = 8, .n_tokens = 300, .bs = 16, .neg_pct = 10},
    {.heads = 64, .n_tokens = 37, .bs = 64, .yarn = 1, .fused = 1, .neg_pct = 20},
    {.heads = 128, .n_tokens = 17, .bs = 256, .fused = 1, .random_cache = 1},
    {.heads = 128, .n_tokens = 5, .bs = 64, .yarn = 1, .random_cache = 1, .neg_pct = 30},
    {.heads = 64, .n_tokens = 9, .bs = 16, .replay = 1, .random_cache = 1},
    {.heads = 8, .n_tokens = 1, .bs = 64, .yarn = 1, .fused = 1},
    {.heads = 3, .n_tokens = 70, .bs = 16, .fused = 1, .random_cache = 1, .neg_pct = 15},
};

/* SPEC §2's subnormal vector: (0x0001, 0x8001, 0x0080, 0...) at position 5 of a plain layer. */
static void check_subnormal_vector(const device_t *d, dsv4_rope_table_t *plain) {
  shape_t s = {.heads = 1, .n_tokens = 1, .bs = 16};
  batch_t b;
  make_batch(&b, &s, plain);
  memset(b.q, 0, b.q_bytes);
  b.q[0] = 0x0001;
  b.q[1] = 0x8001;
  b.q[2] = 0x0080;
  b.pos[0] = 5;
  if (dsv4_rope_table_ensure(plain, b.pos, 1) != 0)
    die("rope rows");
  memcpy(b.rope_rows, dsv4_rope_table_row(plain, 5), DSV4_ROPE_ROW_FLOATS * sizeof(float));
  b.seg_first_lb[0] = 0;
  result_t r;
  alloc_result(&r, &b, d->cl && d->cl->counting);
  run_dev(d, &b, plain, 1u << 20, &r);
  if (r.q_out[0] != 0x01FA || r.q_out[1] != 0x81FA || r.q_out[2] != 0x057A)
    die("subnormal vector: q_out[0..2] = %04x %04x %04x, expected 01fa 81fa 057a", r.q_out[0],
        r.q_out[1], r.q_out[2]);
  printf("subnormal vector: q_out[0..2] = 01fa 81fa 057a\n");
  free_result(&r);
  free_batch(&b);
}

/*
 * Arguments the CPU backend refuses with DSV4_EINVAL: the kernels set their error bit, give the
 * token slot -1 (or skip the store) and write nothing out of bounds.
 */
static void check_error_bits(clrt_t *rt, dsv4_rope_table_t *plain) {
  /* Table-length cases: 1 a token maps the entry past the length; 2 only an unused trailing entry
   * of the last segment lies past it; 3 that segment has no tokens (more segments than tokens). */
  static const struct {
    const char *what;
    uint32_t bit;
    int table;
  } cases[] = {
      {"a segment index out of range", DSV4_LZ_ERR_SEGMENT, 0},
      {"a negative position", DSV4_LZ_ERR_POSITION, 0},
      {"a block id beyond the pool", DSV4_LZ_ERR_BLOCK, 0},
      {"a slot beyond the pool given to qkv_insert", DSV4_LZ_ERR_SLOT, 0},
      {"a token's table entry past the table length", DSV4_LZ_ERR_TABLE, 1},
      {"a segment's unused entry past the table length", DSV4_LZ_ERR_TABLE, 2},
      {"a segment without tokens past the table length", DSV4_LZ_ERR_TABLE, 3},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    shape_t s = {.heads = 8, .n_tokens = cases[i].table == 3 ? 1 : 40, .bs = 16, .random_cache = 1};
    batch_t b;
    make_batch(&b, &s, plain);
    uint32_t bad_token = 0, limit = b.n_blocks;
    if (cases[i].bit == DSV4_LZ_ERR_SEGMENT)
      b.tok_seg[0] = (int32_t)b.n_seg;
    else if (cases[i].bit == DSV4_LZ_ERR_POSITION)
      b.pos[0] = -1;
    else if (cases[i].bit == DSV4_LZ_ERR_BLOCK)
      for (uint32_t e = 0; e < b.n_bt; e++)
        b.bt[e] = (int32_t)b.n_blocks + 3; /* every mapped token hits it */
    else if (cases[i].table == 1) {
      /* The last table entry is left out of the length: the segment that owns it runs past it,
       * and a token mapped there must get slot -1 (its entry is not read). */
      if (b.n_bt < 2)
        die("%s: the batch has %u table entries, 2 needed", cases[i].what, b.n_bt);
      b.bt_entries = b.n_bt - 1;
      bad_token = UINT32_MAX;
      for (uint32_t t = 0; t < s.n_tokens; t++) {
        uint32_t sg = (uint32_t)b.tok_seg[t];
        int64_t idx = b.pos[t] / s.bs - b.seg_first_lb[sg];
        if (idx >= 0 && idx < b.bt_len[sg] && b.bt_off[sg] + idx == b.bt_entries)
          bad_token = t;
      }
      if (bad_token == UINT32_MAX)
        die("%s: no token maps the last table entry", cases[i].what);
    } else if (cases[i].table == 2) {
      /* One more entry at the end of the last segment's table, past every token's block: only
       * the segment's own check can see it (make_batch leaves room for it). */
      b.bt[b.n_bt] = -1;
      b.bt_len[b.n_seg - 1]++;
      b.bt_entries = b.n_bt++;
      bad_token = UINT32_MAX;
    } else if (cases[i].table == 3) {
      /* A second segment, with no tokens, whose one entry lies past the length. */
      b.seg_first_lb = realloc(b.seg_first_lb, 2 * sizeof(int64_t));
      b.bt_off = realloc(b.bt_off, 2 * sizeof(uint32_t));
      b.bt_len = realloc(b.bt_len, 2 * sizeof(uint32_t));
      if (!b.seg_first_lb || !b.bt_off || !b.bt_len || b.n_seg != 1)
        die("%s: cannot add a segment", cases[i].what);
      b.seg_first_lb[1] = 0;
      b.bt_off[1] = b.n_bt;
      b.bt_len[1] = 1;
      b.bt[b.n_bt] = -1;
      b.bt_entries = b.n_bt++;
      b.n_seg = 2;
      bad_token = UINT32_MAX;
    } else
      b.insert_blocks = limit = b.n_blocks / 2;
    result_t r;
    alloc_result(&r, &b, rt->counting);
    run_cl(rt, &b, 1u << 30, &r);
    if (!(r.err & cases[i].bit))
      die("%s: error word 0x%x lacks bit 0x%x", cases[i].what, r.err, cases[i].bit);
    if (cases[i].bit != DSV4_LZ_ERR_SLOT && cases[i].bit != DSV4_LZ_ERR_BLOCK &&
        bad_token != UINT32_MAX && r.slots[bad_token] != -1)
      die("%s: the token got slot %lld, not -1", cases[i].what, (long long)r.slots[bad_token]);
    size_t from = (size_t)limit * DSV4_BLOCK_STRIDE(s.bs);
    if (cases[i].bit == DSV4_LZ_ERR_SLOT &&
        memcmp(r.cache + from, b.cache0 + from, b.cache_bytes - from) != 0)
      die("%s: the kernel wrote beyond the pool it was given", cases[i].what);
    if (cases[i].bit == DSV4_LZ_ERR_BLOCK)
      for (uint32_t t = 0; t < s.n_tokens; t++)
        if (r.slots[t] != -1)
          die("%s: token %u got slot %lld, not -1", cases[i].what, t, (long long)r.slots[t]);
    printf("error bits: %s sets 0x%x, nothing written out of bounds\n", cases[i].what,
           cases[i].bit);
    free_result(&r);
    free_batch(&b);
  }
}

/* SPEC §2's numerics through the whole backend where a Level Zero driver is present, or else the
 * one clear line the daemon prints and the fall back of "auto" to the CPU backend. */
static int check_no_driver(void) {
  dsv4_backend_t *be = NULL;
  char why[512];
  int rc = dsv4_backend_open("level_zero", NULL, &be, why, sizeof(why));
  if (rc == 0) {
    printf("skipped: a Level Zero GPU is present (the no-driver path cannot be seen here)\n");
    dsv4_backend_close(be);
    return 77;
  }
  printf("level_zero: %s (%s)\n", why, dsv4_strerror(rc));
  if (strstr(why, "unknown backend"))
    die("this build has no level_zero backend: %s", why);
  if (rc != DSV4_ENODEV || strncmp(why, "zeInit found no driver (ZE_RESULT_", 34) != 0 ||
      why[strlen(why) - 1] != ')' || strchr(why, '\n'))
    die("opening level_zero without a driver: rc %d, why \"%s\"; expected DSV4_ENODEV and "
        "\"zeInit found no driver (ZE_RESULT_...)\"",
        rc, why);
  dsv4_backend_options_t opt = {.threads = 1};
  rc = dsv4_backend_open("auto", &opt, &be, why, sizeof(why));
  if (rc != 0)
    die("auto did not fall back: %s", why);
  printf("auto: opened %s, skipped: %s\n", be->ops->name, why);
  if (!strcmp(be->ops->name, "cuda")) { /* a CUDA GPU comes first: level_zero was not tried */
    dsv4_backend_close(be);
    printf("PASS: no-driver (auto found a CUDA device before level_zero)\n");
    return 0;
  }
  if (strcmp(be->ops->name, "cpu") != 0 ||
      !strstr(why, "level_zero: zeInit found no driver (ZE_RESULT_"))
    die("auto: opened %s with why \"%s\"; expected cpu and the level_zero reason", be->ops->name,
        why);
  dsv4_backend_close(be);
  printf("PASS: no-driver\n");
  return 0;
}

/* Opens where the kernels run: OpenCL (PoCL) with the build defines given, or, when defines is
 * NULL, the level_zero backend. 0, or 77 when there is nothing to run on. */
static int open_device(const char *defines, int fp64, clrt_t *rt, device_t *dev) {
  if (defines) {
    int rc = clrt_open(rt, defines, fp64);
    if (rc)
      return rc;
    check_fp_probe(rt);
    dev->cl = rt;
  } else {
    char lz_why[512];
    int rc = dsv4_backend_open("level_zero", NULL, &dev->lz, lz_why, sizeof(lz_why));
#ifdef DSV4_LZ_FAKE_ZE
    /* The test double presents a usable device wherever OpenCL has a platform (PoCL): any other
     * refusal is the glue's failure. */
    cl_uint n_plats = 0;
    if (rc && (clGetPlatformIDs(0, NULL, &n_plats) != CL_SUCCESS || n_plats == 0)) {
      printf("skipped: no OpenCL platform for the Level Zero test double\n");
      return 77;
    }
    if (rc)
      die("the level_zero backend over the test double did not open: %s", lz_why);
    /* The module matches the device: fp64 exactly when the double says fp32 divide and sqrt are
     * not correctly rounded (FAKE_ZE_FP32_FLAGS). */
    const char *fl = getenv("FAKE_ZE_FP32_FLAGS");
    int want_fp64 = fl && !(strtoul(fl, NULL, 16) & ZE_DEVICE_FP_FLAG_ROUNDED_DIVIDE_SQRT);
    unsigned n_cr = 0, n_fp64 = 0;
    fake_ze_modules_built(&n_cr, &n_fp64);
    if (n_cr + n_fp64 != 1 || (n_fp64 == 1) != want_fp64)
      die("the backend built %u correctly rounded and %u fp64 modules; the device wants the %s one",
          n_cr, n_fp64, want_fp64 ? "fp64" : "correctly rounded");
    printf("module: %s\n", want_fp64 ? "fp64 (the device's fp32 divide/sqrt are not correctly "
                                       "rounded)"
                                     : "correctly rounded fp32 divide/sqrt");
#else
    /* Only the absence of a driver or a GPU is a skip; a GPU that is there but refused (module
     * build, SPEC §2 probe, properties) fails the test with the reason. */
    if (rc && (!strncmp(lz_why, "zeInit found no driver", 22) || !strncmp(lz_why, "no driver", 9) ||
               !strncmp(lz_why, "no GPU among", 12))) {
      printf("skipped: no Level Zero GPU: %s\n", lz_why);
      return 77;
    }
    if (rc)
      die("a Level Zero GPU is present but the backend refused it: %s", lz_why);
#endif
    printf("level_zero backend open (its SPEC §2 probe passed)\n");
  }
  return 0;
}

/* ---- attention (SPEC §7) ---- */

/*
 * Exact-mode attention after the insert: batches of sequences with history (records written by an
 * earlier batch) in paged blocks, run through the CPU backend's map_slots, qkv_insert and attention
 * (the reference), then through the attention kernels (dsv4_attn_check, a barrier, dsv4_attention)
 * on the CPU's q_out and cache, or through the level_zero backend from the same inputs; attn and
 * lse must be the same bytes.
 */

#define ATTN_RUNS 2

enum { SINK_FINITE, SINK_MIXED, SINK_NONE }; /* MIXED: finite, +inf, -inf, finite, ... by head */

typedef struct {
  int64_t p0, start;
  uint32_t len;
} attn_seg_t;

typedef struct {
  const char *name;
  uint32_t heads, bs;
  int yarn, sinks, want_lse;
  uint32_t n_seg;
  attn_seg_t seg[16];
} attn_case_t;

/* Decode batches of 1 and 16, a 200-token prefill chunk crossing blocks, first tokens (p = p0),
 * p0 > 0, windows cut by p0 and by p - 127, H 8 and 64, every sink kind, lse asked and not. */
static const attn_case_t attn_cases[] = {
    {"decode b=1", 8, 64, 0, SINK_FINITE, 1, 1, {{0, 300, 1}}},
    {"decode b=16",
     64,
     16,
     1,
     SINK_FINITE,
     1,
     16,
     {{0, 1000, 1},
      {50, 100, 1},
      {777, 777, 1},
      {0, 5, 1},
      {3, 130, 1},
      {0, 127, 1},
      {0, 128, 1},
      {1, 129, 1},
      {200, 330, 1},
      {0, 4095, 1},
      {64, 191, 1},
      {64, 192, 1},
      {10, 20, 1},
      {0, 1, 1},
      {100000, 100126, 1},
      {0, 65, 1}}},
    {"prefill 200 across blocks, p0 > 0", 8, 64, 0, SINK_MIXED, 1, 1, {{37, 90, 200}}},
    {"prefill from p0 and decodes, no sink, no lse",
     8,
     16,
     1,
     SINK_NONE,
     0,
     3,
     {{5, 5, 20}, {0, 500, 1}, {130, 200, 3}}},
    {"first token", 64, 256, 0, SINK_MIXED, 1, 1, {{0, 0, 1}}},
    {"decode b=4, no sink",
     8,
     16,
     0,
     SINK_NONE,
     1,
     4,
     {{0, 40, 1}, {7, 300, 1}, {0, 1000, 1}, {2, 2, 1}}},
};

typedef struct {
  const attn_case_t *c;
  uint32_t n, n_blocks, n_bt;
  int64_t *pos, *p0, *first_lb;
  int32_t *tok_seg, *bt;
  uint32_t *bt_off, *bt_len;
  uint16_t *q, *kv;
  float w[DSV4_HEAD_DIM];
  float sink[DSV4_MAX_HEADS];
  uint8_t *cache0; /* before the batch: the history's records, random bytes everywhere else */
  size_t cache_bytes, q_bytes, lse_bytes;
  float *rope_rows; /* [N, 64] */
  dsv4_rope_table_t *rope;
} attn_batch_t;

typedef struct {
  uint16_t *q_out, *out;
  uint8_t *cache;
  float *lse;
  uint32_t err;
} attn_result_t;

/* The first position a token at p of a sequence starting at p0 attends to. */
static int64_t attn_first(int64_t p0, int64_t p) {
  return p - (DSV4_WINDOW - 1) > p0 ? p - (DSV4_WINDOW - 1) : p0;
}

/* map_slots + qkv_insert (fused kv_norm) of n tokens of the batch's sequences on the CPU backend,
 * into cache: the history before the batch. */
static void attn_cpu_insert(dsv4_backend_t *cpu, const attn_batch_t *b, uint32_t n,
                            const int64_t *pos, const int32_t *seg, const uint16_t *kv,
                            uint8_t *cache) {
  int64_t *slots = inv_alloc(n * sizeof(int64_t) + 8);
  uint16_t *q = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2 + 2);
  uint16_t *q_out = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2 + 2);
  inv_fill_bf16(q, (size_t)n * DSV4_HEAD_DIM);
  dsv4_map_args_t m = {
      .n_tokens = n,
      .n_segments = b->c->n_seg,
      .block_size = b->c->bs,
      .n_blocks = b->n_blocks,
      .positions = pos,
      .tok_seg = seg,
      .seg_first_lb = b->first_lb,
      .seg_bt_off = b->bt_off,
      .seg_bt_len = b->bt_len,
      .block_table = b->bt,
      .slots = slots,
      .bt_entries = b->n_bt,
  };
  dsv4_insert_args_t a = {
      .n_tokens = n,
      .heads = 1,
      .q = q,
      .kv = kv,
      .positions = pos,
      .slots = slots,
      .rope = b->rope,
      .kv_norm_weight = b->w,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = q_out,
      .cache = cache,
      .block_size = b->c->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(b->c->bs),
  };
  if (n && (cpu->ops->map_slots(cpu, &m) != 0 || cpu->ops->qkv_insert(cpu, &a) != 0 ||
            cpu->ops->sync(cpu) != 0))
    die("[%s] the cpu backend refused the history", b->c->name);
  for (uint32_t t = 0; t < n; t++)
    if (slots[t] < 0)
      die("[%s] history position %lld has no slot", b->c->name, (long long)pos[t]);
  free(slots);
  free(q);
  free(q_out);
}

/* Each segment's table maps its window's first block to its last token's, with distinct ids. */
static void attn_tables(attn_batch_t *b) {
  const attn_case_t *c = b->c;
  uint32_t entries = 0;
  for (uint32_t s = 0; s < c->n_seg; s++)
    entries += (uint32_t)((c->seg[s].start + c->seg[s].len - 1) / c->bs -
                          attn_first(c->seg[s].p0, c->seg[s].start) / c->bs + 1);
  b->n_blocks = entries + 3;
  uint32_t *perm = inv_alloc(b->n_blocks * sizeof(uint32_t));
  for (uint32_t i = 0; i < b->n_blocks; i++)
    perm[i] = i;
  for (uint32_t i = b->n_blocks - 1; i > 0; i--) {
    uint32_t j = inv_below(i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  /* One spare entry, for the error cases. */
  b->bt = inv_alloc((entries + 1) * sizeof(int32_t));
  b->first_lb = inv_alloc(c->n_seg * sizeof(int64_t));
  b->p0 = inv_alloc(c->n_seg * sizeof(int64_t));
  b->bt_off = inv_alloc(c->n_seg * sizeof(uint32_t));
  b->bt_len = inv_alloc(c->n_seg * sizeof(uint32_t));
  for (uint32_t s = 0; s < c->n_seg; s++) {
    int64_t lo = attn_first(c->seg[s].p0, c->seg[s].start) / c->bs;
    int64_t hi = (c->seg[s].start + c->seg[s].len - 1) / c->bs;
    b->p0[s] = c->seg[s].p0;
    b->first_lb[s] = lo;
    b->bt_off[s] = b->n_bt;
    b->bt_len[s] = (uint32_t)(hi - lo + 1);
    for (int64_t lb = lo; lb <= hi; lb++) {
      b->bt[b->n_bt] = (int32_t)perm[b->n_bt];
      b->n_bt++;
    }
  }
  b->bt[b->n_bt] = -1;
  free(perm);
}

static void make_attn_batch(attn_batch_t *b, const attn_case_t *c, dsv4_rope_table_t *rope,
                            dsv4_backend_t *cpu) {
  memset(b, 0, sizeof(*b));
  b->c = c;
  b->rope = rope;
  attn_tables(b);
  uint32_t n = 0, n_hist = 0;
  for (uint32_t s = 0; s < c->n_seg; s++) {
    n += c->seg[s].len;
    n_hist += (uint32_t)(c->seg[s].start - attn_first(c->seg[s].p0, c->seg[s].start));
  }
  b->n = n;
  b->pos = inv_alloc(n * sizeof(int64_t));
  b->tok_seg = inv_alloc(n * sizeof(int32_t));
  int64_t *hpos = inv_alloc(n_hist * sizeof(int64_t) + 8);
  int32_t *hseg = inv_alloc(n_hist * sizeof(int32_t) + 4);
  uint32_t t = 0, h = 0;
  for (uint32_t s = 0; s < c->n_seg; s++) {
    for (int64_t p = attn_first(c->seg[s].p0, c->seg[s].start); p < c->seg[s].start; p++, h++) {
      hpos[h] = p;
      hseg[h] = (int32_t)s;
    }
    for (uint32_t k = 0; k < c->seg[s].len; k++, t++) {
      b->pos[t] = c->seg[s].start + k;
      b->tok_seg[t] = (int32_t)s;
    }
  }
  b->q_bytes = (size_t)n * c->heads * DSV4_HEAD_DIM * 2;
  b->lse_bytes = (size_t)n * c->heads * sizeof(float);
  b->q = inv_alloc(b->q_bytes);
  b->kv = inv_alloc((size_t)n * DSV4_HEAD_DIM * 2);
  inv_fill_bf16(b->q, b->q_bytes / 2);
  inv_fill_bf16(b->kv, (size_t)n * DSV4_HEAD_DIM);
  inv_fill_weight(b->w);
  for (uint32_t k = 0; k < c->heads; k++) {
    static const float special[] = {0.0f, INFINITY, -INFINITY, 0.0f};
    b->sink[k] = (float)inv_below(8000) * 0.001f - 2.0f;
    if (c->sinks == SINK_MIXED && special[k % 4] != 0.0f)
      b->sink[k] = special[k % 4];
  }
  if (dsv4_rope_table_ensure(rope, b->pos, n) != 0 || dsv4_rope_table_ensure(rope, hpos, n_hist))
    die("rope rows");
  b->rope_rows = inv_alloc((size_t)n * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  for (uint32_t k = 0; k < n; k++)
    memcpy(b->rope_rows + (size_t)k * DSV4_ROPE_ROW_FLOATS, dsv4_rope_table_row(rope, b->pos[k]),
           DSV4_ROPE_ROW_FLOATS * sizeof(float));
  /* Random bytes where no candidate lives (a kernel that reads them gives other bytes), then the
   * history's records. */
  b->cache_bytes = (size_t)b->n_blocks * DSV4_BLOCK_STRIDE(c->bs);
  b->cache0 = inv_alloc(b->cache_bytes);
  for (size_t i = 0; i < b->cache_bytes; i++)
    b->cache0[i] = (uint8_t)inv_rnd();
  uint16_t *hkv = inv_alloc((size_t)n_hist * DSV4_HEAD_DIM * 2 + 2);
  inv_fill_bf16(hkv, (size_t)n_hist * DSV4_HEAD_DIM);
  attn_cpu_insert(cpu, b, n_hist, hpos, hseg, hkv, b->cache0);
  free(hkv);
  free(hpos);
  free(hseg);
}

static void free_attn_batch(attn_batch_t *b) {
  void *all[] = {b->pos,    b->p0, b->first_lb, b->tok_seg, b->bt,       b->bt_off,
                 b->bt_len, b->q,  b->kv,       b->cache0,  b->rope_rows};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    free(all[i]);
}

static void alloc_attn_result(attn_result_t *r, const attn_batch_t *b) {
  r->q_out = inv_alloc(b->q_bytes);
  r->out = inv_alloc(b->q_bytes);
  r->cache = inv_alloc(b->cache_bytes);
  r->lse = inv_alloc(b->lse_bytes);
  r->err = 0;
}

static void free_attn_result(attn_result_t *r) {
  free(r->q_out);
  free(r->out);
  free(r->cache);
  free(r->lse);
}

/* Bytes an output starts as, so that a launch that writes nothing shows. */
#define ATTN_JUNK 0x5A

/* The arguments of the batch's attention, pointing at the given copies of each array. */
static dsv4_attn_args_t attn_args(const attn_batch_t *b, const void *const *p) {
  const attn_case_t *c = b->c;
  return (dsv4_attn_args_t){
      .n_tokens = b->n,
      .n_segments = c->n_seg,
      .heads = c->heads,
      .q = p[0],
      .positions = p[1],
      .tok_seg = p[2],
      .seg_p0 = p[3],
      .seg_first_lb = p[4],
      .seg_bt_off = p[5],
      .seg_bt_len = p[6],
      .block_table = p[7],
      .bt_entries = b->n_bt,
      .cache = p[8],
      .block_size = c->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(c->bs),
      .sink = c->sinks == SINK_NONE ? NULL : p[9],
      .rope = b->rope,
      .out = (uint16_t *)p[10],
      .lse = c->want_lse ? (float *)p[11] : NULL,
  };
}

/* The reference: the CPU backend's map_slots, qkv_insert and attention on host memory. */
static void run_attn_cpu(dsv4_backend_t *cpu, const attn_batch_t *b, attn_result_t *r) {
  const attn_case_t *c = b->c;
  int64_t *slots = inv_alloc(b->n * sizeof(int64_t));
  memcpy(r->cache, b->cache0, b->cache_bytes);
  memset(r->out, ATTN_JUNK, b->q_bytes);
  memset(r->lse, ATTN_JUNK, b->lse_bytes);
  dsv4_map_args_t m = {
      .n_tokens = b->n,
      .n_segments = c->n_seg,
      .block_size = c->bs,
      .n_blocks = b->n_blocks,
      .positions = b->pos,
      .tok_seg = b->tok_seg,
      .seg_first_lb = b->first_lb,
      .seg_bt_off = b->bt_off,
      .seg_bt_len = b->bt_len,
      .block_table = b->bt,
      .slots = slots,
      .bt_entries = b->n_bt,
  };
  dsv4_insert_args_t a = {
      .n_tokens = b->n,
      .heads = c->heads,
      .q = b->q,
      .kv = b->kv,
      .positions = b->pos,
      .slots = slots,
      .rope = b->rope,
      .kv_norm_weight = b->w,
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = r->q_out,
      .cache = r->cache,
      .block_size = c->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(c->bs),
  };
  const void *p[12] = {r->q_out,  b->pos, b->tok_seg, b->p0,   b->first_lb, b->bt_off,
                       b->bt_len, b->bt,  r->cache,   b->sink, r->out,      r->lse};
  dsv4_attn_args_t aa = attn_args(b, p);
  int rc = cpu->ops->map_slots(cpu, &m);
  if (rc == 0)
    rc = cpu->ops->qkv_insert(cpu, &a);
  if (rc == 0)
    rc = cpu->ops->attention(cpu, &aa);
  if (rc == 0)
    rc = cpu->ops->sync(cpu);
  if (rc != 0)
    die("[%s] the cpu backend refused the batch: %s", c->name, dsv4_strerror(rc));
  free(slots);
}

/*
 * The attention kernels on OpenCL: dsv4_attn_check, a barrier, then dsv4_attention in launches of
 * at most max_rows rows, on q_out and cache (the insert's output). out and lse start as ATTN_JUNK.
 */
static void run_attn_cl(clrt_t *rt, const attn_batch_t *b, const uint16_t *q_out,
                        const uint8_t *cache, uint32_t max_rows, attn_result_t *r) {
  const attn_case_t *c = b->c;
  uint32_t n = b->n, n_seg = c->n_seg;
  memset(r->out, ATTN_JUNK, b->q_bytes);
  memset(r->lse, ATTN_JUNK, b->lse_bytes);
  cl_mem m[13] = {
      buf_from(rt, q_out, b->q_bytes),
      buf_from(rt, b->pos, n * sizeof(int64_t)),
      buf_from(rt, b->tok_seg, n * sizeof(int32_t)),
      buf_from(rt, b->p0, n_seg * sizeof(int64_t)),
      buf_from(rt, b->first_lb, n_seg * sizeof(int64_t)),
      buf_from(rt, b->bt_off, n_seg * sizeof(uint32_t)),
      buf_from(rt, b->bt_len, n_seg * sizeof(uint32_t)),
      buf_from(rt, b->bt, (b->n_bt + 1) * sizeof(int32_t)),
      buf_from(rt, cache, b->cache_bytes),
      buf_from(rt, b->sink, sizeof(b->sink)),
      buf_from(rt, r->out, b->q_bytes),
      buf_from(rt, r->lse, b->lse_bytes),
      buf_from(rt, b->rope_rows, (size_t)n * DSV4_ROPE_ROW_FLOATS * sizeof(float)),
  };
  cl_mem err = buf_zero(rt, sizeof(cl_uint));
  cl_uint u_n = n, u_nseg = n_seg, u_bs = c->bs, u_nb = b->n_blocks, u_nbt = b->n_bt;
  cl_uint u_h = c->heads, u_sink = c->sinks != SINK_NONE, u_lse = (cl_uint)c->want_lse;
  cl_uint u_rows = n * c->heads;
  cl_ulong stride = DSV4_BLOCK_STRIDE(c->bs);
  cl_kernel k = rt->attn_check;
  set_arg(k, 0, sizeof(cl_uint), &u_n);
  set_arg(k, 1, sizeof(cl_uint), &u_nseg);
  set_arg(k, 2, sizeof(cl_uint), &u_bs);
  set_arg(k, 3, sizeof(cl_uint), &u_nb);
  for (cl_uint i = 0; i < 7; i++) /* positions .. block_table */
    set_arg(k, 4 + i, sizeof(cl_mem), &m[1 + i]);
  set_arg(k, 11, sizeof(cl_uint), &u_nbt);
  set_arg(k, 12, sizeof(cl_mem), &err);
  size_t local = DSV4_LZ_MAP_GROUP_SIZE, items = n > n_seg ? n : n_seg;
  size_t global = (items + local - 1) / local * local;
  check_cl(clEnqueueNDRangeKernel(rt->queue, k, 1, NULL, &global, &local, 0, NULL, NULL),
           "attention check launch");
  /* SPEC §5.2: the rows run after the check, which decides whether they may write. */
  check_cl(clEnqueueBarrierWithWaitList(rt->queue, 0, NULL, NULL), "barrier");
  k = rt->attn;
  set_arg(k, 1, sizeof(cl_uint), &u_rows);
  set_arg(k, 2, sizeof(cl_uint), &u_h);
  set_arg(k, 3, sizeof(cl_mem), &m[0]);
  for (cl_uint i = 0; i < 5; i++) /* positions, tok_seg, seg_p0, seg_first_lb, seg_bt_off */
    set_arg(k, 4 + i, sizeof(cl_mem), &m[1 + i]);
  set_arg(k, 9, sizeof(cl_mem), &m[7]);
  set_arg(k, 10, sizeof(cl_mem), &m[8]);
  set_arg(k, 11, sizeof(cl_uint), &u_bs);
  set_arg(k, 12, sizeof(cl_ulong), &stride);
  set_arg(k, 13, sizeof(cl_mem), &m[9]);
  set_arg(k, 14, sizeof(cl_uint), &u_sink);
  set_arg(k, 15, sizeof(cl_mem), &m[12]);
  set_arg(k, 16, sizeof(cl_mem), &m[10]);
  set_arg(k, 17, sizeof(cl_mem), &m[11]);
  set_arg(k, 18, sizeof(cl_uint), &u_lse);
  set_arg(k, 19, sizeof(cl_mem), &err);
  /* An SWA-only layer: ratio 0, no compressed branch (lz_compress_test runs the union). */
  cl_uint u_none = 0;
  set_arg(k, 20, sizeof(cl_uint), &u_none);
  for (cl_uint i = 21; i < 26; i++) /* c_cache, its tables and the selection */
    set_arg(k, i, sizeof(cl_mem), NULL);
  set_arg(k, 26, sizeof(cl_uint), &u_none);
  for (uint64_t row0 = 0; row0 < u_rows; row0 += max_rows) {
    uint64_t chunk = u_rows - row0 < max_rows ? u_rows - row0 : max_rows;
    cl_uint u_row0 = (cl_uint)row0;
    set_arg(k, 0, sizeof(cl_uint), &u_row0);
    size_t lsz = DSV4_LZ_GROUP_SIZE;
    size_t gsz = (size_t)((chunk + DSV4_LZ_ROWS_PER_GROUP - 1) / DSV4_LZ_ROWS_PER_GROUP) * lsz;
    check_cl(clEnqueueNDRangeKernel(rt->queue, k, 1, NULL, &gsz, &lsz, 0, NULL, NULL),
             "attention launch");
  }
  check_cl(clEnqueueReadBuffer(rt->queue, m[10], CL_FALSE, 0, b->q_bytes, r->out, 0, NULL, NULL),
           "read attn");
  check_cl(clEnqueueReadBuffer(rt->queue, m[11], CL_FALSE, 0, b->lse_bytes, r->lse, 0, NULL, NULL),
           "read lse");
  check_cl(
      clEnqueueReadBuffer(rt->queue, err, CL_FALSE, 0, sizeof(cl_uint), &r->err, 0, NULL, NULL),
      "read err");
  check_cl(clFinish(rt->queue), "clFinish");
  for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
    clReleaseMemObject(m[i]);
  clReleaseMemObject(err);
}

/*
 * The whole batch through the "level_zero" backend, as the engine runs it: uploads, map_slots,
 * qkv_insert, attention (with the insert's positions), sync, downloads of attn, lse, q_out and the
 * cache.
 */
static void run_attn_lz(dsv4_backend_t *be, const attn_batch_t *b, attn_result_t *r) {
  const attn_case_t *c = b->c;
  uint32_t n = b->n, ns = c->n_seg;
  memset(r->out, ATTN_JUNK, b->q_bytes);
  memset(r->lse, ATTN_JUNK, b->lse_bytes);
  enum { QOUT, POS, SEG, P0, FIRST, OFF, LEN, BT, CACHE, SINK, OUT, LSE, Q, KV, W, SLOTS, N_BUF };
  struct {
    const void *src;
    size_t size;
    dsv4_devbuf_t buf;
  } in[N_BUF] = {
      [QOUT] = {NULL, b->q_bytes, {0}},
      [POS] = {b->pos, n * sizeof(int64_t), {0}},
      [SEG] = {b->tok_seg, n * sizeof(int32_t), {0}},
      [P0] = {b->p0, ns * sizeof(int64_t), {0}},
      [FIRST] = {b->first_lb, ns * sizeof(int64_t), {0}},
      [OFF] = {b->bt_off, ns * sizeof(uint32_t), {0}},
      [LEN] = {b->bt_len, ns * sizeof(uint32_t), {0}},
      [BT] = {b->bt, b->n_bt * sizeof(int32_t), {0}},
      [CACHE] = {b->cache0, b->cache_bytes, {0}},
      [SINK] = {b->sink, c->heads * sizeof(float), {0}},
      [OUT] = {r->out, b->q_bytes, {0}},
      [LSE] = {r->lse, b->lse_bytes, {0}},
      [Q] = {b->q, b->q_bytes, {0}},
      [KV] = {b->kv, (size_t)n * DSV4_HEAD_DIM * 2, {0}},
      [W] = {b->w, sizeof(b->w), {0}},
      [SLOTS] = {NULL, n * sizeof(int64_t), {0}},
  };
  const void *p[N_BUF];
  for (int i = 0; i < N_BUF; i++) {
    if (be->ops->buf_alloc(be, in[i].size, &in[i].buf) != 0)
      die("level_zero buf_alloc(%zu)", in[i].size);
    if (in[i].src && be->ops->upload(be, &in[i].buf, 0, in[i].src, in[i].size) != 0)
      die("level_zero upload");
    p[i] = in[i].buf.ptr;
  }
  dsv4_map_args_t m = {
      .n_tokens = n,
      .n_segments = ns,
      .block_size = c->bs,
      .n_blocks = b->n_blocks,
      .positions = p[POS],
      .tok_seg = p[SEG],
      .seg_first_lb = p[FIRST],
      .seg_bt_off = p[OFF],
      .seg_bt_len = p[LEN],
      .block_table = p[BT],
      .slots = in[SLOTS].buf.ptr,
      .bt_entries = b->n_bt,
  };
  dsv4_insert_args_t a = {
      .n_tokens = n,
      .heads = c->heads,
      .q = p[Q],
      .kv = p[KV],
      .positions = p[POS],
      .slots = in[SLOTS].buf.ptr,
      .rope = b->rope,
      .kv_norm_weight = p[W],
      .eps = 1e-6f,
      .write_kv = 1,
      .q_out = in[QOUT].buf.ptr,
      .cache = in[CACHE].buf.ptr,
      .block_size = c->bs,
      .n_blocks = b->n_blocks,
      .stride = DSV4_BLOCK_STRIDE(c->bs),
  };
  dsv4_attn_args_t aa = attn_args(b, p);
  int rc = be->ops->map_slots(be, &m);
  if (rc == 0)
    rc = be->ops->qkv_insert(be, &a);
  if (rc == 0)
    rc = be->ops->attention(be, &aa);
  if (rc == 0)
    rc = be->ops->sync(be);
  if (rc != 0)
    die("[%s] level_zero launch failed: %s", c->name, dsv4_strerror(rc));
  if (be->ops->download(be, r->out, &in[OUT].buf, 0, b->q_bytes) != 0 ||
      be->ops->download(be, r->lse, &in[LSE].buf, 0, b->lse_bytes) != 0 ||
      be->ops->download(be, r->q_out, &in[QOUT].buf, 0, b->q_bytes) != 0 ||
      be->ops->download(be, r->cache, &in[CACHE].buf, 0, b->cache_bytes) != 0)
    die("level_zero download");
  r->err = 0;
  for (int i = 0; i < N_BUF; i++)
    be->ops->buf_free(be, &in[i].buf);
}

/* Differing bytes of one case's attention outputs (and, through the backend, its q_out and cache).
 */
static size_t attn_diff(const attn_batch_t *b, const attn_result_t *got, const attn_result_t *want,
                        int whole, int run) {
  const char *name = b->c->name;
  size_t bad = diff_bytes(got->out, want->out, b->q_bytes, "attn", name, run);
  if (b->c->want_lse)
    bad += diff_bytes(got->lse, want->lse, b->lse_bytes, "lse", name, run);
  if (whole) {
    bad += diff_bytes(got->q_out, want->q_out, b->q_bytes, "q_out", name, run);
    bad += diff_bytes(got->cache, want->cache, b->cache_bytes, "cache", name, run);
  }
  return bad;
}

/* Every byte of n at p equals ATTN_JUNK: nothing was written there. */
static int attn_untouched(const void *p, size_t n) {
  const uint8_t *u = p;
  for (size_t i = 0; i < n; i++)
    if (u[i] != ATTN_JUNK)
      return 0;
  return 1;
}

/*
 * What the CPU backend refuses, the kernels refuse without writing: each case breaks one valid
 * batch and must set its error bit and leave attn and lse as they were; the valid batch sets none
 * and writes both. No reference is needed.
 */
static int check_attn_errors(clrt_t *rt, dsv4_rope_table_t *plain, dsv4_backend_t *cpu) {
  static const attn_case_t base = {"errors",    8, 16, 0,
                                   SINK_FINITE, 1, 3,  {{0, 300, 2}, {20, 60, 1}, {0, 5, 1}}};
  static const struct {
    const char *what;
    uint32_t bit;
  } cases[] = {
      {"the valid batch", 0},
      {"a candidate's block entry of -1", DSV4_LZ_ERR_MISSING},
      {"a candidate's block before the segment's table", DSV4_LZ_ERR_MISSING},
      {"a token's block after the segment's table", DSV4_LZ_ERR_MISSING},
      {"a block id beyond the pool", DSV4_LZ_ERR_BLOCK},
      {"a candidate's entry past the table length", DSV4_LZ_ERR_TABLE},
      {"a position before its sequence's p0", DSV4_LZ_ERR_POSITION},
      {"a negative position", DSV4_LZ_ERR_POSITION},
      {"a segment index out of range", DSV4_LZ_ERR_SEGMENT},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    attn_batch_t b;
    make_attn_batch(&b, &base, plain, cpu);
    switch (i) {
    case 1:
      b.bt[b.bt_off[0] + 1] = -1;
      break; /* positions 173..300 span blocks 10..18 */
    case 2:
      b.first_lb[0]++, b.bt_off[0]++, b.bt_len[0]--;
      break;
    case 3:
      b.bt_len[0]--;
      break;
    case 4:
      b.bt[b.bt_off[1]] = (int32_t)b.n_blocks;
      break;
    case 5:
      b.n_bt = b.bt_off[2] + b.bt_len[2] - 1;
      break;
    case 6:
      b.p0[1] = b.pos[2] + 1;
      break;
    case 7:
      b.pos[3] = -1;
      break;
    case 8:
      b.tok_seg[1] = 3;
      break;
    }
    attn_result_t r;
    alloc_attn_result(&r, &b);
    run_attn_cl(rt, &b, b.q, b.cache0, 1u << 30, &r);
    int untouched = attn_untouched(r.out, b.q_bytes) && attn_untouched(r.lse, b.lse_bytes);
    if (cases[i].bit == 0 &&
        (r.err || attn_untouched(r.out, b.q_bytes) || attn_untouched(r.lse, b.lse_bytes)))
      die("attention errors: %s: error word 0x%x, attn %s, lse %s", cases[i].what, r.err,
          attn_untouched(r.out, b.q_bytes) ? "not written" : "written",
          attn_untouched(r.lse, b.lse_bytes) ? "not written" : "written");
    if (cases[i].bit && (!(r.err & cases[i].bit) || !untouched))
      die("attention errors: %s: error word 0x%x (expected bit 0x%x), attn and lse %s",
          cases[i].what, r.err, cases[i].bit, untouched ? "untouched" : "WRITTEN");
    printf("attention errors: %s: error word 0x%x, attn and lse %s\n", cases[i].what, r.err,
           untouched ? "untouched" : "written");
    free_attn_result(&r);
    free_attn_batch(&b);
  }
  printf("PASS: attention-errors\n");
  return 0;
}

/* The modes attention, attention-fp64, attention-errors and level-zero-attention. */
static int attention_main(const char *mode) {
  const char *defines = !strcmp(mode, "attention-fp64")         ? "-DDSV4_CL_RMS_FP64"
                        : !strcmp(mode, "level-zero-attention") ? NULL
                                                                : "";
  clrt_t rt = {0};
  device_t dev = {0};
  int rc = open_device(defines, defines && *defines, &rt, &dev);
  if (rc)
    return rc;
  dsv4_backend_options_t opt = {.threads = 2};
  dsv4_backend_t *cpu = NULL;
  char why[256];
  if (dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)) != 0)
    die("cannot open the cpu backend: %s", why);
  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *rope[2] = {NULL, NULL};
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &rope[0]) != 0)
    die("rope table");
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &rope[1]) != 0)
    die("rope table");

  size_t bad = 0, launches = 0;
  if (!strcmp(mode, "attention-errors")) {
    rc = check_attn_errors(&rt, rope[0], cpu);
  } else if (!cpu->ops->attention) {
    printf("skipped: the cpu backend has no attention op, the reference these bytes are compared "
           "with\n");
    rc = 77;
  } else {
    for (size_t ci = 0; ci < sizeof(attn_cases) / sizeof(attn_cases[0]) && !bad; ci++) {
      const attn_case_t *c = &attn_cases[ci];
      attn_batch_t b;
      make_attn_batch(&b, c, rope[c->yarn], cpu);
      attn_result_t want, got;
      alloc_attn_result(&want, &b);
      alloc_attn_result(&got, &b);
      run_attn_cpu(cpu, &b, &want);
      /* Odd launch splits (a multiple of the rows per group) exercise row0. */
      uint32_t max_rows = ci % 2 ? 8u * (1 + inv_below(20)) : 1u << 30;
      for (int run = 0; run < ATTN_RUNS && !bad; run++, launches++) {
        if (dev.cl)
          run_attn_cl(&rt, &b, want.q_out, want.cache, max_rows, &got);
        else
          run_attn_lz(dev.lz, &b, &got);
        if (got.err)
          die("[%s] the kernels set error bits 0x%x on a valid batch", c->name, got.err);
        bad += attn_diff(&b, &got, &want, dev.lz != NULL, run);
      }
      printf("%-50s H=%u N=%u bs=%u: %d runs, %s\n", c->name, c->heads, b.n, c->bs, ATTN_RUNS,
             bad ? "DIFFERENT from the cpu backend" : "byte-identical to the cpu backend");
      free_attn_result(&want);
      free_attn_result(&got);
      free_attn_batch(&b);
    }
    if (bad)
      fprintf(stderr, "FAIL: %zu bytes differ from the cpu backend\n", bad);
    else
      printf("PASS: %s, %zu runs\n", mode, launches);
    rc = bad ? 1 : 0;
  }
  dsv4_backend_close(cpu);
  dsv4_rope_table_destroy(rope[0]);
  dsv4_rope_table_destroy(rope[1]);
  if (dev.cl)
    clrt_close(&rt);
  else
    dsv4_backend_close(dev.lz);
#ifdef DSV4_LZ_FAKE_ZE
  if (fake_ze_live_allocations() != 0)
    die("%zu Level Zero allocations still alive after the backend was closed",
        fake_ze_live_allocations());
#endif
  return rc;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "identity";
  const char *defines = NULL; /* NULL: the level_zero backend instead of OpenCL */
  int counting = 0, fp64 = 0, runs = RUNS;
  if (!strcmp(mode, "identity"))
    defines = "";
  else if (!strcmp(mode, "identity-fp64"))
    defines = "-DDSV4_CL_RMS_FP64", fp64 = 1;
  else if (!strcmp(mode, "one-writer"))
    defines = "-DDSV4_CL_COUNT_STORES", counting = 1, runs = 1;
  else if (!strcmp(mode, "one-writer-broken"))
    defines = "-DDSV4_CL_COUNT_STORES -DDSV4_CL_BROKEN_BULK_STORE", counting = 1, runs = 1;
  else if (!strcmp(mode, "identity-broken"))
    defines = "-DDSV4_CL_BROKEN_BULK_STORE";
  else if (!strcmp(mode, "level-zero"))
    defines = NULL;
  else if (!strcmp(mode, "no-driver"))
    return check_no_driver();
  else if (!strcmp(mode, "attention") || !strcmp(mode, "attention-fp64") ||
           !strcmp(mode, "attention-errors") || !strcmp(mode, "level-zero-attention"))
    return attention_main(mode);
  else
    die("unknown mode %s (identity, identity-fp64, one-writer, one-writer-broken, "
        "identity-broken, level-zero, no-driver, attention, attention-fp64, attention-errors, "
        "level-zero-attention)",
        mode);

  clrt_t rt = {0};
  device_t dev = {0};
  int open_rc = open_device(defines, fp64, &rt, &dev);
  if (open_rc)
    return open_rc;

  float f[DSV4_ROPE_PAIRS];
  dsv4_rope_table_t *plain = NULL, *yarn = NULL;
  dsv4_rope_inv_freq(&dsv4_rope_plain_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &plain) != 0)
    die("rope table");
  dsv4_rope_inv_freq(&dsv4_rope_yarn_default, f);
  if (dsv4_rope_table_create(f, DSV4_MAX_POSITION_DEFAULT, &yarn) != 0)
    die("rope table");
  check_subnormal_vector(&dev, plain);
  if (dev.cl && !strcmp(mode, "identity"))
    check_error_bits(&rt, plain);

  dsv4_backend_options_t opt = {.threads = 2};
  dsv4_backend_t *cpu = NULL;
  char why[256];
  if (dsv4_backend_open("cpu", &opt, &cpu, why, sizeof(why)) != 0)
    die("cannot open the cpu backend: %s", why);

  /* The fixed shapes, then random ones: H 8/64/128, up to 16384 Q rows. */
  size_t n_fixed = sizeof(shapes) / sizeof(shapes[0]), n_shapes = n_fixed + RANDOM_SHAPES;
  shape_t *all = inv_alloc(n_shapes * sizeof(shape_t));
  memcpy(all, shapes, sizeof(shapes));
  for (size_t i = n_fixed; i < n_shapes; i++) {
    static const uint32_t hs[] = {8, 64, 128}, bss[] = {16, 64, 256};
    shape_t *s = &all[i];
    s->heads = hs[inv_below(3)];
    s->n_tokens = 1 + inv_below(16384 / s->heads < 400 ? 16384 / s->heads : 400);
    s->bs = bss[inv_below(3)];
    s->yarn = (int)inv_below(2);
    s->fused = (int)inv_below(2);
    s->replay = inv_below(8) == 0;
    s->random_cache = (int)inv_below(2);
    s->neg_pct = inv_below(40);
  }

  size_t mismatched = 0, wrong_writes = 0, launches = 0;
  for (size_t si = 0; si < n_shapes; si++) {
    const shape_t *s = &all[si];
    dsv4_rope_table_t *rope = s->yarn ? yarn : plain;
    char shape[160];
    shape_str(s, shape, sizeof(shape));
    batch_t b;
    make_batch(&b, s, rope);
    result_t want, got;
    alloc_result(&want, &b, 0);
    alloc_result(&got, &b, counting);
    run_cpu(cpu, &b, rope, &want);
    /* Odd launch splits (a multiple of the rows per group) exercise row0. */
    uint32_t max_rows = si % 2 ? 8u * (1 + inv_below(40)) : 1u << 30;
    size_t bad_here = 0;
    for (int run = 0; run < runs; run++) {
      run_dev(&dev, &b, rope, max_rows, &got);
      launches++;
      if (got.err)
        die("[%s] the kernels set error bits 0x%x on a valid batch", shape, got.err);
      size_t bad =
          diff_bytes(got.slots, want.slots, s->n_tokens * sizeof(int64_t), "slots", shape, run);
      bad += diff_bytes(got.q_out, want.q_out, b.q_bytes, "q_out", shape, run);
      bad += diff_bytes(got.cache, want.cache, b.cache_bytes, "cache", shape, run);
      bad_here += bad;
      if (counting)
        wrong_writes += check_one_writer(&b, &got, shape);
    }
    mismatched += bad_here;
    if (bad_here) /* the first failing batch says enough */
      break;
    printf("%-60s %d run%s, %s\n", shape, runs, runs > 1 ? "s" : "",
           bad_here ? "DIFFERENT from the cpu backend" : "byte-identical to the cpu backend");
    free_result(&want);
    free_result(&got);
    free_batch(&b);
  }

  free(all);
  dsv4_backend_close(cpu);
  dsv4_rope_table_destroy(plain);
  dsv4_rope_table_destroy(yarn);
  if (dev.cl)
    clrt_close(&rt);
  else
    dsv4_backend_close(dev.lz);
#ifdef DSV4_LZ_FAKE_ZE
  /* The backend built against the Level Zero test double: everything it allocated is freed. */
  if (fake_ze_live_allocations() != 0)
    die("%zu Level Zero allocations still alive after the backend was closed",
        fake_ze_live_allocations());
#endif
  if (counting)
    printf("one writer per byte: %zu launches, %zu wrongly stored bytes\n", launches, wrong_writes);
  if (mismatched || wrong_writes) {
    fprintf(stderr, "FAIL: %zu bytes differ from the cpu backend, %zu bytes stored wrongly\n",
            mismatched, wrong_writes);
    return 1;
  }
  printf("PASS: %s, %zu launches\n", mode, launches);
  return 0;
}
