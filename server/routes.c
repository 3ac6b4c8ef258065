/*
 * Data-plane routes (SPEC §6): POST /v1/forward, GET and DELETE /v1/sequences/{seq}, /healthz,
 * /readyz, /metrics. Handlers run on the loop thread; everything that touches the engine goes
 * through the executor as a job, so batches, deletes and lookups are ordered with each other.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "log.h"
#include "safetensors.h"

/* ---- helpers ---- */

/* SPEC §4, for error messages. */
#define SEQ_NAME_RULE "1..128 bytes of [A-Za-z0-9._:-], not starting with '.'"

static void free_release(void *p) {
  free(p);
}

static int parse_u64_strict(const char *s, uint64_t max, uint64_t *out) {
  uint64_t v = 0;
  if (!s || !*s || strlen(s) > 20)
    return DSV4_EINVAL;
  for (const char *c = s; *c; c++) {
    if (*c < '0' || *c > '9')
      return DSV4_EINVAL;
    if (v > (max - (uint64_t)(*c - '0')) / 10)
      return DSV4_ERANGE;
    v = v * 10 + (uint64_t)(*c - '0');
  }
  *out = v;
  return 0;
}

static json_t *seq_name_json(const char *name, uint32_t len) {
  return json_stringn(name, len);
}

/* ---- POST /v1/forward ---- */

typedef struct {
  dsv4_job_t job; /* first */
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  uint8_t *body;
  dsv4_st_view_t view;
  json_t *segs_doc;
  uint16_t *q_copy, *kv_copy; /* aligned copies when the sender's offsets were not 2-aligned */
  int want_q;
  uint64_t deadline_ns; /* 0 = none */
  dsv4_forward_t f;
  uint8_t *out; /* q_out then slots, one aligned allocation */
  size_t q_bytes;
  int rc;
  json_t *err_details;
} fwd_job_t;

static void fwd_free(fwd_job_t *j) {
  dsv4_forward_release(&j->f);
  free(j->f.segs);
  json_decref(j->segs_doc);
  json_decref(j->err_details);
  dsv4_st_view_free(&j->view);
  free(j->q_copy);
  free(j->kv_copy);
  free(j->body);
  free(j->out);
  free(j);
}

static void fwd_release(void *arg) {
  fwd_free(arg);
}

/* Executor thread. */
static void fwd_run(dsv4_job_t *job) {
  fwd_job_t *j = (fwd_job_t *)job;
  dsv4_engine_t *e = j->d->engine;
  if (j->deadline_ns && job->t_start_ns > j->deadline_ns) {
    j->rc = DSV4_EDEADLINE;
    return;
  }
  j->rc = dsv4_engine_forward(e, &j->f);
  if (j->rc == DSV4_EPOSITION || j->rc == DSV4_EEXIST) {
    /* The expected next position of every segment's sequence at this layer. */
    int idx = dsv4_engine_layer_index(e, j->f.layer);
    json_t *exp = json_array();
    for (uint32_t s = 0; s < j->f.n_segs; s++) {
      const dsv4_seg_req_t *sg = &j->f.segs[s];
      dsv4_seq_info_t info;
      json_t *row = json_pack("{s:o,s:I}", "seq", seq_name_json(sg->name, sg->name_len), "start",
                              (json_int_t)sg->start);
      if (idx >= 0 && dsv4_engine_seq_info(e, sg->name, sg->name_len, &info) == 0) {
        json_object_set_new(row, "expected", json_integer(info.next[idx]));
        dsv4_seq_info_free(&info);
      } else {
        json_object_set_new(row, "expected", json_null());
      }
      json_array_append_new(exp, row);
    }
    j->err_details = json_pack("{s:I,s:o}", "layer", (json_int_t)j->f.layer, "segments", exp);
    json_object_set_new(j->err_details, "segment", json_integer(j->f.error.segment));
  }
}

static void observe_stage(dsv4_daemon_t *d, const char *stage, uint64_t ns) {
  const char *v[1] = {stage};
  dsv4_metric_observe(d->m_forward_seconds, v, (double)ns * 1e-9);
}

