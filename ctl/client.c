#include "client.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <llhttp.h>

#include "dsv4-error.h"

#define DEFAULT_MAX_BUFFER ((size_t)64 << 20)
/* A buffered answer's first size; it doubles from there. */
#define ANSWER_MIN_BYTES 4096
/* The request head beyond its variable parts (base, target, host, token): the fixed text, the port
 * and the version, with room to spare. */
#define HEAD_FIXED_BYTES 256
/* Bytes read from the socket at a time. */
#define RECV_BYTES ((size_t)1 << 16)

__attribute__((format(printf, 4, 5))) static int fail(int rc, char *why, size_t why_len,
                                                      const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, why_len, fmt, ap);
  va_end(ap);
  return rc;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for fd to become ready for events within timeout_ms: 0, DSV4_ETIMEDOUT or DSV4_EIO. */
static int wait_fd(int fd, short events, int timeout_ms) {
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = events};
    int64_t left = deadline - now_ms();
    if (left < 0)
      left = 0;
    int n = poll(&pfd, 1, (int)left);
    if (n > 0)
      return 0;
    if (n == 0)
      return DSV4_ETIMEDOUT;
    if (errno != EINTR)
      return DSV4_EIO;
  }
}

/* Connect to the first address of host:port that answers within the timeout. The socket stays
 * non-blocking: every read and write below waits with poll(), so one timeout covers them all. */
static int connect_to(const dsv4_ctl_url_t *url, int timeout_ms, int *out, char *why,
                      size_t why_len) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  struct addrinfo *res = NULL;
  int g = getaddrinfo(url->host, url->port, &hints, &res);
  if (g != 0)
    return fail(DSV4_EIO, why, why_len, "cannot resolve %s: %s", url->host, gai_strerror(g));
  int rc = DSV4_EIO;
  char reason[160] = "no address";
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      snprintf(reason, sizeof(reason), "socket: %s", strerror(errno));
      continue;
    }
    int c = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (c != 0 && errno == EINPROGRESS) {
      int w = wait_fd(fd, POLLOUT, timeout_ms);
      if (w == DSV4_ETIMEDOUT) {
        snprintf(reason, sizeof(reason), "no answer within %d ms", timeout_ms);
        rc = DSV4_ETIMEDOUT;
        close(fd);
        continue;
      }
      int soerr = 0;
      socklen_t sl = sizeof(soerr);
      if (w != 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0)
        soerr = errno;
      if (soerr != 0) {
        errno = soerr;
        c = -1;
      } else {
        c = 0;
      }
    }
    if (c != 0) {
      snprintf(reason, sizeof(reason), "%s", strerror(errno));
      rc = DSV4_EIO;
      close(fd);
      continue;
    }
    freeaddrinfo(res);
    *out = fd;
    return 0;
  }
  freeaddrinfo(res);
  return fail(rc, why, why_len, "cannot connect to %s%s%s:%s: %s", url->ipv6 ? "[" : "", url->host,
              url->ipv6 ? "]" : "", url->port, reason);
}

static int send_all(int fd, const char *p, size_t n, int timeout_ms) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR)
      continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = wait_fd(fd, POLLOUT, timeout_ms);
      if (rc != 0)
        return rc;
      continue;
    }
    return DSV4_EIO;
  }
  return 0;
}

/* The parser's state for one response. llhttp hands out pointers valid only during
 * llhttp_execute(), so header names and values are copied as they arrive. */
typedef struct {
  llhttp_t parser;
  dsv4_ctl_response_t *resp;
  const dsv4_ctl_request_t *req;
  int to_sink;
  int complete;
  int rc; /* the first error a callback met */
  char field[64];
  size_t field_len;
  int field_long;
  char value[256];
  size_t value_len;
  size_t cap;
  char *why;
  size_t why_len;
} rx_t;

