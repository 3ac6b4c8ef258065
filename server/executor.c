#include "executor.h"

#include <assert.h>
#include <errno.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "dsv4-error.h"

/* The tick (the idle-sequence sweep) runs about once per this period, also while no batch comes. */
#define TICK_S 1
#define TICK_NS (TICK_S * 1000000000u)
/* MXCSR flush-to-zero (bit 15) and denormals-are-zero (bit 6). */
#define MXCSR_FTZ_DAZ 0x8040u

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Whether the tick is due (executor thread). */
static int tick_due(const dsv4_executor_t *ex, uint64_t now) {
  return ex->tick && now - ex->last_tick_ns >= TICK_NS;
}

/* Executor thread, under mu (released during the tick): the tick when it is due and no job runs on
 * the loop thread (which may not start one while it runs). */
static void run_tick(dsv4_executor_t *ex) {
  const uint64_t now = now_ns();
  if (ex->here || !tick_due(ex, now))
    return;
  ex->last_tick_ns = now;
  ex->ticking = 1;
  pthread_mutex_unlock(&ex->mu);
  ex->tick(ex->tick_arg);
  pthread_mutex_lock(&ex->mu);
  ex->ticking = 0;
}

/* Whether job shares a key with other. */
static int shares_key(const dsv4_job_t *job, const dsv4_job_t *other) {
  for (uint32_t i = 0; i < other->n_keys; i++)
    for (uint32_t k = 0; k < job->n_keys; k++)
      if (other->keys[i] == job->keys[k])
        return 1;
  return 0;
}

/* Whether job shares a key with any job from head up to (not including) job. */
static int blocked(const dsv4_job_t *head, const dsv4_job_t *job) {
  for (const dsv4_job_t *a = head; a != job; a = a->next)
    if (shares_key(job, a))
      return 1;
  return 0;
}

/* Under mu: take job (after prev, or the head when prev is NULL) out of the waiting queue. */
static dsv4_job_t *unlink_job(dsv4_executor_t *ex, dsv4_job_t *prev, dsv4_job_t *job) {
  if (prev)
    prev->next = job->next;
  else
    ex->q_head = job->next;
  if (ex->q_tail == job)
    ex->q_tail = prev;
  ex->waiting[job->cls]--;
  return job;
}

/* Under mu, with a job waiting: the next one to run (*prev: the job before it, or NULL). The oldest
 * job that is not a prefill and passes nothing it shares a key with, else the oldest job (which
 * passes nothing). */
static dsv4_job_t *peek_next(dsv4_executor_t *ex, dsv4_job_t **prev) {
  dsv4_job_t *p = NULL, *job = ex->q_head;
  for (; job; p = job, job = job->next)
    if (job->cls != DSV4_JOB_PREFILL && !blocked(ex->q_head, job))
      break;
  if (!job) {
    p = NULL;
    job = ex->q_head;
  }
  *prev = p;
  return job;
}

/* Under mu, with a job waiting: unlink the next one to run. */
static dsv4_job_t *take_next(dsv4_executor_t *ex) {
  dsv4_job_t *prev, *job = peek_next(ex, &prev);
  return unlink_job(ex, prev, job);
}

/* Under mu: unlink the next job to run when it may begin while fly is in flight (it has begin and
 * shares no key with fly), else return NULL. */
static dsv4_job_t *take_overlap(dsv4_executor_t *ex, const dsv4_job_t *fly) {
  dsv4_job_t *prev, *job = ex->q_head ? peek_next(ex, &prev) : NULL;
  if (!job || !job->begin || shares_key(job, fly))
    return NULL;
  return unlink_job(ex, prev, job);
}

/* Under mu: unlink the oldest waiting decode that may pass running and every job ahead of it, or
 * return NULL. */
static dsv4_job_t *take_decode(dsv4_executor_t *ex, const dsv4_job_t *running) {
  dsv4_job_t *prev = NULL, *job = ex->q_head;
  for (; job; prev = job, job = job->next)
    if (job->cls == DSV4_JOB_DECODE && !shares_key(job, running) && !blocked(ex->q_head, job))
      break;
  return job ? unlink_job(ex, prev, job) : NULL;
}

/* Executor thread: queue a finished job for the loop thread. */
static void finish_job(dsv4_executor_t *ex, dsv4_job_t *job) {
  pthread_mutex_lock(&ex->mu);
  if (ex->d_tail)
    ex->d_tail->next = job;
  else
    ex->d_head = job;
  ex->d_tail = job;
  pthread_mutex_unlock(&ex->mu);
  atomic_fetch_add_explicit(&ex->finishes, 1, memory_order_release);
  uv_async_send(&ex->async);
}