/* Loop thread. */
static void fwd_done(dsv4_job_t *job) {
  fwd_job_t *j = (fwd_job_t *)job;
  dsv4_daemon_t *d = j->d;
  dsv4_req_t *req = j->req;
  d->inflight--;
  if (j->rc) {
    json_t *det = j->err_details;
    j->err_details = NULL;
    switch (j->rc) {
    case DSV4_ENOSPC:
      dsv4_metric_add(d->m_alloc_failures, NULL, 1);
      det = json_pack("{s:I,s:I}", "needed", (json_int_t)j->f.error.needed, "free",
                      (json_int_t)j->f.error.free);
      break;
    case DSV4_ENOSEQ:
    case DSV4_EEXPIRED:
    case DSV4_EDUPSEQ: {
      const dsv4_seg_req_t *sg = &j->f.segs[j->f.error.segment];
      det = json_pack("{s:o,s:I}", "seq", seq_name_json(sg->name, sg->name_len), "segment",
                      (json_int_t)j->f.error.segment);
      if (j->rc == DSV4_ENOSEQ)
        json_object_set_new(det, "instance", json_string(d->instance));
      break;
    }
    case DSV4_EBACKEND: {
      json_t *arr = json_array();
      for (uint32_t i = 0; i < j->f.n_dropped; i++)
        json_array_append_new(arr, json_string(j->f.dropped[i]));
      det = json_pack("{s:o}", "dropped", arr);
      dsv4_logp(DSV4_LOG_ERROR, "backend failed; batch sequences dropped", "{s:I,s:I}", "layer",
                (json_int_t)j->f.layer, "dropped", (json_int_t)j->f.n_dropped);
      break;
    }
    default:
      break;
    }
    dsv4_respond_error(req, j->rc, NULL, det);
    fwd_free(j);
    return;
  }

  observe_stage(d, "queue", job->t_start_ns - job->t_submit_ns);
  observe_stage(d, "validate", j->f.timing.validate_ns);
  observe_stage(d, "plan", j->f.timing.plan_ns);
  observe_stage(d, "kernel", j->f.timing.kernel_ns);
  if (j->f.want_digest)
    observe_stage(d, "digest", j->f.timing.digest_ns);
  dsv4_metric_observe(d->m_batch_tokens, NULL, (double)j->f.n_tokens);

  {
    uint32_t n = j->f.n_tokens, h = d->cfg->heads;
    dsv4_st_desc_t desc[2];
    dsv4_st_meta_t meta[2];
    size_t nd = 0, nm = 0, hdr_len = 0, data_len = 0;
    char digest_hex[17];
    uint8_t *hdr = NULL;
    uv_buf_t bufs[3];
    size_t nb = 0;
    if (j->want_q)
      desc[nd++] = (dsv4_st_desc_t){"q_out", DSV4_ST_BF16, 3, {n, h, DSV4_HEAD_DIM}, j->q_bytes};
    desc[nd++] = (dsv4_st_desc_t){"slots", DSV4_ST_I64, 1, {n}, (size_t)n * 8};
    if (j->f.want_digest) {
      snprintf(digest_hex, sizeof(digest_hex), "%016" PRIx64, j->f.digest);
      meta[nm++] = (dsv4_st_meta_t){"cache_digest", digest_hex};
    }
    if (j->f.replayed)
      meta[nm++] = (dsv4_st_meta_t){"replayed", "true"};
    if (dsv4_st_build_header(desc, nd, meta, nm, &hdr, &hdr_len, &data_len)) {
      dsv4_respond_error(req, DSV4_ENOMEM, "cannot build the response header", NULL);
      fwd_free(j);
      return;
    }
    /* The header buffer is freed with the job: keep it in the job's body slot. */
    free(j->body);
    j->body = hdr;
    /* uv_buf_init takes an unsigned length, and q_out reaches 2^37 bytes (N = 2^20, H = 128): set
     * the size_t lengths directly. */
    bufs[nb++] = uv_buf_init((char *)hdr, (unsigned)hdr_len);
    if (j->want_q) {
      bufs[nb].base = (char *)j->out;
      bufs[nb++].len = j->q_bytes;
    }
    bufs[nb].base = (char *)j->f.slots;
    bufs[nb++].len = (size_t)n * 8;
    dsv4_respond(req, 200, "application/octet-stream", NULL, 0, bufs, nb, fwd_release, j);
  }
}

