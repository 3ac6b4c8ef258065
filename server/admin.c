/*
 * The admin plane (SPEC §6 admin routes, README "Admin API"): GET /admin/v1/cache, /sequences,
 * /sequences/{seq}, /sequences/{seq}/tokens/{pos}, /sequences/{seq}/entries/{j}, /checksums and
 * /config, the audit log line of
 * every admin call, and the route table (the dump lives in admin_dump.c, the restore and the admin
 * plane's delete in admin_restore.c).
 *
 * Handlers run on the loop thread and check the request there; every read of cache or sequence
 * state runs as an executor job, between batches, so it sees the state at one batch boundary and
 * never races the forward path.
 */
#include "admin.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "engine_admin.h"
#include "forward_parse.h"
#include "log.h"
#include "records.h"
#include "restore.h"

/* ---- helpers --------------------------------------------------------------------------------- */

int dsv4_host_is_loopback(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (host && inet_pton(AF_INET, host, &a4) == 1)
    return (ntohl(a4.s_addr) >> 24) == 127;
  if (host && inet_pton(AF_INET6, host, &a6) == 1)
    return IN6_IS_ADDR_LOOPBACK(&a6);
  return 0;
}

static json_t *hex_json(uint64_t v) {
  char h[17];
  dsv4_digest_hex(v, h);
  return json_string(h);
}

/* A JSON object key for a model layer or a block id. */
static void key_u32(char out[16], uint32_t v) {
  snprintf(out, 16, "%u", v);
}

/* A finite number, or null (a NaN or an infinity has no JSON spelling). */
static json_t *num_json(double v) {
  return isfinite(v) ? json_real(v) : json_null();
}

void dsv4_admin_audit(const dsv4_req_t *req, int status, uint64_t bytes, int written, void *arg) {
  (void)arg;
  double ms = (double)(uv_hrtime() - req->t_start_ns) * 1e-6;
  json_t *f = json_object();
  if (!f)
    return;
  json_t *path = json_string(req->path);
  json_object_set_new(f, "peer", json_string(dsv4_req_peer(req)));
  json_object_set_new(f, "auth", json_string(dsv4_req_authenticated(req) ? "token" : "none"));
  json_object_set_new(f, "method", json_string(dsv4_req_method_name(req)));
  json_object_set_new(f, "route", path ? path : json_string("(not UTF-8)"));
  if (req->query && req->query[0]) {
    json_t *q = json_string(req->query);
    json_object_set_new(f, "query", q ? q : json_string("(not UTF-8)"));
  }
  json_object_set_new(f, "status", json_integer(status));
  json_object_set_new(f, "bytes", json_integer((json_int_t)bytes));
  json_object_set_new(f, "duration_ms", json_real((double)(long long)(ms * 1000.0) / 1000.0));
  if (!written)
    json_object_set_new(f, "client_gone", json_true());
  dsv4_log(DSV4_LOG_INFO, "admin", f);
}

int dsv4__admin_query(dsv4_daemon_t *d, dsv4_req_t *req, unsigned allowed, unsigned required,
                      dsv4_admin_query_t *q) {
  char msg[160];
  if (dsv4_admin_query_parse(req->query, allowed, q, msg, sizeof(msg))) {
    dsv4_respond_error(req, DSV4_EINVAL, msg, NULL);
    return 1;
  }
  if ((q->have & required) != required) {
    const char *miss = (required & ~q->have & DSV4_AQ_LAYER) ? "layer"
                       : (required & ~q->have & DSV4_AQ_SEQ) ? "seq"
                                                             : "layers";
    snprintf(msg, sizeof(msg), "query: \"%s\" is required for this route", miss);
    dsv4_respond_error(req, DSV4_EINVAL, msg, NULL);
    return 1;
  }
  if ((q->have & DSV4_AQ_LAYER) && dsv4_engine_layer_index(d->engine, q->layer) < 0) {
    snprintf(msg, sizeof(msg), "layer %u is not served by this daemon", q->layer);
    dsv4_respond_error(req, DSV4_ELAYER, msg, json_pack("{s:I}", "layer", (json_int_t)q->layer));
    return 1;
  }
  if (q->have & DSV4_AQ_LAYERS)
    for (uint32_t l = q->lo; l <= q->hi; l++)
      if (dsv4_engine_layer_index(d->engine, l) < 0) {
        snprintf(msg, sizeof(msg), "layer %u of layers=%u-%u is not served by this daemon", l,
                 q->lo, q->hi);
        dsv4_respond_error(req, DSV4_ELAYER, msg, json_pack("{s:I}", "layer", (json_int_t)l));
        return 1;
      }
  return 0;
}

void dsv4__admin_seq_error(dsv4_daemon_t *d, dsv4_req_t *req, int rc, const char *seq) {
  json_t *det = json_pack("{s:s}", "seq", seq);
  if (rc == DSV4_ENOSEQ)
    json_object_set_new(det, "instance", json_string(d->instance));
  dsv4_respond_error(req, rc, NULL, det);
}

