/*
 * The CPU reference backend (SPEC §2-3): host memory, and a persistent pool of worker threads over
 * tokens (and over heads when a batch has fewer tokens than the pool can keep busy). Every launch
 * is synchronous: map_slots and qkv_insert return once all their work is done, so the join at the
 * end of each launch is the barrier between producer and consumer (SPEC §5.2), and sync() has
 * nothing to wait for.
 */
#include "cpu_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu-internal.h"
#include "dsv4-numerics.h"

#if defined(DSV4_TEST_DELAY_PRODUCER) || defined(DSV4_TEST_BROKEN_NO_JOIN)
#include <pthread.h>
#include <time.h>
#define TEST_PRODUCER 1
#endif

/* Buffers are aligned to a page so vector loads never straddle an allocation's head. */
#define CPU_BUF_ALIGN 4096

/* Default q_out size from which stores bypass the caches (about a server CPU's last-level cache).
 */
#define CPU_STREAM_BYTES (32u << 20)

/* An insert launch is cut into at least this many work items per participant (splitting a token's
 * heads when there are too few tokens), and handed out in about this many chunks per participant:
 * enough to even out uneven progress without a claim per item. */
#define CPU_ITEMS_PER_THREAD 4u
#define CPU_CHUNKS_PER_THREAD 8

#ifdef TEST_PRODUCER
/*
 * Test-only (tests/unit/inv_no_early_read.c, SPEC §5.2): map_slots hands its tokens to producer
 * threads that sleep before they write their slots, so that a consumer which does not wait for the
 * producer reads stale slots. map_slots joins them before it returns, as the pool's join does for
 * real launches; under DSV4_TEST_BROKEN_NO_JOIN it returns at once (the bug the test must catch).
 */
#define TEST_PRODUCERS 4
#define TEST_PRODUCER_DELAY_NS 20000000L

typedef struct {
  dsv4_map_args_t a; /* a copy: the caller's struct may be gone before a broken producer runs */
  uint32_t first, last;
  int rc;
  int running;
  pthread_t thread;
} test_producer_t;
#endif

typedef struct {
  dsv4_backend_t base;
  dsv4_host_pool_t *pool;
  int isa;
  uint64_t stream_bytes; /* q_out bytes per launch from which q_out bypasses the caches */
  dsv4__cpu_attn_scratch_t *attn_scratch;   /* attention workspaces, made by the first launch */
  dsv4__cpu_index_scratch_t *index_scratch; /* indexer workspaces, made by the first scoring one */
#ifdef TEST_PRODUCER
  test_producer_t producers[TEST_PRODUCERS];
#endif
} cpu_backend_t;

/* One qkv_insert launch, shared read-only by every participant. */
typedef struct {
  const dsv4_insert_args_t *a;
  int isa;
  int stream;
  uint32_t groups;          /* work items per token */
  uint32_t heads_per_group; /* the last group of a token may hold fewer */
  uint64_t n_slots;         /* n_blocks * block_size */
} insert_job_t;

static cpu_backend_t *cpu_of(dsv4_backend_t *be) {
  return (cpu_backend_t *)be;
}

static void cpu_destroy(dsv4_backend_t *be) {
  cpu_backend_t *c = cpu_of(be);
#ifdef TEST_PRODUCER
  dsv4__cpu_backend_test_drain(be);
#endif
  dsv4_host_pool_destroy(c->pool);
  dsv4__cpu_attn_scratch_free(c->attn_scratch);
  dsv4__cpu_index_scratch_free(c->index_scratch);
  free(c);
}

static int cpu_buf_alloc(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out) {
  (void)be;
  if (!out)
    return DSV4_EINVAL;
  size_t rounded = (size + CPU_BUF_ALIGN - 1) / CPU_BUF_ALIGN * CPU_BUF_ALIGN;
  if (rounded < size)
    return DSV4_ENOMEM;
  if (rounded == 0)
    rounded = CPU_BUF_ALIGN;
  /* calloc of a large size maps fresh zero pages, so memory becomes resident only when touched;
   * posix_memalign gives no such promise, so over-allocate from calloc and align by hand. */
  void *raw = calloc(1, rounded + CPU_BUF_ALIGN);
  if (!raw)
    return DSV4_ENOMEM;
  uintptr_t p =
      ((uintptr_t)raw + sizeof(void *) + CPU_BUF_ALIGN - 1) & ~(uintptr_t)(CPU_BUF_ALIGN - 1);
  ((void **)p)[-1] = raw;
  out->ptr = (void *)p;
  out->size = size;
  return 0;
}

