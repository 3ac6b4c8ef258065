/*
 * The CUDA backend's host glue (cuda_backend.h): the backend.h table over the CUDA runtime API and
 * the launch wrappers of cuda-kernels.h.
 *
 * Everything runs on one stream, in submission order: uploads, map_slots, qkv_insert, downloads.
 * That order is the producer/consumer contract of backend.h; with programmatic dependent launch
 * (compute capability 9.0+) the consumer's prologue may overlap the producer, and the kernels wait
 * (griddepcontrol.wait) before they touch mutable memory (SPEC §5.2).
 *
 * Host copies go through a pinned buffer of two halves. An upload copies the caller's bytes into
 * the current half and queues the DMA from there, so it returns without waiting for the device;
 * an event per half, recorded when the uploads move on to the other half, says when its bytes may
 * be overwritten.
 * A download queues the DMA into a half, waits for it and copies out, alternating halves so that
 * the copy-out of one piece overlaps the DMA of the next. Memory given to host_register (shared
 * regions, the daemon's page-locked pool of request bodies and answers) skips the staging: an
 * upload from it queues the DMA straight from the caller's bytes (which stay unchanged until the
 * next sync, backend.h), a download into it queues the DMA straight into them and waits for it,
 * and download_async only queues it (the bytes land by the next sync, which waits for the stream).
 * Registered memory is mapped into the device's address space as well (cudaHostRegisterMapped):
 * host_alias gives launches its device address, so that the engine points the insert at a
 * request's q and kv where the socket or the client wrote them and lets it write q_out straight
 * into the answer, over PCIe in both directions at once, with no copy before or after
 * (DSV4_CUDA_NO_ALIAS=1 turns that off; tests/bench/NOTES.md, "Launches that read and write host
 * memory in place").
 * Pinned memory crosses PCIe several times faster than pageable memory (see tests/bench/NOTES.md,
 * "Figures formerly quoted in kernel comments", cuda_backend: pinned staging); large copies into
 * and out of it run on the host threads
 * (`threads`, the CPU backend's pool), which also validate batches.
 *
 * RoPE rows: per host table (rope.h), a dense device mirror of max_positions rows, allocated at the
 * first launch that uses the table (256 MiB for 1,048,576 positions); every chunk the host has
 * materialised is uploaded once, on the stream, before the next launch. Rows never change once
 * written, which is what lets the consumer read them before its dependency wait.
 *
 * Attention (SPEC §7, exact mode) follows the insert on the same stream, on devices with the
 * shared memory its kernel needs (otherwise the table has no attention op, and the engine says
 * so). A launch that finds a bad token writes nothing and sets a device error word instead; sync
 * reads the word back (only when a launch that checks on the device ran since the last sync) and
 * answers DSV4_EINVAL, clearing it for the next batch.
 *
 * The compressed branch (SPEC §8): compress and indexer on the same stream after the insert, then
 * the union attention, each checking on the device and sharing the error word (a kernel that finds
 * it set writes nothing, so a batch whose compress failed leaves the caches as they were). The
 * indexer scores into a device scratch of keys, grown on demand (dsv4__cuda_indexer); the fast
 * union attention of a small batch splits each token's list and leaves partial states in another
 * (dsv4__cuda_attention), grown the same way.
 *
 * Thread affinity: one thread at a time (the engine's executor), as backend.h says; the CUDA
 * current device is per thread, so every entry point selects the backend's device first.
 */
#include "cuda_backend.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "host_numa.h"
#include "host_pool.h"
#include "cuda-kernels.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "rope.h"

/* Each half of the pinned staging buffer: large enough that a decode batch's uploads share one
 * half, small enough that two of them are cheap to pin. */
#define STAGE_HALF ((size_t)16 << 20)
#define STAGE_ALIGN ((size_t)256)
/* Host copies at least this large are split over the host threads, in pieces of COPY_PIECE (a
 * 64-token decode batch's 4 MiB of q is 32 pieces: every core of a GPU host gets some). */
#define COPY_PARALLEL ((size_t)1 << 20)
#define COPY_PIECE ((size_t)128 << 10)
/* Host tables mirrored at once: the engine has two (plain and YaRN). */
#define MAX_MIRRORS 8
/* Host ranges given to host_register that copies use in place; past this many, a range is still
 * registered but copies to and from it go through the staging. */
#define MAX_REGISTERED 64
#define ROPE_ROW_BYTES (DSV4_ROPE_ROW_FLOATS * sizeof(float))
/* Completion slots of overlapped batches: at most two are in flight (backend.h); four leave room.
 */
#define BATCH_SLOTS 4

/* Device scratch that launches use while they run, grown on demand (scratch_reserve). */
typedef struct {
  void *p;
  uint64_t n; /* elements of the scratch's type */
} scratch_t;

typedef struct {
  const dsv4_rope_table_t *table;
  float *dev; /* positions rows of 64 floats */
  int64_t positions;
  int64_t nchunks;
  uint8_t *have;     /* [nchunks]: 1 once the chunk is on the device */
  size_t seen_bytes; /* dsv4_rope_table_bytes at the last scan */
} rope_mirror_t;

