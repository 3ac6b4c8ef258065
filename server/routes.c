/*
 * Data-plane routes (SPEC §6): POST /v1/forward, GET and DELETE /v1/sequences/{seq}, /healthz,
 * /readyz, /metrics. Handlers run on the loop thread; everything that touches the engine goes
 * through the executor as a job, so batches, deletes and lookups that name the same sequence are
 * ordered with each other (decode batches and lookups may pass prefills of other sequences).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#include "daemon.h"
#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "forward_arrival.h"
#include "forward_parse.h"
#include "log.h"
#include "pinned_pool.h"
#include "safetensors.h"
#include "shm.h"

/* ---- helpers ---- */

static void free_release(void *p) {
  free(p);
}

static json_t *seq_name_json(const char *name, uint32_t len) {
  return json_stringn(name, len);
}

void *dsv4_daemon_buf_alloc(dsv4_daemon_t *d, size_t n, const char *use) {
  int fell_back;
  void *p = dsv4_pinned_alloc(d->pinned, n, &fell_back);
  if (fell_back) {
    const char *v[1] = {use};
    dsv4_metric_add(d->m_pinned_fallbacks, v, 1);
  }
  return p;
}

void dsv4_daemon_buf_free(dsv4_daemon_t *d, void *p) {
  dsv4_pinned_free(d->pinned, p);
}

/* ---- POST /v1/forward ---- */

typedef struct {
  dsv4_job_t job; /* first */
  dsv4_daemon_t *d;
  dsv4_req_t *req;              /* the HTTP request answered, or NULL for a region request */
  dsv4_region_forward_t region; /* a region request's outputs and who is told (region.c) */
  uint8_t *body;
  void *body_alloc;        /* what holds body (dsv4_req_take_body): freed once the answer is made */
  dsv4_forward_req_t p;    /* the parsed body; f's inputs point into it */
  dsv4_arrival_t *arrival; /* the body's watcher (check_on_arrival), or NULL */
  uint64_t deadline_ns;    /* 0 = none */
  dsv4_forward_t f;
  uint8_t *out;   /* q_out, slots, then attn and lse when asked: one aligned allocation */
  uint64_t *keys; /* the executor's keys: one per segment */
  size_t q_bytes;
  int rc;
  json_t *err_details;
  /* The 200 answer once made (fwd_answer_make): its safetensors header (malloc'd) and buffers. */
  uint8_t *ans_hdr;
  uv_buf_t ans[6];
  size_t n_ans;
  /* The executor thread answers (direct_answer_bytes): an HTTP answer through direct (http.h), a
   * region request's through region.answer_now (then region_sent). */
  int direct_on, region_sent;
  dsv4_direct_t direct;
} fwd_job_t;

static void fwd_free(fwd_job_t *j) {
  dsv4_direct_close(&j->direct);
  dsv4_arrival_end(j->arrival);
  dsv4_check_free(j->f.check);
  free(j->ans_hdr);
  dsv4_forward_release(&j->f);
  json_decref(j->err_details);
  dsv4_forward_req_free(&j->p);
  dsv4_daemon_buf_free(j->d, j->body_alloc);
  dsv4_daemon_buf_free(j->d, j->out);
  free(j->keys);
  free(j);
}

/* Loop thread: the result of a region request, to whoever sent it; then the job is freed. */
static void region_answer(fwd_job_t *j, int rc, json_t *details) {
  j->region.done(j->region.arg, rc, NULL, details, &j->f);
  fwd_free(j);
}

static void fwd_release(void *arg) {
  fwd_free(arg);
}

