#include "dump_format.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "records.h"
#include "rope.h"
#include "safetensors.h"

#ifndef DSV4_VERSION
#define DSV4_VERSION "unknown"
#endif

/* Metadata keys a dump has for the whole file, and per layer. */
#define FIXED_KEYS 15
#define LAYER_KEYS 4
/* Room for one metadata value: a number, a range, a digest, a last segment "start,len,hash". */
#define VALUE_LEN 64
/* Room for a tensor's name or a per-layer key: "layers.{L}.positions" with L of 10 digits. */
#define NAME_LEN 48
/* Room for the "layers" runs of one layer ("a-b," with two 10-digit numbers). */
#define RUN_LEN 24

/* ---- the model's id ----------------------------------------------------------------------- */

static void put32(XXH3_state_t *s, uint32_t v) {
  uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
  XXH3_64bits_update(s, b, sizeof(b));
}

void dsv4_dump_model_id(const dsv4_model_t *m, char out[17]) {
  XXH3_state_t *s = XXH3_createState();
  uint32_t eps;
  if (!s) {
    snprintf(out, 17, "%s", "0000000000000000");
    return;
  }
  XXH3_64bits_reset(s);
  put32(s, m->num_attention_heads);
  put32(s, m->n_layers_total);
  for (uint32_t l = 0; l < m->n_layers_total; l++) {
    float inv[DSV4_ROPE_PAIRS];
    put32(s, m->compress_ratios[l]);
    dsv4_rope_inv_freq(dsv4_model_layer_rope(m, l), inv);
    for (int i = 0; i < DSV4_ROPE_PAIRS; i++) {
      uint32_t bits;
      memcpy(&bits, &inv[i], sizeof(bits));
      put32(s, bits);
    }
  }
  memcpy(&eps, &m->rms_norm_eps, sizeof(eps));
  put32(s, eps);
  put32(s, (uint32_t)m->max_position_embeddings);
  put32(s, (uint32_t)((uint64_t)m->max_position_embeddings >> 32));
  dsv4_digest_hex(XXH3_64bits_digest(s), out);
  XXH3_freeState(s);
}

/* ---- writing ------------------------------------------------------------------------------ */

/* "start,len,hash" of a layer's last applied segment, "" before any. */
static void last_text(const dsv4_seq_layer_state_t *ls, char out[VALUE_LEN]) {
  char h[17];
  out[0] = '\0';
  if (ls->last_len == 0)
    return;
  dsv4_digest_hex(ls->last_hash, h);
  snprintf(out, VALUE_LEN, "%" PRId64 ",%" PRIu32 ",%s", ls->last_start, ls->last_len, h);
}

/* The layers as runs "a-b", comma-separated when the set has gaps. */
static void layer_runs(const uint32_t *layer, uint32_t n, char *out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  for (uint32_t i = 0; i < n && len < cap;) {
    uint32_t k = i;
    while (k + 1 < n && layer[k + 1] == layer[k] + 1)
      k++;
    len += (size_t)snprintf(out + len, cap - len, "%s%u-%u", i ? "," : "", layer[i], layer[k]);
    i = k + 1;
  }
}

void dsv4_dump_cdigests(const dsv4_seq_cstate_t *cs, uint64_t *c_digest, uint64_t *i_digest,
                        uint64_t *ring_digest) {
  dsv4_records_digest_t *d;
  int64_t t = cs->j1 - cs->j0;
  *c_digest = *i_digest = 0;
  *ring_digest = XXH3_64bits(cs->ring, DSV4_RING_FLOATS(cs->ratio) * sizeof(float));
  if (dsv4_records_digest_create(&d))
    return;
  for (int64_t k = 0; k < t; k++)
    dsv4_records_digest_add(d, cs->j0 + k, cs->c_records + (size_t)k * DSV4_RECORD_BYTES);
  *c_digest = dsv4_records_digest_value(d);
  dsv4_records_digest_reset(d);
  for (int64_t k = 0; cs->ratio == 4 && k < t; k++)
    dsv4_records_digest_add_index(d, cs->j0 + k,
                                  cs->i_records + (size_t)k * DSV4_INDEX_RECORD_BYTES);
  *i_digest = dsv4_records_digest_value(d);
  dsv4_records_digest_destroy(d);
}

/* The bytes of layer i's compressed tensors (0 when it does not run the branch). */
static uint64_t c_bytes(const dsv4_dump_desc_t *dd, uint32_t i) {
  const dsv4_seq_cstate_t *cs = dd->cstate ? &dd->cstate[i] : NULL;
  if (!cs || !cs->ratio)
    return 0;
  uint64_t t = (uint64_t)(cs->j1 - cs->j0);
  return t * (DSV4_RECORD_BYTES + 8 + (cs->ratio == 4 ? DSV4_INDEX_RECORD_BYTES : 0)) +
         DSV4_RING_FLOATS(cs->ratio) * sizeof(float);
}

