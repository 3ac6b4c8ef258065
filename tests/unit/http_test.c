/*
 * The HTTP layer against raw sockets: a server on 127.0.0.1 port 0 runs on a loop thread of its
 * own with test routes; the test thread talks to it with blocking sockets and checks what comes
 * back byte for byte.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "http.h"
#include "log.h"
#include "metrics.h"

#define TOKEN "sekrit-token"
#define INSTANCE "0123456789abcdef0123456789abcdef"

/* ---- the server side (loop thread) --------------------------------------------------------- */

static uv_loop_t loop;
static uv_async_t wake;
static pthread_t loop_thread;
static dsv4_server_t *srv;
static dsv4_metrics_t *registry;
static int port;
static atomic_int handler_calls;
static atomic_int gone_seen;
static atomic_int gone_responded;
static atomic_int server_closed;

typedef struct {
  void (*fn)(void *);
  void *arg;
  int done;
} cmd_t;
static pthread_mutex_t cmd_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cmd_cv = PTHREAD_COND_INITIALIZER;
static cmd_t *cmd_pending;

static void on_wake(uv_async_t *a) {
  (void)a;
  pthread_mutex_lock(&cmd_mu);
  cmd_t *c = cmd_pending;
  cmd_pending = NULL;
  pthread_mutex_unlock(&cmd_mu);
  if (!c)
    return;
  c->fn(c->arg);
  pthread_mutex_lock(&cmd_mu);
  c->done = 1;
  pthread_cond_broadcast(&cmd_cv);
  pthread_mutex_unlock(&cmd_mu);
}

/* Run fn(arg) on the loop thread and wait for it. */
static void on_loop(void (*fn)(void *), void *arg) {
  cmd_t c = {fn, arg, 0};
  pthread_mutex_lock(&cmd_mu);
  while (cmd_pending)
    pthread_cond_wait(&cmd_cv, &cmd_mu);
  cmd_pending = &c;
  pthread_mutex_unlock(&cmd_mu);
  uv_async_send(&wake);
  pthread_mutex_lock(&cmd_mu);
  while (!c.done)
    pthread_cond_wait(&cmd_cv, &cmd_mu);
  pthread_mutex_unlock(&cmd_mu);
}

/* The immediate responder: echoes what it saw. */
static void h_imm(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  const char *id = dsv4_req_header(req, "x-id");
  char *body = malloc(256);
  int n = snprintf(body, 256, "imm id=%s path=%s query=%s len=%zu", id ? id : "-", req->path,
                   req->query, req->body_len);
  /* The body is 64-byte aligned and holds exactly what was sent. */
  if (req->body && ((uintptr_t)req->body % 64 != 0))
    n = snprintf(body, 256, "misaligned");
  for (size_t i = 0; req->body && i < req->body_len; i++)
    if (req->body[i] != (uint8_t)(i * 31 + 7)) {
      n = snprintf(body, 256, "corrupt at %zu", i);
      break;
    }
  uv_buf_t b = uv_buf_init(body, (unsigned)n);
  dsv4_hdr_t extra = {"X-Handler", "imm"};
  dsv4_respond(req, 200, "text/plain", &extra, 1, &b, 1, free, body);
}

/* The /skew route places its body body[0] % 64 bytes past a 64-byte boundary (dsv4_route_t's
 * body_skew); its handler checks the place and every byte after the first (i * 31 + 7). */
static size_t skew_of(const uint8_t *first8) {
  return first8[0] & 63;
}

/* Its bodies' watcher (dsv4_route_t.watch): every call at the body's one place, with more of it
 * (never past the end), the bytes it says are in there already; the handler checks that it saw the
 * whole body. skew_watches: those begun and not ended. */
typedef struct {
  const uint8_t *body;
  size_t have, len;
  int calls, bad;
  pthread_t begun_on;
  int elsewhere; /* a call came on another thread than watch_begin's (the bulk thread) */
} skew_watch_t;
static atomic_int skew_watches;

static void *skew_watch_begin(void *ctx, size_t len) {
  (void)ctx;
  skew_watch_t *w = calloc(1, sizeof(*w));
  assert_non_null(w);
  w->len = len;
  w->begun_on = pthread_self();
  atomic_fetch_add(&skew_watches, 1);
  return w;
}

static void skew_watch_seen(void *wp, const uint8_t *body, size_t have) {
  skew_watch_t *w = wp;
  w->calls++;
  w->elsewhere |= !pthread_equal(pthread_self(), w->begun_on);
  if ((w->body && body != w->body) || have < w->have || have > w->len ||
      (w->len >= 8 && (uintptr_t)body % 64 != (body[0] & 63u)))
    w->bad = 1;
  for (size_t i = w->have > 1 ? w->have : 1; i < have && !w->bad; i++)
    w->bad = body[i] != (uint8_t)(i * 31 + 7);
  w->body = body;
  w->have = have;
}

static void skew_watch_end(void *wp) {
  atomic_fetch_sub(&skew_watches, 1);
  free(wp);
}

static const dsv4_body_watch_t skew_watch = {skew_watch_begin, skew_watch_seen, skew_watch_end};

static void h_skew(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  char *body = malloc(128);
  const uint8_t *b = req->body;
  size_t want = req->body_len >= 8 ? b[0] & 63 : 0;
  skew_watch_t *w = dsv4_req_take_watch(req);
  const int watched = w && !w->bad && w->calls >= 1 && w->body == b && w->have == req->body_len;
  const int elsewhere = w && w->elsewhere;
  if (w)
    skew_watch_end(w);
  int n = snprintf(body, 128, "at %zu of %zu, len=%zu%s%s", (size_t)((uintptr_t)b % 64), want,
                   req->body_len, watched ? ", watched" : "", elsewhere ? " off the loop" : "");
  for (size_t i = 1; i < req->body_len; i++)
    if (b[i] != (uint8_t)(i * 31 + 7)) {
      n = snprintf(body, 128, "corrupt at %zu", i);
      break;
    }
  uv_buf_t out = uv_buf_init(body, (unsigned)n);
  dsv4_respond(req, 200, "text/plain", NULL, 0, &out, 1, free, body);
}

typedef struct {
  uv_timer_t t;
  dsv4_req_t *req;
  int check_gone;
} defer_t;

static void defer_closed(uv_handle_t *h) {
  free(h->data);
}

static void defer_fire(uv_timer_t *t) {
  defer_t *d = t->data;
  if (d->check_gone) {
    if (dsv4_req_gone(d->req))
      atomic_fetch_add(&gone_seen, 1);
    dsv4_respond_error(d->req, DSV4_EQUEUE, NULL, json_pack("{s:i}", "depth", 7));
    atomic_fetch_add(&gone_responded, 1);
  } else {
    const char *id = dsv4_req_header(d->req, "x-id");
    char *body = malloc(64);
    int n = snprintf(body, 64, "defer id=%s", id ? id : "-");
    /* Two body buffers: the layer sends them in order after the headers. */
    uv_buf_t b[2] = {uv_buf_init(body, (unsigned)n), uv_buf_init((char *)"|tail", 5)};
    dsv4_respond(d->req, 200, "text/plain", NULL, 0, b, 2, free, body);
  }
  uv_close((uv_handle_t *)&d->t, defer_closed);
}

/* The deferred responder: answers from a timer, after ms= milliseconds of the query. */
static void h_defer(dsv4_req_t *req, void *ctx) {
  atomic_fetch_add(&handler_calls, 1);
  defer_t *d = calloc(1, sizeof(*d));
  d->req = req;
  d->check_gone = ctx != NULL;
  int ms = 50;
  sscanf(req->query, "ms=%d", &ms);
  uv_timer_init(&loop, &d->t);
  d->t.data = d;
  uv_timer_start(&d->t, defer_fire, (uint64_t)ms, 0);
}

static void h_busy(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  dsv4_respond_error(req, DSV4_EQUEUE, "queue is full", json_pack("{s:i}", "depth", 3));
}

static void h_empty(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  dsv4_hdr_t h = {"Dsv4d-Existed", "1"};
  dsv4_respond(req, 204, NULL, &h, 1, NULL, 0, NULL, NULL);
}

/* The streaming responder: n pieces of `piece` bytes (piece i filled with byte i), each written
 * once the previous one is in the socket; with short=1 it ends one piece early, with abandon=1
 * right after it queued the first piece. */
typedef struct {
  dsv4_req_t *req;
  int n, sent, piece, short_end, abandon;
  char *buf;
} stream_t;

static atomic_int stream_failed_cbs;
static atomic_int streams_ended;
static atomic_int completions;
static atomic_llong completion_bytes;

static void stream_end(stream_t *st) {
  dsv4_respond_stream_end(st->req);
  atomic_fetch_add(&streams_ended, 1);
  free(st->buf);
  free(st);
}

static void stream_next(stream_t *st);

static void on_piece(dsv4_req_t *req, int status, void *arg) {
  (void)req;
  stream_t *st = arg;
  if (status) {
    atomic_fetch_add(&stream_failed_cbs, 1);
    stream_end(st);
    return;
  }
  st->sent++;
  stream_next(st);
}

static void stream_next(stream_t *st) {
  if (st->sent == st->n - st->short_end) {
    stream_end(st);
    return;
  }
  memset(st->buf, st->sent & 0xff, (size_t)st->piece);
  uv_buf_t b = uv_buf_init(st->buf, (unsigned)st->piece);
  if (dsv4_respond_stream_write(st->req, &b, on_piece, st) || st->abandon)
    stream_end(st); /* the client has gone, or the test ends the stream with the piece queued */
}

static void h_stream(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  stream_t *st = calloc(1, sizeof(*st));
  st->req = req;
  st->n = 4;
  st->piece = 1000;
  sscanf(req->query, "n=%d&piece=%d&short=%d&abandon=%d", &st->n, &st->piece, &st->short_end,
         &st->abandon);
  st->buf = malloc((size_t)st->piece);
  dsv4_hdr_t h = {"X-Stream", "yes"};
  if (dsv4_respond_stream_begin(req, 200, "application/octet-stream", &h, 1,
                                (uint64_t)st->n * (uint64_t)st->piece))
    stream_end(st);
  else
    stream_next(st);
}