/* ---- the read jobs --------------------------------------------------------------------------- */

typedef enum { AJ_CACHE, AJ_SEQUENCES, AJ_SEQUENCE, AJ_TOKEN, AJ_ENTRY, AJ_CHECKSUMS } aj_kind_t;

typedef struct {
  dsv4_job_t job; /* first */
  dsv4_daemon_t *d;
  dsv4_req_t *req;
  aj_kind_t kind;
  dsv4_admin_query_t q;
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t seq_len;
  int64_t pos; /* /tokens/{pos}: the position; /entries/{j}: the entry */
  int rc;
  char msg[160];
  json_t *details; /* merged into an error */
  json_t *doc;     /* the answer */
  uint32_t step;   /* /cache: the served layer whose pool digest this run adds */
} admin_job_t;

/* Per-layer next and last-start objects keyed by model layer. */
static json_t *per_layer(const dsv4_config_t *cfg, const int64_t *v) {
  json_t *o = json_object();
  for (uint32_t i = 0; o && i < cfg->n_served; i++) {
    char k[16];
    key_u32(k, cfg->served_layers[i]);
    json_object_set_new(o, k, json_integer(v[i]));
  }
  return o;
}

/* Which served layers can answer outputs attn and lse, and why the others cannot (SPEC §7). */
static json_t *attention_json(dsv4_daemon_t *d) {
  const dsv4_config_t *cfg = d->cfg;
  json_t *ready = json_array(), *not_ready = json_object();
  int mode = dsv4_engine_attention_default(d->engine);
  for (uint32_t i = 0; i < cfg->n_served; i++) {
    char why[320], k[16];
    uint32_t layer = cfg->served_layers[i];
    int lmode = dsv4_engine_attention_mode(d->engine, layer, DSV4_ATTENTION_DEFAULT);
    if (dsv4_engine_attention_check(d->engine, layer, lmode, why, sizeof(why)) == 0) {
      json_array_append_new(ready, json_integer(layer));
    } else {
      key_u32(k, layer);
      json_object_set_new(not_ready, k, json_string(why));
    }
  }
  return json_pack("{s:s,s:s,s:o,s:o}", "mode", mode == DSV4_ATTENTION_FAST ? "fast" : "exact",
                   "weights", cfg->weights_path, "ready_layers", ready, "not_ready", not_ready);
}

/* The compressed branch (SPEC §8): each served layer's ratio where the branch runs, the indexer's
 * geometry, and the entry pools. */
static json_t *compressed_json(dsv4_daemon_t *d) {
  const dsv4_config_t *cfg = d->cfg;
  json_t *layers = json_object(), *pools = json_object();
  uint32_t total[2], free_b[2];
  char k[16];
  for (uint32_t i = 0; i < cfg->n_served; i++) {
    uint32_t r = dsv4_engine_layer_ratio(d->engine, cfg->served_layers[i]);
    key_u32(k, cfg->served_layers[i]);
    if (r)
      json_object_set_new(layers, k, json_integer(r));
  }
  dsv4_engine_cpool_counts(d->engine, total, free_b);
  static const char *const names[2] = {"c4", "c128"};
  for (int p = 0; p < 2; p++)
    if (total[p])
      json_object_set_new(pools, names[p],
                          json_pack("{s:I,s:I}", "blocks", (json_int_t)total[p], "blocks_free",
                                    (json_int_t)free_b[p]));
  return json_pack("{s:o,s:I,s:I,s:I,s:I,s:o}", "layers", layers, "index_topk",
                   (json_int_t)cfg->model.index_topk, "index_n_heads",
                   (json_int_t)cfg->model.index_n_heads, "max_sequences",
                   (json_int_t)cfg->max_sequences, "index_head_dim", (json_int_t)128, "pools",
                   pools);
}

/*
 * /cache, one served layer per executor job: the counts with the first, then one pool digest per
 * job, so that a batch waits behind at most one layer's hashing (about 10 MB at the default pool),
 * not every layer's (about 400 MB for 43 layers).
 */
