/*
 * A persistent pool of host worker threads (host_pool.h). A launch offers every participant (the
 * workers and the calling thread) the same job; participants take chunks of items from one atomic
 * counter, and the caller returns only after every item is done, so consecutive launches
 * (map_slots, then qkv_insert) are separated by a join as SPEC §5.2 asks of the CPU.
 *
 * A worker must join a launch before it reads the job, and it can join only while the launch is
 * open. Once the caller has seen the item counter run out it closes the launch and waits only for
 * workers that joined. A worker that the scheduler keeps off the CPU (the host may be busy with
 * other work) therefore never delays a launch it did not take part in.
 *
 * Workers spin briefly after a launch before sleeping, because the executor usually launches again
 * within microseconds and a futex wake costs more than a small batch's work. They sleep on a futex
 * of the launch generation (wake_gen), which a launch wakes in one call: every sleeper runs at
 * once, where on a condition variable each woken worker had to take the mutex in turn before it
 * could join.
 */
#include "host_pool.h"

#include <assert.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsv4-error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
/* MXCSR flush-to-zero (bit 15) and denormals-are-zero (bit 6). */
#define MXCSR_FTZ_DAZ 0x8040u
static unsigned read_mxcsr(void) {
  return _mm_getcsr();
}
#else
#define CPU_RELAX() ((void)0)
#define MXCSR_FTZ_DAZ 0u
static unsigned read_mxcsr(void) {
  return 0;
}
#endif

/* Spin iterations before a worker or the caller falls back to sleeping (tens of microseconds). */
#define SPIN_LIMIT 2000

/* A balanced run hands out its items in about this many chunks per participant. */
#define BALANCED_CHUNKS_PER_THREAD 4

/* The launch word: generation in the high 32 bits, a closed flag, and the count of joined workers.
 */
#define W_GEN(w) ((uint32_t)((w) >> 32))
#define W_CLOSED (UINT64_C(1) << 31)
#define W_ACTIVE(w) ((uint32_t)((w)&0x7fffffffu))

typedef struct {
  dsv4_host_pool_t *pool;
  unsigned index;
  pthread_t thread;
} worker_t;

struct dsv4_host_pool {
  unsigned threads; /* participants, including the caller */
  unsigned n_workers;
  worker_t *workers;
  unsigned *start_mxcsr;
  unsigned started; /* workers that have recorded their MXCSR (under mu) */

  pthread_mutex_t mu;
  pthread_cond_t cv_done;
  _Atomic uint64_t word;
  /* The generation of word, for the workers' futex: stored after word, before the wake. */
  _Atomic uint32_t wake_gen;
  atomic_int sleepers; /* workers between deciding to sleep and waking */
  atomic_int stop;
  atomic_int caller_sleeping;

  /* The current launch; written by the caller before it publishes a new generation. */
  dsv4_host_job_fn fn;
  void *arg;
  size_t n_items;
  size_t chunk;
  atomic_size_t next;
};

static void run_chunks(dsv4_host_pool_t *p) {
  for (;;) {
    size_t first = atomic_fetch_add_explicit(&p->next, p->chunk, memory_order_relaxed);
    if (first >= p->n_items)
      break;
    size_t last = first + p->chunk;
    if (last > p->n_items)
      last = p->n_items;
    p->fn(p->arg, first, last);
  }
}