static void on_complete(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg) {
  (void)req;
  (void)status;
  (void)written;
  (void)arg;
  atomic_fetch_add(&completions, 1);
  atomic_store(&completion_bytes, (long long)bytes);
}

/* ---- the body allocator hook (setup_body_hook) ---- */

/* Bodies the hook has handed out and not yet taken back: the test sees that every body comes from
 * the hook and goes back to it exactly once. Loop thread, read by the test thread. */
#define HOOK_SLOTS 16
static void *hook_live[HOOK_SLOTS];
static atomic_int hook_allocs, hook_frees, hook_foreign, hook_refusals, hook_refuse;
static atomic_size_t hook_last_size;
static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;

static void *hook_alloc(void *arg, size_t n) {
  if (arg != &hook_live)
    atomic_fetch_add(&hook_foreign, 1);
  atomic_store(&hook_last_size, n);
  if (atomic_load(&hook_refuse)) {
    atomic_fetch_add(&hook_refusals, 1);
    return NULL;
  }
  void *p = aligned_alloc(64, n);
  pthread_mutex_lock(&hook_mu);
  for (int i = 0; p && i < HOOK_SLOTS; i++)
    if (!hook_live[i]) {
      hook_live[i] = p;
      atomic_fetch_add(&hook_allocs, 1);
      pthread_mutex_unlock(&hook_mu);
      return p;
    }
  pthread_mutex_unlock(&hook_mu);
  free(p);
  return NULL;
}

static void hook_free(void *arg, void *p) {
  if (arg != &hook_live)
    atomic_fetch_add(&hook_foreign, 1);
  if (!p)
    return;
  pthread_mutex_lock(&hook_mu);
  int i = 0;
  while (i < HOOK_SLOTS && hook_live[i] != p)
    i++;
  if (i < HOOK_SLOTS) {
    hook_live[i] = NULL;
    atomic_fetch_add(&hook_frees, 1);
  } else {
    atomic_fetch_add(&hook_foreign, 1);
  }
  pthread_mutex_unlock(&hook_mu);
  if (i < HOOK_SLOTS)
    free(p);
}

/* A handler that takes the body and gives it back through the hook, as the daemon's forward does.
 */
static void h_take(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&handler_calls, 1);
  size_t n = req->body_len;
  void *alloc = NULL;
  (void)dsv4_req_take_body(req, &alloc);
  if (req->body)
    n = 0; /* the body was not taken: the answer says so */
  hook_free(&hook_live, alloc);
  char *text = malloc(64);
  int len = snprintf(text, 64, "took len=%zu", n);
  uv_buf_t out = uv_buf_init(text, (unsigned)len);
  dsv4_respond(req, 200, "text/plain", NULL, 0, &out, 1, free, text);
}

/* The byte at offset i of a /parts answer: changes with i, and not with a period of a slice. */
static uint8_t parts_byte(size_t i) {
  return (uint8_t)((i * 131u) ^ (i >> 9) ^ (i >> 19));
}

/* Body buffers of the sizes in q ("N,N,...", at most 8) over one allocation (*b, malloc'd) filled
 * with parts_byte; returns how many. */
static size_t parts_make(const char *q, uint8_t **b, uv_buf_t out[8]) {
  size_t len[8], n = 0, total = 0;
  while (*q && n < 8) {
    char *end;
    len[n] = strtoul(q, &end, 10);
    total += len[n++];
    q = *end == ',' ? end + 1 : end;
  }
  *b = malloc(total ? total : 1);
  for (size_t i = 0; i < total; i++)
    (*b)[i] = parts_byte(i);
  for (size_t i = 0, off = 0; i < n; off += len[i++])
    out[i] = uv_buf_init((char *)*b + off, (unsigned)len[i]);
  return n;
}

/* An answer of several body buffers, their sizes in the query ("s=N,N,..."), one allocation
 * filled with parts_byte: an answer larger than the server's write slice goes out in slices. */
static void h_parts(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  uint8_t *b;
  uv_buf_t out[8];
  size_t n = parts_make(strncmp(req->query, "s=", 2) == 0 ? req->query + 2 : "", &b, out);
  dsv4_respond(req, 200, "application/octet-stream", NULL, 0, out, n, free, b);
}

/* ---- answers written by another thread (dsv4_direct_*) ---- */

/* A /direct request: answered as /parts by a thread of its own, which writes at most max bytes
 * of it itself (after wait ms), then hands it back to the loop through the async. */
typedef struct {
  uv_async_t back; /* first */
  dsv4_req_t *req;
  dsv4_direct_t dw;
  int opened, wait_ms;
  uint8_t *b;
  uv_buf_t out[8];
  size_t n;
  pthread_t t;
} direct_job_t;

/* Answers whose bytes the other thread wrote (in part at least), and its write errors. */
static atomic_int direct_written, direct_errors, direct_calls;
/* The bytes the other thread wrote of the last /direct answer. */
static atomic_size_t direct_last_bytes;

static void direct_closed(uv_handle_t *h) {
  free(h->data);
}

static void direct_back(uv_async_t *a) {
  direct_job_t *j = a->data;
  pthread_join(j->t, NULL);
  if (j->dw.written)
    atomic_fetch_add(&direct_written, 1);
  atomic_store(&direct_last_bytes, j->dw.written);
  if (j->dw.err)
    atomic_fetch_add(&direct_errors, 1);
  if (j->opened)
    dsv4_respond_direct(j->req, &j->dw, 200, "application/octet-stream", j->out, j->n, free, j->b);
  else
    dsv4_respond(j->req, 200, "application/octet-stream", NULL, 0, j->out, j->n, free, j->b);
  uv_close((uv_handle_t *)&j->back, direct_closed);
}

static void *direct_worker(void *arg) {
  direct_job_t *j = arg;
  if (j->wait_ms)
    usleep((useconds_t)j->wait_ms * 1000);
  if (j->opened)
    dsv4_direct_write(&j->dw, 200, "application/octet-stream", j->out, j->n);
  uv_async_send(&j->back);
  return NULL;
}

/* GET /direct?max=M&wait=W&s=N,N,...: /parts's answer, written as the daemon's executor writes
 * a forward's. */
static void h_direct(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  atomic_fetch_add(&direct_calls, 1);
  direct_job_t *j = calloc(1, sizeof(*j));
  unsigned long max = 0;
  int used = 0;
  sscanf(req->query, "max=%lu&wait=%d&s=%n", &max, &j->wait_ms, &used);
  j->req = req;
  j->n = parts_make(used ? req->query + used : "", &j->b, j->out);
  j->opened = dsv4_direct_open(req, max, &j->dw) == 0;
  uv_async_init(&loop, &j->back, direct_back);
  j->back.data = j;
  assert_int_equal(pthread_create(&j->t, NULL, direct_worker, j), 0);
}

static const dsv4_route_t routes[] = {
    {DSV4_HTTP_POST, "/take", "take", 1 << 20, 0, h_take, NULL, NULL, NULL},
    {DSV4_HTTP_GET, "/stream", "stream", 0, 0, h_stream, NULL, NULL, NULL},
    {DSV4_HTTP_GET, "/parts", "parts", 0, 0, h_parts, NULL, NULL, NULL},
    {DSV4_HTTP_GET, "/direct", "direct", 0, 0, h_direct, NULL, NULL, NULL},
    {DSV4_HTTP_GET | DSV4_HTTP_POST | DSV4_HTTP_HEAD, "/imm", "imm", 1 << 20, 0, h_imm, NULL, NULL,
     NULL},
    {DSV4_HTTP_GET | DSV4_HTTP_POST, "/defer", "defer", 1 << 20, 0, h_defer, NULL, NULL, NULL},
    {DSV4_HTTP_POST, "/gone", "gone", 1 << 20, 0, h_defer, (void *)1, NULL, NULL},
    {DSV4_HTTP_POST, "/small", "small", 1024, 0, h_imm, NULL, NULL, NULL},
    {DSV4_HTTP_POST, "/big", "big", 64 << 20, 0, h_imm, NULL, NULL, NULL},
    {DSV4_HTTP_GET, "/public", "public", 0, 1, h_imm, NULL, NULL, NULL},
    {DSV4_HTTP_GET | DSV4_HTTP_DELETE, "/v1/things/", "things", 0, 0, h_imm, NULL, NULL, NULL},
    {DSV4_HTTP_GET, "/busy", "busy", 0, 0, h_busy, NULL, NULL, NULL},
    {DSV4_HTTP_DELETE, "/empty", "empty", 0, 0, h_empty, NULL, NULL, NULL},
    {DSV4_HTTP_POST, "/skew", "skew", 8 << 20, 0, h_skew, NULL, skew_of, &skew_watch},
};

static void *loop_main(void *arg) {
  (void)arg;
  uv_run(&loop, UV_RUN_DEFAULT);
  return NULL;
}

/* What a test's setup changes in the server's configuration (0 = the default below). */
static uint64_t cfg_idle_timeout_ms;
static uint64_t cfg_body_timeout_ms;
static size_t cfg_max_connections;
static size_t cfg_io_slice; /* 0: the server's default */
static size_t cfg_bulk;     /* bulk_io_bytes; 0: no bulk thread */
static int cfg_body_hook;
/* Sockets of clients a test leaves open for the server's close to meet; teardown closes them. */
static int held_fd[2] = {-1, -1};

static void do_create(void *arg) {
  (void)arg;
  dsv4_server_config_t cfg = {
      .host = "127.0.0.1",
      .port = 0,
      .max_header_bytes = 8192,
      .header_timeout_ms = 300,
      .body_timeout_ms = 300,
      .idle_timeout_ms = 3000,
      .write_timeout_ms = 3000,
      .bearer_token = TOKEN,
      .instance = INSTANCE,
      .name = "data",
      .metrics = registry,
      .on_complete = on_complete,
  };
  if (cfg_idle_timeout_ms)
    cfg.idle_timeout_ms = cfg_idle_timeout_ms;
  if (cfg_body_timeout_ms)
    cfg.body_timeout_ms = cfg_body_timeout_ms;
  cfg.max_connections = cfg_max_connections;
  cfg.io_slice_bytes = cfg_io_slice;
  cfg.bulk_io_bytes = cfg_bulk;
  if (cfg_body_hook) {
    cfg.body_alloc = hook_alloc;
    cfg.body_free = hook_free;
    cfg.body_alloc_arg = &hook_live;
  }
  assert_int_equal(
      dsv4_server_create(&loop, &cfg, routes, sizeof(routes) / sizeof(routes[0]), &srv), 0);
  port = dsv4_server_port(srv);
}