static void cpu_buf_free(dsv4_backend_t *be, dsv4_devbuf_t *buf) {
  (void)be;
  if (!buf || !buf->ptr)
    return;
  free(((void **)buf->ptr)[-1]);
  buf->ptr = NULL;
  buf->size = 0;
}

static int cpu_upload(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                      size_t n) {
  (void)be;
  if (!dst || off > dst->size || n > dst->size - off || (n && !src))
    return DSV4_EINVAL;
  if (n)
    memcpy((uint8_t *)dst->ptr + off, src, n);
  return 0;
}

static int cpu_download(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                        size_t n) {
  (void)be;
  if (!src || off > src->size || n > src->size - off || (n && !dst))
    return DSV4_EINVAL;
  if (n)
    memcpy(dst, (const uint8_t *)src->ptr + off, n);
  return 0;
}

static int cpu_sync(dsv4_backend_t *be) {
  (void)be;
  return 0;
}

#ifdef TEST_PRODUCER
static int cpu_map_slots(dsv4_backend_t *be, const dsv4_map_args_t *a);
/* Set on producer threads: their map_slots call maps its tokens itself. */
static _Thread_local int test_in_producer;

static void *test_producer_main(void *varg) {
  test_producer_t *p = varg;
  struct timespec ts = {0, TEST_PRODUCER_DELAY_NS};
  while (nanosleep(&ts, &ts) != 0) {
  }
  test_in_producer = 1;
  p->rc = cpu_map_slots(NULL, &p->a);
  return NULL;
}

/* Joins every running producer; returns the first error among them. */
static int test_join_producers(cpu_backend_t *c) {
  int rc = 0;
  for (unsigned i = 0; i < TEST_PRODUCERS; i++) {
    test_producer_t *p = &c->producers[i];
    if (!p->running)
      continue;
    pthread_join(p->thread, NULL);
    p->running = 0;
    if (rc == 0)
      rc = p->rc;
  }
  return rc;
}

void dsv4__cpu_backend_test_drain(dsv4_backend_t *be) {
  (void)test_join_producers(cpu_of(be));
}

/* Each producer gets the launch's arguments narrowed to its own range of tokens. */
static int test_delayed_map(cpu_backend_t *c, const dsv4_map_args_t *a) {
  (void)test_join_producers(c);
  uint32_t per = (a->n_tokens + TEST_PRODUCERS - 1) / TEST_PRODUCERS;
  int rc = 0;
  for (unsigned i = 0; i < TEST_PRODUCERS; i++) {
    test_producer_t *p = &c->producers[i];
    uint32_t first = i * per < a->n_tokens ? i * per : a->n_tokens;
    uint32_t last = first + per < a->n_tokens ? first + per : a->n_tokens;
    p->a = *a;
    p->a.n_tokens = last - first;
    p->a.positions = a->positions + first;
    p->a.tok_seg = a->tok_seg + first;
    p->a.slots = a->slots + first;
    p->rc = 0;
    if (pthread_create(&p->thread, NULL, test_producer_main, p) != 0) {
      rc = DSV4_ENOMEM;
      break;
    }
    p->running = 1;
  }
#ifdef DSV4_TEST_BROKEN_NO_JOIN
  if (rc == 0)
    return 0; /* the broken producer: no join, the consumer may run before the slots exist */
#endif
  int jrc = test_join_producers(c);
  return rc ? rc : jrc;
}
#endif

/*
 * The slot mapper is a few integer operations per token, far cheaper than waking the pool, so it
 * runs on the calling thread; the arguments are checked in full before the first slot is written.
 */
