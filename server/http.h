#ifndef DSV4_SERVER_HTTP_H
#define DSV4_SERVER_HTTP_H

/*
 * The HTTP/1.1 layer: libuv + llhttp. One request in flight per connection; pipelined requests are
 * parsed one at a time (llhttp paused in on_message_complete) and answered in order. Handlers run
 * on the loop thread and answer exactly once with dsv4_respond*(), now or later (after executor
 * work).
 *
 * Limits are checked before the body arrives: Content-Length against the route's body limit (413),
 * header bytes against max_header_bytes (431). A POST without Content-Length is 411. Every response
 * carries Dsv4d-Instance.
 *
 * A connection past max_connections, or one that arrives when the process has no file descriptor
 * left, is answered 503 too_many_connections with Connection: close before any request is read,
 * counted in dsv4d_connections_rejected_total{reason="max_connections"|"fd_limit"} and logged once
 * per episode of refusals; dsv4d_connections is the gauge of open connections (every listener
 * sharing the registry adds to it).
 *
 * Thread affinity: everything here is loop thread only, except dsv4_direct_write and
 * dsv4_direct_close.
 */

#include <stddef.h>
#include <stdint.h>

#include <sys/types.h>

#include <jansson.h>
#include <uv.h>

typedef struct dsv4_server dsv4_server_t;
typedef struct dsv4_req dsv4_req_t;

enum {
  DSV4_HTTP_GET = 1,
  DSV4_HTTP_POST = 2,
  DSV4_HTTP_DELETE = 4,
  DSV4_HTTP_HEAD = 8,
  DSV4_HTTP_PUT = 16,
};

struct dsv4_req {
  int method;        /* DSV4_HTTP_* */
  const char *path;  /* NUL-terminated, percent-decoding not applied, without the query */
  const char *query; /* NUL-terminated, "" when none */
  uint8_t *body;     /* the whole body (64-byte aligned), NULL when empty */
  size_t body_len;
  uint64_t t_start_ns; /* when the request line started arriving (uv_hrtime) */
  const char *route;   /* the matched route's metric label, e.g. "forward" */
  void *user;          /* free for the handler */
};

/* A request header by case-insensitive name, or NULL. Valid until the response is sent. */
const char *dsv4_req_header(const dsv4_req_t *req, const char *name);
/* Non-zero once the client has gone away; the handler must still respond (which then frees). */
int dsv4_req_gone(const dsv4_req_t *req);
/* The client's "ip:port" ("[ip]:port" for IPv6), captured when the connection was accepted. */
const char *dsv4_req_peer(const dsv4_req_t *req);
/* 1 when the listener requires a bearer token and the request carried it. */
int dsv4_req_authenticated(const dsv4_req_t *req);
/* Take ownership of the body; req->body becomes NULL. *alloc receives the allocation that holds it
 * (the body itself, or where a route's body_skew placed it inside): free that with the listener's
 * body_free hook (dsv4_server_config_t), or with free() when the listener has none. */
/* The body's watcher (dsv4_route_t.watch_begin), from here on the caller's to free; NULL if none.
 */
void *dsv4_req_take_watch(dsv4_req_t *req);
uint8_t *dsv4_req_take_body(dsv4_req_t *req, void **alloc);
/* The method's name ("GET", ...), for logs. */
const char *dsv4_req_method_name(const dsv4_req_t *req);

typedef struct {
  const char *name;
  const char *value;
} dsv4_hdr_t;

/*
 * Answer req. body[] buffers must stay valid until release(release_arg) is called (after the write
 * completed or failed); release may be NULL. extra[] strings are copied.
 */
void dsv4_respond(dsv4_req_t *req, int status, const char *content_type, const dsv4_hdr_t *extra,
                  size_t n_extra, const uv_buf_t *body, size_t n_body, void (*release)(void *),
                  void *release_arg);
/*
 * An answer written to the socket by another thread (the executor), so that it leaves the moment it
 * is made instead of waiting for the loop thread to wake up and take it (docs/DESIGN.md, "An answer
 * is written where it was made"), in three steps.
 *
 * dsv4_direct_open, loop thread, before the work is handed over: whether the connection may be
 * written from elsewhere now (nothing of it queued, the server not draining), what the answer will
 * announce (keep-alive or close: decided here), and a duplicate of its socket for the other thread,
 * which therefore stays valid whatever the loop does with the connection or the server meanwhile.
 *
 * dsv4_direct_write, the other thread: the response head and what of the body the socket takes at
 * once, without blocking: all of an answer of at most max_bytes, of a larger one its first
 * DSV4_DIRECT_PART bytes (or max_bytes, if less): a prefill's 64 MiB answer, whose rest the loop or
 * the bulk thread moves anyway, holds the executor no longer than that.
 *
 * dsv4_respond_direct, loop thread, in place of dsv4_respond: the rest of the answer, and the
 * request's bookkeeping (log line, counters, keep-alive), as dsv4_respond.
 *
 * Between open and respond the loop writes nothing on the connection (one request in flight).
 * dsv4_direct_close releases an opened one that will not be answered so (an error answer).
 */