static void on_server_closed(void *arg) {
  (void)arg;
  atomic_store(&server_closed, 1);
  uv_close((uv_handle_t *)&wake, NULL);
}

static void do_close(void *arg) {
  (void)arg;
  dsv4_server_close(srv, on_server_closed, NULL);
}

static void do_drain(void *arg) {
  (void)arg;
  dsv4_server_drain(srv);
}

static void do_count(void *arg) {
  *(size_t *)arg = dsv4_server_connections(srv);
}

static int log_fd = -1;
static char log_path[64];

static int setup(void **state) {
  (void)state;
  /* As in the daemon: a write to a connection the client reset fails with EPIPE, not a signal. */
  signal(SIGPIPE, SIG_IGN);
  atomic_store(&handler_calls, 0);
  atomic_store(&gone_seen, 0);
  atomic_store(&gone_responded, 0);
  atomic_store(&server_closed, 0);
  atomic_store(&stream_failed_cbs, 0);
  atomic_store(&streams_ended, 0);
  atomic_store(&completions, 0);
  atomic_store(&direct_written, 0);
  atomic_store(&direct_errors, 0);
  atomic_store(&direct_calls, 0);
  snprintf(log_path, sizeof(log_path), "/tmp/dsv4-http-test-%d.log", (int)getpid());
  log_fd = open(log_path, O_CREAT | O_TRUNC | O_RDWR, 0600);
  dsv4_log_set_fd(log_fd);
  /* Answered requests log at debug level; the tests read those lines too. */
  dsv4_log_set_level(DSV4_LOG_DEBUG);
  assert_int_equal(dsv4_metrics_create(&registry), 0);
  assert_int_equal(uv_loop_init(&loop), 0);
  assert_int_equal(uv_async_init(&loop, &wake, on_wake), 0);
  assert_int_equal(pthread_create(&loop_thread, NULL, loop_main, NULL), 0);
  on_loop(do_create, NULL);
  assert_true(port > 0);
  return 0;
}

static int setup_short_idle(void **state) {
  cfg_idle_timeout_ms = 200;
  return setup(state);
}

/* For bodies of many MiB: 300 ms is too short for 24 MiB under a sanitizer on a loaded machine. */
static int setup_long_body(void **state) {
  cfg_body_timeout_ms = 5000;
  return setup(state);
}

/* Slices of 64 KiB (io_slice_bytes' least): a 24 MiB body is read in 384 of them, a 9 MB answer
 * written in 138, each after the pace check. */
static int setup_small_slice(void **state) {
  cfg_io_slice = 65536;
  return setup_long_body(state);
}

/* The bulk thread moves every body's and answer's rest of 64 KiB or more. */
static int setup_bulk(void **state) {
  cfg_bulk = 65536;
  return setup_long_body(state);
}

static int setup_bulk_short_body(void **state) {
  cfg_bulk = 65536;
  return setup(state);
}

static int setup_two_connections(void **state) {
  cfg_max_connections = 2;
  return setup(state);
}

static int setup_body_hook(void **state) {
  cfg_body_hook = 1;
  atomic_store(&hook_allocs, 0);
  atomic_store(&hook_frees, 0);
  atomic_store(&hook_foreign, 0);
  atomic_store(&hook_refusals, 0);
  atomic_store(&hook_refuse, 0);
  return setup(state);
}

static int teardown(void **state) {
  (void)state;
  cfg_idle_timeout_ms = 0;
  cfg_body_timeout_ms = 0;
  cfg_max_connections = 0;
  cfg_io_slice = 0;
  cfg_bulk = 0;
  cfg_body_hook = 0;
  on_loop(do_close, NULL);
  pthread_join(loop_thread, NULL);
  for (int i = 0; i < 2; i++) {
    if (held_fd[i] >= 0)
      close(held_fd[i]);
    held_fd[i] = -1;
  }
  assert_int_equal(atomic_load(&server_closed), 1);
  /* Every handle of the server and its connections was closed: the loop closes cleanly. */
  assert_int_equal(uv_loop_close(&loop), 0);
  dsv4_metrics_destroy(registry);
  dsv4_log_set_fd(2);
  close(log_fd);
  unlink(log_path);
  return 0;
}

/* ---- the client side (test thread) --------------------------------------------------------- */

typedef struct {
  int fd;
  char buf[1 << 17];
  size_t len;
} client_t;

typedef struct {
  int status;
  char head[4096];
  char body[4096];
  size_t body_len;
} resp_t;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int dial(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static client_t *client_new(void) {
  client_t *c = calloc(1, sizeof(*c));
  assert_non_null(c);
  c->fd = dial();
  assert_true(c->fd >= 0);
  return c;
}

/* A client whose receive buffer is 4 KiB: an answer larger than the socket buffers stays queued
 * on the server's side while the client does not read. */
static client_t *client_small_window(void) {
  client_t *c = client_new();
  int small = 4096;
  setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  return c;
}

static void client_free(client_t *c) {
  if (c->fd >= 0)
    close(c->fd);
  free(c);
}

static void send_str(client_t *c, const char *s, size_t n) {
  while (n > 0) {
    ssize_t k = send(c->fd, s, n, MSG_NOSIGNAL);
    assert_true(k > 0);
    s += k;
    n -= (size_t)k;
  }
}

static void send_s(client_t *c, const char *s) {
  send_str(c, s, strlen(s));
}

/* Read more bytes; 0 on EOF, -1 on timeout or error. */
static int fill(client_t *c) {
  if (c->len == sizeof(c->buf))
    return -1;
  ssize_t k = recv(c->fd, c->buf + c->len, sizeof(c->buf) - c->len, 0);
  if (k <= 0)
    return k == 0 ? 0 : -1;
  c->len += (size_t)k;
  return 1;
}

/* Parse one response (which must arrive); returns the status. */
static int read_response(client_t *c, resp_t *r, int head_request) {
  memset(r, 0, sizeof(*r));
  char *end;
  while (!(end = memmem(c->buf, c->len, "\r\n\r\n", 4)))
    if (fill(c) <= 0)
      fail_msg("connection ended before a response head (%zu bytes)", c->len);
  size_t hlen = (size_t)(end - c->buf) + 4;
  assert_true(hlen < sizeof(r->head));
  memcpy(r->head, c->buf, hlen);
  assert_int_equal(sscanf(r->head, "HTTP/1.1 %d", &r->status), 1);
  size_t cl = 0;
  char *p = strcasestr(r->head, "\r\nContent-Length:");
  if (p && !head_request)
    cl = strtoul(p + 17, NULL, 10);
  while (c->len < hlen + cl)
    if (fill(c) <= 0)
      fail_msg("connection ended inside a response body");
  assert_true(cl < sizeof(r->body));
  memcpy(r->body, c->buf + hlen, cl);
  r->body_len = cl;
  memmove(c->buf, c->buf + hlen + cl, c->len - hlen - cl);
  c->len -= hlen + cl;
  return r->status;
}

/* The connection is closed by the server: EOF with nothing more. */
static void expect_eof(client_t *c) {
  assert_int_equal(c->len, 0);
  assert_int_equal(fill(c), 0);
}

static const char *header(resp_t *r, const char *name) {
  static char v[256];
  char pat[64];
  snprintf(pat, sizeof(pat), "\r\n%s: ", name);
  char *p = strcasestr(r->head, pat);
  if (!p)
    return NULL;
  p += strlen(pat);
  size_t n = strcspn(p, "\r");
  snprintf(v, sizeof(v), "%.*s", (int)n, p);
  return v;
}

static void get(client_t *c, const char *path, const char *id) {
  char req[512];
  snprintf(req, sizeof(req),
           "GET %s HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: %s\r\n\r\n",
           path, id);
  send_s(c, req);
}

static size_t server_connections(void) {
  size_t n;
  on_loop(do_count, &n);
  return n;
}

static void wait_connections(size_t want) {
  double t0 = now_s();
  while (server_connections() != want && now_s() - t0 < 5)
    usleep(5000);
  assert_int_equal(server_connections(), want);
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_keep_alive(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  for (int i = 0; i < 3; i++) {
    char id[8];
    snprintf(id, sizeof(id), "k%d", i);
    get(c, "/imm?x=1", id);
    assert_int_equal(read_response(c, &r, 0), 200);
    char want[128];
    snprintf(want, sizeof(want), "imm id=k%d path=/imm query=x=1 len=0", i);
    assert_int_equal(r.body_len, strlen(want));
    assert_memory_equal(r.body, want, r.body_len);
    assert_string_equal(header(&r, "Dsv4d-Instance"), INSTANCE);
    assert_string_equal(header(&r, "X-Handler"), "imm");
    assert_string_equal(header(&r, "Content-Type"), "text/plain");
    assert_null(header(&r, "Connection"));
  }
  assert_int_equal(server_connections(), 1);
  assert_int_equal(atomic_load(&handler_calls), 3);
  client_free(c);
  wait_connections(0);

  /* Requests were counted by route and code, and each has a log line. */
  char *text;
  size_t len;
  assert_int_equal(dsv4_metrics_render(registry, &text, &len), 0);
  assert_non_null(strstr(text, "dsv4d_requests_total{route=\"imm\",code=\"200\"} 3\n"));
  free(text);
  char logbuf[8192] = {0};
  assert_true(pread(log_fd, logbuf, sizeof(logbuf) - 1, 0) > 0);
  assert_non_null(strstr(logbuf, "\"msg\":\"request\""));
  assert_non_null(strstr(logbuf, "\"path\":\"/imm\""));
  assert_non_null(strstr(logbuf, "\"status\":200"));
}

static void test_pipelining_order(void **state) {
  (void)state;
  client_t *c = client_new();
  /* Three requests in one segment: a slow deferred one first, the immediate one must wait. */
  send_s(c, "GET /defer?ms=150 HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: a\r\n\r\n"
            "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: b\r\n"
            "Content-Length: 3\r\n\r\n\x07\x26\x45"
            "GET /defer?ms=5 HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: c\r\n\r\n");
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_int_equal(r.body_len, strlen("defer id=a|tail"));
  assert_memory_equal(r.body, "defer id=a|tail", r.body_len);
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_memory_equal(r.body, "imm id=b path=/imm query= len=3", r.body_len);
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_memory_equal(r.body, "defer id=c|tail", r.body_len);
  assert_int_equal(atomic_load(&handler_calls), 3);
  client_free(c);
}

static void test_body_large_and_split(void **state) {
  (void)state;
  client_t *c = client_new();
  size_t n = 300000;
  char *body = malloc(n);
  for (size_t i = 0; i < n; i++)
    body[i] = (char)(uint8_t)(i * 31 + 7);
  char head[256];
  snprintf(head, sizeof(head),
           "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: %zu\r\n"
           "X-Id: big\r\n\r\n",
           n);
  /* Headers and body arrive in awkward pieces. */
  send_str(c, head, 10);
  usleep(20000);
  send_str(c, head + 10, strlen(head) - 10);
  send_str(c, body, 1);
  usleep(20000);
  send_str(c, body + 1, n - 1);
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 200);
  char want[128];
  snprintf(want, sizeof(want), "imm id=big path=/imm query= len=%zu", n);
  assert_int_equal(r.body_len, strlen(want));
  assert_memory_equal(r.body, want, r.body_len);
  free(body);
  client_free(c);
}

static void test_413_before_body(void **state) {
  (void)state;
  client_t *c = client_new();
  double t0 = now_s();
  send_s(c, "POST /small HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n"
            "Content-Length: 1073741824\r\n\r\n");
  resp_t r;
  /* The answer comes at once, without a single body byte sent. */
  assert_int_equal(read_response(c, &r, 0), 413);
  assert_true(now_s() - t0 < 1.0);
  assert_non_null(strstr(r.body, "\"code\":\"payload_too_large\""));
  assert_string_equal(header(&r, "Connection"), "close");
  assert_string_equal(header(&r, "Dsv4d-Instance"), INSTANCE);
  expect_eof(c);
  client_free(c);

  /* A client that already sent part of the body still reads the 413 (no reset). */
  c = client_new();
  char *junk = calloc(1, 200000);
  send_s(c, "POST /small HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n"
            "Content-Length: 200000\r\n\r\n");
  send_str(c, junk, 200000);
  assert_int_equal(read_response(c, &r, 0), 413);
  free(junk);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 0);

  /* At the limit is fine. */
  c = client_new();
  char head[256];
  snprintf(head, sizeof(head),
           "POST /small HTTP/1.1\r\nAuthorization: Bearer " TOKEN
           "\r\nContent-Length: 1024\r\n\r\n");
  send_s(c, head);
  char body[1024];
  for (size_t i = 0; i < sizeof(body); i++)
    body[i] = (char)(uint8_t)(i * 31 + 7);
  send_str(c, body, sizeof(body));
  assert_int_equal(read_response(c, &r, 0), 200);
  client_free(c);
}