/* Layer i's compressed tensors and digest keys into the arrays at *nd and *nk, which advance. */
static void c_entries(const dsv4_dump_desc_t *dd, uint32_t i, char (*names)[NAME_LEN],
                      char (*keys)[NAME_LEN], char (*vals)[VALUE_LEN], dsv4_st_desc_t *desc,
                      size_t *nd, size_t *nk) {
  const dsv4_seq_cstate_t *cs = dd->cstate ? &dd->cstate[i] : NULL;
  if (!cs || !cs->ratio)
    return;
  uint32_t layer = dd->layer[i];
  int64_t t = cs->j1 - cs->j0;
  uint64_t dg[3];
  static const char *const dkey[3] = {"c_digest", "i_digest", "ring_digest"};
  const struct {
    const char *suffix;
    int dtype, ndim;
    int64_t d0, d1;
    size_t bytes;
  } td[4] = {
      {"c_records", DSV4_ST_U8, 2, t, DSV4_RECORD_BYTES, (size_t)t * DSV4_RECORD_BYTES},
      {"c_entries", DSV4_ST_I64, 1, t, 0, (size_t)t * 8},
      {"i_records", DSV4_ST_U8, 2, t, DSV4_INDEX_RECORD_BYTES, (size_t)t * DSV4_INDEX_RECORD_BYTES},
      {"ring", DSV4_ST_F32, 1, (int64_t)DSV4_RING_FLOATS(cs->ratio), 0,
       DSV4_RING_FLOATS(cs->ratio) * sizeof(float)},
  };
  for (int k = 0; k < 4; k++) {
    if (k == 2 && cs->ratio != 4)
      continue;
    snprintf(names[*nd], NAME_LEN, "layers.%u.%s", layer, td[k].suffix);
    desc[*nd] =
        (dsv4_st_desc_t){names[*nd], td[k].dtype, td[k].ndim, {td[k].d0, td[k].d1}, td[k].bytes};
    (*nd)++;
  }
  dsv4_dump_cdigests(cs, &dg[0], &dg[1], &dg[2]);
  for (int k = 0; k < 3; k++) {
    if (k == 1 && cs->ratio != 4)
      continue;
    snprintf(keys[*nk], NAME_LEN, "%s.%u", dkey[k], layer);
    dsv4_digest_hex(dg[k], vals[*nk]);
    (*nk)++;
  }
}

int dsv4_dump_ctail(const dsv4_dump_desc_t *dd, uint8_t **out, size_t *out_len) {
  uint64_t n = 0;
  *out = NULL;
  *out_len = 0;
  for (uint32_t i = 0; i < dd->n; i++)
    n += c_bytes(dd, i);
  if (n == 0)
    return 0;
  uint8_t *p = malloc((size_t)n);
  if (!p)
    return DSV4_ENOMEM;
  *out = p;
  *out_len = (size_t)n;
  for (uint32_t i = 0; i < dd->n; i++) {
    const dsv4_seq_cstate_t *cs = &dd->cstate[i];
    size_t t = (size_t)(cs->j1 - cs->j0);
    if (!cs->ratio)
      continue;
    memcpy(p, cs->c_records, t * DSV4_RECORD_BYTES);
    p += t * DSV4_RECORD_BYTES;
    for (size_t k = 0; k < t; k++, p += 8)
      dsv4_position_put(p, cs->j0 + (int64_t)k);
    if (cs->ratio == 4) {
      memcpy(p, cs->i_records, t * DSV4_INDEX_RECORD_BYTES);
      p += t * DSV4_INDEX_RECORD_BYTES;
    }
    memcpy(p, cs->ring, DSV4_RING_FLOATS(cs->ratio) * sizeof(float));
    p += DSV4_RING_FLOATS(cs->ratio) * sizeof(float);
  }
  return 0;
}

/* The per-layer tensors and metadata of a header: names, keys and values into the arrays given. */
static void layer_entries(const dsv4_dump_desc_t *dd, uint32_t i, char (*names)[NAME_LEN],
                          char (*keys)[NAME_LEN], char (*vals)[VALUE_LEN], dsv4_st_desc_t *desc) {
  uint32_t layer = dd->layer[i];
  uint64_t t = (uint64_t)(dd->end[i] - dd->first[i]);
  snprintf(names[2 * i], NAME_LEN, "layers.%u.records", layer);
  snprintf(names[2 * i + 1], NAME_LEN, "layers.%u.positions", layer);
  desc[2 * i] = (dsv4_st_desc_t){
      names[2 * i], DSV4_ST_U8, 2, {(int64_t)t, DSV4_RECORD_BYTES}, (size_t)t * DSV4_RECORD_BYTES};
  desc[2 * i + 1] = (dsv4_st_desc_t){names[2 * i + 1], DSV4_ST_I64, 1, {(int64_t)t}, (size_t)t * 8};
  char(*k)[NAME_LEN] = keys + (size_t)LAYER_KEYS * i;
  char(*v)[VALUE_LEN] = vals + (size_t)LAYER_KEYS * i;
  snprintf(k[0], NAME_LEN, "positions.%u", layer);
  v[0][0] = '\0';
  if (t)
    snprintf(v[0], VALUE_LEN, "%" PRId64 "-%" PRId64, dd->first[i], dd->end[i] - 1);
  snprintf(k[1], NAME_LEN, "digest.%u", layer);
  dsv4_digest_hex(dd->digest[i], v[1]);
  snprintf(k[2], NAME_LEN, "next.%u", layer);
  snprintf(v[2], VALUE_LEN, "%" PRId64, dd->layers[i].next);
  snprintf(k[3], NAME_LEN, "last.%u", layer);
  last_text(&dd->layers[i], v[3]);
}

