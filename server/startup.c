/*
 * The daemon's start-up and shut-down (startup.h): the configuration, the secrets, the engine
 * behind the executor thread, the listeners and signal handling, then the loop. Each pass is a
 * function of its own; dsv4d_run calls them in order and unwinds what was started when one fails.
 */
#include <malloc.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "dsv4-error.h"
#include "log.h"
#include "pinned_pool.h"
#include "restore.h"
#include "sdnotify.h"
#include "shm.h"
#include "startup.h"
#include "weights.h"

extern char **environ;

/* The random bytes of an instance id: 128 bits, the 32 hex digits of Dsv4d-Instance (SPEC §6). */
#define INSTANCE_BYTES 16
/* While draining, in-flight work is looked at this often (ms) until it is done or the deadline. */
#define DRAIN_POLL_MS 20
/* Room for the routes of one listener (data or admin). */
#define MAX_ROUTES 12

typedef struct {
  dsv4_daemon_t d;
  uv_signal_t sigterm, sigint, sighup;
  uv_timer_t drain_timer;
  uint64_t drain_deadline_ms;
  int servers_open; /* listeners not yet closed: the executor stops after the last */
  int closing;
  dsv4_job_t snap_job; /* the snapshot written after a drain, or restored at start-up */
  int snap_started;
  int exit_code;
  dsv4_config_t cfg;
  char *token, *admin_token;
  uv_loop_t loop;
} app_t;

/* The backend alias set by dsv4d_backend_alias, or none. */
static const char *alias_from, *alias_to;

void dsv4d_backend_alias(const char *from, const char *to) {
  alias_from = from;
  alias_to = to;
}

static void make_instance(char out[2 * INSTANCE_BYTES + 1]) {
  unsigned char r[INSTANCE_BYTES];
  size_t got = 0;
  while (got < sizeof(r)) {
    ssize_t n = getrandom(r + got, sizeof(r) - got, 0);
    if (n > 0)
      got += (size_t)n;
  }
  for (size_t i = 0; i < sizeof(r); i++)
    snprintf(out + 2 * i, 3, "%02x", r[i]);
}

/* Executor thread, about once a second: expire idle sequences. */
static void tick(void *arg) {
  dsv4_daemon_t *d = arg;
  uint32_t n = dsv4_engine_expire(d->engine, uv_hrtime());
  if (n)
    dsv4_logp(DSV4_LOG_INFO, "sequences expired", "{s:i}", "count", (int)n);
}

