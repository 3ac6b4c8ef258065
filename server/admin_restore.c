/*
 * PUT /admin/v1/sequences/{seq}[?replace=1]: a sequence recreated from a dump (SPEC §6), and
 * DELETE /admin/v1/sequences/{seq}, the admin plane's own delete (dsv4ctl migrate's last step).
 *
 * A restore is read and checked whole before anything changes: the dump is parsed and every digest
 * recomputed on libuv's thread pool (neither the loop nor a batch waits for it), then one executor
 * job, ordered with the batches that name the sequence, checks the name and the room and places
 * the records in freshly taken blocks (engine_restore.c). Its answer gives the digests read back
 * from the cache, which are the dump's.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "admin.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "engine_admin.h"
#include "errors.h"
#include "forward_parse.h"
#include "log.h"
#include "records.h"
#include "restore.h"
#include "safetensors.h"

#define SEQ_PREFIX "/admin/v1/sequences/"

uint64_t dsv4__restore_max_body(const dsv4_config_t *cfg) {
  uint64_t per_layer = (uint64_t)cfg->kv_blocks * cfg->block_size * (DSV4_RECORD_BYTES + 8);
  uint64_t body = 8 + DSV4_ST_MAX_HEADER + per_layer * cfg->n_served;
  /* A layer that may run the compressed branch adds its entries filling its pool and one ring. */
  for (uint32_t i = 0; i < cfg->n_served; i++) {
    uint32_t r = cfg->model.compress_ratios[cfg->served_layers[i]];
    if (r == 4)
      body += (uint64_t)cfg->c4_blocks * cfg->block_size *
                  (DSV4_RECORD_BYTES + 8 + DSV4_INDEX_RECORD_BYTES) +
              DSV4_RING_FLOATS(4u) * sizeof(float);
    else if (r == 128)
      body += (uint64_t)cfg->c128_blocks * cfg->block_size * (DSV4_RECORD_BYTES + 8) +
              DSV4_RING_FLOATS(128u) * sizeof(float);
  }
  return body;
}

void dsv4__restore_expect(const dsv4_daemon_t *d, dsv4_dump_expect_t *want, char model[17]) {
  const dsv4_config_t *cfg = d->cfg;
  dsv4_dump_model_id(&cfg->model, model);
  *want = (dsv4_dump_expect_t){
      .served_layers = cfg->served_layers,
      .n_served = cfg->n_served,
      .heads = cfg->heads,
      .head_offset = cfg->head_offset,
      .model_id = model,
      .max_position = cfg->model.max_position_embeddings,
      .ratio = dsv4_engine_c_ratios(d->engine),
  };
}

/* The restored sequence's digests, read back from the cache, against the dump's. */
static int check_back(dsv4_daemon_t *d, const char *name, uint32_t len,
                      const dsv4_dump_parsed_t *p) {
  dsv4_seq_info_t info;
  int rc = dsv4_engine_seq_info(d->engine, name, len, &info);
  for (uint32_t i = 0; rc == 0 && i < d->cfg->n_served; i++) {
    uint64_t dig;
    rc = dsv4_engine_seq_digest(d->engine, i, &info, &dig, NULL, NULL);
    if (rc == 0 && dig != p->digest[i])
      rc = DSV4_EIO;
  }
  if (rc != DSV4_ENOSEQ)
    dsv4_seq_info_free(&info);
  /* The compressed state too: its three digests as the dump's. */
  for (uint32_t i = 0; rc == 0 && dsv4_engine_runs_compressed(d->engine) && i < d->cfg->n_served;
       i++) {
    dsv4_engine_cstate_t cs;
    uint64_t got[3], want[3];
    if (!p->cstate[i].ratio)
      continue;
    rc = dsv4_engine_read_cstate(d->engine, name, len, i, &cs);
    if (rc)
      break;
    dsv4_dump_cdigests(&cs, &got[0], &got[1], &got[2]);
    dsv4_dump_cdigests(&p->cstate[i], &want[0], &want[1], &want[2]);
    if (cs.j0 != p->cstate[i].j0 || cs.j1 != p->cstate[i].j1 || memcmp(got, want, sizeof(got)))
      rc = DSV4_EIO;
    dsv4_engine_cstate_free(&cs);
  }
  return rc;
}