int dsv4_dump_header(const dsv4_dump_desc_t *dd, uint8_t **out, size_t *out_len, uint64_t *total,
                     uint64_t *offsets) {
  /* Room for the compressed tensors (4) and digest keys (3) of every layer too. */
  size_t nd = 2 * (size_t)dd->n, nk = (size_t)LAYER_KEYS * dd->n, nm = 0, data_len = 0;
  size_t dcap = nd + 4 * (size_t)dd->n, kcap = nk + 3 * (size_t)dd->n;
  dsv4_st_desc_t *desc = calloc(dcap ? dcap : 1, sizeof(*desc));
  dsv4_st_meta_t *meta = calloc(FIXED_KEYS + kcap, sizeof(*meta));
  char(*names)[NAME_LEN] = calloc(dcap ? dcap : 1, sizeof(*names));
  char(*keys)[NAME_LEN] = calloc(kcap ? kcap : 1, sizeof(*keys));
  char(*vals)[VALUE_LEN] = calloc(kcap ? kcap : 1, sizeof(*vals));
  char *runs = calloc((size_t)dd->n + 1, RUN_LEN);
  char bs[16], p0[24], heads[16], off[16];
  int rc = DSV4_ENOMEM;
  if (!desc || !meta || !names || !keys || !vals || !runs)
    goto out;
  for (uint32_t i = 0; i < dd->n; i++)
    layer_entries(dd, i, names, keys, vals, desc);
  for (uint32_t i = 0; i < dd->n; i++)
    c_entries(dd, i, names, keys, vals, desc, &nd, &nk);
  snprintf(bs, sizeof(bs), "%u", dd->block_size);
  snprintf(p0, sizeof(p0), "%" PRId64, dd->p0);
  snprintf(heads, sizeof(heads), "%u", dd->heads);
  snprintf(off, sizeof(off), "%u", dd->head_offset);
  layer_runs(dd->layer, dd->n, runs, ((size_t)dd->n + 1) * RUN_LEN);
  meta[nm++] = (dsv4_st_meta_t){"layout", DSV4_RECORD_LAYOUT};
  meta[nm++] = (dsv4_st_meta_t){"fp8", DSV4_RECORD_FP8};
  meta[nm++] = (dsv4_st_meta_t){"scale", DSV4_RECORD_SCALE};
  meta[nm++] = (dsv4_st_meta_t){"block_size", bs};
  meta[nm++] = (dsv4_st_meta_t){"window", DSV4_RECORD_WINDOW_TEXT};
  meta[nm++] = (dsv4_st_meta_t){"record_bytes", DSV4_RECORD_BYTES_TEXT};
  meta[nm++] = (dsv4_st_meta_t){"records", DSV4_RECORD_FIELDS};
  meta[nm++] = (dsv4_st_meta_t){"p0", p0};
  meta[nm++] = (dsv4_st_meta_t){"seq", dd->seq};
  meta[nm++] = (dsv4_st_meta_t){"layers", runs};
  meta[nm++] = (dsv4_st_meta_t){"heads", heads};
  meta[nm++] = (dsv4_st_meta_t){"head_offset", off};
  meta[nm++] = (dsv4_st_meta_t){"model", dd->model_id};
  meta[nm++] = (dsv4_st_meta_t){"version", DSV4_VERSION};
  meta[nm++] = (dsv4_st_meta_t){"instance", dd->instance};
  for (size_t i = 0; i < nk; i++)
    meta[nm++] = (dsv4_st_meta_t){keys[i], vals[i]};
  rc = dsv4_st_build_header(desc, nd, meta, nm, out, out_len, &data_len);
  if (rc)
    goto out;
  uint64_t at = *out_len;
  for (uint32_t i = 0; i < dd->n; i++) {
    if (offsets)
      offsets[i] = at;
    at += (uint64_t)(dd->end[i] - dd->first[i]) * (DSV4_RECORD_BYTES + 8);
  }
  for (uint32_t i = 0; i < dd->n; i++)
    at += c_bytes(dd, i);
  *total = at;
  rc = at == *out_len + data_len ? 0 : DSV4_EINVAL;
  if (rc) {
    free(*out);
    *out = NULL;
  }
out:
  free(desc);
  free(meta);
  free(names);
  free(keys);
  free(vals);
  free(runs);
  return rc;
}

/* ---- reading ------------------------------------------------------------------------------ */

/*
 * The per-layer tensors a restore understands, one row per kind, with the layers that may carry
 * it: a dump that carries any other tensor, or compressed state where this daemon does not run the
 * branch, is refused, never half-restored. A new kind adds a row here and its handling in a pass.
 */