static void run_cache(admin_job_t *j) {
  dsv4_daemon_t *d = j->d;
  const dsv4_config_t *cfg = d->cfg;
  uint64_t pd = 0;
  char k[16];
  if (j->step == 0) {
    dsv4_engine_counts_t c;
    dsv4_engine_counts(d->engine, &c);
    json_t *layers = json_array();
    for (uint32_t i = 0; i < cfg->n_served; i++)
      json_array_append_new(layers, json_integer(cfg->served_layers[i]));
    uint32_t used = c.kv_blocks - c.blocks_free;
    j->doc = json_pack(
        "{s:s,s:s,s:s,s:s,s:s,s:s,s:I,s:i,s:i,s:I,s:i,s:o,s:I,s:I,s:I,s:f,s:I,s:I,s:I,s:o}",
        "instance", d->instance, "version", DSV4_VERSION, "backend",
        dsv4_engine_backend_name(d->engine), "layout", DSV4_RECORD_LAYOUT, "fp8", DSV4_RECORD_FP8,
        "scale", DSV4_RECORD_SCALE, "block_size", (json_int_t)c.block_size, "window", DSV4_WINDOW,
        "record_bytes", DSV4_RECORD_BYTES, "stride", (json_int_t)c.stride, "heads", (int)cfg->heads,
        "served_layers", layers, "kv_blocks", (json_int_t)c.kv_blocks, "blocks_used",
        (json_int_t)used, "blocks_free", (json_int_t)c.blocks_free, "usage_ratio",
        c.kv_blocks ? (double)used / (double)c.kv_blocks : 0.0, "blocks_pinned_released",
        (json_int_t)c.blocks_pinned_released, "cache_bytes",
        (json_int_t)dsv4_engine_cache_bytes(d->engine), "sequences", (json_int_t)c.sequences,
        "pool_digests", json_object());
    if (!j->doc)
      return;
    json_object_set_new(j->doc, "attention", attention_json(d));
    json_object_set_new(j->doc, "compressed", compressed_json(d));
  }
  key_u32(k, cfg->served_layers[j->step]);
  j->rc = dsv4_engine_pool_digest(d->engine, j->step, cfg->served_layers[j->step], &pd, NULL, NULL);
  json_object_set_new(json_object_get(j->doc, "pool_digests"), k, hex_json(pd));
}

typedef struct {
  dsv4_daemon_t *d;
  json_t *arr;
  uint64_t now;
} list_ctx_t;

static int list_one(const char *name, uint32_t len, const dsv4_seq_info_t *info, void *arg) {
  list_ctx_t *lc = arg;
  uint64_t idle = lc->now > info->last_used_ns ? lc->now - info->last_used_ns : 0;
  uint32_t held = 0;
  for (uint32_t b = 0; b < info->n_blocks_held; b++)
    held += info->blocks[b] >= 0;
  json_t *row =
      json_pack("{s:s#,s:I,s:I,s:o,s:I}", "seq", name, (int)len, "p0", (json_int_t)info->p0,
                "blocks", (json_int_t)held, "next", per_layer(lc->d->cfg, info->next), "idle_ms",
                (json_int_t)(idle / 1000000u));
  return row && json_array_append_new(lc->arr, row) == 0 ? 0 : DSV4_ENOMEM;
}

static int by_name(const void *a, const void *b) {
  json_t *x = *(json_t *const *)a, *y = *(json_t *const *)b;
  return strcmp(json_string_value(json_object_get(x, "seq")),
                json_string_value(json_object_get(y, "seq")));
}

static void run_sequences(admin_job_t *j) {
  list_ctx_t lc = {j->d, json_array(), uv_hrtime()};
  if (!lc.arr) {
    j->rc = DSV4_ENOMEM;
    return;
  }
  j->rc = dsv4_engine_foreach_seq(j->d->engine, list_one, &lc);
  size_t n = json_array_size(lc.arr);
  json_t **rows = malloc((n ? n : 1) * sizeof(*rows));
  json_t *sorted = json_array();
  if (!rows || !sorted) {
    free(rows);
    json_decref(sorted);
    json_decref(lc.arr);
    j->rc = DSV4_ENOMEM;
    return;
  }
  for (size_t i = 0; i < n; i++)
    rows[i] = json_array_get(lc.arr, i);
  qsort(rows, n, sizeof(*rows), by_name);
  for (size_t i = 0; i < n; i++)
    json_array_append(sorted, rows[i]);
  free(rows);
  json_decref(lc.arr);
  j->doc = json_pack("{s:s,s:I,s:o}", "instance", j->d->instance, "count", (json_int_t)n,
                     "sequences", sorted);
}

