/*
 * Shared regions (shm.h, SPEC §6.1): the listener, the connections and their regions, and the
 * three operations, register, unregister and forward. One message at a time per connection: while
 * a request is in flight nothing more is read, so answers go out in request order.
 */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "errors.h"
#include "log.h"
#include "metrics.h"
#include "safetensors.h"
#include "shm_msg.h"

/* The largest message taken: a forward request of about 1000 segments. The kernel's default
 * socket buffers (net.core.wmem_default, 208 KiB) bound what a client can send in one message. */
#define SHM_MAX_MSG (256u << 10)
/* Descriptors taken from one message: one is a registration, more are closed and refused. */
#define SHM_MAX_FDS 4
/* Regions one connection may hold at once, and the largest region mapped. */
#define SHM_MAX_REGIONS 64
#define SHM_MAX_REGION_BYTES ((uint64_t)1 << 40)
/* The seals a region must carry: its size can change neither way, so every byte the daemon maps
 * stays backed by the file and an access can never raise SIGBUS. */
#define SHM_SEALS (F_SEAL_SHRINK | F_SEAL_GROW)
#ifdef F_SEAL_FUTURE_WRITE
#define SHM_NO_WRITE_SEALS (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)
#else
#define SHM_NO_WRITE_SEALS F_SEAL_WRITE
#endif
#define NS_PER_MS 1000000u
/* With no descriptor left for a client, the listener waits this long before it accepts again,
 * instead of spinning on a socket that stays readable. */
#define ACCEPT_RETRY_MS 1000

typedef struct region {
  struct region *next;
  uint32_t id;
  uint8_t *base;
  size_t size;
} region_t;

typedef struct conn conn_t;

/* The outputs of a forward request: where each goes in the region. */
enum { OUT_Q, OUT_SLOTS, OUT_ATTN, OUT_LSE, OUT_TOPK, OUT_COUNT };
static const char *const out_names[OUT_COUNT] = {"q_out", "slots", "attn", "lse", "topk"};

typedef struct {
  int wanted;
  int dtype;
  int ndim;
  int64_t shape[3];
  size_t nbytes;
  size_t off;
} out_t;

struct conn {
  uv_poll_t poll; /* first: the handle of this object */
  conn_t *prev, *next;
  dsv4_shm_server_t *srv;
  int fd;
  region_t *regions;
  uint32_t n_regions, next_id;
  int busy;      /* a request in flight: nothing more is read until it is answered */
  int closing;   /* the peer left or the server closes: tear down once not busy */
  char *pending; /* an answer the socket did not take yet */
  size_t pending_len;
  int armed;            /* the events the poll handle waits for (conn_arm) */
  out_t out[OUT_COUNT]; /* the forward in flight */
  int want_digest;
  uint64_t t_recv; /* when the message of the forward in flight was read (uv_hrtime) */
  /* The executor thread sent the forward's answer itself (forward_now), at t_sent. */
  int sent;
  uint64_t t_sent;
};

struct dsv4_shm_server {
  uv_poll_t poll;   /* the listening socket's */
  uv_timer_t retry; /* accepting again after the descriptors ran out */
  dsv4_daemon_t *d;
  int fd;
  char *path;
  dev_t dev;
  ino_t ino;
  char *token;
  size_t max_connections;
  conn_t *conns;
  size_t n_conns;
  int listening, draining, closing;
  size_t handles; /* poll handles and teardowns not finished */
  uint8_t *rx;    /* one message: messages are handled one at a time on the loop thread */
  dsv4_metric_t *requests, *regions, *forward_seconds;
  void (*close_cb)(void *);
  void *close_arg;
};

/* An executor job that registers a region with the backend, or unregisters a list of them. */
typedef struct {
  dsv4_job_t job; /* first */
  conn_t *c;
  region_t *r;
  int reg;
  int rc;
} reg_job_t;

/* What follows a message's JSON object: a forward's segments text ("segments_bytes"), or white
 * space. */
typedef struct {
  const char *text;
  size_t len;
} trailer_t;

static void conn_close(conn_t *c);
static void conn_update(conn_t *c);
static void conn_arm(conn_t *c, int ev);

/* ---- answers ---- */

static void count(conn_t *c, const char *op, int status) {
  char code[8];
  snprintf(code, sizeof(code), "%d", status);
  const char *v[2] = {op, code};
  dsv4_metric_add(c->srv->requests, v, 1);
}

/* Send one answer's text (malloc'd, taken; NULL: out of memory), or keep it until the socket takes
 * it. */
static void send_text(conn_t *c, char *text, size_t len) {
  if (!text || c->closing) {
    free(text);
    if (!text)
      conn_close(c); /* out of memory for an answer: the client sees the connection go */
    return;
  }
  ssize_t n = send(c->fd, text, len, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == (ssize_t)len) {
    free(text);
    return;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    c->pending = text;
    c->pending_len = len;
    return;
  }
  free(text);
  conn_close(c);
}