typedef struct {
  dsv4_backend_t base; /* first */
  int dev;
  int pdl;
  cudaStream_t stream;
  uint8_t *pin; /* two halves of STAGE_HALF bytes, pinned */
  size_t used[2];
  int half;
  cudaEvent_t done[2]; /* recorded when the uploads move to the other half, after its last DMA */
  rope_mirror_t mirrors[MAX_MIRRORS];
  int n_mirrors;
  /* Host threads (the CPU backend's pool): batch validation through host_parallel, and the copies
   * between the caller's memory and the pinned staging, which one core cannot feed at PCIe speed.
   */
  dsv4_host_pool_t *pool;
  /* This backend's table: cuda_ops, without attention where the device cannot run it. */
  dsv4_backend_ops_t ops;
  uint32_t *attn_err;      /* device: the error word of attention, compress and indexer */
  uint32_t *attn_err_host; /* pinned: where sync reads it back */
  int attn_pending;        /* a launch that checks on the device since the last sync */
  scratch_t keys;          /* device: the indexer's score keys (uint32) */
  scratch_t part;          /* device: a split fast launch's partial states (float) */
  /* The ranges of host_register, which copies use in place. The list is changed by host_register
   * and host_unregister and read by every copy, possibly on other threads: under reg_lock. */
  pthread_mutex_t reg_lock;
  struct {
    const uint8_t *p;
    size_t n;
    uint8_t *dev; /* the range's device mapping (cudaHostGetDevicePointer) */
  } reg[MAX_REGISTERED];
  int n_reg;
  int alias;      /* host_alias answers (0 with DSV4_CUDA_NO_ALIAS=1) */
  int numa_taken; /* the opening thread took the device node's preference (prefer_device_node) */
  /* Overlapped batches (backend.h, DSV4_BE_OVERLAP): their uploads from registered memory on
   * up_stream, their downloads into it on dn_stream, with events between those and the stream.
   * phase is the DSV4_BATCH_* of the batch being submitted (0 outside one). */
  cudaStream_t up_stream, dn_stream;
  cudaEvent_t ev_alloc, ev_up, ev_kern;
  int phase;
  int alloc_pending; /* a buf_alloc's memset queued on the stream since the last batch's uploads */
  int up_queued;     /* the batch being submitted queued an upload on up_stream */
  int dn_queued;     /* ... a download on dn_stream (which then waits for its launches) */
  int dn_marked;     /* ... a marked download on dn_stream (which waits for its mark only) */
  cudaEvent_t ev_mark[DSV4_MARKS]; /* mark: recorded on the stream */
  uint64_t tickets;                /* batches submitted */
  struct {
    cudaEvent_t done;       /* recorded on dn_stream after the batch's downloads */
    int has_err;            /* the batch's error word was copied into batch_err_host */
  } slot[BATCH_SLOTS];      /* by ticket % BATCH_SLOTS */
  uint32_t *batch_err_host; /* pinned [BATCH_SLOTS]: each batch's error word */
} cuda_backend_t;

static cuda_backend_t *cuda_of(dsv4_backend_t *be) {
  return (cuda_backend_t *)be;
}

/* A CUDA result as a project error code; a failure is also cleared from the thread's last error,
 * so that it is reported once. */
static int cu(cudaError_t e) {
  if (e == cudaSuccess)
    return 0;
  (void)cudaGetLastError();
  return dsv4__cuda_err(e);
}

/* The device this thread last selected through use_device: every entry point selects the
 * backend's, and a batch makes a dozen such calls, so a thread that has it already skips the call.
 * Nothing else in the process selects devices. */
static _Thread_local int thread_dev = -1;

static int use_device(cuda_backend_t *c) {
  if (thread_dev == c->dev)
    return 0;
  int rc = cu(cudaSetDevice(c->dev));
  if (!rc)
    thread_dev = c->dev;
  return rc;
}

typedef struct {
  uint8_t *dst;
  const uint8_t *src;
  size_t n;
} copy_job_t;

static void copy_pieces(void *arg, size_t first, size_t last) {
  const copy_job_t *j = arg;
  size_t lo = first * COPY_PIECE, hi = last * COPY_PIECE < j->n ? last * COPY_PIECE : j->n;
  memcpy(j->dst + lo, j->src + lo, hi - lo);
}

/* memcpy, on every host thread when it is large. */
static void host_copy(cuda_backend_t *c, void *dst, const void *src, size_t n) {
  if (n < COPY_PARALLEL || dsv4_host_pool_threads(c->pool) < 2) {
    memcpy(dst, src, n);
    return;
  }
  copy_job_t j = {dst, src, n};
  dsv4_host_pool_run(c->pool, copy_pieces, &j, (n + COPY_PIECE - 1) / COPY_PIECE, 1);
}

/* The stream is idle: both halves of the staging buffer are free again. */
static void stage_reset(cuda_backend_t *c) {
  c->used[0] = c->used[1] = 0;
  c->half = 0;
}

/*
 * n (<= STAGE_HALF) bytes of pinned space for an upload: in the current half, or in the other one
 * once every DMA that read it has completed. Leaving a half records its event on the stream, after
 * every DMA queued so far (those reading it among them), so one event per switch covers them all.
 */
static int stage_take(cuda_backend_t *c, size_t n, uint8_t **p) {
  size_t need = (n + STAGE_ALIGN - 1) & ~(STAGE_ALIGN - 1);
  if (c->used[c->half] + need > STAGE_HALF) {
    int rc = cu(cudaEventRecord(c->done[c->half], c->stream));
    c->half ^= 1;
    if (!rc)
      rc = cu(cudaEventSynchronize(c->done[c->half]));
    if (rc)
      return rc;
    c->used[c->half] = 0;
  }
  *p = c->pin + (size_t)c->half * STAGE_HALF + c->used[c->half];
  c->used[c->half] += need;
  return 0;
}

/* The device mapping of the n bytes at p when they lie inside one range given to host_register,
 * else NULL. */
static uint8_t *registered_dev(cuda_backend_t *c, const void *p, size_t n) {
  const uint8_t *b = p;
  uint8_t *dev = NULL;
  pthread_mutex_lock(&c->reg_lock);
  for (int i = 0; i < c->n_reg && !dev; i++)
    if (b >= c->reg[i].p && n <= c->reg[i].n && (size_t)(b - c->reg[i].p) <= c->reg[i].n - n)
      dev = c->reg[i].dev + (b - c->reg[i].p);
  pthread_mutex_unlock(&c->reg_lock);
  return dev;
}

