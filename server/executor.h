#ifndef DSV4_SERVER_EXECUTOR_H
#define DSV4_SERVER_EXECUTOR_H

/*
 * The executor: one thread of its own that runs device work (never the loop thread, never libuv's
 * shared thread pool). Jobs go in from the loop thread; finished jobs come back, in completion
 * order, through one uv_async_t whose callback drains the whole completion list (uv_async_send
 * coalesces).
 *
 * Decode first: a decode batch (one token per segment) is short and on the critical path of every
 * generated token, so it never waits behind a prefill. The executor takes the oldest waiting job
 * that is not a prefill and shares no key with a job ahead of it, else the oldest job; prefills
 * therefore run in arrival order among themselves, and two jobs that share a key (a sequence name)
 * never swap. Keys are hashes of sequence names: a collision only keeps two jobs in arrival order.
 *
 * A long prefill yields between its chunks (dsv4_executor_yield): the decodes waiting then run
 * inside it, each answered as soon as it finishes, so a decode waits at most one chunk.
 *
 * Overlap: a job with begin/end whose begin leaves it in flight stays so while the executor begins
 * the job it would run next, when that one has begin/end too and shares no key with it; then the
 * first one ends. So at most two are in flight, they end in the order they began, and the order
 * of the jobs that share a key, decode-first and the answers in completion order are as without.
 * Any other job (control, one sharing a key, one whose begin defers) waits for the end, and so
 * does the tick when it falls due (it stops the chain of overlapping jobs).
 *
 * Run here (dsv4_executor_run_here): the loop thread may run a job itself when the executor holds
 * none (none waiting, running, or finished and not yet handed back) and is not in its tick; the
 * executor then starts nothing (no job, no tick) until it returns. A lone batch so skips both
 * hand-offs; it is the same order as a submit, since nothing else was in the executor.
 *
 * Busy polling (dsv4_executor_set_busy_poll, off by default): for a window after each submit and
 * each hand-back, the executor thread spins on the queue instead of sleeping on its condition
 * variable, and the loop thread polls its sockets and the finished jobs without blocking (a
 * uv_idle_t), so neither hand-off waits for the scheduler to wake a sleeping thread; after a job
 * run here the loop polls for the window too, for the lone client's next request. It costs the
 * two threads' cores while batches keep coming, and nothing once the window has passed.
 */

#include <stddef.h>
#include <stdint.h>

#include <pthread.h>
#include <stdatomic.h>
#include <uv.h>

typedef struct dsv4_job dsv4_job_t;

/* The scheduling class. Zero (control: sequence lookups and deletes, admin reads) is what a
 * zero-filled job gets; control jobs are short and take the decode lane. */
typedef enum {
  DSV4_JOB_CONTROL = 0,
  DSV4_JOB_DECODE,
  DSV4_JOB_PREFILL,
  DSV4_JOB_CLASSES
} dsv4_job_class_t;

/* What a job's begin did (dsv4_job_t.begin). */
enum {
  DSV4_JOB_DONE = 0,  /* the job finished inside begin */
  DSV4_JOB_IN_FLIGHT, /* end must follow */
  DSV4_JOB_DEFER, /* (only with alone 0) it cannot begin beside the job in flight: nothing done */
};

struct dsv4_job {
  void (*run)(dsv4_job_t *job);  /* executor thread */
  void (*done)(dsv4_job_t *job); /* loop thread, after run (or end) */
  /*
   * Optional, both or neither (executor thread): the job in two halves, so that the device works
   * on one batch while the next is submitted (dsv4_engine_forward_begin). begin(job, alone)
   * returns a DSV4_JOB_* value; alone is 0 when another job is in flight, which the executor ends
   * (end) before it begins anything that does not overlap. run stays required: a yield runs jobs
   * whole.
   */
  int (*begin)(dsv4_job_t *job, int alone);
  void (*end)(dsv4_job_t *job);
  dsv4_job_t *next;
  dsv4_job_class_t cls;
  /* The sequences the job names (XXH3 of each name), owned by the job; none for a job that may
   * pass any other (an admin read sees the state at some batch boundary whichever it is). */
  const uint64_t *keys;
  uint32_t n_keys;
  uint64_t t_submit_ns;
  uint64_t t_start_ns;
};

