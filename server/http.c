#include "http.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>

#include <llhttp.h>

#include "dsv4-error.h"
#include "errors.h"
#include "http-internal.h"
#include "log.h"
#include "metrics.h"

#define READ_CHUNK ((size_t)64 * 1024)
/* While a request is in flight the connection keeps reading only to notice a client that went away;
 * pipelined bytes beyond this much stay in the kernel's buffer (backpressure). */
#define INFLIGHT_READ_CAP ((size_t)64 * 1024)
/* Reads whose arrival times a connection remembers (conn_t.marks). */
#define MARKS 16
/* After a response that closes the connection: shut down our side, then read and discard for at
 * most this long, so unread request bytes do not turn the close into a reset that destroys the
 * response before the client reads it (nginx's lingering close). */
#define LINGER_MS 1000
#define DEFAULT_MAX_HEADER ((size_t)64 * 1024)

typedef enum {
  PHASE_NONE = 0,
  PHASE_IDLE,
  PHASE_HEADER,
  PHASE_BODY,
  PHASE_WRITE,
  PHASE_LINGER,
} phase_t;

typedef enum {
  REQ_PARSING = 0, /* request line, headers or body still arriving */
  REQ_DISPATCHED,  /* complete; the handler (or an error answer) owns it */
  REQ_WRITING,     /* answered; the response is being written */
  REQ_STREAMING,   /* a streamed answer: the handler writes the body piece by piece */
} req_state_t;

typedef struct conn conn_t;

typedef struct {
  uint32_t name, value; /* offsets into the arena */
} hdr_off_t;

typedef struct {
  dsv4_req_t pub; /* first: handlers get &pub and we cast back */
  conn_t *conn;   /* NULL once the connection is gone */
  req_state_t state;
  int gone;
  int err; /* a DSV4_E* found while parsing: answered instead of calling the handler */
  char errmsg[96];
  int keep_alive;
  int http_minor;
  const dsv4_route_t *route;
  dsv4_metric_t *requests_total;
  char listener[16];
  char *arena; /* URL and header bytes, NUL-separated; stable once the headers are complete */
  size_t arena_len, arena_cap;
  hdr_off_t *hdrs;
  size_t n_hdrs, cap_hdrs;
  int field_open, value_open;
  size_t header_bytes;
  size_t body_received;
  uint64_t content_length;
  size_t bytes_out;
  int authed;      /* carried the listener's bearer token */
  char peer[64];   /* "ip:port" of the client */
  int resp_status; /* a streamed answer's status, recorded at its end */
  uint64_t stream_len, stream_sent;
  int stream_hdr_sent, stream_failed;
  dsv4_stream_cb stream_cb;
  void *stream_arg;
  /* The listener's completion hook, copied: the request may outlive its connection. */
  void (*on_complete)(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
  void *on_complete_arg;
} req_t;

struct conn {
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  } io; /* first, so the handle's data pointer is not the only way back */
  uv_timer_t timer;
  uv_write_t wreq;
  uv_shutdown_t sreq;
  dsv4_server_t *srv;
  conn_t *prev, *next;
  llhttp_t parser;
  req_t *req;
  char *rbuf;
  size_t rbuf_off, rbuf_len, rbuf_cap;
  /* When the bytes in rbuf arrived: rbuf_in counts every byte ever appended to rbuf, and each read
   * appended from stream offset marks[k].at on, at marks[k].ns (a ring of the last MARKS reads), so
   * a pipelined request that waited in rbuf still starts its clock when its first byte arrived. */
  uint64_t rbuf_in;
  struct {
    uint64_t at, ns;
  } marks[MARKS];
  unsigned n_marks, mark0;
  uint64_t exec_arrived_ns; /* arrival of the byte the parser starts from, 0 = unknown */
  phase_t phase;
  int handles_open;
  int closing, processing, reading, writing, lingering, close_after, peer_eof, body_read;
  /* The response being written. */
  char *whdr;
  uv_buf_t *wbufs;
  void (*wrelease)(void *);
  void *wrelease_arg;
  int stream_pending; /* a streamed piece is being written */
  uv_buf_t sbufs[2];  /* that piece: the response head (first piece only) and the caller's bytes */
  char peer[64];
};

