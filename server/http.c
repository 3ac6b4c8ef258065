#include "http.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <llhttp.h>

#include "bulk_io.h"
#include "dsv4-error.h"
#include "errors.h"
#include "http-internal.h"
#include "log.h"
#include "metrics.h"

#define READ_CHUNK ((size_t)64 * 1024)
/* A read into the read buffer (a head, and whatever follows it) takes at most this much: the body
 * bytes that come with a head are copied out of the buffer, the rest of the body is read straight
 * into its place (on_alloc). Offered the whole buffer, a one-token decode's q was copied whole. */
#define READ_HEAD_OFFER ((size_t)8 * 1024)
/* While a request is in flight the connection keeps reading only to notice a client that went away;
 * pipelined bytes beyond this much (a head's read) stay in the kernel's buffer (backpressure). A
 * client that sends its next request as soon as an answer written by the executor arrives, before
 * the loop has taken that answer's completion, then has the rest of the body read into its place
 * afterwards: with 64 KiB here a one-token decode's q came in eight reads of 8 KiB into the read
 * buffer and was copied out of it (tests/bench/NOTES.md). */
#define INFLIGHT_READ_CAP READ_HEAD_OFFER
/* Reads whose arrival times a connection remembers (conn_t.marks). */
#define MARKS 16
/*
 * The slice (dsv4_server_config_t.io_slice_bytes, 1 MiB unless set). An answer larger than a slice
 * goes out a slice at a time, at most one slice a connection in a loop iteration (the server's pace
 * check sends the next). Written at once, a prefill's 64 MiB answer held the loop for the kernel's
 * copy of what the socket took, 1.3-1.9 ms a write on the H200 host, while other connections'
 * decodes waited (tests/bench/NOTES.md, "mixed_load v3"). Likewise a body is read at most a slice
 * a connection in a loop iteration: a read that fills its slice stops the reading until the pace
 * check. Offered the whole rest of a 64 MiB body, one read took what the socket held, up to
 * several MiB, and held the loop for up to 1.7 ms on the H200 host.
 */
#define DEFAULT_IO_SLICE ((size_t)1 << 20)
/* Buffers of one slice: an answer's head and its tensors (fwd_answer has at most 6). */
#define WRITE_SLICE_BUFS 16
/* Duplicates of sockets held for answers written by another thread (DSV4_DIRECT_MAX), and for the
 * bulk I/O thread's transfers (DSV4_BULK_MAX). */
static atomic_int direct_fds, bulk_fds;

/* A duplicate of fd (close-on-exec) counted in *held, while fewer than max are held; -1 when none
 * (the count is then unchanged). Whoever closes it takes it off the count. */
static int dup_counted(atomic_int *held, int max, int fd) {
  if (atomic_fetch_add(held, 1) >= max) {
    atomic_fetch_sub(held, 1);
    return -1;
  }
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0)
    atomic_fetch_sub(held, 1);
  return d;
}
/* After a response that closes the connection: shut down our side, then read and discard for at
 * most this long, so unread request bytes do not turn the close into a reset that destroys the
 * response before the client reads it (nginx's lingering close). */
#define LINGER_MS 1000
/* While the server drains, an idle keep-alive connection waits this long (at most) for its next
 * request before it closes: a client in the middle of a run of requests sends the next one within
 * a round trip of reading an answer, and a connection idle longer is a pooled one whose client
 * must expect it to close, as at idle_timeout_ms. */
#define DRAIN_IDLE_MS 1000
#define DEFAULT_MAX_HEADER ((size_t)64 * 1024)
/* Connections taken per readiness of the listener, so that a burst does not starve the rest. */
#define ACCEPT_BATCH 64
/* Descriptors max_connections' default leaves for everything else (dsv4_server_default_...). */
#define FD_RESERVE 64

/*
 * Where a connection is. Exactly one state holds at a time and conn_enter() makes every change,
 * arming the timer that belongs to the new state, so a timeout always means "too long in this
 * state".
 */
typedef enum {
  CONN_IDLE = 0,  /* between requests: nothing of the next one parsed yet (idle_timeout_ms) */
  CONN_HEAD,      /* a request line and headers are arriving (header_timeout_ms, whole head) */
  CONN_BODY,      /* a request body is arriving (body_timeout_ms, whole body) */
  CONN_HANDLING,  /* a complete request is with its handler; no timer (the executor decides) */
  CONN_WRITING,   /* an answer, or a piece of a streamed one, is going out (write_timeout_ms) */
  CONN_STREAMING, /* a streamed answer between pieces: the handler makes the next; no timer */
  CONN_LINGERING, /* the last answer is out, our side shut down; input is discarded (LINGER_MS) */
  CONN_CLOSING,   /* uv_close has been called; the close callbacks free the connection */
} conn_state_t;

typedef enum {
  REQ_PARSING = 0, /* request line, headers or body still arriving */
  REQ_DISPATCHED,  /* complete; the handler (or an error answer) owns it */
  REQ_WRITING,     /* answered; the response is being written */
  REQ_STREAMING,   /* a streamed answer: the handler writes the body piece by piece */
} req_state_t;

typedef struct conn conn_t;

/*
 * Obsolete line folding (RFC 9112 section 5.2): llhttp 8 joins a header line that starts with a
 * blank onto the one before, also in Content-Length, so a folded length frames a body whose bytes a
 * proxy that reads the fold differently takes for the next request. No lenient flag controls it, so
 * every request head is scanned before llhttp reads it: a line after the request line that starts
 * with a space or a tab is refused (400, then the connection closes).
 */
typedef struct {
  uint32_t lines; /* complete lines with text so far; the first is the request line */
  enum { LINE_START = 0, LINE_CR, LINE_TEXT } at; /* where the current line stands */
  bool done;                                      /* the empty line ending the head was seen */
} head_scan_t;

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
  /* The body's allocation; pub.body is skew bytes into it once its route's body_skew placed it. */
  uint8_t *body_base;
  bool skew_pending; /* the route places the body and fewer than 8 of its bytes have come */
  void *watch;       /* the route's watcher of this body (watch_begin), or NULL */
  size_t bytes_out;
  uint64_t t_sent_ns; /* the answer's first bytes went from another thread then (0: from here) */
  bool direct;        /* dsv4_direct_open gave another thread a duplicate of the socket */
  int authed;         /* carried the listener's bearer token */
  char peer[64];      /* "ip:port" of the client */
  int resp_status;    /* a streamed answer's status, recorded at its end */
  uint64_t stream_len, stream_sent;
  int stream_hdr_sent, stream_failed;
  dsv4_stream_cb stream_cb;
  void *stream_arg;
  /* The listener's completion hook, copied: the request may outlive its connection. */
  void (*on_complete)(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
  void *on_complete_arg;
  /* The listener's body allocator, copied for the same reason (NULL: aligned_alloc and free). */
  void *(*body_alloc)(void *arg, size_t n);
  void (*body_free)(void *arg, void *p);
  void *body_alloc_arg;
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
  head_scan_t scan;         /* the head being parsed, for obsolete line folding */
  conn_state_t state;
  int handles_open;
  /* The booleans below are not states of the connection but facts that hold across several of them.
   * reading mirrors whether uv_read_start is in effect, which the state decides only together with
   * peer_eof and how much is buffered (conn_update_reading). */
  bool reading;
  /* conn_process is on the stack: a handler that answers at once re-enters it through write_done,
   * and the outer call must finish parsing first. */
  bool in_process;
  /* The client half-closed (EOF) while its request was handled or answered: whatever the state, the
   * answer still goes out and the connection then closes. */
  bool peer_eof;
  /* on_alloc handed libuv the body buffer itself rather than rbuf; on_read, called right after with
   * the same buffer, must know which one it got. */
  bool read_into_body;
  /* The response being written: wbufs[wfirst .. wnb) are still to go (wfirst's start moves as
   * its bytes go out), wslice bytes of them in the write request in flight. pace_due: on the
   * server's pace list, its next slice waiting for the check (no write in flight then). */
  char *whdr;
  uv_buf_t *wbufs;
  size_t wnb, wfirst, wslice;
  bool pace_due;
  conn_t *pace_next;
  /* A body read filled a slice (io_slice bytes): reading is stopped and the connection is on
   * the pace list (pace_due) for the check to start it again. */
  bool read_paced;
  void (*wrelease)(void *);
  void *wrelease_arg;
  /* A streamed piece owns wreq. Unlike CONN_WRITING this outlives conn_close: uv_close cancels the
   * write, and its callback must still reach the streaming handler. */
  bool stream_pending;
  uv_buf_t sbufs[2]; /* that piece: the response head (first piece only) and the caller's bytes */
  /* The rest of a body, or of an answer, that the bulk thread moves (bulk_io_bytes): while
   * bulk_out, the job is the bulk thread's and holds a reference (handles_open); the loop neither
   * reads nor writes the socket. bulk_timed_out: the body's timer fired and cancelled the job. */
  dsv4_bulk_job_t bulk;
  uv_buf_t bulk_buf;
  bool bulk_out, bulk_timed_out;
  /* The request whose body the bulk thread reads, for on_bulk_seen: while the job runs the loop
   * changes none of it (its body_received counts the bytes before the job). */
  req_t *bulk_req;
  char peer[64];
};

