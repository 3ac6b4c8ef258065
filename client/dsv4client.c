/*
 * libdsv4client (dsv4client.h): the messages of SPEC §6.1 over a SOCK_SEQPACKET socket, one JSON
 * object each way. A forward's message is written directly into buffers the client keeps, and its
 * 200 answer read without a document; anything else (a name that needs escaping, an error, the
 * region messages) is built and read with jansson.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, MFD_ALLOW_SEALING, F_ADD_SEALS */
#endif
#include "dsv4client.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

/* The largest answer read: answers are small (an error, or the outputs' header). */
#define ANSWER_MAX (64u << 10)
/* Room for a forward request of about 1000 segments in one message (the daemon takes 256 KiB). */
#define SEND_BUFFER (1u << 20)
#define BF16_BYTES 2u
#define HEAD_DIM 512u

/* The longest poll for an answer before sleeping (dsv4c_set_spin). */
#define SPIN_MAX_US 10000u

/* A text that grows, written without stdio (a decode step's message is built at every call). */
typedef struct {
  char *p;
  size_t len, cap;
  int oom; /* a growth failed: the text is incomplete */
} text_t;

struct dsv4c_client {
  int fd;
  char *token;
  uint32_t spin_us;
  /* Kept from call to call (one request at a time): a forward's message, its segments' text, and
   * the answer read. */
  text_t msg, segs;
  char *answer;
};

struct dsv4c_region {
  uint8_t *base;
  size_t size;
  uint32_t id;
  const dsv4c_client_t *client; /* the connection the id belongs to */
};

int dsv4c_connect(const char *path, const char *token, dsv4c_client_t **out) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  *out = NULL;
  if (strlen(path) >= sizeof(addr.sun_path))
    return -ENAMETOOLONG;
  memcpy(addr.sun_path, path, strlen(path) + 1);
  dsv4c_client_t *c = calloc(1, sizeof(*c));
  if (!c || (token && !(c->token = strdup(token)))) {
    free(c);
    return -ENOMEM;
  }
  c->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  int sndbuf = SEND_BUFFER;
  if (c->fd < 0 || connect(c->fd, (const struct sockaddr *)&addr, sizeof(addr)) != 0) {
    int err = -errno;
    if (c->fd >= 0)
      close(c->fd);
    free(c->token);
    free(c);
    return err;
  }
  /* The kernel caps it at net.core.wmem_max: a larger message then fails with EMSGSIZE. */
  (void)setsockopt(c->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  *out = c;
  return 0;
}

void dsv4c_close(dsv4c_client_t *c) {
  if (!c)
    return;
  close(c->fd);
  free(c->token);
  free(c->msg.p);
  free(c->segs.p);
  free(c->answer);
  free(c);
}

