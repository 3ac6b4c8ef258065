/*
 * The host thread pool (kernels/host_pool.c): workers that went to sleep between launches wake for
 * the next one, every item of every launch runs exactly once, and a pool whose workers sleep is
 * destroyed without hanging.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "host_pool.h"

#define THREADS 4
/* Longer than the workers' spin after a launch, whatever a pause costs: they are asleep. */
#define IDLE_US 3000

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Every participant takes one item and waits there until all THREADS have arrived (or 5 s). */
typedef struct {
  atomic_int arrived;
  atomic_int timed_out;
  pthread_t who[THREADS];
} gather_t;

static void gather(void *arg, size_t first, size_t last) {
  gather_t *g = arg;
  for (size_t i = first; i < last; i++) {
    g->who[i] = pthread_self();
    atomic_fetch_add(&g->arrived, 1);
    double t0 = now_s();
    while (atomic_load(&g->arrived) < THREADS) {
      if (now_s() - t0 > 5.0) {
        atomic_store(&g->timed_out, 1);
        return;
      }
      sched_yield();
    }
  }
}

/* Launch after launch, each after the workers have gone to sleep: all of them join every one. */
static void test_sleeping_workers_wake(void **state) {
  (void)state;
  dsv4_host_pool_t *p = NULL;
  assert_int_equal(dsv4_host_pool_create(THREADS, &p), 0);
  for (int round = 0; round < 30; round++) {
    usleep(IDLE_US);
    gather_t g;
    memset(&g, 0, sizeof(g));
    dsv4_host_pool_run(p, gather, &g, THREADS, 1);
    assert_int_equal(atomic_load(&g.timed_out), 0);
    assert_int_equal(atomic_load(&g.arrived), THREADS);
    for (int a = 0; a < THREADS; a++)
      for (int b = a + 1; b < THREADS; b++)
        assert_false(pthread_equal(g.who[a], g.who[b]));
  }
  dsv4_host_pool_destroy(p);
}

typedef struct {
  atomic_int *count;
} tally_t;

static void tally(void *arg, size_t first, size_t last) {
  tally_t *t = arg;
  for (size_t i = first; i < last; i++)
    atomic_fetch_add(&t->count[i], 1);
}

/* Launches back to back and after pauses of every length around the spin: each item once. */
static void test_every_item_once(void **state) {
  (void)state;
  enum { ITEMS = 97 };
  dsv4_host_pool_t *p = NULL;
  assert_int_equal(dsv4_host_pool_create(THREADS, &p), 0);
  atomic_int count[ITEMS];
  tally_t t = {count};
  for (int round = 0; round < 400; round++) {
    for (int i = 0; i < ITEMS; i++)
      atomic_init(&count[i], 0);
    if (round % 4 == 1)
      usleep((useconds_t)(round % 37) * 20);
    dsv4_host_pool_run(p, tally, &t, ITEMS, 1 + (size_t)(round % 5));
    for (int i = 0; i < ITEMS; i++)
      assert_int_equal(atomic_load(&count[i]), 1);
  }
  dsv4_host_pool_destroy(p);
}

/* A pool whose workers sleep is destroyed: they wake and exit. */
static void test_destroy_while_asleep(void **state) {
  (void)state;
  for (int k = 0; k < 5; k++) {
    dsv4_host_pool_t *p = NULL;
    assert_int_equal(dsv4_host_pool_create(THREADS, &p), 0);
    usleep(IDLE_US);
    dsv4_host_pool_destroy(p);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sleeping_workers_wake),
      cmocka_unit_test(test_every_item_once),
      cmocka_unit_test(test_destroy_while_asleep),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