int dsv4__restore_apply(dsv4_daemon_t *d, const char *name, uint32_t len,
                        const dsv4_dump_parsed_t *p, int replace,
                        dsv4_engine_restore_result_t *res) {
  dsv4_engine_restore_t r = {p->p0, p->first, p->layers, p->records,
                             dsv4_engine_runs_compressed(d->engine) ? p->cstate : NULL};
  uint64_t now = uv_hrtime();
  /* Sweep first, so an idle name is seen as the expired one a batch would be told it is. */
  dsv4_engine_expire(d->engine, now);
  int rc = dsv4_engine_restore(d->engine, name, len, &r, replace, now, res);
  if (rc)
    return rc;
  rc = check_back(d, name, len, p);
  if (rc) {
    /* What the cache holds is not what was written: never serve from it. */
    int existed;
    dsv4_engine_delete(d->engine, name, len, &existed);
    res->dropped = 1;
    snprintf(res->why, sizeof(res->why), "the records read back do not match the dump (%s)",
             dsv4_strerror(rc));
    return DSV4_EBACKEND;
  }
  return 0;
}

json_t *dsv4__restore_error_details(int rc, const dsv4_dump_parsed_t *p,
                                    const dsv4_engine_restore_result_t *res, const char *seq) {
  switch (rc) {
  case DSV4_EGEOMETRY:
    if (p && p->field[0])
      return json_pack("{s:s,s:s,s:s,s:s}", "seq", seq, "field", p->field, "dump", p->dump_value,
                       "daemon", p->daemon_value);
    return json_pack("{s:s,s:s}", "seq", seq, "field", "block_size");
  case DSV4_EDIGEST:
    return json_pack("{s:s,s:I,s:s,s:s}", "seq", seq, "layer", (json_int_t)p->layer, "expected",
                     p->expected, "computed", p->computed);
  case DSV4_ENOSPC:
    if (res->sequences_full)
      return json_pack("{s:s,s:b}", "seq", seq, "sequences_full", 1);
    return json_pack("{s:s,s:s,s:I,s:I}", "seq", seq, "pool", res->pool[0] ? res->pool : "swa",
                     "needed", (json_int_t)res->needed, "free", (json_int_t)res->free);
  case DSV4_EBACKEND: {
    json_t *dropped = json_array();
    if (res->dropped)
      json_array_append_new(dropped, json_string(seq));
    return json_pack("{s:s,s:o}", "seq", seq, "dropped", dropped);
  }
  default:
    return json_pack("{s:s}", "seq", seq);
  }
}

/* ---- PUT ----------------------------------------------------------------------------------- */

typedef struct {
  dsv4_job_t job; /* first */
  uv_work_t work;
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t seq_len;
  uint64_t key; /* XXH3 of seq: ordered with the batches that name it */
  int replace;
  uint8_t *body;
  void *body_alloc; /* what holds body (dsv4_req_take_body) */
  size_t body_len;
  char model[17];
  dsv4_dump_expect_t want;
  dsv4_dump_parsed_t parsed;
  dsv4_engine_restore_result_t res;
  int rc;
  json_t *doc;
} restore_job_t;

static void restore_free(restore_job_t *j) {
  dsv4_dump_parsed_free(&j->parsed);
  json_decref(j->doc);
  free(j->body_alloc);
  free(j);
}