static void on_walk_close(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

static void on_executor_closed(void *arg) {
  (void)arg;
}

static void on_server_closed(void *arg) {
  app_t *a = arg;
  if (--a->servers_open > 0)
    return;
  dsv4_executor_stop(&a->d.ex, on_executor_closed, a);
  uv_close((uv_handle_t *)&a->sigterm, NULL);
  uv_close((uv_handle_t *)&a->sigint, NULL);
  uv_close((uv_handle_t *)&a->sighup, NULL);
  uv_close((uv_handle_t *)&a->drain_timer, NULL);
}

static void shutdown_now(app_t *a) {
  if (a->closing)
    return;
  a->closing = 1;
  /* The drain's poll reads the servers, which free themselves as they close. */
  uv_timer_stop(&a->drain_timer);
  a->servers_open = 1 + (a->d.admin != NULL) + (a->d.shm != NULL);
  dsv4_server_close(a->d.data, on_server_closed, a);
  if (a->d.admin)
    dsv4_server_close(a->d.admin, on_server_closed, a);
  if (a->d.shm)
    dsv4_shm_close(a->d.shm, on_server_closed, a);
}

static app_t *app_of(dsv4_job_t *job) {
  return (app_t *)(void *)((char *)job - offsetof(app_t, snap_job));
}

/* Executor thread: every live sequence into snapshot_dir, once the drain has run every batch. */
static void snapshot_run(dsv4_job_t *job) {
  dsv4__snapshot_write(&app_of(job)->d);
}

static void snapshot_done(dsv4_job_t *job) {
  shutdown_now(app_of(job));
}

/* The drain is over: with snapshot_dir, the snapshot is written before the listeners close. */
static void drained(app_t *a) {
  if (!a->cfg.snapshot_dir[0] || a->closing) {
    shutdown_now(a);
    return;
  }
  if (a->snap_started)
    return;
  a->snap_started = 1;
  uv_timer_stop(&a->drain_timer);
  a->snap_job.run = snapshot_run;
  a->snap_job.done = snapshot_done;
  dsv4_executor_submit_force(&a->d.ex, &a->snap_job);
}

/* While draining: finish once no batch is pending and every connection has gone. */
static void on_drain_timer(uv_timer_t *t) {
  app_t *a = t->data;
  uint32_t pending = dsv4_executor_pending(&a->d.ex);
  size_t conns = dsv4_server_connections(a->d.data) +
                 (a->d.admin ? dsv4_server_connections(a->d.admin) : 0) +
                 (a->d.shm ? dsv4_shm_connections(a->d.shm) : 0);
  if (pending == 0 && conns == 0) {
    dsv4_logp(DSV4_LOG_INFO, "drained", NULL);
    drained(a);
  } else if (uv_now(a->d.loop) >= a->drain_deadline_ms && pending == 0) {
    /* Batches always finish; past the deadline only idle or slow connections are cut. */
    dsv4_logp(DSV4_LOG_WARN, "drain deadline passed; closing connections", "{s:I}", "connections",
              (json_int_t)conns);
    drained(a);
  }
}

static void on_signal(uv_signal_t *s, int signum) {
  app_t *a = s->data;
  if (a->d.draining) {
    if (signum == SIGINT) /* a second ^C: stop waiting */
      shutdown_now(a);
    return;
  }
  dsv4_logp(DSV4_LOG_INFO, "draining", "{s:s,s:I}", "signal",
            signum == SIGTERM  ? "SIGTERM"
            : signum == SIGHUP ? "SIGHUP"
                               : "SIGINT",
            "deadline_ms", (json_int_t)a->d.cfg->drain_timeout_ms);
  a->d.draining = 1;
  dsv4_sd_notify("STOPPING=1");
  dsv4_server_drain(a->d.data);
  if (a->d.admin)
    dsv4_server_drain(a->d.admin);
  if (a->d.shm)
    dsv4_shm_drain(a->d.shm);
  a->drain_deadline_ms = uv_now(a->d.loop) + a->d.cfg->drain_timeout_ms;
  uv_timer_start(&a->drain_timer, on_drain_timer, 0, DRAIN_POLL_MS);
}

/*
 * Read a bearer token file. With private_only, a file that its group or others may read or write
 * (mode & 077) is refused with DSV4_EFORBID and *mode set: a token everyone on the host can read
 * protects nothing. The token is the file's bytes less trailing newlines, spaces and tabs (the rule
 * dsv4ctl applies to the same file); a file of more than 4095 bytes, or a token holding a space, a
 * control character or a NUL, is refused with DSV4_EINVAL and why says which: an HTTP header
 * cannot carry it, and a NUL would silently cut it short.
 */
static int read_token_file(const char *path, int private_only, char **out, unsigned *mode,
                           char *why, size_t why_len) {
  FILE *f;
  char buf[4096];
  size_t n;
  struct stat st;
  *out = NULL;
  snprintf(why, why_len, "%s", "cannot be opened or read");
  if (!path || !*path)
    return 0;
  f = fopen(path, "rb");
  if (!f)
    return DSV4_EIO;
  /* fstat on the open file: the mode checked is the mode of the bytes read. */
  if (fstat(fileno(f), &st) != 0) {
    fclose(f);
    return DSV4_EIO;
  }
  *mode = (unsigned)st.st_mode & 07777u;
  if (private_only && (st.st_mode & 077)) {
    fclose(f);
    return DSV4_EFORBID;
  }
  n = fread(buf, 1, sizeof(buf), f);
  int rerr = ferror(f);
  fclose(f);
  if (rerr)
    return DSV4_EIO;
  if (n == sizeof(buf)) { /* the same limit as dsv4ctl's, on the file before trimming */
    snprintf(why, why_len, "is longer than %zu bytes", sizeof(buf) - 1);
    return DSV4_EINVAL;
  }
  while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
    n--;
  if (!n) {
    snprintf(why, why_len, "%s", "is empty");
    return DSV4_EINVAL;
  }
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)buf[i] < 0x21 || (unsigned char)buf[i] == 0x7f) {
      snprintf(why, why_len, "holds a space, a control character or a NUL at byte %zu", i);
      return DSV4_EINVAL;
    }
  buf[n] = '\0';
  *out = strdup(buf);
  return *out ? 0 : DSV4_ENOMEM;
}