/* Send one answer, or keep it until the socket takes it. Takes doc. */
static void send_doc(conn_t *c, json_t *doc) {
  char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  json_decref(doc);
  send_text(c, text, text ? strlen(text) : 0);
}

/* The error answer: the HTTP status and error object of the same failure (SPEC §6). Takes
 * details. */
static void answer_error(conn_t *c, const char *op, int err, const char *message, json_t *details) {
  dsv4_http_error_t he = dsv4_http_error(err);
  json_t *e = json_pack("{s:s,s:s}", "code", he.code, "message",
                        message && *message ? message : dsv4_strerror(err));
  if (e && json_is_object(details))
    json_object_update_missing(e, details);
  json_decref(details);
  count(c, op, he.status);
  send_doc(c, e ? json_pack("{s:i,s:s,s:o}", "status", he.status, "instance", c->srv->d->instance,
                            "error", e)
                : NULL);
}

/* A 200 answer: doc's fields with status and instance added. Takes doc. */
static void answer_ok(conn_t *c, const char *op, json_t *doc) {
  if (doc) {
    json_object_set_new(doc, "status", json_integer(200));
    json_object_set_new(doc, "instance", json_string(c->srv->d->instance));
  }
  count(c, op, 200);
  send_doc(c, doc);
}

/* ---- regions ---- */

/* The region of this connection with id (given, an integer), or NULL. */
static region_t **region_find(conn_t *c, int given, int64_t id) {
  if (!given)
    return NULL;
  for (region_t **p = &c->regions; *p; p = &(*p)->next)
    if ((int64_t)(*p)->id == id)
      return p;
  return NULL;
}

static void region_unmap(dsv4_shm_server_t *s, region_t *r) {
  munmap(r->base, r->size);
  free(r);
  dsv4_metric_add(s->regions, NULL, -1);
}

/* Executor thread. */
static void reg_run(dsv4_job_t *job) {
  reg_job_t *j = (reg_job_t *)job;
  dsv4_engine_t *e = j->c->srv->d->engine;
  if (j->reg) {
    j->rc = dsv4_engine_host_register(e, j->r->base, j->r->size);
    return;
  }
  for (region_t *r = j->r; r; r = r->next)
    dsv4_engine_host_unregister(e, r->base);
}

/* Loop thread: a registration or an unregistration has run on the executor. */
static void reg_done(dsv4_job_t *job) {
  reg_job_t *j = (reg_job_t *)job;
  conn_t *c = j->c;
  c->busy = 0;
  if (j->reg && j->rc) {
    answer_error(c, "register", j->rc, "the backend cannot register the region", NULL);
    region_unmap(c->srv, j->r);
  } else if (j->reg) {
    j->r->next = c->regions;
    c->regions = j->r;
    c->n_regions++;
    answer_ok(
        c, "register",
        json_pack("{s:I,s:I}", "region", (json_int_t)j->r->id, "bytes", (json_int_t)j->r->size));
  } else {
    while (j->r) {
      region_t *r = j->r;
      j->r = r->next;
      region_unmap(c->srv, r);
    }
    if (!c->closing)
      answer_ok(c, "unregister", json_object());
  }
  free(j);
  if (c->closing)
    conn_close(c);
  else
    conn_update(c);
}

/* Queue a (un)registration; the connection is busy until reg_done. A teardown is never refused. */
static int reg_submit(conn_t *c, region_t *r, int reg) {
  reg_job_t *j = calloc(1, sizeof(*j));
  if (!j)
    return DSV4_ENOMEM;
  j->c = c;
  j->r = r;
  j->reg = reg;
  j->job.run = reg_run;
  j->job.done = reg_done;
  j->job.cls = DSV4_JOB_CONTROL;
  if (reg) {
    int rc = dsv4_executor_submit(&c->srv->d->ex, &j->job);
    if (rc) {
      free(j);
      return rc;
    }
  } else {
    dsv4_executor_submit_force(&c->srv->d->ex, &j->job);
  }
  c->busy = 1;
  return 0;
}

/* The checks of a registered descriptor: a sealed memfd of a size the daemon maps. 0, or an
 * error code with why. */
static int region_check(int fd, size_t *size, char *why, size_t why_len) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    snprintf(why, why_len, "the descriptor is not a memory file (memfd_create)");
    return DSV4_EINVAL;
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & SHM_SEALS) != SHM_SEALS) {
    snprintf(why, why_len,
             "the region is not sealed against resizing: create it with MFD_ALLOW_SEALING and add "
             "F_SEAL_SHRINK and F_SEAL_GROW before registering it (seals 0x%x)",
             seals < 0 ? 0 : seals);
    return DSV4_EINVAL;
  }
  if (seals & SHM_NO_WRITE_SEALS) {
    snprintf(why, why_len, "the region is sealed against writing: the daemon writes outputs there");
    return DSV4_EINVAL;
  }
  if (st.st_size <= 0 || (uint64_t)st.st_size > SHM_MAX_REGION_BYTES) {
    snprintf(why, why_len, "a region has 1 to %" PRIu64 " bytes, not %lld", SHM_MAX_REGION_BYTES,
             (long long)st.st_size);
    return DSV4_EINVAL;
  }
  *size = (size_t)st.st_size;
  return 0;
}