struct dsv4_server {
  uv_tcp_t listener;
  uv_timer_t sentinel; /* never started: closing it guarantees dsv4_server_close a callback */
  uv_loop_t *loop;
  char *host, *token, *name;
  char instance[40];
  size_t max_header_bytes;
  uint64_t header_timeout_ms, body_timeout_ms, idle_timeout_ms, write_timeout_ms;
  dsv4_route_t *routes;
  size_t n_routes;
  llhttp_settings_t settings;
  conn_t *conns;
  size_t n_conns;
  int port;
  int listener_open, sentinel_open, draining, closing;
  void (*close_cb)(void *);
  void *close_arg;
  dsv4_metric_t *requests_total;
  void (*on_complete)(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
  void *on_complete_arg;
};

static void conn_close(conn_t *c);
static void conn_process(conn_t *c);
static void conn_update_reading(conn_t *c);
static void server_maybe_done(dsv4_server_t *s);

/* ---- requests ------------------------------------------------------------------------------- */

static req_t *req_new(conn_t *c) {
  req_t *r = calloc(1, sizeof(*r));
  if (!r)
    return NULL;
  r->conn = c;
  r->pub.query = "";
  r->pub.path = "";
  r->pub.route = "none";
  r->pub.t_start_ns = c->exec_arrived_ns ? c->exec_arrived_ns : uv_hrtime();
  r->requests_total = c->srv->requests_total;
  snprintf(r->listener, sizeof(r->listener), "%s", c->srv->name);
  snprintf(r->peer, sizeof(r->peer), "%s", c->peer[0] ? c->peer : "unknown");
  r->on_complete = c->srv->on_complete;
  r->on_complete_arg = c->srv->on_complete_arg;
  return r;
}

static void req_free(req_t *r) {
  free(r->pub.body);
  free(r->arena);
  free(r->hdrs);
  free(r);
}

static req_t *req_of(const dsv4_req_t *pub) {
  return (req_t *)(void *)((char *)(uintptr_t)pub - offsetof(req_t, pub));
}

static int arena_put(req_t *r, const char *p, size_t n) {
  if (r->arena_len + n + 1 > r->arena_cap) {
    size_t cap = r->arena_cap ? r->arena_cap : 512;
    while (cap < r->arena_len + n + 1)
      cap *= 2;
    char *a = realloc(r->arena, cap);
    if (!a)
      return -1;
    r->arena = a;
    r->arena_cap = cap;
  }
  memcpy(r->arena + r->arena_len, p, n);
  r->arena_len += n;
  return 0;
}

const char *dsv4_req_header(const dsv4_req_t *pub, const char *name) {
  const req_t *r = req_of(pub);
  for (size_t i = 0; i < r->n_hdrs; i++)
    if (strcasecmp(r->arena + r->hdrs[i].name, name) == 0)
      return r->arena + r->hdrs[i].value;
  return NULL;
}

int dsv4_req_gone(const dsv4_req_t *pub) {
  return req_of(pub)->gone;
}

const char *dsv4_req_peer(const dsv4_req_t *pub) {
  return req_of(pub)->peer;
}

int dsv4_req_authenticated(const dsv4_req_t *pub) {
  return req_of(pub)->authed;
}

uint8_t *dsv4_req_take_body(dsv4_req_t *req) {
  uint8_t *b = req->body;
  req->body = NULL;
  return b;
}

const char *dsv4_req_method_name(const dsv4_req_t *req) {
  switch (req->method) {
  case DSV4_HTTP_GET:
    return "GET";
  case DSV4_HTTP_POST:
    return "POST";
  case DSV4_HTTP_DELETE:
    return "DELETE";
  case DSV4_HTTP_HEAD:
    return "HEAD";
  default:
    return "OTHER";
  }
}

/* ---- timers --------------------------------------------------------------------------------- */

static void on_timer(uv_timer_t *t);

static void set_phase(conn_t *c, phase_t phase) {
  const dsv4_server_t *s = c->srv;
  uint64_t ms = 0;
  switch (phase) {
  case PHASE_IDLE:
    ms = s->idle_timeout_ms;
    break;
  case PHASE_HEADER:
    ms = s->header_timeout_ms;
    break;
  case PHASE_BODY:
    ms = s->body_timeout_ms;
    break;
  case PHASE_WRITE:
    ms = s->write_timeout_ms;
    break;
  case PHASE_LINGER:
    ms = LINGER_MS;
    break;
  case PHASE_NONE:
    break;
  }
  c->phase = phase;
  if (c->closing)
    return;
  if (ms > 0)
    uv_timer_start(&c->timer, on_timer, ms, 0);
  else
    uv_timer_stop(&c->timer);
}

static void conn_fail(conn_t *c, int err, const char *msg);

/* Whether the connection stays open after the current answer. While the server drains, only to
 * answer requests whose bytes already arrived (pipelined; a forward among them gets 503 draining,
 * which tells a gateway it was never applied) rather than drop them with the connection. */
static int conn_keeps(const conn_t *c, int keep_alive) {
  return keep_alive && !c->close_after && !c->peer_eof &&
         (!c->srv->draining || c->rbuf_off < c->rbuf_len);
}

static void on_timer(uv_timer_t *t) {
  conn_t *c = t->data;
  switch (c->phase) {
  case PHASE_HEADER:
  case PHASE_BODY:
    /* A request that started but did not finish in time gets a 408; the connection then closes. */
    if (c->req && c->req->state == REQ_PARSING && !c->writing)
      conn_fail(c, DSV4_ETIMEDOUT,
                c->phase == PHASE_HEADER ? "request headers not received in time"
                                         : "request body stalled");
    else
      conn_close(c);
    break;
  default:
    conn_close(c);
    break;
  }
}

/* ---- responses ------------------------------------------------------------------------------ */

static const char *reason(int status) {
  switch (status) {
  case 100:
    return "Continue";
  case 200:
    return "OK";
  case 201:
    return "Created";
  case 204:
    return "No Content";
  case 400:
    return "Bad Request";
  case 401:
    return "Unauthorized";
  case 403:
    return "Forbidden";
  case 404:
    return "Not Found";
  case 405:
    return "Method Not Allowed";
  case 408:
    return "Request Timeout";
  case 409:
    return "Conflict";
  case 410:
    return "Gone";
  case 411:
    return "Length Required";
  case 413:
    return "Payload Too Large";
  case 429:
    return "Too Many Requests";
  case 431:
    return "Request Header Fields Too Large";
  case 500:
    return "Internal Server Error";
  case 503:
    return "Service Unavailable";
  case 504:
    return "Gateway Timeout";
  default:
    return status < 300 ? "OK" : status < 500 ? "Client Error" : "Server Error";
  }
}

/* Count the request and write its log line; runs once per request, however it ended. */
static void req_record(req_t *r, int status, int written) {
  char code[16];
  snprintf(code, sizeof(code), "%d", status);
  const char *labels[2] = {r->pub.route, code};
  dsv4_metric_add(r->requests_total, labels, 1);
  if (r->on_complete)
    r->on_complete(&r->pub, status, r->bytes_out, written, r->on_complete_arg);
  /* Answered requests log at debug (a decode step is thousands of them a second, and the counters
   * above already tell), refused ones at info, failures at warn. */
  int level = status >= 500               ? DSV4_LOG_WARN
              : status >= 400 || !written ? DSV4_LOG_INFO
                                          : DSV4_LOG_DEBUG;
  if (!dsv4_log_enabled(level))
    return;
  double ms = (double)(uv_hrtime() - r->pub.t_start_ns) * 1e-6;
  json_t *f = json_object();
  if (!f)
    return;
  json_t *path = json_string(r->pub.path);
  json_object_set_new(f, "listener", json_string(r->listener));
  json_object_set_new(f, "method", json_string(dsv4_req_method_name(&r->pub)));
  json_object_set_new(f, "path", path ? path : json_string("(not UTF-8)"));
  json_object_set_new(f, "route", json_string(r->pub.route));
  json_object_set_new(f, "status", json_integer(status));
  json_object_set_new(f, "bytes", json_integer((json_int_t)r->bytes_out));
  json_object_set_new(f, "duration_ms", json_real((double)(long long)(ms * 1000.0) / 1000.0));
  if (!written)
    json_object_set_new(f, "client_gone", json_true());
  dsv4_log(level, "request", f);
}

static void write_done(conn_t *c, int status_ok) {
  req_t *r = c->req;
  void (*release)(void *) = c->wrelease;
  void *arg = c->wrelease_arg;
  c->wrelease = NULL;
  c->wrelease_arg = NULL;
  c->writing = 0;
  free(c->whdr);
  free(c->wbufs);
  c->whdr = NULL;
  c->wbufs = NULL;
  if (release)
    release(arg);
  int keep = r && conn_keeps(c, r->keep_alive);
  c->req = NULL;
  if (r)
    req_free(r);
  if (c->closing)
    return;
  if (!status_ok) {
    conn_close(c);
    return;
  }
  if (!keep) {
    /* Shut down our side and drain what the client still sends until it closes or LINGER_MS. */
    c->lingering = 1;
    c->rbuf_off = c->rbuf_len = 0;
    if (uv_shutdown(&c->sreq, &c->io.stream, NULL) != 0) {
      conn_close(c);
      return;
    }
    set_phase(c, PHASE_LINGER);
    conn_update_reading(c);
    return;
  }
  llhttp_init(&c->parser, HTTP_REQUEST, &c->srv->settings);
  c->parser.data = c;
  set_phase(c, PHASE_IDLE);
  conn_process(c);
}

static void stream_piece_done(conn_t *c, int status);

static void on_write(uv_write_t *w, int status) {
  conn_t *c = w->data;
  if (c->stream_pending) {
    stream_piece_done(c, status);
    return;
  }
  write_done(c, status == 0);
}

/*
 * The status line and headers of an answer, sized exactly: extra headers are copied (and dropped
 * when they hold CR, LF or a colon in the name, so a handler cannot split the response).
 * Content-Type and Content-Length only when the answer has a body. malloc'd; NULL when out of
 * memory.
 */
static char *response_head(const conn_t *c, const req_t *r, int status, const char *content_type,
                           const dsv4_hdr_t *extra, size_t n_extra, int has_body,
                           uint64_t content_length, int keep, size_t *len) {
  size_t cap = 256 + strlen(c->srv->instance) + (content_type ? strlen(content_type) : 0);
  for (size_t i = 0; i < n_extra; i++)
    cap += strlen(extra[i].name) + strlen(extra[i].value) + 4;
  char *h = malloc(cap);
  if (!h)
    return NULL;
  size_t n = (size_t)snprintf(h, cap, "HTTP/1.1 %d %s\r\n", status, reason(status));
  if (content_type && has_body)
    n += (size_t)snprintf(h + n, cap - n, "Content-Type: %s\r\n", content_type);
  if (has_body)
    n += (size_t)snprintf(h + n, cap - n, "Content-Length: %llu\r\n",
                          (unsigned long long)content_length);
  n += (size_t)snprintf(h + n, cap - n, "Dsv4d-Instance: %s\r\n", c->srv->instance);
  if (!keep)
    n += (size_t)snprintf(h + n, cap - n, "Connection: close\r\n");
  else if (r->http_minor == 0)
    n += (size_t)snprintf(h + n, cap - n, "Connection: keep-alive\r\n");
  for (size_t i = 0; i < n_extra; i++) {
    if (strpbrk(extra[i].name, "\r\n:") || strpbrk(extra[i].value, "\r\n"))
      continue;
    n += (size_t)snprintf(h + n, cap - n, "%s: %s\r\n", extra[i].name, extra[i].value);
  }
  n += (size_t)snprintf(h + n, cap - n, "\r\n");
  assert(n < cap);
  *len = n;
  return h;
}

void dsv4_respond(dsv4_req_t *pub, int status, const char *content_type, const dsv4_hdr_t *extra,
                  size_t n_extra, const uv_buf_t *body, size_t n_body, void (*release)(void *),
                  void *release_arg) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_DISPATCHED);
  conn_t *c = r->conn;
  size_t total = 0;
  for (size_t i = 0; i < n_body; i++)
    total += body[i].len;
  int no_body = status < 200 || status == 204 || status == 304;
  if (!c || c->closing) {
    /* The client went away while the handler worked: nothing to write, only to release. */
    if (release)
      release(release_arg);
    req_record(r, status, 0);
    if (c)
      c->req = NULL;
    req_free(r);
    return;
  }
  r->state = REQ_WRITING;
  int keep = conn_keeps(c, r->keep_alive);

  size_t n = 0;
  char *h = response_head(c, r, status, content_type, extra, n_extra, !no_body, total, keep, &n);
  uv_buf_t *bufs = malloc((n_body + 1) * sizeof(uv_buf_t));
  if (!h || !bufs) {
    free(h);
    free(bufs);
    c->req = r;
    c->wrelease = release;
    c->wrelease_arg = release_arg;
    req_record(r, status, 0);
    write_done(c, 0);
    return;
  }

  size_t nb = 0;
  bufs[nb++] = uv_buf_init(h, (unsigned)n);
  if (pub->method != DSV4_HTTP_HEAD && !no_body)
    for (size_t i = 0; i < n_body; i++)
      if (body[i].len > 0)
        bufs[nb++] = body[i];
  r->keep_alive = keep;
  r->bytes_out = n + (pub->method != DSV4_HTTP_HEAD && !no_body ? total : 0);
  c->whdr = h;
  c->wbufs = bufs;
  c->wrelease = release;
  c->wrelease_arg = release_arg;
  c->writing = 1;
  req_record(r, status, 1);
  conn_update_reading(c);

  /* Most responses fit the socket buffer: try to write them now and skip the write request. */
  int w = uv_try_write(&c->io.stream, bufs, (unsigned)nb);
  size_t done = w > 0 ? (size_t)w : 0;
  if (w < 0 && w != UV_EAGAIN) {
    write_done(c, 0);
    return;
  }
  size_t first = 0;
  while (first < nb && done >= bufs[first].len) {
    done -= bufs[first].len;
    first++;
  }
  if (first == nb) {
    write_done(c, 1);
    return;
  }
  bufs[first].base += done;
  bufs[first].len -= done;
  c->wreq.data = c;
  set_phase(c, PHASE_WRITE);
  if (uv_write(&c->wreq, &c->io.stream, bufs + first, (unsigned)(nb - first), on_write) != 0)
    write_done(c, 0);
}