static void run_sequence(admin_job_t *j, const dsv4_seq_info_t *info) {
  const dsv4_config_t *cfg = j->d->cfg;
  const uint32_t bs = dsv4_engine_block_size(j->d->engine);
  json_t *stored = json_object(), *table = json_array();
  int64_t low_min = INT64_MAX, low_max = INT64_MIN;
  for (uint32_t i = 0; i < cfg->n_served; i++) {
    char k[16];
    int64_t f, e, low = info->last_start[i] - (DSV4_WINDOW - 1);
    key_u32(k, cfg->served_layers[i]);
    dsv4_seq_stored_range(info, bs, i, &f, &e);
    json_object_set_new(
        stored, k, f < e ? json_pack("[I,I]", (json_int_t)f, (json_int_t)(e - 1)) : json_null());
    if (low < info->p0)
      low = info->p0;
    low_min = low < low_min ? low : low_min;
    low_max = low > low_max ? low : low_max;
  }
  uint32_t held = 0;
  for (uint32_t b = 0; b < info->n_blocks_held; b++) {
    if (info->blocks[b] < 0)
      continue;
    int64_t lb = info->first_lb + b, first = lb * bs;
    held++;
    json_array_append_new(table, json_pack("{s:I,s:I,s:I,s:I}", "logical", (json_int_t)lb, "block",
                                           (json_int_t)info->blocks[b], "first",
                                           (json_int_t)(first < info->p0 ? info->p0 : first),
                                           "last", (json_int_t)(first + bs - 1)));
  }
  json_t *holder =
      low_min == low_max ? json_null() : json_integer(cfg->served_layers[info->holding_layer]);
  j->doc =
      json_pack("{s:s,s:s#,s:I,s:o,s:o,s:o,s:o,s:I,s:o}", "instance", j->d->instance, "seq", j->seq,
                (int)j->seq_len, "p0", (json_int_t)info->p0, "next", per_layer(cfg, info->next),
                "last_start", per_layer(cfg, info->last_start), "stored", stored, "release_held_by",
                holder, "blocks", (json_int_t)held, "block_table", table);
}

/*
 * A 584-byte record decoded into doc (SPEC §3): its fp8 bytes, scale codes and scales, dequantised
 * NoPE values, RoPE bits and values, and its §3.1 digest with key (the position of an SWA record,
 * the entry of a compressed one) in the position's place. The token and entry inspectors share it,
 * so that both decode a record one way.
 */
static int record_json(json_t *doc, const uint8_t rec[DSV4_RECORD_BYTES], int64_t key) {
  json_t *fp8 = json_array(), *nope = json_array(), *codes = json_array(), *scales = json_array();
  json_t *rope_bits = json_array(), *rope = json_array();
  dsv4_record_fields_t rf;
  dsv4_record_decode(rec, &rf);
  for (int t = 0; t < DSV4_NTILES; t++) {
    json_array_append_new(codes, json_integer(rf.scale_codes[t]));
    json_array_append_new(scales, num_json(rf.scales[t]));
  }
  for (int i = 0; i < DSV4_NOPE_DIM; i++) {
    json_array_append_new(fp8, json_integer(rf.fp8[i]));
    json_array_append_new(nope, num_json(rf.nope[i]));
  }
  for (int i = 0; i < DSV4_ROPE_DIM; i++) {
    json_array_append_new(rope_bits, json_integer(rf.rope_bits[i]));
    json_array_append_new(rope, num_json((double)rf.rope[i]));
  }
  dsv4_records_digest_t *rd;
  uint64_t dig = 0;
  int rc = dsv4_records_digest_create(&rd);
  if (!rc) {
    dsv4_records_digest_add(rd, key, rec);
    dig = dsv4_records_digest_value(rd);
    dsv4_records_digest_destroy(rd);
  }
  const char *const names[] = {"fp8",       "nope", "scale_codes",  "scales",
                               "rope_bf16", "rope", "record_digest"};
  json_t *vals[] = {fp8, nope, codes, scales, rope_bits, rope, hex_json(dig)};
  for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++)
    if (json_object_set_new(doc, names[i], vals[i]) && !rc)
      rc = DSV4_ENOMEM; /* set_new takes the reference even when it fails */
  return rc;
}

static void run_token(admin_job_t *j, const dsv4_seq_info_t *info) {
  dsv4_daemon_t *d = j->d;
  const uint32_t bs = dsv4_engine_block_size(d->engine);
  uint32_t idx = (uint32_t)dsv4_engine_layer_index(d->engine, j->q.layer);
  int64_t first, end;
  uint8_t rec[DSV4_RECORD_BYTES];
  dsv4_seq_stored_range(info, bs, idx, &first, &end);
  if (j->pos < info->p0 || j->pos >= info->next[idx]) {
    j->rc = DSV4_ENOTWRITTEN;
    snprintf(j->msg, sizeof(j->msg), "position %" PRId64 " was never written at layer %u", j->pos,
             j->q.layer);
    j->details = json_pack("{s:s,s:I,s:I,s:I,s:I}", "seq", j->seq, "layer", (json_int_t)j->q.layer,
                           "position", (json_int_t)j->pos, "p0", (json_int_t)info->p0, "next",
                           (json_int_t)info->next[idx]);
    return;
  }
  if (j->pos < first) {
    j->rc = DSV4_ERELEASED;
    snprintf(j->msg, sizeof(j->msg),
             "position %" PRId64 " at layer %u is out of the window: stored from %" PRId64, j->pos,
             j->q.layer, first);
    j->details = json_pack("{s:s,s:I,s:I,s:I}", "seq", j->seq, "layer", (json_int_t)j->q.layer,
                           "position", (json_int_t)j->pos, "first_stored", (json_int_t)first);
    return;
  }
  j->rc = dsv4_engine_read_records(d->engine, idx, info, j->pos, 1, rec);
  if (j->rc)
    return;
  int64_t slot = dsv4_seq_slot(info, bs, j->pos);
  j->doc = json_pack("{s:s,s:s#,s:I,s:I,s:I,s:I,s:I}", "instance", d->instance, "seq", j->seq,
                     (int)j->seq_len, "layer", (json_int_t)j->q.layer, "position",
                     (json_int_t)j->pos, "block", (json_int_t)(slot / bs), "offset",
                     (json_int_t)(slot % bs), "slot", (json_int_t)slot);
  if (j->doc)
    j->rc = record_json(j->doc, rec, j->pos);
}