enum { K_RECORDS, K_POSITIONS, K_C_RECORDS, K_C_ENTRIES, K_I_RECORDS, K_RING, K_COUNT };
static const struct {
  const char *suffix;
  int dtype;
  int64_t row;     /* the second dimension, or 0 for a one-dimensional tensor */
  uint32_t ratios; /* bit 0: SWA (every layer), bit 1: ratio 4, bit 2: ratio 128 */
} kinds[K_COUNT] = {
    {"records", DSV4_ST_U8, DSV4_RECORD_BYTES, 7},         {"positions", DSV4_ST_I64, 0, 7},
    {"c_records", DSV4_ST_U8, DSV4_RECORD_BYTES, 6},       {"c_entries", DSV4_ST_I64, 0, 6},
    {"i_records", DSV4_ST_U8, DSV4_INDEX_RECORD_BYTES, 2}, {"ring", DSV4_ST_F32, 0, 6},
};

/* The reader's working state beside the caller's result. */
typedef struct {
  const dsv4_st_view_t *st;
  const dsv4_dump_expect_t *want;
  dsv4_dump_parsed_t *out;
  const dsv4_st_tensor_t **t; /* [n_served * K_COUNT] */
} rd_t;

__attribute__((format(printf, 3, 4))) static int fail(dsv4_dump_parsed_t *p, int rc,
                                                      const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->why, sizeof(p->why), fmt, ap);
  va_end(ap);
  return rc;
}

static int mismatch(dsv4_dump_parsed_t *p, const char *field, const char *dump_value,
                    const char *daemon_value) {
  snprintf(p->field, sizeof(p->field), "%s", field);
  snprintf(p->dump_value, sizeof(p->dump_value), "%s", dump_value);
  snprintf(p->daemon_value, sizeof(p->daemon_value), "%s", daemon_value);
  return fail(p, DSV4_EGEOMETRY, "the dump's %s is \"%.64s\", this daemon's is \"%.64s\"", field,
              dump_value, daemon_value);
}

/* A metadata value that must be there. */
static const char *need(const rd_t *r, const char *key) {
  return dsv4_st_meta(r->st, key);
}

/* A decimal int64 in 0..max without sign, spaces or leading zeros. */
static int decimal(const char *s, int64_t max, int64_t *v) {
  uint64_t x;
  size_t n = s ? strlen(s) : 0;
  if (n == 0 || (n > 1 && s[0] == '0') || dsv4_parse_decimal(s, n, (uint64_t)max, &x) != 0)
    return DSV4_EINVAL;
  *v = (int64_t)x;
  return 0;
}

/* Read pass 1: the record layout and the geometry, named keys against this daemon's values. */
static int read_geometry(rd_t *r) {
  static const struct {
    const char *key, *want;
  } fixed[] = {{"layout", DSV4_RECORD_LAYOUT},
               {"fp8", DSV4_RECORD_FP8},
               {"scale", DSV4_RECORD_SCALE},
               {"record_bytes", DSV4_RECORD_BYTES_TEXT},
               {"window", DSV4_RECORD_WINDOW_TEXT}};
  char heads[16], off[16];
  snprintf(heads, sizeof(heads), "%u", r->want->heads);
  snprintf(off, sizeof(off), "%u", r->want->head_offset);
  const struct {
    const char *key, *want;
  } geo[] = {{"heads", heads}, {"head_offset", off}, {"model", r->want->model_id}};
  for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++) {
    const char *v = need(r, fixed[i].key);
    if (!v)
      return fail(r->out, DSV4_EINVAL, "metadata has no \"%s\": not a dump", fixed[i].key);
    if (strcmp(v, fixed[i].want) != 0)
      return mismatch(r->out, fixed[i].key, v, fixed[i].want);
  }
  for (size_t i = 0; i < sizeof(geo) / sizeof(geo[0]); i++) {
    const char *v = need(r, geo[i].key);
    if (!v)
      return fail(r->out, DSV4_EINVAL,
                  "metadata has no \"%s\" (a dump of a daemon without restore cannot be restored)",
                  geo[i].key);
    if (strcmp(v, geo[i].want) != 0)
      return mismatch(r->out, geo[i].key, v, geo[i].want);
  }
  const char *bs = need(r, "block_size");
  int64_t b = 0;
  if (bs && decimal(bs, DSV4_MAX_BLOCK_SIZE, &b) == 0)
    r->out->block_size = (uint32_t)b;
  const char *seq = need(r, "seq");
  if (seq && dsv4_seq_name_valid(seq, strlen(seq)))
    snprintf(r->out->seq, sizeof(r->out->seq), "%s", seq);
  return 0;
}

/* The most layers a dump's "layers" may name: more than any model has. */
#define MAX_DUMP_LAYERS 1024u