/* Executor thread: the error details of a finished batch. */
static void fwd_after(fwd_job_t *j) {
  dsv4_engine_t *e = j->d->engine;
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

/* Any thread: the 200 answer, a safetensors file of the outputs asked for, into j->ans (its header
 * in j->ans_hdr). DSV4_ENOMEM when the header cannot be built. */
static int fwd_answer_make(fwd_job_t *j) {
  uint32_t n = j->f.n_tokens, h = j->d->cfg->heads;
  dsv4_st_desc_t desc[5];
  dsv4_st_meta_t meta[3];
  size_t nd = 0, nm = 0, hdr_len = 0, data_len = 0;
  char digest_hex[17];
  const void *data[5];
  if (j->ans_hdr)
    return 0;
  if (j->p.want_q) {
    data[nd] = j->f.q_out;
    desc[nd++] = (dsv4_st_desc_t){"q_out", DSV4_ST_BF16, 3, {n, h, DSV4_HEAD_DIM}, j->q_bytes};
  }
  data[nd] = j->f.slots;
  desc[nd++] = (dsv4_st_desc_t){"slots", DSV4_ST_I64, 1, {n}, (size_t)n * sizeof(int64_t)};
  if (j->p.want_attn) {
    data[nd] = j->f.attn;
    desc[nd++] = (dsv4_st_desc_t){"attn", DSV4_ST_BF16, 3, {n, h, DSV4_HEAD_DIM}, j->q_bytes};
  }
  if (j->p.want_lse) {
    data[nd] = j->f.lse;
    desc[nd++] = (dsv4_st_desc_t){"lse", DSV4_ST_F32, 2, {n, h}, (size_t)n * h * sizeof(float)};
  }
  if (j->f.topk) {
    uint32_t k = j->d->cfg->model.index_topk;
    data[nd] = j->f.topk;
    desc[nd++] = (dsv4_st_desc_t){"topk", DSV4_ST_I32, 2, {n, k}, (size_t)n * k * sizeof(int32_t)};
  }
  if (j->f.want_digest) {
    snprintf(digest_hex, sizeof(digest_hex), "%016" PRIx64, j->f.digest);
    meta[nm++] = (dsv4_st_meta_t){"cache_digest", digest_hex};
  }
  if (j->f.attn)
    meta[nm++] =
        (dsv4_st_meta_t){"attention", j->f.attention == DSV4_ATTENTION_FAST ? "fast" : "exact"};
  if (j->f.replayed)
    meta[nm++] = (dsv4_st_meta_t){"replayed", "true"};
  if (dsv4_st_build_header(desc, nd, meta, nm, &j->ans_hdr, &hdr_len, &data_len))
    return DSV4_ENOMEM;
  /* uv_buf_init takes an unsigned length, and q_out reaches 2^37 bytes (N = 2^20, H = 128): set
   * the size_t lengths directly. */
  j->n_ans = 0;
  j->ans[j->n_ans++] = uv_buf_init((char *)j->ans_hdr, (unsigned)hdr_len);
  for (size_t i = 0; i < nd; i++) {
    j->ans[j->n_ans].base = (char *)data[i];
    j->ans[j->n_ans++].len = desc[i].nbytes;
  }
  return 0;
}

/* Executor thread, once a batch has finished: its 200 answer to the socket now, as much of it as
 * the socket takes (all of an answer within direct_answer_bytes, else its first DSV4_DIRECT_PART
 * bytes; fwd_answer sends the rest from the loop). */
static void fwd_direct(fwd_job_t *j) {
  if (!j->direct_on || j->rc)
    return;
  /* Counted before it can reach the client (on_metrics). */
  atomic_fetch_add(&j->d->direct_sent, 1);
  if (!j->req)
    j->region_sent = j->region.answer_now(j->region.arg, &j->f);
  else if (!fwd_answer_make(j))
    dsv4_direct_write(&j->direct, 200, "application/octet-stream", j->ans, j->n_ans);
#ifdef DSV4_TEST_DIRECT_SLOW_BACK_US
  usleep(DSV4_TEST_DIRECT_SLOW_BACK_US); /* a test build: the batch comes back late to the loop */
#endif
}

/* Executor thread. */
static void fwd_run(dsv4_job_t *job) {
  fwd_job_t *j = (fwd_job_t *)job;
  if (j->deadline_ns && job->t_start_ns > j->deadline_ns) {
    j->rc = DSV4_EDEADLINE;
    return;
  }
  j->rc = dsv4_engine_forward(j->d->engine, &j->f);
  fwd_after(j);
  fwd_direct(j);
}

/* Executor thread: the batch's first half (dsv4_job_t.begin); it stays in flight when the engine
 * overlaps it with the next batch. */
static int fwd_begin(dsv4_job_t *job, int alone) {
  fwd_job_t *j = (fwd_job_t *)job;
  if (j->deadline_ns && job->t_start_ns > j->deadline_ns) {
    j->rc = DSV4_EDEADLINE;
    return DSV4_JOB_DONE;
  }
  if (!alone && !dsv4_engine_can_overlap(j->d->engine, &j->f))
    return DSV4_JOB_DEFER;
  j->rc = dsv4_engine_forward_begin(j->d->engine, &j->f);
  if (!j->rc && j->f.in_flight)
    return DSV4_JOB_IN_FLIGHT;
  fwd_after(j);
  fwd_direct(j);
  return DSV4_JOB_DONE;
}

static void fwd_end(dsv4_job_t *job) {
  fwd_job_t *j = (fwd_job_t *)job;
  j->rc = dsv4_engine_forward_end(j->d->engine, &j->f);
  fwd_after(j);
  fwd_direct(j);
}

static const char *class_label(const dsv4_job_t *job) {
  return job->cls == DSV4_JOB_DECODE ? "decode" : "prefill";
}

static void observe_stage(dsv4_daemon_t *d, const char *stage, const char *cls, uint64_t ns) {
  const char *v[2] = {stage, cls};
  dsv4_metric_observe(d->m_forward_seconds, v, (double)ns * 1e-9);
}

/* Loop thread: the 200 answer (fwd_answer_make), or what the executor did not write of it. */
static void fwd_answer(fwd_job_t *j) {
  if (fwd_answer_make(j)) {
    dsv4_respond_error(j->req, DSV4_ENOMEM, "cannot build the response header", NULL);
    fwd_free(j);
    return;
  }
  /* The body is no longer needed (the answer's tensors are in the job's own buffers): back to
   * the page-locked pool now, not once the answer is out. */
  dsv4_daemon_buf_free(j->d, j->body_alloc);
  j->body = j->body_alloc = NULL;
  if (j->direct_on) {
    if (j->direct.written)
      dsv4_metric_add(j->d->m_direct_answers, NULL, 1);
    dsv4_respond_direct(j->req, &j->direct, 200, "application/octet-stream", j->ans, j->n_ans,
                        fwd_release, j);
    return;
  }
  dsv4_respond(j->req, 200, "application/octet-stream", NULL, 0, j->ans, j->n_ans, fwd_release, j);
}

/* Loop thread: a batch back from the executor, its counts and its answer (frees j). */
static void fwd_finish(fwd_job_t *j) {
  dsv4_daemon_t *d = j->d;
  dsv4_req_t *req = j->req;
  d->inflight--;
  if (j->rc) {
    json_t *det = j->err_details;
    j->err_details = NULL;
    switch (j->rc) {
    case DSV4_ENOSPC:
      dsv4_metric_add(d->m_alloc_failures, NULL, 1);
      det =
          json_pack("{s:I,s:I,s:s}", "needed", (json_int_t)j->f.error.needed, "free",
                    (json_int_t)j->f.error.free, "pool", j->f.error.pool ? j->f.error.pool : "swa");
      break;
    case DSV4_ESEQLIMIT:
      det = json_pack("{s:I,s:I}", "new_sequences", (json_int_t)j->f.error.new_sequences,
                      "free_sequences", (json_int_t)j->f.error.free_sequences);
      break;
    case DSV4_ERANGE:
      if (j->f.bad_tensor)
        det = json_pack("{s:s}", "tensor", j->f.bad_tensor);
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
    if (!req) {
      region_answer(j, j->rc, det);
      return;
    }
    dsv4_respond_error(req, j->rc, NULL, det);
    fwd_free(j);
    return;
  }

  const char *cls = class_label(&j->job);
  observe_stage(d, "queue", cls, j->job.t_start_ns - j->job.t_submit_ns);
  observe_stage(d, "validate", cls, j->f.timing.validate_ns);
  observe_stage(d, "plan", cls, j->f.timing.plan_ns);
  observe_stage(d, "kernel", cls, j->f.timing.kernel_ns);
  if (j->f.timing.staged) {
    observe_stage(d, "upload", cls, j->f.timing.upload_ns);
    observe_stage(d, "launch", cls, j->f.timing.launch_ns);
    observe_stage(d, "download", cls, j->f.timing.download_ns);
  }
  if (j->f.want_digest)
    observe_stage(d, "digest", cls, j->f.timing.digest_ns);
  if (j->f.chunks > 1) {
    observe_stage(d, "yield", cls, j->f.timing.yield_ns);
    dsv4_metric_add(d->m_prefill_chunks, NULL, j->f.chunks);
  }
  if (j->f.timing.flushed_bytes)
    dsv4_metric_add(d->m_flushed_bytes, NULL, (double)j->f.timing.flushed_bytes);
  dsv4_metric_observe(d->m_batch_tokens, NULL, (double)j->f.n_tokens);

  if (!req) {
    if (j->region_sent)
      dsv4_metric_add(d->m_direct_answers, NULL, 1);
    region_answer(j, 0, NULL);
    return;
  }
  /* The whole of the daemon's time for the request, the loop's hand-offs and reads included (the
   * stages above are the executor's part of it). */
  const char *v[1] = {cls};
  uint64_t t_out = j->direct.written ? j->direct.t_written_ns : uv_hrtime();
  dsv4_metric_observe(d->m_forward_request, v, (double)(t_out - req->t_start_ns) * 1e-9);
  fwd_answer(j);
}

/* /metrics requests waiting for the answers the executor sent before they came (daemon.h). */
typedef struct dsv4_metrics_wait {
  struct dsv4_metrics_wait *next;
  dsv4_req_t *req;
  uint64_t sent; /* d->direct_sent when it came */
} metrics_wait_t;

static void metrics_respond(dsv4_daemon_t *d, dsv4_req_t *req);

/* Loop thread. */
static void fwd_done(dsv4_job_t *job) {
  fwd_job_t *j = (fwd_job_t *)job;
  dsv4_daemon_t *d = j->d;
  int ahead = j->direct_on && !j->rc; /* fwd_direct counted it in d->direct_sent */
  fwd_finish(j);
  if (!ahead)
    return;
  /* Batches come back in the order the executor counted their answers: those waiting for at most
   * this many are answered, with this batch's counts in. */
  d->direct_back++;
  for (metrics_wait_t **p = &d->metrics_waiting; *p;) {
    metrics_wait_t *w = *p;
    if (w->sent > d->direct_back) {
      p = &w->next;
      continue;
    }
    *p = w->next;
    metrics_respond(d, w->req);
    free(w);
  }
}

static int layer_served(const void *engine, uint32_t layer) {
  return dsv4_engine_layer_index(engine, layer) >= 0;
}

static uint32_t layer_ratio(const void *engine, uint32_t layer) {
  return dsv4_engine_layer_ratio(engine, layer);
}

/* Executor thread, between two chunks of a prefill: the decodes waiting may run. */
static void fwd_yield(void *arg) {
  fwd_job_t *j = arg;
  dsv4_executor_yield(&j->d->ex, &j->job);
}

/* The executor's class and keys: decode when every segment is one token, else prefill; one key per
 * segment, so a batch never passes a waiting one that names the same sequence. A prefill yields to
 * waiting decodes between its chunks (prefill_chunk_tokens). */
static int fwd_schedule(fwd_job_t *j) {
  j->job.cls = dsv4_forward_is_decode(&j->f) ? DSV4_JOB_DECODE : DSV4_JOB_PREFILL;
  j->keys = malloc((j->f.n_segs ? j->f.n_segs : 1) * sizeof(*j->keys));
  if (!j->keys)
    return DSV4_ENOMEM;
  for (uint32_t s = 0; s < j->f.n_segs; s++)
    j->keys[s] = XXH3_64bits(j->f.segs[s].name, j->f.segs[s].name_len);
  j->job.keys = j->keys;
  j->job.n_keys = j->f.n_segs;
  if (j->job.cls == DSV4_JOB_PREFILL) {
    j->f.yield = fwd_yield;
    j->f.yield_arg = j;
  }
  return 0;
}

dsv4_forward_limits_t dsv4_forward_limits(const dsv4_daemon_t *d) {
  const dsv4_config_t *cfg = d->cfg;
  return (dsv4_forward_limits_t){
      .heads = cfg->heads,
      .max_batch_tokens = cfg->max_batch_tokens,
      .max_segments = cfg->max_segments,
      .max_position_embeddings = cfg->model.max_position_embeddings,
      .layer_served = layer_served,
      .layer_arg = d->engine,
      .layer_ratio = layer_ratio,
      .index_heads = cfg->model.index_n_heads,
  };
}

/* The batch from the parsed request: its fields, class and keys, and the attention check. */
static int fwd_setup(dsv4_daemon_t *d, fwd_job_t *j, char *why, size_t why_len) {
  int rc;
  j->f.layer = j->p.layer;
  j->f.n_tokens = j->p.n_tokens;
  j->f.q = j->p.q;
  j->f.kv = j->p.kv;
  j->f.segs = j->p.segs;
  j->f.n_segs = j->p.n_segs;
  j->f.want_digest = j->p.want_digest;
  j->f.q_unwanted = !j->p.want_q;
  j->f.ckv = j->p.ckv;
  j->f.ikv = j->p.ikv;
  j->f.iq = j->p.iq;
  j->f.iw = j->p.iw;
  j->q_bytes = j->p.q_bytes;
  rc = fwd_schedule(j);
  if (rc)
    return rc;
  /* The batch's mode: its attention's, and its indexer's also when it asks for topk alone (SPEC
   * §8.9). */
  j->f.attention = dsv4_engine_attention_mode(d->engine, j->p.layer, j->p.attention);
  if (j->p.want_attn || j->p.want_lse) {
    /* Refused here, before the batch is queued, so the refusal changes nothing. */
    rc = dsv4_engine_attention_check(d->engine, j->p.layer, j->f.attention, why, why_len);
    if (rc)
      return rc;
  }
  return 0;
}

static int fwd_prepare(dsv4_daemon_t *d, fwd_job_t *j, char *why, size_t why_len) {
  const dsv4_config_t *cfg = d->cfg;
  const dsv4_forward_limits_t lim = dsv4_forward_limits(d);
  int rc;
  /* The header as its watcher parsed it when it came (the same view over the same bytes). */
  memset(&j->p, 0, sizeof(j->p));
  if (dsv4_arrival_take_view(j->arrival, j->body, j->req->body_len, &j->p.view))
    rc = dsv4_forward_parse_view(&lim, &j->p, why, why_len);
  else
    rc = dsv4_forward_parse(j->body, j->req->body_len, &lim, &j->p, why, why_len);
  if (!rc)
    rc = fwd_setup(d, j, why, why_len);
  if (rc)
    return rc;
  /* What its watcher checked and hashed as the body came, for the engine to resume. */
  j->f.check = dsv4_arrival_take_check(j->arrival, &j->p);
  if (j->f.check)
    dsv4_metric_add(d->m_arrival_bytes, NULL, (double)dsv4_check_fed_bytes(j->f.check));
  int attend = j->p.want_attn || j->p.want_lse;
  /* q_out, slots, attn and lse, each from a 64-byte boundary. attn is the kernel's output even
   * when only lse is asked for. */
  size_t n = j->p.n_tokens, lse_bytes = n * cfg->heads * sizeof(float);
  size_t q_span = (j->q_bytes + 63) & ~(size_t)63, off_slots = q_span;
  size_t off_attn = off_slots + ((n * sizeof(int64_t) + 63) & ~(size_t)63);
  size_t off_lse = off_attn + (attend ? q_span : 0);
  size_t off_topk = off_lse + (attend ? (lse_bytes + 63) & ~(size_t)63 : 0);
  size_t topk_bytes = j->p.want_topk ? n * cfg->model.index_topk * sizeof(int32_t) : 0;
  /* In the pinned pool when it has room, so the device downloads where the socket sends from. */
  size_t total = (off_topk + topk_bytes + 63) & ~(size_t)63;
  j->out = dsv4_daemon_buf_alloc(d, total, "output");
  if (!j->out)
    return DSV4_ENOMEM;
  j->f.q_out = (uint16_t *)(void *)j->out;
  j->f.slots = (int64_t *)(void *)(j->out + off_slots);
  if (attend) {
    j->f.attn = (uint16_t *)(void *)(j->out + off_attn);
    j->f.lse = j->p.want_lse ? (float *)(void *)(j->out + off_lse) : NULL;
  }
  if (j->p.want_topk)
    j->f.topk = (int32_t *)(void *)(j->out + off_topk);
  return 0;
}

/* Whether one data-plane connection is open (HTTP, its Unix socket, the shared regions' socket): a
 * lone client, whose next request cannot come while a batch runs on the loop thread. */
static int lone_client(const dsv4_daemon_t *d) {
  return dsv4_server_connections(d->data) + (d->shm ? dsv4_shm_connections(d->shm) : 0) == 1;
}

/* Loop thread: the accepted batch to the executor, or run here at once when it is a decode of at
 * most inline_decode_tokens tokens from a lone client and the executor is idle (then answered
 * before this returns). */
static int fwd_submit(dsv4_daemon_t *d, fwd_job_t *j) {
  d->inflight++;
  if (j->job.cls == DSV4_JOB_DECODE && j->f.n_tokens <= d->cfg->inline_decode_tokens &&
      lone_client(d) && dsv4_executor_run_here(&d->ex, &j->job)) {
    dsv4_metric_add(d->m_inline_batches, NULL, 1);
    fwd_done(&j->job);
    return 0;
  }
  /* Only for the executor: an answer made on the loop thread goes out from there at once. */
  if (j->req && d->cfg->direct_answer_bytes)
    j->direct_on = dsv4_direct_open(j->req, d->cfg->direct_answer_bytes, &j->direct) == 0;
  else if (!j->req)
    j->direct_on = d->cfg->direct_answer_bytes && j->region.answer_now;
  int rc = dsv4_executor_submit(&d->ex, &j->job);
  if (rc)
    d->inflight--;
  return rc;
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
  j->direct.fd = -1; /* none opened (dsv4_direct_close is then a no-op) */
  j->body = dsv4_req_take_body(req, &j->body_alloc);
  j->arrival = dsv4_req_take_watch(req);
  j->job.run = fwd_run;
  j->job.done = fwd_done;
  j->job.begin = fwd_begin;
  j->job.end = fwd_end;
  dl = dsv4_req_header(req, "Dsv4d-Deadline-Ms");
  if (dl) {
    uint64_t ms, span = UINT64_MAX;
    size_t len = strlen(dl);
    if (len == 0 || strspn(dl, "0123456789") != len) {
      dsv4_respond_error(req, DSV4_EINVAL, "Dsv4d-Deadline-Ms must be a whole number of ms", NULL);
      fwd_free(j);
      return;
    }
    /* A deadline beyond the clock's range saturates (no deadline) rather than wrap into the past,
     * however many digits it has. */
    if (dsv4_parse_decimal(dl, len, UINT64_MAX / 1000000u, &ms) == 0)
      span = ms * 1000000u;
    j->deadline_ns = span > UINT64_MAX - req->t_start_ns ? UINT64_MAX : req->t_start_ns + span;
  }
  msg[0] = '\0';
  rc = fwd_prepare(d, j, msg, sizeof(msg));
  if (rc) {
    json_t *det = NULL;
    if (j->p.bad_tensor) /* SPEC §8.8 names the tensor and the reason */
      det = json_pack("{s:s,s:s}", "tensor", j->p.bad_tensor, "reason", j->p.bad_reason);
    dsv4_respond_error(req, rc, msg[0] ? msg : NULL, det);
    fwd_free(j);
    return;
  }
  rc = fwd_submit(d, j);
  if (rc) {
    dsv4_respond_error(req, rc, NULL, NULL);
    fwd_free(j);
  }
}

int dsv4_forward_submit_region(dsv4_daemon_t *d, dsv4_forward_req_t *p,
                               const dsv4_region_forward_t *rf, char *why, size_t why_len) {
  if (d->draining)
    return DSV4_EDRAIN;
  fwd_job_t *j = calloc(1, sizeof(*j));
  if (!j)
    return DSV4_ENOMEM;
  j->d = d;
  j->direct.fd = -1; /* a region request's answer never goes through it */
  j->region = *rf;
  j->p = *p;
  memset(p, 0, sizeof(*p));
  j->job.run = fwd_run;
  j->job.done = fwd_done;
  j->job.begin = fwd_begin;
  j->job.end = fwd_end;
  j->deadline_ns = rf->deadline_ns;
  j->q_bytes = j->p.q_bytes;
  int rc = fwd_setup(d, j, why, why_len);
  j->f.q_out = rf->q_out;
  j->f.slots = rf->slots;
  j->f.attn = rf->attn;
  j->f.lse = rf->lse;
  j->f.topk = rf->topk;
  /* q_out is the insert's output and the attention's input even when q is not asked for, and attn
   * the kernel's output even when only lse is: buffers of the job's own then. */
  int own_q = !rc && !j->p.want_q, own_attn = !rc && j->p.want_lse && !j->p.want_attn;
  size_t q_span = (j->q_bytes + 63) & ~(size_t)63;
  if (own_q || own_attn) {
    j->out = dsv4_daemon_buf_alloc(d, q_span * (size_t)(own_q + own_attn), "output");
    rc = j->out ? 0 : DSV4_ENOMEM;
  }
  if (!rc && own_q)
    j->f.q_out = (uint16_t *)(void *)j->out;
  if (!rc && own_attn)
    j->f.attn = (uint16_t *)(void *)(j->out + (own_q ? q_span : 0));
  if (!rc)
    rc = fwd_submit(d, j);
  if (rc) {
    *p = j->p; /* the caller still owns the request it is refused with */
    memset(&j->p, 0, sizeof(j->p));
    fwd_free(j);
    return rc;
  }
  return 0;
}

/* ---- GET / DELETE /v1/sequences/{seq} ---- */

typedef struct {
  dsv4_job_t job;
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  int method;
  char name[DSV4_SEQ_NAME_MAX + 1];
  uint32_t name_len;
  uint64_t key; /* XXH3 of name: kept in order with batches that name it */
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
    dsv4_respond_error(req, DSV4_EINVAL, "a sequence name must be " DSV4_SEQ_NAME_RULE, NULL);
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
  /* A control job: it passes waiting prefills, never one that names its sequence. */
  j->job.cls = DSV4_JOB_CONTROL;
  j->key = XXH3_64bits(j->name, j->name_len);
  j->job.keys = &j->key;
  j->job.n_keys = 1;
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
  else if (d->restoring)
    why = "restoring";
  if (why)
    dsv4_respond_json(req, 503, json_pack("{s:s,s:s}", "status", "not_ready", "reason", why));
  else
    dsv4_respond_json(
        req, 200,
        json_pack("{s:s,s:s}", "status", "ready", "backend", dsv4_engine_backend_name(d->engine)));
}

static void metrics_respond(dsv4_daemon_t *d, dsv4_req_t *req) {
  char *text = NULL;
  size_t len = 0;
  if (dsv4_metrics_render(d->metrics, &text, &len)) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  uv_buf_t b = uv_buf_init(text, (unsigned)len);
  dsv4_respond(req, 200, DSV4_METRICS_CONTENT_TYPE, NULL, 0, &b, 1, free_release, text);
}

/* A client may have read an answer the executor sent before that batch came back here: then the
 * metrics wait for it (fwd_done), so that what a client has seen answered is counted. Every such
 * batch comes back, also at shutdown (the executor hands back all it ran). */
static void on_metrics(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  uint64_t sent = atomic_load(&d->direct_sent);
  metrics_wait_t *w = sent > d->direct_back ? malloc(sizeof(*w)) : NULL;
  if (!w) {
    metrics_respond(d, req);
    return;
  }
  *w = (metrics_wait_t){d->metrics_waiting, req, sent};
  d->metrics_waiting = w;
}

/* dsv4d_kv_blocks{pool,state} and dsv4d_kv_blocks_total{pool} of one block pool. */
static void set_pool_blocks(dsv4_daemon_t *d, const char *pool, uint32_t total, uint32_t free_b) {
  const char *used_l[2] = {pool, "used"}, *free_l[2] = {pool, "free"}, *pool_l[1] = {pool};
  dsv4_metric_set(d->m_blocks, used_l, (double)(total - free_b));
  dsv4_metric_set(d->m_blocks, free_l, (double)free_b);
  dsv4_metric_set(d->m_blocks_total, pool_l, (double)total);
}

static void collect(dsv4_metrics_t *m, void *arg) {
  dsv4_daemon_t *d = arg;
  uint32_t total = dsv4_engine_blocks_total(d->engine);
  uint32_t free_b = dsv4_engine_blocks_free(d->engine);
  uint32_t c_total[2], c_free[2];
  (void)m;
  dsv4_metric_set(d->m_usage, NULL, total ? (double)(total - free_b) / (double)total : 0.0);
  set_pool_blocks(d, "swa", total, free_b);
  /* SPEC §8.7: the compressed branch's entry pools, when some served layer runs it. */
  dsv4_engine_cpool_counts(d->engine, c_total, c_free);
  if (c_total[0])
    set_pool_blocks(d, "c4", c_total[0], c_free[0]);
  if (c_total[1])
    set_pool_blocks(d, "c128", c_total[1], c_free[1]);
  dsv4_metric_set(d->m_sequences, NULL, (double)dsv4_engine_sequences(d->engine));
  dsv4_metric_set(d->m_inflight, NULL, (double)d->inflight);
  const char *decode_l[1] = {"decode"}, *prefill_l[1] = {"prefill"};
  dsv4_metric_set(d->m_queued, decode_l, (double)dsv4_executor_waiting(&d->ex, DSV4_JOB_DECODE));
  dsv4_metric_set(d->m_queued, prefill_l, (double)dsv4_executor_waiting(&d->ex, DSV4_JOB_PREFILL));
  dsv4_pinned_stats_t ps = {0};
  if (d->pinned)
    dsv4_pinned_pool_stats(d->pinned, &ps);
  const char *used_l[1] = {"used"}, *free_l[1] = {"free"};
  dsv4_metric_set(d->m_pinned_bytes, used_l, (double)ps.used);
  dsv4_metric_set(d->m_pinned_bytes, free_l, (double)(ps.total - ps.used));
  dsv4_metric_set(d->m_pinned_total, NULL, (double)ps.total);
}

/* The pinned pool's bytes by state and in all (0 while it is off) and the buffers it could not
 * hold. Both uses render from the start, so a scrape can tell none from not yet counted. */
static int pinned_metrics_init(dsv4_daemon_t *d) {
  const char *state[1] = {"state"}, *use[1] = {"use"};
  const char *body_l[1] = {"body"}, *output_l[1] = {"output"};
  dsv4_metrics_t *m = d->metrics;
  int rc = 0;
  rc |= dsv4_metrics_gauge(m, "dsv4d_pinned_pool_bytes",
                           "Bytes of the page-locked pool for bodies and answers, by state.", state,
                           1, &d->m_pinned_bytes);
  rc |= dsv4_metrics_gauge(m, "dsv4d_pinned_pool_bytes_total",
                           "Bytes of the page-locked pool (used + free; 0 when it is off).", NULL,
                           0, &d->m_pinned_total);
  rc |=
      dsv4_metrics_counter(m, "dsv4d_pinned_pool_fallbacks_total",
                           "Request bodies and answers put in heap memory because the page-locked "
                           "pool had no room, by use (body, output).",
                           use, 1, &d->m_pinned_fallbacks);
  if (rc)
    return rc;
  dsv4_metric_add(d->m_pinned_fallbacks, body_l, 0);
  dsv4_metric_add(d->m_pinned_fallbacks, output_l, 0);
  return 0;
}

int dsv4_daemon_metrics_init(dsv4_daemon_t *d) {
  static const double token_bounds[] = {1,   2,   4,    8,    16,   32,   64,   128,
                                        256, 512, 1024, 2048, 4096, 8192, 16384};
  const char *state[2] = {"pool", "state"}, *stage[2] = {"stage", "class"}, *cls[1] = {"class"};
  const char *pool[1] = {"pool"};
  const char *build[2] = {"version", "backend"};
  dsv4_metrics_t *m = d->metrics;
  int rc = 0;
  rc |= dsv4_metrics_gauge(m, "dsv4d_kv_cache_usage_ratio", "Used KV block ids over all block ids.",
                           NULL, 0, &d->m_usage);
  rc |=
      dsv4_metrics_gauge(m, "dsv4d_kv_blocks",
                         "Block ids by pool (swa; c4, c128 for the compressed entries) and state.",
                         state, 2, &d->m_blocks);
  /* The pool's geometry, for a router that scores daemons by free tokens (free blocks x block size)
   * without reading the configuration: both are fixed for the life of the process. */
  rc |= dsv4_metrics_gauge(m, "dsv4d_kv_block_size", "Tokens per KV cache block.", NULL, 0,
                           &d->m_block_size);
  rc |= dsv4_metrics_gauge(m, "dsv4d_kv_blocks_total", "Block ids of a pool (used + free).", pool,
                           1, &d->m_blocks_total);
  rc |= dsv4_metrics_gauge(m, "dsv4d_sequences", "Live sequences.", NULL, 0, &d->m_sequences);
  rc |= dsv4_metrics_histogram(m, "dsv4d_batch_tokens", "Tokens per forward batch.", NULL, 0,
                               token_bounds, sizeof(token_bounds) / sizeof(token_bounds[0]),
                               &d->m_batch_tokens);
  rc |= dsv4_metrics_histogram(m, "dsv4d_forward_seconds",
                               "Forward batch time by stage and class (decode, prefill).", stage, 2,
                               dsv4_seconds_bounds, DSV4_SECONDS_BOUNDS, &d->m_forward_seconds);
  rc |= dsv4_metrics_histogram(
      m, "dsv4d_forward_request_seconds",
      "HTTP forward requests answered 200, by class (decode, prefill): from "
      "the request's first byte to its answer handed to the socket.",
      cls, 1, dsv4_seconds_bounds, DSV4_SECONDS_BOUNDS, &d->m_forward_request);
  rc |= dsv4_metrics_counter(m, "dsv4d_kv_alloc_failures_total",
                             "Batches refused because the KV pool was exhausted.", NULL, 0,
                             &d->m_alloc_failures);
  rc |= dsv4_metrics_gauge(m, "dsv4d_inflight_batches", "Forward batches accepted, not answered.",
                           NULL, 0, &d->m_inflight);
  rc |= dsv4_metrics_counter(m, "dsv4d_prefill_chunks_total",
                             "Kernel chunks of the prefills run in chunks (prefill_chunk_tokens).",
                             NULL, 0, &d->m_prefill_chunks);
  rc |= dsv4_metrics_counter(m, "dsv4d_inline_batches_total",
                             "Decode batches of a lone client run on the event loop's thread, the "
                             "executor being idle (inline_decode_tokens).",
                             NULL, 0, &d->m_inline_batches);
  rc |= dsv4_metrics_counter(m, "dsv4d_direct_answers_total",
                             "Forward answers whose first bytes the executor's thread wrote to the "
                             "socket itself, as soon as each was made (direct_answer_bytes).",
                             NULL, 0, &d->m_direct_answers);
  rc |= dsv4_metrics_counter(m, "dsv4d_arrival_checked_bytes_total",
                             "Bytes of forward bodies' tensors range-checked and hashed by the "
                             "thread that read them, as they arrived (check_on_arrival).",
                             NULL, 0, &d->m_arrival_bytes);
  rc |=
      dsv4_metrics_counter(m, "dsv4d_cache_flushed_bytes_total",
                           "Bytes of forward batches' q and kv flushed from the CPU caches before "
                           "the device copied them (cache_flush_bytes).",
                           NULL, 0, &d->m_flushed_bytes);
  rc |= dsv4_metrics_gauge(m, "dsv4d_queued_batches",
                           "Forward batches waiting in the executor (not running) by class.", cls,
                           1, &d->m_queued);
  rc |= dsv4_metrics_gauge(m, "dsv4d_build_info", "Build and backend of this daemon.", build, 2,
                           &d->m_build_info);
  rc |= pinned_metrics_init(d);
  if (rc)
    return DSV4_ENOMEM;
  {
    const char *v[2] = {DSV4_VERSION, dsv4_engine_backend_name(d->engine)};
    dsv4_metric_set(d->m_build_info, v, 1);
  }
  dsv4_metric_set(d->m_block_size, NULL, (double)d->cfg->block_size);
  dsv4_metric_add(d->m_alloc_failures, NULL, 0);
  dsv4_metric_add(d->m_prefill_chunks, NULL, 0);
  dsv4_metric_add(d->m_inline_batches, NULL, 0);
  dsv4_metric_add(d->m_direct_answers, NULL, 0);
  dsv4_metric_add(d->m_arrival_bytes, NULL, 0);
  dsv4_metric_add(d->m_flushed_bytes, NULL, 0);
  dsv4_metrics_set_collect(m, collect, d);
  return 0;
}

/* A forward body's place (dsv4_route_t.body_skew): its safetensors data section, 8 + the header's
 * length in, on a 64-byte boundary, so that the tensors the launches read in place are aligned
 * (backend.h, host_alias) whenever their offsets in the section are. */
static size_t forward_body_skew(const uint8_t *first8) {
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--)
    hlen = hlen << 8 | first8[i];
  return (64 - (size_t)((8 + hlen) & 63)) & 63;
}

/* The forward route's body watcher (check_on_arrival): forward_arrival.h. */
static void *forward_watch_begin(void *ctx, size_t content_length) {
  const dsv4_forward_limits_t lim = dsv4_forward_limits(ctx);
  return dsv4_arrival_begin(&lim, content_length);
}

static void forward_watch_seen(void *w, const uint8_t *body, size_t have) {
  dsv4_arrival_seen(w, body, have);
}

static void forward_watch_end(void *w) {
  dsv4_arrival_end(w);
}

static const dsv4_body_watch_t forward_watch = {forward_watch_begin, forward_watch_seen,
                                                forward_watch_end};

size_t dsv4_data_routes(dsv4_daemon_t *d, dsv4_route_t *out, size_t cap) {
  const dsv4_route_t routes[] = {
      {DSV4_HTTP_POST, "/v1/forward", "forward", d->cfg->max_body_bytes_effective, 0, on_forward, d,
       forward_body_skew, d->cfg->check_on_arrival ? &forward_watch : NULL},
      {DSV4_HTTP_GET | DSV4_HTTP_DELETE, "/v1/sequences/", "sequences", 0, 0, on_sequence, d, NULL,
       NULL},
      {DSV4_HTTP_GET, "/healthz", "healthz", 0, 1, on_healthz, d, NULL, NULL},
      {DSV4_HTTP_GET, "/readyz", "readyz", 0, 1, on_readyz, d, NULL, NULL},
      {DSV4_HTTP_GET, "/metrics", "metrics", 0, 1, on_metrics, d, NULL, NULL},
  };
  return dsv4_routes_copy(routes, sizeof(routes) / sizeof(routes[0]), out, cap);
}

size_t dsv4_routes_copy(const dsv4_route_t *routes, size_t n, dsv4_route_t *out, size_t cap) {
  if (n > cap)
    n = cap;
  memcpy(out, routes, n * sizeof(routes[0]));
  return n;
}