/* Parse one segments entry into sg. Returns NULL or a message. */
static const char *parse_segment(json_t *o, dsv4_seg_req_t *sg) {
  const char *key;
  json_t *v;
  json_t *seq = NULL, *start = NULL, *len = NULL, *isnew = NULL;
  if (!json_is_object(o))
    return "each segment must be a JSON object";
  json_object_foreach(o, key, v) {
    if (!strcmp(key, "seq"))
      seq = v;
    else if (!strcmp(key, "start"))
      start = v;
    else if (!strcmp(key, "len"))
      len = v;
    else if (!strcmp(key, "new"))
      isnew = v;
    else
      return "unknown key in a segment (allowed: seq, start, len, new)";
  }
  if (!json_is_string(seq))
    return "segment \"seq\" must be a string";
  if (!dsv4_seq_name_valid(json_string_value(seq), json_string_length(seq)))
    return "segment \"seq\" must be " SEQ_NAME_RULE;
  if (!json_is_integer(start) || json_integer_value(start) < 0)
    return "segment \"start\" must be an integer >= 0";
  if (!json_is_integer(len) || json_integer_value(len) < 1 ||
      json_integer_value(len) > (json_int_t)UINT32_MAX)
    return "segment \"len\" must be an integer >= 1";
  if (isnew && !json_is_boolean(isnew))
    return "segment \"new\" must be true or false";
  sg->name = json_string_value(seq);
  sg->name_len = (uint32_t)json_string_length(seq);
  sg->start = json_integer_value(start);
  sg->len = (uint32_t)json_integer_value(len);
  sg->is_new = isnew && json_is_true(isnew);
  sg->hash = 0;
  return NULL;
}

static int check_tensor(const dsv4_st_tensor_t *t, int ndim, const int64_t *shape, char *msg,
                        size_t msg_len) {
  if (t->dtype != DSV4_ST_BF16) {
    snprintf(msg, msg_len, "tensor \"%s\" must be BF16, not %s", t->name,
             dsv4_st_dtype_name(t->dtype));
    return DSV4_EINVAL;
  }
  if (t->ndim != ndim) {
    snprintf(msg, msg_len, "tensor \"%s\" must have %d dimensions, not %d", t->name, ndim, t->ndim);
    return DSV4_EINVAL;
  }
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] != shape[i]) {
      snprintf(msg, msg_len, "tensor \"%s\" dimension %d is %" PRId64 ", expected %" PRId64,
               t->name, i, t->shape[i], shape[i]);
      return DSV4_EINVAL;
    }
  return 0;
}

/* bf16 data straight from the body when 2-aligned, else an aligned copy (kept in *copy). */
static const uint16_t *bf16_data(const dsv4_st_tensor_t *t, uint16_t **copy) {
  if (((uintptr_t)t->data & 1u) == 0)
    return (const uint16_t *)(const void *)t->data;
  *copy = aligned_alloc(64, (t->nbytes + 63) & ~(size_t)63);
  if (*copy)
    memcpy(*copy, t->data, t->nbytes);
  return *copy;
}