/* The data plane's request bodies, in the pinned pool when it has room. Loop thread. */
static void *body_alloc(void *arg, size_t n) {
  return dsv4_daemon_buf_alloc(arg, n, "body");
}

static void body_free(void *arg, void *p) {
  dsv4_daemon_buf_free(arg, p);
}

/* One listener with the configuration's limits and timeouts; logs why when it cannot listen. Its
 * request bodies go to the pinned pool when pinned_bodies is set and the pool is on. */
static int listen_on(dsv4_daemon_t *d, const char *name, const char *host, int port,
                     const char *unix_path, size_t max_connections, const char *token,
                     const dsv4_route_t *routes, size_t n_routes,
                     void (*on_complete)(const dsv4_req_t *, int, uint64_t, int, void *),
                     int pinned_bodies, dsv4_server_t **out) {
  const dsv4_config_t *cfg = d->cfg;
  dsv4_server_config_t sc = {
      .host = host,
      .port = port,
      .unix_path = unix_path,
      .max_header_bytes = cfg->max_header_bytes,
      .max_connections = max_connections,
      .header_timeout_ms = cfg->header_timeout_ms,
      .body_timeout_ms = cfg->body_timeout_ms,
      .idle_timeout_ms = cfg->idle_timeout_ms,
      .write_timeout_ms = cfg->write_timeout_ms,
      .io_slice_bytes = cfg->io_slice_bytes,
      .bulk_io_bytes = cfg->bulk_io_bytes,
      .bearer_token = token,
      .instance = d->instance,
      .name = name,
      .metrics = d->metrics,
      .on_complete = on_complete,
      .on_complete_arg = d,
      .body_alloc = pinned_bodies && d->pinned ? body_alloc : NULL,
      .body_free = pinned_bodies && d->pinned ? body_free : NULL,
      .body_alloc_arg = d,
  };
  int rc = dsv4_server_create(d->loop, &sc, routes, n_routes, out);
  if (rc) {
    *out = NULL;
    if (rc != DSV4_EIO) /* a bind or listen failure (DSV4_EIO) was logged with its own reason */
      dsv4_logp(DSV4_LOG_ERROR, "cannot listen", "{s:s,s:s,s:i,s:s}", "listener", name, "host",
                host, "port", port, "error", dsv4_strerror(rc));
  }
  return rc;
}

/* Exit codes of the start-up passes: 0 continue, else the process's exit status. */
#define EXIT_BAD_CONFIG 2
#define EXIT_FAILED 1

/*
 * The request and response bodies are megabytes each and come and go with every batch. Served from
 * the heap and kept there, their pages stay mapped between batches; left to mmap, every batch
 * would fault in and zero fresh pages (measured: most of a 64-token batch's time).
 */
#define BODY_MMAP_THRESHOLD (512 << 20)
#define BODY_TRIM_THRESHOLD (1024 << 20)

/* Load the configuration (file < env < CLI). -1: --help or --version was answered (exit 0). */
static int load_config(app_t *a, int argc, char **argv) {
  char err[512];
  int level;
  int rc = dsv4_config_load(&a->cfg, argc, argv, environ, err, sizeof(err));
  if (rc == DSV4_CONFIG_HELP || rc == DSV4_CONFIG_VERSION)
    return -1;
  if (rc) {
    /* A JSON line like every other start-up error: the value it quotes is escaped, so a newline in
     * it cannot forge a log line; bytes outside ASCII become '?' (a log line must be UTF-8). */
    for (char *c = err; *c; c++)
      if ((unsigned char)*c >= 0x80)
        *c = '?';
    dsv4_logp(DSV4_LOG_ERROR, "bad configuration", "{s:s}", "error", err);
    return EXIT_BAD_CONFIG;
  }
  if (dsv4_log_parse_level(a->cfg.log_level, &level) == 0)
    dsv4_log_set_level(level);
  return 0;
}