/* Parse the runs "a-b,c,..." (strictly increasing) into got; their count, or 0 when malformed. */
static uint32_t parse_runs(const char *p, uint32_t *got) {
  uint32_t n = 0;
  while (*p) {
    int64_t a, b;
    char num[16];
    size_t k = strspn(p, "0123456789");
    if (k == 0 || k >= sizeof(num))
      return 0;
    memcpy(num, p, k);
    num[k] = '\0';
    if (decimal(num, INT32_MAX, &a))
      return 0;
    p += k;
    b = a;
    if (*p == '-') {
      k = strspn(++p, "0123456789");
      if (k == 0 || k >= sizeof(num))
        return 0;
      memcpy(num, p, k);
      num[k] = '\0';
      if (decimal(num, INT32_MAX, &b) || b < a)
        return 0;
      p += k;
    }
    for (int64_t l = a; l <= b; l++) {
      if (n == MAX_DUMP_LAYERS || (n && got[n - 1] >= l))
        return 0;
      got[n++] = (uint32_t)l;
    }
    if (*p == ',' && !*++p)
      return 0;
    if (*p && p[-1] != ',')
      return 0;
  }
  return n;
}

/* Read pass 2: "layers" names exactly the served layers (whatever runs spell them). */
static int read_layer_set(rd_t *r) {
  const dsv4_dump_expect_t *w = r->want;
  const char *v = need(r, "layers");
  if (!v)
    return fail(r->out, DSV4_EINVAL, "metadata has no \"layers\": not a dump");
  size_t cap = (size_t)(MAX_DUMP_LAYERS > w->n_served ? MAX_DUMP_LAYERS : w->n_served) * RUN_LEN;
  uint32_t *got = malloc(MAX_DUMP_LAYERS * sizeof(*got));
  char *mine = malloc(cap), *shown = malloc(cap);
  int rc = 0;
  if (!got || !mine || !shown) {
    rc = fail(r->out, DSV4_ENOMEM, "out of memory");
    goto out;
  }
  uint32_t n = parse_runs(v, got);
  if (n == 0) {
    rc = fail(r->out, DSV4_EINVAL, "metadata layers \"%.64s\" is not a list of runs a-b", v);
    goto out;
  }
  /* Both written the way this daemon writes runs, so "0-1,2-3" equals "0-3". */
  layer_runs(w->served_layers, w->n_served, mine, cap);
  layer_runs(got, n, shown, cap);
  if (strcmp(shown, mine) != 0)
    rc = mismatch(r->out, "layers", shown, mine);
out:
  free(got);
  free(mine);
  free(shown);
  return rc;
}

/* The served index of model layer l, or -1. */
static long served_index(const dsv4_dump_expect_t *w, int64_t l) {
  for (uint32_t i = 0; i < w->n_served; i++)
    if (w->served_layers[i] == l)
      return (long)i;
  return -1;
}

/* Read pass 3: every tensor is a known kind of a served layer, with its dtype and shape. */
static int read_tensors(rd_t *r) {
  for (size_t i = 0; i < r->st->n_tensors; i++) {
    const dsv4_st_tensor_t *t = &r->st->tensors[i];
    const char *d = strncmp(t->name, "layers.", 7) == 0 ? t->name + 7 : NULL;
    size_t k = d ? strspn(d, "0123456789") : 0;
    int64_t l = -1;
    char num[16];
    long idx = -1;
    int kind = -1;
    if (k > 0 && k < sizeof(num) && d[k] == '.') {
      memcpy(num, d, k);
      num[k] = '\0';
      if (decimal(num, INT32_MAX, &l) == 0)
        idx = served_index(r->want, l);
      for (int j = 0; j < K_COUNT && idx >= 0; j++)
        if (strcmp(d + k + 1, kinds[j].suffix) == 0)
          kind = j;
    }
    if (kind < 0)
      return fail(r->out, DSV4_EINVAL,
                  "tensor \"%.64s\" is not one this daemon restores (layers.{L}.records and "
                  "layers.{L}.positions of its served layers, and the compressed state of those "
                  "that run the branch): a dump with state it does not know is refused, not "
                  "half-restored",
                  t->name);
    uint32_t ratio = r->want->ratio ? r->want->ratio[idx] : 0;
    if (!(kinds[kind].ratios & (ratio == 4 ? 2u : ratio == 128 ? 4u : 1u)))
      return fail(r->out, DSV4_EINVAL,
                  "tensor \"%.64s\" is compressed state this daemon does not hold at layer %" PRId64
                  " (it %s): a dump of a daemon that ran the branch is not restored into one "
                  "that does not",
                  t->name, l,
                  ratio ? "runs the branch at another ratio"
                        : "does not run the compressed branch");
    int shape_ok = kinds[kind].row ? t->ndim == 2 && t->shape[1] == kinds[kind].row : t->ndim == 1;
    if (t->dtype != kinds[kind].dtype || !shape_ok) {
      char row[24] = "";
      if (kinds[kind].row)
        snprintf(row, sizeof(row), ", %" PRId64, kinds[kind].row);
      return fail(r->out, DSV4_EINVAL, "tensor \"%.64s\" must be %s [%s%s]", t->name,
                  dsv4_st_dtype_name(kinds[kind].dtype), kind == K_RING ? "floats" : "T", row);
    }
    r->t[(size_t)idx * K_COUNT + (size_t)kind] = t;
  }
  return 0;
}

