/*
 * dsv4d: serves DeepSeek V4 attention layers over HTTP. main() wires the configuration, the engine
 * (behind the executor thread), the data-plane listener and signal handling, then runs the loop.
 */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "dsv4-error.h"
#include "kvweights.h"
#include "log.h"
#include "sdnotify.h"
#ifdef DSV4_TEST_CPU_STAGED
#include "cpu_staged.h"
#endif

extern char **environ;

typedef struct {
  dsv4_daemon_t d;
  uv_signal_t sigterm, sigint, sighup;
  uv_timer_t drain_timer;
  uint64_t drain_deadline_ms;
  int servers_open; /* listeners not yet closed: the executor stops after the last */
  int closing;
  int exit_code;
} app_t;

static void make_instance(char out[33]) {
  unsigned char r[16];
  size_t got = 0;
  while (got < sizeof(r)) {
    ssize_t n = getrandom(r + got, sizeof(r) - got, 0);
    if (n > 0)
      got += (size_t)n;
  }
  for (int i = 0; i < 16; i++)
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
  a->servers_open = a->d.admin ? 2 : 1;
  dsv4_server_close(a->d.data, on_server_closed, a);
  if (a->d.admin)
    dsv4_server_close(a->d.admin, on_server_closed, a);
}

/* While draining: finish once no batch is pending and every connection has gone. */
static void on_drain_timer(uv_timer_t *t) {
  app_t *a = t->data;
  uint32_t pending = dsv4_executor_pending(&a->d.ex);
  size_t conns =
      dsv4_server_connections(a->d.data) + (a->d.admin ? dsv4_server_connections(a->d.admin) : 0);
  if (pending == 0 && conns == 0) {
    dsv4_logp(DSV4_LOG_INFO, "drained", NULL);
    shutdown_now(a);
  } else if (uv_now(a->d.loop) >= a->drain_deadline_ms && pending == 0) {
    /* Batches always finish; past the deadline only idle or slow connections are cut. */
    dsv4_logp(DSV4_LOG_WARN, "drain deadline passed; closing connections", "{s:I}", "connections",
              (json_int_t)conns);
    shutdown_now(a);
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
  a->drain_deadline_ms = uv_now(a->d.loop) + a->d.cfg->drain_timeout_ms;
  uv_timer_start(&a->drain_timer, on_drain_timer, 0, 20);
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

/* One listener with the configuration's limits and timeouts; logs why when it cannot listen. */
static int listen_on(dsv4_daemon_t *d, const char *name, const char *host, int port,
                     size_t max_connections, const char *token, const dsv4_route_t *routes,
                     size_t n_routes,
                     void (*on_complete)(const dsv4_req_t *, int, uint64_t, int, void *),
                     dsv4_server_t **out) {
  const dsv4_config_t *cfg = d->cfg;
  dsv4_server_config_t sc = {
      .host = host,
      .port = port,
      .max_header_bytes = cfg->max_header_bytes,
      .max_connections = max_connections,
      .header_timeout_ms = cfg->header_timeout_ms,
      .body_timeout_ms = cfg->body_timeout_ms,
      .idle_timeout_ms = cfg->idle_timeout_ms,
      .write_timeout_ms = cfg->write_timeout_ms,
      .bearer_token = token,
      .instance = d->instance,
      .name = name,
      .metrics = d->metrics,
      .on_complete = on_complete,
      .on_complete_arg = d,
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

int main(int argc, char **argv) {
  static app_t app;
  dsv4_daemon_t *d = &app.d;
  dsv4_config_t cfg;
  char err[512];
  char *token = NULL, *admin_token = NULL;
  unsigned mode = 0;
  float *kv_w = NULL;
  uv_loop_t loop;
  dsv4_route_t routes[8];
  size_t n_routes;
  uint64_t t0 = uv_hrtime();
  int rc, level;

  signal(SIGPIPE, SIG_IGN);
  /*
   * Request and response bodies are megabytes each and come and go with every batch. Served from
   * the heap and kept there, their pages stay mapped between batches; left to mmap, every batch
   * would fault in and zero fresh pages (measured: most of a 64-token batch's time).
   */
  mallopt(M_MMAP_THRESHOLD, 512 << 20);
  mallopt(M_TRIM_THRESHOLD, 1024 << 20);
  memset(&cfg, 0, sizeof(cfg));
  rc = dsv4_config_load(&cfg, argc, argv, environ, err, sizeof(err));
  if (rc == DSV4_CONFIG_HELP || rc == DSV4_CONFIG_VERSION) {
    dsv4_config_free(&cfg);
    return 0;
  }
  if (rc) {
    /* A JSON line like every other start-up error: the value it quotes is escaped, so a newline in
     * it cannot forge a log line; bytes outside ASCII become '?' (a log line must be UTF-8). */
    for (char *c = err; *c; c++)
      if ((unsigned char)*c >= 0x80)
        *c = '?';
    dsv4_logp(DSV4_LOG_ERROR, "bad configuration", "{s:s}", "error", err);
    dsv4_config_free(&cfg);
    return 2;
  }
  if (dsv4_log_parse_level(cfg.log_level, &level) == 0)
    dsv4_log_set_level(level);
  char why[128];
  if (read_token_file(cfg.api_token_file, 0, &token, &mode, why, sizeof(why))) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot use api_token_file", "{s:s,s:s}", "path", cfg.api_token_file,
              "why", why);
    dsv4_config_free(&cfg);
    return 2;
  }
  rc = read_token_file(cfg.admin_token_file, 1, &admin_token, &mode, why, sizeof(why));
  if (rc == DSV4_EFORBID) {
    char m[8];
    snprintf(m, sizeof(m), "0%03o", mode);
    dsv4_logp(DSV4_LOG_ERROR, "admin_token_file is readable or writable by group or others",
              "{s:s,s:s,s:s}", "path", cfg.admin_token_file, "mode", m, "fix",
              "chmod 600 the file");
    free(token);
    dsv4_config_free(&cfg);
    return 2;
  }
  if (rc) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot use admin_token_file", "{s:s,s:s}", "path",
              cfg.admin_token_file, "why", why);
    free(token);
    dsv4_config_free(&cfg);
    return 2;
  }
  if (!strcmp(cfg.kv_norm, "fused")) {
    rc = dsv4_kv_norm_weights_load(cfg.kv_norm_weights, cfg.served_layers, cfg.n_served, &kv_w, err,
                                   sizeof(err));
    if (rc) {
      dsv4_logp(DSV4_LOG_ERROR, "cannot load kv_norm weights", "{s:s}", "why", err);
      free(token);
      free(admin_token);
      dsv4_config_free(&cfg);
      return 2;
    }
  }

  d->cfg = &cfg;
  make_instance(d->instance);
  {
    const char *backend = cfg.backend;
#ifdef DSV4_TEST_CPU_STAGED
    /* The test daemon dsv4d_staged: the CPU backend behind device staging stands in for cpu, so
     * the integration suite runs through the engine's staging path without a device. */
    if (dsv4_backend_register("cpu_staged", dsv4_test_cpu_staged_open) == 0 &&
        !strcmp(backend, "cpu"))
      backend = "cpu_staged";
#endif
    dsv4_engine_params_t ep = {
        .backend = backend,
        .threads = cfg.threads,
        .block_size = cfg.block_size,
        .kv_blocks = cfg.kv_blocks,
        .heads = cfg.heads,
        .model = &cfg.model,
        .served_layers = cfg.served_layers,
        .n_served = cfg.n_served,
        .kv_norm_weights = kv_w,
        .max_sequences = cfg.kv_blocks, /* every live sequence holds at least one block */
        .implicit_create = cfg.implicit_create,
        .idle_timeout_ns = cfg.sequence_idle_timeout_s * 1000000000u,
    };
    err[0] = '\0';
    rc = dsv4_engine_create(&ep, &d->engine, err, sizeof(err));
    free(kv_w);
    if (rc) {
      dsv4_logp(DSV4_LOG_ERROR, "cannot start the engine", "{s:s,s:s,s:s}", "backend", backend,
                "error", dsv4_strerror(rc), "why", err);
      free(token);
      free(admin_token);
      dsv4_config_free(&cfg);
      return 1;
    }
    if (err[0]) /* backend = auto passed over unusable devices: say which, and why, in one line */
      dsv4_logp(DSV4_LOG_INFO, "backends skipped", "{s:s,s:s}", "using",
                dsv4_engine_backend_name(d->engine), "why", err);
  }

  uv_loop_init(&loop);
  d->loop = &loop;
  if (dsv4_metrics_create(&d->metrics) || dsv4_daemon_metrics_init(d)) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot create metrics", NULL);
    goto fail;
  }
  rc = dsv4_executor_start(&d->ex, &loop, cfg.queue_depth, tick, d);
  if (rc) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot start the executor thread", NULL);
    goto fail;
  }
  n_routes = dsv4_data_routes(d, routes, sizeof(routes) / sizeof(routes[0]));
  /* The admin plane has no limit of its own: its few connections come out of the reserve. */
  rc = listen_on(d, "data", cfg.host, cfg.port,
                 cfg.max_connections ? cfg.max_connections : dsv4_server_default_max_connections(),
                 token, routes, n_routes, NULL, &d->data);
  if (rc) {
    dsv4_executor_stop(&d->ex, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    goto fail;
  }
  n_routes = dsv4_admin_routes(d, routes, sizeof(routes) / sizeof(routes[0]));
  d->admin_token = admin_token != NULL;
  d->admin_loopback = dsv4_host_is_loopback(cfg.admin_host);
  rc = listen_on(d, "admin", cfg.admin_host, cfg.admin_port, 0, admin_token, routes, n_routes,
                 dsv4_admin_audit, &d->admin);
  if (rc) {
    dsv4_server_close(d->data, NULL, NULL);
    dsv4_executor_stop(&d->ex, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    goto fail;
  }
  if (!d->admin_token && !d->admin_loopback)
    dsv4_logp(DSV4_LOG_WARN, "admin listener is not loopback and has no token: dumps are refused",
              "{s:s}", "admin_host", cfg.admin_host);
  app.sigterm.data = app.sigint.data = app.sighup.data = app.drain_timer.data = &app;
  uv_signal_init(&loop, &app.sigterm);
  uv_signal_init(&loop, &app.sigint);
  uv_signal_init(&loop, &app.sighup);
  uv_timer_init(&loop, &app.drain_timer);
  uv_signal_start(&app.sigterm, on_signal, SIGTERM);
  uv_signal_start(&app.sigint, on_signal, SIGINT);
  /* The configuration is not reloaded: a hang-up (a closed terminal, a service manager's reload
   * without a reload command) drains like SIGTERM instead of killing batches in flight. */
  uv_signal_start(&app.sighup, on_signal, SIGHUP);

  dsv4_logp(DSV4_LOG_INFO, "started", "{s:s,s:s,s:s,s:i,s:i,s:i,s:I,s:f}", "version", DSV4_VERSION,
            "instance", d->instance, "backend", dsv4_engine_backend_name(d->engine), "layers",
            (int)cfg.n_served, "heads", (int)cfg.heads, "block_size", (int)cfg.block_size,
            "cache_bytes", (json_int_t)dsv4_engine_cache_bytes(d->engine), "startup_s",
            (double)(uv_hrtime() - t0) * 1e-9);
  dsv4_log_listening("data", cfg.host, dsv4_server_port(d->data));
  dsv4_log_listening("admin", cfg.admin_host, dsv4_server_port(d->admin));
  if (dsv4_sd_notify("READY=1"))
    dsv4_logp(DSV4_LOG_WARN, "cannot notify the service manager", "{s:s}", "socket",
              getenv("NOTIFY_SOCKET"));

  uv_run(&loop, UV_RUN_DEFAULT);

  /* Every handle must be closed by now; a leak shows as a non-zero uv_loop_close. */
  uv_walk(&loop, on_walk_close, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  rc = uv_loop_close(&loop);
  if (rc)
    dsv4_logp(DSV4_LOG_ERROR, "event loop closed with open handles", NULL);
  dsv4_engine_destroy(d->engine);
  dsv4_metrics_destroy(d->metrics);
  free(token);
  free(admin_token);
  dsv4_config_free(&cfg);
  dsv4_logp(DSV4_LOG_INFO, "exit", "{s:i}", "code", rc ? 1 : 0);
  return rc ? 1 : 0;

fail:
  /* A start-up failure after the engine exists: release everything, as a normal exit does. */
  uv_walk(&loop, on_walk_close, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  (void)uv_loop_close(&loop);
  dsv4_engine_destroy(d->engine);
  dsv4_metrics_destroy(d->metrics);
  free(token);
  free(admin_token);
  dsv4_config_free(&cfg);
  return 1;
}
