/* The executor's scheduling: decode and control jobs pass waiting prefills, prefills keep their
 * arrival order, two jobs that share a key (a sequence) never swap, and a prefill that yields
 * between its chunks lets the waiting decodes run and be answered before it completes; with busy
 * polling as without; and a job run on the loop thread (dsv4_executor_run_here) only when the
 * executor is idle, which then starts nothing until it returns. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "executor.h"

#define MAX_JOBS 8

typedef struct {
  dsv4_job_t job; /* first */
  char id;
  uint64_t keys[2];
  int blocks; /* waits on the gate until the test opens it */
  /* A chunked prefill: before chunk c it waits until chunks_open > c, and it yields between two. */
  dsv4_executor_t *ex;
  int chunks;
} fake_job_t;

/* What the executor thread ran and the loop thread got back, in order. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static char ran[MAX_JOBS + 1], done[MAX_JOBS + 1];
static int n_ran, n_done, running, gate_open, chunks_open, chunks_done;

static void fake_run(dsv4_job_t *job) {
  fake_job_t *j = (fake_job_t *)job;
  pthread_mutex_lock(&mu);
  ran[n_ran++] = j->id;
  running = 1;
  pthread_cond_broadcast(&cv);
  while (j->blocks && !gate_open)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
}

/* A prefill in chunks, as the engine runs one: the yield between two chunks. */
static void chunked_run(dsv4_job_t *job) {
  fake_job_t *j = (fake_job_t *)job;
  pthread_mutex_lock(&mu);
  ran[n_ran++] = j->id;
  running = 1;
  pthread_cond_broadcast(&cv);
  for (int c = 0; c < j->chunks; c++) {
    if (c) {
      pthread_mutex_unlock(&mu);
      dsv4_executor_yield(j->ex, job);
      pthread_mutex_lock(&mu);
    }
    while (chunks_open <= c)
      pthread_cond_wait(&cv, &mu);
    chunks_done = c + 1;
  }
  pthread_mutex_unlock(&mu);
}

static void fake_done(dsv4_job_t *job) {
  done[n_done++] = ((fake_job_t *)job)->id;
}

static void fake_init(fake_job_t *j, char id, dsv4_job_class_t cls, uint64_t k0, uint64_t k1) {
  memset(j, 0, sizeof(*j));
  j->id = id;
  j->job.run = fake_run;
  j->job.done = fake_done;
  j->job.cls = cls;
  j->keys[0] = k0;
  j->keys[1] = k1;
  j->job.keys = j->keys;
  j->job.n_keys = k1 ? 2 : 1;
}

static void reset(void) {
  memset(ran, 0, sizeof(ran));
  memset(done, 0, sizeof(done));
  n_ran = n_done = running = gate_open = chunks_open = chunks_done = 0;
}

/* Submit jobs[0] (which blocks), wait until it runs, submit the rest, open the gate and hand
 * everything back. */
static void run_all(dsv4_executor_t *ex, uv_loop_t *loop, fake_job_t *jobs, int n,
                    const uint32_t *want_waiting) {
  assert_int_equal(dsv4_executor_submit(ex, &jobs[0].job), 0);
  pthread_mutex_lock(&mu);
  while (!running)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  for (int i = 1; i < n; i++)
    assert_int_equal(dsv4_executor_submit(ex, &jobs[i].job), 0);
  for (int c = 0; c < DSV4_JOB_CLASSES; c++)
    assert_int_equal(dsv4_executor_waiting(ex, (dsv4_job_class_t)c), want_waiting[c]);
  pthread_mutex_lock(&mu);
  gate_open = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  while (n_done < n)
    uv_run(loop, UV_RUN_ONCE);
  for (int c = 0; c < DSV4_JOB_CLASSES; c++)
    assert_int_equal(dsv4_executor_waiting(ex, (dsv4_job_class_t)c), 0);
  assert_int_equal(dsv4_executor_pending(ex), 0);
}

/* Decode and control jobs pass a waiting prefill, except one that names the prefill's sequence;
 * the answers come back in the order the jobs ran. */