/* Whether the n bytes at p lie inside one range given to host_register. */
static int registered(cuda_backend_t *c, const void *p, size_t n) {
  return registered_dev(c, p, n) != NULL;
}

/* Queue a copy of n host bytes to device address dst; returns once src may be reused, except from
 * registered memory, which the DMA reads in place (it stays unchanged until the next sync). */
static int h2d(cuda_backend_t *c, void *dst, const void *src, size_t n) {
  const uint8_t *s = src;
  uint8_t *d = dst;
  if (n && registered(c, src, n))
    return cu(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream));
  while (n) {
    size_t k = n < STAGE_HALF ? n : STAGE_HALF;
    uint8_t *p;
    int rc = stage_take(c, k, &p);
    if (rc)
      return rc;
    host_copy(c, p, s, k);
    rc = cu(cudaMemcpyAsync(d, p, k, cudaMemcpyHostToDevice, c->stream));
    if (rc)
      return rc;
    s += k;
    d += k;
    n -= k;
  }
  return 0;
}

/*
 * Copy n bytes at device address src to host dst, after all work queued before it. Pieces
 * alternate between the halves: the DMA of piece j is queued before piece j - 1 is copied out.
 * The DMAs write pinned memory only after every earlier DMA on the stream (that read it) is done.
 */