static int token_ok(const dsv4_shm_server_t *s, json_t *tok) {
  if (!s->token)
    return 1;
  if (!json_is_string(tok))
    return 0;
  /* Compared in time independent of where the first difference is. */
  size_t n = strlen(s->token), m = json_string_length(tok);
  const char *t = json_string_value(tok);
  unsigned diff = n != m;
  for (size_t i = 0; i < m; i++)
    diff |= (unsigned)(t[i] ^ s->token[i % n]);
  return diff == 0;
}

static void op_register(conn_t *c, json_t *msg, const int *fds, int nfd) {
  char why[256];
  size_t size = 0;
  if (!token_ok(c->srv, json_object_get(msg, "token"))) {
    answer_error(c, "register", DSV4_EUNAUTH, "a registration needs the data plane's token", NULL);
    return;
  }
  if (nfd != 1) {
    answer_error(c, "register", DSV4_EINVAL,
                 nfd ? "a registration carries exactly one descriptor"
                     : "a registration carries the region's descriptor (SCM_RIGHTS)",
                 NULL);
    return;
  }
  if (c->n_regions >= SHM_MAX_REGIONS) {
    snprintf(why, sizeof(why), "a connection holds at most %d regions", SHM_MAX_REGIONS);
    answer_error(c, "register", DSV4_EINVAL, why, NULL);
    return;
  }
  int rc = region_check(fds[0], &size, why, sizeof(why));
  if (rc) {
    answer_error(c, "register", rc, why, NULL);
    return;
  }
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  region_t *r = base != MAP_FAILED ? calloc(1, sizeof(*r)) : NULL;
  if (!r) {
    snprintf(why, sizeof(why), "cannot map the region: %s",
             base == MAP_FAILED ? strerror(errno) : "out of memory");
    if (base != MAP_FAILED)
      munmap(base, size);
    answer_error(c, "register", DSV4_ENOMEM, why, NULL);
    return;
  }
  r->id = ++c->next_id;
  r->base = base;
  r->size = size;
  dsv4_metric_add(c->srv->regions, NULL, 1);
  rc = reg_submit(c, r, 1);
  if (rc) {
    region_unmap(c->srv, r);
    answer_error(c, "register", rc, NULL, NULL);
  }
}

static void op_unregister(conn_t *c, json_t *msg) {
  json_t *id = json_object_get(msg, "region");
  region_t **p =
      region_find(c, json_is_integer(id), json_is_integer(id) ? json_integer_value(id) : 0);
  if (!p) {
    answer_error(c, "unregister", DSV4_ENOTFOUND, "no such region on this connection",
                 json_pack("{s:O?}", "region", id));
    return;
  }
  region_t *r = *p;
  *p = r->next;
  r->next = NULL;
  c->n_regions--;
  (void)reg_submit(c, r, 0);
}

/* ---- forward ---- */

/* The outputs the request asks for, with their dtypes, shapes and sizes. */
static void outputs_wanted(conn_t *c, const dsv4_forward_req_t *p, uint32_t heads, uint32_t topk) {
  int64_t n = p->n_tokens, h = heads, k = topk;
  size_t q = p->q_bytes, lse = (size_t)n * heads * sizeof(float);
  const out_t outs[OUT_COUNT] = {
      [OUT_Q] = {p->want_q, DSV4_ST_BF16, 3, {n, h, DSV4_HEAD_DIM}, q, 0},
      [OUT_SLOTS] = {1, DSV4_ST_I64, 1, {n}, (size_t)n * sizeof(int64_t), 0},
      [OUT_ATTN] = {p->want_attn, DSV4_ST_BF16, 3, {n, h, DSV4_HEAD_DIM}, q, 0},
      [OUT_LSE] = {p->want_lse, DSV4_ST_F32, 2, {n, h}, lse, 0},
      [OUT_TOPK] = {p->want_topk, DSV4_ST_I32, 2, {n, k}, (size_t)n * topk * sizeof(int32_t), 0},
  };
  memcpy(c->out, outs, sizeof(outs));
  c->want_digest = p->want_digest;
}

/* Whether [off, off + n) shares a byte with [o2, o2 + n2). */
static int overlaps(size_t off, size_t n, size_t o2, size_t n2) {
  return off < o2 + n2 && o2 < off + n;
}

/* "out": an offset for exactly the outputs asked for, each inside the region, on a multiple of
 * its element size and sharing no byte with an input or another output. */