/* One bearer token file, private to the daemon's user (as ssh asks of a key). */
static int load_token(const char *option, const char *path, char **out) {
  char why[128], m[8], msg[96];
  unsigned mode = 0;
  int rc = read_token_file(path, 1, out, &mode, why, sizeof(why));
  if (rc == DSV4_EFORBID) {
    snprintf(m, sizeof(m), "0%03o", mode);
    snprintf(msg, sizeof(msg), "%s is readable or writable by group or others", option);
    dsv4_logp(DSV4_LOG_ERROR, msg, "{s:s,s:s,s:s}", "path", path, "mode", m, "fix",
              "chmod 600 the file");
    return EXIT_BAD_CONFIG;
  }
  if (rc) {
    snprintf(msg, sizeof(msg), "cannot use %s", option);
    dsv4_logp(DSV4_LOG_ERROR, msg, "{s:s,s:s}", "path", path, "why", why);
    return EXIT_BAD_CONFIG;
  }
  return 0;
}

/* The checkpoint's small tensors for the served layers: the attention sinks whenever a checkpoint
 * is configured, the kv_norm weights for kv_norm = fused. */
static int load_weights(const dsv4_config_t *cfg, dsv4_layer_weights_t *lw) {
  char why[512];
  dsv4_weights_t *w = NULL;
  uint32_t *ratios;
  memset(lw, 0, sizeof(*lw));
  if (!*cfg->weights_path)
    return 0;
  ratios = calloc(cfg->n_served ? cfg->n_served : 1, sizeof(uint32_t));
  if (!ratios)
    return EXIT_FAILED;
  for (uint32_t i = 0; i < cfg->n_served; i++)
    ratios[i] = cfg->model.compress_ratios[cfg->served_layers[i]];
  dsv4_layer_weights_req_t req = {
      .served_layers = cfg->served_layers,
      .n_served = cfg->n_served,
      .total_heads = cfg->model.num_attention_heads,
      .head_offset = cfg->head_offset,
      .heads = cfg->heads,
      .kv_norm = !strcmp(cfg->kv_norm, "fused"),
      .sinks = 1,
      .ratios = ratios,
  };
  int rc = dsv4_weights_open(cfg->weights_path, &w, why, sizeof(why));
  /* Named only by the older kv_norm_weights, a file of kv_norm weights alone stays valid: its
   * layers then have no sinks and no compressor, and a batch asking for attention is refused. */
  if (!strcmp(cfg->compressed_branch, "off"))
    req.ratios = NULL;
  if (!rc && !*cfg->weights && cfg->n_served) {
    req.ratios = NULL;
    char name[64];
    const char *file;
    snprintf(name, sizeof(name), "layers.%u.attn.attn_sink", cfg->served_layers[0]);
    req.sinks = dsv4_weights_find(w, name, &file) != NULL;
  }
  if (!rc)
    rc = dsv4_layer_weights_load(w, &req, lw, why, sizeof(why));
  dsv4_weights_close(w);
  free(ratios);
  if (rc)
    dsv4_logp(DSV4_LOG_ERROR, "cannot load weights", "{s:s,s:s}", "option",
              *cfg->weights ? "weights" : "kv_norm_weights", "why", why);
  return rc ? EXIT_BAD_CONFIG : 0;
}