static int fwd_prepare(dsv4_daemon_t *d, fwd_job_t *j, char *msg, size_t msg_len) {
  const dsv4_config_t *cfg = d->cfg;
  const dsv4_st_tensor_t *q, *kv;
  const char *layer_s, *segs_s, *outputs_s;
  uint64_t layer;
  int64_t n, h = cfg->heads;
  json_error_t jerr;
  int rc;

  rc = dsv4_st_parse(j->body, j->req->body_len, &j->view);
  if (rc) {
    snprintf(msg, msg_len, "malformed safetensors body: %s", j->view.error);
    return DSV4_EINVAL;
  }
  for (size_t i = 0; i < j->view.n_tensors; i++) {
    const char *name = j->view.tensors[i].name;
    if (strcmp(name, "q") && strcmp(name, "kv")) {
      snprintf(msg, msg_len, "unknown tensor \"%s\" (a forward body has q and kv)", name);
      return DSV4_EINVAL;
    }
  }
  q = dsv4_st_find(&j->view, "q");
  kv = dsv4_st_find(&j->view, "kv");
  if (!q || !kv) {
    snprintf(msg, msg_len, "missing tensor \"%s\"", q ? "kv" : "q");
    return DSV4_EINVAL;
  }
  if (q->ndim < 1 || q->shape[0] < 1) {
    snprintf(msg, msg_len, "tensor \"q\" must be [N, %" PRId64 ", 512] with N >= 1", h);
    return DSV4_EINVAL;
  }
  n = q->shape[0];
  if (n > (int64_t)cfg->max_batch_tokens) {
    snprintf(msg, msg_len, "N = %" PRId64 " exceeds max_batch_tokens = %u", n,
             cfg->max_batch_tokens);
    return DSV4_EINVAL;
  }
  if (q->ndim == 3 && q->shape[1] != h && q->shape[2] == DSV4_HEAD_DIM) {
    snprintf(msg, msg_len, "q has H = %" PRId64 " heads, this daemon serves heads = %" PRId64,
             q->shape[1], h);
    return DSV4_EINVAL;
  }
  {
    int64_t qs[3] = {n, h, DSV4_HEAD_DIM}, ks[2] = {n, DSV4_HEAD_DIM};
    rc = check_tensor(q, 3, qs, msg, msg_len);
    if (!rc)
      rc = check_tensor(kv, 2, ks, msg, msg_len);
    if (rc)
      return rc;
  }

  layer_s = dsv4_st_meta(&j->view, "layer");
  segs_s = dsv4_st_meta(&j->view, "segments");
  outputs_s = dsv4_st_meta(&j->view, "outputs");
  if (!layer_s || !segs_s) {
    snprintf(msg, msg_len, "__metadata__ must have \"layer\" and \"segments\"");
    return DSV4_EINVAL;
  }
  if (parse_u64_strict(layer_s, UINT32_MAX, &layer)) {
    snprintf(msg, msg_len, "__metadata__ \"layer\" must be a decimal layer number");
    return DSV4_EINVAL;
  }
  if (dsv4_engine_layer_index(d->engine, (uint32_t)layer) < 0) {
    snprintf(msg, msg_len, "layer %" PRIu64 " is not served by this daemon", layer);
    return DSV4_ELAYER;
  }
  j->want_q = 1;
  j->f.want_digest = 0;
  if (outputs_s) {
    const char *p = outputs_s;
    j->want_q = 0;
    while (*p) {
      const char *end = strchr(p, ',');
      size_t len = end ? (size_t)(end - p) : strlen(p);
      while (len && *p == ' ')
        p++, len--;
      while (len && p[len - 1] == ' ')
        len--;
      if (len == 1 && p[0] == 'q') {
        j->want_q = 1;
      } else if (len == 6 && !memcmp(p, "digest", 6)) {
        j->f.want_digest = 1;
      } else if (len == 4 && !memcmp(p, "attn", 4)) {
        snprintf(msg, msg_len, "output \"attn\" is not available in this version");
        return DSV4_EINVAL;
      } else {
        snprintf(msg, msg_len, "unknown output \"%.*s\" (outputs: q, digest)", (int)len, p);
        return DSV4_EINVAL;
      }
      if (!end)
        break;
      p = end + 1;
    }
  }

  j->segs_doc = json_loads(segs_s, JSON_REJECT_DUPLICATES, &jerr);
  if (!j->segs_doc || !json_is_array(j->segs_doc)) {
    snprintf(msg, msg_len, "__metadata__ \"segments\" must be a JSON array: %s",
             j->segs_doc ? "not an array" : jerr.text);
    return DSV4_EINVAL;
  }
  {
    size_t ns = json_array_size(j->segs_doc);
    int64_t total = 0;
    if (ns < 1 || ns > cfg->max_segments) {
      snprintf(msg, msg_len, "a batch has 1..%u segments, not %zu", cfg->max_segments, ns);
      return DSV4_EINVAL;
    }
    j->f.segs = calloc(ns, sizeof(*j->f.segs));
    if (!j->f.segs)
      return DSV4_ENOMEM;
    for (size_t s = 0; s < ns; s++) {
      const char *why = parse_segment(json_array_get(j->segs_doc, s), &j->f.segs[s]);
      if (why) {
        snprintf(msg, msg_len, "segment %zu: %s", s, why);
        return DSV4_EINVAL;
      }
      total += j->f.segs[s].len;
    }
    j->f.n_segs = (uint32_t)ns;
    if (total != n) {
      snprintf(msg, msg_len, "segment lengths add up to %" PRId64 ", but N = %" PRId64, total, n);
      return DSV4_EINVAL;
    }
    for (size_t s = 0; s < ns; s++) {
      const dsv4_seg_req_t *sg = &j->f.segs[s];
      /* start may be anything up to INT64_MAX: compare without forming start + len. */
      if (sg->start > cfg->model.max_position_embeddings - (int64_t)sg->len) {
        snprintf(msg, msg_len,
                 "segment %zu: positions from %" PRId64 " (%u of them)"
                 " reach past max_position_embeddings = %" PRId64,
                 s, sg->start, sg->len, cfg->model.max_position_embeddings);
        return DSV4_EPOSRANGE;
      }
    }
  }

  j->f.layer = (uint32_t)layer;
  j->f.n_tokens = (uint32_t)n;
  j->f.q = bf16_data(q, &j->q_copy);
  j->f.kv = bf16_data(kv, &j->kv_copy);
  if (!j->f.q || !j->f.kv)
    return DSV4_ENOMEM;
  j->q_bytes = (size_t)n * (size_t)h * DSV4_HEAD_DIM * 2;
  j->out = aligned_alloc(64, (j->q_bytes + (size_t)n * 8 + 63) & ~(size_t)63);
  if (!j->out)
    return DSV4_ENOMEM;
  j->f.q_out = (uint16_t *)(void *)j->out;
  j->f.slots = (int64_t *)(void *)(j->out + j->q_bytes);
  return 0;
}