/* Why new connections are refused, if they are: an episode lasts while refusals keep coming. */
typedef enum { REFUSING_NONE = 0, REFUSING_LIMIT, REFUSING_FDS } refusing_t;

/* A whole 503 too_many_connections answer, built once: it goes out before any request is read. */
typedef struct {
  char *text;
  size_t len;
} refusal_t;

/* The data plane's TCP socket and, when configured, its Unix domain socket. */
#define LISTENERS 2

/*
 * A listening socket. It is ours, not a uv_tcp_t or uv_pipe_t: libuv meets EMFILE on accept by
 * accepting and closing every waiting connection with no word to its user, and this layer must
 * count, log and answer those.
 */
typedef struct {
  uv_poll_t poll;
  int fd;
  int open;   /* 0 no handle, 1 polling, 2 closing */
  char *path; /* a Unix socket's file, unlinked when the listener closes; NULL for TCP */
  dev_t dev;  /* the file bind made, so that a file another process put there is left alone */
  ino_t ino;
  struct dsv4_server *srv;
} listener_t;

struct dsv4_server {
  /* Every listener shares the routes, limits, timeouts, token and max_connections. */
  listener_t listeners[LISTENERS];
  size_t n_listeners;
  int spare_fd; /* held so that at the descriptor limit a connection can still be taken and told */
  uv_timer_t
      retry; /* restarts accepting after a pause; closing it also guarantees a close callback */
  /* Paced answers (io_slice): the check sends the next slice of each connection on the list,
   * once a loop iteration; the idle handle keeps the loop's poll from blocking meanwhile. */
  uv_check_t pace;
  uv_idle_t pace_idle;
  conn_t *pace_head;
  int pace_open; /* the two handles not yet closed */
  uv_loop_t *loop;
  char *host, *token, *name;
  char instance[40];
  size_t max_header_bytes, max_connections;
  uint64_t header_timeout_ms, body_timeout_ms, idle_timeout_ms, write_timeout_ms;
  size_t io_slice; /* io_slice_bytes */
  /* The bulk thread (bulk_io_bytes; NULL: none) and its smallest transfer; bulk_open: 1 while it
   * runs, 2 while it closes. bulk_bytes: dsv4d_bulk_bytes_total{direction}. */
  dsv4_bulk_t *bulk;
  size_t bulk_min;
  int bulk_open;
  dsv4_metric_t *bulk_bytes;
  dsv4_route_t *routes;
  size_t n_routes;
  llhttp_settings_t settings;
  conn_t *conns;
  size_t n_conns;
  /* Of those, the ones in CONN_CLOSING: their sockets are closed already, their handles not yet
   * (libuv calls back on a later loop turn). They no longer count against max_connections, so a
   * client that saw its connections end finds the room free at once. */
  size_t n_closing;
  int port;
  int retry_open, draining, closing;
  refusing_t refusing;
  uint64_t refused_in_episode, episode_start_ms, last_refusal_ms;
  refusal_t refusal_limit, refusal_fds;
  void (*close_cb)(void *);
  void *close_arg;
  dsv4_metric_t *requests_total, *rejected_total;
  dsv4_series_t *connections;
  void (*on_complete)(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
  void *on_complete_arg;
  void *(*body_alloc)(void *arg, size_t n);
  void (*body_free)(void *arg, void *p);
  void *body_alloc_arg;
};

static void conn_close(conn_t *c);
static void conn_process(conn_t *c);
static void conn_update_reading(conn_t *c);
static void server_maybe_done(dsv4_server_t *s);
static bool answer_to_bulk(conn_t *c);

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
  r->body_alloc = c->srv->body_alloc;
  r->body_free = c->srv->body_free;
  r->body_alloc_arg = c->srv->body_alloc_arg;
  return r;
}

static void req_free(req_t *r) {
  if (r->watch)
    r->route->watch->end(r->watch);
  if (r->body_free)
    r->body_free(r->body_alloc_arg, r->body_base);
  else
    free(r->body_base);
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

void *dsv4_req_take_watch(dsv4_req_t *pub) {
  req_t *r = req_of(pub);
  void *w = r->watch;
  r->watch = NULL;
  return w;
}

uint8_t *dsv4_req_take_body(dsv4_req_t *pub, void **alloc) {
  req_t *r = req_of(pub);
  uint8_t *b = pub->body;
  *alloc = r->body_base;
  pub->body = NULL;
  r->body_base = NULL;
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
  case DSV4_HTTP_PUT:
    return "PUT";
  default:
    return "OTHER";
  }
}

/* ---- timers --------------------------------------------------------------------------------- */

static void on_timer(uv_timer_t *t);

/* The one place a connection changes state; the timer of the new state replaces the old one. */
static void conn_enter(conn_t *c, conn_state_t state) {
  const dsv4_server_t *s = c->srv;
  if (c->state == CONN_CLOSING)
    return; /* final: the close callbacks own the connection now */
  uint64_t ms = 0;
  switch (state) {
  case CONN_IDLE:
    ms = s->draining && s->idle_timeout_ms > DRAIN_IDLE_MS ? DRAIN_IDLE_MS : s->idle_timeout_ms;
    break;
  case CONN_HEAD:
    ms = s->header_timeout_ms;
    break;
  case CONN_BODY:
    ms = s->body_timeout_ms;
    break;
  case CONN_WRITING:
    ms = s->write_timeout_ms;
    break;
  case CONN_LINGERING:
    ms = LINGER_MS;
    break;
  case CONN_HANDLING:
  case CONN_STREAMING:
  case CONN_CLOSING:
    break;
  }
  c->state = state;
  if (state == CONN_CLOSING) {
    c->srv->n_closing++; /* until on_conn_handle_closed */
    return;              /* uv_close stops the timer */
  }
  if (ms > 0)
    uv_timer_start(&c->timer, on_timer, ms, 0);
  else
    uv_timer_stop(&c->timer);
}

static void conn_fail(conn_t *c, int err, const char *msg);