static int cpu_map_slots(dsv4_backend_t *be, const dsv4_map_args_t *a) {
  (void)be;
  int rc = dsv4_backend_check_map_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  const int64_t bs = a->block_size;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int32_t s = a->tok_seg[t];
    if (s < 0 || (uint32_t)s >= a->n_segments || a->positions[t] < 0)
      return DSV4_EINVAL;
  }
  /* Every segment's table lies within bt_entries (when given) and every block id it maps is in
   * the pool, so a bad launch writes no slot at all. */
  for (uint32_t s = 0; s < a->n_segments; s++) {
    if (a->bt_entries && (uint64_t)a->seg_bt_off[s] + a->seg_bt_len[s] > a->bt_entries)
      return DSV4_EINVAL;
    for (uint32_t i = 0; i < a->seg_bt_len[s]; i++)
      if (a->block_table[(uint64_t)a->seg_bt_off[s] + i] >= (int64_t)a->n_blocks)
        return DSV4_EINVAL;
  }
#ifdef TEST_PRODUCER
  if (!test_in_producer)
    return test_delayed_map(cpu_of(be), a);
#endif
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    uint32_t s = (uint32_t)a->tok_seg[t];
    int64_t pos = a->positions[t];
    int64_t idx = pos / bs - a->seg_first_lb[s];
    int64_t slot = -1;
    if (idx >= 0 && idx < (int64_t)a->seg_bt_len[s]) {
      int32_t b = a->block_table[(uint64_t)a->seg_bt_off[s] + (uint64_t)idx];
      if (b >= 0)
        slot = (int64_t)b * bs + pos % bs;
    }
    a->slots[t] = slot;
  }
  return 0;
}

static void insert_items(void *varg, size_t first, size_t last) {
  const insert_job_t *j = varg;
  const dsv4_insert_args_t *a = j->a;
  for (size_t item = first; item < last; item++) {
    size_t t = item / j->groups;
    uint32_t g = (uint32_t)(item % j->groups);
    uint32_t h0 = g * j->heads_per_group;
    uint32_t nh = a->heads - h0 < j->heads_per_group ? a->heads - h0 : j->heads_per_group;
    const float *row = dsv4_rope_table_row(a->rope, a->positions[t]);
    size_t qoff = (t * a->heads + h0) * (size_t)DSV4_HEAD_DIM;
    dsv4__cpu_q_heads(j->isa, a->q + qoff, a->q_out + qoff, nh, row, a->eps, j->stream);
    /* The token's single KV record is the job of its first head group. */
    int64_t slot = a->slots[t];
    if (g == 0 && a->write_kv && slot >= 0) {
      uint64_t block = (uint64_t)slot / a->block_size;
      uint64_t o = (uint64_t)slot % a->block_size;
      uint8_t *base = a->cache + block * a->stride;
      dsv4__cpu_kv_token(j->isa, a->kv + t * DSV4_HEAD_DIM, row, a->kv_norm_weight, a->eps,
                         base + DSV4_TOKEN_DATA_OFFSET(o),
                         base + DSV4_SCALE_OFFSET(a->block_size, o));
    }
  }
}

static int cpu_qkv_insert(dsv4_backend_t *be, const dsv4_insert_args_t *a) {
  cpu_backend_t *c = cpu_of(be);
  int rc = dsv4_backend_check_insert_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  if (!a->rope)
    return DSV4_EINVAL;
  insert_job_t j = {.a = a, .isa = c->isa};
  /* A q_out larger than the caches would only evict the next batch's inputs on its way out. */
  j.stream = (uint64_t)a->n_tokens * a->heads * DSV4_HEAD_DIM * 2 >= c->stream_bytes;
  if (a->write_kv) {
    j.n_slots = (uint64_t)a->n_blocks * a->block_size;
    /* Every slot is checked before anything is written, so a bad batch changes nothing. */
    for (uint32_t t = 0; t < a->n_tokens; t++)
      if (a->slots[t] >= (int64_t)j.n_slots)
        return DSV4_EINVAL;
  }
  /*
   * Work items: a token, or a group of a token's heads when there are too few tokens to keep every
   * participant busy. The split only changes which thread computes a value, never the value.
   */
  unsigned threads = dsv4_host_pool_threads(c->pool);
  uint32_t groups = 1;
  if (threads > 1 && a->n_tokens < CPU_ITEMS_PER_THREAD * threads) {
    groups = (CPU_ITEMS_PER_THREAD * threads + a->n_tokens - 1) / a->n_tokens;
    if (groups > a->heads)
      groups = a->heads;
  }
  j.heads_per_group = (a->heads + groups - 1) / groups;
  j.groups = (a->heads + j.heads_per_group - 1) / j.heads_per_group;
  size_t items = (size_t)a->n_tokens * j.groups;
  size_t chunk = items / ((size_t)threads * CPU_CHUNKS_PER_THREAD);
  if (chunk == 0)
    chunk = 1;
  /* A launch this small is done by the caller in less time than a worker takes to wake up (see
   * tests/bench/NOTES.md, "Figures formerly quoted in kernel comments", cpu_backend). */
  if ((uint64_t)a->n_tokens * a->heads * DSV4_HEAD_DIM * 2 < DSV4__CPU_INLINE_Q_BYTES)
    chunk = items;
  dsv4_host_pool_run(c->pool, insert_items, &j, items, chunk);
  return 0;
}