static void on_forward(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  fwd_job_t *j;
  char msg[320];
  const char *dl;
  int rc;

  if (d->draining) {
    dsv4_respond_error(req, DSV4_EDRAIN, NULL, NULL);
    return;
  }
  if (!req->body || !req->body_len) {
    dsv4_respond_error(req, DSV4_EINVAL, "empty body: a forward request is a safetensors file",
                       NULL);
    return;
  }
  j = calloc(1, sizeof(*j));
  if (!j) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  j->d = d;
  j->req = req;
  j->body = dsv4_req_take_body(req);
  j->job.run = fwd_run;
  j->job.done = fwd_done;
  dl = dsv4_req_header(req, "Dsv4d-Deadline-Ms");
  if (dl) {
    uint64_t ms;
    if (parse_u64_strict(dl, UINT64_MAX / 1000000u, &ms)) {
      dsv4_respond_error(req, DSV4_EINVAL, "Dsv4d-Deadline-Ms must be a whole number of ms", NULL);
      fwd_free(j);
      return;
    }
    /* A deadline beyond the clock's range saturates rather than wrap into the past. */
    uint64_t span = ms * 1000000u;
    j->deadline_ns = span > UINT64_MAX - req->t_start_ns ? UINT64_MAX : req->t_start_ns + span;
  }
  msg[0] = '\0';
  rc = fwd_prepare(d, j, msg, sizeof(msg));
  if (rc) {
    dsv4_respond_error(req, rc, msg[0] ? msg : NULL, NULL);
    fwd_free(j);
    return;
  }
  rc = dsv4_executor_submit(&d->ex, &j->job);
  if (rc) {
    dsv4_respond_error(req, rc, NULL, NULL);
    fwd_free(j);
    return;
  }
  d->inflight++;
}

/* ---- GET / DELETE /v1/sequences/{seq} ---- */

typedef struct {
  dsv4_job_t job;
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  int method;
  char name[DSV4_SEQ_NAME_MAX + 1];
  uint32_t name_len;
  int rc;
  int existed;
  json_t *doc;
} seq_job_t;