static int on_header_field(llhttp_t *p, const char *at, size_t n) {
  rx_t *rx = p->data;
  if (rx->field_len + n >= sizeof(rx->field)) {
    rx->field_long = 1;
    return 0;
  }
  memcpy(rx->field + rx->field_len, at, n);
  rx->field_len += n;
  return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n) {
  rx_t *rx = p->data;
  size_t room = sizeof(rx->value) - 1 - rx->value_len;
  if (n > room)
    n = room;
  memcpy(rx->value + rx->value_len, at, n);
  rx->value_len += n;
  return 0;
}

static void keep(char *dst, size_t cap, const char *src, size_t n) {
  if (n >= cap)
    n = cap - 1;
  memcpy(dst, src, n);
  dst[n] = '\0';
}

static int on_header_value_complete(llhttp_t *p) {
  rx_t *rx = p->data;
  if (!rx->field_long) {
    rx->field[rx->field_len] = '\0';
    dsv4_ctl_response_t *r = rx->resp;
    if (strcasecmp(rx->field, "Content-Type") == 0)
      keep(r->content_type, sizeof(r->content_type), rx->value, rx->value_len);
    else if (strcasecmp(rx->field, "Dsv4d-Instance") == 0)
      keep(r->instance, sizeof(r->instance), rx->value, rx->value_len);
    else if (strcasecmp(rx->field, "Retry-After") == 0)
      keep(r->retry_after, sizeof(r->retry_after), rx->value, rx->value_len);
  }
  rx->field_len = 0;
  rx->field_long = 0;
  rx->value_len = 0;
  return 0;
}

static int on_headers_complete(llhttp_t *p) {
  rx_t *rx = p->data;
  dsv4_ctl_response_t *r = rx->resp;
  r->status = llhttp_get_status_code(p);
  r->content_length = (p->flags & F_CONTENT_LENGTH) ? (int64_t)p->content_length : -1;
  const dsv4_ctl_sink_t *sink = rx->req->sink;
  if (sink && sink->on_headers) {
    int s = sink->on_headers(sink->ud, r);
    if (s < 0) {
      rx->rc = s;
      return -1;
    }
    rx->to_sink = s == 1;
  }
  if (!rx->to_sink && r->content_length > 0 && (uint64_t)r->content_length > rx->req->max_buffer) {
    rx->rc = fail(DSV4_ETOOBIG, rx->why, rx->why_len, "a %lld-byte answer is larger than %zu bytes",
                  (long long)r->content_length, rx->req->max_buffer);
    return -1;
  }
  return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n) {
  rx_t *rx = p->data;
  dsv4_ctl_response_t *r = rx->resp;
  r->body_bytes += n;
  if (rx->to_sink) {
    const dsv4_ctl_sink_t *sink = rx->req->sink;
    int s = sink->on_data(sink->ud, (const uint8_t *)at, n);
    if (s < 0) {
      rx->rc = s;
      return -1;
    }
    return 0;
  }
  if (r->body_len + n > rx->req->max_buffer) {
    rx->rc = fail(DSV4_ETOOBIG, rx->why, rx->why_len, "answer larger than %zu bytes",
                  rx->req->max_buffer);
    return -1;
  }
  if (r->body_len + n + 1 > rx->cap) {
    size_t cap = rx->cap ? rx->cap : ANSWER_MIN_BYTES;
    while (cap < r->body_len + n + 1)
      cap *= 2;
    char *b = realloc(r->body, cap);
    if (!b) {
      rx->rc = fail(DSV4_ENOMEM, rx->why, rx->why_len, "out of memory for a %zu-byte answer",
                    r->body_len + n);
      return -1;
    }
    r->body = b;
    rx->cap = cap;
  }
  memcpy(r->body + r->body_len, at, n);
  r->body_len += n;
  r->body[r->body_len] = '\0';
  return 0;
}

