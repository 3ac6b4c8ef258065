/*
 * libFuzzer driver for the HTTP glue: each input is written as raw bytes into one end of a
 * socketpair whose other end the server serves as a connection (dsv4__server_adopt_fd), then the
 * writing side shuts down and the loop runs until the connection is gone. Routes answer at once,
 * from a timer, or with an error, so the asynchronous paths run too. Whatever comes back must be
 * whole HTTP/1.1 responses carrying Dsv4d-Instance, none after one that closes the connection.
 * One route watches its bodies as they arrive (dsv4_route_t.watch).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "http-internal.h"
#include "log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uv_loop_t *loop;
static dsv4_server_t *srv;

static void h_now(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  static char msg[] = "ok";
  uv_buf_t b = uv_buf_init(msg, 2);
  const char *x = dsv4_req_header(req, "x-echo");
  dsv4_hdr_t h = {"X-Echo", x ? x : ""};
  dsv4_respond(req, 200, "text/plain", &h, 1, &b, 1, NULL, NULL);
}

static void timer_closed(uv_handle_t *h) {
  free(h);
}

static void fire(uv_timer_t *t) {
  dsv4_req_t *req = t->data;
  if (dsv4_req_gone(req))
    dsv4_respond_error(req, DSV4_EQUEUE, NULL, NULL);
  else
    dsv4_respond_json(req, 200,
                      json_pack("{s:s, s:I}", "path", req->path, "n", (json_int_t)req->body_len));
  uv_close((uv_handle_t *)t, timer_closed);
}

static void h_later(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  uv_timer_t *t = malloc(sizeof(*t));
  uv_timer_init(loop, t);
  t->data = req;
  uv_timer_start(t, fire, 0, 0);
}

static void h_take(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  void *alloc = NULL;
  (void)dsv4_req_take_body(req, &alloc);
  free(alloc);
  dsv4_respond_error(req, DSV4_EPOSITION, "nope", json_pack("{s:i}", "expected", 3));
}

/* A route that places its bodies (body_skew) by their first byte, as the forward route does by
 * their first 8: the placement runs on whatever bytes arrive. The handler reads every byte. */
static size_t skew_of(const uint8_t *first8) {
  return first8[0] & 63;
}

/* Its bodies' watcher: each call's bytes read (ASan sees a read past what arrived only as past the
 * allocation, but a `have` beyond the body or going back aborts), freed by the handler or the
 * server. */
typedef struct {
  size_t len, have;
  const uint8_t *body;
} watch_t;

static void *watch_begin(void *ctx, size_t len) {
  (void)ctx;
  watch_t *w = calloc(1, sizeof(*w));
  if (w)
    w->len = len;
  return w;
}

static void watch_seen(void *wp, const uint8_t *body, size_t have) {
  watch_t *w = wp;
  if (have < w->have || have > w->len || (w->body && body != w->body))
    abort();
  volatile uint8_t acc = 0;
  for (size_t i = w->have; i < have; i++)
    acc ^= body[i];
  (void)acc;
  w->have = have;
  w->body = body;
}

static const dsv4_body_watch_t watch = {watch_begin, watch_seen, free};

static void h_skew(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  watch_t *w = dsv4_req_take_watch(req);
  if (w && (w->have != req->body_len || (req->body_len && w->body != req->body)))
    abort();
  free(w);
  unsigned sum = 0;
  for (size_t i = 0; i < req->body_len; i++)
    sum += req->body[i];
  dsv4_respond_json(req, 200, json_pack("{s:I}", "sum", (json_int_t)sum));
}

static const dsv4_route_t routes[] = {
    {DSV4_HTTP_GET | DSV4_HTTP_HEAD | DSV4_HTTP_POST, "/now", "now", 4096, 1, h_now, NULL, NULL,
     NULL},
    {DSV4_HTTP_GET | DSV4_HTTP_POST | DSV4_HTTP_DELETE, "/v1/later/", "later", 4096, 0, h_later,
     NULL, NULL, NULL},
    {DSV4_HTTP_POST, "/take", "take", 64, 0, h_take, NULL, NULL, NULL},
    {DSV4_HTTP_POST, "/skew", "skew", 4096, 0, h_skew, NULL, skew_of, &watch},
};