static void seq_run(dsv4_job_t *job) {
  seq_job_t *j = (seq_job_t *)job;
  dsv4_daemon_t *d = j->d;
  if (j->method == DSV4_HTTP_DELETE) {
    j->rc = dsv4_engine_delete(d->engine, j->name, j->name_len, &j->existed);
    return;
  }
  dsv4_seq_info_t info;
  /* Sweep first, so a lookup agrees to the nanosecond with what a batch would be told (the periodic
   * sweep alone could leave an expired or forgotten name up to a second behind). */
  dsv4_engine_expire(d->engine, uv_hrtime());
  j->rc = dsv4_engine_seq_info(d->engine, j->name, j->name_len, &info);
  if (j->rc)
    return;
  json_t *next = json_object(), *blocks = json_array();
  for (uint32_t i = 0; i < d->cfg->n_served; i++) {
    char key[16];
    snprintf(key, sizeof(key), "%u", d->cfg->served_layers[i]);
    json_object_set_new(next, key, json_integer(info.next[i]));
  }
  for (uint32_t b = 0; b < info.n_blocks_held; b++)
    if (info.blocks[b] >= 0)
      json_array_append_new(blocks, json_integer(info.blocks[b]));
  j->doc = json_pack("{s:s,s:s#,s:I,s:o,s:o}", "instance", d->instance, "seq", j->name,
                     (int)j->name_len, "p0", (json_int_t)info.p0, "next", next, "blocks", blocks);
  dsv4_seq_info_free(&info);
}

static void seq_done(dsv4_job_t *job) {
  seq_job_t *j = (seq_job_t *)job;
  if (j->rc) {
    json_t *det = json_pack("{s:s#}", "seq", j->name, (int)j->name_len);
    if (j->rc == DSV4_ENOSEQ)
      json_object_set_new(det, "instance", json_string(j->d->instance));
    dsv4_respond_error(j->req, j->rc, NULL, det);
  } else if (j->method == DSV4_HTTP_DELETE) {
    dsv4_hdr_t h = {"Dsv4d-Existed", j->existed ? "1" : "0"};
    dsv4_respond(j->req, 204, NULL, &h, 1, NULL, 0, NULL, NULL);
  } else {
    dsv4_respond_json(j->req, 200, j->doc);
    j->doc = NULL;
  }
  json_decref(j->doc);
  free(j);
}

static void on_sequence(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  const char *name = req->path + strlen("/v1/sequences/");
  size_t len = strlen(name);
  seq_job_t *j;
  if (!dsv4_seq_name_valid(name, len)) {
    dsv4_respond_error(req, DSV4_EINVAL, "a sequence name must be " SEQ_NAME_RULE, NULL);
    return;
  }
  j = calloc(1, sizeof(*j));
  if (!j) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  j->d = d;
  j->req = req;
  j->method = req->method;
  memcpy(j->name, name, len);
  j->name_len = (uint32_t)len;
  j->job.run = seq_run;
  j->job.done = seq_done;
  /* DELETE frees memory: never refuse it for a full queue. */
  if (req->method == DSV4_HTTP_DELETE) {
    dsv4_executor_submit_force(&d->ex, &j->job);
  } else {
    int rc = dsv4_executor_submit(&d->ex, &j->job);
    if (rc) {
      dsv4_respond_error(req, rc, NULL, NULL);
      free(j);
    }
  }
}

/* ---- health, readiness, metrics ---- */

static void on_healthz(dsv4_req_t *req, void *ctx) {
  (void)ctx;
  dsv4_respond_json(req, 200, json_pack("{s:s}", "status", "ok"));
}

static void on_readyz(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  const char *why = NULL;
  if (d->draining)
    why = "draining";
  else if (!d->engine || !dsv4_engine_healthy(d->engine))
    why = "backend_unusable";
  if (why)
    dsv4_respond_json(req, 503, json_pack("{s:s,s:s}", "status", "not_ready", "reason", why));
  else
    dsv4_respond_json(
        req, 200,
        json_pack("{s:s,s:s}", "status", "ready", "backend", dsv4_engine_backend_name(d->engine)));
}

static void on_metrics(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  char *text = NULL;
  size_t len = 0;
  if (dsv4_metrics_render(d->metrics, &text, &len)) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  uv_buf_t b = uv_buf_init(text, (unsigned)len);
  dsv4_respond(req, 200, DSV4_METRICS_CONTENT_TYPE, NULL, 0, &b, 1, free_release, text);
}