static int d2h(cuda_backend_t *c, void *dst, const void *src, size_t n) {
  /* Nothing to copy and nothing waited for: the staging halves may still be read by queued
   * uploads, so they are not reset either. */
  if (n == 0)
    return 0;
  if (registered(c, dst, n)) {
    int rc = cu(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
    if (!rc)
      rc = cu(cudaStreamSynchronize(c->stream));
    if (!rc)
      stage_reset(c);
    return rc;
  }
  const uint8_t *s = src;
  uint8_t *d = dst, *prev_dst = NULL;
  size_t prev_n = 0;
  int j = 0, rc = 0;
  for (; n || prev_n; j++) {
    size_t k = n < STAGE_HALF ? n : STAGE_HALF;
    int h = j & 1;
    if (k) {
      rc = cu(cudaMemcpyAsync(c->pin + (size_t)h * STAGE_HALF, s, k, cudaMemcpyDeviceToHost,
                              c->stream));
      if (!rc)
        rc = cu(cudaEventRecord(c->done[h], c->stream));
      if (rc)
        return rc;
    }
    if (prev_n) {
      rc = cu(cudaEventSynchronize(c->done[h ^ 1]));
      if (rc)
        return rc;
      host_copy(c, prev_dst, c->pin + (size_t)(h ^ 1) * STAGE_HALF, prev_n);
    }
    prev_dst = d;
    prev_n = k;
    s += k;
    d += k;
    n -= k;
  }
  /* Everything queued so far has completed (the last piece waited on its event). */
  stage_reset(c);
  return 0;
}

static void mirror_free(rope_mirror_t *m) {
  if (m->dev)
    (void)cudaFree(m->dev);
  free(m->have);
  memset(m, 0, sizeof(*m));
}

/* Upload the chunks of m's table that the host has materialised since the last scan. */
static int mirror_refresh(cuda_backend_t *c, rope_mirror_t *m) {
  size_t bytes = dsv4_rope_table_bytes(m->table);
  if (bytes == m->seen_bytes)
    return 0;
  for (int64_t k = 0; k < m->nchunks; k++) {
    int64_t rows = 0;
    const float *chunk;
    if (m->have[k] || !(chunk = dsv4_rope_table_chunk(m->table, k, &rows)))
      continue;
    int rc = h2d(c, m->dev + k * DSV4_ROPE_CHUNK_ROWS * DSV4_ROPE_ROW_FLOATS, chunk,
                 (size_t)rows * ROPE_ROW_BYTES);
    if (rc)
      return rc;
    m->have[k] = 1;
  }
  m->seen_bytes = bytes;
  return 0;
}

static int mirrors_refresh(cuda_backend_t *c) {
  for (int i = 0; i < c->n_mirrors; i++) {
    int rc = mirror_refresh(c, &c->mirrors[i]);
    if (rc)
      return rc;
  }
  return 0;
}

/* The mirror of table t, made at its first use, with every materialised chunk queued for upload. */
static int mirror_get(cuda_backend_t *c, const dsv4_rope_table_t *t, rope_mirror_t **out) {
  for (int i = 0; i < c->n_mirrors; i++)
    if (c->mirrors[i].table == t) {
      *out = &c->mirrors[i];
      return mirror_refresh(c, *out);
    }
  if (c->n_mirrors == MAX_MIRRORS)
    return DSV4_ENOSPC;
  rope_mirror_t *m = &c->mirrors[c->n_mirrors];
  m->table = t;
  m->positions = dsv4_rope_table_positions(t);
  m->nchunks = (m->positions + DSV4_ROPE_CHUNK_ROWS - 1) / DSV4_ROPE_CHUNK_ROWS;
  m->have = calloc((size_t)m->nchunks, 1);
  if (!m->have) {
    mirror_free(m);
    return DSV4_ENOMEM;
  }
  int rc = cu(cudaMalloc((void **)&m->dev, (size_t)m->positions * ROPE_ROW_BYTES));
  if (rc) {
    m->dev = NULL;
    mirror_free(m);
    return rc;
  }
  c->n_mirrors++;
  *out = m;
  return mirror_refresh(c, m);
}

/*
 * Page-locked memory near the device. The DMA engine reads a request's bytes from host memory and
 * writes the answer's there; on a host of several NUMA nodes, memory of a node other than the
 * device's costs each transfer a crossing of the processors' link. Unless DSV4_CUDA_NO_NUMA=1 or
 * the operator has set a policy (numactl), the opening thread, and the threads it starts after,
 * prefer the device's node for new pages (host_numa.h): the staging, the daemon's pool, which
 * start-up registers on this thread, and the host threads' memory. Returns the node, or -1 (the
 * daemon's "pinned pool" line says where the pool's pages went).
 */
static int prefer_device_node(int dev) {
  char bus[64];
  unsigned dom, b, d, fn;
  if (cudaDeviceGetPCIBusId(bus, (int)sizeof(bus), dev) != cudaSuccess ||
      sscanf(bus, "%x:%x:%x.%x", &dom, &b, &d, &fn) != 4)
    return -1;
  return dsv4_host_prefer_node(dsv4_pci_numa_node(dom, b, d, fn), "DSV4_CUDA_NO_NUMA");
}

/* The copy streams and events of overlapped batches (NULL members: not made). */
static void overlap_destroy(cuda_backend_t *c) {
  cudaStream_t st[2] = {c->up_stream, c->dn_stream};
  for (int i = 0; i < 2; i++)
    if (st[i])
      (void)cudaStreamDestroy(st[i]);
  cudaEvent_t ev[3] = {c->ev_alloc, c->ev_up, c->ev_kern};
  for (int i = 0; i < 3; i++)
    if (ev[i])
      (void)cudaEventDestroy(ev[i]);
  for (int k = 0; k < BATCH_SLOTS; k++)
    if (c->slot[k].done)
      (void)cudaEventDestroy(c->slot[k].done);
  for (unsigned k = 0; k < DSV4_MARKS; k++)
    if (c->ev_mark[k])
      (void)cudaEventDestroy(c->ev_mark[k]);
  if (c->batch_err_host)
    (void)cudaFreeHost(c->batch_err_host);
}

static void cuda_destroy(dsv4_backend_t *be) {
  cuda_backend_t *c = cuda_of(be);
  (void)cudaSetDevice(c->dev);
  if (c->stream)
    (void)cudaStreamSynchronize(c->stream);
  if (c->up_stream)
    (void)cudaStreamSynchronize(c->up_stream);
  if (c->dn_stream)
    (void)cudaStreamSynchronize(c->dn_stream);
  for (int i = 0; i < c->n_mirrors; i++)
    mirror_free(&c->mirrors[i]);
  for (int h = 0; h < 2; h++)
    if (c->done[h])
      (void)cudaEventDestroy(c->done[h]);
  if (c->pin)
    (void)cudaFreeHost(c->pin);
  if (c->attn_err)
    (void)cudaFree(c->attn_err);
  if (c->attn_err_host)
    (void)cudaFreeHost(c->attn_err_host);
  if (c->keys.p)
    (void)cudaFree(c->keys.p);
  if (c->part.p)
    (void)cudaFree(c->part.p);
  if (c->stream)
    (void)cudaStreamDestroy(c->stream);
  overlap_destroy(c);
  (void)cudaGetLastError();
  if (c->pool)
    dsv4_host_pool_destroy(c->pool);
  pthread_mutex_destroy(&c->reg_lock);
  free(c);
}

/* Device memory, never managed memory: zero-filled by a memset queued on the stream, so every later
 * use (all of it on the stream) sees zeros. */
static int cuda_buf_alloc(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out) {
  cuda_backend_t *c = cuda_of(be);
  void *p = NULL;
  if (!out)
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (!rc)
    rc = cu(cudaMalloc(&p, size ? size : 1));
  if (rc)
    return rc;
  rc = cu(cudaMemsetAsync(p, 0, size, c->stream));
  if (rc) {
    (void)cudaFree(p);
    return rc;
  }
  c->alloc_pending = 1; /* the next batch's uploads wait for the memset */
  out->ptr = p;
  out->size = size;
  return 0;
}

static void cuda_buf_free(dsv4_backend_t *be, dsv4_devbuf_t *buf) {
  cuda_backend_t *c = cuda_of(be);
  if (!buf || !buf->ptr)
    return;
  (void)cudaSetDevice(c->dev);
  /* cudaFree waits for the work that may still use the buffer. */
  (void)cudaFree(buf->ptr);
  (void)cudaGetLastError();
  buf->ptr = NULL;
  buf->size = 0;
}

static int cuda_upload(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                       size_t n) {
  cuda_backend_t *c = cuda_of(be);
  if (!dst || !dst->ptr || off > dst->size || n > dst->size - off || (n && !src))
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (rc)
    return rc;
  /* A batch's upload from registered memory goes on the copy stream, beside the launches of the
   * batch before; from other memory it goes through the staging on the stream, as ever, which
   * orders it before the batch's launches too. */
  if (c->phase == DSV4_BATCH_UPLOADS && n && registered(c, src, n)) {
    c->up_queued = 1;
    return cu(
        cudaMemcpyAsync((uint8_t *)dst->ptr + off, src, n, cudaMemcpyHostToDevice, c->up_stream));
  }
  return h2d(c, (uint8_t *)dst->ptr + off, src, n);
}

static int cuda_download(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                         size_t n) {
  cuda_backend_t *c = cuda_of(be);
  if (!src || !src->ptr || off > src->size || n > src->size - off || (n && !dst))
    return DSV4_EINVAL;
  int rc = use_device(c);
  return rc ? rc : d2h(c, dst, (const uint8_t *)src->ptr + off, n);
}

/* A download that completes at the next sync (backend.h): into registered memory the DMA is only
 * queued, so a batch's outputs cost one stream wait (the sync) instead of one each. Into other
 * memory the bytes go through the staging and the call waits, as download does. */
static int cuda_download_async(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                               size_t n) {
  cuda_backend_t *c = cuda_of(be);
  if (!src || !src->ptr || off > src->size || n > src->size - off || (n && !dst))
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (rc || n == 0)
    return rc;
  const uint8_t *s = (const uint8_t *)src->ptr + off;
  /* In a batch's DOWNLOADS phase the copy stream, which waits for the batch's launches only (the
   * first such download queues that wait). Into other memory the staging on the stream waits for
   * them, as download does. */
  if (!registered(c, dst, n))
    return d2h(c, dst, s, n);
  if (c->phase != DSV4_BATCH_DOWNLOADS)
    return cu(cudaMemcpyAsync(dst, s, n, cudaMemcpyDeviceToHost, c->stream));
  if (!c->dn_queued) {
    rc = cu(cudaEventRecord(c->ev_kern, c->stream));
    if (!rc)
      rc = cu(cudaStreamWaitEvent(c->dn_stream, c->ev_kern, 0));
    if (rc)
      return rc;
    c->dn_queued = 1;
  }
  return cu(cudaMemcpyAsync(dst, s, n, cudaMemcpyDeviceToHost, c->dn_stream));
}

/* A mark (backend.h): an event on the stream, after the launches queued so far. */
static int cuda_mark(dsv4_backend_t *be, unsigned k) {
  cuda_backend_t *c = cuda_of(be);
  if (k >= DSV4_MARKS)
    return DSV4_EINVAL;
  int rc = use_device(c);
  return rc ? rc : cu(cudaEventRecord(c->ev_mark[k], c->stream));
}

/* A marked download (backend.h): into registered memory, on the download stream after mark k's
 * event only, so that it runs beside the launches queued since; into other memory as
 * download_async, after every launch. */
static int cuda_download_marked(dsv4_backend_t *be, unsigned k, void *dst, const dsv4_devbuf_t *src,
                                size_t off, size_t n) {
  cuda_backend_t *c = cuda_of(be);
  if (k >= DSV4_MARKS || !src || !src->ptr || off > src->size || n > src->size - off || (n && !dst))
    return DSV4_EINVAL;
  if (n == 0 || !registered(c, dst, n))
    return cuda_download_async(be, dst, src, off, n);
  int rc = use_device(c);
  if (!rc)
    rc = cu(cudaStreamWaitEvent(c->dn_stream, c->ev_mark[k], 0));
  if (!rc)
    rc = cu(cudaMemcpyAsync(dst, (const uint8_t *)src->ptr + off, n, cudaMemcpyDeviceToHost,
                            c->dn_stream));
  c->dn_marked |= c->phase != 0;
  return rc;
}

/*
 * The producer. The wrapper cannot see the contents of device arrays; the engine builds tok_seg,
 * positions and block tables itself, and the kernel maps a block id outside the pool to slot -1
 * rather than writing past a buffer. Chunks of RoPE rows that appeared since the last launch are
 * queued here, ahead of the producer, so the consumer can follow it at once.
 */
static int cuda_map_slots(dsv4_backend_t *be, const dsv4_map_args_t *a) {
  cuda_backend_t *c = cuda_of(be);
  int rc = use_device(c);
  if (!rc)
    rc = mirrors_refresh(c);
  return rc ? rc : dsv4__cuda_map_slots(a, c->stream, c->pdl);
}

static int cuda_qkv_insert(dsv4_backend_t *be, const dsv4_insert_args_t *a) {
  cuda_backend_t *c = cuda_of(be);
  rope_mirror_t *m;
  if (a && a->n_tokens == 0)
    return dsv4_backend_check_insert_args(a); /* a launch of no tokens needs no pointers */
  if (!a || !a->rope)
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (!rc)
    rc = mirror_get(c, a->rope, &m);
  return rc ? rc : dsv4__cuda_qkv_insert(a, m->dev, m->positions, c->stream, c->pdl);
}

/* Scratch of at least n elements of `size` bytes. cudaFree waits for the launches still using the
 * smaller one, so no queued kernel reads memory freed under it. */
static int scratch_reserve(scratch_t *d, uint64_t n, size_t size) {
  if (n <= d->n)
    return 0;
  if (d->p)
    (void)cudaFree(d->p);
  d->p = NULL;
  d->n = 0;
  int rc = cu(cudaMalloc(&d->p, n * size));
  if (rc) {
    d->p = NULL;
    return rc;
  }
  d->n = n;
  return 0;
}

/*
 * Attention after the insert, on the same stream. The kernels check what the host cannot see (the
 * device copies of positions and block tables); a failure shows in the error word, which sync
 * reads.
 */
static int cuda_attention(dsv4_backend_t *be, const dsv4_attn_args_t *a) {
  cuda_backend_t *c = cuda_of(be);
  rope_mirror_t *m;
  if (a && a->n_tokens == 0)
    return dsv4__cuda_attention(a, NULL, 0, NULL, 0, c->attn_err, c->stream, c->pdl);
  if (!a || !a->rope)
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (!rc)
    rc = mirror_get(c, a->rope, &m);
  /* A fast launch of a small batch splits its tokens' lists: their partial states. */
  if (!rc)
    rc = scratch_reserve(&c->part, dsv4__cuda_attention_part_floats(a), sizeof(float));
  if (!rc) {
    rc = dsv4__cuda_attention(a, m->dev, m->positions, c->part.p, c->part.n, c->attn_err, c->stream,
                              c->pdl);
    c->attn_pending = 1; /* even if a later launch failed: its check kernel may have set the word */
  }
  return rc;
}

/* SPEC §8.3, after the insert: the rows into the rings and the batch's emissions, checked on the
 * device (the error word, as for the attention). The RoPE rows of the emissions come from the
 * table's mirror, refreshed here. */
static int cuda_compress(dsv4_backend_t *be, const dsv4_compress_args_t *a) {
  cuda_backend_t *c = cuda_of(be);
  rope_mirror_t *m;
  if (a && a->n_tokens == 0)
    return dsv4__cuda_compress(a, NULL, 0, c->attn_err, c->stream, c->pdl);
  if (!a || !a->rope)
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (!rc)
    rc = mirror_get(c, a->rope, &m);
  if (!rc) {
    rc = dsv4__cuda_compress(a, m->dev, m->positions, c->attn_err, c->stream, c->pdl);
    c->attn_pending = 1; /* as in cuda_attention */
  }
  return rc;
}

/* SPEC §8.5, after compress: every token's selection, checked on the device. */
static int cuda_indexer(dsv4_backend_t *be, const dsv4_indexer_args_t *a) {
  cuda_backend_t *c = cuda_of(be);
  rope_mirror_t *m;
  if (a && a->n_tokens == 0)
    return dsv4__cuda_indexer(a, NULL, 0, NULL, 0, c->attn_err, c->stream, c->pdl);
  if (!a || !a->rope)
    return DSV4_EINVAL;
  int rc = use_device(c);
  if (!rc)
    rc = mirror_get(c, a->rope, &m);
  if (!rc)
    rc = scratch_reserve(&c->keys,
                         (uint64_t)dsv4__cuda_indexer_ctas(a->n_tokens) *
                             dsv4__cuda_indexer_keys_per_cta(m->positions),
                         sizeof(uint32_t));
  if (!rc) {
    rc = dsv4__cuda_indexer(a, m->dev, m->positions, c->keys.p, c->keys.n, c->attn_err, c->stream,
                            c->pdl);
    c->attn_pending = 1; /* as in cuda_attention */
  }
  return rc;
}

/* The error word, read back by the sync that follows a launch that checks on the device: 0, or
 * DSV4_EINVAL once the word is cleared for the next batch. */
static int attn_err_take(cuda_backend_t *c) {
  c->attn_pending = 0;
  if (*c->attn_err_host == 0)
    return 0;
  int rc = cu(cudaMemsetAsync(c->attn_err, 0, sizeof(uint32_t), c->stream));
  if (!rc)
    rc = cu(cudaStreamSynchronize(c->stream));
  return rc ? rc : DSV4_EINVAL;
}

static int cuda_sync(dsv4_backend_t *be) {
  cuda_backend_t *c = cuda_of(be);
  int rc = use_device(c);
  const int attn = c->attn_pending;
  if (!rc && attn)
    rc = cu(cudaMemcpyAsync(c->attn_err_host, c->attn_err, sizeof(uint32_t), cudaMemcpyDeviceToHost,
                            c->stream));
  if (!rc)
    rc = cu(cudaStreamSynchronize(c->stream));
  /* Every overlapped batch too, and one whose submission stopped part way (backend.h). */
  if (!rc && c->up_stream)
    rc = cu(cudaStreamSynchronize(c->up_stream));
  if (!rc && c->dn_stream)
    rc = cu(cudaStreamSynchronize(c->dn_stream));
  c->phase = 0;
  if (!rc)
    stage_reset(c);
  if (!rc && attn)
    rc = attn_err_take(c);
  return rc;
}

/*
 * The phases of an overlapped batch (backend.h). UPLOADS: the copy stream first waits for the
 * zeroing memsets of buffers allocated since (they run on the stream). LAUNCHES: the stream waits
 * for the batch's uploads. DOWNLOADS: the batch's error word is copied aside on the stream and
 * cleared for the next batch; the download stream waits for the launches once a download is queued
 * there (download_async). SUBMITTED: the batch's completion event, after its downloads, or after
 * its launches on the stream when it queued none (its outputs were written in place).
 */
static int cuda_batch_phase(dsv4_backend_t *be, int phase, uint64_t *ticket) {
  cuda_backend_t *c = cuda_of(be);
  if (phase != c->phase + 1 || phase > DSV4_BATCH_SUBMITTED ||
      (phase == DSV4_BATCH_SUBMITTED && !ticket))
    return DSV4_EINVAL;
  int rc = use_device(c);
  const int k = (int)((c->tickets + 1) % BATCH_SLOTS);
  if (!rc && phase == DSV4_BATCH_UPLOADS && c->alloc_pending) {
    rc = cu(cudaEventRecord(c->ev_alloc, c->stream));
    if (!rc)
      rc = cu(cudaStreamWaitEvent(c->up_stream, c->ev_alloc, 0));
    c->alloc_pending = rc != 0;
  }
  /* A batch whose inputs the launches read in place (host_alias) may have queued no upload there:
   * then they wait for none (each earlier batch's launches waited for its own). */
  if (!rc && phase == DSV4_BATCH_LAUNCHES && c->up_queued) {
    rc = cu(cudaEventRecord(c->ev_up, c->up_stream));
    if (!rc)
      rc = cu(cudaStreamWaitEvent(c->stream, c->ev_up, 0));
  }
  if (phase == DSV4_BATCH_LAUNCHES)
    c->up_queued = 0;
  if (phase == DSV4_BATCH_UPLOADS)
    c->dn_marked = 0;
  if (!rc && phase == DSV4_BATCH_DOWNLOADS) {
    c->slot[k].has_err = c->attn_pending;
    if (c->attn_pending) {
      rc = cu(cudaMemcpyAsync(&c->batch_err_host[k], c->attn_err, sizeof(uint32_t),
                              cudaMemcpyDeviceToHost, c->stream));
      if (!rc)
        rc = cu(cudaMemsetAsync(c->attn_err, 0, sizeof(uint32_t), c->stream));
      c->attn_pending = 0;
    }
    c->dn_queued = 0;
  }
  /* Marked downloads alone on dn_stream: it waits for the batch's launches as well, so that the
   * completion event follows both. */
  if (!rc && phase == DSV4_BATCH_SUBMITTED && c->dn_marked && !c->dn_queued) {
    rc = cu(cudaEventRecord(c->ev_kern, c->stream));
    if (!rc)
      rc = cu(cudaStreamWaitEvent(c->dn_stream, c->ev_kern, 0));
    c->dn_queued = !rc;
  }
  if (!rc && phase == DSV4_BATCH_SUBMITTED) {
    rc = cu(cudaEventRecord(c->slot[k].done, c->dn_queued ? c->dn_stream : c->stream));
    if (!rc)
      *ticket = ++c->tickets;
  }
  /* A failed phase leaves the batch to sync(), which waits for everything. */
  c->phase = rc || phase == DSV4_BATCH_SUBMITTED ? 0 : phase;
  return rc;
}

static int cuda_batch_wait(dsv4_backend_t *be, uint64_t ticket) {
  cuda_backend_t *c = cuda_of(be);
  if (ticket == 0 || ticket > c->tickets)
    return DSV4_EINVAL;
  const int k = (int)(ticket % BATCH_SLOTS);
  int rc = use_device(c);
  if (!rc)
    rc = cu(cudaEventSynchronize(c->slot[k].done));
  if (!rc && c->slot[k].has_err && c->batch_err_host[k])
    rc = DSV4_EINVAL;
  c->slot[k].has_err = 0;
  return rc;
}

static void cuda_host_parallel(dsv4_backend_t *be, void (*fn)(void *arg, size_t first, size_t last),
                               void *arg, size_t n_items) {
  dsv4_host_pool_run_balanced(cuda_of(be)->pool, fn, arg, n_items);
}

/* Host memory (a shared region, SPEC §6.1, or the daemon's pool) page-locked in place, and listed
 * so that copies from and to it are DMA in place. */
static int cuda_host_register(dsv4_backend_t *be, void *p, size_t n) {
  cuda_backend_t *c = cuda_of(be);
  void *dev = NULL;
  int rc = use_device(c);
  if (!rc)
    rc = cu(cudaHostRegister(p, n, cudaHostRegisterMapped));
  if (!rc && (rc = cu(cudaHostGetDevicePointer(&dev, p, 0))) != 0)
    (void)cudaHostUnregister(p);
  if (rc)
    return rc;
  pthread_mutex_lock(&c->reg_lock);
  if (c->n_reg < MAX_REGISTERED) {
    c->reg[c->n_reg].p = p;
    c->reg[c->n_reg].n = n;
    c->reg[c->n_reg].dev = dev;
    c->n_reg++;
  }
  pthread_mutex_unlock(&c->reg_lock);
  return 0;
}

/* The caller has synced since its last copy from or to p (backend.h): no DMA reads it now. */
static void cuda_host_unregister(dsv4_backend_t *be, void *p) {
  cuda_backend_t *c = cuda_of(be);
  pthread_mutex_lock(&c->reg_lock);
  for (int i = 0; i < c->n_reg; i++)
    if (c->reg[i].p == p) {
      c->reg[i] = c->reg[--c->n_reg];
      break;
    }
  pthread_mutex_unlock(&c->reg_lock);
  if (use_device(c) == 0)
    (void)cu(cudaHostUnregister(p));
}

/* Registered memory, aligned for the launches' 16-byte accesses, at its device mapping: a launch
 * reads its inputs there and writes its outputs there over PCIe, in place of a copy each way. */
static void *cuda_host_alias(dsv4_backend_t *be, const void *p, size_t n) {
  cuda_backend_t *c = cuda_of(be);
  if (!c->alias || !p || n == 0 || ((uintptr_t)p & (DSV4_ALIAS_ALIGN - 1)))
    return NULL;
  return registered_dev(c, p, n);
}

static const dsv4_backend_ops_t cuda_ops = {
    .name = "cuda",
    /* Device memory: the engine stages through upload/download; batches may overlap (the copy
     * streams are made at open, which clears the bit when DSV4_CUDA_NO_OVERLAP=1). */
    .caps = DSV4_BE_OVERLAP,
    .destroy = cuda_destroy,
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .download_async = cuda_download_async,
    .batch_phase = cuda_batch_phase,
    .batch_wait = cuda_batch_wait,
    .map_slots = cuda_map_slots,
    .qkv_insert = cuda_qkv_insert,
    .attention = cuda_attention,
    .compress = cuda_compress,
    .indexer = cuda_indexer,
    .sync = cuda_sync,
    .host_parallel = cuda_host_parallel,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .host_alias = cuda_host_alias,
    .mark = cuda_mark,
    .download_marked = cuda_download_marked,
};

/* One line for why: what failed and CUDA's words for it. */
static int fail(cuda_backend_t *c, cudaError_t e, const char *what, char *why, size_t why_len) {
  int rc = cu(e);
  if (why_len)
    snprintf(why, why_len, "cuda: %s: %s", what, cudaGetErrorString(e));
  if (c && c->numa_taken)
    dsv4_host_prefer_undo(); /* another backend may open on this thread next ("auto") */
  if (c)
    cuda_destroy(&c->base);
  return rc;
}

/* The copy streams and events of overlapped batches, or none with DSV4_CUDA_NO_OVERLAP=1 (the
 * engine then runs every batch alone, as a backend without DSV4_BE_OVERLAP). */
static cudaError_t overlap_create(cuda_backend_t *c) {
  const char *off = getenv("DSV4_CUDA_NO_OVERLAP");
  cudaError_t e = cudaSuccess;
  if (off && !strcmp(off, "1")) {
    c->ops.caps &= ~(unsigned)DSV4_BE_OVERLAP;
    c->ops.batch_phase = NULL;
    c->ops.batch_wait = NULL;
    c->ops.mark = NULL; /* a marked download goes on the download stream */
    c->ops.download_marked = NULL;
    return cudaSuccess;
  }
  if (e == cudaSuccess)
    e = cudaStreamCreateWithFlags(&c->up_stream, cudaStreamNonBlocking);
  if (e == cudaSuccess)
    e = cudaStreamCreateWithFlags(&c->dn_stream, cudaStreamNonBlocking);
  cudaEvent_t *ev[3] = {&c->ev_alloc, &c->ev_up, &c->ev_kern};
  for (int i = 0; i < 3 && e == cudaSuccess; i++)
    e = cudaEventCreateWithFlags(ev[i], cudaEventDisableTiming);
  for (int k = 0; k < BATCH_SLOTS && e == cudaSuccess; k++)
    e = cudaEventCreateWithFlags(&c->slot[k].done, cudaEventDisableTiming);
  for (unsigned k = 0; k < DSV4_MARKS && e == cudaSuccess; k++)
    e = cudaEventCreateWithFlags(&c->ev_mark[k], cudaEventDisableTiming);
  if (e == cudaSuccess)
    e = cudaMallocHost((void **)&c->batch_err_host, BATCH_SLOTS * sizeof(uint32_t));
  if (e == cudaSuccess)
    memset(c->batch_err_host, 0, BATCH_SLOTS * sizeof(uint32_t));
  return e;
}

int dsv4_cuda_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                           size_t why_len) {
  int count = 0;
  cudaError_t e;
  if (!out)
    return DSV4_EINVAL;
  /* Every kernel's code loaded when the driver creates the context, not at its first launch (the
   * runtime's default is lazy): the daemon's first batch of each kind would wait for it, a first
   * prefill's launches 0.3-0.5 ms longer on an H100, while start-up took no measurably longer
   * (tests/bench/NOTES.md, "Kernels loaded at start"). An operator's setting is kept. The driver
   * reads it when it initialises, which cudaGetDeviceCount below does in the daemon. */
  (void)setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count < 1) {
    if (why_len)
      snprintf(why, why_len, "no CUDA device (cudaGetDeviceCount: %s)",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    (void)cudaGetLastError();
    return DSV4_ENODEV;
  }
  cuda_backend_t *c = calloc(1, sizeof(*c));
  if (!c) {
    if (why_len)
      snprintf(why, why_len, "cuda backend: out of memory");
    return DSV4_ENOMEM;
  }
  c->ops = cuda_ops;
  c->base.ops = &c->ops;
  c->dev = 0;
  pthread_mutex_init(&c->reg_lock, NULL);
  if ((e = cudaSetDevice(c->dev)) != cudaSuccess)
    return fail(c, e, "cudaSetDevice(0)", why, why_len);
  c->numa_taken = prefer_device_node(c->dev) >= 0;
  if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
    c->stream = NULL;
    return fail(c, e, "cudaStreamCreateWithFlags", why, why_len);
  }
  if ((e = cudaMallocHost((void **)&c->pin, 2 * STAGE_HALF)) != cudaSuccess) {
    c->pin = NULL;
    return fail(c, e, "cudaMallocHost (pinned staging)", why, why_len);
  }
  for (int h = 0; h < 2; h++)
    if ((e = cudaEventCreateWithFlags(&c->done[h], cudaEventDisableTiming)) != cudaSuccess) {
      c->done[h] = NULL;
      return fail(c, e, "cudaEventCreateWithFlags", why, why_len);
    }
  if ((e = overlap_create(c)) != cudaSuccess)
    return fail(c, e, "overlap streams and events", why, why_len);
  c->pdl = dsv4__cuda_pdl_supported(c->dev);
  const char *no_alias = getenv("DSV4_CUDA_NO_ALIAS");
  c->alias = !(no_alias && strcmp(no_alias, "1") == 0);
  if (!dsv4__cuda_attention_supported(c->dev))
    c->ops.attention = NULL;
  else if (dsv4__cuda_attention_fast_supported(c->dev) &&
           dsv4__cuda_attention_fast_union_supported(c->dev))
    c->ops.caps |= DSV4_BE_ATTN_FAST;
  /* Wherever attention runs, so does the fused decode path: a KV-only insert (q_out NULL) and the
   * attention kernels' own Q norm of the raw q (SPEC §7). */
  if (c->ops.attention)
    c->ops.caps |= DSV4_BE_ATTN_FUSED_Q;
  /* The error word of the launches that check on the device (attention, compress, indexer). */
  if ((e = cudaMallocHost((void **)&c->attn_err_host, sizeof(uint32_t))) != cudaSuccess) {
    c->attn_err_host = NULL;
    return fail(c, e, "cudaMallocHost (error word)", why, why_len);
  }
  if ((e = cudaMalloc((void **)&c->attn_err, sizeof(uint32_t))) != cudaSuccess) {
    c->attn_err = NULL;
    return fail(c, e, "cudaMalloc (error word)", why, why_len);
  }
  /* On the stream, ahead of every launch that reads or sets the word. */
  if ((e = cudaMemsetAsync(c->attn_err, 0, sizeof(uint32_t), c->stream)) != cudaSuccess)
    return fail(c, e, "cudaMemsetAsync (error word)", why, why_len);
  unsigned threads = opt ? opt->threads : 0;
  if (threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (unsigned)n : 1;
  }
  if (dsv4_host_pool_create(threads, &c->pool)) {
    c->pool = NULL;
    if (why_len)
      snprintf(why, why_len, "cuda backend: cannot start %u host threads", threads);
    if (c->numa_taken)
      dsv4_host_prefer_undo();
    cuda_destroy(&c->base);
    return DSV4_ENOMEM;
  }
  *out = &c->base;
  return 0;
}