static void check_decode_first(dsv4_executor_t *ex, uv_loop_t *loop) {
  fake_job_t j[6];
  reset();
  /* Sequences: 1 = A's, 2 = B's, 3 = C's, 4 = D's, 5 = F's. */
  fake_init(&j[0], 'A', DSV4_JOB_PREFILL, 1, 0);
  j[0].blocks = 1;
  fake_init(&j[1], 'B', DSV4_JOB_PREFILL, 2, 0);
  fake_init(&j[2], 'C', DSV4_JOB_DECODE, 3, 0);
  fake_init(&j[3], 'D', DSV4_JOB_DECODE, 4, 0);
  fake_init(&j[4], 'E', DSV4_JOB_DECODE, 2, 0); /* names B's sequence: stays behind B */
  fake_init(&j[5], 'F', DSV4_JOB_CONTROL, 5, 0);
  const uint32_t want[DSV4_JOB_CLASSES] = {
      [DSV4_JOB_CONTROL] = 1, [DSV4_JOB_DECODE] = 3, [DSV4_JOB_PREFILL] = 1};
  run_all(ex, loop, j, 6, want);
  assert_string_equal(ran, "ACDFBE");
  assert_string_equal(done, "ACDFBE");
}

static void test_decode_first(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  check_decode_first(&ex, &loop);
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* A decode blocked by a prefill blocks, in turn, a later job that shares another of its keys; a
 * delete of a sequence stays behind the prefill that names it; prefills keep arrival order. */
static void test_same_sequence_order(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[7];
  reset();
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  fake_init(&j[0], 'A', DSV4_JOB_PREFILL, 1, 0);
  j[0].blocks = 1;
  fake_init(&j[1], 'P', DSV4_JOB_PREFILL, 10, 0);
  fake_init(&j[2], 'X', DSV4_JOB_CONTROL, 10, 0); /* a DELETE of P's sequence */
  fake_init(&j[3], 'D', DSV4_JOB_DECODE, 10, 11);
  fake_init(&j[4], 'E', DSV4_JOB_DECODE, 11, 0);
  fake_init(&j[5], 'Q', DSV4_JOB_PREFILL, 12, 0);
  fake_init(&j[6], 'Z', DSV4_JOB_DECODE, 13, 0);
  const uint32_t want[DSV4_JOB_CLASSES] = {
      [DSV4_JOB_CONTROL] = 1, [DSV4_JOB_DECODE] = 3, [DSV4_JOB_PREFILL] = 2};
  run_all(&ex, &loop, j, 7, want);
  assert_string_equal(ran, "AZPXDEQ");
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* Jobs in two halves (begin/end), as the engine's overlapped batches: what each half did, in
 * order: the id at begin (after '-' when begin deferred), the id in lower case at end. */
static char halves[32];
static int n_halves, defer_when_not_alone;

static int half_begin(dsv4_job_t *job, int alone) {
  fake_job_t *j = (fake_job_t *)job;
  pthread_mutex_lock(&mu);
  int defer = !alone && j->blocks == defer_when_not_alone;
  halves[n_halves++] = defer ? '-' : j->id;
  pthread_mutex_unlock(&mu);
  return defer ? DSV4_JOB_DEFER : DSV4_JOB_IN_FLIGHT;
}

static void half_end(dsv4_job_t *job) {
  fake_job_t *j = (fake_job_t *)job;
  pthread_mutex_lock(&mu);
  halves[n_halves++] = (char)(j->id - 'A' + 'a');
  pthread_mutex_unlock(&mu);
}

/*
 * A job in flight stays so while the next job begins when that one has halves too and shares no
 * key with it (two in flight at most, ending in the order they began); a job sharing a key, one
 * that defers, and a job without halves wait for the end. Answers come back in completion order.
 */
static void test_overlapped_halves(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[6];
  reset();
  memset(halves, 0, sizeof(halves));
  n_halves = 0;
  defer_when_not_alone = 2; /* fake_job_t.blocks == 2 marks the job that defers */
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  fake_init(&j[0], 'Z', DSV4_JOB_PREFILL, 9, 0);
  j[0].blocks = 1;
  fake_init(&j[1], 'A', DSV4_JOB_DECODE, 1, 0);
  fake_init(&j[2], 'B', DSV4_JOB_DECODE, 2, 0);
  fake_init(&j[3], 'C', DSV4_JOB_DECODE, 2, 0); /* B's sequence */
  fake_init(&j[4], 'D', DSV4_JOB_DECODE, 3, 0);
  j[4].blocks = 2;
  fake_init(&j[5], 'E', DSV4_JOB_DECODE, 4, 0); /* no halves */
  for (int i = 1; i < 5; i++) {
    j[i].job.begin = half_begin;
    j[i].job.end = half_end;
  }
  const uint32_t want[DSV4_JOB_CLASSES] = {[DSV4_JOB_DECODE] = 5};
  run_all(&ex, &loop, j, 6, want);
  assert_string_equal(halves, "ABabC-cDd");
  assert_string_equal(ran, "ZE");
  assert_string_equal(done, "ZABCDE");
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* The tick of test_overlap_tick: recorded in halves once armed (a spurious early tick is not). */
static int tick_armed;

static void halves_tick(void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  if (tick_armed) {
    halves[n_halves++] = 'T';
    tick_armed = 0;
  }
  pthread_mutex_unlock(&mu);
}

/* half_end, and for job A: the tick falls due now. */
static void half_end_tick_due(dsv4_job_t *job) {
  fake_job_t *j = (fake_job_t *)job;
  half_end(job);
  if (j->id == 'A') {
    pthread_mutex_lock(&mu);
    tick_armed = 1;
    pthread_mutex_unlock(&mu);
    j->ex->last_tick_ns = 0; /* executor thread: the field is its own */
  }
}

/* A tick that falls due while batches overlap runs once the one in flight has ended, before the
 * next job begins: a steady stream of overlapping jobs does not hold the expiry sweep off. */
static void test_overlap_tick(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[5];
  reset();
  memset(halves, 0, sizeof(halves));
  n_halves = tick_armed = 0;
  defer_when_not_alone = -1;
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, halves_tick, NULL), 0);
  fake_init(&j[0], 'Z', DSV4_JOB_PREFILL, 9, 0);
  j[0].blocks = 1;
  for (int i = 1; i < 5; i++) {
    fake_init(&j[i], (char)('A' + i - 1), DSV4_JOB_DECODE, (uint64_t)i, 0);
    j[i].ex = &ex;
    j[i].job.begin = half_begin;
    j[i].job.end = half_end_tick_due;
  }
  const uint32_t want[DSV4_JOB_CLASSES] = {[DSV4_JOB_DECODE] = 4};
  run_all(&ex, &loop, j, 5, want);
  assert_string_equal(halves, "ABabTCDcd");
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* The queue limit counts every class alike, running and waiting jobs included. */
static void test_queue_full(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[3];
  reset();
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 2, NULL, NULL), 0);
  fake_init(&j[0], 'A', DSV4_JOB_PREFILL, 1, 0);
  j[0].blocks = 1;
  fake_init(&j[1], 'B', DSV4_JOB_PREFILL, 2, 0);
  fake_init(&j[2], 'C', DSV4_JOB_DECODE, 3, 0);
  assert_int_equal(dsv4_executor_submit(&ex, &j[0].job), 0);
  assert_int_equal(dsv4_executor_submit(&ex, &j[1].job), 0);
  assert_int_not_equal(dsv4_executor_submit(&ex, &j[2].job), 0);
  pthread_mutex_lock(&mu);
  gate_open = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  while (n_done < 2)
    uv_run(&loop, UV_RUN_ONCE);
  assert_string_equal(ran, "AB");
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static void open_chunks(int n) {
  pthread_mutex_lock(&mu);
  chunks_open = n;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
}

/*
 * A decode queued behind a long prefill is run between two of its chunks and answered before the
 * prefill completes; a decode of the prefill's own sequence, a control job and another prefill wait
 * for the whole prefill, and then run in the usual order.
 */
static void test_decode_between_chunks(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[5];
  reset();
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  fake_init(&j[0], 'P', DSV4_JOB_PREFILL, 1, 0);
  j[0].job.run = chunked_run;
  j[0].ex = &ex;
  j[0].chunks = 3;
  fake_init(&j[1], 'D', DSV4_JOB_DECODE, 2, 0);
  fake_init(&j[2], 'E', DSV4_JOB_DECODE, 1, 0);  /* names P's sequence */
  fake_init(&j[3], 'F', DSV4_JOB_CONTROL, 3, 0); /* a lookup: never between chunks */
  fake_init(&j[4], 'Q', DSV4_JOB_PREFILL, 4, 0);
  assert_int_equal(dsv4_executor_submit(&ex, &j[0].job), 0);
  pthread_mutex_lock(&mu);
  while (!running)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  for (int i = 1; i < 5; i++)
    assert_int_equal(dsv4_executor_submit(&ex, &j[i].job), 0);
  assert_int_equal(dsv4_executor_waiting(&ex, DSV4_JOB_DECODE), 2);

  /* The first chunk ends, P yields: D runs and its answer reaches the loop while P waits before
   * its second chunk. */
  open_chunks(1);
  while (n_done < 1)
    uv_run(&loop, UV_RUN_ONCE);
  assert_string_equal(done, "D");
  pthread_mutex_lock(&mu);
  assert_int_equal(chunks_done, 1);
  assert_string_equal(ran, "PD");
  pthread_mutex_unlock(&mu);
  assert_int_equal(dsv4_executor_waiting(&ex, DSV4_JOB_DECODE), 1);
  assert_int_equal(dsv4_executor_waiting(&ex, DSV4_JOB_CONTROL), 1);
  assert_int_equal(dsv4_executor_waiting(&ex, DSV4_JOB_PREFILL), 1);

  open_chunks(3);
  while (n_done < 5)
    uv_run(&loop, UV_RUN_ONCE);
  assert_int_equal(chunks_done, 3);
  assert_string_equal(ran, "PDEFQ");
  assert_string_equal(done, "DPEFQ");
  assert_int_equal(dsv4_executor_pending(&ex), 0);
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The round trips of test_busy_poll: jobs run and handed back so far (ran: executor thread). */
static int trips_ran, trips_done;

static void trip_run(dsv4_job_t *job) {
  (void)job;
  pthread_mutex_lock(&mu);
  trips_ran++;
  pthread_mutex_unlock(&mu);
}

static void trip_done(dsv4_job_t *job) {
  (void)job;
  trips_done++;
}

/* One job submitted and handed back, the loop run until then. */
static void round_trip(dsv4_executor_t *ex, uv_loop_t *loop, fake_job_t *j) {
  fake_init(j, 'r', DSV4_JOB_DECODE, 1, 0);
  j->job.run = trip_run;
  j->job.done = trip_done;
  const int before = trips_done;
  assert_int_equal(dsv4_executor_submit(ex, &j->job), 0);
  while (trips_done == before)
    uv_run(loop, UV_RUN_ONCE);
  assert_int_equal(trips_done, before + 1);
  pthread_mutex_lock(&mu);
  assert_int_equal(trips_ran, trips_done);
  pthread_mutex_unlock(&mu);
}

/* With a busy-poll window of 200 µs begun just now: the loop polls (its idle handle active) until
 * the window has passed, and then no longer. */
static void poll_window_passes(dsv4_executor_t *ex, uv_loop_t *loop) {
  assert_true(uv_is_active((uv_handle_t *)&ex->idle));
  const uint64_t t0 = mono_ns();
  while (uv_is_active((uv_handle_t *)&ex->idle))
    uv_run(loop, UV_RUN_NOWAIT);
  assert_true(mono_ns() - t0 >= 150000u);
}

/*
 * Busy polling: the scheduling is unchanged (decode first, as test_decode_first); the loop polls
 * (its idle handle active) from a submit until the window has passed, then blocks again; a steady
 * stream is answered; and a submit still wakes an executor that fell asleep on its condition
 * variable, here and with busy polling off (the submit signals only a sleeping executor): twenty
 * round trips 3 ms apart take far less than the twenty seconds of the executor's 1 s tick, which
 * is all a lost wake-up would leave.
 */
static void test_busy_poll(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j;
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  dsv4_executor_set_busy_poll(&ex, 200);
  check_decode_first(&ex, &loop);
  poll_window_passes(&ex, &loop); /* from the last hand-back */
  for (int off = 0; off < 2; off++) {
    if (off)
      dsv4_executor_set_busy_poll(&ex, 0);
    for (int i = 0; i < 500; i++)
      round_trip(&ex, &loop, &j);
    assert_int_equal(uv_is_active((uv_handle_t *)&ex.idle), !off);
    const uint64_t t1 = mono_ns();
    for (int i = 0; i < 20; i++) {
      const struct timespec nap = {0, 3000000};
      nanosleep(&nap, NULL); /* past the window: the executor sleeps on its condition variable */
      round_trip(&ex, &loop, &j);
    }
    assert_true(mono_ns() - t1 < 5000000000ull);
  }
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* test_run_here: what ran where, and the tick's state. */
static pthread_t loop_thread;
static int here_on_loop, ticks, in_tick, tick_blocks;
static dsv4_executor_t *here_ex;
static fake_job_t here_sub;

static void here_run(dsv4_job_t *job) {
  fake_run(job);
  here_on_loop = pthread_equal(pthread_self(), loop_thread);
}

/* A job run here that, with chunks set, outlasts the executor's 1 s tick period, else submits
 * another job: the executor starts neither meanwhile. */
static void here_submit_run(dsv4_job_t *job) {
  here_run(job);
  const int long_nap = ((fake_job_t *)job)->chunks;
  if (!long_nap)
    assert_int_equal(dsv4_executor_submit(here_ex, &here_sub.job), 0);
  const struct timespec nap = {long_nap ? 1 : 0, 200000000};
  nanosleep(&nap, NULL);
  pthread_mutex_lock(&mu);
  assert_int_equal(n_ran, 1); /* this job only */
  assert_int_equal(in_tick, 0);
  pthread_mutex_unlock(&mu);
}

static void counting_tick(void *arg) {
  (void)arg;
  pthread_mutex_lock(&mu);
  ticks++;
  in_tick = 1;
  pthread_cond_broadcast(&cv);
  while (tick_blocks)
    pthread_cond_wait(&cv, &mu);
  in_tick = 0;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
}

/* Run j here once the executor has come back from its tick (it clears its flag just after the tick
 * function returns): until then it is declined and nothing runs. */
static void run_here_after_tick(dsv4_executor_t *ex, fake_job_t *j) {
  int tries = 0;
  while (!dsv4_executor_run_here(ex, &j->job)) {
    assert_int_equal(n_ran, 0);
    assert_true(++tries < 1000);
    const struct timespec nap = {0, 1000000};
    nanosleep(&nap, NULL);
  }
}

/*
 * dsv4_executor_run_here: an idle executor lets the loop thread run a job itself (its done is then
 * the caller's); a job running, waiting or not yet handed back, or the tick under way, makes it
 * decline without running anything; and while a job runs here the executor starts nothing, not a
 * job submitted meanwhile nor a tick that falls due, which both come after it.
 */
static void test_run_here(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[4];
  reset();
  loop_thread = pthread_self();
  here_ex = &ex;
  ticks = in_tick = 0;
  tick_blocks = 1;
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, counting_tick, NULL), 0);
  /* The tick (due 1 s after the start) under way: declined. */
  pthread_mutex_lock(&mu);
  while (!in_tick)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  fake_init(&j[0], 'A', DSV4_JOB_DECODE, 1, 0);
  j[0].job.run = here_run;
  assert_int_equal(dsv4_executor_run_here(&ex, &j[0].job), 0);
  assert_int_equal(n_ran, 0);
  pthread_mutex_lock(&mu);
  tick_blocks = 0;
  pthread_cond_broadcast(&cv);
  while (in_tick)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  /* Idle: A runs on this thread; nothing is handed back through the loop. */
  run_here_after_tick(&ex, &j[0]);
  assert_true(here_on_loop);
  assert_string_equal(ran, "A");
  uv_run(&loop, UV_RUN_NOWAIT);
  assert_int_equal(n_done, 0);
  assert_int_equal(dsv4_executor_pending(&ex), 0);
  /* B running on the executor, then finished but not handed back: C is declined both times. */
  fake_init(&j[1], 'B', DSV4_JOB_PREFILL, 2, 0);
  j[1].blocks = 1;
  fake_init(&j[2], 'C', DSV4_JOB_DECODE, 3, 0);
  j[2].job.run = here_run;
  assert_int_equal(dsv4_executor_submit(&ex, &j[1].job), 0);
  pthread_mutex_lock(&mu);
  while (n_ran < 2)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  assert_int_equal(dsv4_executor_run_here(&ex, &j[2].job), 0);
  pthread_mutex_lock(&mu);
  gate_open = 1;
  pthread_cond_broadcast(&cv);
  pthread_mutex_unlock(&mu);
  while (dsv4_executor_waiting(&ex, DSV4_JOB_PREFILL) || n_done == 0) {
    assert_int_equal(dsv4_executor_run_here(&ex, &j[2].job), 0);
    uv_run(&loop, UV_RUN_ONCE);
  }
  assert_string_equal(ran, "AB");
  /* D runs here past a tick's period: the tick waits for it. */
  reset();
  const int ticks_before = ticks;
  fake_init(&j[3], 'D', DSV4_JOB_DECODE, 4, 0);
  j[3].job.run = here_submit_run;
  j[3].chunks = 1; /* here: sleep past the tick's period */
  assert_int_equal(dsv4_executor_run_here(&ex, &j[3].job), 1);
  pthread_mutex_lock(&mu);
  assert_int_equal(ticks, ticks_before);
  while (ticks == ticks_before) /* then it comes */
    pthread_cond_wait(&cv, &mu);
  while (in_tick)
    pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu);
  /* D again, submitting E: E waits for D. */
  reset();
  j[3].chunks = 0;
  fake_init(&here_sub, 'E', DSV4_JOB_DECODE, 5, 0);
  run_here_after_tick(&ex, &j[3]);
  while (n_done < 1)
    uv_run(&loop, UV_RUN_ONCE);
  assert_string_equal(ran, "DE");
  assert_string_equal(done, "E");
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/*
 * Busy polling after a job run here: the loop polls for the window from the run's end, as after a
 * hand-back, so that the lone client's next batch is read without the loop's wake-up; with busy
 * polling off it does not.
 */
static void test_busy_poll_here(void **state) {
  (void)state;
  uv_loop_t loop;
  dsv4_executor_t ex;
  fake_job_t j[2];
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(&ex, &loop, 16, NULL, NULL), 0);
  for (int on = 0; on < 2; on++) {
    reset();
    dsv4_executor_set_busy_poll(&ex, on ? 200 : 0);
    assert_false(uv_is_active((uv_handle_t *)&ex.idle));
    fake_init(&j[on], on ? 'P' : 'O', DSV4_JOB_DECODE, 1, 0);
    run_here_after_tick(&ex, &j[on]);
    assert_int_equal(n_ran, 1);
    if (on)
      poll_window_passes(&ex, &loop); /* from the run's end */
    else
      assert_false(uv_is_active((uv_handle_t *)&ex.idle));
  }
  dsv4_executor_stop(&ex, NULL, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

/* test_stop_frees: the loop it runs, and handles of the executor still on that loop at its closed
 * callback. */
static uv_loop_t *stop_loop;
static int handles_left, closed_runs;

static void count_in_executor(uv_handle_t *h, void *arg) {
  const char *at = (const char *)h, *ex = arg;
  handles_left += at >= ex && at < ex + sizeof(dsv4_executor_t);
}

static void free_closed(void *arg) {
  uv_walk(stop_loop, count_in_executor, arg);
  closed_runs++;
  free(arg);
}

/* The closed callback of dsv4_executor_stop may free the executor: every handle of it has finished
 * closing by then (none is left on the loop, where libuv would still write to it), also with busy
 * polling's idle handle active at the stop. */
static void test_stop_frees(void **state) {
  (void)state;
  uv_loop_t loop;
  fake_job_t j;
  dsv4_executor_t *ex = malloc(sizeof(*ex));
  assert_non_null(ex);
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(dsv4_executor_start(ex, &loop, 16, NULL, NULL), 0);
  dsv4_executor_set_busy_poll(ex, 10000);
  round_trip(ex, &loop, &j);
  assert_true(uv_is_active((uv_handle_t *)&ex->idle));
  stop_loop = &loop;
  handles_left = closed_runs = 0;
  dsv4_executor_stop(ex, free_closed, ex);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(closed_runs, 1);
  assert_int_equal(handles_left, 0);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_decode_first),      cmocka_unit_test(test_same_sequence_order),
      cmocka_unit_test(test_queue_full),        cmocka_unit_test(test_decode_between_chunks),
      cmocka_unit_test(test_overlapped_halves), cmocka_unit_test(test_overlap_tick),
      cmocka_unit_test(test_busy_poll),         cmocka_unit_test(test_stop_frees),
      cmocka_unit_test(test_run_here),          cmocka_unit_test(test_busy_poll_here),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