/* ---- streamed responses --------------------------------------------------------------------- */

int dsv4_respond_stream_begin(dsv4_req_t *pub, int status, const char *content_type,
                              const dsv4_hdr_t *extra, size_t n_extra, uint64_t content_length) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_DISPATCHED);
  conn_t *c = r->conn;
  r->state = REQ_STREAMING;
  r->resp_status = status;
  r->stream_len = content_length;
  if (content_length == 0 || pub->method == DSV4_HTTP_HEAD) {
    r->stream_failed = 1;
    return DSV4_EINVAL;
  }
  if (!c || c->closing) {
    r->stream_failed = 1;
    return DSV4_EIO;
  }
  r->keep_alive = conn_keeps(c, r->keep_alive);
  size_t n = 0;
  char *h = response_head(c, r, status, content_type, extra, n_extra, 1, content_length,
                          r->keep_alive, &n);
  if (!h) {
    r->stream_failed = 1;
    return DSV4_ENOMEM;
  }
  c->whdr = h;
  c->sbufs[0] = uv_buf_init(h, (unsigned)n);
  c->writing = 1; /* no reading while the answer streams: one request in flight per connection */
  conn_update_reading(c);
  return 0;
}

int dsv4_respond_stream_write(dsv4_req_t *pub, const uv_buf_t *buf, dsv4_stream_cb cb, void *arg) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_STREAMING);
  conn_t *c = r->conn;
  if (r->stream_failed || !c || c->closing)
    return DSV4_EIO;
  assert(!c->stream_pending);
  if (buf->len > r->stream_len - r->stream_sent)
    return DSV4_EINVAL;
  size_t nb = 0;
  uv_buf_t bufs[2];
  if (!r->stream_hdr_sent)
    bufs[nb++] = c->sbufs[0];
  bufs[nb++] = *buf;
  c->sbufs[1] = *buf;
  r->stream_cb = cb;
  r->stream_arg = arg;
  c->stream_pending = 1;
  c->wreq.data = c;
  /* uv_write tries the socket at once and queues the rest; its callback is always deferred, so
   * the caller's callback never runs inside this call. */
  if (uv_write(&c->wreq, &c->io.stream, bufs, (unsigned)nb, on_write) != 0) {
    c->stream_pending = 0;
    r->stream_failed = 1;
    return DSV4_EIO;
  }
  set_phase(c, PHASE_WRITE);
  return 0;
}

