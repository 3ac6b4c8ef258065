#ifndef DSV4_TESTS_BENCH_CHILD_H
#define DSV4_TESTS_BENCH_CHILD_H

/* What the HTTP benchmarks share: a monotonic clock, and stopping a server they started. */

#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* SIGTERM, up to 5 s for the child's drain, then SIGKILL; *pid becomes -1. */
static inline void stop_child(pid_t *pid) {
  if (*pid <= 0)
    return;
  kill(*pid, SIGTERM);
  for (int i = 0; i < 100; i++) {
    if (waitpid(*pid, NULL, WNOHANG) == *pid) {
      *pid = -1;
      return;
    }
    usleep(50000);
  }
  kill(*pid, SIGKILL);
  waitpid(*pid, NULL, 0);
  *pid = -1;
}

#endif /* DSV4_TESTS_BENCH_CHILD_H */