/* Sleep while the futex word at w holds val (or until a wake); spurious returns are fine. */
static void futex_wait(_Atomic uint32_t *w, uint32_t val) {
  (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *w) {
  (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* A new generation published in word: wake the workers that sleep on it. Seen by a worker that is
 * about to sleep either in its check of word (it counted itself first) or here (sleepers). */
static void wake_workers(dsv4_host_pool_t *p, uint32_t gen) {
  atomic_store_explicit(&p->wake_gen, gen, memory_order_seq_cst);
  if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0)
    futex_wake_all(&p->wake_gen);
}

/* Worker: wait for a generation after seen, or the pool's stop; returns the generation. */
static uint32_t await_launch(dsv4_host_pool_t *p, uint32_t seen) {
  uint32_t g = W_GEN(atomic_load_explicit(&p->word, memory_order_acquire));
  for (int spin = 0; g == seen && spin < SPIN_LIMIT; spin++) {
    CPU_RELAX();
    g = W_GEN(atomic_load_explicit(&p->word, memory_order_acquire));
  }
  if (g != seen)
    return g;
  atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
  while ((g = W_GEN(atomic_load_explicit(&p->word, memory_order_seq_cst))) == seen &&
         !atomic_load_explicit(&p->stop, memory_order_seq_cst))
    futex_wait(&p->wake_gen, seen);
  atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_relaxed);
  return g;
}

/* Join the launch of generation gen if it is still open; returns 1 when joined. */
static int try_join(dsv4_host_pool_t *p, uint32_t gen) {
  uint64_t w = atomic_load_explicit(&p->word, memory_order_acquire);
  while (W_GEN(w) == gen && !(w & W_CLOSED))
    if (atomic_compare_exchange_weak_explicit(&p->word, &w, w + 1, memory_order_acq_rel,
                                              memory_order_acquire))
      return 1;
  return 0;
}

static void *worker_main(void *varg) {
  worker_t *w = varg;
  dsv4_host_pool_t *p = w->pool;
  unsigned csr = read_mxcsr();
  pthread_mutex_lock(&p->mu);
  p->start_mxcsr[w->index] = csr;
  p->started++;
  pthread_cond_broadcast(&p->cv_done);
  pthread_mutex_unlock(&p->mu);
  /* SPEC §2: subnormals are honoured, so no executor thread may flush or read them as zero. */
  assert((csr & MXCSR_FTZ_DAZ) == 0);
#ifdef DSV4_TEST_BROKEN_ORDER
  dsv4__host_test_participant = w->index + 1;
#endif
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = await_launch(p, seen);
    if (atomic_load_explicit(&p->stop, memory_order_relaxed))
      break;
    seen = g;
    if (!try_join(p, g))
      continue; /* the launch finished without us */
    run_chunks(p);
    uint64_t before = atomic_fetch_sub_explicit(&p->word, 1, memory_order_seq_cst);
    if ((before & W_CLOSED) && W_ACTIVE(before) == 1 &&
        atomic_load_explicit(&p->caller_sleeping, memory_order_seq_cst)) {
      pthread_mutex_lock(&p->mu);
      pthread_cond_signal(&p->cv_done);
      pthread_mutex_unlock(&p->mu);
    }
  }
  return NULL;
}

int dsv4_host_pool_create(unsigned threads, dsv4_host_pool_t **out) {
  if (threads < 1)
    return DSV4_EINVAL;
  dsv4_host_pool_t *p = calloc(1, sizeof(*p));
  if (!p)
    return DSV4_ENOMEM;
  p->threads = threads;
  p->n_workers = threads - 1;
  p->workers = calloc(threads, sizeof(*p->workers));
  p->start_mxcsr = calloc(threads, sizeof(*p->start_mxcsr));
  if (!p->workers || !p->start_mxcsr) {
    free(p->workers);
    free(p->start_mxcsr);
    free(p);
    return DSV4_ENOMEM;
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv_done, NULL);
  atomic_init(&p->word, 0);
  atomic_init(&p->wake_gen, 0);
  atomic_init(&p->sleepers, 0);
  atomic_init(&p->stop, 0);
  atomic_init(&p->caller_sleeping, 0);
  atomic_init(&p->next, 0);
  unsigned started = 0;
  for (; started < p->n_workers; started++) {
    worker_t *w = &p->workers[started];
    w->pool = p;
    w->index = started;
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0)
      break;
    char name[16]; /* a thread's name has at most 15 characters (the kernel's limit) */
    snprintf(name, sizeof name, "dsv4d-host%u", (started + 1) % 100000u);
    pthread_setname_np(w->thread, name);
  }
  if (started < p->n_workers) {
    p->n_workers = started;
    dsv4_host_pool_destroy(p);
    return DSV4_ENOMEM;
  }
  /* Open returns once every worker runs, so each worker's MXCSR check has happened by then. */
  pthread_mutex_lock(&p->mu);
  while (p->started < p->n_workers)
    pthread_cond_wait(&p->cv_done, &p->mu);
  pthread_mutex_unlock(&p->mu);
  *out = p;
  return 0;
}

