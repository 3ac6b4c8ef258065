/*
 * bare_server: the HTTP ceiling for http_bench. A keep-alive HTTP/1.1 server on libuv + llhttp, the
 * same stack as the daemon, that does no work at all: it copies each request body into a
 * per-connection buffer (any server must hold the whole body before it can act on it) and answers
 * with a body of the requested size taken from one preallocated buffer. What the daemon achieves
 * over what this server achieves on the same payloads is the share of the HTTP path that is not
 * inherent in moving the bytes.
 *
 * The response size comes from the request header Bench-Response-Bytes (the size the daemon would
 * answer with for the same batch); without it the response is as long as the request body.
 *
 * Usage: bare_server [--host 127.0.0.1] [--port 0] [--unix PATH] [--max-response-bytes 67108864]
 * The bound port is printed on stdout as one line; with --unix the server listens on a Unix socket
 * at PATH instead (as the daemon's listen_unix does) and prints PATH. SIGTERM or SIGINT stops it.
 */
#include <errno.h>
#include <llhttp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <uv.h>

#define READ_BUF_BYTES (256u * 1024u)
#define FIELD_MAX 64
#define VALUE_MAX 32

typedef struct {
  /* First, so a handle pointer is a conn pointer; a TCP or a Unix socket connection. */
  union {
    uv_tcp_t tcp;
    uv_pipe_t pipe;
  };
  llhttp_t parser;
  uv_write_t wr;
  char head[256];
  uint8_t *body;
  size_t body_len, body_cap;
  size_t want_bytes; /* Bench-Response-Bytes, or SIZE_MAX when absent */
  char field[FIELD_MAX];
  size_t field_len;
  char value[VALUE_MAX];
  size_t value_len;
  int field_overflow;
  int keep_alive;
  /* Bytes received after a complete request while its response is being written. */
  uint8_t *pending;
  size_t pending_len, pending_cap;
  char rbuf[READ_BUF_BYTES];
} conn_t;

static uv_loop_t *loop;
static union {
  uv_tcp_t tcp;
  uv_pipe_t pipe;
} listener;
static int unix_socket;
static uv_signal_t sig_term, sig_int;
static llhttp_settings_t settings;
static uint8_t *payload; /* the one response body, shared read-only by every connection */
static size_t payload_cap;

static void on_closed(uv_handle_t *h) {
  conn_t *c = (conn_t *)h;
  free(c->body);
  free(c->pending);
  free(c);
}

static void conn_close(conn_t *c) {
  if (!uv_is_closing((uv_handle_t *)&c->tcp))
    uv_close((uv_handle_t *)&c->tcp, on_closed);
}

static int grow(uint8_t **buf, size_t *cap, size_t need) {
  if (need <= *cap)
    return 0;
  size_t n = *cap ? *cap : 4096;
  while (n < need)
    n *= 2;
  uint8_t *p = realloc(*buf, n);
  if (!p)
    return -1;
  *buf = p;
  *cap = n;
  return 0;
}

static int on_message_begin(llhttp_t *p) {
  conn_t *c = p->data;
  c->body_len = 0;
  c->want_bytes = SIZE_MAX;
  c->field_len = c->value_len = 0;
  c->field_overflow = 0;
  return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = p->data;
  if (c->field_len + n >= FIELD_MAX) {
    c->field_overflow = 1;
    return 0;
  }
  memcpy(c->field + c->field_len, at, n);
  c->field_len += n;
  return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = p->data;
  if (c->value_len + n < VALUE_MAX) {
    memcpy(c->value + c->value_len, at, n);
    c->value_len += n;
  }
  return 0;
}

static int on_header_value_complete(llhttp_t *p) {
  conn_t *c = p->data;
  c->field[c->field_len] = '\0';
  c->value[c->value_len] = '\0';
  if (!c->field_overflow && strcasecmp(c->field, "Bench-Response-Bytes") == 0) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(c->value, &end, 10);
    if (errno == 0 && end != c->value && *end == '\0')
      c->want_bytes = (size_t)v;
  }
  c->field_len = c->value_len = 0;
  c->field_overflow = 0;
  return 0;
}