static int place_outputs(conn_t *c, const dsv4_shm_fwd_t *m, const region_t *r,
                         const dsv4_st_view_t *v, char *why, size_t why_len) {
  if (!m->out_object) {
    snprintf(why, why_len, "\"out\" must be an object of output offsets in the region");
    return DSV4_EINVAL;
  }
  for (size_t k = 0; k < m->n_outs; k++) {
    int i = 0;
    while (i < OUT_COUNT && strcmp(m->outs[k].name, out_names[i]))
      i++;
    if (i == OUT_COUNT || !c->out[i].wanted) {
      snprintf(why, why_len, "\"out\" names \"%.32s\", which the outputs asked for do not have",
               m->outs[k].name);
      return DSV4_EINVAL;
    }
  }
  for (int i = 0; i < OUT_COUNT; i++) {
    out_t *o = &c->out[i];
    if (!o->wanted)
      continue;
    const dsv4_shm_out_t *j = NULL;
    for (size_t k = 0; k < m->n_outs && !j; k++)
      j = strcmp(m->outs[k].name, out_names[i]) ? NULL : &m->outs[k];
    size_t elem = dsv4_st_dtype_size(o->dtype);
    if (!j || !j->ok) {
      snprintf(why, why_len, "\"out\" needs the offset of \"%s\" (an integer >= 0)", out_names[i]);
      return DSV4_EINVAL;
    }
    uint64_t off = (uint64_t)j->off;
    if (off > r->size || o->nbytes > r->size - off || off % elem) {
      snprintf(why, why_len, "output \"%s\" at %" PRIu64 " (%zu bytes) is %s the %zu-byte region",
               out_names[i], off, o->nbytes,
               off % elem ? "not aligned to its element size in" : "outside", r->size);
      return DSV4_EINVAL;
    }
    o->off = (size_t)off;
    for (size_t t = 0; t < v->n_tensors; t++)
      if (overlaps(o->off, o->nbytes, v->tensors[t].offset, v->tensors[t].nbytes)) {
        snprintf(why, why_len, "output \"%s\" overlaps input \"%s\"", out_names[i],
                 v->tensors[t].name);
        return DSV4_EINVAL;
      }
    for (int k = 0; k < i; k++)
      if (c->out[k].wanted && overlaps(o->off, o->nbytes, c->out[k].off, c->out[k].nbytes)) {
        snprintf(why, why_len, "output \"%s\" overlaps output \"%s\"", out_names[i], out_names[k]);
        return DSV4_EINVAL;
      }
  }
  return 0;
}

/*
 * The 200 answer of a forward, as answer_ok would write it from its JSON document (the metadata,
 * the tensors in the order of out_names, status, instance), but formatted directly: every value is
 * a number, a hex digest or a fixed word, so nothing needs escaping, and the answer of a decode
 * step costs no document built and dumped. NULL when out of memory; its length in *len.
 */
static char *forward_answer(const conn_t *c, const dsv4_forward_t *f, size_t *len) {
  char *t = NULL;
  FILE *x = open_memstream(&t, len);
  if (!x)
    return NULL;
  const char *sep = "";
  fputs("{\"metadata\":{", x);
  if (c->want_digest) {
    fprintf(x, "\"cache_digest\":\"%016" PRIx64 "\"", f->digest);
    sep = ",";
  }
  if (f->attn) {
    fprintf(x, "%s\"attention\":\"%s\"", sep,
            f->attention == DSV4_ATTENTION_FAST ? "fast" : "exact");
    sep = ",";
  }
  if (f->replayed)
    fprintf(x, "%s\"replayed\":\"true\"", sep);
  fputs("},\"tensors\":{", x);
  sep = "";
  for (int i = 0; i < OUT_COUNT; i++) {
    const out_t *o = &c->out[i];
    if (!o->wanted)
      continue;
    fputs(sep, x);
    dsv4_st_put_entry(x, out_names[i], o->dtype, o->ndim, o->shape, o->off, o->off + o->nbytes);
    sep = ",";
  }
  fprintf(x, "},\"status\":200,\"instance\":\"%s\"}", c->srv->d->instance);
  if (fclose(x) != 0) { /* out of memory: no answer rather than a cut one */
    free(t);
    return NULL;
  }
  return t;
}

/*
 * Executor thread (dsv4_region_forward_t.answer_now): the 200 answer of the forward that just ran,
 * sent at once when the socket takes it without blocking (a SOCK_SEQPACKET message goes whole or
 * not at all), so that it does not wait for the loop thread. While the forward is in flight the
 * loop reads and sends nothing on the connection and keeps it open (busy), and what this reads of
 * it was set before the batch was submitted.
 */
static int forward_now(void *arg, const dsv4_forward_t *f) {
  conn_t *c = arg;
  size_t len = 0;
  char *text = forward_answer(c, f, &len);
  if (!text)
    return 0;
  ssize_t n = send(c->fd, text, len, MSG_DONTWAIT | MSG_NOSIGNAL);
  free(text);
  if (n != (ssize_t)len)
    return 0; /* the loop sends it (again), and sees a failed socket for itself */
  c->t_sent = uv_hrtime();
  c->sent = 1;
  return 1;
}