/* Opened and not yet closed at most, in the whole process (each holds a descriptor); past it,
 * dsv4_direct_open refuses and the loop writes the answer. */
#define DSV4_DIRECT_MAX 16
/* Of an answer larger than max_bytes, the bytes the other thread writes (its head, early). */
#define DSV4_DIRECT_PART ((size_t)256 << 10)
/* Transfers out with the bulk I/O thread at most, in the whole process (each holds a descriptor,
 * apart from those above, so that slow uploads cannot take the direct answers' turn); past it, the
 * loop moves the bytes. */
#define DSV4_BULK_MAX 16

typedef struct {
  int fd;            /* the socket's duplicate, -1 once closed */
  int keep;          /* what the answer announces (the loop's decision at open) */
  int http_minor;    /* of the request */
  char instance[40]; /* Dsv4d-Instance (a copy: the server may be gone before the write) */
  size_t max_bytes;  /* an answer of at most this many bytes whole from the other thread */
  char *head;        /* the response head dsv4_direct_write built (malloc'd) */
  size_t head_len;
  size_t written;        /* bytes of the answer (head first) that went out */
  int err;               /* the socket's error (-errno), 0 */
  uint64_t t_written_ns; /* when they went (uv_hrtime's clock) */
} dsv4_direct_t;

/* Loop thread. 0 and *dw ready; else -1 (bytes queued on the connection, draining, a HEAD request,
 * DSV4_DIRECT_MAX open, no descriptor left for the duplicate) and nothing to close. */
int dsv4_direct_open(dsv4_req_t *req, size_t max_bytes, dsv4_direct_t *dw);
/* Any one thread. Returns the bytes written (0: none, for the loop to write); never blocks. */
size_t dsv4_direct_write(dsv4_direct_t *dw, int status, const char *content_type,
                         const uv_buf_t *body, size_t n_body);
/* Loop thread: answer req whose first dw->written bytes went out (0: as dsv4_respond); the body
 * must be the one given to dsv4_direct_write. Closes dw. */
void dsv4_respond_direct(dsv4_req_t *req, dsv4_direct_t *dw, int status, const char *content_type,
                         const uv_buf_t *body, size_t n_body, void (*release)(void *),
                         void *release_arg);
/* Any thread: free what an opened dw holds (idempotent). */
void dsv4_direct_close(dsv4_direct_t *dw);

/* Answer with a JSON document (stolen reference). */
void dsv4_respond_json(dsv4_req_t *req, int status, json_t *doc);
/*
 * Answer with {"error": {"code": ..., "message": ..., ...details}} for a dsv4 error code; message
 * NULL means dsv4_strerror(err); details (stolen, may be NULL) are merged into the error object.
 * Adds Retry-After: 1 for 503 and 429 answers.
 */
void dsv4_respond_error(dsv4_req_t *req, int err, const char *message, json_t *details);

/*
 * A streamed answer (an admin dump): begin sends nothing yet, it fixes the status, the headers and
 * Content-Length (> 0); each write sends one piece, the first with the response head, and cb runs
 * from the loop once the piece is in the socket (status 0) or the connection failed (DSV4_EIO),
 * never inside the call. One piece at a time: the next write only after cb, so a slow reader slows
 * the writer down (back-pressure). write_timeout_ms applies to each piece. end always follows,
 * exactly once, whatever happened (it frees the request): an answer shorter than Content-Length
 * closes the connection. begin and write return DSV4_EIO once the client has gone (then only end is
 * left).
 */
typedef void (*dsv4_stream_cb)(dsv4_req_t *req, int status, void *arg);
int dsv4_respond_stream_begin(dsv4_req_t *req, int status, const char *content_type,
                              const dsv4_hdr_t *extra, size_t n_extra, uint64_t content_length);
int dsv4_respond_stream_write(dsv4_req_t *req, const uv_buf_t *buf, dsv4_stream_cb cb, void *arg);
void dsv4_respond_stream_end(dsv4_req_t *req);

typedef void (*dsv4_handler_fn)(dsv4_req_t *req, void *ctx);

/*
 * A watcher of a route's bodies as they arrive: begin(ctx, content_length) once the headers are in
 * (it may answer NULL: none for this body); seen(w, body, have) each time reads have brought the
 * body's first `have` bytes, once the body is in its place: on the loop thread, or on the bulk
 * thread for the part that thread reads, never on both at once, always before the handler; end(w)
 * frees it, unless the handler took it (dsv4_req_take_watch).
 */
typedef struct {
  void *(*begin)(void *ctx, size_t content_length);
  void (*seen)(void *w, const uint8_t *body, size_t have);
  void (*end)(void *w);
} dsv4_body_watch_t;