/* Executor thread: run one job and queue it for the loop thread. */
static void run_job(dsv4_executor_t *ex, dsv4_job_t *job) {
  job->t_start_ns = now_ns();
  job->next = NULL;
  job->run(job);
  finish_job(ex, job);
}

/* Executor thread: begin job (alone: nothing else in flight); returns it when it is in flight,
 * else NULL (it finished, and is queued for the loop thread). */
static dsv4_job_t *begin_job(dsv4_executor_t *ex, dsv4_job_t *job, int alone) {
  int st = job->begin(job, alone);
  if (st == DSV4_JOB_IN_FLIGHT)
    return job;
  finish_job(ex, job);
  return NULL;
}

/*
 * Executor thread: run a job that has begin/end. While one is in flight, the job that would run
 * next begins beside it when it may (take_overlap), then the one in flight ends; a job that
 * defers begins once the one in flight has ended. Returns with nothing in flight, so a drain
 * finishes everything it began. A tick that falls due ends the chain too: it uses the engine
 * (the expiry sweep), which no batch may have in flight, and a steady stream of overlapping
 * batches must not hold idle sequences' blocks past their timeout.
 */
static void run_overlapped(dsv4_executor_t *ex, dsv4_job_t *job) {
  job->t_start_ns = now_ns();
  job->next = NULL;
  dsv4_job_t *fly = begin_job(ex, job, 1);
  while (fly) {
    pthread_mutex_lock(&ex->mu);
    dsv4_job_t *nx = tick_due(ex, now_ns()) ? NULL : take_overlap(ex, fly);
    pthread_mutex_unlock(&ex->mu);
    dsv4_job_t *next_fly = NULL;
    if (nx) {
      nx->t_start_ns = now_ns();
      nx->next = NULL;
      int st = nx->begin(nx, 0);
      if (st == DSV4_JOB_DEFER) {
        fly->end(fly);
        finish_job(ex, fly);
        fly = NULL;
        next_fly = begin_job(ex, nx, 1);
      } else if (st == DSV4_JOB_IN_FLIGHT) {
        next_fly = nx;
      } else {
        finish_job(ex, nx);
      }
    }
    if (fly) {
      fly->end(fly);
      finish_job(ex, fly);
    }
    fly = next_fly;
  }
}

uint32_t dsv4_executor_yield(dsv4_executor_t *ex, const dsv4_job_t *running) {
  pthread_mutex_lock(&ex->mu);
  /* Only the decodes waiting now: a steady stream of new ones cannot hold the prefill up. */
  uint32_t budget = ex->waiting[DSV4_JOB_DECODE], ran = 0;
  while (ran < budget) {
    dsv4_job_t *job = take_decode(ex, running);
    if (!job)
      break;
    pthread_mutex_unlock(&ex->mu);
    run_job(ex, job);
    ran++;
    pthread_mutex_lock(&ex->mu);
  }
  pthread_mutex_unlock(&ex->mu);
  return ran;
}

/* Under mu with nothing queued: with busy polling, wait for a submit by spinning (mu released) for
 * up to the window, so that a batch that comes soon does not wait for the thread's wake-up. */
static void spin_for_work(dsv4_executor_t *ex) {
  if (!ex->poll_ns || ex->q_head || ex->stopping)
    return;
  const uint64_t seen = atomic_load_explicit(&ex->submits, memory_order_relaxed);
  const uint64_t until = now_ns() + ex->poll_ns;
  pthread_mutex_unlock(&ex->mu);
  for (uint32_t i = 1; atomic_load_explicit(&ex->submits, memory_order_relaxed) == seen; i++) {
    if (!(i & 63) && now_ns() >= until)
      break;
    CPU_RELAX();
  }
  pthread_mutex_lock(&ex->mu);
}

static void *executor_main(void *arg) {
  dsv4_executor_t *ex = arg;
#if defined(__x86_64__) || defined(__i386__)
  /* SPEC §2: subnormals are honoured on every thread that computes; FTZ (bit 15) and DAZ (bit 6).
   */
  assert((_mm_getcsr() & MXCSR_FTZ_DAZ) == 0);
#endif
  pthread_mutex_lock(&ex->mu);
  for (;;) {
    spin_for_work(ex);
    /* A job on the loop thread (here) holds the engine: nothing starts until it returns. */
    while ((!ex->q_head || ex->here) && !ex->stopping) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_sec += TICK_S;
      ex->sleeping = 1;
      pthread_cond_timedwait(&ex->cv, &ex->mu, &ts);
      ex->sleeping = 0;
      if (!ex->q_head && !ex->stopping)
        run_tick(ex);
    }
    if (!ex->q_head)
      break; /* stopping and nothing left */
    dsv4_job_t *job = take_next(ex);
    pthread_mutex_unlock(&ex->mu);
    if (job->begin)
      run_overlapped(ex, job);
    else
      run_job(ex, job);
    pthread_mutex_lock(&ex->mu);
    run_tick(ex);
  }
  pthread_mutex_unlock(&ex->mu);
  return NULL;
}