/* A streamed piece has been written (status 0) or failed; runs the caller's callback. */
static void stream_piece_done(conn_t *c, int status) {
  req_t *r = c->req;
  c->stream_pending = 0;
  assert(r && r->state == REQ_STREAMING);
  if (status == 0) {
    if (!r->stream_hdr_sent) {
      r->bytes_out += c->sbufs[0].len;
      r->stream_hdr_sent = 1;
    }
    r->bytes_out += c->sbufs[1].len;
    r->stream_sent += c->sbufs[1].len;
    uv_timer_stop(&c->timer);
    c->phase = PHASE_NONE;
  } else {
    /* The client went away or stalled past write_timeout_ms: the answer cannot complete. */
    r->stream_failed = 1;
    r->gone = 1;
    if (!c->closing)
      conn_close(c); /* detaches r: the caller ends the stream, which frees it */
    else {
      r->conn = NULL;
      c->req = NULL;
    }
  }
  if (r->stream_cb)
    r->stream_cb(&r->pub, status == 0 ? 0 : DSV4_EIO, r->stream_arg);
}

void dsv4_respond_stream_end(dsv4_req_t *pub) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_STREAMING);
  conn_t *c = r->conn;
  int complete = !r->stream_failed && r->stream_sent == r->stream_len;
  if (c && c->stream_pending) {
    /* Ended while a piece is still in the socket's queue: the answer cannot complete. */
    complete = 0;
    r->stream_cb = NULL;
  }
  req_record(r, r->resp_status, complete);
  if (!c) {
    req_free(r);
    return;
  }
  if (!complete) {
    /* Short of Content-Length: closing is the only honest end. The request is freed here. */
    r->conn = NULL;
    c->req = NULL;
    c->close_after = 1;
    free(c->whdr);
    c->whdr = NULL;
    conn_close(c);
    req_free(r);
    return;
  }
  write_done(c, 1);
}

static void free_release(void *p) {
  free(p);
}

static void respond_json_extra(dsv4_req_t *req, int status, json_t *doc, const dsv4_hdr_t *extra,
                               size_t n_extra) {
  char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  if (doc)
    json_decref(doc);
  if (!text) {
    static const char oom[] =
        "{\"error\":{\"code\":\"out_of_memory\",\"message\":\"cannot build the response\"}}";
    uv_buf_t b = uv_buf_init((char *)oom, sizeof(oom) - 1);
    dsv4_respond(req, 503, "application/json", NULL, 0, &b, 1, NULL, NULL);
    return;
  }
  uv_buf_t b = uv_buf_init(text, (unsigned)strlen(text));
  dsv4_respond(req, status, "application/json", extra, n_extra, &b, 1, free_release, text);
}

void dsv4_respond_json(dsv4_req_t *req, int status, json_t *doc) {
  respond_json_extra(req, status, doc, NULL, 0);
}

void dsv4_respond_error(dsv4_req_t *req, int err, const char *message, json_t *details) {
  dsv4_http_error_t he = dsv4_http_error(err);
  int status = he.status;
  json_t *e = json_object();
  json_t *doc = e ? json_pack("{s:o}", "error", e) : NULL;
  if (e) {
    json_t *m = json_string(message ? message : dsv4_strerror(err));
    json_object_set_new(e, "code", json_string(he.code));
    json_object_set_new(e, "message", m ? m : json_string(dsv4_strerror(err)));
    if (json_is_object(details))
      json_object_update_missing(e, details);
  }
  if (details)
    json_decref(details);
  dsv4_hdr_t extra[2];
  size_t n = 0;
  if (status == 503 || status == 429)
    extra[n++] = (dsv4_hdr_t){"Retry-After", "1"};
  if (status == 401)
    extra[n++] = (dsv4_hdr_t){"WWW-Authenticate", "Bearer"};
  respond_json_extra(req, status, doc, extra, n);
}

/* ---- parsing -------------------------------------------------------------------------------- */

static conn_t *conn_of(llhttp_t *p) {
  return p->data;
}

/* Count request-line and header bytes; past the limit the parser stops with HPE_USER (431). */
static int count_header(llhttp_t *p, req_t *r, size_t n) {
  r->header_bytes += n;
  if (r->header_bytes > conn_of(p)->srv->max_header_bytes) {
    r->err = DSV4_EHDRBIG;
    llhttp_set_error_reason(p, "headers too large");
    return HPE_USER;
  }
  return 0;
}

static int on_message_begin(llhttp_t *p) {
  conn_t *c = conn_of(p);
  assert(!c->req);
  c->req = req_new(c);
  if (!c->req)
    return -1;
  set_phase(c, PHASE_HEADER);
  return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t n) {
  req_t *r = conn_of(p)->req;
  if (count_header(p, r, n) != 0)
    return HPE_USER;
  return arena_put(r, at, n) == 0 ? 0 : -1;
}

static int on_url_complete(llhttp_t *p) {
  req_t *r = conn_of(p)->req;
  return arena_put(r, "", 1) == 0 ? 0 : -1;
}

static int on_header_field(llhttp_t *p, const char *at, size_t n) {
  req_t *r = conn_of(p)->req;
  /* Four bytes for ": " and CRLF, so many empty headers still count against the limit. */
  if (count_header(p, r, n + (r->field_open ? 0 : 4)) != 0)
    return HPE_USER;
  if (!r->field_open) {
    if (r->n_hdrs == r->cap_hdrs) {
      size_t cap = r->cap_hdrs ? 2 * r->cap_hdrs : 16;
      hdr_off_t *h = realloc(r->hdrs, cap * sizeof(*h));
      if (!h)
        return -1;
      r->hdrs = h;
      r->cap_hdrs = cap;
    }
    r->hdrs[r->n_hdrs].name = (uint32_t)r->arena_len;
    r->hdrs[r->n_hdrs].value = 0;
    r->field_open = 1;
  }
  return arena_put(r, at, n) == 0 ? 0 : -1;
}