/* The engine over the configured backend, with the served layers' weights. */
static int start_engine(app_t *a) {
  const dsv4_config_t *cfg = &a->cfg;
  dsv4_daemon_t *d = &a->d;
  char err[512];
  dsv4_layer_weights_t lw;
  int rc = load_weights(cfg, &lw);
  if (rc)
    return rc;
  dsv4_engine_compressor_t *comp = NULL;
  if (lw.comp && !(comp = calloc(cfg->n_served, sizeof(*comp)))) {
    dsv4_layer_weights_free(&lw);
    return EXIT_FAILED;
  }
  for (uint32_t i = 0; comp && i < cfg->n_served; i++)
    comp[i] = (dsv4_engine_compressor_t){lw.comp[i].ape, lw.comp[i].norm, lw.comp[i].i_ape,
                                         lw.comp[i].i_norm};
  const char *backend = cfg->backend;
  if (alias_from && !strcmp(backend, alias_from))
    backend = alias_to;
  dsv4_engine_params_t ep = {
      .backend = backend,
      .threads = cfg->threads,
      .block_size = cfg->block_size,
      .kv_blocks = cfg->kv_blocks,
      .heads = cfg->heads,
      .model = &cfg->model,
      .served_layers = cfg->served_layers,
      .n_served = cfg->n_served,
      .kv_norm_weights = lw.kv_norm,
      .attn_sinks = lw.sinks,
      .attention_mode =
          !strcmp(cfg->attention_mode, "fast") ? DSV4_ATTENTION_FAST : DSV4_ATTENTION_EXACT,
      .compressors = comp,
      .c4_blocks = cfg->c4_blocks,
      .c128_blocks = cfg->c128_blocks,
      .max_sequences = cfg->max_sequences,
      .implicit_create = cfg->implicit_create,
      .idle_timeout_ns = cfg->sequence_idle_timeout_s * 1000000000u,
      .prefill_chunk_tokens = cfg->prefill_chunk_tokens,
      .prefill_chunk_tokens_alone = cfg->prefill_chunk_tokens_alone,
      .in_place_max_bytes = cfg->in_place_max_bytes,
      .cache_flush_bytes = cfg->cache_flush_bytes,
  };
  err[0] = '\0';
  rc = dsv4_engine_create(&ep, &d->engine, err, sizeof(err));
  dsv4_layer_weights_free(&lw);
  free(comp);
  if (rc) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot start the engine", "{s:s,s:s,s:s}", "backend", backend,
              "error", dsv4_strerror(rc), "why", err);
    return EXIT_FAILED;
  }
  if (err[0]) /* backend = auto passed over unusable devices: say which, and why, in one line */
    dsv4_logp(DSV4_LOG_INFO, "backends skipped", "{s:s,s:s}", "using",
              dsv4_engine_backend_name(d->engine), "why", err);
  return 0;
}

/*
 * The pinned pool (pinned_pool_mib), when the backend copies faster from registered memory: one
 * arena, registered once before the executor thread starts. Without the hook the pool is off and
 * says nothing (the CPU backend reads any memory as fast); when the arena cannot be mapped or
 * registered, one line says why and the daemon runs without it, as with pinned_pool_mib 0.
 */
static void start_pinned_pool(app_t *a) {
  dsv4_daemon_t *d = &a->d;
  size_t bytes = (size_t)a->cfg.pinned_pool_mib << 20;
  dsv4_pinned_pool_t *p = NULL;
  if (!bytes || !dsv4_engine_can_host_register(d->engine))
    return;
  int rc = dsv4_pinned_pool_create(bytes, &p);
  const char *what = "cannot map the arena";
  if (!rc) {
    rc = dsv4_engine_host_register(d->engine, dsv4_pinned_pool_base(p), dsv4_pinned_pool_bytes(p));
    what = "the backend cannot register the arena";
  }
  if (rc) {
    dsv4_logp(DSV4_LOG_WARN, "pinned pool off: bodies and answers in heap memory", "{s:I,s:s,s:s}",
              "bytes", (json_int_t)bytes, "why", what, "error", dsv4_strerror(rc));
    dsv4_pinned_pool_destroy(p);
    return;
  }
  d->pinned = p;
  dsv4_pinned_placement_t at;
  dsv4_pinned_pool_placement(p, &at);
  dsv4_logp(DSV4_LOG_INFO, "pinned pool", "{s:I,s:s,s:i,s:i,s:I}", "bytes",
            (json_int_t)dsv4_pinned_pool_bytes(p), "backend", dsv4_engine_backend_name(d->engine),
            "numa_node", at.first_node, "numa_node_last", at.last_node, "huge_page_bytes",
            (json_int_t)at.huge_bytes);
}

/* After the executor thread has stopped: unregister the arena and unmap it. Every body and answer
 * has been freed by then (their connections and jobs are gone); a block still live is a leak. */