static void collect(dsv4_metrics_t *m, void *arg) {
  dsv4_daemon_t *d = arg;
  uint32_t total = dsv4_engine_blocks_total(d->engine);
  uint32_t free_b = dsv4_engine_blocks_free(d->engine);
  const char *used_l[1] = {"used"}, *free_l[1] = {"free"};
  (void)m;
  dsv4_metric_set(d->m_usage, NULL, total ? (double)(total - free_b) / (double)total : 0.0);
  dsv4_metric_set(d->m_blocks, used_l, (double)(total - free_b));
  dsv4_metric_set(d->m_blocks, free_l, (double)free_b);
  dsv4_metric_set(d->m_sequences, NULL, (double)dsv4_engine_sequences(d->engine));
  dsv4_metric_set(d->m_inflight, NULL, (double)d->inflight);
}

int dsv4_daemon_metrics_init(dsv4_daemon_t *d) {
  static const double token_bounds[] = {1,   2,   4,    8,    16,   32,   64,   128,
                                        256, 512, 1024, 2048, 4096, 8192, 16384};
  static const double sec_bounds[] = {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                      1e-2, 2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1,    2.5,    5};
  const char *state[1] = {"state"}, *stage[1] = {"stage"};
  const char *build[2] = {"version", "backend"};
  dsv4_metrics_t *m = d->metrics;
  int rc = 0;
  rc |= dsv4_metrics_gauge(m, "dsv4d_kv_cache_usage_ratio", "Used KV block ids over all block ids.",
                           NULL, 0, &d->m_usage);
  rc |= dsv4_metrics_gauge(m, "dsv4d_kv_blocks", "KV block ids by state.", state, 1, &d->m_blocks);
  rc |= dsv4_metrics_gauge(m, "dsv4d_sequences", "Live sequences.", NULL, 0, &d->m_sequences);
  rc |= dsv4_metrics_histogram(m, "dsv4d_batch_tokens", "Tokens per forward batch.", NULL, 0,
                               token_bounds, sizeof(token_bounds) / sizeof(token_bounds[0]),
                               &d->m_batch_tokens);
  rc |= dsv4_metrics_histogram(m, "dsv4d_forward_seconds", "Forward batch time by stage.", stage, 1,
                               sec_bounds, sizeof(sec_bounds) / sizeof(sec_bounds[0]),
                               &d->m_forward_seconds);
  rc |= dsv4_metrics_counter(m, "dsv4d_kv_alloc_failures_total",
                             "Batches refused because the KV pool was exhausted.", NULL, 0,
                             &d->m_alloc_failures);
  rc |= dsv4_metrics_gauge(m, "dsv4d_inflight_batches", "Forward batches accepted, not answered.",
                           NULL, 0, &d->m_inflight);
  rc |= dsv4_metrics_gauge(m, "dsv4d_build_info", "Build and backend of this daemon.", build, 2,
                           &d->m_build_info);
  if (rc)
    return DSV4_ENOMEM;
  {
    const char *v[2] = {DSV4_VERSION, dsv4_engine_backend_name(d->engine)};
    dsv4_metric_set(d->m_build_info, v, 1);
  }
  dsv4_metric_add(d->m_alloc_failures, NULL, 0);
  dsv4_metrics_set_collect(m, collect, d);
  return 0;
}

size_t dsv4_data_routes(dsv4_daemon_t *d, dsv4_route_t *out, size_t cap) {
  const dsv4_route_t routes[] = {
      {DSV4_HTTP_POST, "/v1/forward", "forward", d->cfg->max_body_bytes_effective, 0, on_forward,
       d},
      {DSV4_HTTP_GET | DSV4_HTTP_DELETE, "/v1/sequences/", "sequences", 0, 0, on_sequence, d},
      {DSV4_HTTP_GET, "/healthz", "healthz", 0, 1, on_healthz, d},
      {DSV4_HTTP_GET, "/readyz", "readyz", 0, 1, on_readyz, d},
      {DSV4_HTTP_GET, "/metrics", "metrics", 0, 1, on_metrics, d},
  };
  size_t n = sizeof(routes) / sizeof(routes[0]);
  if (n > cap)
    n = cap;
  memcpy(out, routes, n * sizeof(routes[0]));
  return n;
}