static int on_header_field_complete(llhttp_t *p) {
  req_t *r = conn_of(p)->req;
  if (!r->field_open)
    return -1;
  r->field_open = 0;
  return arena_put(r, "", 1) == 0 ? 0 : -1;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n) {
  req_t *r = conn_of(p)->req;
  if (count_header(p, r, n) != 0)
    return HPE_USER;
  if (!r->value_open) {
    r->hdrs[r->n_hdrs].value = (uint32_t)r->arena_len;
    r->value_open = 1;
  }
  return arena_put(r, at, n) == 0 ? 0 : -1;
}

static int on_header_value_complete(llhttp_t *p) {
  req_t *r = conn_of(p)->req;
  if (!r->value_open)
    r->hdrs[r->n_hdrs].value = (uint32_t)r->arena_len;
  r->value_open = 0;
  /* Trailing whitespace is not part of a field value (RFC 9110 §5.5). */
  size_t start = r->hdrs[r->n_hdrs].value;
  while (r->arena_len > start &&
         (r->arena[r->arena_len - 1] == ' ' || r->arena[r->arena_len - 1] == '\t'))
    r->arena_len--;
  r->n_hdrs++;
  return arena_put(r, "", 1) == 0 ? 0 : -1;
}

static int method_of(uint8_t m) {
  switch (m) {
  case HTTP_GET:
    return DSV4_HTTP_GET;
  case HTTP_POST:
    return DSV4_HTTP_POST;
  case HTTP_DELETE:
    return DSV4_HTTP_DELETE;
  case HTTP_HEAD:
    return DSV4_HTTP_HEAD;
  default:
    return 0;
  }
}

static int path_matches(const char *route, const char *path) {
  size_t n = strlen(route);
  if (n > 0 && route[n - 1] == '/')
    return strncmp(route, path, n) == 0;
  return strcmp(route, path) == 0;
}

/* Compare every byte of the expected token whatever the given one holds, so timing does not tell
 * how long a matching prefix was. */
static int token_ok(const char *expected, const char *given) {
  size_t n = strlen(expected), g = strlen(given);
  volatile unsigned char diff = (unsigned char)(n != g);
  for (size_t i = 0; i < n; i++)
    diff |= (unsigned char)(expected[i] ^ (i < g ? given[i] : 0));
  return diff == 0;
}

static int authorized(const dsv4_server_t *s, const dsv4_req_t *req) {
  if (!s->token)
    return 1;
  const char *a = dsv4_req_header(req, "Authorization");
  if (!a)
    return 0;
  while (*a == ' ' || *a == '\t')
    a++;
  if (strncasecmp(a, "Bearer", 6) != 0 || (a[6] != ' ' && a[6] != '\t'))
    return 0;
  a += 6;
  while (*a == ' ' || *a == '\t')
    a++;
  return token_ok(s->token, a);
}

static void early_error(req_t *r, int err, const char *msg) {
  r->err = err;
  snprintf(r->errmsg, sizeof(r->errmsg), "%s", msg);
}

static void send_continue(conn_t *c);

static int on_headers_complete(llhttp_t *p) {
  conn_t *c = conn_of(p);
  req_t *r = c->req;
  dsv4_server_t *s = c->srv;
  dsv4_req_t *q = &r->pub;
  q->method = method_of(llhttp_get_method(p));
  r->http_minor = llhttp_get_http_minor(p);
  /* The URL is stable in the arena from here on: split off the query and any fragment. */
  char *url = r->arena;
  char *hash = strchr(url, '#');
  if (hash)
    *hash = '\0';
  char *qm = strchr(url, '?');
  if (qm) {
    *qm = '\0';
    q->query = qm + 1;
  }
  q->path = url;

  const dsv4_route_t *rt = NULL;
  int path_seen = 0;
  for (size_t i = 0; i < s->n_routes && !rt; i++) {
    if (!path_matches(s->routes[i].path, url))
      continue;
    path_seen = 1;
    if (q->method && (s->routes[i].methods & (unsigned)q->method))
      rt = &s->routes[i];
  }
  int chunked = (p->flags & (F_CHUNKED | F_TRANSFER_ENCODING)) != 0;
  int has_len = (p->flags & F_CONTENT_LENGTH) != 0;
  r->content_length = has_len ? p->content_length : 0;
  if (rt) {
    r->route = rt;
    q->route = rt->label;
    r->authed = s->token != NULL && authorized(s, q);
  }
  if (!rt)
    early_error(r, path_seen ? DSV4_EMETHOD : DSV4_ENOTFOUND,
                path_seen ? "method not allowed for this path" : "no such route");
  else if (!rt->public_route && !authorized(s, q))
    early_error(r, DSV4_EUNAUTH, "missing or wrong bearer token");
  else if (chunked || (q->method == DSV4_HTTP_POST && !has_len))
    early_error(r, DSV4_ELENGTH, "a request body needs Content-Length (chunked is not accepted)");
  else if (r->content_length > rt->max_body) {
    char m[96];
    snprintf(m, sizeof(m), "body of %llu bytes exceeds the limit of %zu",
             (unsigned long long)r->content_length, rt->max_body);
    early_error(r, DSV4_ETOOBIG, m);
  }
  if (r->err) {
    /* Without a body the message completes normally and the connection stays usable; with one,
     * stop here and close after answering rather than read a body nobody wants. */
    if (r->content_length == 0 && !chunked)
      return 0;
    c->close_after = 1;
    return -1;
  }
  if (r->content_length > 0) {
    size_t n = (size_t)r->content_length;
    q->body = aligned_alloc(64, (n + 63) & ~(size_t)63);
    if (!q->body) {
      early_error(r, DSV4_ENOMEM, "cannot allocate the request body");
      c->close_after = 1;
      return -1;
    }
    const char *expect = dsv4_req_header(q, "Expect");
    if (expect && strcasecmp(expect, "100-continue") == 0)
      send_continue(c);
    set_phase(c, PHASE_BODY);
  }
  return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = conn_of(p);
  req_t *r = c->req;
  if (r->body_received + n > r->content_length)
    return -1;
  uint8_t *dst = r->pub.body + r->body_received;
  /* Reads during the body go straight into the body buffer (see on_alloc); copy only otherwise. */
  if ((const uint8_t *)at != dst)
    memcpy(dst, at, n);
  r->body_received += n;
  /* body_timeout_ms is for the whole body, as header_timeout_ms is for the whole head: the timer
   * runs from the end of the headers and is not restarted by each piece, so a body dripped a byte
   * at a time cannot hold its buffer (up to max_body_bytes) for ever. */
  return 0;
}