static void test_431(void **state) {
  (void)state;
  client_t *c = client_new();
  char *big = malloc(12000);
  memset(big, 'a', 11999);
  big[11999] = 0;
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Big: ");
  send_s(c, big);
  send_s(c, "\r\n\r\n");
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 431);
  assert_non_null(strstr(r.body, "\"code\":\"headers_too_large\""));
  free(big);
  client_free(c);

  /* Many small headers count too. */
  c = client_new();
  send_s(c, "GET /imm HTTP/1.1\r\n");
  for (int i = 0; i < 2000; i++)
    send_s(c, "A: b\r\n");
  send_s(c, "\r\n");
  assert_int_equal(read_response(c, &r, 0), 431);
  client_free(c);
  /* So does a long URL. */
  c = client_new();
  char *url = malloc(10000);
  memset(url, 'u', 9999);
  url[0] = '/';
  url[9999] = 0;
  send_s(c, "GET ");
  send_s(c, url);
  send_s(c, " HTTP/1.1\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 431);
  free(url);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 0);
}

static void test_411(void **state) {
  (void)state;
  client_t *c = client_new();
  send_s(c, "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n\r\n");
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 411);
  assert_non_null(strstr(r.body, "\"code\":\"length_required\""));
  /* Without a body the connection stays usable. */
  get(c, "/imm", "after411");
  assert_int_equal(read_response(c, &r, 0), 200);
  client_free(c);

  c = client_new();
  send_s(c, "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 411);
  assert_string_equal(header(&r, "Connection"), "close");
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 1);
}

static void test_404_405(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  get(c, "/nope", "x");
  assert_int_equal(read_response(c, &r, 0), 404);
  assert_string_equal(header(&r, "Content-Type"), "application/json");
  assert_string_equal(header(&r, "Dsv4d-Instance"), INSTANCE);
  assert_non_null(strstr(r.body, "{\"error\":{\"code\":\"not_found\",\"message\":"));
  send_s(c, "DELETE /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 405);
  assert_non_null(strstr(r.body, "\"code\":\"method_not_allowed\""));
  send_s(c, "PUT /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: 0\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 405);
  /* A prefix route matches below its prefix, not the prefix's parent. */
  get(c, "/v1/things/abc", "p");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "path=/v1/things/abc"));
  get(c, "/v1/things", "p");
  assert_int_equal(read_response(c, &r, 0), 404);
  /* Still the same connection after the errors. */
  assert_int_equal(server_connections(), 1);
  assert_int_equal(atomic_load(&handler_calls), 1);
  client_free(c);
}

static void test_401(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  send_s(c, "GET /imm HTTP/1.1\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 401);
  assert_non_null(strstr(r.body, "\"code\":\"unauthorized\""));
  assert_string_equal(header(&r, "WWW-Authenticate"), "Bearer");
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer sekrit-tokeN\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 401);
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer sekrit-token2\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 401);
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer sekrit\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 401);
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Basic " TOKEN "\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 401);
  assert_int_equal(atomic_load(&handler_calls), 0);
  send_s(c, "GET /imm HTTP/1.1\r\nauthorization:   bearer " TOKEN "  \r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  send_s(c, "GET /public HTTP/1.1\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_int_equal(atomic_load(&handler_calls), 2);
  client_free(c);
}

static void test_disconnect_mid_body(void **state) {
  (void)state;
  client_t *c = client_new();
  send_s(c,
         "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: 100000\r\n\r\n");
  char part[5000] = {0};
  send_str(c, part, sizeof(part));
  usleep(50000);
  assert_int_equal(server_connections(), 1);
  client_free(c);
  wait_connections(0);
  assert_int_equal(atomic_load(&handler_calls), 0);
}

static void test_gone_while_handler_works(void **state) {
  (void)state;
  client_t *c = client_new();
  send_s(c, "POST /gone?ms=200 HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nContent-Length: 2\r\n\r\nhi");
  usleep(50000);
  assert_int_equal(atomic_load(&handler_calls), 1);
  client_free(c);
  double t0 = now_s();
  while (atomic_load(&gone_responded) == 0 && now_s() - t0 < 5)
    usleep(5000);
  assert_int_equal(atomic_load(&gone_responded), 1);
  assert_int_equal(atomic_load(&gone_seen), 1);
  wait_connections(0);

  /* A client that stays sees the same handler's 503 with Retry-After and the details. */
  c = client_new();
  send_s(c, "POST /gone?ms=20 HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nContent-Length: 2\r\n\r\nhi");
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 503);
  assert_string_equal(header(&r, "Retry-After"), "1");
  assert_non_null(strstr(r.body, "\"code\":\"queue_full\""));
  assert_non_null(strstr(r.body, "\"depth\":7"));
  assert_int_equal(atomic_load(&gone_seen), 1);
  client_free(c);
}

static void test_timeouts(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  double t0 = now_s();
  send_s(c, "GET /imm HTTP/1.1\r\nHost: x\r\n");
  assert_int_equal(read_response(c, &r, 0), 408);
  double dt = now_s() - t0;
  assert_true(dt > 0.25 && dt < 2.0);
  assert_non_null(strstr(r.body, "\"code\":\"timeout\""));
  expect_eof(c);
  client_free(c);

  /* The body timer covers the whole body: a steady trickle that takes longer is cut, each piece
   * arriving well within the limit notwithstanding (a stalled body the same way). */
  c = client_new();
  send_s(c, "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: 4\r\n\r\n");
  t0 = now_s();
  const char body[4] = {7, 38, 69, 100};
  for (int i = 0; i < 3; i++) {
    usleep(150000);
    send_str(c, body + i, 1);
  }
  assert_int_equal(read_response(c, &r, 0), 408);
  dt = now_s() - t0;
  assert_true(dt > 0.25 && dt < 2.0);
  expect_eof(c);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 0);
  wait_connections(0);
}

