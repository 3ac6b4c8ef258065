#ifndef DSV4_KERNELS_HOST_POOL_H
#define DSV4_KERNELS_HOST_POOL_H

/*
 * A persistent pool of host worker threads: the CPU backend runs its kernels on it, and the device
 * backends run their host-side work (validation, staging copies) on it. A launch returns only after
 * every item is done, which is the join that orders one launch before the next (SPEC §5.2 on the
 * CPU).
 *
 * Thread affinity: one launching thread at a time (a backend is driven by the executor alone).
 */

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dsv4_host_pool dsv4_host_pool_t;

/* fn(arg, first, last) processes work items first..last-1; any thread may run any range. */
typedef void (*dsv4_host_job_fn)(void *arg, size_t first, size_t last);

/* A pool of participants: threads - 1 worker threads plus the calling thread (threads >= 1). */
int dsv4_host_pool_create(unsigned threads, dsv4_host_pool_t **out);
void dsv4_host_pool_destroy(dsv4_host_pool_t *p);
unsigned dsv4_host_pool_threads(const dsv4_host_pool_t *p);
/*
 * Run fn over items 0..n_items-1 in chunks of `chunk` items on every participant; returns once
 * every item is done (the join that orders one launch before the next). Caller thread only.
 */
void dsv4_host_pool_run(dsv4_host_pool_t *p, dsv4_host_job_fn fn, void *arg, size_t n_items,
                        size_t chunk);
/* dsv4_host_pool_run in a few chunks per participant, which balances uneven items (a backend's
 * host_parallel: segments of different lengths). */
void dsv4_host_pool_run_balanced(dsv4_host_pool_t *p, dsv4_host_job_fn fn, void *arg,
                                 size_t n_items);
/* The MXCSR each worker thread saw at its start (x86 only; 0 elsewhere). */
unsigned dsv4_host_pool_start_mxcsr(const dsv4_host_pool_t *p, unsigned worker);

#ifdef DSV4_TEST_BROKEN_ORDER
/* The participant running the calling thread: 0 for the launching thread, 1.. for the workers. */
extern _Thread_local unsigned dsv4__host_test_participant;
unsigned dsv4__host_pool_participant(void);
#endif

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_HOST_POOL_H */