static int on_message_complete(llhttp_t *p) {
  conn_t *c = conn_of(p);
  req_t *r = c->req;
  r->keep_alive = llhttp_should_keep_alive(p);
  r->pub.body_len = r->body_received;
  /* One request in flight per connection: pause here, answer, then resume where we stopped. */
  return HPE_PAUSED;
}

typedef struct {
  uv_write_t w;
  char msg[96];
} cont_write_t;

static void on_continue_written(uv_write_t *w, int status) {
  (void)status;
  free(w->data);
}

/* The interim answer to "Expect: 100-continue", sent once the limits have passed. */
static void send_continue(conn_t *c) {
  char msg[96];
  int n = snprintf(msg, sizeof(msg), "HTTP/1.1 100 Continue\r\nDsv4d-Instance: %s\r\n\r\n",
                   c->srv->instance);
  uv_buf_t b = uv_buf_init(msg, (unsigned)n);
  int k = uv_try_write(&c->io.stream, &b, 1);
  if (k == n || (k < 0 && k != UV_EAGAIN))
    return; /* sent, or the connection failed and the read side will notice */
  if (k < 0)
    k = 0;
  cont_write_t *cw = malloc(sizeof(*cw));
  if (!cw)
    return;
  memcpy(cw->msg, msg + k, (size_t)(n - k));
  cw->w.data = cw;
  b = uv_buf_init(cw->msg, (unsigned)(n - k));
  if (uv_write(&cw->w, &c->io.stream, &b, 1, on_continue_written) != 0)
    free(cw);
}

/* Hand a complete request to its handler, or answer the error found while parsing it. */
static void dispatch(conn_t *c) {
  req_t *r = c->req;
  r->state = REQ_DISPATCHED;
  uv_timer_stop(&c->timer);
  c->phase = PHASE_NONE;
  if (r->err)
    dsv4_respond_error(&r->pub, r->err, r->errmsg[0] ? r->errmsg : NULL, NULL);
  else
    r->route->fn(&r->pub, r->route->ctx);
}

/* Answer a request that cannot go on (a parse error, a limit, a timeout) and close afterwards. */
static void conn_fail(conn_t *c, int err, const char *msg) {
  if (!c->req) {
    c->req = req_new(c);
    if (!c->req) {
      conn_close(c);
      return;
    }
  }
  req_t *r = c->req;
  if (r->state != REQ_PARSING) {
    conn_close(c);
    return;
  }
  if (r->err) {
    err = r->err;
    msg = r->errmsg[0] ? r->errmsg : NULL;
  }
  r->err = err;
  if (msg != r->errmsg) /* a message already in place stays (copying it onto itself overlaps) */
    snprintf(r->errmsg, sizeof(r->errmsg), "%s", msg ? msg : dsv4_strerror(err));
  r->keep_alive = 0;
  c->close_after = 1;
  dispatch(c);
}

/* Parse data; returns how many bytes were consumed (the rest waits for the current request). */
static size_t conn_execute(conn_t *c, const char *data, size_t len) {
  llhttp_errno_t e = llhttp_execute(&c->parser, data, len);
  if (e == HPE_OK)
    return len;
  if (e == HPE_PAUSED) {
    size_t used = (size_t)(llhttp_get_error_pos(&c->parser) - data);
    llhttp_resume(&c->parser);
    dispatch(c);
    return used;
  }
  char msg[96];
  snprintf(msg, sizeof(msg), "malformed request: %s", llhttp_get_error_reason(&c->parser));
  conn_fail(c, DSV4_EINVAL, msg);
  return len;
}

static int conn_busy(const conn_t *c) {
  return c->writing || (c->req && c->req->state != REQ_PARSING);
}

/* The arrival time of rbuf[rbuf_off]: the latest read that began at or before it (or, when that
 * read's mark is gone, the oldest one left: a little late, never early). Older marks go. */
static uint64_t rbuf_arrival(conn_t *c) {
  uint64_t at = c->rbuf_in - (c->rbuf_len - c->rbuf_off), ns = 0;
  while (c->n_marks) {
    unsigned k = c->mark0;
    if (c->marks[k].at > at) {
      if (!ns)
        ns = c->marks[k].ns;
      break;
    }
    ns = c->marks[k].ns;
    unsigned next = (k + 1) % MARKS;
    if (c->n_marks == 1 || c->marks[next].at > at)
      break;
    c->mark0 = next;
    c->n_marks--;
  }
  return ns;
}

static void conn_process(conn_t *c) {
  if (c->processing)
    return;
  c->processing = 1;
  while (!c->closing && !c->lingering && !conn_busy(c) && c->rbuf_off < c->rbuf_len) {
    c->exec_arrived_ns = rbuf_arrival(c);
    size_t used = conn_execute(c, c->rbuf + c->rbuf_off, c->rbuf_len - c->rbuf_off);
    c->exec_arrived_ns = 0;
    c->rbuf_off += used;
  }
  if (c->rbuf_off == c->rbuf_len)
    c->rbuf_off = c->rbuf_len = 0;
  c->processing = 0;
  conn_update_reading(c);
}