/* Loop thread: the forward in flight has its result. */
static void forward_done(void *arg, int rc, const char *message, json_t *details,
                         const dsv4_forward_t *f) {
  conn_t *c = arg;
  c->busy = 0;
  if (rc) {
    answer_error(c, "forward", rc, message, details);
  } else {
    count(c, "forward", 200);
    if (!c->sent) {
      size_t len = 0;
      char *text = forward_answer(c, f, &len);
      send_text(c, text, len);
    }
    /* The daemon's whole time for the forward, as dsv4d_forward_request_seconds is over HTTP. */
    const char *cls[1] = {dsv4_forward_is_decode(f) ? "decode" : "prefill"};
    uint64_t t = c->sent ? c->t_sent : uv_hrtime();
    dsv4_metric_observe(c->srv->forward_seconds, cls, (double)(t - c->t_recv) * 1e-9);
  }
  c->sent = 0;
  if (c->closing)
    conn_close(c);
  else
    conn_update(c);
}

/*
 * The segments' text after a forward's JSON object ("segments_bytes": its length; SPEC §6.1): as
 * __metadata__ "segments" would give it, but never lexed as a JSON string (4 KiB of escaped
 * segments cost jansson about 35 us to read, and the client as much to write). Into p->segs_given;
 * 0 when the message has none.
 */
static int segments_after(const dsv4_shm_fwd_t *m, const trailer_t *tr, dsv4_forward_req_t *p,
                          char *why, size_t why_len) {
  if (!m->segs_given)
    return 0;
  if (m->segs_bytes < 1 || (uint64_t)m->segs_bytes != tr->len) {
    snprintf(why, why_len,
             "\"segments_bytes\" must be the length of the segments text after the message (%zu "
             "bytes follow it)",
             tr->len);
    return DSV4_EINVAL;
  }
  if (dsv4_st_meta(&p->view, "segments")) {
    snprintf(why, why_len, "the segments are given twice: in __metadata__ and after the message");
    return DSV4_EINVAL;
  }
  if (memchr(tr->text, 0, tr->len)) {
    snprintf(why, why_len, "the segments text after the message holds a NUL byte");
    return DSV4_EINVAL;
  }
  p->segs_given = malloc(tr->len + 1);
  if (!p->segs_given)
    return DSV4_ENOMEM;
  memcpy(p->segs_given, tr->text, tr->len);
  p->segs_given[tr->len] = '\0';
  return 0;
}

/*
 * The request as the HTTP body would be checked: the header's tensors in the region, then the
 * same parse, then the outputs' places. kv and the compressed branch's tensors are copied out of
 * the region, so the cache and the rings only ever holds bytes that passed the range check; q is
 * read where the client wrote it (a client that writes it during its own request changes only its
 * own answer).
 */
static int forward_parse(conn_t *c, dsv4_shm_fwd_t *m, region_t *r, const trailer_t *tr,
                         dsv4_forward_req_t *p, char *why, size_t why_len) {
  const dsv4_forward_limits_t lim = dsv4_forward_limits(c->srv->d);
  memset(p, 0, sizeof(*p));
  dsv4_st_raw_t *raw = m->raw;
  m->raw = NULL; /* the view takes it */
  int rc = raw ? dsv4_st_view_region_raw(raw, r->base, r->size, &p->view)
               : dsv4_st_view_region(m->header, r->base, r->size, &p->view);
  if (rc) {
    snprintf(why, why_len, "malformed region header: %s", p->view.error);
    memset(&p->view, 0, sizeof(p->view));
    return rc;
  }
  rc = segments_after(m, tr, p, why, why_len);
  if (!rc)
    rc = dsv4_forward_parse_view(&lim, p, why, why_len);
  if (rc)
    return rc;
  outputs_wanted(c, p, lim.heads, c->srv->d->cfg->model.index_topk);
  rc = place_outputs(c, m, r, &p->view, why, why_len);
  if (rc)
    return rc;
  return dsv4_forward_req_own_cache_inputs(p);
}