/* The answer's document: the restored sequence as the cache now holds it. Executor thread. */
static json_t *restored_doc(restore_job_t *j) {
  const dsv4_config_t *cfg = j->d->cfg;
  json_t *next = json_object(), *dig = json_object();
  for (uint32_t i = 0; i < cfg->n_served; i++) {
    char k[16], h[17];
    snprintf(k, sizeof(k), "%u", cfg->served_layers[i]);
    dsv4_digest_hex(j->parsed.digest[i], h);
    json_object_set_new(next, k, json_integer(j->parsed.layers[i].next));
    json_object_set_new(dig, k, json_string(h));
  }
  return json_pack("{s:s,s:s,s:I,s:o,s:I,s:b,s:o}", "instance", j->d->instance, "seq", j->seq, "p0",
                   (json_int_t)j->parsed.p0, "next", next, "blocks", (json_int_t)j->res.blocks,
                   "replaced", j->res.replaced, "digests", dig);
}

static void restore_run(dsv4_job_t *job) {
  restore_job_t *j = (restore_job_t *)job;
  j->rc = dsv4__restore_apply(j->d, j->seq, j->seq_len, &j->parsed, j->replace, &j->res);
  if (!j->rc && !(j->doc = restored_doc(j)))
    j->rc = DSV4_ENOMEM;
}

/* Answer a refused restore: the reader's or the engine's sentence, with the details. */
static void restore_refuse(restore_job_t *j) {
  const char *why = j->parsed.why[0] ? j->parsed.why : j->res.why[0] ? j->res.why : NULL;
  json_t *det = dsv4__restore_error_details(j->rc, &j->parsed, &j->res, j->seq);
  dsv4_logp(DSV4_LOG_WARN, "restore refused", "{s:s,s:s,s:s}", "seq", j->seq, "error",
            dsv4_http_error(j->rc).code, "why", why ? why : dsv4_strerror(j->rc));
  dsv4_respond_error(j->req, j->rc, why, det);
}

static void restore_done(dsv4_job_t *job) {
  restore_job_t *j = (restore_job_t *)job;
  if (j->rc) {
    restore_refuse(j);
  } else {
    dsv4_logp(DSV4_LOG_INFO, "restored", "{s:s,s:I,s:I,s:b,s:f}", "seq", j->seq, "bytes",
              (json_int_t)j->body_len, "blocks", (json_int_t)j->res.blocks, "replaced",
              j->res.replaced, "ms", (double)(uv_hrtime() - j->req->t_start_ns) * 1e-6);
    dsv4_respond_json(j->req, j->res.replaced ? 200 : 201, j->doc);
    j->doc = NULL;
  }
  restore_free(j);
}

/* libuv's thread pool: the whole dump read and checked, digests included. */
static void parse_work(uv_work_t *w) {
  restore_job_t *j = w->data;
  j->rc = dsv4_dump_parse(j->body, j->body_len, &j->want, &j->parsed);
}

static void parse_after(uv_work_t *w, int status) {
  restore_job_t *j = w->data;
  if (status)
    j->rc = DSV4_EIO;
  else if (!j->rc && j->d->draining)
    j->rc = DSV4_EDRAIN;
  /* A client that went away during the checks would never learn of the restore: none is made. */
  else if (!j->rc && dsv4_req_gone(j->req))
    j->rc = DSV4_EIO;
  if (j->rc) {
    restore_refuse(j);
    restore_free(j);
    return;
  }
  j->job.run = restore_run;
  j->job.done = restore_done;
  j->key = XXH3_64bits(j->seq, j->seq_len);
  j->job.keys = &j->key;
  j->job.n_keys = 1;
  int rc = j->d->ex.stopping ? DSV4_EDRAIN : dsv4_executor_submit(&j->d->ex, &j->job);
  if (rc) {
    dsv4_respond_error(j->req, rc, NULL, NULL);
    restore_free(j);
  }
}