/* ---- reading -------------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  conn_t *c = h->data;
  req_t *r = c->req;
  c->body_read = 0;
  if (!c->lingering && r && r->state == REQ_PARSING && r->pub.body && c->rbuf_off == c->rbuf_len &&
      r->body_received < r->content_length) {
    /* Mid-body with nothing buffered: read straight into the body buffer, at most what is left of
     * it, so the bytes of a large body are copied once, by the kernel. */
    size_t left = (size_t)r->content_length - r->body_received;
    *buf = uv_buf_init((char *)r->pub.body + r->body_received,
                       (unsigned)(left < 0x40000000u ? left : 0x40000000u));
    c->body_read = 1;
    return;
  }
  if (c->rbuf_off == c->rbuf_len)
    c->rbuf_off = c->rbuf_len = 0;
  if (c->rbuf_cap - c->rbuf_len < READ_CHUNK / 4) {
    if (c->rbuf_off > 0) {
      memmove(c->rbuf, c->rbuf + c->rbuf_off, c->rbuf_len - c->rbuf_off);
      c->rbuf_len -= c->rbuf_off;
      c->rbuf_off = 0;
    }
    if (c->rbuf_cap - c->rbuf_len < READ_CHUNK / 4) {
      size_t cap = c->rbuf_cap ? c->rbuf_cap * 2 : READ_CHUNK;
      char *b = realloc(c->rbuf, cap);
      if (!b) {
        *buf = uv_buf_init(NULL, 0);
        return;
      }
      c->rbuf = b;
      c->rbuf_cap = cap;
    }
  }
  *buf = uv_buf_init(c->rbuf + c->rbuf_len, (unsigned)(c->rbuf_cap - c->rbuf_len));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = st->data;
  if (c->closing)
    return;
  if (nread == 0)
    return;
  if (nread < 0) {
    req_t *r = c->req;
    if (c->lingering || !r || r->state == REQ_PARSING || nread != UV_EOF) {
      /* Idle, mid-request (no handler was called) or a reset: nothing more can be answered. */
      conn_close(c);
      return;
    }
    /* EOF while the handler works or the response is written: the client has gone away (most
     * clients never half-close). Answer anyway; the connection closes afterwards. */
    c->peer_eof = 1;
    r->gone = 1;
    conn_update_reading(c);
    return;
  }
  if (c->lingering) {
    c->rbuf_off = c->rbuf_len = 0;
    return;
  }
  if (c->body_read) {
    c->body_read = 0;
    size_t used = conn_execute(c, buf->base, (size_t)nread);
    (void)used;
    conn_process(c);
    return;
  }
  /* A mark for this read; with the ring full the oldest gives way (its bytes then count from the
   * next read's time, a little late, never early). */
  if (c->n_marks == MARKS) {
    c->mark0 = (c->mark0 + 1) % MARKS;
    c->n_marks--;
  }
  unsigned k = (c->mark0 + c->n_marks++) % MARKS;
  c->marks[k].at = c->rbuf_in;
  c->marks[k].ns = uv_hrtime();
  c->rbuf_in += (uint64_t)nread;
  c->rbuf_len += (size_t)nread;
  conn_process(c);
}

static void conn_update_reading(conn_t *c) {
  if (c->closing)
    return;
  int want;
  if (c->lingering)
    want = 1;
  else if (c->peer_eof || c->writing)
    want = 0;
  else if (conn_busy(c))
    want = c->rbuf_len - c->rbuf_off < INFLIGHT_READ_CAP;
  else
    want = 1;
  if (want && !c->reading) {
    if (uv_read_start(&c->io.stream, on_alloc, on_read) == 0)
      c->reading = 1;
  } else if (!want && c->reading) {
    uv_read_stop(&c->io.stream);
    c->reading = 0;
  }
}

/* ---- connections ---------------------------------------------------------------------------- */

static void on_conn_handle_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  if (--c->handles_open > 0)
    return;
  dsv4_server_t *s = c->srv;
  if (c->prev)
    c->prev->next = c->next;
  else
    s->conns = c->next;
  if (c->next)
    c->next->prev = c->prev;
  s->n_conns--;
  /* A streamed answer abandoned between pieces leaves its head here (write_done frees it else). */
  free(c->whdr);
  free(c->wbufs);
  free(c->rbuf);
  free(c);
  server_maybe_done(s);
}