static void op_forward(conn_t *c, dsv4_shm_fwd_t *m, const trailer_t *tr, uint64_t t_recv) {
  char why[320] = "";
  c->t_recv = t_recv;
  dsv4_forward_req_t p;
  region_t **rp = region_find(c, m->region_ok, m->region);
  if (!rp) {
    answer_error(c, "forward", DSV4_ENOTFOUND, "no such region on this connection",
                 m->region_ok && !m->region_json
                     ? json_pack("{s:I}", "region", (json_int_t)m->region)
                     : json_pack("{s:O?}", "region", m->region_json));
    return;
  }
  if (m->deadline_given && !m->deadline_ok) {
    answer_error(c, "forward", DSV4_EINVAL, "\"deadline_ms\" must be a whole number of ms", NULL);
    return;
  }
  dsv4_region_forward_t rf = {.done = forward_done, .answer_now = forward_now, .arg = c};
  int rc = forward_parse(c, m, *rp, tr, &p, why, sizeof(why));
  if (!rc) {
    uint8_t *base = (*rp)->base;
    rf.q_out = c->out[OUT_Q].wanted ? (uint16_t *)(void *)(base + c->out[OUT_Q].off) : NULL;
    rf.slots = (int64_t *)(void *)(base + c->out[OUT_SLOTS].off);
    rf.attn = c->out[OUT_ATTN].wanted ? (uint16_t *)(void *)(base + c->out[OUT_ATTN].off) : NULL;
    rf.lse = c->out[OUT_LSE].wanted ? (float *)(void *)(base + c->out[OUT_LSE].off) : NULL;
    rf.topk = c->out[OUT_TOPK].wanted ? (int32_t *)(void *)(base + c->out[OUT_TOPK].off) : NULL;
  }
  if (m->deadline_given) {
    /* A deadline beyond the clock's range saturates, as Dsv4d-Deadline-Ms does. */
    uint64_t ms = (uint64_t)m->deadline_ms;
    uint64_t span = ms > UINT64_MAX / NS_PER_MS ? UINT64_MAX : ms * NS_PER_MS;
    rf.deadline_ns = span > UINT64_MAX - t_recv ? UINT64_MAX : t_recv + span;
  }
  if (!rc) {
    c->busy = 1; /* first: a batch run at once is answered inside the call (forward_done) */
    rc = dsv4_forward_submit_region(c->srv->d, &p, &rf, why, sizeof(why));
    if (rc)
      c->busy = 0;
  }
  /* SPEC §8.8: a refused compressed tensor is named with the reason, as over HTTP. */
  json_t *det = rc && p.bad_tensor
                    ? json_pack("{s:s,s:s}", "tensor", p.bad_tensor, "reason", p.bad_reason)
                    : NULL;
  dsv4_forward_req_free(&p);
  if (rc)
    answer_error(c, "forward", rc, why, det);
}

/* ---- connections ---- */

/* The descriptors a message brought (SCM_RIGHTS), at most SHM_MAX_FDS; -1 when it brought more
 * or they were cut short (every one then closed). */
static int take_fds(struct msghdr *mh, int *fds) {
  int n = 0, bad = (mh->msg_flags & MSG_CTRUNC) != 0;
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
      continue;
    size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (n < SHM_MAX_FDS)
        fds[n++] = fd;
      else
        close(fd), bad = 1;
    }
  }
  if (bad) {
    for (int i = 0; i < n; i++)
      close(fds[i]);
    return -1;
  }
  return n;
}

static int all_space(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] != ' ' && s[i] != '\t' && s[i] != '\n' && s[i] != '\r')
      return 0;
  return 1;
}

static void dispatch(conn_t *c, size_t len, int trunc, const int *fds, int nfd, uint64_t t_read) {
  json_error_t jerr;
  if (trunc) {
    char why[96];
    snprintf(why, sizeof(why), "a message holds at most %u bytes", SHM_MAX_MSG);
    answer_error(c, "other", DSV4_ETOOBIG, why, NULL);
    return;
  }
  if (nfd < 0) {
    answer_error(c, "other", DSV4_EINVAL, "too many descriptors in one message", NULL);
    return;
  }
  /* A forward of the usual shape is read without a document (shm_msg.h), with the same answers. */
  dsv4_shm_fwd_t fm;
  size_t used = 0;
  if (!nfd && dsv4_shm_fwd_scan((const char *)c->srv->rx, len, &fm, &used) == 0) {
    trailer_t st = {(const char *)c->srv->rx + used, len - used};
    op_forward(c, &fm, &st, t_read);
    dsv4_shm_fwd_free(&fm);
    return;
  }
  /* The JSON object, then (a forward with "segments_bytes") the segments' text: anything else
   * after the object but white space makes the message no JSON, as the parser alone would say. */
  json_t *msg = json_loadb((const char *)c->srv->rx, len,
                           JSON_REJECT_DUPLICATES | JSON_DISABLE_EOF_CHECK, &jerr);
  trailer_t tr = {NULL, 0};
  const char *op = json_string_value(json_object_get(msg, "op"));
  if (msg && (size_t)jerr.position < len) {
    tr.text = (const char *)c->srv->rx + jerr.position;
    tr.len = len - (size_t)jerr.position;
    if (!all_space(tr.text, tr.len) &&
        !(op && !strcmp(op, "forward") && json_object_get(msg, "segments_bytes"))) {
      json_decref(msg);
      msg = NULL;
      op = NULL;
    }
  }
  if (!json_is_object(msg) || !op) {
    answer_error(c, "other", DSV4_EINVAL,
                 msg ? "a message is a JSON object with \"op\"" : "a message must be JSON", NULL);
  } else if (!strcmp(op, "register")) {
    op_register(c, msg, fds, nfd);
  } else if (nfd) {
    answer_error(c, "other", DSV4_EINVAL, "only a registration carries a descriptor", NULL);
  } else if (!strcmp(op, "forward")) {
    if (dsv4_shm_fwd_from_doc(msg, &fm) == 0)
      op_forward(c, &fm, &tr, t_read);
    else
      answer_error(c, "forward", DSV4_ENOMEM, "out of memory reading the message", NULL);
    dsv4_shm_fwd_free(&fm);
  } else if (!strcmp(op, "unregister")) {
    op_unregister(c, msg);
  } else {
    answer_error(c, "other", DSV4_EINVAL, "unknown \"op\" (one of register, unregister, forward)",
                 NULL);
  }
  json_decref(msg);
}