/* A 68-byte index record decoded (SPEC §8.5): the e2m1 nibbles and their values, the four UE8M0
 * codes and scales, and its digest [LE int64 j || record] as i_digest frames it. */
static json_t *index_json(const uint8_t rec[DSV4_INDEX_RECORD_BYTES], int64_t entry, int *rc) {
  json_t *nib = json_array(), *vals = json_array(), *codes = json_array(), *scales = json_array();
  dsv4_index_fields_t f;
  dsv4_index_record_decode(rec, &f);
  for (int b = 0; b < 4; b++) {
    json_array_append_new(codes, json_integer(f.scale_codes[b]));
    json_array_append_new(scales, num_json(f.scales[b]));
  }
  for (int i = 0; i < 128; i++) {
    json_array_append_new(nib, json_integer(f.nibbles[i]));
    json_array_append_new(vals, num_json(f.values[i]));
  }
  dsv4_records_digest_t *rd;
  uint64_t dig = 0;
  *rc = dsv4_records_digest_create(&rd);
  if (!*rc) {
    dsv4_records_digest_add_index(rd, entry, rec);
    dig = dsv4_records_digest_value(rd);
    dsv4_records_digest_destroy(rd);
  }
  return json_pack("{s:o,s:o,s:o,s:o,s:o}", "e2m1", nib, "values", vals, "scale_codes", codes,
                   "scales", scales, "record_digest", hex_json(dig));
}

/* /entries/{j}: compressed entry j of a layer that runs the branch (SPEC §8.7), its record decoded
 * as a token's is and, at ratio 4, its index record. */
static void run_entry(admin_job_t *j, const dsv4_seq_info_t *info) {
  dsv4_daemon_t *d = j->d;
  const uint32_t bs = dsv4_engine_block_size(d->engine);
  uint32_t idx = (uint32_t)dsv4_engine_layer_index(d->engine, j->q.layer);
  dsv4_engine_entry_t en;
  j->rc = dsv4_engine_read_entry(d->engine, j->seq, j->seq_len, idx, info, j->pos, &en);
  if (j->rc == DSV4_ENOTEMITTED) {
    if (en.j1 > en.j0)
      snprintf(j->msg, sizeof(j->msg),
               "entry %" PRId64 " was not emitted at layer %u: entries %" PRId64 "..%" PRId64
               " are (ratio %u, next position %" PRId64 ")",
               j->pos, j->q.layer, en.j0, en.j1 - 1, en.ratio, info->next[idx]);
    else
      snprintf(j->msg, sizeof(j->msg),
               "entry %" PRId64 " was not emitted at layer %u: none is yet (ratio %u, next "
               "position %" PRId64 ")",
               j->pos, j->q.layer, en.ratio, info->next[idx]);
    j->details =
        json_pack("{s:s,s:I,s:I,s:I,s:I,s:I}", "seq", j->seq, "layer", (json_int_t)j->q.layer,
                  "entry", (json_int_t)j->pos, "ratio", (json_int_t)en.ratio, "first_entry",
                  (json_int_t)en.j0, "next_entry", (json_int_t)en.j1);
    return;
  }
  if (j->rc)
    return;
  int64_t w = j->pos * en.ratio;
  j->doc = json_pack("{s:s,s:s#,s:I,s:I,s:I,s:[I,I],s:I,s:I,s:I}", "instance", d->instance, "seq",
                     j->seq, (int)j->seq_len, "layer", (json_int_t)j->q.layer, "ratio",
                     (json_int_t)en.ratio, "entry", (json_int_t)j->pos, "window", (json_int_t)w,
                     (json_int_t)(w + en.ratio - 1), "block", (json_int_t)en.block, "offset",
                     (json_int_t)en.offset, "slot", (json_int_t)(en.block * bs + en.offset));
  if (!j->doc)
    return;
  j->rc = record_json(j->doc, en.record, j->pos);
  if (!j->rc && en.ratio == 4 &&
      json_object_set_new(j->doc, "index", index_json(en.index, j->pos, &j->rc)) && !j->rc)
    j->rc = DSV4_ENOMEM;
}