void dsv4c_set_spin(dsv4c_client_t *c, uint32_t spin_us) {
  c->spin_us = spin_us < SPIN_MAX_US ? spin_us : SPIN_MAX_US;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* recv of the answer: polled without sleeping for up to c->spin_us, then blocking (flags 0). */
static ssize_t recv_answer(const dsv4c_client_t *c, char *buf, int flags) {
  ssize_t n;
  if (!flags && c->spin_us) {
    const uint64_t until = now_ns() + (uint64_t)c->spin_us * 1000u;
    for (uint32_t i = 1;; i++) {
      n = recv(c->fd, buf, ANSWER_MAX, MSG_DONTWAIT);
      if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return n;
      if (!(i & 15) && now_ns() >= until)
        break;
    }
  }
  do
    n = recv(c->fd, buf, ANSWER_MAX, flags);
  while (n < 0 && errno == EINTR);
  return n;
}

void dsv4c_result_free(dsv4c_result_t *r) {
  if (r) {
    free(r->json);
    r->json = NULL;
  }
}

static void copy_str(char *dst, size_t cap, json_t *v) {
  snprintf(dst, cap, "%s", json_is_string(v) ? json_string_value(v) : "");
}

/* ---- a forward's 200 answer as the daemon formats it (server/shm.c, forward_answer) ---- */

typedef struct {
  const char *p, *end;
} scan_t;

/* The literal lit next, taken. */
static int lit(scan_t *s, const char *lit) {
  const size_t n = strlen(lit);
  if ((size_t)(s->end - s->p) < n || memcmp(s->p, lit, n))
    return 0;
  s->p += n;
  return 1;
}

/* A string of 1..cap-1 characters of set (letters, digits, '_') up to its quote, into out. */
static int word(scan_t *s, char *out, size_t cap) {
  size_t n = 0;
  while (s->p < s->end && n + 1 < cap &&
         ((*s->p >= 'a' && *s->p <= 'z') || (*s->p >= 'A' && *s->p <= 'Z') ||
          (*s->p >= '0' && *s->p <= '9') || *s->p == '_'))
    out[n++] = *s->p++;
  out[n] = '\0';
  return n > 0 && lit(s, "\"");
}

/* A non-negative integer of 1..19 digits, no leading zero but 0 itself. */
static int uint_(scan_t *s) {
  const char *b = s->p;
  while (s->p < s->end && *s->p >= '0' && *s->p <= '9' && s->p - b < 19)
    s->p++;
  return s->p > b && (s->p - b == 1 || *b != '0') && (s->p == s->end || *s->p < '0' || *s->p > '9');
}

/* One tensor entry: "name":{"dtype":"X","shape":[d,...],"data_offsets":[a,b]}. */
static int tensor_(scan_t *s) {
  char name[16], dtype[16];
  if (!lit(s, "\"") || !word(s, name, sizeof(name)) || !lit(s, ":{\"dtype\":\"") ||
      !word(s, dtype, sizeof(dtype)) || !lit(s, ",\"shape\":["))
    return 0;
  for (int d = 0;; d++) {
    if (d && !lit(s, ","))
      break;
    if (!uint_(s))
      return 0;
  }
  return lit(s, "],\"data_offsets\":[") && uint_(s) && lit(s, ",") && uint_(s) && lit(s, "]}");
}

/*
 * A 200 answer of a forward in exactly the form the daemon writes it (metadata with its optional
 * fields in order, tensor entries, status 200, a 32-digit instance), its fields into res: 0.
 * Anything else (an error answer, another form): 1, and read_answer parses it with jansson.
 */
static int read_forward_ok(const char *text, size_t len, dsv4c_result_t *res) {
  scan_t s = {text, text + len};
  char inst[40];
  memset(res, 0, sizeof(*res));
  if (!lit(&s, "{\"metadata\":{"))
    return 1;
  int more = 0;
  if (lit(&s, "\"cache_digest\":\"")) {
    if (!word(&s, res->cache_digest, sizeof(res->cache_digest)) || strlen(res->cache_digest) != 16)
      return 1;
    more = 1;
  }
  if ((!more || lit(&s, ",")) && lit(&s, "\"attention\":\"")) {
    if (!word(&s, res->attention, sizeof(res->attention)) ||
        (strcmp(res->attention, "exact") && strcmp(res->attention, "fast")))
      return 1;
    more = 1;
  }
  if ((!more || lit(&s, ",")) && lit(&s, "\"replayed\":\"true\""))
    res->replayed = 1;
  if (!lit(&s, "},\"tensors\":{"))
    return 1;
  for (int i = 0; !lit(&s, "}"); i++)
    if ((i && !lit(&s, ",")) || !tensor_(&s))
      return 1;
  if (!lit(&s, ",\"status\":200,\"instance\":\"") || !word(&s, inst, sizeof(inst)) ||
      strlen(inst) != 32 || !lit(&s, "}") || s.p != s.end)
    return 1;
  res->status = 200;
  res->json = strndup(text, len);
  return res->json ? 0 : -ENOMEM;
}

/* The answer's fields into res, read with jansson (any answer). */
static int read_answer_json(const char *text, size_t len, dsv4c_result_t *res) {
  json_error_t jerr;
  json_t *doc = json_loadb(text, len, 0, &jerr);
  memset(res, 0, sizeof(*res));
  if (!json_is_object(doc) || !json_is_integer(json_object_get(doc, "status"))) {
    json_decref(doc);
    return -EPROTO;
  }
  json_t *err = json_object_get(doc, "error"), *meta = json_object_get(doc, "metadata");
  res->status = (int)json_integer_value(json_object_get(doc, "status"));
  copy_str(res->code, sizeof(res->code), json_object_get(err, "code"));
  copy_str(res->message, sizeof(res->message), json_object_get(err, "message"));
  copy_str(res->cache_digest, sizeof(res->cache_digest), json_object_get(meta, "cache_digest"));
  copy_str(res->attention, sizeof(res->attention), json_object_get(meta, "attention"));
  json_t *rep = json_object_get(meta, "replayed");
  res->replayed = json_is_string(rep) && !strcmp(json_string_value(rep), "true");
  res->json = strndup(text, len);
  json_decref(doc);
  return res->json ? 0 : -ENOMEM;
}

/* The answer's fields into res: a forward's 200 answer in the daemon's form without a document
 * (read_forward_ok), anything else with jansson. */
static int read_answer(const char *text, size_t len, dsv4c_result_t *res) {
  const int fast = read_forward_ok(text, len, res);
  return fast <= 0 ? fast : read_answer_json(text, len, res);
}

/* Send one message, the concatenation of iov[0..n-1] (a descriptor attached when fd >= 0), and
 * read its answer into res. */
static int exchange(dsv4c_client_t *c, struct iovec *iov, int n_iov, int fd, dsv4c_result_t *res) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n_iov};
  memset(res, 0, sizeof(*res));
  if (!c->answer && !(c->answer = malloc(ANSWER_MAX)))
    return -ENOMEM;
  if (fd >= 0) {
    memset(&ctl, 0, sizeof(ctl));
    mh.msg_control = ctl.buf;
    mh.msg_controllen = sizeof(ctl.buf);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  }
  ssize_t n;
  do
    n = sendmsg(c->fd, &mh, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  /* A daemon that refused the connection (too many clients) said why before it closed it: that
   * answer is still to be read. */
  int flags = 0, err = n < 0 ? errno : 0;
  if (n < 0 && err != EPIPE && err != ECONNRESET)
    return -err;
  if (n < 0)
    flags = MSG_DONTWAIT;
  char *buf = c->answer;
  n = recv_answer(c, buf, flags);
  /* A peer that closed with our request unread reports the reset first, and its last answer after
   * it. */
  if (n < 0 && errno == ECONNRESET) {
    err = ECONNRESET;
    n = recv(c->fd, buf, ANSWER_MAX, MSG_DONTWAIT);
  }
  if (err && n <= 0)
    return -err;
  return n < 0 ? -errno : n == 0 ? -ECONNRESET : read_answer(buf, (size_t)n, res);
}