static void test_http10_head_204_503(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  send_s(c, "GET /public HTTP/1.0\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(c);
  client_free(c);

  c = client_new();
  send_s(c, "GET /public HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_string_equal(header(&r, "Connection"), "keep-alive");
  send_s(c, "HEAD /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n\r\n");
  assert_int_equal(read_response(c, &r, 1), 200);
  assert_non_null(header(&r, "Content-Length"));
  assert_true(atoi(header(&r, "Content-Length")) > 0);
  send_s(c, "DELETE /empty HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 204);
  assert_null(header(&r, "Content-Length"));
  assert_string_equal(header(&r, "Dsv4d-Existed"), "1");
  get(c, "/busy", "b");
  assert_int_equal(read_response(c, &r, 0), 503);
  assert_string_equal(header(&r, "Retry-After"), "1");
  assert_non_null(
      strstr(r.body, "{\"error\":{\"code\":\"queue_full\",\"message\":\"queue is full\""));
  assert_non_null(strstr(r.body, "\"depth\":3"));
  /* The HEAD answer carried no body: the next response starts right after its head. */
  get(c, "/imm", "last");
  assert_int_equal(read_response(c, &r, 0), 200);
  client_free(c);
}

static void test_malformed(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  send_s(c, "GARBAGE\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 400);
  assert_non_null(strstr(r.body, "\"code\":\"bad_request\""));
  expect_eof(c);
  client_free(c);
  c = client_new();
  send_s(c, "GET /imm HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 400);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 0);
}

/* Sends raw, expects one 400 bad_request marked Connection: close and then the end of the
 * connection: nothing after the fold may be answered, whatever it holds. */
static void expect_fold_refused(const char *raw, size_t split) {
  client_t *c = client_new();
  resp_t r;
  if (split) {
    send_str(c, raw, split);
    usleep(30000);
  }
  send_s(c, raw + split);
  assert_int_equal(read_response(c, &r, 0), 400);
  assert_non_null(strstr(r.body, "\"code\":\"bad_request\""));
  assert_non_null(strstr(r.body, "folding"));
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(c);
  client_free(c);
}

/* Obsolete line folding (RFC 9112 §5.2) is refused in every header, framing or not, and the
 * connection closes: a Content-Length folded onto its next line must not frame a body whose bytes
 * then pass for a request of their own (request smuggling). */
static void test_obs_fold(void **state) {
  (void)state;
  /* Content-Length's value folded onto the next line; the "body" holds a request of its own. */
  expect_fold_refused("POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n"
                      "Content-Length:\r\n 10\r\n\r\n0123456789"
                      "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN
                      "\r\nX-Id: hidden\r\n\r\n",
                      0);
  /* A GET whose Content-Length is folded onto a tab and 0, with a request pipelined behind it. */
  expect_fold_refused("GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n"
                      "Content-Length:\r\n\t0\r\n\r\n"
                      "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN
                      "\r\nX-Id: second\r\n\r\n",
                      0);
  /* An ordinary header folded after a value, and a continuation line of nothing but a blank. */
  expect_fold_refused(
      "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: a\r\n b\r\n\r\n", 0);
  expect_fold_refused("GET /public HTTP/1.1\r\nX-Id: a\r\n \r\n\r\n", 0);
  /* A fold whose line break and blank arrive in different reads. */
  static const char split_fold[] = "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\n"
                                   "Content-Length:\r\n 4\r\n\r\nabcd";
  expect_fold_refused(split_fold, (size_t)(strstr(split_fold, " 4") - split_fold));
  /* The first request of a pipeline is answered; the folded one behind it is not, nor the third. */
  client_t *c = client_new();
  resp_t r;
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: first\r\n\r\n"
            "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: x\r\n\ty\r\n\r\n"
            "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: third\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "id=first"));
  assert_int_equal(read_response(c, &r, 0), 400);
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(c);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 1);

  /* Blanks inside a value, and a CR LF followed by a blank inside a body, are not folding. */
  c = client_new();
  send_s(c, "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: a b\tc\r\n\r\n");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=a b\tc path=/imm"));
  send_s(c, "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: crlf\r\n"
            "Content-Length: 3\r\n\r\n\r\n ");
  assert_int_equal(read_response(c, &r, 0), 200);
  get(c, "/imm", "after");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=after"));
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 4);
}

static void do_block(void *arg) {
  usleep((useconds_t)(uintptr_t)arg);
}

static void *block_loop(void *arg) {
  on_loop(do_block, arg);
  return NULL;
}

/* The idle timer is due when a request has arrived but is still unread (libuv runs timers before it
 * polls): the request is answered, not cut off by the close. */
static void test_idle_timer_with_request_waiting(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  get(c, "/imm", "first");
  assert_int_equal(read_response(c, &r, 0), 200);
  /* The loop sleeps past the 200 ms idle timeout; the next request arrives meanwhile. */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, block_loop, (void *)(uintptr_t)400000), 0);
  usleep(100000);
  get(c, "/imm", "waiting");
  pthread_join(t, NULL);
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=waiting"));
  /* Idle for real, the connection closes. */
  double t0 = now_s();
  expect_eof(c);
  assert_true(now_s() - t0 > 0.1);
  client_free(c);
}

/* How many lines of the log so far hold both a and b. */
static int log_lines_with(const char *a, const char *b) {
  static char text[1 << 16];
  ssize_t n = pread(log_fd, text, sizeof(text) - 1, 0);
  int count = 0;
  text[n > 0 ? n : 0] = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n"))
    count += strstr(line, a) && strstr(line, b);
  return count;
}

static double metric_value(const char *series) {
  char *text;
  size_t len;
  assert_int_equal(dsv4_metrics_render(registry, &text, &len), 0);
  const char *p = strstr(text, series);
  double v = p ? strtod(p + strlen(series), NULL) : -1;
  free(text);
  return v;
}

/* Past max_connections a new connection is answered 503 too_many_connections and closed before any
 * request is read; the refusals are counted, logged once, and a freed slot serves again. */
static void test_max_connections(void **state) {
  (void)state;
  client_t *a = client_new(), *b = client_new();
  resp_t r;
  get(a, "/imm", "a");
  assert_int_equal(read_response(a, &r, 0), 200);
  get(b, "/imm", "b");
  assert_int_equal(read_response(b, &r, 0), 200);
  for (int i = 0; i < 3; i++) {
    client_t *c = client_new();
    assert_int_equal(read_response(c, &r, 0), 503);
    assert_non_null(strstr(r.body, "{\"error\":{\"code\":\"too_many_connections\""));
    assert_non_null(strstr(r.body, "at most 2 connections"));
    assert_string_equal(header(&r, "Connection"), "close");
    assert_string_equal(header(&r, "Retry-After"), "1");
    assert_string_equal(header(&r, "Dsv4d-Instance"), INSTANCE);
    expect_eof(c);
    client_free(c);
  }
  wait_connections(2);
  assert_true(metric_value("dsv4d_connections_rejected_total{reason=\"max_connections\"} ") == 3);
  assert_true(metric_value("dsv4d_connections_rejected_total{reason=\"fd_limit\"} ") == 0);
  assert_true(metric_value("\ndsv4d_connections ") == 2);
  assert_int_equal(log_lines_with("\"refusing connections\"", "\"reason\":\"max_connections\""), 1);
  /* Refusals are not requests: no handler ran, nothing was counted per route. */
  assert_int_equal(atomic_load(&handler_calls), 2);
  assert_true(metric_value("dsv4d_requests_total{route=\"none\",code=\"503\"} ") < 0);
  client_free(a);
  wait_connections(1);
  client_t *c = client_new();
  get(c, "/imm", "c");
  assert_int_equal(read_response(c, &r, 0), 200);
  client_free(c);
  client_free(b);
  wait_connections(0);
  assert_true(metric_value("\ndsv4d_connections ") == 0);
}

/* SIGTERM's drain: nothing new is accepted and no connection is cut under a request. An idle one
 * gets up to a second for its next request, which is answered with Connection: close; one whose
 * request is with its handler is answered, marked close, and closed. */
static void test_drain(void **state) {
  (void)state;
  client_t *idle = client_new(), *late = client_new();
  resp_t r;
  get(idle, "/imm", "i");
  assert_int_equal(read_response(idle, &r, 0), 200);
  get(late, "/imm", "l");
  assert_int_equal(read_response(late, &r, 0), 200);
  client_t *busy = client_new();
  get(busy, "/defer?ms=300", "d");
  usleep(50000);
  assert_int_equal(server_connections(), 3);
  double t0 = now_s();
  on_loop(do_drain, NULL);
  /* Nothing new is accepted. */
  assert_int_equal(dial(), -1);
  usleep(100000);
  get(late, "/imm", "late");
  assert_int_equal(read_response(late, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=late"));
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(late);
  assert_int_equal(read_response(busy, &r, 0), 200);
  assert_memory_equal(r.body, "defer id=d|tail", r.body_len);
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(busy);
  /* The idle one closes after the drain's idle wait (1 s), well before idle_timeout_ms (3 s). */
  expect_eof(idle);
  double dt = now_s() - t0;
  assert_true(dt > 0.9 && dt < 2.5);
  wait_connections(0);
  client_free(idle);
  client_free(late);
  client_free(busy);
}

/* An answer that was announced keep-alive stays true when the drain begins while it is being sent:
 * the client may send its next request, which is answered (with Connection: close). */
static void test_drain_mid_answer(void **state) {
  (void)state;
  client_t *c = client_new();
  /* 16 MiB: more than the socket buffers hold, so the answer is still going out at the drain. */
  get(c, "/stream?n=256&piece=65536&short=0", "big");
  while (!memmem(c->buf, c->len, "\r\n\r\n", 4))
    assert_int_equal(fill(c), 1);
  size_t head = (size_t)((char *)memmem(c->buf, c->len, "\r\n\r\n", 4) - c->buf) + 4;
  assert_null(memmem(c->buf, head, "\r\nConnection:", 14));
  usleep(50000);
  on_loop(do_drain, NULL);
  size_t want = (size_t)256 * 65536, got = c->len - head;
  c->len = 0;
  while (got < want) {
    assert_int_equal(fill(c), 1);
    got += c->len;
    c->len = 0;
  }
  assert_int_equal(got, want);
  get(c, "/imm", "next");
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=next"));
  assert_string_equal(header(&r, "Connection"), "close");
  expect_eof(c);
  client_free(c);
  wait_connections(0);
}

/* Reads one /parts answer of `want` body bytes, checking every byte as it arrives (the client's
 * buffer is smaller than the answer); a slow reader pauses after each read for the first MiBs.
 * counted: the answer was asked for after completion_bytes was set to -1, and the completion
 * hook must count its bytes. */
static void read_parts(client_t *c, size_t want, int slow, int counted) {
  char *end;
  while (!(end = memmem(c->buf, c->len, "\r\n\r\n", 4)))
    assert_int_equal(fill(c), 1);
  size_t head = (size_t)(end - c->buf) + 4;
  char *cl = strcasestr(c->buf, "\r\nContent-Length: ");
  assert_non_null(cl);
  assert_int_equal(strtoull(cl + 18, NULL, 10), want);
  size_t got = 0, at = head;
  for (;;) {
    for (; at < c->len && got < want; at++, got++)
      if ((uint8_t)c->buf[at] != parts_byte(got))
        fail_msg("byte %zu of the answer: %u, expected %u", got, (uint8_t)c->buf[at],
                 parts_byte(got));
    memmove(c->buf, c->buf + at, c->len - at);
    c->len -= at;
    at = 0;
    if (got == want)
      break;
    assert_int_equal(fill(c), 1);
    if (slow && got < ((size_t)6 << 20))
      usleep(1000);
  }
  double t0 = now_s();
  while (counted && atomic_load(&completion_bytes) < 0 && now_s() - t0 < 5)
    usleep(1000);
  if (counted)
    assert_int_equal(atomic_load(&completion_bytes), (long long)(head + want));
}

/* Answers around and beyond the write slice (1 MiB), of one buffer and of several that cross the
 * slices' bounds, to a fast and a slow reader, on two connections at once: every byte once and in
 * order, the byte count complete, and each connection serves its next request. */
static void test_sliced_answers(void **state) {
  (void)state;
  static const struct {
    const char *sizes;
    size_t total;
  } cases[] = {
      {"1048000", 1048000}, {"1048576", 1048576},           {"1,1048576,3,2097152,777", 3146509},
      {"9000001", 9000001}, {"0,65536,0,3000000", 3065536},
  };
  client_t *c = client_new(), *other = client_new();
  for (int slow = 0; slow < 2; slow++)
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
      char path[96];
      snprintf(path, sizeof(path), "/parts?s=%s", cases[k].sizes);
      /* other's answer begins (its completion hook runs) before c's request goes out, so the
       * hook's last count is c's: the server may take either connection's request first. */
      int before = atomic_load(&completions);
      get(other, "/parts?s=5000000", "o");
      double t0 = now_s();
      while (atomic_load(&completions) == before && now_s() - t0 < 5)
        usleep(500);
      assert_int_not_equal(atomic_load(&completions), before);
      atomic_store(&completion_bytes, -1);
      get(c, path, "p");
      read_parts(c, cases[k].total, slow, 1);
      read_parts(other, 5000000, 0, 0);
      resp_t r;
      get(c, "/imm", "after");
      assert_int_equal(read_response(c, &r, 0), 200);
      assert_non_null(strstr(r.body, "imm id=after"));
    }
  client_free(c);
  client_free(other);
}

/* Clients that leave (a reset) while their answers go out in slices, one that stopped reading and
 * ones that read as fast as they can: each connection closes and its answer's buffer is released
 * (the ASan build reports a leak otherwise). */
static void test_sliced_answer_client_gone(void **state) {
  (void)state;
  for (int k = 0; k < 6; k++) {
    client_t *c = client_new();
    get(c, "/parts?s=40000000", "gone");
    size_t got = 0, stop = k == 0 ? 0 : (size_t)k << 20;
    do {
      assert_int_equal(fill(c), 1);
      got += c->len;
      c->len = 0;
    } while (got < stop);
    struct linger reset = {1, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    client_free(c);
    wait_connections(0);
  }
}

/*
 * Answers written in part by another thread (dsv4_direct_*): whatever share it wrote (none, a byte
 * of the head, the head and some of the body, all of it) and however the loop goes on from there
 * (at once, in slices, to a slow reader), the client reads one whole answer, every byte once and
 * in order, and the connection serves its next request. (A build whose loop wrote the answer from
 * its start again, or lost the other thread's bytes, fails read_parts here.)
 */
static void test_direct_answers(void **state) {
  (void)state;
  static const size_t maxes[] = {0, 1, 37, 4096, (size_t)1 << 20, (size_t)1 << 30};
  static const struct {
    const char *sizes;
    size_t total;
  } cases[] = {{"5000", 5000}, {"1,65536,0,3", 65540}, {"9000001", 9000001}};
  client_t *c = client_new();
  for (size_t m = 0; m < sizeof(maxes) / sizeof(maxes[0]); m++)
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
      int before = atomic_load(&direct_written);
      char path[128];
      snprintf(path, sizeof(path), "/direct?max=%zu&wait=0&s=%s", maxes[m], cases[k].sizes);
      atomic_store(&completion_bytes, -1);
      get(c, path, "d");
      read_parts(c, cases[k].total, k == 2 && m % 2, 1);
      /* Nothing queued on the connection, so the other thread wrote what the limit let it: of an
       * answer larger than the limit, at most DSV4_DIRECT_PART bytes (or the limit, if less). */
      assert_int_equal(atomic_load(&direct_written), before + (maxes[m] > 0));
      if (cases[k].total + 200 > maxes[m]) {
        size_t part = maxes[m] < DSV4_DIRECT_PART ? maxes[m] : DSV4_DIRECT_PART;
        assert_true(atomic_load(&direct_last_bytes) <= part);
      }
      resp_t r;
      get(c, "/imm", "after-direct");
      assert_int_equal(read_response(c, &r, 0), 200);
      assert_non_null(strstr(r.body, "imm id=after-direct"));
    }
  assert_int_equal(atomic_load(&direct_errors), 0);
  client_free(c);
}

/*
 * A client that resets its connection before the other thread writes its answer: the write fails
 * on that socket (whose duplicate kept it), the server frees the request, and a client that
 * connected meanwhile, whose socket may have the closed one's number, gets its own answers and
 * nothing else. (A build that wrote to the connection's descriptor number rather than a duplicate
 * sent the first answer to the second client here.)
 */
static void test_direct_client_gone(void **state) {
  (void)state;
  for (int k = 0; k < 4; k++) {
    client_t *a = client_new();
    get(a, "/direct?max=1048576&wait=300&s=300000", "gone");
    while (atomic_load(&direct_calls) < 1 + k)
      usleep(1000);
    struct linger reset = {1, 0};
    setsockopt(a->fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    client_free(a);
    wait_connections(0);
    client_t *b = client_new();
    double t0 = now_s();
    int n = 0;
    /* Past the other thread's write (300 ms after the handler): b's answers are its own. */
    while (now_s() - t0 < 0.5) {
      char id[32];
      snprintf(id, sizeof(id), "b%d-%d", k, n++);
      resp_t r;
      get(b, "/imm", id);
      while (!memmem(b->buf, b->len, "\r\n\r\n", 4))
        assert_int_equal(fill(b), 1);
      if (memmem(b->buf, b->len, "application/octet-stream", 24)) {
        client_free(b); /* the failure leaks nothing (the sanitizer builds run this too) */
        fail_msg("the second client got another connection's answer (request %d)", n);
      }
      assert_int_equal(read_response(b, &r, 0), 200);
      char want[64];
      snprintf(want, sizeof(want), "imm id=%s ", id);
      if (strncmp(r.body, want, strlen(want)) != 0)
        fail_msg("answer %d of the second client: %.60s", n, r.body);
      usleep(20000);
    }
    assert_int_equal(b->len, 0);
    client_free(b);
    wait_connections(0);
  }
  double t0 = now_s();
  while (atomic_load(&direct_errors) < 4 && now_s() - t0 < 5)
    usleep(1000);
  assert_int_equal(atomic_load(&direct_written), 0);
  assert_int_equal(atomic_load(&direct_errors), 4);
}

/* More answers waiting for their other thread than DSV4_DIRECT_MAX at once: that many get a
 * duplicate of their socket, the others are written by the loop, and every one arrives whole. */
static void test_direct_max(void **state) {
  (void)state;
  enum { N = DSV4_DIRECT_MAX + 4 };
  client_t *c[N];
  for (int i = 0; i < N; i++) {
    c[i] = client_new();
    get(c[i], "/direct?max=1048576&wait=700&s=5000,3", "many");
  }
  double t0 = now_s();
  while (atomic_load(&direct_calls) < N && now_s() - t0 < 5)
    usleep(1000);
  assert_int_equal(atomic_load(&direct_calls), N);
  for (int i = 0; i < N; i++) {
    read_parts(c[i], 5003, 0, 0);
    client_free(c[i]);
  }
  /* The loop's part of each answer (its completion is counted after the duplicate is closed). */
  t0 = now_s();
  while (atomic_load(&completions) < N && now_s() - t0 < 5)
    usleep(1000);
  assert_int_equal(atomic_load(&completions), N);
  /* Every handler ran within the first one's wait: none had closed its duplicate yet. */
  assert_int_equal(atomic_load(&direct_written), DSV4_DIRECT_MAX);
  wait_connections(0);
  /* All closed again: the next answer gets one. */
  client_t *d = client_new();
  get(d, "/direct?max=1048576&wait=0&s=100", "after");
  read_parts(d, 100, 0, 0);
  client_free(d);
  t0 = now_s();
  while (atomic_load(&completions) < N + 1 && now_s() - t0 < 5)
    usleep(1000);
  assert_int_equal(atomic_load(&direct_written), DSV4_DIRECT_MAX + 1);
}

/* The head of a POST /big of n bytes with X-Id id, and its body (h_imm's pattern). */
static char *big_request(size_t n, const char *id, char *head, size_t head_cap) {
  snprintf(head, head_cap,
           "POST /big HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: %zu\r\n"
           "X-Id: %s\r\n\r\n",
           n, id);
  char *body = malloc(n);
  assert_non_null(body);
  for (size_t i = 0; i < n; i++)
    body[i] = (char)(uint8_t)(i * 31 + 7);
  return body;
}

static void expect_big_answer(client_t *c, size_t n, const char *id) {
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 200);
  char want[128];
  snprintf(want, sizeof(want), "imm id=%s path=/big query= len=%zu", id, n);
  assert_int_equal(r.body_len, strlen(want));
  assert_memory_equal(r.body, want, r.body_len);
}

/*
 * A route's body_skew places the body where it says from the body's first 8 bytes, whole and in
 * order, however those arrive: with the head, a few bytes at a time (each read then lands in the
 * body buffer, and the first 8 move), or one byte and then megabytes; a body under 8 bytes stays at
 * the boundary. (A build that moved the bytes received but not those of the read that completed
 * the 8, or placed the body from a wrong start, answers "corrupt" or the wrong place here.)
 */
static void test_body_skew(void **state) {
  (void)state;
  const size_t skews[] = {0, 1, 3, 8, 57, 63};
  const size_t lens[] = {100, 3000, 2u << 20, 5};
  char head[256], want[128];
  client_t *c = client_new();
  for (size_t k = 0; k < sizeof(skews) / sizeof(skews[0]); k++)
    for (size_t m = 0; m < 3 * sizeof(lens) / sizeof(lens[0]); m++) {
      const size_t len = lens[m % 4], mode = m / 4;
      uint8_t *body = malloc(len);
      for (size_t i = 0; i < len; i++)
        body[i] = (uint8_t)(i * 31 + 7);
      body[0] = (uint8_t)(skews[k] | 128);
      snprintf(head, sizeof(head),
               "POST /skew HTTP/1.1\r\nAuthorization: Bearer " TOKEN
               "\r\nContent-Length: %zu\r\n\r\n",
               len);
      if (mode == 0) { /* the head and the body in one write */
        char *all = malloc(strlen(head) + len);
        memcpy(all, head, strlen(head));
        memcpy(all + strlen(head), body, len);
        send_str(c, all, strlen(head) + len);
        free(all);
      } else { /* the head, then 3 (or 1) bytes, then 2 more, then the rest, with pauses */
        send_s(c, head);
        size_t first = mode == 1 ? 3 : 1, done = 0;
        const size_t parts[3] = {first, 2, len};
        for (int i = 0; i < 3 && done < len; i++) {
          usleep(5000);
          size_t p = parts[i] < len - done ? parts[i] : len - done;
          send_str(c, (const char *)body + done, p);
          done += p;
        }
      }
      resp_t r;
      assert_int_equal(read_response(c, &r, 0), 200);
      /* The bulk thread (setup_bulk: 64 KiB) calls the watcher for the 2 MiB bodies' reads. */
      snprintf(want, sizeof(want), "at %zu of %zu, len=%zu, watched%s", len >= 8 ? skews[k] : 0,
               len >= 8 ? skews[k] : 0, len, cfg_bulk && len >= (2u << 20) ? " off the loop" : "");
      assert_int_equal(r.body_len, strlen(want));
      assert_memory_equal(r.body, want, r.body_len);
      free(body);
    }
  client_free(c);
  /* A body left half sent: its watcher ends with its connection, no handler having taken it. */
  const int calls = atomic_load(&handler_calls);
  c = client_new();
  send_s(c, "POST /skew HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nContent-Length: 3000000\r\n\r\n");
  char part[300000];
  memset(part, 7, sizeof(part));
  send_str(c, part, sizeof(part));
  usleep(50000);
  assert_int_equal(atomic_load(&skew_watches), 1);
  client_free(c);
  wait_connections(0);
  assert_int_equal(atomic_load(&skew_watches), 0);
  assert_int_equal(atomic_load(&handler_calls), calls);
}

/*
 * Bodies are read a slice (1 MiB) a loop iteration: sizes around and beyond the slice, sent at
 * once, arrive whole and in order (the handler checks every byte); two connections' bodies sent in
 * turns of 3 MiB both do; clients that reset after 1-4 MiB of a body, whose reading has been
 * stopped and restarted by the pace check on the way, leave the server working. (A build whose
 * check does not restart the reading fails here on the body timeout, 5 s here; a pause lasts less
 * than a loop iteration, so no reset can land inside one.)
 */
static void test_paced_body_reads(void **state) {
  (void)state;
  const size_t sizes[] = {(1u << 20) - 1, 1u << 20, (1u << 20) + 1, (5u << 20) + 123, 24u << 20};
  char head[256], id[16];
  client_t *c = client_new();
  for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
    snprintf(id, sizeof(id), "b%zu", k);
    char *body = big_request(sizes[k], id, head, sizeof(head));
    send_s(c, head);
    send_str(c, body, sizes[k]);
    expect_big_answer(c, sizes[k], id);
    free(body);
  }
  client_free(c);

  const size_t n = 12u << 20, turn = 3u << 20;
  client_t *two[2] = {client_new(), client_new()};
  char *body = big_request(n, "two", head, sizeof(head));
  for (int i = 0; i < 2; i++)
    send_s(two[i], head);
  for (size_t off = 0; off < n; off += turn)
    for (int i = 0; i < 2; i++)
      send_str(two[i], body + off, n - off < turn ? n - off : turn);
  for (int i = 0; i < 2; i++) {
    expect_big_answer(two[i], n, "two");
    client_free(two[i]);
  }

  long calls = atomic_load(&handler_calls);
  for (int k = 0; k < 4; k++) {
    c = client_new();
    send_s(c, head);
    send_str(c, body, (size_t)(k + 1) << 20);
    usleep(20000);
    struct linger reset = {1, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    client_free(c);
    wait_connections(0);
  }
  assert_int_equal(atomic_load(&handler_calls), calls);
  c = client_new();
  send_s(c, head);
  send_str(c, body, n);
  expect_big_answer(c, n, "two");
  client_free(c);
  free(body);
}

/* The same bodies and answers in slices of 64 KiB (setup_small_slice). */
static void test_small_slice_bodies(void **state) {
  test_paced_body_reads(state);
}

static void test_small_slice_answers(void **state) {
  test_sliced_answers(state);
}

/* The bulk thread's bytes so far in one direction ("in": bodies, "out": answers). */
static double bulk_bytes(const char *direction) {
  char series[64];
  snprintf(series, sizeof(series), "dsv4d_bulk_bytes_total{direction=\"%s\"} ", direction);
  return metric_value(series);
}

/* A large body behind "Expect: 100-continue" (the interim answer first, then the body through the
 * bulk thread), and one with a request pipelined behind it, whose bytes the thread leaves in the
 * socket for the loop: each answered, in order. */
static void bulk_continue_and_pipelined(void) {
  char head[256], cont[320];
  const size_t n = (size_t)3 << 20;
  char *body = big_request(n, "cont", head, sizeof(head));
  snprintf(cont, sizeof(cont), "%.*sExpect: 100-continue\r\n\r\n", (int)strlen(head) - 2, head);
  client_t *c = client_new();
  send_s(c, cont);
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 100);
  send_str(c, body, n);
  expect_big_answer(c, n, "cont");

  static const char next[] =
      "GET /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nX-Id: behind\r\n\r\n";
  char *all = malloc(strlen(head) + n + strlen(next));
  assert_non_null(all);
  memcpy(all, head, strlen(head));
  memcpy(all + strlen(head), body, n);
  memcpy(all + strlen(head) + n, next, strlen(next));
  send_str(c, all, strlen(head) + n + strlen(next));
  expect_big_answer(c, n, "cont");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=behind "));
  client_free(c);
  free(all);
  free(body);
}

/* Bodies whose rest the bulk thread reads (setup_bulk): whole and in order whatever their size,
 * split or skew, two at once, and clients that leave mid-body close their connections without a
 * handler's call. (A build whose loop still read the bodies fails the count of bytes.) */
static void test_bulk_bodies(void **state) {
  test_paced_body_reads(state);
  test_body_large_and_split(state);
  test_body_skew(state);
  bulk_continue_and_pipelined();
  double in = bulk_bytes("in");
  assert_true(in > (double)(24u << 20) + 3 * (double)(12u << 20));
  atomic_store(&handler_calls, 0); /* it asserts that no handler ran */
  test_disconnect_mid_body(state);
  /* Of the body that never completed, the bytes the thread read count, and no more. */
  double after = bulk_bytes("in");
  assert_true(after >= in && after <= in + 5000);
}

/* Answers whose rest the bulk thread writes: every byte once and in order to fast and slow
 * readers, after another thread's first bytes, and to clients that leave midway. */
static void test_bulk_answers(void **state) {
  test_sliced_answers(state);
  test_direct_answers(state);
  double out = bulk_bytes("out");
  assert_true(out > 10 * 5000000.0 + 9000001.0);
  test_sliced_answer_client_gone(state);
  /* A client that stops reading: the write timer (3 s) ends the answer the thread is writing. */
  client_t *w = client_small_window();
  get(w, "/parts?s=40000000", "stops");
  usleep(100000);
  assert_int_equal(server_connections(), 1);
  wait_connections(0);
  client_free(w);
  /* It counts from zero: its wait for the handler's call, and its totals. */
  atomic_store(&direct_calls, 0);
  atomic_store(&direct_written, 0);
  atomic_store(&direct_errors, 0);
  test_direct_client_gone(state);
}

/*
 * A body that stalls while the bulk thread reads it gets its 408 at the body timeout, and its
 * handler is never called. Then a body half sent and an answer its client does not read are both
 * with the bulk thread when the server closes: the close ends both, and every handle and buffer
 * goes (teardown asserts the loop closes cleanly; the ASan build reports a leak otherwise).
 */
static void test_bulk_stall_and_close(void **state) {
  (void)state;
  char head[256];
  char *body = big_request((size_t)1 << 20, "stall", head, sizeof(head));
  client_t *c = client_new();
  send_s(c, head);
  send_str(c, body, 100000);
  double t0 = now_s();
  resp_t r;
  assert_int_equal(read_response(c, &r, 0), 408);
  double dt = now_s() - t0;
  assert_true(dt > 0.2 && dt < 2.0);
  assert_non_null(strstr(r.body, "\"code\":\"timeout\""));
  expect_eof(c);
  client_free(c);
  assert_int_equal(atomic_load(&handler_calls), 0);
  wait_connections(0);
  assert_true(bulk_bytes("in") > 50000); /* the thread had read what came of it */

  client_t *a = client_new(), *b = client_small_window();
  send_s(a, head);
  send_str(a, body, 200000);
  get(b, "/parts?s=40000000", "stuck");
  usleep(100000);
  assert_int_equal(server_connections(), 2);
  held_fd[0] = a->fd;
  held_fd[1] = b->fd;
  a->fd = b->fd = -1;
  client_free(a);
  client_free(b);
  free(body);
}

/* A streamed answer: the head with its Content-Length, then every piece in order, and the
 * connection stays usable; the completion hook sees it once, with every byte counted. */
static void test_stream(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  atomic_store(&completions, 0);
  get(c, "/stream?n=3&piece=1000&short=0", "s1");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_string_equal(header(&r, "Content-Length"), "3000");
  assert_string_equal(header(&r, "X-Stream"), "yes");
  assert_string_equal(header(&r, "Dsv4d-Instance"), INSTANCE);
  assert_int_equal(r.body_len, 3000);
  for (size_t i = 0; i < 3000; i++)
    assert_int_equal((unsigned char)r.body[i], i / 1000);
  double t1 = now_s();
  while (atomic_load(&completions) < 1 && now_s() - t1 < 5)
    usleep(2000);
  assert_int_equal(atomic_load(&completion_bytes), (long long)(strlen(r.head) + 3000));
  get(c, "/imm", "after");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_non_null(strstr(r.body, "imm id=after"));
  double t0 = now_s();
  while (atomic_load(&completions) < 2 && now_s() - t0 < 5)
    usleep(2000);
  assert_int_equal(atomic_load(&streams_ended), 1);
  assert_int_equal(atomic_load(&stream_failed_cbs), 0);
  client_free(c);

  /* Ended short of its Content-Length: the connection closes after what was sent. */
  c = client_new();
  get(c, "/stream?n=3&piece=100&short=1", "s2");
  char *end;
  while (!(end = memmem(c->buf, c->len, "\r\n\r\n", 4)) || c->len < (size_t)(end - c->buf) + 204)
    assert_int_equal(fill(c), 1);
  assert_int_equal(c->len, (size_t)(end - c->buf) + 4 + 200);
  c->len = 0;
  expect_eof(c);
  client_free(c);
  wait_connections(0);
  assert_int_equal(atomic_load(&streams_ended), 2);
}

/* A stream ended while its piece is still queued for the socket: the answer is cut short, the
 * connection closes, the write's cancellation finds no request (it was freed at the end), and the
 * server goes on serving. */
static void test_stream_ended_with_piece_queued(void **state) {
  (void)state;
  /* A piece far larger than the socket buffers take is still queued when the handler ends the
   * stream (in the same loop iteration). A client with a tiny window would not do: through a 4 KiB
   * one the kernel's persist timer makes 8 MiB take about 100 s. Nor would a client that reads
   * at once: over loopback one write can hand a reader on another core all 32 MiB. So the client
   * reads only once the handler has ended the stream (streams_ended). */
  client_t *c = client_new();
  const int ended = atomic_load(&streams_ended);
  get(c, "/stream?n=4&piece=33554432&short=0&abandon=1", "ab");
  for (double t0 = now_s(); atomic_load(&streams_ended) == ended && now_s() - t0 < 5;)
    usleep(1000);
  assert_int_not_equal(atomic_load(&streams_ended), ended);
  size_t got = 0;
  int k;
  while ((k = fill(c)) == 1) {
    got += c->len;
    c->len = 0;
  }
  assert_int_equal(k, 0);              /* EOF, not a timeout */
  assert_true(got < (size_t)33554432); /* cut inside the first piece: it was still queued */
  client_free(c);
  wait_connections(0);
  c = client_new();
  resp_t r;
  get(c, "/imm", "next");
  assert_int_equal(read_response(c, &r, 0), 200);
  client_free(c);
}

/* The client leaves mid-stream: the writer hears of it (a failed piece or a refused write), ends
 * the stream once, and the connection goes. */
static void test_stream_client_gone(void **state) {
  (void)state;
  client_t *c = client_small_window();
  get(c, "/stream?n=4096&piece=65536&short=0", "big");
  while (!memmem(c->buf, c->len, "\r\n\r\n", 4))
    assert_int_equal(fill(c), 1);
  client_free(c);
  double t0 = now_s();
  while (atomic_load(&streams_ended) == 0 && now_s() - t0 < 10)
    usleep(5000);
  assert_int_equal(atomic_load(&streams_ended), 1);
  wait_connections(0);
}

/* Wait until the hook has taken back as many bodies as it gave (the answer's release frees the
 * body after the write completed, a moment after the client read it). */
static void wait_hook_balanced(int allocs) {
  double t0 = now_s();
  while (atomic_load(&hook_frees) != allocs && now_s() - t0 < 5)
    usleep(5000);
  assert_int_equal(atomic_load(&hook_allocs), allocs);
  assert_int_equal(atomic_load(&hook_frees), allocs);
  assert_int_equal(atomic_load(&hook_foreign), 0);
}

/* With a body allocator hook, every body comes from it (a multiple of 64 bytes, at least the
 * body) and goes back to it exactly once: after the answer, from a handler that took it, and when
 * the client leaves mid-body. A hook without memory gets 503 out_of_memory, and a request without
 * a body never calls it. */
static void test_body_hook(void **state) {
  (void)state;
  client_t *c = client_new();
  resp_t r;
  size_t n = 300001;
  char *body = malloc(n), head[256];
  for (size_t i = 0; i < n; i++)
    body[i] = (char)(uint8_t)(i * 31 + 7);
  snprintf(head, sizeof(head),
           "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: %zu\r\n"
           "X-Id: hook\r\n\r\n",
           n);
  send_s(c, head);
  send_str(c, body, n);
  assert_int_equal(read_response(c, &r, 0), 200);
  char want[128];
  snprintf(want, sizeof(want), "imm id=hook path=/imm query= len=%zu", n);
  assert_memory_equal(r.body, want, strlen(want));
  assert_int_equal(atomic_load(&hook_last_size), 300032);
  wait_hook_balanced(1);

  send_s(c, "POST /take HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nContent-Length: 5\r\n\r\nhello");
  assert_int_equal(read_response(c, &r, 0), 200);
  assert_memory_equal(r.body, "took len=5", r.body_len);
  assert_int_equal(atomic_load(&hook_last_size), 64);
  wait_hook_balanced(2);

  get(c, "/imm", "nobody");
  assert_int_equal(read_response(c, &r, 0), 200);
  wait_hook_balanced(2);
  client_free(c);

  c = client_new();
  send_s(c,
         "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN "\r\nContent-Length: 100000\r\n\r\n");
  send_str(c, body, 5000);
  usleep(50000);
  assert_int_equal(atomic_load(&hook_allocs), 3);
  client_free(c);
  wait_connections(0);
  wait_hook_balanced(3);

  atomic_store(&hook_refuse, 1);
  c = client_new();
  send_s(c, "POST /imm HTTP/1.1\r\nAuthorization: Bearer " TOKEN
            "\r\nContent-Length: 10\r\n\r\n0123456789");
  assert_int_equal(read_response(c, &r, 0), 503);
  assert_non_null(strstr(r.body, "out_of_memory"));
  assert_string_equal(header(&r, "Connection"), "close");
  assert_int_equal(atomic_load(&hook_refusals), 1);
  client_free(c);
  wait_connections(0);
  wait_hook_balanced(3);
  assert_int_equal(atomic_load(&handler_calls), 3); /* imm, take, the GET */
  free(body);
}

/* argv[1]: run only the tests whose names match this pattern (cmocka_set_test_filter). */
int main(int argc, char **argv) {
  if (argc > 1)
    cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_keep_alive, setup, teardown),
      cmocka_unit_test_setup_teardown(test_pipelining_order, setup, teardown),
      cmocka_unit_test_setup_teardown(test_body_large_and_split, setup, teardown),
      cmocka_unit_test_setup_teardown(test_413_before_body, setup, teardown),
      cmocka_unit_test_setup_teardown(test_431, setup, teardown),
      cmocka_unit_test_setup_teardown(test_411, setup, teardown),
      cmocka_unit_test_setup_teardown(test_404_405, setup, teardown),
      cmocka_unit_test_setup_teardown(test_401, setup, teardown),
      cmocka_unit_test_setup_teardown(test_disconnect_mid_body, setup, teardown),
      cmocka_unit_test_setup_teardown(test_gone_while_handler_works, setup, teardown),
      cmocka_unit_test_setup_teardown(test_timeouts, setup, teardown),
      cmocka_unit_test_setup_teardown(test_http10_head_204_503, setup, teardown),
      cmocka_unit_test_setup_teardown(test_malformed, setup, teardown),
      cmocka_unit_test_setup_teardown(test_obs_fold, setup, teardown),
      cmocka_unit_test_setup_teardown(test_idle_timer_with_request_waiting, setup_short_idle,
                                      teardown),
      cmocka_unit_test_setup_teardown(test_max_connections, setup_two_connections, teardown),
      cmocka_unit_test_setup_teardown(test_drain, setup, teardown),
      cmocka_unit_test_setup_teardown(test_drain_mid_answer, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stream, setup, teardown),
      cmocka_unit_test_setup_teardown(test_sliced_answers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stream_ended_with_piece_queued, setup, teardown),
      cmocka_unit_test_setup_teardown(test_sliced_answer_client_gone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_direct_answers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_direct_client_gone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_direct_max, setup, teardown),
      cmocka_unit_test_setup_teardown(test_paced_body_reads, setup_long_body, teardown),
      cmocka_unit_test_setup_teardown(test_small_slice_bodies, setup_small_slice, teardown),
      cmocka_unit_test_setup_teardown(test_small_slice_answers, setup_small_slice, teardown),
      cmocka_unit_test_setup_teardown(test_body_skew, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stream_client_gone, setup, teardown),
      cmocka_unit_test_setup_teardown(test_body_hook, setup_body_hook, teardown),
      cmocka_unit_test_setup_teardown(test_bulk_bodies, setup_bulk, teardown),
      cmocka_unit_test_setup_teardown(test_bulk_answers, setup_bulk, teardown),
      cmocka_unit_test_setup_teardown(test_bulk_stall_and_close, setup_bulk_short_body, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