static void conn_read(conn_t *c) {
  int fds[SHM_MAX_FDS];
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(SHM_MAX_FDS * sizeof(int))];
  } ctl;
  struct iovec iov = {c->srv->rx, SHM_MAX_MSG};
  struct msghdr mh = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf)};
  ssize_t n = recvmsg(c->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
    return;
  const uint64_t t_read = uv_hrtime();
  int nfd = n >= 0 ? take_fds(&mh, fds) : 0;
  if (n <= 0) { /* the peer left (0), or the socket failed */
    for (int i = 0; i < nfd; i++)
      close(fds[i]);
    conn_close(c);
    return;
  }
  dispatch(c, (size_t)n, (mh.msg_flags & MSG_TRUNC) != 0, fds, nfd, t_read);
  /* A registration has mapped its descriptor, or refused it: the daemon keeps none. */
  for (int i = 0; i < nfd; i++)
    close(fds[i]);
  if (!c->closing)
    conn_update(c);
}

static void conn_flush(conn_t *c) {
  ssize_t n = send(c->fd, c->pending, c->pending_len, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
    return;
  free(c->pending);
  c->pending = NULL;
  if (n < 0)
    conn_close(c);
}

static void on_conn(uv_poll_t *h, int status, int events) {
  conn_t *c = (conn_t *)h;
  if (status < 0) {
    conn_close(c);
    return;
  }
  if ((events & UV_WRITABLE) && c->pending)
    conn_flush(c);
  if (!c->closing && (events & UV_READABLE)) {
    if (c->busy || c->pending) /* the client sent before its answer: read it after that */
      conn_arm(c, c->armed & ~UV_READABLE);
    else
      conn_read(c);
  }
  if (!c->closing)
    conn_update(c);
}

/* The poll handle waiting for ev, touched only when ev changes: libuv's uv_poll_start takes the
 * descriptor out of epoll and puts it back even for the same events. */
static void conn_arm(conn_t *c, int ev) {
  if (ev == c->armed)
    return;
  if (ev)
    uv_poll_start(&c->poll, ev, on_conn);
  else
    uv_poll_stop(&c->poll);
  c->armed = ev;
}

/*
 * Wait for what the connection can do next: a message when idle, room for a pending answer. While
 * a request is in flight the handle stays armed for reading, as it was, until the client sends
 * anyway (on_conn then disarms it until the answer): a client that waits for its answers costs no
 * epoll_ctl per request.
 */
static void conn_update(conn_t *c) {
  int ev = 0;
  if (!c->pending && !c->srv->draining && (!c->busy || (c->armed & UV_READABLE)))
    ev |= UV_READABLE;
  if (c->pending)
    ev |= UV_WRITABLE;
  if (c->srv->draining && !c->busy && !c->pending) {
    conn_close(c); /* drained: nothing in flight and nothing to send */
    return;
  }
  conn_arm(c, ev);
}

static void server_maybe_done(dsv4_shm_server_t *s) {
  if (!s->closing || s->handles)
    return;
  void (*cb)(void *) = s->close_cb;
  void *arg = s->close_arg;
  free(s->path);
  free(s->token);
  free(s->rx);
  free(s);
  if (cb)
    cb(arg);
}

static void on_conn_closed(uv_handle_t *h) {
  conn_t *c = (conn_t *)h;
  dsv4_shm_server_t *s = c->srv;
  close(c->fd);
  free(c->pending);
  free(c);
  s->handles--;
  server_maybe_done(s);
}

/* Tear a connection down: once no request is in flight, its regions are unregistered (one
 * executor job) and unmapped, then its handle closes. */
static void conn_close(conn_t *c) {
  if (!c->closing) {
    dsv4_shm_server_t *s = c->srv;
    c->closing = 1;
    uv_poll_stop(&c->poll);
    if (c->prev)
      c->prev->next = c->next;
    else
      s->conns = c->next;
    if (c->next)
      c->next->prev = c->prev;
    s->n_conns--;
  }
  if (c->busy)
    return; /* reg_done or forward_done comes back here */
  if (c->regions) {
    region_t *all = c->regions;
    c->regions = NULL;
    c->n_regions = 0;
    (void)reg_submit(c, all, 0);
    return;
  }
  if (!uv_is_closing((uv_handle_t *)&c->poll))
    uv_close((uv_handle_t *)&c->poll, on_conn_closed);
}

/* A client past max_connections is told why and closed. */
static void refuse(dsv4_shm_server_t *s, int fd) {
  char *text = NULL;
  json_t *doc = json_pack("{s:i,s:s,s:{s:s,s:s}}", "status", 503, "instance", s->d->instance,
                          "error", "code", dsv4_http_error(DSV4_ECONNLIMIT).code, "message",
                          "the shared-region socket serves no more connections now");
  if (doc && (text = json_dumps(doc, JSON_COMPACT)))
    (void)send(fd, text, strlen(text), MSG_DONTWAIT | MSG_NOSIGNAL);
  free(text);
  json_decref(doc);
  close(fd);
}

static void on_listen(uv_poll_t *h, int status, int events);

static void on_retry(uv_timer_t *t) {
  dsv4_shm_server_t *s = t->data;
  if (s->listening)
    uv_poll_start(&s->poll, UV_READABLE, on_listen);
}

static void on_listen(uv_poll_t *h, int status, int events) {
  dsv4_shm_server_t *s = (dsv4_shm_server_t *)h;
  (void)events;
  if (status < 0)
    return;
  for (;;) {
    int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
      uv_poll_stop(&s->poll);
      uv_timer_start(&s->retry, on_retry, ACCEPT_RETRY_MS, 0);
    }
    if (fd < 0)
      return; /* EAGAIN: all taken; anything else: that client is gone */
    if (s->max_connections && s->n_conns >= s->max_connections) {
      refuse(s, fd);
      continue;
    }
    conn_t *c = calloc(1, sizeof(*c));
    if (!c || uv_poll_init_socket(s->d->loop, &c->poll, fd) != 0) {
      free(c);
      close(fd);
      continue;
    }
    c->srv = s;
    c->fd = fd;
    c->next = s->conns;
    if (s->conns)
      s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    s->handles++;
    conn_update(c);
  }
}