/* Parse "start,len,hash" (or "") into a layer state whose next is already set. */
static int parse_last(const char *v, dsv4_seq_layer_state_t *ls, int64_t max_position) {
  char buf[VALUE_LEN];
  size_t n = strlen(v);
  if (n == 0)
    return 0;
  if (n >= sizeof(buf))
    return DSV4_EINVAL;
  memcpy(buf, v, n + 1);
  char *c1 = strchr(buf, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
  int64_t start, len;
  if (!c2 || strlen(c2 + 1) != 16)
    return DSV4_EINVAL;
  *c1 = *c2 = '\0';
  if (decimal(buf, max_position, &start) || decimal(c1 + 1, UINT32_MAX, &len) || len == 0)
    return DSV4_EINVAL;
  uint64_t h = 0;
  for (const char *p = c2 + 1; *p; p++) {
    int x = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
    if (x < 0)
      return DSV4_EINVAL;
    h = h << 4 | (uint64_t)x;
  }
  ls->last_start = start;
  ls->last_len = (uint32_t)len;
  ls->last_hash = h;
  return 0;
}

/* Read pass 4: p0 and each layer's next, last segment and digest (the keys a restore needs). */
static int read_state(rd_t *r) {
  const dsv4_dump_expect_t *w = r->want;
  dsv4_dump_parsed_t *o = r->out;
  const char *v = need(r, "p0");
  if (!v || decimal(v, w->max_position - 1, &o->p0))
    return fail(o, DSV4_EINVAL, "metadata p0 is missing or not a position");
  for (uint32_t i = 0; i < w->n_served; i++) {
    uint32_t l = w->served_layers[i];
    char key[NAME_LEN];
    dsv4_seq_layer_state_t *ls = &o->layers[i];
    snprintf(key, sizeof(key), "next.%u", l);
    v = need(r, key);
    if (!v || decimal(v, w->max_position, &ls->next))
      return fail(o, DSV4_EINVAL,
                  "metadata %s is missing or not a position (a dump of a daemon without restore "
                  "cannot be restored)",
                  key);
    ls->last_start = o->p0;
    snprintf(key, sizeof(key), "last.%u", l);
    v = need(r, key);
    if (!v || parse_last(v, ls, w->max_position))
      return fail(o, DSV4_EINVAL, "metadata %s is missing or not \"start,len,hash\" (or \"\")",
                  key);
    snprintf(key, sizeof(key), "digest.%u", l);
    v = need(r, key);
    if (!v || strlen(v) != 16 || strspn(v, "0123456789abcdef") != 16)
      return fail(o, DSV4_EINVAL, "metadata %s is missing or not 16 lowercase hex digits", key);
    o->digest[i] = strtoull(v, NULL, 16);
    if (!r->t[i * K_COUNT + K_RECORDS] || !r->t[i * K_COUNT + K_POSITIONS])
      return fail(o, DSV4_EINVAL, "layer %u has no layers.%u.%s tensor", l, l,
                  r->t[i * K_COUNT + K_RECORDS] ? "positions" : "records");
    if (r->t[i * K_COUNT + K_RECORDS]->shape[0] != r->t[i * K_COUNT + K_POSITIONS]->shape[0])
      return fail(o, DSV4_EINVAL, "layer %u has %" PRId64 " records but %" PRId64 " positions", l,
                  r->t[i * K_COUNT + K_RECORDS]->shape[0],
                  r->t[i * K_COUNT + K_POSITIONS]->shape[0]);
  }
  return 0;
}

static int64_t le64(const uint8_t *p) {
  uint64_t x = 0;
  for (int i = 7; i >= 0; i--)
    x = x << 8 | p[i];
  return (int64_t)x;
}

/*
 * Read pass 5: the positions. Each written layer stores first .. next - 1 with the same first for
 * every layer (its daemon released blocks for all layers at once); a layer that never wrote stores
 * nothing. The records are ones the insert path can write.
 */
static int read_positions(rd_t *r) {
  const dsv4_dump_expect_t *w = r->want;
  dsv4_dump_parsed_t *o = r->out;
  int have_first = 0;
  o->first = o->p0;
  for (uint32_t i = 0; i < w->n_served; i++) {
    const dsv4_st_tensor_t *rec = r->t[i * K_COUNT + K_RECORDS];
    const dsv4_st_tensor_t *pos = r->t[i * K_COUNT + K_POSITIONS];
    const dsv4_seq_layer_state_t *ls = &o->layers[i];
    uint32_t l = w->served_layers[i];
    int64_t t = pos->shape[0];
    if (t == 0) {
      if (ls->last_len != 0)
        return fail(o, DSV4_EINVAL, "layer %u wrote up to %" PRId64 " but stores no record", l,
                    ls->next - 1);
      continue;
    }
    int64_t f = le64(pos->data);
    if (have_first && f != o->first)
      return fail(o, DSV4_EINVAL,
                  "layer %u stores from position %" PRId64 ", another layer from %" PRId64, l, f,
                  o->first);
    if (f < o->p0 || f > ls->next - t || f + t != ls->next)
      return fail(o, DSV4_EINVAL,
                  "layer %u stores %" PRId64 " records from %" PRId64 " but its next is %" PRId64
                  " (p0 %" PRId64 ")",
                  l, t, f, ls->next, o->p0);
    o->first = f;
    have_first = 1;
    for (int64_t k = 0; k < t; k++) {
      const uint8_t *x = rec->data + (size_t)k * DSV4_RECORD_BYTES;
      const char *bad = dsv4_record_implausible(x);
      if (le64(pos->data + (size_t)k * 8) != f + k)
        return fail(o, DSV4_EINVAL, "layer %u: positions not consecutive at index %" PRId64, l, k);
      if (bad)
        return fail(o, DSV4_EINVAL,
                    "layer %u, position %" PRId64 ": the record holds %s, which no batch writes", l,
                    f + k, bad);
    }
    o->records[i] = rec->data;
  }
  return 0;
}

/* Read pass 6: the state is one a table can hold (dsv4_seqtable_state_low) and its windows reach
 * no position below the first stored one. */
static int read_windows(rd_t *r) {
  dsv4_dump_parsed_t *o = r->out;
  dsv4_seqtable_config_t cfg = {.n_layers = r->want->n_served,
                                .block_size = DSV4_MIN_BLOCK_SIZE,
                                .max_position = r->want->max_position};
  dsv4_seq_state_t st = {o->p0, o->layers};
  int64_t low;
  if (dsv4_seqtable_state_low(&cfg, &st, &low) != 0)
    return fail(o, DSV4_EINVAL,
                "inconsistent state: a layer's next is not its last segment's end, a segment "
                "starts below p0, or a layer without one moved");
  if (o->first > low)
    return fail(o, DSV4_EINVAL,
                "the records start at %" PRId64 " but the windows reach back to %" PRId64, o->first,
                low);
  return 0;
}

/* Read pass 7: every layer's records hash to its digest (SPEC §3.1). */
static int read_digests(rd_t *r) {
  dsv4_dump_parsed_t *o = r->out;
  dsv4_records_digest_t *d;
  if (dsv4_records_digest_create(&d))
    return DSV4_ENOMEM;
  int rc = 0;
  for (uint32_t i = 0; i < r->want->n_served && !rc; i++) {
    const dsv4_st_tensor_t *rec = r->t[i * K_COUNT + K_RECORDS];
    int64_t t = rec->shape[0];
    dsv4_records_digest_reset(d);
    for (int64_t k = 0; k < t; k++)
      dsv4_records_digest_add(d, o->first + k, rec->data + (size_t)k * DSV4_RECORD_BYTES);
    uint64_t got = dsv4_records_digest_value(d);
    if (got != o->digest[i]) {
      o->layer = r->want->served_layers[i];
      dsv4_digest_hex(o->digest[i], o->expected);
      dsv4_digest_hex(got, o->computed);
      rc = fail(o, DSV4_EDIGEST, "layer %" PRId64 ": the records hash to %s, the dump says %s",
                o->layer, o->computed, o->expected);
    }
  }
  dsv4_records_digest_destroy(d);
  return rc;
}

/* A digest key of the metadata ("{what}.{L}"), 16 lowercase hex digits. */
static int meta_digest(rd_t *r, const char *what, uint32_t l, uint64_t *v) {
  char key[NAME_LEN];
  snprintf(key, sizeof(key), "%s.%u", what, l);
  const char *x = need(r, key);
  if (!x || strlen(x) != 16 || strspn(x, "0123456789abcdef") != 16)
    return fail(r->out, DSV4_EINVAL, "metadata %s is missing or not 16 lowercase hex digits", key);
  *v = strtoull(x, NULL, 16);
  return 0;
}

/* Layer i's compressed tensors are there, of the lengths its p0 and next give, entries in order. */
static int read_ctensors(rd_t *r, uint32_t i, uint32_t ratio, const dsv4_st_tensor_t **t) {
  dsv4_dump_parsed_t *o = r->out;
  uint32_t l = r->want->served_layers[i];
  int64_t j0 = o->p0 / ratio, j1 = o->layers[i].next / ratio;
  j1 = j1 < j0 ? j0 : j1;
  for (int k = K_C_RECORDS; k <= K_RING; k++)
    if (!t[k] && (k != K_I_RECORDS || ratio == 4))
      return fail(o, DSV4_EINVAL,
                  "layer %u runs the compressed branch here but the dump has no layers.%u.%s (a "
                  "dump of a daemon without the branch is not restored into one that runs it)",
                  l, l, kinds[k].suffix);
  for (int k = K_C_RECORDS; k <= K_I_RECORDS; k++)
    if (t[k] && t[k]->shape[0] != j1 - j0)
      return fail(o, DSV4_EINVAL,
                  "layers.%u.%s has %" PRId64 " rows; p0 %" PRId64 " and next %" PRId64
                  " emitted %" PRId64 " entries",
                  l, kinds[k].suffix, t[k]->shape[0], o->p0, o->layers[i].next, j1 - j0);
  if (t[K_RING]->shape[0] != (int64_t)DSV4_RING_FLOATS(ratio))
    return fail(o, DSV4_EINVAL, "layers.%u.ring must hold %lu floats", l,
                (unsigned long)DSV4_RING_FLOATS(ratio));
  for (int64_t k = 0; k < j1 - j0; k++) {
    const char *bad = dsv4_record_implausible(t[K_C_RECORDS]->data + (size_t)k * DSV4_RECORD_BYTES);
    if (le64(t[K_C_ENTRIES]->data + (size_t)k * 8) != j0 + k)
      return fail(o, DSV4_EINVAL, "layer %u: entries are not %" PRId64 " .. %" PRId64, l, j0,
                  j1 - 1);
    if (bad)
      return fail(o, DSV4_EINVAL,
                  "layer %u, entry %" PRId64 ": the record holds %s, which no batch writes", l,
                  j0 + k, bad);
  }
  /* Ring rows come from inputs below 2^59 (SPEC §8.8): a non-finite one is no batch's. */
  for (size_t k = 0; k < DSV4_RING_FLOATS(ratio); k++) {
    uint32_t u = (uint32_t)t[K_RING]->data[4 * k] | (uint32_t)t[K_RING]->data[4 * k + 1] << 8 |
                 (uint32_t)t[K_RING]->data[4 * k + 2] << 16 |
                 (uint32_t)t[K_RING]->data[4 * k + 3] << 24;
    if ((u & 0x7f800000u) == 0x7f800000u)
      return fail(o, DSV4_EINVAL, "layers.%u.ring holds a non-finite float at %zu", l, k);
  }
  o->cstate[i] = (dsv4_seq_cstate_t){ratio,
                                     j0,
                                     j1,
                                     t[K_C_RECORDS]->data,
                                     t[K_I_RECORDS] ? t[K_I_RECORDS]->data : NULL,
                                     (const float *)(const void *)t[K_RING]->data};
  return 0;
}

/* Read pass 8: the compressed state of every layer that runs the branch, and its digests. */
static int read_cstate(rd_t *r) {
  dsv4_dump_parsed_t *o = r->out;
  for (uint32_t i = 0; i < r->want->n_served; i++) {
    uint32_t ratio = r->want->ratio ? r->want->ratio[i] : 0, l = r->want->served_layers[i];
    uint64_t want[3] = {0, 0, 0}, got[3];
    static const char *const what[3] = {"c_digest", "i_digest", "ring_digest"};
    if (!ratio)
      continue;
    int rc = read_ctensors(r, i, ratio, r->t + (size_t)i * K_COUNT);
    for (int k = 0; k < 3 && !rc; k++)
      if (k != 1 || ratio == 4)
        rc = meta_digest(r, what[k], l, &want[k]);
    if (rc)
      return rc;
    dsv4_dump_cdigests(&o->cstate[i], &got[0], &got[1], &got[2]);
    for (int k = 0; k < 3; k++) {
      if (got[k] == want[k] || (k == 1 && ratio != 4))
        continue;
      o->layer = l;
      dsv4_digest_hex(want[k], o->expected);
      dsv4_digest_hex(got[k], o->computed);
      return fail(o, DSV4_EDIGEST, "layer %u: the %s hash to %s, the dump's %s.%u says %s", l,
                  k == 0   ? "compressed entries"
                  : k == 1 ? "index records"
                           : "ring rows",
                  o->computed, what[k], l, o->expected);
    }
  }
  return 0;
}

int dsv4_dump_parse(const uint8_t *buf, size_t len, const dsv4_dump_expect_t *want,
                    dsv4_dump_parsed_t *out) {
  memset(out, 0, sizeof(*out));
  out->layer = -1;
  uint32_t n = want->n_served;
  out->layers = calloc(n ? n : 1, sizeof(*out->layers));
  out->records = calloc(n ? n : 1, sizeof(*out->records));
  out->digest = calloc(n ? n : 1, sizeof(*out->digest));
  out->cstate = calloc(n ? n : 1, sizeof(*out->cstate));
  const dsv4_st_tensor_t **t = calloc((size_t)(n ? n : 1) * K_COUNT, sizeof(*t));
  if (!out->layers || !out->records || !out->digest || !out->cstate || !t) {
    free(t);
    return fail(out, DSV4_ENOMEM, "out of memory");
  }
  dsv4_st_view_t st;
  int rc = dsv4_st_parse(buf, len, &st);
  if (rc) {
    free(t);
    if (rc == DSV4_ENOMEM)
      return fail(out, rc, "out of memory reading the header");
    return fail(out, DSV4_EINVAL, "not a safetensors file (cut short?): %s", st.error);
  }
  rd_t r = {&st, want, out, t};
  rc = read_geometry(&r);
  if (!rc)
    rc = read_layer_set(&r);
  if (!rc)
    rc = read_tensors(&r);
  if (!rc)
    rc = read_state(&r);
  if (!rc)
    rc = read_positions(&r);
  if (!rc)
    rc = read_windows(&r);
  if (!rc)
    rc = read_digests(&r);
  if (!rc)
    rc = read_cstate(&r);
  dsv4_st_view_free(&st);
  free(t);
  return rc;
}

void dsv4_dump_parsed_free(dsv4_dump_parsed_t *p) {
  free(p->layers);
  free(p->records);
  free(p->digest);
  free(p->cstate);
  p->cstate = NULL;
  p->layers = NULL;
  p->records = NULL;
  p->digest = NULL;
}