typedef struct {
  uv_async_t async; /* first: the handle of this object */
  uv_loop_t *loop;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  dsv4_job_t *q_head, *q_tail;        /* submitted, not yet started */
  dsv4_job_t *d_head, *d_tail;        /* finished, not yet handed back */
  uint32_t queued;                    /* jobs submitted and not yet handed back */
  uint32_t waiting[DSV4_JOB_CLASSES]; /* jobs submitted and not yet started, by class */
  uint32_t max_queue;
  int here;    /* a job runs on the loop thread (dsv4_executor_run_here) */
  int ticking; /* the executor thread is in its tick */
  int stopping;
  int started;
  /* Called on the executor thread about once a second when idle and between jobs. */
  void (*tick)(void *arg);
  void *tick_arg;
  uint64_t last_tick_ns;
  void (*closed_cb)(void *arg);
  void *closed_arg;
  /* Busy polling: the window (0 = off), submits so far (the executor spins until it changes), and
   * whether the executor sleeps on cv (a submit signals only then). */
  uint64_t poll_ns;
  atomic_uint_fast64_t submits;
  int sleeping;
  /* Jobs queued for the loop so far (the loop's idle handle hands them back once it changes). */
  atomic_uint_fast64_t finishes;
  /* Loop thread: the idle handle that keeps the loop polling until poll_until_ns. */
  uv_idle_t idle;
  int idle_on;
  uint64_t poll_until_ns, finishes_seen;
} dsv4_executor_t;

/* Start the thread. tick may be NULL. */
int dsv4_executor_start(dsv4_executor_t *ex, uv_loop_t *loop, uint32_t max_queue,
                        void (*tick)(void *), void *tick_arg);
/* Loop thread, after dsv4_executor_start: busy-poll for us microseconds after each submit,
 * hand-back and job run here (0, the default: off). */
void dsv4_executor_set_busy_poll(dsv4_executor_t *ex, uint32_t us);
/* Loop thread. DSV4_EQUEUE when max_queue jobs are already in the executor. */
int dsv4_executor_submit(dsv4_executor_t *ex, dsv4_job_t *job);
/* Loop thread: run job's run here and now when the executor holds no job and is not in its tick,
 * and return 1 (the caller calls its done); else 0, and nothing was done (submit it instead). */
int dsv4_executor_run_here(dsv4_executor_t *ex, dsv4_job_t *job);
/* Loop thread. Submit even past max_queue (control jobs such as DELETE must not be refused). */
void dsv4_executor_submit_force(dsv4_executor_t *ex, dsv4_job_t *job);
/* Jobs submitted and not yet handed back to the loop. Loop thread. */
uint32_t dsv4_executor_pending(dsv4_executor_t *ex);
/* Jobs of class cls submitted and not yet started (the queue, not the running job). */
uint32_t dsv4_executor_waiting(dsv4_executor_t *ex, dsv4_job_class_t cls);
/*
 * Executor thread, from inside running->run only: run the decode jobs waiting now that may pass
 * running (they share no key with it nor with a job ahead of them), oldest first, and hand each
 * back as it finishes. Control and prefill jobs wait for running to return, and so does the tick;
 * decodes submitted meanwhile wait for the next yield. Returns the jobs it ran.
 */
uint32_t dsv4_executor_yield(dsv4_executor_t *ex, const dsv4_job_t *running);
/* Finish the queued jobs, join the thread and close the async handle (cb after close). */
void dsv4_executor_stop(dsv4_executor_t *ex, void (*closed)(void *arg), void *arg);

#endif /* DSV4_SERVER_EXECUTOR_H */