static int on_headers_complete(llhttp_t *p) {
  conn_t *c = p->data;
  /* Size the body buffer once from Content-Length, as the daemon does, rather than per read. */
  if (p->content_length > 0 && p->content_length < (uint64_t)1 << 40 &&
      grow(&c->body, &c->body_cap, (size_t)p->content_length))
    return -1;
  return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n) {
  conn_t *c = p->data;
  if (grow(&c->body, &c->body_cap, c->body_len + n))
    return -1;
  memcpy(c->body + c->body_len, at, n);
  c->body_len += n;
  return 0;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

/* Parse data; on a complete request the parser pauses and the rest is kept for later. */
static void feed(conn_t *c, const char *data, size_t len) {
  llhttp_errno_t e = llhttp_execute(&c->parser, data, len);
  if (e == HPE_OK)
    return;
  if (e == HPE_PAUSED) {
    const char *pos = llhttp_get_error_pos(&c->parser);
    size_t used = pos ? (size_t)(pos - data) : len;
    size_t rest = len - used;
    if (rest) {
      /* data may point into pending itself, so move rather than copy. */
      if (data != (const char *)c->pending && grow(&c->pending, &c->pending_cap, rest)) {
        conn_close(c);
        return;
      }
      memmove(c->pending, data + used, rest);
    }
    c->pending_len = rest;
    uv_read_stop((uv_stream_t *)&c->tcp);
    return;
  }
  conn_close(c);
}

static void on_written(uv_write_t *w, int status) {
  conn_t *c = w->data;
  if (status < 0 || !c->keep_alive) {
    conn_close(c);
    return;
  }
  llhttp_resume(&c->parser);
  if (c->pending_len) {
    size_t n = c->pending_len;
    c->pending_len = 0;
    feed(c, (const char *)c->pending, n);
    if (uv_is_closing((uv_handle_t *)&c->tcp) || llhttp_get_errno(&c->parser) == HPE_PAUSED)
      return;
  }
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read))
    conn_close(c);
}

static int on_message_complete(llhttp_t *p) {
  conn_t *c = p->data;
  size_t n = c->want_bytes == SIZE_MAX ? c->body_len : c->want_bytes;
  int status = 200;
  const char *reason = "OK";
  if (n > payload_cap) {
    status = 413;
    reason = "Payload Too Large";
    n = 0;
  }
  c->keep_alive = llhttp_should_keep_alive(p);
  int hl =
      snprintf(c->head, sizeof(c->head),
               "HTTP/1.1 %d %s\r\nContent-Type: application/octet-stream\r\n"
               "Content-Length: %zu\r\nDsv4d-Instance: 00000000000000000000000000000000\r\n%s\r\n",
               status, reason, n, c->keep_alive ? "" : "Connection: close\r\n");
  uv_buf_t bufs[2] = {uv_buf_init(c->head, (unsigned)hl),
                      uv_buf_init((char *)payload, (unsigned)n)};
  c->wr.data = c;
  if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, bufs, n ? 2 : 1, on_written)) {
    conn_close(c);
    return HPE_PAUSED;
  }
  /* One request at a time per connection: the next is parsed once this answer is written. */
  return HPE_PAUSED;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn_t *c = (conn_t *)h;
  (void)suggested;
  *buf = uv_buf_init(c->rbuf, READ_BUF_BYTES);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = (conn_t *)s;
  if (nread < 0) {
    conn_close(c);
    return;
  }
  if (nread > 0)
    feed(c, buf->base, (size_t)nread);
}

static void on_connection(uv_stream_t *srv, int status) {
  if (status < 0)
    return;
  conn_t *c = calloc(1, sizeof(*c));
  if (!c)
    return;
  if (unix_socket)
    uv_pipe_init(loop, &c->pipe, 0);
  else
    uv_tcp_init(loop, &c->tcp);
  if (uv_accept(srv, (uv_stream_t *)&c->tcp)) {
    conn_close(c);
    return;
  }
  if (!unix_socket)
    uv_tcp_nodelay(&c->tcp, 1);
  llhttp_init(&c->parser, HTTP_REQUEST, &settings);
  c->parser.data = c;
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

static void on_walk_close(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h))
    uv_close(h, (h->type == UV_TCP || h->type == UV_NAMED_PIPE) && h != (uv_handle_t *)&listener
                    ? on_closed
                    : NULL);
}