/* The sequence name of a /admin/v1/sequences/{seq} path, or 0 after answering 400 or 404. */
static uint32_t path_seq(dsv4_req_t *req, char out[DSV4_SEQ_NAME_MAX + 1]) {
  const char *name = req->path + strlen(SEQ_PREFIX);
  size_t len = strlen(name);
  if (strchr(name, '/')) {
    dsv4_respond_error(req, DSV4_ENOTFOUND, "no such route", NULL);
    return 0;
  }
  if (!dsv4_seq_name_valid(name, len)) {
    dsv4_respond_error(req, DSV4_EINVAL, "a sequence name must be " DSV4_SEQ_NAME_RULE, NULL);
    return 0;
  }
  memcpy(out, name, len + 1);
  return (uint32_t)len;
}

/* Writes to the cache follow the dumps' rule: a token, or a loopback listener. */
static int writes_allowed(dsv4_daemon_t *d, dsv4_req_t *req) {
  if (d->admin_token || d->admin_loopback)
    return 1;
  dsv4_respond_error(req, DSV4_EFORBID,
                     "restores and deletes need admin_token_file when the admin listener is not "
                     "loopback",
                     NULL);
  return 0;
}

void dsv4__admin_on_restore(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  dsv4_admin_query_t q;
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t len;
  if (!writes_allowed(d, req) || !(len = path_seq(req, seq)) ||
      dsv4__admin_query(d, req, DSV4_AQ_REPLACE, 0, &q))
    return;
  if (d->draining) {
    dsv4_respond_error(req, DSV4_EDRAIN, NULL, NULL);
    return;
  }
  if (!req->body || !req->body_len) {
    dsv4_respond_error(req, DSV4_EINVAL, "empty body: a restore's body is a dump", NULL);
    return;
  }
  restore_job_t *j = calloc(1, sizeof(*j));
  if (!j) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  j->d = d;
  j->req = req;
  memcpy(j->seq, seq, len + 1);
  j->seq_len = len;
  j->replace = q.replace;
  j->body_len = req->body_len;
  j->body = dsv4_req_take_body(req, &j->body_alloc);
  dsv4__restore_expect(d, &j->want, j->model);
  j->work.data = j;
  int rc = uv_queue_work(d->loop, &j->work, parse_work, parse_after);
  if (rc) {
    dsv4_respond_error(req, DSV4_EIO, "cannot queue the dump's checks", NULL);
    restore_free(j);
  }
}

/* ---- DELETE -------------------------------------------------------------------------------- */

typedef struct {
  dsv4_job_t job; /* first */
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t seq_len;
  uint64_t key;
  int rc, existed;
} delete_job_t;

static void delete_run(dsv4_job_t *job) {
  delete_job_t *j = (delete_job_t *)job;
  j->rc = dsv4_engine_delete(j->d->engine, j->seq, j->seq_len, &j->existed);
}

static void delete_done(dsv4_job_t *job) {
  delete_job_t *j = (delete_job_t *)job;
  if (j->rc) {
    dsv4_respond_error(j->req, j->rc, NULL, json_pack("{s:s}", "seq", j->seq));
  } else {
    dsv4_hdr_t h = {"Dsv4d-Existed", j->existed ? "1" : "0"};
    dsv4_respond(j->req, 204, NULL, &h, 1, NULL, 0, NULL, NULL);
  }
  free(j);
}

void dsv4__admin_on_delete(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  dsv4_admin_query_t q;
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t len;
  if (!writes_allowed(d, req) || !(len = path_seq(req, seq)) || dsv4__admin_query(d, req, 0, 0, &q))
    return;
  delete_job_t *j = calloc(1, sizeof(*j));
  if (!j) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  j->d = d;
  j->req = req;
  memcpy(j->seq, seq, len + 1);
  j->seq_len = len;
  j->job.run = delete_run;
  j->job.done = delete_done;
  j->key = XXH3_64bits(j->seq, j->seq_len);
  j->job.keys = &j->key;
  j->job.n_keys = 1;
  /* As on the data plane: a delete frees memory and is never refused for a full queue. */
  if (d->ex.stopping) {
    dsv4_respond_error(req, DSV4_EDRAIN, NULL, NULL);
    free(j);
    return;
  }
  dsv4_executor_submit_force(&d->ex, &j->job);
}