static void init(void) {
  loop = uv_default_loop();
  dsv4_log_set_level(DSV4_LOG_ERROR);
  dsv4_server_config_t cfg = {
      .host = "127.0.0.1",
      .port = 0,
      .max_header_bytes = 1024,
      .header_timeout_ms = 50,
      .body_timeout_ms = 50,
      .idle_timeout_ms = 50,
      .write_timeout_ms = 50,
      .bearer_token = "tok",
      .instance = "00000000000000000000000000000000",
      .name = "fuzz",
  };
  if (dsv4_server_create(loop, &cfg, routes, sizeof(routes) / sizeof(routes[0]), &srv) != 0)
    abort();
}

/* Whatever comes back is a run of whole HTTP/1.1 responses, each carrying Dsv4d-Instance, and
 * nothing follows one that says Connection: close: a request smuggled past a refused one (a folded
 * Content-Length, say) would be answered after it. */
static size_t check_output(const char *out, size_t n) {
  static const char instance[] = "\r\nDsv4d-Instance: 00000000000000000000000000000000\r\n";
  static const char close_hdr[] = "\r\nConnection: close\r\n";
  static const char length_hdr[] = "\r\nContent-Length: ";
  size_t at = 0, answers = 0;
  while (at < n) {
    const char *h = out + at;
    answers++;
    const char *end = memmem(h, n - at, "\r\n\r\n", 4);
    if (n - at < 9 || memcmp(h, "HTTP/1.1 ", 9) != 0 || !end)
      abort();
    size_t head = (size_t)(end - h) + 4;
    if (!memmem(h, head, instance, sizeof(instance) - 1))
      abort();
    int closes = memmem(h, head, close_hdr, sizeof(close_hdr) - 1) != NULL;
    const char *cl = memmem(h, head, length_hdr, sizeof(length_hdr) - 1);
    size_t body = cl ? (size_t)strtoull(cl + sizeof(length_hdr) - 1, NULL, 10) : 0;
    at += head;
    /* An answer to HEAD has a Content-Length and no body: nothing follows it, or the next answer
     * (no body here starts like a status line). */
    if (at == n || (n - at >= 9 && memcmp(out + at, "HTTP/1.1 ", 9) == 0))
      body = 0;
    if (body > n - at || (closes && at + body < n))
      abort();
    at += body;
  }
  return answers;
}

/*
 * An independent reading of RFC 9112 section 5.2 for an input whose first request head is plain
 * (it starts with a letter, its lines end in CR LF): when a line of that head starts with a blank,
 * the one answer must be a 400 that closes the connection, whatever follows.
 */
static int first_head_folded(const uint8_t *d, size_t n) {
  const uint8_t *end = memmem(d, n, "\r\n\r\n", 4);
  if (!end || !((d[0] >= 'A' && d[0] <= 'Z') || (d[0] >= 'a' && d[0] <= 'z')))
    return 0;
  size_t len = (size_t)(end - d) + 2;
  int folded = 0;
  for (size_t i = 1; i < len; i++) {
    if (d[i] != '\n')
      continue;
    if (d[i - 1] != '\r')
      return 0; /* a bare LF: lines may end where this reading does not see them */
    if (d[i + 1] == ' ' || d[i + 1] == '\t')
      folded = 1;
  }
  return folded;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!srv)
    init();
  if (size > 32768)
    return 0;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
    abort();
  if (dsv4__server_adopt_fd(srv, sv[0]) != 0)
    abort();
  size_t off = 0;
  static char out[1 << 20];
  size_t out_len = 0;
  int shut = 0, wrapped = 0;
  while (dsv4_server_connections(srv) > 0) {
    if (off < size) {
      ssize_t k = write(sv[1], data + off, size - off);
      if (k > 0)
        off += (size_t)k;
      else
        off = size; /* the server closed its end */
    }
    if (off == size && !shut) {
      shutdown(sv[1], SHUT_WR);
      shut = 1;
    }
    uv_run(loop, UV_RUN_ONCE);
    for (;;) {
      ssize_t k = read(sv[1], out + out_len, sizeof(out) - out_len - 1);
      if (k <= 0)
        break;
      out_len += (size_t)k;
      if (out_len >= sizeof(out) - 1) {
        out_len = 0;
        wrapped = 1; /* the output no longer starts at a response: it cannot be checked */
      }
    }
  }
  if (!wrapped) {
    size_t answers = check_output(out, out_len);
    if (first_head_folded(data, size) && (answers != 1 || memcmp(out, "HTTP/1.1 400 ", 13) != 0 ||
                                          !memmem(out, out_len, "\r\nConnection: close\r\n", 21)))
      abort();
  }
  close(sv[1]);
  /* Let the closed handles' callbacks run before the next input. */
  uv_run(loop, UV_RUN_NOWAIT);
  return 0;
}