static void stop_pinned_pool(app_t *a) {
  dsv4_daemon_t *d = &a->d;
  dsv4_pinned_stats_t st;
  if (!d->pinned)
    return;
  dsv4_pinned_pool_stats(d->pinned, &st);
  if (st.blocks)
    dsv4_logp(DSV4_LOG_WARN, "pinned pool blocks still allocated at exit", "{s:I,s:I}", "blocks",
              (json_int_t)st.blocks, "bytes", (json_int_t)st.used);
  dsv4_engine_host_unregister(d->engine, dsv4_pinned_pool_base(d->pinned));
  dsv4_pinned_pool_destroy(d->pinned);
  d->pinned = NULL;
}

/* The metrics, the executor thread and both listeners. On failure what was started is stopped and
 * the loop has run until it is closed. */
static int start_serving(app_t *a) {
  dsv4_daemon_t *d = &a->d;
  const dsv4_config_t *cfg = &a->cfg;
  dsv4_route_t routes[MAX_ROUTES];
  size_t n_routes;
  if (dsv4_metrics_create(&d->metrics) || dsv4_daemon_metrics_init(d)) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot create metrics", NULL);
    return EXIT_FAILED;
  }
  if (dsv4_executor_start(&d->ex, &a->loop, cfg->queue_depth, tick, d)) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot start the executor thread", NULL);
    return EXIT_FAILED;
  }
  dsv4_executor_set_busy_poll(&d->ex, cfg->busy_poll_us);
  n_routes = dsv4_data_routes(d, routes, sizeof(routes) / sizeof(routes[0]));
  /* The admin plane has no limit of its own: its few connections come out of the reserve. */
  if (listen_on(d, "data", cfg->host, cfg->port, cfg->listen_unix,
                cfg->max_connections ? cfg->max_connections : dsv4_server_default_max_connections(),
                a->token, routes, n_routes, NULL, 1, &d->data)) {
    dsv4_executor_stop(&d->ex, NULL, NULL);
    uv_run(&a->loop, UV_RUN_DEFAULT);
    return EXIT_FAILED;
  }
  n_routes = dsv4_admin_routes(d, routes, sizeof(routes) / sizeof(routes[0]));
  d->admin_token = a->admin_token != NULL;
  d->admin_loopback = dsv4_host_is_loopback(cfg->admin_host);
  if (listen_on(d, "admin", cfg->admin_host, cfg->admin_port, NULL, 0, a->admin_token, routes,
                n_routes, dsv4_admin_audit, 0, &d->admin)) {
    dsv4_server_close(d->data, NULL, NULL);
    dsv4_executor_stop(&d->ex, NULL, NULL);
    uv_run(&a->loop, UV_RUN_DEFAULT);
    return EXIT_FAILED;
  }
  if (!d->admin_token && !d->admin_loopback)
    dsv4_logp(DSV4_LOG_WARN, "admin listener is not loopback and has no token: dumps are refused",
              "{s:s}", "admin_host", cfg->admin_host);
  /* Shared regions count their clients against the data plane's limit, separately. */
  if (cfg->listen_shm[0] &&
      dsv4_shm_listen(d, cfg->listen_shm, a->token,
                      cfg->max_connections ? cfg->max_connections
                                           : dsv4_server_default_max_connections(),
                      &d->shm)) {
    dsv4_server_close(d->admin, NULL, NULL);
    dsv4_server_close(d->data, NULL, NULL);
    dsv4_executor_stop(&d->ex, NULL, NULL);
    uv_run(&a->loop, UV_RUN_DEFAULT);
    return EXIT_FAILED;
  }
  return 0;
}

/* SIGTERM, SIGINT and SIGHUP drain; a second SIGINT stops at once. */
static void start_signals(app_t *a) {
  a->sigterm.data = a->sigint.data = a->sighup.data = a->drain_timer.data = a;
  uv_signal_init(&a->loop, &a->sigterm);
  uv_signal_init(&a->loop, &a->sigint);
  uv_signal_init(&a->loop, &a->sighup);
  uv_timer_init(&a->loop, &a->drain_timer);
  uv_signal_start(&a->sigterm, on_signal, SIGTERM);
  uv_signal_start(&a->sigint, on_signal, SIGINT);
  /* The configuration is not reloaded: a hang-up (a closed terminal, a service manager's reload
   * without a reload command) drains like SIGTERM instead of killing batches in flight. */
  uv_signal_start(&a->sighup, on_signal, SIGHUP);
}