void dsv4_host_pool_destroy(dsv4_host_pool_t *p) {
  if (!p)
    return;
  atomic_store(&p->stop, 1);
  /* A new generation wakes spinning workers as well as sleeping ones. */
  uint64_t w = atomic_fetch_add(&p->word, UINT64_C(1) << 32);
  wake_workers(p, W_GEN(w) + 1u);
  for (unsigned i = 0; i < p->n_workers; i++)
    pthread_join(p->workers[i].thread, NULL);
  pthread_cond_destroy(&p->cv_done);
  pthread_mutex_destroy(&p->mu);
  free(p->start_mxcsr);
  free(p->workers);
  free(p);
}

unsigned dsv4_host_pool_threads(const dsv4_host_pool_t *p) {
  return p->threads;
}

unsigned dsv4_host_pool_start_mxcsr(const dsv4_host_pool_t *p, unsigned worker) {
  return worker < p->n_workers ? p->start_mxcsr[worker] : 0;
}

void dsv4_host_pool_run(dsv4_host_pool_t *p, dsv4_host_job_fn fn, void *arg, size_t n_items,
                        size_t chunk) {
  if (n_items == 0)
    return;
  if (chunk == 0)
    chunk = 1;
  /* A launch that fits in one chunk, or a pool without workers, runs on the caller alone. */
  if (p->n_workers == 0 || n_items <= chunk) {
    fn(arg, 0, n_items);
    return;
  }
  p->fn = fn;
  p->arg = arg;
  p->n_items = n_items;
  p->chunk = chunk;
  atomic_store_explicit(&p->next, 0, memory_order_relaxed);
  /* Publish the job: a new generation, open, nobody joined yet. */
  uint32_t gen = W_GEN(atomic_load_explicit(&p->word, memory_order_relaxed)) + 1u;
  atomic_store_explicit(&p->word, (uint64_t)gen << 32, memory_order_seq_cst);
  wake_workers(p, gen);
  run_chunks(p);
  /* Every item is taken: close the launch, then wait for the workers that joined it. */
  uint64_t w = atomic_fetch_or_explicit(&p->word, W_CLOSED, memory_order_acq_rel);
  if (W_ACTIVE(w) == 0)
    return;
  for (int spin = 0; spin < SPIN_LIMIT; spin++) {
    if (W_ACTIVE(atomic_load_explicit(&p->word, memory_order_acquire)) == 0)
      return;
    CPU_RELAX();
  }
  pthread_mutex_lock(&p->mu);
  atomic_store_explicit(&p->caller_sleeping, 1, memory_order_seq_cst);
  while (W_ACTIVE(atomic_load_explicit(&p->word, memory_order_seq_cst)) != 0)
    pthread_cond_wait(&p->cv_done, &p->mu);
  atomic_store_explicit(&p->caller_sleeping, 0, memory_order_relaxed);
  pthread_mutex_unlock(&p->mu);
}

#ifdef DSV4_TEST_BROKEN_ORDER
/* Test-only (tests/unit/inv_determinism.c): which participant this thread is, 0 for the caller. */
_Thread_local unsigned dsv4__host_test_participant;

unsigned dsv4__host_pool_participant(void) {
  return dsv4__host_test_participant;
}
#endif

void dsv4_host_pool_run_balanced(dsv4_host_pool_t *p, dsv4_host_job_fn fn, void *arg,
                                 size_t n_items) {
  size_t chunk = n_items / ((size_t)dsv4_host_pool_threads(p) * BALANCED_CHUNKS_PER_THREAD);
  dsv4_host_pool_run(p, fn, arg, n_items, chunk ? chunk : 1);
}
