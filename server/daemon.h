#ifndef DSV4_SERVER_DAEMON_H
#define DSV4_SERVER_DAEMON_H

/*
 * The daemon object: the loop, the configuration, the engine behind the executor, the listeners and
 * the metrics. Route handlers get it as their context.
 */

#include <stdatomic.h>
#include <stdint.h>

#include <uv.h>

#include "config.h"
#include "engine.h"
#include "executor.h"
#include "forward_parse.h"
#include "http.h"
#include "metrics.h"

typedef struct dsv4_daemon {
  uv_loop_t *loop;
  const dsv4_config_t *cfg;
  dsv4_engine_t *engine; /* executor thread only, except its "any thread" functions */
  dsv4_executor_t ex;
  dsv4_server_t *data;
  dsv4_server_t *admin;        /* the admin plane's listener (admin.c) */
  int admin_token;             /* admin_token_file is set: every admin route needs the token */
  int admin_loopback;          /* admin_host is a loopback address */
  struct dsv4_dump *dump;      /* the dump streaming now, or NULL (at most one at a time) */
  struct dsv4_shm_server *shm; /* the shared regions' socket (shm.c), or NULL */
  /* Page-locked memory for request bodies and answers, registered with the backend; NULL when the
   * pool is off (pinned_pool_mib 0, a backend without host_register, or registration failed). */
  struct dsv4_pinned_pool *pinned;
  dsv4_metrics_t *metrics;
  char instance[33];
  int draining;
  int restoring;     /* the snapshot in snapshot_dir is being restored: /readyz says so */
  uint64_t inflight; /* forward batches submitted and not yet answered (loop thread) */
  /* Answers the executor's thread sent itself (direct_answer_bytes): counted there before each
   * send, and here as each batch comes back; a /metrics request waits in metrics_waiting until
   * those sent before it are back, so that a client that has read an answer sees it counted. */
  atomic_uint_fast64_t direct_sent;
  uint64_t direct_back;
  struct dsv4_metrics_wait *metrics_waiting;
  /* Metric families. */
  dsv4_metric_t *m_usage, *m_blocks, *m_sequences, *m_batch_tokens, *m_forward_seconds, *m_queued,
      *m_alloc_failures, *m_inflight, *m_build_info, *m_rope_bytes, *m_block_size, *m_blocks_total,
      *m_prefill_chunks, *m_pinned_bytes, *m_pinned_total, *m_pinned_fallbacks, *m_forward_request,
      *m_inline_batches, *m_direct_answers, *m_arrival_bytes, *m_flushed_bytes;
} dsv4_daemon_t;

/*
 * A forward request whose tensors live in a shared region (region.c, SPEC §6.1): where its outputs
 * go in the region, and who is told the result.
 */
typedef struct {
  uint16_t *q_out; /* when outputs names q (else the job has a buffer of its own) */
  int64_t *slots;
  uint16_t *attn;       /* when outputs names attn (lse alone gets a buffer of the job's own) */
  float *lse;           /* when outputs names lse */
  int32_t *topk;        /* when outputs names topk (a ratio-4 layer's selection) */
  uint64_t deadline_ns; /* 0 = none */
  /* Loop thread, once, after the batch ran or was refused by the executor: rc 0 (f holds the
   * answer's metadata), or an error code with its JSON details (owned by the callee, may be NULL).
   * The region must stay mapped until then. */
  void (*done)(void *arg, int rc, const char *message, json_t *details, const dsv4_forward_t *f);
  /* Optional, executor thread, with direct_answer_bytes on: the batch succeeded (f its result);
   * send its answer now if that cannot block, and return 1 if it went. done follows as ever (the
   * bookkeeping, on the loop thread), and then sends nothing. */
  int (*answer_now)(void *arg, const dsv4_forward_t *f);
  void *arg;
} dsv4_region_forward_t;

/*
 * A buffer of n bytes, 64-byte aligned, for a request body (use "body") or the tensors of an
 * answer ("output"): from the pinned pool when it is on and has room, else from the heap, counted
 * in dsv4d_pinned_pool_fallbacks_total{use} while the pool is on. NULL when the heap fails too. Any
 * thread.
 */
void *dsv4_daemon_buf_alloc(dsv4_daemon_t *d, size_t n, const char *use);
/* Free a buffer from dsv4_daemon_buf_alloc, or any heap pointer, to where it came from (NULL is a
 * no-op). Any thread. */
void dsv4_daemon_buf_free(dsv4_daemon_t *d, void *p);

/* The limits a forward request is parsed against. Any thread. */
dsv4_forward_limits_t dsv4_forward_limits(const dsv4_daemon_t *d);
/*
 * Loop thread: queue a parsed region request, moving *p into the job; rf->done is called later,
 * or before this returns when the batch ran at once on this thread (inline_decode_tokens). Or an
 * error (draining, unsupported attention, queue full, no memory) with why set when it says
 * more than the code: then nothing was queued, *p is still the caller's and done is never called.
 */
int dsv4_forward_submit_region(dsv4_daemon_t *d, dsv4_forward_req_t *p,
                               const dsv4_region_forward_t *rf, char *why, size_t why_len);
/* The data-plane route table (forward, sequences, health, readiness, metrics). */
size_t dsv4_data_routes(dsv4_daemon_t *d, dsv4_route_t *out, size_t cap);
/* Copy a route table into out (at most cap rows); the rows copied. */
size_t dsv4_routes_copy(const dsv4_route_t *routes, size_t n, dsv4_route_t *out, size_t cap);
/* The admin-plane route table (SPEC §6 admin routes, admin.c). */
size_t dsv4_admin_routes(dsv4_daemon_t *d, dsv4_route_t *out, size_t cap);
/* The admin listener's completion hook: one audit log line per admin call. */
void dsv4_admin_audit(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
/* 1 when host is a loopback address (127.0.0.0/8, ::1). */
int dsv4_host_is_loopback(const char *host);
/* Register the daemon's metric families and the collect hook. */
int dsv4_daemon_metrics_init(dsv4_daemon_t *d);

#endif /* DSV4_SERVER_DAEMON_H */