/* One sequence's digest entry at served layer idx. */
static json_t *seq_digest_json(dsv4_engine_t *e, uint32_t idx, const dsv4_seq_info_t *info,
                               int *rc) {
  uint64_t dig = 0;
  int64_t f, t;
  *rc = dsv4_engine_seq_digest(e, idx, info, &dig, &f, &t);
  if (*rc)
    return NULL;
  return json_pack("{s:o,s:o,s:o,s:I}", "digest", hex_json(dig), "first",
                   f < t ? json_integer(f) : json_null(), "last",
                   f < t ? json_integer(t - 1) : json_null(), "records", (json_int_t)(t - f));
}

/* Where served layer idx runs the compressed branch, the sequence's entries and their digests
 * (SPEC §8.9: c_digest, i_digest at ratio 4, ring_digest) into row as "compressed". */
static int add_cdigests(dsv4_engine_t *e, uint32_t idx, const char *name, uint32_t len,
                        json_t *row) {
  dsv4_engine_cstate_t cs;
  uint64_t dg[3];
  int rc = dsv4_engine_read_cstate(e, name, len, idx, &cs);
  if (rc || !cs.ratio)
    return rc;
  dsv4_dump_cdigests(&cs, &dg[0], &dg[1], &dg[2]);
  json_t *c = json_pack("{s:I,s:o,s:I,s:o,s:o}", "ratio", (json_int_t)cs.ratio, "first",
                        cs.j1 > cs.j0 ? json_integer(cs.j0) : json_null(), "entries",
                        (json_int_t)(cs.j1 - cs.j0), "c_digest", hex_json(dg[0]), "ring_digest",
                        hex_json(dg[2]));
  if (c && cs.ratio == 4)
    json_object_set_new(c, "i_digest", hex_json(dg[1]));
  dsv4_engine_cstate_free(&cs);
  return c && json_object_set_new(row, "compressed", c) == 0 ? 0 : DSV4_ENOMEM;
}

typedef struct {
  dsv4_engine_t *e;
  uint32_t idx;
  json_t *obj;
  int rc;
} digest_ctx_t;

static int digest_one(const char *name, uint32_t len, const dsv4_seq_info_t *info, void *arg) {
  digest_ctx_t *dc = arg;
  char key[DSV4_SEQ_NAME_MAX + 1];
  json_t *row = seq_digest_json(dc->e, dc->idx, info, &dc->rc);
  if (!row)
    return dc->rc ? dc->rc : DSV4_ENOMEM;
  if ((dc->rc = add_cdigests(dc->e, dc->idx, name, len, row)) != 0) {
    json_decref(row);
    return dc->rc;
  }
  memcpy(key, name, len);
  key[len] = '\0';
  return json_object_set_new(dc->obj, key, row) ? DSV4_ENOMEM : 0;
}

static void run_checksums(admin_job_t *j, const dsv4_seq_info_t *info) {
  dsv4_daemon_t *d = j->d;
  dsv4_engine_t *e = d->engine;
  uint32_t idx = (uint32_t)dsv4_engine_layer_index(e, j->q.layer);
  uint32_t nb = dsv4_engine_blocks_total(e);
  uint64_t pool = 0, *bd = calloc(nb, sizeof(uint64_t));
  uint8_t *used = calloc(nb, 1);
  json_t *blocks = json_object(), *seqs = json_object();
  if (!bd || !used || !blocks || !seqs) {
    j->rc = DSV4_ENOMEM;
    goto out;
  }
  j->rc = dsv4_engine_pool_digest(e, idx, j->q.layer, &pool, bd, used);
  if (j->rc)
    goto out;
  if (info) {
    /* Only the sequence's blocks, in logical order (JSON objects keep insertion order). */
    for (uint32_t b = 0; b < info->n_blocks_held; b++) {
      char k[16];
      if (info->blocks[b] < 0)
        continue;
      key_u32(k, (uint32_t)info->blocks[b]);
      json_object_set_new(blocks, k, hex_json(bd[info->blocks[b]]));
    }
    json_t *row = seq_digest_json(e, idx, info, &j->rc);
    if (!row)
      goto out;
    json_object_set_new(seqs, j->seq, row);
    if ((j->rc = add_cdigests(e, idx, j->seq, j->seq_len, row)) != 0)
      goto out;
  } else {
    for (uint32_t b = 0; b < nb; b++) {
      char k[16];
      if (!used[b])
        continue;
      key_u32(k, b);
      json_object_set_new(blocks, k, hex_json(bd[b]));
    }
    digest_ctx_t dc = {e, idx, seqs, 0};
    j->rc = dsv4_engine_foreach_seq(e, digest_one, &dc);
    if (j->rc)
      goto out;
  }
  j->doc =
      json_pack("{s:s,s:I,s:o,s:o,s:o}", "instance", d->instance, "layer", (json_int_t)j->q.layer,
                "pool", hex_json(pool), "blocks", blocks, "sequences", seqs);
  blocks = seqs = NULL;
out:
  json_decref(blocks);
  json_decref(seqs);
  free(bd);
  free(used);
}