static void on_signal(uv_signal_t *s, int signum) {
  (void)signum;
  uv_walk(s->loop, on_walk_close, NULL);
}

/* Listen on a Unix socket at path (replacing a stale socket file) and print the path. */
static int listen_unix(const char *path) {
  unlink(path);
  int rc = uv_pipe_init(loop, &listener.pipe, 0);
  if (rc == 0)
    rc = uv_pipe_bind(&listener.pipe, path);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&listener, 128, on_connection);
  if (rc) {
    fprintf(stderr, "bare_server: cannot listen on %s: %s\n", path, uv_strerror(rc));
    return -1;
  }
  printf("%s\n", path);
  fflush(stdout);
  return 0;
}

/* Listen on host:port and print the bound port. */
static int listen_tcp(const char *host, int port) {
  struct sockaddr_storage addr;
  int rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&addr);
  if (rc)
    rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr);
  if (rc == 0)
    rc = uv_tcp_init(loop, &listener.tcp);
  if (rc == 0)
    rc = uv_tcp_bind(&listener.tcp, (const struct sockaddr *)&addr, 0);
  if (rc == 0)
    rc = uv_listen((uv_stream_t *)&listener, 128, on_connection);
  if (rc) {
    fprintf(stderr, "bare_server: cannot listen on %s:%d: %s\n", host, port, uv_strerror(rc));
    return -1;
  }
  struct sockaddr_storage bound;
  int blen = sizeof(bound);
  uv_tcp_getsockname(&listener.tcp, (struct sockaddr *)&bound, &blen);
  int bound_port = bound.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&bound)->sin6_port)
                                               : ntohs(((struct sockaddr_in *)&bound)->sin_port);
  printf("%d\n", bound_port);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  const char *host = "127.0.0.1";
  int port = 0;
  const char *unix_path = NULL;
  size_t max_bytes = (size_t)64 << 20;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--host") == 0 && i + 1 < argc) {
      host = argv[++i];
    } else if (strcmp(argv[i], "--port") == 0 && i + 1 < argc) {
      port = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--unix") == 0 && i + 1 < argc) {
      unix_path = argv[++i];
    } else if (strcmp(argv[i], "--max-response-bytes") == 0 && i + 1 < argc) {
      max_bytes = strtoull(argv[++i], NULL, 10);
    } else {
      fprintf(stderr, "usage: %s [--host H] [--port P] [--unix PATH] [--max-response-bytes B]\n",
              argv[0]);
      return 2;
    }
  }
  payload = malloc(max_bytes ? max_bytes : 1);
  if (!payload) {
    fprintf(stderr, "bare_server: cannot allocate %zu bytes\n", max_bytes);
    return 1;
  }
  /* Touch every page now, so no response pays for a page fault the daemon would not. */
  for (size_t i = 0; i < max_bytes; i++)
    payload[i] = (uint8_t)(i * 131u);
  payload_cap = max_bytes;

  llhttp_settings_init(&settings);
  settings.on_message_begin = on_message_begin;
  settings.on_header_field = on_header_field;
  settings.on_header_value = on_header_value;
  settings.on_header_value_complete = on_header_value_complete;
  settings.on_headers_complete = on_headers_complete;
  settings.on_body = on_body;
  settings.on_message_complete = on_message_complete;

  loop = uv_default_loop();
  unix_socket = unix_path != NULL;
  if (unix_socket ? listen_unix(unix_path) : listen_tcp(host, port))
    return 1;
  uv_signal_init(loop, &sig_term);
  uv_signal_init(loop, &sig_int);
  uv_signal_start(&sig_term, on_signal, SIGTERM);
  uv_signal_start(&sig_int, on_signal, SIGINT);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
  free(payload);
  return 0;
}