static void on_idle(uv_idle_t *h);

/* Loop thread: keep the loop polling for the busy-poll window from now. */
static void poll_on(dsv4_executor_t *ex) {
  if (!ex->poll_ns || ex->stopping) /* stopping: written by the loop thread (stop) */
    return;
  ex->poll_until_ns = now_ns() + ex->poll_ns;
  if (!ex->idle_on && uv_idle_start(&ex->idle, on_idle) == 0)
    ex->idle_on = 1;
}

/* Loop thread: hand every finished job back, in completion order. */
static void on_async(uv_async_t *h) {
  dsv4_executor_t *ex = (dsv4_executor_t *)h;
  pthread_mutex_lock(&ex->mu);
  dsv4_job_t *list = ex->d_head;
  ex->d_head = ex->d_tail = NULL;
  pthread_mutex_unlock(&ex->mu);
  if (list)
    poll_on(ex);
  while (list) {
    dsv4_job_t *next = list->next;
    pthread_mutex_lock(&ex->mu);
    ex->queued--;
    pthread_mutex_unlock(&ex->mu);
    list->done(list);
    list = next;
  }
}

/* Loop thread, every loop iteration while busy polling: hand back what finished without waiting
 * for the async wake-up; stop polling once the window has passed. */
static void on_idle(uv_idle_t *h) {
  dsv4_executor_t *ex = (dsv4_executor_t *)((char *)h - offsetof(dsv4_executor_t, idle));
  const uint64_t f = atomic_load_explicit(&ex->finishes, memory_order_acquire);
  if (f != ex->finishes_seen) {
    ex->finishes_seen = f;
    on_async(&ex->async);
  }
  if (now_ns() >= ex->poll_until_ns) {
    uv_idle_stop(h);
    ex->idle_on = 0;
  }
}

int dsv4_executor_start(dsv4_executor_t *ex, uv_loop_t *loop, uint32_t max_queue,
                        void (*tick)(void *), void *tick_arg) {
  int rc;
  ex->loop = loop;
  ex->q_head = ex->q_tail = ex->d_head = ex->d_tail = NULL;
  ex->queued = 0;
  for (int c = 0; c < DSV4_JOB_CLASSES; c++)
    ex->waiting[c] = 0;
  ex->max_queue = max_queue ? max_queue : 1;
  ex->stopping = 0;
  ex->here = ex->ticking = 0;
  ex->tick = tick;
  ex->tick_arg = tick_arg;
  ex->last_tick_ns = now_ns();
  ex->poll_ns = 0;
  atomic_init(&ex->submits, 0);
  atomic_init(&ex->finishes, 0);
  ex->sleeping = 0;
  ex->idle_on = 0;
  ex->poll_until_ns = ex->finishes_seen = 0;
  if (uv_idle_init(loop, &ex->idle))
    return DSV4_EIO;
  if (uv_async_init(loop, &ex->async, on_async)) {
    uv_close((uv_handle_t *)&ex->idle, NULL);
    return DSV4_EIO;
  }
  pthread_mutex_init(&ex->mu, NULL);
  pthread_cond_init(&ex->cv, NULL);
  rc = pthread_create(&ex->thread, NULL, executor_main, ex);
  if (rc == 0)
    pthread_setname_np(ex->thread, "dsv4d-exec"); /* a name for top -H and /proc/PID/task */
  if (rc) {
    uv_close((uv_handle_t *)&ex->idle, NULL);
    uv_close((uv_handle_t *)&ex->async, NULL);
    return DSV4_ENOMEM;
  }
  ex->started = 1;
  return 0;
}

static void enqueue(dsv4_executor_t *ex, dsv4_job_t *job) {
  job->next = NULL;
  job->t_submit_ns = now_ns();
  if (ex->q_tail)
    ex->q_tail->next = job;
  else
    ex->q_head = job;
  ex->q_tail = job;
  ex->queued++;
  ex->waiting[job->cls]++;
  atomic_fetch_add_explicit(&ex->submits, 1, memory_order_relaxed);
}

