/*
 * libFuzzer driver for the HTTP glue: each input is written as raw bytes into one end of a
 * socketpair whose other end the server serves as a connection (dsv4__server_adopt_fd), then the
 * writing side shuts down and the loop runs until the connection is gone. Routes answer at once,
 * from a timer, or with an error, so the asynchronous paths run too. Whatever comes back must be
 * HTTP/1.1 responses carrying Dsv4d-Instance.
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
  free(dsv4_req_take_body(req));
  dsv4_respond_error(req, DSV4_EPOSITION, "nope", json_pack("{s:i}", "expected", 3));
}

static const dsv4_route_t routes[] = {
    {DSV4_HTTP_GET | DSV4_HTTP_HEAD | DSV4_HTTP_POST, "/now", "now", 4096, 1, h_now, NULL},
    {DSV4_HTTP_GET | DSV4_HTTP_POST | DSV4_HTTP_DELETE, "/v1/later/", "later", 4096, 0, h_later,
     NULL},
    {DSV4_HTTP_POST, "/take", "take", 64, 0, h_take, NULL},
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

static void check_output(const char *out, size_t n) {
  if (n == 0)
    return;
  if (n < 9 || memcmp(out, "HTTP/1.1 ", 9) != 0)
    abort();
  if (!memmem(out, n, "\r\nDsv4d-Instance: 00000000000000000000000000000000\r\n", 52))
    abort();
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
  int shut = 0;
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
      if (out_len >= sizeof(out) - 1)
        out_len = 0;
    }
  }
  check_output(out, out_len);
  close(sv[1]);
  /* Let the closed handles' callbacks run before the next input. */
  uv_run(loop, UV_RUN_NOWAIT);
  return 0;
}