/* Executor thread: the sequences of the last drain's snapshot, before any request is served. */
static void restore_run(dsv4_job_t *job) {
  dsv4__snapshot_restore(&app_of(job)->d);
}

static void restore_done(dsv4_job_t *job) {
  app_of(job)->d.restoring = 0;
}

/* The restore is the executor's first job: a request that arrives meanwhile waits behind it, and
 * /readyz answers 503 "restoring" until it is done. */
static void start_restore(app_t *a) {
  if (!a->cfg.snapshot_dir[0])
    return;
  a->d.restoring = 1;
  a->snap_job.run = restore_run;
  a->snap_job.done = restore_done;
  dsv4_executor_submit_force(&a->d.ex, &a->snap_job);
}

static void log_started(app_t *a, uint64_t t0) {
  dsv4_daemon_t *d = &a->d;
  const dsv4_config_t *cfg = &a->cfg;
  dsv4_logp(DSV4_LOG_INFO, "started", "{s:s,s:s,s:s,s:i,s:i,s:i,s:I,s:f}", "version", DSV4_VERSION,
            "instance", d->instance, "backend", dsv4_engine_backend_name(d->engine), "layers",
            (int)cfg->n_served, "heads", (int)cfg->heads, "block_size", (int)cfg->block_size,
            "cache_bytes", (json_int_t)dsv4_engine_cache_bytes(d->engine), "startup_s",
            (double)(uv_hrtime() - t0) * 1e-9);
  dsv4_log_listening("data", cfg->host, dsv4_server_port(d->data));
  dsv4_log_listening("admin", cfg->admin_host, dsv4_server_port(d->admin));
  if (cfg->listen_unix[0])
    dsv4_log_listening_unix(cfg->listen_unix);
  if (cfg->listen_shm[0])
    dsv4_log_listening_path("shm", cfg->listen_shm);
  if (dsv4_sd_notify("READY=1"))
    dsv4_logp(DSV4_LOG_WARN, "cannot notify the service manager", "{s:s}", "socket",
              getenv("NOTIFY_SOCKET"));
}

/* Close every handle still open and the loop; 0 when the loop closed clean. */
static int close_loop(app_t *a) {
  uv_walk(&a->loop, on_walk_close, NULL);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  return uv_loop_close(&a->loop);
}

static void release(app_t *a) {
  stop_pinned_pool(a);
  dsv4_engine_destroy(a->d.engine);
  dsv4_metrics_destroy(a->d.metrics);
  free(a->token);
  free(a->admin_token);
  dsv4_config_free(&a->cfg);
}

int dsv4d_run(int argc, char **argv) {
  static app_t app;
  app_t *a = &app;
  uint64_t t0 = uv_hrtime();
  int rc;

  signal(SIGPIPE, SIG_IGN);
  mallopt(M_MMAP_THRESHOLD, BODY_MMAP_THRESHOLD);
  mallopt(M_TRIM_THRESHOLD, BODY_TRIM_THRESHOLD);
  rc = load_config(a, argc, argv);
  if (!rc)
    rc = load_token("api_token_file", a->cfg.api_token_file, &a->token);
  if (!rc)
    rc = load_token("admin_token_file", a->cfg.admin_token_file, &a->admin_token);
  a->d.cfg = &a->cfg;
  make_instance(a->d.instance);
  if (!rc)
    rc = start_engine(a);
  if (!rc)
    start_pinned_pool(a);
  if (rc) {
    release(a);
    return rc < 0 ? 0 : rc;
  }
  uv_loop_init(&a->loop);
  a->d.loop = &a->loop;
  rc = start_serving(a);
  if (rc) {
    /* A start-up failure after the engine exists: release everything, as a normal exit does. */
    (void)close_loop(a);
    release(a);
    return rc;
  }
  start_signals(a);
  start_restore(a);
  log_started(a, t0);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  /* Every handle must be closed by now; a leak shows as a non-zero uv_loop_close. */
  rc = close_loop(a);
  if (rc)
    dsv4_logp(DSV4_LOG_ERROR, "event loop closed with open handles", NULL);
  release(a);
  dsv4_logp(DSV4_LOG_INFO, "exit", "{s:i}", "code", rc ? 1 : 0);
  return rc ? 1 : 0;
}