typedef struct {
  unsigned methods;  /* DSV4_HTTP_* mask */
  const char *path;  /* exact path, or a prefix when it ends with '/' */
  const char *label; /* metric label */
  size_t max_body;   /* body limit for this route */
  int public_route;  /* 1: no bearer token needed (health, metrics) */
  dsv4_handler_fn fn;
  void *ctx;
  /* Optional (NULL: 0). From a body's first 8 bytes, the offset (0..63) past a 64-byte boundary at
   * which the body is placed, so that a part of it the handler hands on in place starts aligned
   * (the forward route: its safetensors data section, which the CUDA backend's launches read in
   * place). Called once per body of 8 bytes or more, before the handler. */
  size_t (*body_skew)(const uint8_t *first8);
  /* Optional (NULL: none): a watcher of the body as it arrives. */
  const dsv4_body_watch_t *watch;
} dsv4_route_t;

typedef struct {
  const char *host; /* listen address */
  int port;         /* 0 = ephemeral */
  /* A Unix domain socket served beside host:port, mode 0660, unlinked on close; NULL or "" = none.
   * Its connections count toward max_connections with the TCP ones. */
  const char *unix_path;
  size_t max_header_bytes;
  /* A connection's body read, and its answer's write, at most this many bytes in a loop iteration
   * (0 = 1 MiB): what a large body or answer holds the loop before other connections' turns. */
  size_t io_slice_bytes;
  /* A body's rest, or an answer's, of at least this many bytes moves on a thread of its own
   * (server/bulk_io.h), a slice at a time as above, while the loop serves the other connections
   * (0 = none: the loop moves every byte). */
  size_t bulk_io_bytes;
  size_t max_connections;       /* open connections; more are refused with 503 (0 = no limit) */
  uint64_t header_timeout_ms;   /* request line + headers */
  uint64_t body_timeout_ms;     /* between body reads */
  uint64_t idle_timeout_ms;     /* keep-alive idle */
  uint64_t write_timeout_ms;    /* a response that does not drain */
  const char *bearer_token;     /* NULL = no token required */
  const char *instance;         /* 32 hex digits */
  const char *name;             /* "data" / "admin", for logs */
  struct dsv4_metrics *metrics; /* dsv4d_requests_total goes here; NULL = dsv4_metrics_default() */
  /* Called once per request when its answer is complete or abandoned (bytes written so far; written
   * 0 when the client went away first): the admin plane's audit log. NULL = none. */
  void (*on_complete)(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg);
  void *on_complete_arg;
  /* Where request bodies live (both or neither; NULL = aligned_alloc and free): body_alloc(arg, n)
   * returns n bytes, n a multiple of 64, aligned to 64 bytes, or NULL when there is no memory (the
   * request is then answered 503 out_of_memory); body_free(arg, p) takes back what it returned, and
   * NULL. The daemon puts bodies in memory a device copies from directly. */
  void *(*body_alloc)(void *arg, size_t n);
  void (*body_free)(void *arg, void *p);
  void *body_alloc_arg;
} dsv4_server_config_t;

int dsv4_server_create(uv_loop_t *loop, const dsv4_server_config_t *cfg, const dsv4_route_t *routes,
                       size_t n_routes, dsv4_server_t **out);
/*
 * The connections a process can serve: the soft RLIMIT_NOFILE less a reserve for every other
 * descriptor it opens (the loop's own, listeners, files, the admin plane, a GPU driver's): 64, or
 * half the limit when it is small. 0 when the limit is infinite.
 */
size_t dsv4_server_default_max_connections(void);
/* The bound port (after port 0). */
int dsv4_server_port(const dsv4_server_t *s);
/* Stop accepting and close idle connections; busy ones close after their response. */
void dsv4_server_drain(dsv4_server_t *s);
/* Connections still open. */
size_t dsv4_server_connections(const dsv4_server_t *s);
/* Close everything; cb runs once all handles are closed. */
void dsv4_server_close(dsv4_server_t *s, void (*cb)(void *), void *arg);

/*
 * A bound, listening Unix domain socket of type (SOCK_STREAM, SOCK_SEQPACKET) at path, mode 0660
 * (set before it listens): its non-blocking, close-on-exec descriptor and the file's device and
 * inode, or DSV4_EIO after a "cannot listen" error line naming listener and path. A socket file
 * left by a process that died is replaced; any other file there, a socket something listens on,
 * or a missing directory is refused (a typo never deletes a file).
 */
int dsv4_unix_listen(const char *listener, const char *path, int type, int *fd, dev_t *dev,
                     ino_t *ino);
/* Remove the socket file at path, unless another process has put a file of its own there since. */
void dsv4_unix_unlink_own(const char *path, dev_t dev, ino_t ino);

#endif /* DSV4_SERVER_HTTP_H */