/* Executor thread. */
static void admin_run(dsv4_job_t *job) {
  admin_job_t *j = (admin_job_t *)job;
  dsv4_engine_t *e = j->d->engine;
  dsv4_seq_info_t info;
  int have_info = 0;
  /* Sweep first, so that 404 / 410 agree with what a batch would be told now. */
  dsv4_engine_expire(e, uv_hrtime());
  if (j->seq_len) {
    j->rc = dsv4_engine_seq_info(e, j->seq, j->seq_len, &info);
    if (j->rc)
      return;
    have_info = 1;
  }
  switch (j->kind) {
  case AJ_CACHE:
    run_cache(j);
    break;
  case AJ_SEQUENCES:
    run_sequences(j);
    break;
  case AJ_SEQUENCE:
    run_sequence(j, &info);
    break;
  case AJ_TOKEN:
    run_token(j, &info);
    break;
  case AJ_ENTRY:
    run_entry(j, &info);
    break;
  case AJ_CHECKSUMS:
    run_checksums(j, have_info ? &info : NULL);
    break;
  }
  if (have_info)
    dsv4_seq_info_free(&info);
  if (!j->rc && !j->doc)
    j->rc = DSV4_ENOMEM;
}

/* Loop thread. */
static void admin_done(dsv4_job_t *job) {
  admin_job_t *j = (admin_job_t *)job;
  if (!j->rc && j->doc && j->kind == AJ_CACHE && ++j->step < j->d->cfg->n_served) {
    /* The next layer, behind whatever was queued meanwhile; never refused for a full queue (one
     * step of one request at a time). Nothing runs once the executor has stopped. */
    if (!j->d->ex.stopping) {
      dsv4_executor_submit_force(&j->d->ex, &j->job);
      return;
    }
    j->rc = DSV4_EDRAIN;
  }
  if (j->rc == DSV4_ENOSEQ || j->rc == DSV4_EEXPIRED) {
    dsv4__admin_seq_error(j->d, j->req, j->rc, j->seq);
    json_decref(j->details);
  } else if (j->rc) {
    dsv4_respond_error(j->req, j->rc, j->msg[0] ? j->msg : NULL, j->details);
  } else {
    dsv4_respond_json(j->req, 200, j->doc);
    j->doc = NULL;
  }
  json_decref(j->doc);
  free(j);
}

static void submit(dsv4_daemon_t *d, dsv4_req_t *req, admin_job_t *j) {
  j->d = d;
  j->req = req;
  j->job.run = admin_run;
  j->job.done = admin_done;
  int rc = dsv4_executor_submit(&d->ex, &j->job);
  if (rc) {
    dsv4_respond_error(req, rc, NULL, NULL);
    free(j);
  }
}

static admin_job_t *new_job(dsv4_req_t *req, aj_kind_t kind) {
  admin_job_t *j = calloc(1, sizeof(*j));
  if (!j)
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
  else
    j->kind = kind;
  return j;
}

/* ---- handlers -------------------------------------------------------------------------------- */

/* A route without a query and a read job of the given kind. */
static void on_plain(dsv4_req_t *req, dsv4_daemon_t *d, aj_kind_t kind) {
  dsv4_admin_query_t q;
  if (dsv4__admin_query(d, req, 0, 0, &q))
    return;
  admin_job_t *j = new_job(req, kind);
  if (j)
    submit(d, req, j);
}

static void on_cache(dsv4_req_t *req, void *ctx) {
  on_plain(req, ctx, AJ_CACHE);
}

static void on_sequences(dsv4_req_t *req, void *ctx) {
  on_plain(req, ctx, AJ_SEQUENCES);
}

/*
 * Loop thread: the layer of an /entries/{j} query must run the compressed branch; the refusal
 * names why it does not (the model's ratio, compressed_branch, the weights or the backend).
 */
static int entry_layer_refused(dsv4_daemon_t *d, dsv4_req_t *req, uint32_t layer) {
  if (dsv4_engine_layer_ratio(d->engine, layer))
    return 0;
  const dsv4_model_t *m = &d->cfg->model;
  uint32_t r = layer < m->n_layers_total ? m->compress_ratios[layer] : 0;
  char msg[320], why[160];
  if (r < 2)
    snprintf(why, sizeof(why), "compress ratio %u: an SWA-only layer", r);
  else if (r != 4 && r != 128)
    snprintf(why, sizeof(why), "compress ratio %u: the branch exists for ratios 4 and 128 only", r);
  else
    snprintf(why, sizeof(why),
             "compress ratio %u, but this daemon serves its SWA part only (SPEC §8.9: "
             "compressed_branch, the weights option or the backend)",
             r);
  snprintf(msg, sizeof(msg),
           "layer %u has no compressed entries (%s); /tokens/{pos} decodes its SWA records", layer,
           why);
  dsv4_respond_error(req, DSV4_EUNSUPPORTED, msg,
                     json_pack("{s:I,s:I}", "layer", (json_int_t)layer, "ratio", (json_int_t)r));
  return 1;
}