/* Whether bytes (not only an EOF) wait in the socket, unread. */
static bool conn_input_waiting(const conn_t *c) {
  uv_os_fd_t fd;
  char b;
  return uv_fileno(&c->io.handle, &fd) == 0 && recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

/* Whether the connection stays open after the answer now being made; the answer says so, and that
 * decision holds once it is sent. While the server drains, only when bytes of a further request
 * have arrived (buffered or still in the socket), so that a request already sent is answered (a
 * forward with 503 draining, which tells a gateway it was never applied) rather than cut off. */
static int conn_keeps(const conn_t *c, int keep_alive) {
  if (!keep_alive || c->peer_eof)
    return 0;
  return !c->srv->draining || c->rbuf_off < c->rbuf_len || conn_input_waiting(c);
}

static void on_timer(uv_timer_t *t) {
  conn_t *c = t->data;
  switch (c->state) {
  case CONN_HEAD:
  case CONN_BODY:
    if (c->bulk_out) { /* the bulk thread stops reading first; its callback answers the 408 */
      c->bulk_timed_out = true;
      dsv4_bulk_cancel(c->srv->bulk, &c->bulk);
      break;
    }
    /* A request that started but did not finish in time gets a 408; the connection then closes. */
    conn_fail(c, DSV4_ETIMEDOUT,
              c->state == CONN_HEAD ? "request headers not received in time"
                                    : "request body stalled");
    break;
  case CONN_IDLE:
    /* libuv runs due timers before it polls: the next request may be here, unread. Let it in. */
    if (conn_input_waiting(c)) {
      conn_enter(c, CONN_IDLE);
      break;
    }
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
  double ms = (double)((r->t_sent_ns ? r->t_sent_ns : uv_hrtime()) - r->pub.t_start_ns) * 1e-6;
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

/* After an answer that closes the connection: shut down our side and drain what the client still
 * sends until it closes or LINGER_MS passes. */
static void conn_linger(conn_t *c) {
  c->rbuf_off = c->rbuf_len = 0;
  if (uv_shutdown(&c->sreq, &c->io.stream, NULL) != 0) {
    conn_close(c);
    return;
  }
  conn_enter(c, CONN_LINGERING);
  conn_update_reading(c);
}

static void write_done(conn_t *c, int status_ok) {
  req_t *r = c->req;
  void (*release)(void *) = c->wrelease;
  void *arg = c->wrelease_arg;
  c->wrelease = NULL;
  c->wrelease_arg = NULL;
  free(c->whdr);
  free(c->wbufs);
  c->whdr = NULL;
  c->wbufs = NULL;
  c->wnb = c->wfirst = c->wslice = 0;
  if (release)
    release(arg);
  /* What the answer announced, not a new decision: a client told keep-alive may already be sending
   * its next request (the server may have begun to drain since). Only its leaving ends it. */
  int keep = r && r->keep_alive && !c->peer_eof;
  c->req = NULL;
  if (r)
    req_free(r);
  if (c->state == CONN_CLOSING)
    return;
  if (!status_ok) {
    conn_close(c);
    return;
  }
  if (!keep) {
    conn_linger(c);
    return;
  }
  llhttp_init(&c->parser, HTTP_REQUEST, &c->srv->settings);
  c->parser.data = c;
  c->scan = (head_scan_t){0};
  conn_enter(c, CONN_IDLE);
  conn_process(c);
}

static void stream_piece_done(conn_t *c, int status);

static void on_write(uv_write_t *w, int status);

/* The answer's next slice: up to a slice's bytes from wbufs[wfirst] on; returns its bytes. */
static size_t slice_bufs(const conn_t *c, uv_buf_t *part, unsigned *n) {
  const size_t slice = c->srv->io_slice;
  size_t bytes = 0;
  *n = 0;
  for (size_t i = c->wfirst; i < c->wnb && *n < WRITE_SLICE_BUFS && bytes < slice; i++) {
    part[*n] = c->wbufs[i];
    if (part[*n].len > slice - bytes)
      part[*n].len = slice - bytes;
    bytes += part[(*n)++].len;
  }
  return bytes;
}

/* done bytes of the answer went out. Returns whether that was all of it. */
static int write_advance(conn_t *c, size_t done) {
  while (c->wfirst < c->wnb && done >= c->wbufs[c->wfirst].len) {
    done -= c->wbufs[c->wfirst].len;
    c->wfirst++;
  }
  if (c->wfirst == c->wnb)
    return 1;
  c->wbufs[c->wfirst].base += done;
  c->wbufs[c->wfirst].len -= done;
  return 0;
}

/* Queue the answer's next slice: uv_write writes what the socket takes at once (and copies the
 * array); on_write hears when all of it is out. */
static int write_slice(conn_t *c) {
  uv_buf_t part[WRITE_SLICE_BUFS];
  unsigned n;
  c->wslice = slice_bufs(c, part, &n);
  c->wreq.data = c;
  return uv_write(&c->wreq, &c->io.stream, part, n, on_write);
}

static void pace_wait(uv_idle_t *h) {
  (void)h; /* its being active is the point: the poll does not block while slices wait */
}

/* The pace check: one slice of each connection on the list. A connection whose slice goes out at
 * once is back on the list in the next iteration. (Sending the next slice from the write callback
 * instead let one answer write 18 slices of 2 MiB in a single iteration on the H200 host.) */
static void on_pace(uv_check_t *h) {
  dsv4_server_t *s = h->data;
  conn_t *list = s->pace_head;
  s->pace_head = NULL;
  uv_check_stop(&s->pace);
  uv_idle_stop(&s->pace_idle);
  while (list) {
    conn_t *c = list;
    list = c->pace_next;
    if (!c->pace_due)
      continue; /* closed meanwhile by a callback of this loop: its answer is done */
    c->pace_due = false;
    if (c->read_paced) {
      c->read_paced = false;
      conn_update_reading(c);
    } else if (write_slice(c) != 0) {
      write_done(c, 0);
    }
  }
}

/* c's next slice (of its answer, or with read_paced of its body) waits for the pace check. */
static void pace_add(conn_t *c) {
  dsv4_server_t *s = c->srv;
  c->pace_due = true;
  c->pace_next = s->pace_head;
  s->pace_head = c;
  uv_check_start(&s->pace, on_pace);
  uv_idle_start(&s->pace_idle, pace_wait);
}

/* c closes: off the pace list (or the list on_pace is working through, which skips it). Returns
 * whether it was on one. */
static int pace_remove(conn_t *c) {
  if (!c->pace_due)
    return 0;
  for (conn_t **p = &c->srv->pace_head; *p; p = &(*p)->pace_next)
    if (*p == c) {
      *p = c->pace_next;
      break;
    }
  c->pace_due = false;
  return 1;
}

static void on_write(uv_write_t *w, int status) {
  conn_t *c = w->data;
  if (c->stream_pending) {
    stream_piece_done(c, status);
    return;
  }
  /* The write_timeout_ms timer keeps running: it bounds the whole answer, not each slice. */
  if (status == 0 && !write_advance(c, c->wslice) && c->state != CONN_CLOSING) {
    pace_add(c);
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
static char *response_head(const char *instance, int http_minor, int status,
                           const char *content_type, const dsv4_hdr_t *extra, size_t n_extra,
                           int has_body, uint64_t content_length, int keep, size_t *len) {
  size_t cap = 256 + strlen(instance) + (content_type ? strlen(content_type) : 0);
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
  n += (size_t)snprintf(h + n, cap - n, "Dsv4d-Instance: %s\r\n", instance);
  if (!keep)
    n += (size_t)snprintf(h + n, cap - n, "Connection: close\r\n");
  else if (http_minor == 0)
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

/* The connection went away while the handler worked: nothing to write, only to release. */
static void respond_gone(conn_t *c, req_t *r, int status, void (*release)(void *),
                         void *release_arg) {
  if (release)
    release(release_arg);
  req_record(r, status, 0);
  if (c)
    c->req = NULL;
  req_free(r);
}

/*
 * The answer, head h (n bytes, taken; NULL: out of memory) and body (with_body: else the head
 * alone), into the connection's write state, and out: the first sent bytes already went
 * (dsv4_direct_write), or the connection failed (failed); the rest goes from here.
 */
static void respond_start(conn_t *c, req_t *r, int status, char *h, size_t n, const uv_buf_t *body,
                          size_t n_body, int with_body, int keep, void (*release)(void *),
                          void *release_arg, size_t sent, int failed) {
  size_t total = 0;
  for (size_t i = 0; i < n_body; i++)
    total += body[i].len;
  r->state = REQ_WRITING;
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
  if (with_body)
    for (size_t i = 0; i < n_body; i++)
      if (body[i].len > 0)
        bufs[nb++] = body[i];
  r->keep_alive = keep;
  r->bytes_out = n + (with_body ? total : 0);
  c->whdr = h;
  c->wbufs = bufs;
  c->wrelease = release;
  c->wrelease_arg = release_arg;
  conn_enter(c, CONN_WRITING);
  req_record(r, status, 1);
  conn_update_reading(c);

  c->wnb = nb;
  c->wfirst = 0;
  if (failed) {
    write_done(c, 0);
    return;
  }
  /* The first slice (the whole of most answers) goes to the socket now, without a write request;
   * the rest a slice a loop iteration, through the pace check, or all of it from the bulk thread.
   */
  if (write_advance(c, sent)) {
    write_done(c, 1);
    return;
  }
  if (answer_to_bulk(c))
    return;
  uv_buf_t part[WRITE_SLICE_BUFS];
  unsigned np;
  slice_bufs(c, part, &np);
  int w = uv_try_write(&c->io.stream, part, np);
  if (w < 0 && w != UV_EAGAIN)
    write_done(c, 0);
  else if (write_advance(c, w > 0 ? (size_t)w : 0))
    write_done(c, 1);
  else
    pace_add(c);
}

void dsv4_respond(dsv4_req_t *pub, int status, const char *content_type, const dsv4_hdr_t *extra,
                  size_t n_extra, const uv_buf_t *body, size_t n_body, void (*release)(void *),
                  void *release_arg) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_DISPATCHED);
  conn_t *c = r->conn;
  if (!c || c->state == CONN_CLOSING) {
    respond_gone(c, r, status, release, release_arg);
    return;
  }
  size_t total = 0;
  for (size_t i = 0; i < n_body; i++)
    total += body[i].len;
  int no_body = status < 200 || status == 204 || status == 304;
  int keep = conn_keeps(c, r->keep_alive);
  size_t n = 0;
  char *h = response_head(c->srv->instance, r->http_minor, status, content_type, extra, n_extra,
                          !no_body, total, keep, &n);
  respond_start(c, r, status, h, n, body, n_body, pub->method != DSV4_HTTP_HEAD && !no_body, keep,
                release, release_arg, 0, 0);
}

/* ---- answers written by another thread ------------------------------------------------------ */

int dsv4_direct_open(dsv4_req_t *pub, size_t max_bytes, dsv4_direct_t *dw) {
  req_t *r = req_of(pub);
  conn_t *c = r->conn;
  uv_os_fd_t fd;
  *dw = (dsv4_direct_t){.fd = -1};
  if (!c || c->state != CONN_HANDLING || c->srv->draining || pub->method == DSV4_HTTP_HEAD ||
      max_bytes == 0 || uv_stream_get_write_queue_size(&c->io.stream) > 0 ||
      uv_fileno(&c->io.handle, &fd) != 0)
    return -1;
  /* The duplicate keeps the socket open for the other thread even if the loop closes the
   * connection meanwhile (a reset, the server closing): no other connection can get its number.
   * At most DSV4_DIRECT_MAX of them at once, so that the descriptors FD_RESERVE keeps for
   * everything else stay there however many batches are queued. */
  int dup_fd = dup_counted(&direct_fds, DSV4_DIRECT_MAX, fd);
  if (dup_fd < 0)
    return -1;
#ifdef DSV4_TEST_BROKEN_DIRECT_NO_DUP
  close(dup_fd);
  dup_fd = fd; /* broken on purpose: the number the loop closes and the next accept reuses */
#endif
  r->direct = true;
  *dw = (dsv4_direct_t){.fd = dup_fd,
                        .keep = conn_keeps(c, r->keep_alive),
                        .http_minor = r->http_minor,
                        .max_bytes = max_bytes};
  snprintf(dw->instance, sizeof(dw->instance), "%s", c->srv->instance);
  return 0;
}

size_t dsv4_direct_write(dsv4_direct_t *dw, int status, const char *content_type,
                         const uv_buf_t *body, size_t n_body) {
  if (dw->fd < 0 || dw->head)
    return 0;
  uint64_t total = 0;
  for (size_t i = 0; i < n_body; i++)
    total += body[i].len;
  dw->head = response_head(dw->instance, dw->http_minor, status, content_type, NULL, 0, 1, total,
                           dw->keep, &dw->head_len);
  if (!dw->head)
    return 0;
  struct iovec iov[WRITE_SLICE_BUFS];
  const uint64_t whole = dw->head_len + total;
  size_t room = whole <= dw->max_bytes             ? (size_t)whole
                : dw->max_bytes < DSV4_DIRECT_PART ? dw->max_bytes
                                                   : DSV4_DIRECT_PART,
         k = 0;
  iov[k].iov_base = dw->head;
  iov[k].iov_len = dw->head_len < room ? dw->head_len : room;
  room -= iov[k++].iov_len;
  for (size_t i = 0; i < n_body && room > 0 && k < WRITE_SLICE_BUFS; i++) {
    iov[k].iov_base = body[i].base;
    iov[k].iov_len = body[i].len < room ? body[i].len : room;
    room -= iov[k++].iov_len;
  }
  struct msghdr m = {.msg_iov = iov, .msg_iovlen = k};
  ssize_t w = sendmsg(dw->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (w < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      dw->err = -errno;
    return 0;
  }
  dw->written = (size_t)w;
  dw->t_written_ns = uv_hrtime();
  return dw->written;
}

void dsv4_respond_direct(dsv4_req_t *pub, dsv4_direct_t *dw, int status, const char *content_type,
                         const uv_buf_t *body, size_t n_body, void (*release)(void *),
                         void *release_arg) {
  if (!dw->written && !dw->err) {
    dsv4_direct_close(dw);
    dsv4_respond(pub, status, content_type, NULL, 0, body, n_body, release, release_arg);
    return;
  }
  req_t *r = req_of(pub);
  assert(r->state == REQ_DISPATCHED);
  conn_t *c = r->conn;
  char *h = dw->head;
  size_t n = dw->head_len, sent = dw->written;
  int keep = dw->keep, failed = dw->err != 0;
  r->t_sent_ns = dw->t_written_ns; /* the log line's duration: until the answer went */
  dw->head = NULL;
  dsv4_direct_close(dw);
  if (!c || c->state == CONN_CLOSING) {
    free(h);
    r->bytes_out = sent; /* what went before the connection did */
    respond_gone(c, r, status, release, release_arg);
    return;
  }
  respond_start(c, r, status, h, n, body, n_body, 1, keep, release, release_arg, sent, failed);
}

void dsv4_direct_close(dsv4_direct_t *dw) {
  if (dw->fd >= 0) {
#ifndef DSV4_TEST_BROKEN_DIRECT_NO_DUP
    close(dw->fd);
#endif
    atomic_fetch_sub(&direct_fds, 1);
  }
  dw->fd = -1;
  free(dw->head);
  dw->head = NULL;
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
  if (!c || c->state == CONN_CLOSING) {
    r->stream_failed = 1;
    return DSV4_EIO;
  }
  r->keep_alive = conn_keeps(c, r->keep_alive);
  size_t n = 0;
  char *h = response_head(c->srv->instance, r->http_minor, status, content_type, extra, n_extra, 1,
                          content_length, r->keep_alive, &n);
  if (!h) {
    r->stream_failed = 1;
    return DSV4_ENOMEM;
  }
  c->whdr = h;
  c->sbufs[0] = uv_buf_init(h, (unsigned)n);
  conn_enter(c, CONN_STREAMING); /* no reading while it streams: one request in flight */
  conn_update_reading(c);
  return 0;
}

int dsv4_respond_stream_write(dsv4_req_t *pub, const uv_buf_t *buf, dsv4_stream_cb cb, void *arg) {
  req_t *r = req_of(pub);
  assert(r->state == REQ_STREAMING);
  conn_t *c = r->conn;
  if (r->stream_failed || !c || c->state == CONN_CLOSING)
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
  c->stream_pending = true;
  c->wreq.data = c;
  /* uv_write tries the socket at once and queues the rest; its callback is always deferred, so
   * the caller's callback never runs inside this call. */
  if (uv_write(&c->wreq, &c->io.stream, bufs, (unsigned)nb, on_write) != 0) {
    c->stream_pending = false;
    r->stream_failed = 1;
    return DSV4_EIO;
  }
  conn_enter(c, CONN_WRITING);
  return 0;
}

/* A streamed piece has been written (status 0) or failed; runs the caller's callback. */
static void stream_piece_done(conn_t *c, int status) {
  req_t *r = c->req;
  c->stream_pending = false;
  if (!r)
    return; /* the stream was ended while this piece was queued: the connection has closed */
  assert(r->state == REQ_STREAMING);
  if (status == 0) {
    if (!r->stream_hdr_sent) {
      r->bytes_out += c->sbufs[0].len;
      r->stream_hdr_sent = 1;
    }
    r->bytes_out += c->sbufs[1].len;
    r->stream_sent += c->sbufs[1].len;
    conn_enter(c, CONN_STREAMING);
  } else {
    /* The client went away or stalled past write_timeout_ms: the answer cannot complete. */
    r->stream_failed = 1;
    r->gone = 1;
    if (c->state != CONN_CLOSING)
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
  conn_enter(c, CONN_HEAD);
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
  case HTTP_PUT:
    return DSV4_HTTP_PUT;
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
  else if (chunked || ((q->method == DSV4_HTTP_POST || q->method == DSV4_HTTP_PUT) && !has_len))
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
    return -1; /* conn_fail answers with Connection: close */
  }
  if (r->content_length > 0) {
    /* A multiple of the alignment, as aligned_alloc takes (C11 7.22.3.1), and room for the skew
     * (body_place). */
    r->skew_pending = rt->body_skew && r->content_length >= 8;
    size_t n = (((size_t)r->content_length + 63) & ~(size_t)63) + (r->skew_pending ? 64 : 0);
    r->body_base = r->body_alloc ? r->body_alloc(r->body_alloc_arg, n) : aligned_alloc(64, n);
    q->body = r->body_base;
    if (!q->body) {
      early_error(r, DSV4_ENOMEM, "cannot allocate the request body");
      return -1;
    }
    if (rt->watch)
      r->watch = rt->watch->begin(rt->ctx, (size_t)r->content_length);
    const char *expect = dsv4_req_header(q, "Expect");
    if (expect && strcasecmp(expect, "100-continue") == 0)
      send_continue(c);
    conn_enter(c, CONN_BODY);
  }
  return 0;
}

/*
 * The body's place, once its first 8 bytes are here (the received ones and those n at *at): its
 * route's body_skew past the allocation's start. The fewer than 8 bytes received so far move, and
 * the n at *at with them when a read put them right after (on_alloc offers at most the first 8
 * bytes while the place is open, so at most 8 bytes move); *at then follows them.
 */
static void body_place(req_t *r, const char **at, size_t n) {
  uint8_t head[8];
  const size_t have = r->body_received;
  memcpy(head, r->pub.body, have);
  memcpy(head + have, *at, 8 - have);
  const size_t skew = r->route->body_skew(head) & 63;
  r->skew_pending = false;
  if (skew == 0)
    return;
  const int inside = (const uint8_t *)*at == r->pub.body + have;
  memmove(r->body_base + skew, r->pub.body, have + (inside ? n : 0));
  r->pub.body = r->body_base + skew;
  if (inside)
    *at = (const char *)r->pub.body + have;
}

static int on_body(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = conn_of(p);
  req_t *r = c->req;
  if (r->body_received + n > r->content_length)
    return -1;
  if (r->skew_pending && r->body_received + n >= 8)
    body_place(r, &at, n);
  uint8_t *dst = r->pub.body + r->body_received;
  /* Reads during the body go straight into the body buffer (see on_alloc); copy only otherwise. */
  if ((const uint8_t *)at != dst)
    memcpy(dst, at, n);
  r->body_received += n;
  if (r->watch && !r->skew_pending)
    r->route->watch->seen(r->watch, r->pub.body, r->body_received);
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
  conn_enter(c, CONN_HANDLING);
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
  dispatch(c);
}

/* Parse data; returns how many bytes were consumed (the rest waits for the current request). */
/* Scan the next bytes of a request head (head_scan_t); true when a line is folded. Stops at the
 * empty line that ends the head; lines ending in a bare LF count as lines, as llhttp reads them. */
static bool head_folded(head_scan_t *hs, const char *p, size_t n) {
  for (size_t i = 0; i < n && !hs->done; i++) {
    char ch = p[i];
    if (ch == '\n') {
      if (hs->at == LINE_TEXT)
        hs->lines++;
      else if (hs->lines > 0)
        hs->done = true; /* empty lines before the request line are skipped, as llhttp does */
      hs->at = LINE_START;
    } else if (hs->at == LINE_START && (ch == ' ' || ch == '\t') && hs->lines > 0) {
      return true;
    } else {
      hs->at = ch == '\r' && hs->at == LINE_START ? LINE_CR : LINE_TEXT;
    }
  }
  return false;
}

typedef enum {
  PARSED_MORE,     /* every byte taken; the request, if one began, is still arriving */
  PARSED_REQUEST,  /* a request is complete; the bytes after it wait for its answer */
  PARSED_MALFORMED /* the request cannot go on; every byte counts as taken */
} parsed_t;

/* Parse data into the current request; *used is how many bytes it took, *why says what was
 * malformed. Nothing is answered here: the caller first accounts for the bytes, so that an answer
 * knows whether more requests are buffered behind this one. */
static parsed_t conn_parse(conn_t *c, const char *data, size_t len, size_t *used,
                           const char **why) {
  *used = len;
  if ((c->state == CONN_IDLE || c->state == CONN_HEAD) && head_folded(&c->scan, data, len)) {
    *why = "obsolete line folding in a header";
    return PARSED_MALFORMED;
  }
  llhttp_errno_t e = llhttp_execute(&c->parser, data, len);
  if (e == HPE_OK)
    return PARSED_MORE;
  if (e == HPE_PAUSED) {
    *used = (size_t)(llhttp_get_error_pos(&c->parser) - data);
    llhttp_resume(&c->parser);
    return PARSED_REQUEST;
  }
  *why = llhttp_get_error_reason(&c->parser);
  return PARSED_MALFORMED;
}

/* Act on what conn_parse found: hand a complete request over, or answer a malformed one. */
static void conn_parsed(conn_t *c, parsed_t p, const char *why) {
  if (p == PARSED_REQUEST) {
    dispatch(c);
  } else if (p == PARSED_MALFORMED) {
    char msg[96];
    snprintf(msg, sizeof(msg), "malformed request: %s", why);
    conn_fail(c, DSV4_EINVAL, msg);
  }
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
  if (c->in_process)
    return;
  c->in_process = true;
  /* Only between answers: a pipelined request waits in rbuf until the one before it is answered. */
  while ((c->state == CONN_IDLE || c->state == CONN_HEAD || c->state == CONN_BODY) &&
         c->rbuf_off < c->rbuf_len) {
    size_t used;
    const char *why = NULL;
    c->exec_arrived_ns = rbuf_arrival(c);
    parsed_t p = conn_parse(c, c->rbuf + c->rbuf_off, c->rbuf_len - c->rbuf_off, &used, &why);
    c->rbuf_off += used;
    conn_parsed(c, p, why);
    c->exec_arrived_ns = 0;
  }
  if (c->rbuf_off == c->rbuf_len)
    c->rbuf_off = c->rbuf_len = 0;
  c->in_process = false;
  conn_update_reading(c);
}

/* ---- reading -------------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  (void)suggested;
  conn_t *c = h->data;
  req_t *r = c->req;
  c->read_into_body = false;
  if (c->state == CONN_BODY && c->rbuf_off == c->rbuf_len && r->body_received < r->content_length) {
    /* Mid-body with nothing buffered: read straight into the body buffer, at most what is left of
     * it and a slice, so the bytes of a large body are copied once, by the kernel. */
    size_t left = (size_t)r->content_length - r->body_received;
    if (r->skew_pending) /* the first 8 bytes alone, which say where the body goes */
      left = 8 - r->body_received;
    *buf = uv_buf_init((char *)r->pub.body + r->body_received,
                       (unsigned)(left < c->srv->io_slice ? left : c->srv->io_slice));
    c->read_into_body = true;
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
  const size_t room = c->rbuf_cap - c->rbuf_len;
  *buf = uv_buf_init(c->rbuf + c->rbuf_len,
                     (unsigned)(room < READ_HEAD_OFFER ? room : READ_HEAD_OFFER));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = st->data;
  if (c->state == CONN_CLOSING)
    return;
  if (nread == 0)
    return;
  if (nread < 0) {
    req_t *r = c->req;
    if (c->state == CONN_LINGERING || !r || r->state == REQ_PARSING || nread != UV_EOF) {
      /* Idle, mid-request (no handler was called) or a reset: nothing more can be answered. */
      conn_close(c);
      return;
    }
    /* EOF while the handler works or the response is written: the client has gone away (most
     * clients never half-close). Answer anyway; the connection closes afterwards. */
    c->peer_eof = true;
    r->gone = 1;
    conn_update_reading(c);
    return;
  }
  if (c->state == CONN_LINGERING) {
    c->rbuf_off = c->rbuf_len = 0;
    return;
  }
  if (c->read_into_body) {
    c->read_into_body = false;
    size_t used; /* all of it: on_alloc offered no more than the body still missing */
    const char *why = NULL;
    parsed_t p = conn_parse(c, buf->base, (size_t)nread, &used, &why);
    conn_parsed(c, p, why);
    conn_process(c);
    if (c->state == CONN_BODY && (size_t)nread == c->srv->io_slice && c->reading && !c->pace_due) {
      /* A whole slice: the next waits for the pace check (libuv would read again at once). A
       * shorter read that filled its offer either ended the body or was the first 8 bytes that
       * place it (on_alloc), which should not cost the body a loop iteration. */
      uv_read_stop(&c->io.stream);
      c->reading = false;
      c->read_paced = true;
      pace_add(c);
    }
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

/* ---- the bulk thread's transfers (bulk_io_bytes) ------------------------------------------- */

static void on_conn_handle_closed(uv_handle_t *h);

/* A transfer of the bulk thread is over: the reference it held on c goes (c may be freed). */
static void conn_unref(conn_t *c) {
  on_conn_handle_closed(&c->io.handle);
}

/* Hand bufs[0 .. nb) of c to the bulk thread: its socket's duplicate (within DSV4_BULK_MAX) and a
 * reference on c until cb. Returns whether it went. */
static bool bulk_start(conn_t *c, int writing, uv_buf_t *bufs, size_t nb,
                       void (*cb)(dsv4_bulk_job_t *)) {
  uv_os_fd_t fd;
  dsv4_bulk_job_t *j = &c->bulk;
  if (uv_fileno(&c->io.handle, &fd) != 0 || (j->fd = dup_counted(&bulk_fds, DSV4_BULK_MAX, fd)) < 0)
    return false;
  j->writing = writing;
  if (writing)
    j->seen = NULL;
  j->bufs = bufs;
  j->nb = nb;
  j->cb = cb;
  j->data = c;
  if (dsv4_bulk_submit(c->srv->bulk, j) != 0) {
    close(j->fd);
    atomic_fetch_sub(&bulk_fds, 1);
    return false;
  }
  c->bulk_out = true;
  c->handles_open++;
  return true;
}

/* The job is back (its duplicate closed): count its bytes. */
static void bulk_returned(conn_t *c, const char *direction) {
  atomic_fetch_sub(&bulk_fds, 1);
  c->bulk_out = false;
  dsv4_metric_add(c->srv->bulk_bytes, &direction, (double)c->bulk.done);
}

/* The rest of a body, read by the bulk thread, is in place: the parser takes it as read (on_body
 * copies nothing, the bytes being where it would put them), and the request goes on. */
static void on_bulk_read(dsv4_bulk_job_t *j) {
  conn_t *c = j->data;
  bulk_returned(c, "in");
  if (c->state == CONN_CLOSING) {
    if (c->req && c->req->state == REQ_PARSING) { /* conn_close left it to us */
      req_free(c->req);
      c->req = NULL;
    }
  } else if (j->err == 0) {
    req_t *r = c->req;
    size_t used;
    const char *why = NULL;
    parsed_t p = conn_parse(c, (const char *)r->pub.body + r->body_received, j->done, &used, &why);
    conn_parsed(c, p, why);
    conn_process(c);
  } else if (c->bulk_timed_out && j->err == UV_ECANCELED) {
    conn_fail(c, DSV4_ETIMEDOUT, "request body stalled");
  } else {
    conn_close(c); /* the end, or a reset, mid-body: nothing can be answered (as in on_read) */
  }
  c->bulk_timed_out = false;
  conn_unref(c);
}

/* Bulk thread: the watcher learns of each read as the loop's on_body would tell it. */
static void on_bulk_seen(dsv4_bulk_job_t *j) {
  const req_t *r = ((conn_t *)j->data)->bulk_req;
  r->route->watch->seen(r->watch, r->pub.body, r->body_received + j->done);
}

/* A body whose rest is bulk_min bytes or more goes to the bulk thread, once its place is known
 * and no byte of it waits in rbuf. Returns whether it went. */
static bool body_to_bulk(conn_t *c) {
  const dsv4_server_t *s = c->srv;
  req_t *r = c->req;
  if (!s->bulk || c->bulk_out || !r || r->skew_pending || c->rbuf_off != c->rbuf_len ||
      r->content_length - r->body_received < s->bulk_min)
    return false;
  c->bulk_buf.base = (char *)r->pub.body + r->body_received;
  c->bulk_buf.len = (size_t)(r->content_length - r->body_received);
  /* What on_bulk_seen reads, set before the job goes (bulk_start hands it over under a lock). */
  c->bulk_req = r;
  c->bulk.seen = r->watch ? on_bulk_seen : NULL;
  if (!bulk_start(c, 0, &c->bulk_buf, 1, on_bulk_read))
    return false;
  if (c->reading) {
    uv_read_stop(&c->io.stream);
    c->reading = false;
  }
  return true;
}

static void on_bulk_write(dsv4_bulk_job_t *j) {
  conn_t *c = j->data;
  bulk_returned(c, "out");
  write_done(c, j->err == 0);
  conn_unref(c);
}

/* An answer whose rest is bulk_min bytes or more goes to the bulk thread (the write timer keeps
 * running: it bounds the whole answer). Returns whether it went. */
static bool answer_to_bulk(conn_t *c) {
  const dsv4_server_t *s = c->srv;
  /* Bytes the loop has queued on the socket (an interim 100 Continue) go first, from the loop. */
  if (!s->bulk || uv_stream_get_write_queue_size(&c->io.stream) > 0)
    return false;
  size_t left = 0;
  for (size_t i = c->wfirst; i < c->wnb; i++)
    left += c->wbufs[i].len;
  return left >= s->bulk_min &&
         bulk_start(c, 1, c->wbufs + c->wfirst, c->wnb - c->wfirst, on_bulk_write);
}

static void conn_update_reading(conn_t *c) {
  bool want;
  switch (c->state) {
  case CONN_CLOSING:
    return;
  case CONN_LINGERING:
    want = true;
    break;
  case CONN_WRITING:
  case CONN_STREAMING:
    want = false;
    break;
  case CONN_HANDLING:
    want = !c->peer_eof && c->rbuf_len - c->rbuf_off < INFLIGHT_READ_CAP;
    break;
  default:
    want = !c->peer_eof && !c->read_paced && !c->bulk_out;
    break;
  }
  if (want && c->state == CONN_BODY && body_to_bulk(c))
    want = false;
  if (want && !c->reading) {
    if (uv_read_start(&c->io.stream, on_alloc, on_read) == 0)
      c->reading = true;
  } else if (!want && c->reading) {
    uv_read_stop(&c->io.stream);
    c->reading = false;
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
  s->n_closing--; /* every connection closes through CONN_CLOSING */
  dsv4_series_add(s->connections, -1);
  /* A streamed answer abandoned between pieces leaves its head here (write_done frees it else). */
  free(c->whdr);
  free(c->wbufs);
  free(c->rbuf);
  free(c);
  server_maybe_done(s);
}

static void conn_close(conn_t *c) {
  if (c->state == CONN_CLOSING)
    return;
  conn_enter(c, CONN_CLOSING);
  req_t *r = c->req;
  if (c->bulk_out) /* its callback comes soon, and frees what the job held */
    dsv4_bulk_cancel(c->srv->bulk, &c->bulk);
  if (r && r->state == REQ_PARSING) {
    /* Disconnected mid-request: the handler never saw it, so it is simply dropped (once the bulk
     * thread no longer writes into its body). */
    if (!c->bulk_out) {
      req_free(r);
      c->req = NULL;
    }
  } else if (r &&
             (r->state == REQ_DISPATCHED || (r->state == REQ_STREAMING && !c->stream_pending))) {
    /* The handler still owns the request and will respond (or end its stream); that only frees
     * it. A streamed piece in flight is cancelled by uv_close, and its callback detaches. A
     * duplicate held for its answer would keep the socket open past uv_close: shut it down now,
     * so that the client sees the end at once and the other thread's write fails. */
    uv_os_fd_t fd;
    if (r->direct && uv_fileno(&c->io.handle, &fd) == 0)
      shutdown(fd, SHUT_RDWR);
    r->conn = NULL;
    r->gone = 1;
    r->stream_failed = 1;
    c->req = NULL;
  }
  /* A request being written is freed by the write callback, which uv_close cancels first; one
   * whose next slice waits for the pace check has none in flight, and is freed here. A body
   * whose reading waits for it is the request's, freed above. */
  if (pace_remove(c) && !c->read_paced)
    write_done(c, 0);
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
  dsv4_series_add(s->connections, 1);
}

/* A connection whose stream could not be set up: close and free it through the usual path. */
static void conn_abandon(dsv4_server_t *s, conn_t *c) {
  conn_link(s, c, 1);
  conn_enter(c, CONN_CLOSING); /* touches no timer: this one was never initialised */
  uv_close(&c->io.handle, on_conn_handle_closed);
}

/* An episode of refusals ends at the first connection taken this long after the last refusal, so a
 * daemon that hovers at its limit logs once, not at every connection that comes and goes. */
#define REFUSAL_QUIET_MS 10000

/* n connections were refused for why: count them, and log when an episode of refusals begins. */
static void refused(dsv4_server_t *s, refusing_t why, uint64_t n) {
  const char *reason = why == REFUSING_LIMIT ? "max_connections" : "fd_limit";
  dsv4_metric_add(s->rejected_total, &reason, (double)n);
  uint64_t now = uv_now(s->loop);
  if (s->refusing != why) {
    struct rlimit rl;
    uint64_t limit = s->max_connections;
    if (why == REFUSING_FDS)
      limit = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (uint64_t)rl.rlim_cur : 0;
    dsv4_logp(DSV4_LOG_WARN, "refusing connections", "{s:s,s:s,s:I,s:I}", "listener", s->name,
              "reason", reason, why == REFUSING_LIMIT ? "max_connections" : "rlimit_nofile",
              (json_int_t)limit, "connections", (json_int_t)s->n_conns);
    s->refusing = why;
    s->refused_in_episode = 0;
    s->episode_start_ms = now;
  }
  s->refused_in_episode += n;
  s->last_refusal_ms = now;
}

/* A connection is being served: an episode of refusals that has gone quiet is over. */
static void accepting(dsv4_server_t *s) {
  uint64_t now = uv_now(s->loop);
  if (s->refusing == REFUSING_NONE || now - s->last_refusal_ms < REFUSAL_QUIET_MS)
    return;
  dsv4_logp(DSV4_LOG_INFO, "accepting connections again", "{s:s,s:s,s:I,s:I}", "listener", s->name,
            "reason", s->refusing == REFUSING_LIMIT ? "max_connections" : "fd_limit", "refused",
            (json_int_t)s->refused_in_episode, "episode_ms",
            (json_int_t)(s->last_refusal_ms - s->episode_start_ms));
  s->refusing = REFUSING_NONE;
}

/* Answer 503 too_many_connections at once, without reading a request, and close the way every
 * closing answer does (lingering), so that the client reads the answer rather than a reset. */
static void conn_refuse(conn_t *c) {
  const refusal_t *a = &c->srv->refusal_limit;
  uv_buf_t b = uv_buf_init(a->text, (unsigned)a->len);
  refused(c->srv, REFUSING_LIMIT, 1);
  /* A fresh socket's send buffer takes a few hundred bytes whole. */
  if (uv_try_write(&c->io.stream, &b, 1) != (int)a->len) {
    conn_close(c);
    return;
  }
  conn_linger(c);
}

static void conn_start(dsv4_server_t *s, conn_t *c) {
  uv_timer_init(s->loop, &c->timer);
  conn_link(s, c, 2);
  if (s->closing) {
    conn_close(c);
    return;
  }
  if (s->max_connections && s->n_conns - s->n_closing > s->max_connections) {
    conn_refuse(c);
    return;
  }
  accepting(s);
  conn_enter(c, CONN_IDLE);
  conn_update_reading(c);
}

static void peer_name(conn_t *c, const struct sockaddr_storage *peer) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (peer->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)peer;
    uv_ip6_name(a, ip, sizeof(ip));
    snprintf(c->peer, sizeof(c->peer), "[%s]:%d", ip, ntohs(a->sin6_port));
  } else if (peer->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)peer;
    uv_ip4_name(a, ip, sizeof(ip));
    snprintf(c->peer, sizeof(c->peer), "%s:%d", ip, ntohs(a->sin_port));
  }
}

/* Serve a socket accept4 returned (non-blocking already). */
static void serve_accepted(listener_t *l, int fd, const struct sockaddr_storage *peer) {
  dsv4_server_t *s = l->srv;
  conn_t *c = conn_new(s);
  if (!c) {
    close(fd);
    return;
  }
  int rc;
  if (l->path) {
    uv_pipe_init(s->loop, &c->io.pipe, 0);
    c->io.handle.data = c;
    rc = uv_pipe_open(&c->io.pipe, fd);
  } else {
    uv_tcp_init(s->loop, &c->io.tcp);
    c->io.handle.data = c;
    rc = uv_tcp_open(&c->io.tcp, fd);
  }
  if (rc != 0) {
    close(fd); /* the handle never owned it */
    conn_abandon(s, c);
    return;
  }
  if (l->path) /* a Unix peer has no address worth logging: its listener names it */
    snprintf(c->peer, sizeof(c->peer), "unix");
  else {
    uv_tcp_nodelay(&c->io.tcp, 1);
    peer_name(c, peer);
  }
  conn_start(s, c);
}

static void on_listener_readable(uv_poll_t *p, int status, int events);

static void on_retry(uv_timer_t *t) {
  dsv4_server_t *s = t->data;
  for (size_t i = 0; i < s->n_listeners; i++)
    if (s->listeners[i].open == 1)
      uv_poll_start(&s->listeners[i].poll, UV_READABLE, on_listener_readable);
}

/* Stop accepting for a while: waiting connections stay in the kernel's queue (not reset), and the
 * loop does not spin on a listener it cannot empty. */
#define ACCEPT_PAUSE_MS 100

static void accept_pause(dsv4_server_t *s) {
  /* Every listener pauses: the shortage (descriptors, kernel memory) is the process's. */
  for (size_t i = 0; i < s->n_listeners; i++)
    if (s->listeners[i].open == 1)
      uv_poll_stop(&s->listeners[i].poll);
  uv_timer_start(&s->retry, on_retry, ACCEPT_PAUSE_MS, 0);
}

/*
 * accept4 failed with EMFILE or ENFILE. Each waiting connection is taken with the descriptor the
 * spare frees, told 503 too_many_connections as far as one non-blocking send goes, and closed at
 * once (there is no descriptor to linger with, so a request the client already sent may turn the
 * close into a reset). Without a spare (another thread took the freed one) accepting pauses.
 */
static void refuse_at_fd_limit(listener_t *l) {
  dsv4_server_t *s = l->srv;
  if (s->spare_fd < 0)
    s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (s->spare_fd < 0) {
    refused(s, REFUSING_FDS, 0);
    accept_pause(s);
    return;
  }
  close(s->spare_fd);
  s->spare_fd = -1;
  uint64_t n = 0;
  for (int i = 0; i < ACCEPT_BATCH; i++) {
    int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EINTR || errno == ECONNABORTED))
      continue;
    if (fd < 0)
      break;
    ssize_t k = send(fd, s->refusal_fds.text, s->refusal_fds.len, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)k; /* best effort: the count and the log line do not depend on it */
    close(fd);
    n++;
  }
  refused(s, REFUSING_FDS, n);
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* Take up to ACCEPT_BATCH waiting connections; true when the batch was full (more may wait). */
static bool accept_batch(listener_t *l) {
  for (int i = 0; i < ACCEPT_BATCH && l->open == 1; i++) {
    struct sockaddr_storage peer;
    socklen_t len = sizeof(peer);
    int fd = accept4(l->fd, (struct sockaddr *)&peer, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      serve_accepted(l, fd, &peer);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED)
      continue;
    if (errno == EMFILE || errno == ENFILE)
      refuse_at_fd_limit(l);
    else if (errno != EAGAIN && errno != EWOULDBLOCK)
      accept_pause(l->srv); /* ENOBUFS, ENOMEM: the kernel is short; try again shortly */
    return false;
  }
  return l->open == 1;
}

static void on_listener_readable(uv_poll_t *p, int status, int events) {
  listener_t *l = p->data;
  (void)events;
  if (status < 0)
    accept_pause(l->srv);
  else
    accept_batch(l); /* a batch at a time: the listener stays readable while more wait */
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
  if (s->spare_fd >= 0)
    close(s->spare_fd);
  free(s->refusal_limit.text);
  free(s->refusal_fds.text);
  free(s->host);
  free(s->token);
  free(s->name);
  free(s->routes);
  for (size_t i = 0; i < LISTENERS; i++)
    free(s->listeners[i].path);
  free(s);
}

static void on_bulk_closed(void *arg) {
  dsv4_server_t *s = arg;
  s->bulk_open = 0;
  server_maybe_done(s);
}

static void server_maybe_done(dsv4_server_t *s) {
  if (!s->closing || s->retry_open || s->pace_open || s->n_conns > 0)
    return;
  for (size_t i = 0; i < s->n_listeners; i++)
    if (s->listeners[i].open)
      return;
  if (s->bulk_open == 1) { /* every connection is gone, and with them the bulk thread's jobs */
    s->bulk_open = 2;
    dsv4_bulk_close(s->bulk, on_bulk_closed, s);
  }
  if (s->bulk_open)
    return;
  void (*cb)(void *) = s->close_cb;
  void *arg = s->close_arg;
  server_free(s);
  if (cb)
    cb(arg);
}

static void on_listener_closed(uv_handle_t *h) {
  listener_t *l = h->data;
  l->open = 0;
  server_maybe_done(l->srv);
}

static void on_retry_closed(uv_handle_t *h) {
  dsv4_server_t *s = h->data;
  s->retry_open = 0;
  server_maybe_done(s);
}

static void on_pace_closed(uv_handle_t *h) {
  dsv4_server_t *s = h->data;
  s->pace_open--;
  server_maybe_done(s);
}

void dsv4_unix_unlink_own(const char *path, dev_t dev, ino_t ino) {
  struct stat st;
  if (path && lstat(path, &st) == 0 && st.st_dev == dev && st.st_ino == ino)
    unlink(path);
}

/* Remove a Unix socket's file, unless another process has put a file of its own there since. */
static void unlink_own(const listener_t *l) {
  dsv4_unix_unlink_own(l->path, l->dev, l->ino);
}

static void close_listener(dsv4_server_t *s) {
  for (size_t i = 0; i < s->n_listeners; i++) {
    listener_t *l = &s->listeners[i];
    if (l->open != 1)
      continue;
    l->open = 2; /* closing */
    uv_close((uv_handle_t *)&l->poll, on_listener_closed);
    /* A socket may be closed as soon as its poll handle is closing (libuv's uv_poll docs). */
    close(l->fd);
    l->fd = -1;
    /* A client that finds no file is told at once that nothing listens, not refused later. */
    unlink_own(l);
  }
  if (s->retry_open == 1)
    uv_timer_stop(&s->retry);
}

size_t dsv4_server_default_max_connections(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY)
    return 0;
  size_t n = (size_t)rl.rlim_cur;
  size_t reserve = n / 2 < FD_RESERVE ? n / 2 : FD_RESERVE;
  return n - reserve > 0 ? n - reserve : 1;
}

/* The whole 503 too_many_connections answer with message msg; NULL when out of memory. */
static char *refusal_text(const dsv4_server_t *s, const char *msg, size_t *len) {
  json_t *doc = json_pack("{s:{s:s,s:s}}", "error", "code", dsv4_http_error(DSV4_ECONNLIMIT).code,
                          "message", msg);
  char *body = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  json_decref(doc);
  if (!body)
    return NULL;
  static const char fmt[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            "Content-Length: %zu\r\nDsv4d-Instance: %s\r\nConnection: close\r\n"
                            "Retry-After: 1\r\n\r\n%s";
  int n = snprintf(NULL, 0, fmt, strlen(body), s->instance, body);
  char *text = n > 0 ? malloc((size_t)n + 1) : NULL;
  if (text)
    snprintf(text, (size_t)n + 1, fmt, strlen(body), s->instance, body);
  free(body);
  *len = text ? (size_t)n : 0;
  return text;
}

/* The metric families this layer records into, and the answers it refuses connections with. */
static int server_prepare(dsv4_server_t *s, const dsv4_server_config_t *cfg) {
  dsv4_metrics_t *reg = cfg->metrics ? cfg->metrics : dsv4_metrics_default();
  static const char *const labels[2] = {"route", "code"};
  static const char *const reason[1] = {"reason"};
  dsv4_metric_t *gauge = NULL;
  if (!reg || dsv4_metrics_counter(reg, "dsv4d_requests_total",
                                   "HTTP requests answered, by route and status code.", labels, 2,
                                   &s->requests_total) != 0)
    return DSV4_ENOMEM;
  if (dsv4_metrics_gauge(reg, "dsv4d_connections", "Open HTTP connections, every listener.", NULL,
                         0, &gauge) != 0 ||
      dsv4_metric_series(gauge, NULL, &s->connections) != 0 ||
      dsv4_metrics_counter(reg, "dsv4d_connections_rejected_total",
                           "Connections refused with 503 too_many_connections, by reason.", reason,
                           1, &s->rejected_total) != 0)
    return DSV4_ENOMEM;
  /* Both series exist from the start, so a rate over them is defined before the first refusal. */
  static const char *const reasons[2] = {"max_connections", "fd_limit"};
  for (int i = 0; i < 2; i++)
    dsv4_metric_add(s->rejected_total, &reasons[i], 0);
  static const char *const direction[1] = {"direction"};
  if (dsv4_metrics_counter(reg, "dsv4d_bulk_bytes_total",
                           "Request body (in) and answer (out) bytes the bulk I/O thread moved "
                           "(bulk_io_bytes), by direction.",
                           direction, 1, &s->bulk_bytes) != 0)
    return DSV4_ENOMEM;
  static const char *const directions[2] = {"in", "out"};
  for (int i = 0; i < 2; i++)
    dsv4_metric_add(s->bulk_bytes, &directions[i], 0);
  char msg[128];
  snprintf(msg, sizeof(msg), "this listener serves at most %zu connections at once",
           s->max_connections);
  s->refusal_limit.text = refusal_text(s, msg, &s->refusal_limit.len);
  s->refusal_fds.text =
      refusal_text(s, "no file descriptor is left for a connection", &s->refusal_fds.len);
  if (!s->refusal_limit.text || !s->refusal_fds.text)
    return DSV4_ENOMEM;
  if (s->max_connections > dsv4_server_default_max_connections() &&
      dsv4_server_default_max_connections() > 0)
    dsv4_logp(DSV4_LOG_WARN, "max_connections is above what RLIMIT_NOFILE leaves for connections",
              "{s:s,s:I,s:I}", "listener", s->name, "max_connections",
              (json_int_t)s->max_connections, "fd_budget",
              (json_int_t)dsv4_server_default_max_connections());
  return 0;
}

/* A bound, listening, non-blocking socket for host:port; its descriptor, or -errno. */
static int listen_socket(const struct sockaddr_storage *addr) {
  int fd = socket(addr->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  int one = 1;
  socklen_t len =
      addr->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
  /* As libuv's uv_tcp_bind: a restarted daemon binds while old connections sit in TIME_WAIT. */
  if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      bind(fd, (const struct sockaddr *)addr, len) != 0 || listen(fd, 511) != 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  return fd;
}

/* Log why a listener cannot listen; DSV4_EIO, which tells the caller it was logged. */
static int unix_fail_as(const char *listener, const char *path, const char *why) {
  dsv4_logp(DSV4_LOG_ERROR, "cannot listen", "{s:s,s:s,s:s}", "listener", listener, "path", path,
            "error", why);
  return DSV4_EIO;
}

static int unix_fail(const char *path, const char *why) {
  return unix_fail_as("unix", path, why);
}

/* Whether a process listens on the socket file at addr (a socket of this type): a daemon still
 * running keeps its file. */
static bool unix_socket_live(const struct sockaddr_un *addr, int type) {
  int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return false;
  /* A Unix connect does not wait: it is refused at once when nothing listens. */
  bool live = connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) == 0 || errno == EAGAIN;
  close(fd);
  return live;
}

int dsv4_unix_listen(const char *listener, const char *path, int type, int *out_fd, dev_t *dev,
                     ino_t *ino) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof(addr.sun_path))
    return unix_fail_as(listener, path,
                        "the path is longer than a Unix socket address holds (107 bytes)");
  memcpy(addr.sun_path, path, strlen(path) + 1);
  char dir[sizeof(addr.sun_path)];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash)
    slash[slash == dir ? 1 : 0] = '\0'; /* the root keeps its slash */
  struct stat st;
  if (slash && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)))
    return unix_fail_as(listener, path, "the socket's directory does not exist");
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return unix_fail_as(listener, path, "the path exists and is not a socket");
    if (unix_socket_live(&addr, type))
      return unix_fail_as(listener, path, "another process listens on this socket");
    unlink(path); /* a stale socket: bind would fail with EADDRINUSE */
  }
  int fd = socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return unix_fail_as(listener, path, strerror(errno));
  if (bind(fd, (const struct sockaddr *)&addr, sizeof(addr)) != 0) {
    int err = errno;
    close(fd);
    return unix_fail_as(listener, path, strerror(err));
  }
  /* The mode is set before listen(), so no client connects through a wider one. */
  if (chmod(path, 0660) != 0 || lstat(path, &st) != 0 || listen(fd, 511) != 0) {
    int err = errno;
    close(fd);
    unlink(path);
    return unix_fail_as(listener, path, strerror(err));
  }
  *out_fd = fd;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return 0;
}