void dsv4_executor_set_busy_poll(dsv4_executor_t *ex, uint32_t us) {
  pthread_mutex_lock(&ex->mu);
  ex->poll_ns = (uint64_t)us * 1000u;
  pthread_mutex_unlock(&ex->mu);
}

/* The executor is woken after mu is released: signalled while the submitter still held it, it
 * would wake only to block on mu, and the unlock would have to wake it a second time. It is
 * signalled only when it sleeps on cv: otherwise (running a job or the tick, spinning) it looks at
 * the queue, under mu, before it sleeps. */
int dsv4_executor_submit(dsv4_executor_t *ex, dsv4_job_t *job) {
  int rc = 0, wake = 0;
  pthread_mutex_lock(&ex->mu);
  if (ex->stopping)
    rc = DSV4_EDRAIN;
  else if (ex->queued >= ex->max_queue)
    rc = DSV4_EQUEUE;
  else
    enqueue(ex, job);
  wake = !rc && ex->sleeping;
  pthread_mutex_unlock(&ex->mu);
  if (wake)
    pthread_cond_signal(&ex->cv);
  if (!rc)
    poll_on(ex);
  return rc;
}

int dsv4_executor_run_here(dsv4_executor_t *ex, dsv4_job_t *job) {
  pthread_mutex_lock(&ex->mu);
  /* queued counts the jobs waiting, running and not yet handed back */
  const int ok = !ex->stopping && !ex->queued && !ex->ticking;
  ex->here = ok;
  pthread_mutex_unlock(&ex->mu);
  if (!ok)
    return 0;
  job->next = NULL;
  job->t_submit_ns = job->t_start_ns = now_ns();
  job->run(job);
  pthread_mutex_lock(&ex->mu);
  ex->here = 0;
  const int wake = ex->q_head && ex->sleeping; /* a submit while here left it asleep */
  pthread_mutex_unlock(&ex->mu);
  if (wake)
    pthread_cond_signal(&ex->cv);
  /* With busy polling the loop keeps polling after the answer, as after a hand-back: the lone
   * client's next batch is read without the loop's wake-up. */
  poll_on(ex);
  return 1;
}

void dsv4_executor_submit_force(dsv4_executor_t *ex, dsv4_job_t *job) {
  pthread_mutex_lock(&ex->mu);
  enqueue(ex, job);
  const int wake = ex->sleeping;
  pthread_mutex_unlock(&ex->mu);
  if (wake)
    pthread_cond_signal(&ex->cv);
  poll_on(ex);
}

uint32_t dsv4_executor_pending(dsv4_executor_t *ex) {
  pthread_mutex_lock(&ex->mu);
  uint32_t n = ex->queued;
  pthread_mutex_unlock(&ex->mu);
  return n;
}

uint32_t dsv4_executor_waiting(dsv4_executor_t *ex, dsv4_job_class_t cls) {
  pthread_mutex_lock(&ex->mu);
  uint32_t n = ex->waiting[cls];
  pthread_mutex_unlock(&ex->mu);
  return n;
}

static void on_async_closed(uv_handle_t *h);

/* The idle handle closes first, then the async handle, whose close callback may free ex (libuv
 * runs the close callbacks of one loop iteration in the reverse order of their uv_close). */
static void on_idle_closed(uv_handle_t *h) {
  dsv4_executor_t *ex = (dsv4_executor_t *)((char *)h - offsetof(dsv4_executor_t, idle));
  uv_close((uv_handle_t *)&ex->async, on_async_closed);
}

static void on_async_closed(uv_handle_t *h) {
  dsv4_executor_t *ex = (dsv4_executor_t *)h;
  pthread_mutex_destroy(&ex->mu);
  pthread_cond_destroy(&ex->cv);
  if (ex->closed_cb)
    ex->closed_cb(ex->closed_arg);
}

void dsv4_executor_stop(dsv4_executor_t *ex, void (*closed)(void *arg), void *arg) {
  pthread_mutex_lock(&ex->mu);
  ex->stopping = 1;
  atomic_fetch_add_explicit(&ex->submits, 1, memory_order_relaxed); /* ends a spin */
  pthread_cond_signal(&ex->cv);
  pthread_mutex_unlock(&ex->mu);
  if (ex->started) {
    pthread_join(ex->thread, NULL);
    ex->started = 0;
  }
  /* Hand back what finished while joining, so every job's done() runs exactly once. */
  on_async(&ex->async);
  ex->closed_cb = closed;
  ex->closed_arg = arg;
  uv_close((uv_handle_t *)&ex->idle, on_idle_closed);
}