/*
 * /admin/v1/sequences/{seq}, /admin/v1/sequences/{seq}/tokens/{pos} and
 * /admin/v1/sequences/{seq}/entries/{j}.
 */
static void on_sequence(dsv4_req_t *req, void *ctx) {
  static const char tok[] = "/tokens/", ent[] = "/entries/";
  dsv4_daemon_t *d = ctx;
  const char *name = req->path + strlen("/admin/v1/sequences/");
  const char *slash = strchr(name, '/');
  size_t len = slash ? (size_t)(slash - name) : strlen(name);
  dsv4_admin_query_t q;
  uint64_t pos = 0;
  aj_kind_t kind = AJ_SEQUENCE;
  if (!dsv4_seq_name_valid(name, len)) {
    dsv4_respond_error(req, DSV4_EINVAL, "a sequence name must be " DSV4_SEQ_NAME_RULE, NULL);
    return;
  }
  if (slash) {
    const char *p;
    if (strncmp(slash, tok, sizeof(tok) - 1) == 0) {
      kind = AJ_TOKEN;
      p = slash + sizeof(tok) - 1;
    } else if (strncmp(slash, ent, sizeof(ent) - 1) == 0) {
      kind = AJ_ENTRY;
      p = slash + sizeof(ent) - 1;
    } else {
      dsv4_respond_error(req, DSV4_ENOTFOUND, "no such route", NULL);
      return;
    }
    if (dsv4_parse_decimal(p, strlen(p), DSV4_AQ_MAX_POSITION, &pos)) {
      dsv4_respond_error(req, DSV4_EINVAL,
                         kind == AJ_TOKEN ? "a position must be a non-negative decimal number"
                                          : "an entry must be a non-negative decimal number",
                         NULL);
      return;
    }
  }
  unsigned lq = kind == AJ_SEQUENCE ? 0 : DSV4_AQ_LAYER;
  if (dsv4__admin_query(d, req, lq, lq, &q))
    return;
  if (kind == AJ_ENTRY && entry_layer_refused(d, req, q.layer))
    return;
  admin_job_t *j = new_job(req, kind);
  if (!j)
    return;
  memcpy(j->seq, name, len);
  j->seq_len = (uint32_t)len;
  j->q = q;
  j->pos = (int64_t)pos;
  submit(d, req, j);
}

static void on_checksums(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  dsv4_admin_query_t q;
  if (dsv4__admin_query(d, req, DSV4_AQ_LAYER | DSV4_AQ_SEQ, DSV4_AQ_LAYER, &q))
    return;
  admin_job_t *j = new_job(req, AJ_CHECKSUMS);
  if (!j)
    return;
  j->q = q;
  if (q.have & DSV4_AQ_SEQ) {
    memcpy(j->seq, q.seq, q.seq_len + 1);
    j->seq_len = q.seq_len;
  }
  submit(d, req, j);
}

/* The configuration never changes after start-up: answered on the loop thread. */
static void on_config(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  dsv4_admin_query_t q;
  if (dsv4__admin_query(d, req, 0, 0, &q))
    return;
  json_t *doc = dsv4_config_to_json(d->cfg);
  if (!doc || json_object_set_new(doc, "instance", json_string(d->instance))) {
    json_decref(doc);
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  dsv4_respond_json(req, 200, doc);
}

size_t dsv4_admin_routes(dsv4_daemon_t *d, dsv4_route_t *out, size_t cap) {
  const dsv4_route_t routes[] = {
      {DSV4_HTTP_GET, "/admin/v1/cache", "admin_cache", 0, 0, on_cache, d, NULL, NULL},
      {DSV4_HTTP_GET, "/admin/v1/sequences", "admin_sequences", 0, 0, on_sequences, d, NULL, NULL},
      {DSV4_HTTP_GET, "/admin/v1/sequences/", "admin_sequence", 0, 0, on_sequence, d, NULL, NULL},
      {DSV4_HTTP_PUT, "/admin/v1/sequences/", "admin_restore",
       (size_t)dsv4__restore_max_body(d->cfg), 0, dsv4__admin_on_restore, d, NULL, NULL},
      {DSV4_HTTP_DELETE, "/admin/v1/sequences/", "admin_delete", 0, 0, dsv4__admin_on_delete, d,
       NULL, NULL},
      {DSV4_HTTP_GET, "/admin/v1/checksums", "admin_checksums", 0, 0, on_checksums, d, NULL, NULL},
      {DSV4_HTTP_GET, "/admin/v1/dump", "admin_dump", 0, 0, dsv4__admin_on_dump, d, NULL, NULL},
      {DSV4_HTTP_GET, "/admin/v1/config", "admin_config", 0, 0, on_config, d, NULL, NULL},
  };
  return dsv4_routes_copy(routes, sizeof(routes) / sizeof(routes[0]), out, cap);
}