static int on_message_complete(llhttp_t *p) {
  rx_t *rx = p->data;
  rx->complete = 1;
  /* One response per connection: stop here, whatever follows. */
  return HPE_PAUSED;
}

void dsv4_ctl_response_free(dsv4_ctl_response_t *resp) {
  free(resp->body);
  memset(resp, 0, sizeof(*resp));
}

/* The request head: method, target, host, token, and Content-Length when a body follows. */
static char *request_head(const dsv4_ctl_request_t *req, const char *method, const char *target,
                          int with_body, size_t body_len, size_t *len) {
  const dsv4_ctl_url_t *u = req->url;
  /* The token was checked for control characters when read, so the request cannot be split. */
  char clen[96] = "";
  if (with_body)
    snprintf(clen, sizeof(clen),
             "Content-Type: application/octet-stream\r\nContent-Length: %zu\r\n", body_len);
  size_t need = strlen(u->base) + strlen(target) + strlen(u->host) + strlen(method) + strlen(clen) +
                HEAD_FIXED_BYTES + (req->token ? strlen(req->token) : 0);
  char *head = malloc(need);
  if (!head)
    return NULL;
  int hn = snprintf(head, need,
                    "%s %s%s HTTP/1.1\r\nHost: %s%s%s:%s\r\nUser-Agent: dsv4ctl/%s\r\n"
                    "Accept: */*\r\n%s%s%s%sConnection: close\r\n\r\n",
                    method, u->base, target, u->ipv6 ? "[" : "", u->host, u->ipv6 ? "]" : "",
                    u->port, DSV4_VERSION, req->token ? "Authorization: Bearer " : "",
                    req->token ? req->token : "", req->token ? "\r\n" : "", clen);
  *len = (size_t)hn;
  return head;
}

/* Read and parse the answer on fd until it is complete (rx set up by the caller). */
static int receive(int fd, rx_t *rx, const dsv4_ctl_request_t *req, char *why, size_t why_len) {
  const dsv4_ctl_url_t *u = req->url;
  dsv4_ctl_response_t *resp = rx->resp;
  char buf[RECV_BYTES];
  while (!rx->complete) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = wait_fd(fd, POLLIN, req->timeout_ms);
      if (rc == DSV4_ETIMEDOUT)
        return fail(rc, why, why_len, "no data from %s:%s for %d ms (%llu body bytes received)",
                    u->host, u->port, req->timeout_ms, (unsigned long long)resp->body_bytes);
      if (rc != 0)
        return fail(rc, why, why_len, "waiting for the answer: %s", strerror(errno));
      continue;
    }
    if (n < 0)
      return fail(DSV4_EIO, why, why_len, "reading the answer: %s", strerror(errno));
    if (n == 0) {
      /* EOF ends a body that had no length; anywhere else the answer was cut short. */
      llhttp_finish(&rx->parser);
      if (rx->complete)
        break;
      return fail(DSV4_EIO, why, why_len,
                  "connection closed before the answer was complete (%llu of %lld body bytes)",
                  (unsigned long long)resp->body_bytes, (long long)resp->content_length);
    }
    llhttp_errno_t e = llhttp_execute(&rx->parser, buf, (size_t)n);
    if (rx->complete)
      break;
    if (e != HPE_OK) {
      if (rx->rc == 0)
        return fail(DSV4_EIO, why, why_len, "bad HTTP answer from %s:%s: %s", u->host, u->port,
                    llhttp_get_error_reason(&rx->parser));
      if (why[0] == '\0')
        snprintf(why, why_len, "the answer's body could not be stored: %s", dsv4_strerror(rx->rc));
      return rx->rc;
    }
  }
  return 0;
}