/* ---- the server ---- */

int dsv4_shm_listen(dsv4_daemon_t *d, const char *path, const char *token, size_t max_connections,
                    dsv4_shm_server_t **out) {
  static const char *const labels[2] = {"op", "code"}, *cls[1] = {"class"};
  dsv4_shm_server_t *s = calloc(1, sizeof(*s));
  *out = NULL;
  if (!s || !(s->rx = malloc(SHM_MAX_MSG)) || !(s->path = strdup(path)) ||
      (token && !(s->token = strdup(token))) ||
      dsv4_metrics_counter(d->metrics, "dsv4d_shm_requests_total",
                           "Shared-region messages answered, by op and status.", labels, 2,
                           &s->requests) ||
      dsv4_metrics_gauge(d->metrics, "dsv4d_shm_regions", "Shared regions mapped.", NULL, 0,
                         &s->regions) ||
      dsv4_metrics_histogram(d->metrics, "dsv4d_shm_forward_seconds",
                             "Shared-region forwards answered 200, by class (decode, prefill): "
                             "from the message read to its answer sent.",
                             cls, 1, dsv4_seconds_bounds, DSV4_SECONDS_BOUNDS,
                             &s->forward_seconds)) {
    if (s) {
      free(s->rx);
      free(s->path);
      free(s->token);
    }
    free(s);
    return DSV4_ENOMEM;
  }
  s->d = d;
  s->max_connections = max_connections;
  dsv4_metric_set(s->regions, NULL, 0);
  int rc = dsv4_unix_listen("shm", path, SOCK_SEQPACKET, &s->fd, &s->dev, &s->ino);
  if (!rc && uv_poll_init_socket(d->loop, &s->poll, s->fd) != 0) {
    close(s->fd);
    dsv4_unix_unlink_own(path, s->dev, s->ino);
    rc = DSV4_EIO;
  }
  if (rc) {
    free(s->rx);
    free(s->path);
    free(s->token);
    free(s);
    return rc;
  }
  s->listening = 1;
  s->handles = 2; /* the listener's poll handle and the retry timer */
  uv_timer_init(d->loop, &s->retry);
  s->retry.data = s;
  s->poll.data = s;
  uv_poll_start(&s->poll, UV_READABLE, on_listen);
  *out = s;
  return 0;
}

/* The listener's poll handle or its retry timer has closed (data: the server). */
static void on_listen_closed(uv_handle_t *h) {
  dsv4_shm_server_t *s = h->data;
  s->handles--;
  server_maybe_done(s);
}

static void stop_listening(dsv4_shm_server_t *s) {
  if (!s->listening)
    return;
  s->listening = 0;
  uv_close((uv_handle_t *)&s->poll, on_listen_closed);
  uv_close((uv_handle_t *)&s->retry, on_listen_closed);
  close(s->fd);
  dsv4_unix_unlink_own(s->path, s->dev, s->ino);
}

void dsv4_shm_drain(dsv4_shm_server_t *s) {
  if (s->draining || s->closing)
    return;
  s->draining = 1;
  stop_listening(s);
  for (conn_t *c = s->conns, *nx; c; c = nx) {
    nx = c->next;
    conn_update(c);
  }
}

size_t dsv4_shm_connections(const dsv4_shm_server_t *s) {
  return s->n_conns;
}

void dsv4_shm_close(dsv4_shm_server_t *s, void (*cb)(void *), void *arg) {
  if (s->closing)
    return;
  s->closing = 1;
  s->close_cb = cb;
  s->close_arg = arg;
  stop_listening(s);
  while (s->conns)
    conn_close(s->conns);
  server_maybe_done(s);
}