int dsv4c_request(dsv4c_client_t *c, const char *msg, int fd, dsv4c_result_t *res) {
  struct iovec iov = {(void *)msg, strlen(msg)};
  return exchange(c, &iov, 1, fd, res);
}

/* Send a message built as a JSON object (taken) and read the answer. */
static int request_doc(dsv4c_client_t *c, json_t *doc, int fd, dsv4c_result_t *res) {
  char *text = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
  json_decref(doc);
  if (!text)
    return -ENOMEM;
  int rc = dsv4c_request(c, text, fd, res);
  free(text);
  return rc;
}

int dsv4c_region_create(dsv4c_client_t *c, size_t bytes, dsv4c_region_t **out,
                        dsv4c_result_t *res) {
  dsv4c_result_t local;
  dsv4c_result_t *r = res ? res : &local;
  long page = sysconf(_SC_PAGESIZE);
  size_t size = (bytes + (size_t)page - 1) & ~((size_t)page - 1);
  *out = NULL;
  memset(r, 0, sizeof(*r));
  if (size == 0)
    return -EINVAL;
  int fd = memfd_create("dsv4-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return -errno;
  dsv4c_region_t *reg = calloc(1, sizeof(*reg));
  void *base = MAP_FAILED;
  int rc = 0;
  /* Sealed before the daemon sees it: neither side can resize it, so no access past its end (and
   * no SIGBUS) is possible on either side. */
  if (!reg || ftruncate(fd, (off_t)size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0 ||
      (base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
    rc = reg ? -errno : -ENOMEM;
  if (!rc) {
    json_t *msg = json_pack("{s:s}", "op", "register");
    if (msg && c->token)
      json_object_set_new(msg, "token", json_string(c->token));
    rc = request_doc(c, msg, fd, r);
    if (!rc && r->status != 200)
      rc = -EPROTO;
  }
  if (!rc) {
    json_t *doc = json_loads(r->json, 0, NULL);
    reg->id = (uint32_t)json_integer_value(json_object_get(doc, "region"));
    json_decref(doc);
  }
  close(fd); /* the mappings, ours and the daemon's, keep the memory */
  if (r == &local)
    dsv4c_result_free(&local);
  if (rc) {
    if (base != MAP_FAILED)
      munmap(base, size);
    free(reg);
    return rc;
  }
  reg->base = base;
  reg->client = c;
  reg->size = size;
  *out = reg;
  return 0;
}

void *dsv4c_region_data(const dsv4c_region_t *r) {
  return r->base;
}

size_t dsv4c_region_size(const dsv4c_region_t *r) {
  return r->size;
}

uint32_t dsv4c_region_id(const dsv4c_region_t *r) {
  return r->id;
}

int dsv4c_region_destroy(dsv4c_client_t *c, dsv4c_region_t *r) {
  int rc = 0;
  if (!r)
    return 0;
  if (c && c != r->client)
    return -EINVAL;
  if (c) {
    dsv4c_result_t res = {0};
    rc = request_doc(c, json_pack("{s:s,s:I}", "op", "unregister", "region", (json_int_t)r->id), -1,
                     &res);
    if (!rc && res.status != 200)
      rc = -EPROTO;
    dsv4c_result_free(&res);
  }
  munmap(r->base, r->size);
  free(r);
  return rc;
}

/* A tensor entry of the header: dtype, shape and where it lies in the region. */
static json_t *typed_entry(const char *dtype, json_t *shape, size_t off, size_t nbytes) {
  return json_pack("{s:s,s:o,s:[I,I]}", "dtype", dtype, "shape", shape, "data_offsets",
                   (json_int_t)off, (json_int_t)(off + nbytes));
}

static json_t *tensor_entry(json_t *shape, size_t off, size_t nbytes) {
  return typed_entry("BF16", shape, off, nbytes);
}

/* A compressed layer's ckv, ikv, iq and iw (SPEC §8.2) into the header, those the batch has. */
static void add_compressed(json_t *header, const dsv4c_forward_t *f, uint64_t n) {
  json_int_t jn = (json_int_t)n, ih = (json_int_t)f->index_heads;
  if (!header)
    return;
  if (f->ckv_width)
    json_object_set_new(header, "ckv",
                        typed_entry("F32", json_pack("[I,I]", jn, (json_int_t)f->ckv_width),
                                    f->ckv_off, (size_t)n * f->ckv_width * 4));
  if (!f->index_heads)
    return;
  json_object_set_new(
      header, "ikv",
      typed_entry("F32", json_pack("[I,I]", jn, (json_int_t)512), f->ikv_off, (size_t)n * 512 * 4));
  json_object_set_new(header, "iq",
                      typed_entry("BF16", json_pack("[I,I,I]", jn, ih, (json_int_t)128), f->iq_off,
                                  (size_t)n * f->index_heads * 128 * BF16_BYTES));
  json_object_set_new(
      header, "iw",
      typed_entry("F32", json_pack("[I,I]", jn, ih), f->iw_off, (size_t)n * f->index_heads * 4));
}

/* Whether name needs no escaping in a JSON string: the characters of a valid sequence name. */
static int plain_name(const char *name) {
  for (const char *c = name; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.' || *c == '_' || *c == ':' || *c == '-'))
      return 0;
  return 1;
}

/* ---- text written without stdio ---- */

/* Room for n more bytes and the terminating NUL: 1, or 0 when the text could not grow (oom). */
static int text_room(text_t *t, size_t n) {
  if (t->oom)
    return 0;
  if (t->len + n < t->cap)
    return 1;
  size_t cap = t->cap ? t->cap : 1024;
  while (cap <= t->len + n)
    cap *= 2;
  char *p = realloc(t->p, cap);
  if (!p) {
    t->oom = 1;
    return 0;
  }
  t->p = p;
  t->cap = cap;
  return 1;
}

static void put_mem(text_t *t, const char *s, size_t n) {
  if (!text_room(t, n))
    return;
  memcpy(t->p + t->len, s, n);
  t->len += n;
  t->p[t->len] = '\0';
}

/* A string literal's bytes. */
#define put_lit(t, lit) put_mem((t), (lit), sizeof(lit) - 1)

static void put_str(text_t *t, const char *s) {
  put_mem(t, s, strlen(s));
}

static void put_u64(text_t *t, uint64_t v) {
  char b[20];
  size_t i = sizeof(b);
  do
    b[--i] = (char)('0' + v % 10);
  while (v /= 10);
  put_mem(t, b + i, sizeof(b) - i);
}

static void put_i64(text_t *t, int64_t v) {
  if (v < 0)
    put_lit(t, "-");
  put_u64(t, v < 0 ? 0 - (uint64_t)v : (uint64_t)v);
}

/* t emptied for a new text. */
static void text_reset(text_t *t) {
  t->len = 0;
  t->oom = 0;
  if (text_room(t, 0))
    t->p[0] = '\0';
}

/* The segments' JSON text written directly into t when every name is plain (a gateway's many
 * one-token segments cost a JSON document per call otherwise): 1, with *n_tokens their tokens; 0
 * when a name needs jansson, which escapes what needs it. t->oom tells a text cut short. */
static int segments_plain(const dsv4c_forward_t *f, text_t *t, uint64_t *n_tokens) {
  for (uint32_t i = 0; i < f->n_segs; i++)
    if (!f->segs[i].seq || !plain_name(f->segs[i].seq))
      return 0;
  text_reset(t);
  put_lit(t, "[");
  *n_tokens = 0;
  for (uint32_t i = 0; i < f->n_segs; i++) {
    const dsv4c_segment_t *sg = &f->segs[i];
    put_str(t, i ? ",{\"seq\":\"" : "{\"seq\":\"");
    put_str(t, sg->seq);
    put_lit(t, "\",\"start\":");
    put_i64(t, sg->start);
    put_lit(t, ",\"len\":");
    put_u64(t, sg->len);
    put_str(t, sg->is_new ? ",\"new\":true}" : "}");
    *n_tokens += sg->len;
  }
  put_lit(t, "]");
  return 1;
}

/* The segments' JSON text through jansson (any name it can encode), or NULL. */
static char *segments_json(const dsv4c_forward_t *f, uint64_t *n_tokens) {
  json_t *segs = json_array();
  *n_tokens = 0;
  for (uint32_t i = 0; i < f->n_segs && segs; i++) {
    const dsv4c_segment_t *s = &f->segs[i];
    /* A name that is not UTF-8 cannot be sent: the whole request fails (-ENOMEM), none is lost. */
    json_t *o = json_pack("{s:s,s:I,s:I}", "seq", s->seq ? s->seq : "", "start",
                          (json_int_t)s->start, "len", (json_int_t)s->len);
    if (o && s->is_new)
      json_object_set_new(o, "new", json_true());
    if (!o || json_array_append_new(segs, o) != 0) {
      json_decref(segs);
      segs = NULL;
    }
    *n_tokens += s->len;
  }
  char *text = segs ? json_dumps(segs, JSON_COMPACT) : NULL;
  json_decref(segs);
  return text;
}

/*
 * The __metadata__ of the HTTP body: layer, outputs and attention, and segments (JSON text) when a
 * name needs jansson's escaping. Plain segments are written directly into *after instead, the text
 * that follows the message (SPEC §6.1, "segments_bytes"): a JSON string of them would cost the
 * escaping here and the unescaping in the daemon, about 20 and 35 us at 64 segments.
 */
static json_t *metadata(const dsv4c_forward_t *f, uint64_t *n_tokens, char **after) {
  text_t plain = {0};
  *after = NULL;
  if (segments_plain(f, &plain, n_tokens) && !plain.oom)
    *after = plain.p;
  else
    free(plain.p);
  char *segs_text = *after ? NULL : segments_json(f, n_tokens);
  if (!*after && !segs_text)
    return NULL;
  char layer[16];
  snprintf(layer, sizeof(layer), "%u", f->layer);
  json_t *m = json_pack("{s:s,s:s}", "layer", layer, "outputs", f->outputs ? f->outputs : "q");
  if (m && segs_text)
    json_object_set_new(m, "segments", json_string(segs_text));
  if (m && f->attention)
    json_object_set_new(m, "attention", json_string(f->attention));
  free(segs_text);
  return m;
}

/* The offsets of the outputs asked for (every output name of outputs; slots always). */
static json_t *out_offsets(const dsv4c_forward_t *f) {
  const char *o = f->outputs ? f->outputs : "q";
  json_t *out = json_pack("{s:I}", "slots", (json_int_t)f->slots_off);
  char list[64];
  snprintf(list, sizeof(list), "%s", o);
  for (char *save = NULL, *t = strtok_r(list, ", ", &save); t && out;
       t = strtok_r(NULL, ", ", &save)) {
    if (!strcmp(t, "q"))
      json_object_set_new(out, "q_out", json_integer((json_int_t)f->q_out_off));
    else if (!strcmp(t, "attn"))
      json_object_set_new(out, "attn", json_integer((json_int_t)f->attn_off));
    else if (!strcmp(t, "lse"))
      json_object_set_new(out, "lse", json_integer((json_int_t)f->lse_off));
    else if (!strcmp(t, "topk"))
      json_object_set_new(out, "topk", json_integer((json_int_t)f->topk_off));
  }
  return out;
}

/* Whether s needs no escaping in a JSON string (outputs, attention): letters, digits, commas and
 * spaces. */
static int plain_words(const char *s) {
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
          *s == ',' || *s == ' '))
      return 0;
  return 1;
}

/* A tensor's header entry, as typed_entry makes it; dims < 0 end the shape. */
static void put_entry(text_t *x, const char *name, const char *dtype, int64_t d0, int64_t d1,
                      int64_t d2, size_t off, size_t nbytes) {
  put_lit(x, ",\"");
  put_str(x, name);
  put_lit(x, "\":{\"dtype\":\"");
  put_str(x, dtype);
  put_lit(x, "\",\"shape\":[");
  put_i64(x, d0);
  for (int i = 0; i < 2; i++) {
    const int64_t d = i ? d2 : d1;
    if (d < 0)
      break;
    put_lit(x, ",");
    put_i64(x, d);
  }
  put_lit(x, "],\"data_offsets\":[");
  put_u64(x, off);
  put_lit(x, ",");
  put_u64(x, off + nbytes);
  put_lit(x, "]}");
}

/* The offsets of the outputs asked for, as out_offsets gives them: slots, then each output name
 * of the list once. */
static void put_outs(text_t *x, const dsv4c_forward_t *f) {
  static const char *const word[4] = {"q", "attn", "lse", "topk"};
  static const char *const key[4] = {",\"q_out\":", ",\"attn\":", ",\"lse\":", ",\"topk\":"};
  const size_t off[4] = {f->q_out_off, f->attn_off, f->lse_off, f->topk_off};
  int seen[4] = {0};
  char list[64];
  snprintf(list, sizeof(list), "%s", f->outputs ? f->outputs : "q");
  put_lit(x, ",\"out\":{\"slots\":");
  put_u64(x, f->slots_off);
  for (char *save = NULL, *t = strtok_r(list, ", ", &save); t; t = strtok_r(NULL, ", ", &save))
    for (int i = 0; i < 4; i++)
      if (!strcmp(t, word[i]) && !seen[i]) {
        seen[i] = 1;
        put_str(x, key[i]);
        put_u64(x, off[i]);
      }
  put_lit(x, "}");
}

/*
 * The forward message written directly into x, the document dsv4c_forward would build with jansson
 * and dump (the same keys, in the same order), and the segments' text into after
 * (segments_plain): 1, when the segments are plain and outputs and attention need no escaping, so
 * that a decode step costs no document. 0 otherwise: the caller builds the message with jansson.
 * x->oom or after->oom tells a text cut short.
 */
static int forward_plain(const dsv4c_region_t *r, const dsv4c_forward_t *f, text_t *x,
                         text_t *after) {
  uint64_t n;
  const char *outputs = f->outputs ? f->outputs : "q";
  if (!plain_words(outputs) || (f->attention && !plain_words(f->attention)) ||
      !segments_plain(f, after, &n))
    return 0;
  const int64_t jn = (int64_t)n, ih = (int64_t)f->index_heads;
  text_reset(x);
  put_lit(x, "{\"op\":\"forward\",\"region\":");
  put_u64(x, r->id);
  put_lit(x, ",\"header\":{\"__metadata__\":{\"layer\":\"");
  put_u64(x, f->layer);
  put_lit(x, "\",\"outputs\":\"");
  put_str(x, outputs);
  put_lit(x, "\"");
  if (f->attention) {
    put_lit(x, ",\"attention\":\"");
    put_str(x, f->attention);
    put_lit(x, "\"");
  }
  put_lit(x, "}");
  put_entry(x, "q", "BF16", jn, f->heads, HEAD_DIM, f->q_off,
            (size_t)n * f->heads * HEAD_DIM * BF16_BYTES);
  put_entry(x, "kv", "BF16", jn, HEAD_DIM, -1, f->kv_off, (size_t)n * HEAD_DIM * BF16_BYTES);
  if (f->ckv_width)
    put_entry(x, "ckv", "F32", jn, f->ckv_width, -1, f->ckv_off, (size_t)n * f->ckv_width * 4);
  if (f->index_heads) {
    put_entry(x, "ikv", "F32", jn, 512, -1, f->ikv_off, (size_t)n * 512 * 4);
    put_entry(x, "iq", "BF16", jn, ih, 128, f->iq_off,
              (size_t)n * f->index_heads * 128 * BF16_BYTES);
    put_entry(x, "iw", "F32", jn, ih, -1, f->iw_off, (size_t)n * f->index_heads * 4);
  }
  put_lit(x, "}");
  put_outs(x, f);
  if (f->deadline_ms >= 0) {
    put_lit(x, ",\"deadline_ms\":");
    put_i64(x, f->deadline_ms);
  }
  put_lit(x, ",\"segments_bytes\":");
  put_u64(x, after->len);
  put_lit(x, "}");
  return 1;
}

/* The forward message built with jansson and dumped (any segment names, outputs and attention it
 * can encode), or NULL; *after is the segments' text when they go plain after it, else NULL. */
static char *forward_json(const dsv4c_region_t *r, const dsv4c_forward_t *f, char **after) {
  uint64_t n;
  json_t *meta = metadata(f, &n, after);
  size_t q_bytes = (size_t)n * f->heads * HEAD_DIM * BF16_BYTES;
  json_t *header =
      meta ? json_pack("{s:o,s:o,s:o}", "__metadata__", meta, "q",
                       tensor_entry(json_pack("[I,I,I]", (json_int_t)n, (json_int_t)f->heads,
                                              (json_int_t)HEAD_DIM),
                                    f->q_off, q_bytes),
                       "kv",
                       tensor_entry(json_pack("[I,I]", (json_int_t)n, (json_int_t)HEAD_DIM),
                                    f->kv_off, (size_t)n * HEAD_DIM * BF16_BYTES))
           : NULL;
  add_compressed(header, f, n);
  json_t *msg = header ? json_pack("{s:s,s:I,s:o,s:o}", "op", "forward", "region",
                                   (json_int_t)r->id, "header", header, "out", out_offsets(f))
                       : NULL;
  if (msg && f->deadline_ms >= 0)
    json_object_set_new(msg, "deadline_ms", json_integer(f->deadline_ms));
  if (msg && *after)
    json_object_set_new(msg, "segments_bytes", json_integer((json_int_t)strlen(*after)));
  char *text = msg ? json_dumps(msg, JSON_COMPACT) : NULL;
  json_decref(msg);
  return text;
}

int dsv4c_forward(dsv4c_client_t *c, const dsv4c_region_t *r, const dsv4c_forward_t *f,
                  dsv4c_result_t *res) {
  memset(res, 0, sizeof(*res));
  if (r->client != c)
    return -EINVAL;
  if (forward_plain(r, f, &c->msg, &c->segs)) {
    if (c->msg.oom || c->segs.oom)
      return -ENOMEM;
    struct iovec iov[2] = {{c->msg.p, c->msg.len}, {c->segs.p, c->segs.len}};
    return exchange(c, iov, 2, -1, res);
  }
  char *after = NULL;
  char *text = forward_json(r, f, &after);
  struct iovec iov[2] = {{text, text ? strlen(text) : 0}, {after, after ? strlen(after) : 0}};
  const int rc = text ? exchange(c, iov, after ? 2 : 1, -1, res) : -ENOMEM;
  free(text);
  free(after);
  return rc;
}