int dsv4_ctl_send(const dsv4_ctl_request_t *req_in, const char *method, const char *target,
                  const uint8_t *body, size_t body_len, dsv4_ctl_response_t *resp, char *why,
                  size_t why_len) {
  dsv4_ctl_request_t req = *req_in;
  if (why_len > 0)
    why[0] = '\0';
  if (req.max_buffer == 0)
    req.max_buffer = DEFAULT_MAX_BUFFER;
  memset(resp, 0, sizeof(*resp));
  resp->content_length = -1;
  const dsv4_ctl_url_t *u = req.url;
  size_t hn;
  char *head = request_head(&req, method, target, body != NULL, body_len, &hn);
  if (!head)
    return fail(DSV4_ENOMEM, why, why_len, "out of memory");
  int fd = -1;
  int rc = connect_to(u, req.timeout_ms, &fd, why, why_len);
  if (rc != 0) {
    free(head);
    return rc;
  }
  rc = send_all(fd, head, hn, req.timeout_ms);
  free(head);
  /* A daemon may answer before the whole body is in (a refusal by its head) and close: the answer
   * is still read, and the failed send reported only when there is none. */
  int body_rc =
      rc == 0 && body_len ? send_all(fd, (const char *)body, body_len, req.timeout_ms) : 0;
  if (rc != 0) {
    close(fd);
    return fail(rc, why, why_len, "sending the request to %s:%s: %s", u->host, u->port,
                rc == DSV4_ETIMEDOUT ? "timed out" : strerror(errno));
  }
  llhttp_settings_t settings;
  llhttp_settings_init(&settings);
  settings.on_header_field = on_header_field;
  settings.on_header_value = on_header_value;
  settings.on_header_value_complete = on_header_value_complete;
  settings.on_headers_complete = on_headers_complete;
  settings.on_body = on_body;
  settings.on_message_complete = on_message_complete;
  rx_t rx;
  memset(&rx, 0, sizeof(rx));
  llhttp_init(&rx.parser, HTTP_RESPONSE, &settings);
  rx.parser.data = &rx;
  rx.resp = resp;
  rx.req = &req;
  rx.why = why;
  rx.why_len = why_len;
  rc = receive(fd, &rx, &req, why, why_len);
  close(fd);
  if (rc != 0 || !rx.complete) {
    if (body_rc != 0)
      rc = fail(body_rc, why, why_len, "sending the body to %s:%s: %s", u->host, u->port,
                body_rc == DSV4_ETIMEDOUT ? "timed out" : "the connection was closed");
    else if (rc == 0)
      rc = fail(DSV4_EIO, why, why_len, "incomplete answer");
    dsv4_ctl_response_free(resp);
    return rc;
  }
  return 0;
}

int dsv4_ctl_get(const dsv4_ctl_request_t *req, const char *target, dsv4_ctl_response_t *resp,
                 char *why, size_t why_len) {
  return dsv4_ctl_send(req, "GET", target, NULL, 0, resp, why, why_len);
}

int dsv4_ctl_read_token(const char *path, char **out, char *why, size_t why_len) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f)
    return fail(DSV4_EINVAL, why, why_len, "token file %s: %s", path, strerror(errno));
  char buf[4097];
  size_t n = fread(buf, 1, sizeof(buf), f);
  int rerr = ferror(f);
  fclose(f);
  if (rerr)
    return fail(DSV4_EINVAL, why, why_len, "token file %s: read error", path);
  if (n == sizeof(buf))
    return fail(DSV4_EINVAL, why, why_len, "token file %s is longer than 4096 bytes", path);
  while (n > 0 &&
         (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
    n--;
  if (n == 0)
    return fail(DSV4_EINVAL, why, why_len, "token file %s is empty", path);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)buf[i] < 0x21 || (unsigned char)buf[i] == 0x7f)
      return fail(DSV4_EINVAL, why, why_len,
                  "token file %s holds a space or control character at byte %zu", path, i);
  char *t = malloc(n + 1);
  if (!t)
    return fail(DSV4_ENOMEM, why, why_len, "out of memory");
  memcpy(t, buf, n);
  t[n] = '\0';
  *out = t;
  return 0;
}
