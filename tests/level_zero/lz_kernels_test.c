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
 * Exit status: 0 pass, 1 fail, 77 skipped (no OpenCL platform or device, no fp64 for
 * identity-fp64, no Level Zero GPU for level-zero, a Level Zero driver present for no-driver).
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
  cl_kernel map, insert, probe;
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
  rt->counting = strstr(defines, "DSV4_CL_COUNT_STORES") != NULL;
  return 0;
}

static void clrt_close(clrt_t *rt) {
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
  else
    die("unknown mode %s (identity, identity-fp64, one-writer, one-writer-broken, "
        "identity-broken, level-zero, no-driver)",
        mode);

  clrt_t rt = {0};
  device_t dev = {0};
  if (defines) {
    int rc = clrt_open(&rt, defines, fp64);
    if (rc)
      return rc;
    check_fp_probe(&rt);
    dev.cl = &rt;
  } else {
    char lz_why[512];
    int rc = dsv4_backend_open("level_zero", NULL, &dev.lz, lz_why, sizeof(lz_why));
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