static void conn_close(conn_t *c) {
  if (c->closing)
    return;
  c->closing = 1;
  req_t *r = c->req;
  if (r && r->state == REQ_PARSING) {
    /* Disconnected mid-request: the handler never saw it, so it is simply dropped. */
    req_free(r);
    c->req = NULL;
  } else if (r &&
             (r->state == REQ_DISPATCHED || (r->state == REQ_STREAMING && !c->stream_pending))) {
    /* The handler still owns the request and will respond (or end its stream); that only frees
     * it. A streamed piece in flight is cancelled by uv_close, and its callback detaches. */
    r->conn = NULL;
    r->gone = 1;
    r->stream_failed = 1;
    c->req = NULL;
  }
  /* A request being written is freed by the write callback, which uv_close cancels first. */
  uv_close(&c->io.handle, on_conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
}

static conn_t *conn_new(dsv4_server_t *s) {
  conn_t *c = calloc(1, sizeof(*c));
  if (!c)
    return NULL;
  c->srv = s;
  c->io.handle.data = c;
  c->timer.data = c;
  llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
  c->parser.data = c;
  return c;
}

/* Link c (whose stream is initialised) into the server and start serving it. */
/* Put c on the server's list; its close callbacks take it off again. */
static void conn_link(dsv4_server_t *s, conn_t *c, int handles_open) {
  c->handles_open = handles_open;
  c->next = s->conns;
  if (s->conns)
    s->conns->prev = c;
  s->conns = c;
  s->n_conns++;
}

/* A connection whose stream could not be set up: close and free it through the usual path. */
static void conn_abandon(dsv4_server_t *s, conn_t *c) {
  conn_link(s, c, 1);
  c->closing = 1;
  uv_close(&c->io.handle, on_conn_handle_closed);
}

static void conn_start(dsv4_server_t *s, conn_t *c) {
  uv_timer_init(s->loop, &c->timer);
  conn_link(s, c, 2);
  if (s->draining || s->closing) {
    conn_close(c);
    return;
  }
  set_phase(c, PHASE_IDLE);
  conn_update_reading(c);
}

static void on_connection(uv_stream_t *ls, int status) {
  dsv4_server_t *s = ls->data;
  if (status < 0)
    return;
  conn_t *c = conn_new(s);
  if (!c)
    return;
  uv_tcp_init(s->loop, &c->io.tcp);
  c->io.handle.data = c;
  if (uv_accept(ls, &c->io.stream) != 0) {
    /* Nothing was accepted; the handle is closed and freed alone. */
    conn_abandon(s, c);
    return;
  }
  uv_tcp_nodelay(&c->io.tcp, 1);
  {
    struct sockaddr_storage peer;
    int len = sizeof(peer);
    char ip[INET6_ADDRSTRLEN] = "?";
    if (uv_tcp_getpeername(&c->io.tcp, (struct sockaddr *)&peer, &len) == 0) {
      if (peer.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&peer;
        uv_ip6_name(a, ip, sizeof(ip));
        snprintf(c->peer, sizeof(c->peer), "[%s]:%d", ip, ntohs(a->sin6_port));
      } else {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&peer;
        uv_ip4_name(a, ip, sizeof(ip));
        snprintf(c->peer, sizeof(c->peer), "%s:%d", ip, ntohs(a->sin_port));
      }
    }
  }
  conn_start(s, c);
}

int dsv4__server_adopt_fd(dsv4_server_t *s, int fd) {
  conn_t *c = conn_new(s);
  if (!c)
    return DSV4_ENOMEM;
  uv_pipe_init(s->loop, &c->io.pipe, 0);
  c->io.handle.data = c;
  if (uv_pipe_open(&c->io.pipe, fd) != 0) {
    conn_abandon(s, c);
    return DSV4_EIO;
  }
  conn_start(s, c);
  return 0;
}

/* ---- the server ----------------------------------------------------------------------------- */

static void server_free(dsv4_server_t *s) {
  free(s->host);
  free(s->token);
  free(s->name);
  free(s->routes);
  free(s);
}

static void server_maybe_done(dsv4_server_t *s) {
  if (!s->closing || s->listener_open || s->sentinel_open || s->n_conns > 0)
    return;
  void (*cb)(void *) = s->close_cb;
  void *arg = s->close_arg;
  server_free(s);
  if (cb)
    cb(arg);
}

static void on_listener_closed(uv_handle_t *h) {
  dsv4_server_t *s = h->data;
  s->listener_open = 0;
  server_maybe_done(s);
}

static void on_sentinel_closed(uv_handle_t *h) {
  dsv4_server_t *s = h->data;
  s->sentinel_open = 0;
  server_maybe_done(s);
}

static void close_listener(dsv4_server_t *s) {
  if (s->listener_open == 1) {
    s->listener_open = 2; /* closing */
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
  }
}

int dsv4_server_create(uv_loop_t *loop, const dsv4_server_config_t *cfg, const dsv4_route_t *routes,
                       size_t n_routes, dsv4_server_t **out) {
  for (size_t i = 0; i < n_routes; i++)
    if (!routes[i].path || !routes[i].label || !routes[i].fn)
      return DSV4_EINVAL;
  dsv4_server_t *s = calloc(1, sizeof(*s));
  if (!s)
    return DSV4_ENOMEM;
  s->loop = loop;
  s->host = strdup(cfg->host ? cfg->host : "127.0.0.1");
  s->name = strdup(cfg->name ? cfg->name : "data");
  s->token = cfg->bearer_token && cfg->bearer_token[0] ? strdup(cfg->bearer_token) : NULL;
  s->routes = calloc(n_routes ? n_routes : 1, sizeof(*routes));
  if (!s->host || !s->name || !s->routes ||
      (cfg->bearer_token && cfg->bearer_token[0] && !s->token)) {
    server_free(s);
    return DSV4_ENOMEM;
  }
  if (n_routes)
    memcpy(s->routes, routes, n_routes * sizeof(*routes));
  s->n_routes = n_routes;
  if (cfg->instance && strlen(cfg->instance) < sizeof(s->instance)) {
    snprintf(s->instance, sizeof(s->instance), "%s", cfg->instance);
  } else {
    uint8_t rnd[16] = {0};
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd))
      memset(rnd, 0, sizeof(rnd));
    for (int i = 0; i < 16; i++)
      snprintf(s->instance + 2 * i, 3, "%02x", rnd[i]);
  }
  s->max_header_bytes = cfg->max_header_bytes ? cfg->max_header_bytes : DEFAULT_MAX_HEADER;
  s->header_timeout_ms = cfg->header_timeout_ms;
  s->body_timeout_ms = cfg->body_timeout_ms;
  s->idle_timeout_ms = cfg->idle_timeout_ms;
  s->write_timeout_ms = cfg->write_timeout_ms;
  s->on_complete = cfg->on_complete;
  s->on_complete_arg = cfg->on_complete_arg;

  dsv4_metrics_t *reg = cfg->metrics ? cfg->metrics : dsv4_metrics_default();
  static const char *const labels[2] = {"route", "code"};
  if (!reg || dsv4_metrics_counter(reg, "dsv4d_requests_total",
                                   "HTTP requests answered, by route and status code.", labels, 2,
                                   &s->requests_total) != 0) {
    server_free(s);
    return DSV4_ENOMEM;
  }

  llhttp_settings_init(&s->settings);
  s->settings.on_message_begin = on_message_begin;
  s->settings.on_url = on_url;
  s->settings.on_url_complete = on_url_complete;
  s->settings.on_header_field = on_header_field;
  s->settings.on_header_field_complete = on_header_field_complete;
  s->settings.on_header_value = on_header_value;
  s->settings.on_header_value_complete = on_header_value_complete;
  s->settings.on_headers_complete = on_headers_complete;
  s->settings.on_body = on_body;
  s->settings.on_message_complete = on_message_complete;

  struct sockaddr_storage addr;
  int rc = uv_ip4_addr(s->host, cfg->port, (struct sockaddr_in *)&addr);
  if (rc != 0)
    rc = uv_ip6_addr(s->host, cfg->port, (struct sockaddr_in6 *)&addr);
  if (rc != 0) {
    server_free(s);
    return DSV4_ECONFIG;
  }
  uv_tcp_init(loop, &s->listener);
  s->listener.data = s;
  s->listener_open = 1;
  uv_timer_init(loop, &s->sentinel);
  s->sentinel.data = s;
  s->sentinel_open = 1;
  rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
  if (rc != 0) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot listen", "{s:s, s:s, s:i, s:s}", "listener", s->name, "host",
              s->host, "port", cfg->port, "error", uv_strerror(rc));
    /* The handle must be closed before the server is freed: close it and let the callback free. */
    s->closing = 1;
    close_listener(s);
    s->sentinel_open = 2;
    uv_close((uv_handle_t *)&s->sentinel, on_sentinel_closed);
    return DSV4_EIO;
  }
  struct sockaddr_storage bound;
  int len = sizeof(bound);
  uv_tcp_getsockname(&s->listener, (struct sockaddr *)&bound, &len);
  s->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                        : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  *out = s;
  return 0;
}

int dsv4_server_port(const dsv4_server_t *s) {
  return s->port;
}

size_t dsv4_server_connections(const dsv4_server_t *s) {
  return s->n_conns;
}

void dsv4_server_drain(dsv4_server_t *s) {
  if (s->draining || s->closing)
    return;
  s->draining = 1;
  close_listener(s);
  for (conn_t *c = s->conns, *next; c; c = next) {
    next = c->next;
    int idle = !c->req && !c->writing && c->rbuf_off == c->rbuf_len;
    if (idle && !c->closing)
      conn_close(c);
  }
}

void dsv4_server_close(dsv4_server_t *s, void (*cb)(void *), void *arg) {
  if (s->closing)
    return;
  s->closing = 1;
  s->close_cb = cb;
  s->close_arg = arg;
  close_listener(s);
  s->sentinel_open = 2;
  uv_close((uv_handle_t *)&s->sentinel, on_sentinel_closed);
  for (conn_t *c = s->conns, *next; c; c = next) {
    next = c->next;
    conn_close(c);
  }
  /* Callbacks always run from the loop, never from inside this call. */
}
