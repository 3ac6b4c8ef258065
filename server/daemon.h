#ifndef DSV4_SERVER_DAEMON_H
#define DSV4_SERVER_DAEMON_H

/*
 * The daemon object: the loop, the configuration, the engine behind the executor, the listeners and
 * the metrics. Route handlers get it as their context.
 */

#include <stdint.h>

#include <uv.h>

#include "config.h"
#include "engine.h"
#include "executor.h"
#include "http.h"
#include "metrics.h"

typedef struct dsv4_daemon {
  uv_loop_t *loop;
  const dsv4_config_t *cfg;
  dsv4_engine_t *engine; /* executor thread only, except its "any thread" functions */
  dsv4_executor_t ex;
  dsv4_server_t *data;
  dsv4_server_t *admin;   /* the admin plane's listener (admin.c) */
  int admin_token;        /* admin_token_file is set: every admin route needs the token */
  int admin_loopback;     /* admin_host is a loopback address */
  struct dsv4_dump *dump; /* the dump streaming now, or NULL (at most one at a time) */
  dsv4_metrics_t *metrics;
  char instance[33];
  int draining;
  int restoring;     /* the snapshot in snapshot_dir is being restored: /readyz says so */
  uint64_t inflight; /* forward batches submitted and not yet answered (loop thread) */
  /* Metric families. */
  dsv4_metric_t *m_usage, *m_blocks, *m_sequences, *m_batch_tokens, *m_forward_seconds, *m_queued,
      *m_alloc_failures, *m_inflight, *m_build_info, *m_rope_bytes, *m_block_size, *m_blocks_total;
} dsv4_daemon_t;

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