/*
 * A bound, listening Unix domain socket at path, mode 0660, into l; 0 or DSV4_EIO (logged). A
 * socket file left by a daemon that died is replaced; any other file there is refused, so a typo
 * never deletes a file of the operator's.
 */
static int unix_listen_socket(const char *path, listener_t *l) {
  int fd = -1;
  int rc = dsv4_unix_listen("unix", path, SOCK_STREAM, &fd, &l->dev, &l->ino);
  if (rc != 0)
    return rc;
  l->fd = fd;
  l->path = strdup(path);
  if (!l->path) {
    close(fd);
    unlink(path);
    l->fd = -1;
    return DSV4_ENOMEM;
  }
  return 0;
}

/* Bind and listen on the configured address and start polling for connections. */
static int server_listen(dsv4_server_t *s, const dsv4_server_config_t *cfg) {
  struct sockaddr_storage addr;
  memset(&addr, 0, sizeof(addr));
  int rc = uv_ip4_addr(s->host, cfg->port, (struct sockaddr_in *)&addr);
  if (rc != 0)
    rc = uv_ip6_addr(s->host, cfg->port, (struct sockaddr_in6 *)&addr);
  if (rc != 0)
    return DSV4_ECONFIG;
  int fd = listen_socket(&addr);
  if (fd >= 0 && (rc = uv_poll_init_socket(s->loop, &s->listeners[0].poll, fd)) != 0) {
    close(fd);
    fd = rc;
  }
  if (fd < 0) {
    dsv4_logp(DSV4_LOG_ERROR, "cannot listen", "{s:s, s:s, s:i, s:s}", "listener", s->name, "host",
              s->host, "port", cfg->port, "error", uv_strerror(fd));
    return DSV4_EIO;
  }
  s->listeners[0].fd = fd;
  s->listeners[0].open = 1;
  s->listeners[0].poll.data = &s->listeners[0]; /* before anything may close it */
  s->n_listeners = 1;
  struct sockaddr_storage bound;
  socklen_t len = sizeof(bound);
  getsockname(fd, (struct sockaddr *)&bound, &len);
  s->port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                        : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  if (cfg->unix_path && cfg->unix_path[0]) {
    listener_t *u = &s->listeners[1];
    rc = unix_listen_socket(cfg->unix_path, u);
    if (rc == 0 && (rc = uv_poll_init_socket(s->loop, &u->poll, u->fd)) != 0) {
      close(u->fd);
      unlink(u->path);
      rc = unix_fail(u->path, uv_strerror(rc));
    }
    if (rc != 0)
      return rc;
    u->open = 1;
    u->poll.data = u;
    s->n_listeners = 2;
  }
  uv_timer_init(s->loop, &s->retry);
  s->retry.data = s;
  s->retry_open = 1;
  uv_check_init(s->loop, &s->pace);
  uv_idle_init(s->loop, &s->pace_idle);
  s->pace.data = s->pace_idle.data = s;
  s->pace_open = 2;
  for (size_t i = 0; i < s->n_listeners; i++)
    uv_poll_start(&s->listeners[i].poll, UV_READABLE, on_listener_readable);
  return 0;
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
  for (size_t i = 0; i < LISTENERS; i++) {
    s->listeners[i].fd = -1;
    s->listeners[i].srv = s;
  }
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
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
  s->max_connections = cfg->max_connections;
  s->header_timeout_ms = cfg->header_timeout_ms;
  s->body_timeout_ms = cfg->body_timeout_ms;
  s->idle_timeout_ms = cfg->idle_timeout_ms;
  s->write_timeout_ms = cfg->write_timeout_ms;
  s->io_slice = cfg->io_slice_bytes ? cfg->io_slice_bytes : DEFAULT_IO_SLICE;
  s->on_complete = cfg->on_complete;
  s->on_complete_arg = cfg->on_complete_arg;
  if (cfg->body_alloc && cfg->body_free) {
    s->body_alloc = cfg->body_alloc;
    s->body_free = cfg->body_free;
    s->body_alloc_arg = cfg->body_alloc_arg;
  }
  int rc = server_prepare(s, cfg);
  if (rc != 0) {
    server_free(s);
    return rc;
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

  /* The server is freed here and now when no handle exists yet; once the TCP listener's does
   * (the Unix socket failed), closing it frees the server from the loop. */
  rc = server_listen(s, cfg);
  if (rc != 0 && s->n_listeners == 0) {
    server_free(s);
    return rc;
  }
  if (rc != 0) {
    s->closing = 1;
    close_listener(s);
    return rc;
  }
  /* Without its bulk thread the server still serves: the loop moves every body and answer. */
  s->bulk_min = cfg->bulk_io_bytes;
  if (s->bulk_min > 0) {
    if (dsv4_bulk_create(loop, s->io_slice, &s->bulk) == 0)
      s->bulk_open = 1;
    else
      dsv4_logp(DSV4_LOG_WARN, "no bulk I/O thread: the loop moves every body and answer", "{s:s}",
                "listener", s->name);
  }
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
  /* Connections the kernel has completed but this layer not yet taken would be reset with the
   * listening socket, requests and all: take them first; their first answer says close. */
  for (size_t i = 0; i < s->n_listeners; i++)
    if (s->listeners[i].open == 1)
      while (accept_batch(&s->listeners[i]))
        ;
  close_listener(s);
  /* No connection closes here: an idle one may have a request on its way. Re-entering the idle
   * state shortens its wait to DRAIN_IDLE_MS; every other one closes after its next answer. */
  for (conn_t *c = s->conns; c; c = c->next)
    if (c->state == CONN_IDLE)
      conn_enter(c, CONN_IDLE);
}

void dsv4_server_close(dsv4_server_t *s, void (*cb)(void *), void *arg) {
  if (s->closing)
    return;
  s->closing = 1;
  s->close_cb = cb;
  s->close_arg = arg;
  close_listener(s);
  if (s->retry_open == 1) {
    s->retry_open = 2;
    uv_close((uv_handle_t *)&s->retry, on_retry_closed);
  }
  for (conn_t *c = s->conns, *next; c; c = next) {
    next = c->next;
    conn_close(c);
  }
  if (s->pace_open == 2) { /* every connection is off its list now */
    uv_close((uv_handle_t *)&s->pace, on_pace_closed);
    uv_close((uv_handle_t *)&s->pace_idle, on_pace_closed);
  }
  /* The close callback always runs from the loop, never from inside this call. An answer waiting
   * for its next slice has its release callback run here (its connection has no write in flight
   * to run it later). */
}