static int cpu_attention(dsv4_backend_t *be, const dsv4_attn_args_t *a) {
  cpu_backend_t *c = cpu_of(be);
  return dsv4__cpu_attention(c->pool, c->isa, &c->attn_scratch, a);
}

static int cpu_compress(dsv4_backend_t *be, const dsv4_compress_args_t *a) {
  cpu_backend_t *c = cpu_of(be);
  return dsv4__cpu_compress(c->pool, c->isa, a);
}

static int cpu_indexer(dsv4_backend_t *be, const dsv4_indexer_args_t *a) {
  cpu_backend_t *c = cpu_of(be);
  return dsv4__cpu_indexer(c->pool, c->isa, &c->index_scratch, a);
}

static void cpu_host_parallel(dsv4_backend_t *be, void (*fn)(void *arg, size_t first, size_t last),
                              void *arg, size_t n_items) {
  dsv4_host_pool_run_balanced(cpu_of(be)->pool, fn, arg, n_items);
}

static const dsv4_backend_ops_t cpu_ops = {
    .name = "cpu",
    .caps = DSV4_BE_HOST_MEMORY,
    .destroy = cpu_destroy,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .map_slots = cpu_map_slots,
    .qkv_insert = cpu_qkv_insert,
    .attention = cpu_attention,
    .compress = cpu_compress,
    .indexer = cpu_indexer,
    .sync = cpu_sync,
    .host_parallel = cpu_host_parallel,
};

int dsv4_cpu_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                          size_t why_len) {
  if (!out)
    return DSV4_EINVAL;
  unsigned threads = opt ? opt->threads : 0;
  if (threads == 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (unsigned)n : 1;
  }
  cpu_backend_t *c = calloc(1, sizeof(*c));
  if (!c) {
    if (why_len)
      snprintf(why, why_len, "cpu backend: out of memory");
    return DSV4_ENOMEM;
  }
  c->base.ops = &cpu_ops;
  c->isa = dsv4__cpu_isa_best();
  c->stream_bytes = CPU_STREAM_BYTES;
  int err = dsv4_host_pool_create(threads, &c->pool);
  if (err) {
    if (why_len)
      snprintf(why, why_len, "cpu backend: cannot start %u worker threads", threads);
    free(c);
    return err;
  }
  *out = &c->base;
  return 0;
}

int dsv4__cpu_backend_set_isa(dsv4_backend_t *be, int isa) {
  if (!dsv4__cpu_isa_supported(isa))
    return DSV4_EUNSUPPORTED;
  cpu_of(be)->isa = isa;
  return 0;
}

void dsv4__cpu_backend_set_stream_bytes(dsv4_backend_t *be, uint64_t bytes) {
  cpu_of(be)->stream_bytes = bytes;
}

unsigned dsv4__cpu_backend_workers(dsv4_backend_t *be) {
  return dsv4_host_pool_threads(cpu_of(be)->pool) - 1;
}

unsigned dsv4__cpu_backend_worker_mxcsr(dsv4_backend_t *be, unsigned worker) {
  return dsv4_host_pool_start_mxcsr(cpu_of(be)->pool, worker);
}
