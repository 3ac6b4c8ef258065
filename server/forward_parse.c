/*
 * POST /v1/forward request parsing (SPEC §6): safetensors view -> q/kv checked -> layer -> outputs
 * -> segments checked against N and the limits. The messages here are the ones clients see in the
 * error object, so they name the field and the rule that was broken.
 */
#include "forward_parse.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "json_scan.h"

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
    return "segment \"seq\" must be " DSV4_SEQ_NAME_RULE;
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

/* The shape of a tensor whose dtype was checked already. */
static int check_shape(const dsv4_st_tensor_t *t, int ndim, const int64_t *shape, char *why,
                       size_t why_len);

static int check_tensor(const dsv4_st_tensor_t *t, int ndim, const int64_t *shape, char *why,
                        size_t why_len) {
  if (t->dtype != DSV4_ST_BF16) {
    snprintf(why, why_len, "tensor \"%s\" must be BF16, not %s", t->name,
             dsv4_st_dtype_name(t->dtype));
    return DSV4_EINVAL;
  }
  return check_shape(t, ndim, shape, why, why_len);
}

static int check_shape(const dsv4_st_tensor_t *t, int ndim, const int64_t *shape, char *why,
                       size_t why_len) {
  if (t->ndim != ndim) {
    snprintf(why, why_len, "tensor \"%s\" must have %d dimensions, not %d", t->name, ndim, t->ndim);
    return DSV4_EINVAL;
  }
  for (int i = 0; i < ndim; i++)
    if (t->shape[i] != shape[i]) {
      snprintf(why, why_len, "tensor \"%s\" dimension %d is %" PRId64 ", expected %" PRId64,
               t->name, i, t->shape[i], shape[i]);
      return DSV4_EINVAL;
    }
  return 0;
}

/* bf16 data straight from the body when 2-aligned, else an aligned copy (kept in *copy). */
static const uint16_t *bf16_data(const dsv4_st_tensor_t *t, uint16_t **copy) {
  if (((uintptr_t)t->data & 1u) == 0)
    return (const uint16_t *)(const void *)t->data;
  *copy = aligned_alloc(DSV4_FORWARD_ALIGN,
                        (t->nbytes + DSV4_FORWARD_ALIGN - 1) & ~(size_t)(DSV4_FORWARD_ALIGN - 1));
  if (*copy)
    memcpy(*copy, t->data, t->nbytes);
  return *copy;
}

/* Tensor data straight from the body when aligned to `align`, else an aligned copy (in *copy). */
static const void *aligned_data(const dsv4_st_tensor_t *t, size_t align, void **copy) {
  if (((uintptr_t)t->data & (align - 1)) == 0)
    return t->data;
  *copy = aligned_alloc(DSV4_FORWARD_ALIGN,
                        (t->nbytes + DSV4_FORWARD_ALIGN - 1) & ~(size_t)(DSV4_FORWARD_ALIGN - 1));
  if (*copy)
    memcpy(*copy, t->data, t->nbytes);
  return *copy;
}

/* The tensors of the compressed branch, in the order §8.2 lists them. */
static const char *const c_names[4] = {"ckv", "ikv", "iq", "iw"};

static int is_c_name(const char *name) {
  for (int i = 0; i < 4; i++)
    if (!strcmp(name, c_names[i]))
      return 1;
  return 0;
}

/* SPEC §8.8: the layer's ratio decides which of ckv, ikv, iq and iw the body carries. */
static int parse_compressed(const dsv4_forward_limits_t *lim, int64_t n, dsv4_forward_req_t *r,
                            char *why, size_t why_len) {
  uint32_t ratio = lim->layer_ratio ? lim->layer_ratio(lim->layer_arg, r->layer) : 0;
  int64_t ih = lim->index_heads;
  int64_t shapes[4][3] = {{n, ratio == 4 ? 2048 : 1024}, {n, 512}, {n, ih, 128}, {n, ih}};
  static const int ndims[4] = {2, 2, 3, 2};
  static const dsv4_st_dtype_t dtypes[4] = {DSV4_ST_F32, DSV4_ST_F32, DSV4_ST_BF16, DSV4_ST_F32};
  const void *data[4] = {0};
  r->ratio = ratio;
  for (int i = 0; i < 4; i++) {
    const dsv4_st_tensor_t *t = dsv4_st_find(&r->view, c_names[i]);
    int wanted = ratio == 4 || (ratio == 128 && i == 0);
    r->bad_tensor = c_names[i];
    if (!t && wanted) {
      r->bad_reason = "missing";
      snprintf(why, why_len, "layer %u has compress ratio %u: tensor \"%s\" is missing", r->layer,
               ratio, c_names[i]);
      return DSV4_EINVAL;
    }
    if (t && !wanted) {
      r->bad_reason = "unexpected";
      if (ratio)
        snprintf(why, why_len, "layer %u has compress ratio %u, which takes no tensor \"%s\"",
                 r->layer, ratio, c_names[i]);
      else
        snprintf(why, why_len,
                 "layer %u takes no tensor \"%s\" (an SWA-only layer, or a compressed layer "
                 "whose branch this daemon does not run: see GET /admin/v1/cache)",
                 r->layer, c_names[i]);
      return DSV4_EINVAL;
    }
    if (!t)
      continue;
    if (t->dtype != dtypes[i]) {
      r->bad_reason = "dtype";
      snprintf(why, why_len, "tensor \"%s\" must be %s, not %s", c_names[i],
               dsv4_st_dtype_name(dtypes[i]), dsv4_st_dtype_name(t->dtype));
      return DSV4_EINVAL;
    }
    if (check_shape(t, ndims[i], shapes[i], why, why_len)) {
      r->bad_reason = "shape";
      return DSV4_EINVAL;
    }
    data[i] = aligned_data(t, i == 2 ? 2 : 4, &r->c_copy[i]);
    r->c_bytes[i] = t->nbytes;
    if (!data[i])
      return DSV4_ENOMEM;
  }
  r->bad_tensor = r->bad_reason = NULL;
  r->ckv = data[0];
  r->ikv = data[1];
  r->iq = data[2];
  r->iw = data[3];
  if (r->want_topk && ratio != 4) {
    snprintf(why, why_len, "output topk is the indexer's selection: layer %u has none", r->layer);
    return DSV4_EINVAL;
  }
  return 0;
}

static int layer_served(const dsv4_forward_limits_t *lim, uint32_t layer) {
  if (lim->layer_served)
    return lim->layer_served(lim->layer_arg, layer);
  for (uint32_t i = 0; i < lim->n_served; i++)
    if (lim->served_layers[i] == layer)
      return 1;
  return 0;
}

/* The comma-separated "outputs" list: entries trimmed of spaces; q, attn, lse, digest and topk. */
static int parse_outputs(const char *outputs_s, dsv4_forward_req_t *r, char *why, size_t why_len) {
  const char *p = outputs_s;
  r->want_q = 0;
  while (*p) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    while (len && *p == ' ')
      p++, len--;
    while (len && p[len - 1] == ' ')
      len--;
    if (len == 1 && p[0] == 'q') {
      r->want_q = 1;
    } else if (len == 6 && !memcmp(p, "digest", 6)) {
      r->want_digest = 1;
    } else if (len == 4 && !memcmp(p, "topk", 4)) {
      r->want_topk = 1;
    } else if (len == 4 && !memcmp(p, "attn", 4)) {
      r->want_attn = 1;
    } else if (len == 3 && !memcmp(p, "lse", 3)) {
      r->want_lse = 1;
    } else {
      snprintf(why, why_len, "unknown output \"%.*s\" (outputs: q, attn, lse, digest, topk)",
               (int)len, p);
      return DSV4_EINVAL;
    }
    if (!end)
      break;
    p = end + 1;
  }
  return 0;
}

/* The optional "attention" mode: exact or fast (absent: the daemon's attention_mode). */
static int parse_attention(const char *mode, dsv4_forward_req_t *r, char *why, size_t why_len) {
  r->attention = DSV4_ATTENTION_DEFAULT;
  if (!mode)
    return 0;
  if (!strcmp(mode, "exact")) {
    r->attention = DSV4_ATTENTION_EXACT;
  } else if (!strcmp(mode, "fast")) {
    r->attention = DSV4_ATTENTION_FAST;
  } else {
    snprintf(why, why_len, "__metadata__ \"attention\" must be \"exact\" or \"fast\"");
    return DSV4_EINVAL;
  }
  return 0;
}

/* ---- the segments' usual shape, read without a JSON document ---- */

/* One segment object, read with the primitives of json_scan.h (names copied into the scanner's
 * memory); the rules of parse_segment hold, or 0: the text then goes to the JSON parser, which
 * names what is wrong (an escape, a sign, an unknown or repeated key among them). */
static int take_segment(dsv4_scan_t *s, dsv4_seg_req_t *sg) {
  int have[4] = {0, 0, 0, 0};
  int64_t start = -1, len = 0;
  if (!dsv4_scan_take(s, '{'))
    return 0;
  do {
    const char *key = dsv4_scan_string(s, 0);
    /* The scanner's copy ends right before s->out: its length without a strlen. */
    const size_t kl = key ? (size_t)(s->out - key) - 1 : 0;
    int k = kl == 3 && !memcmp(key, "seq", 3)     ? 0
            : kl == 5 && !memcmp(key, "start", 5) ? 1
            : kl == 3 && !memcmp(key, "len", 3)   ? 2
            : kl == 3 && !memcmp(key, "new", 3)   ? 3
                                                  : -1;
    if (k < 0 || have[k]++ || !dsv4_scan_take(s, ':'))
      return 0;
    if (k == 0) {
      if (!(sg->name = dsv4_scan_string(s, 0)))
        return 0;
      sg->name_len = (uint32_t)(s->out - sg->name) - 1;
    } else if (k < 3) {
      if (!dsv4_scan_int(s, k == 1 ? &start : &len))
        return 0;
    } else if (dsv4_scan_lit(s, "true")) {
      sg->is_new = 1;
    } else if (!dsv4_scan_lit(s, "false")) {
      return 0;
    }
  } while (dsv4_scan_take(s, ','));
  if (!dsv4_scan_take(s, '}') || !have[0] || !have[1] || !have[2] || len < 1 ||
      len > (int64_t)UINT32_MAX || !dsv4_seq_name_valid(sg->name, sg->name_len))
    return 0;
  sg->start = start;
  sg->len = (uint32_t)len;
  return 1;
}

/*
 * The segments as a gateway writes them (an array of 1..max objects with seq, start, len and new;
 * names without escapes; integers without sign, fraction or exponent; every rule of parse_segment
 * met), read without building a JSON document: for a decode of many sequences that document cost
 * more than the rest of the request's parse. Returns 1 with r->segs and r->n_segs filled (names
 * point into r->segs_text, the scanner's copies), else 0 with nothing kept: the JSON parser then
 * reads the text and says what is wrong, so the answers are the same either way.
 */
static int segments_fast(const char *text, uint32_t max_segments, dsv4_forward_req_t *r) {
  size_t cap = 0, len = strlen(text);
  for (const char *c = text; (c = strchr(c, '{')) != NULL; c++)
    cap++;
  if (cap < 1 || cap > max_segments)
    return 0;
  /* Every string is shorter unescaped than its quoted text: len bytes hold them all. */
  char *mem = malloc(len + 1);
  dsv4_seg_req_t *segs = calloc(cap, sizeof(*segs));
  dsv4_scan_t s = {text, text + len, mem};
  uint32_t ns = 0;
  int ok = mem && segs && dsv4_scan_take(&s, '[');
  while (ok) {
    ok = ns < cap && take_segment(&s, &segs[ns++]);
    if (!dsv4_scan_take(&s, ','))
      break;
  }
  ok = ok && dsv4_scan_take(&s, ']');
  dsv4_scan_ws(&s);
  if (ok && s.p == s.end) {
    r->segs = segs;
    r->n_segs = ns;
    r->segs_text = mem;
    return 1;
  }
  free(mem);
  free(segs);
  return 0;
}

/* The segments through the JSON parser: every shape, and the messages of what is wrong. */
static int segments_json(const char *segs_s, uint32_t max_segments, dsv4_forward_req_t *r,
                         char *why, size_t why_len) {
  json_error_t jerr;
  r->segs_doc = json_loads(segs_s, JSON_REJECT_DUPLICATES, &jerr);
  if (!r->segs_doc || !json_is_array(r->segs_doc)) {
    snprintf(why, why_len, "__metadata__ \"segments\" must be a JSON array: %s",
             r->segs_doc ? "not an array" : jerr.text);
    return DSV4_EINVAL;
  }
  size_t ns = json_array_size(r->segs_doc);
  if (ns < 1 || ns > max_segments) {
    snprintf(why, why_len, "a batch has 1..%u segments, not %zu", max_segments, ns);
    return DSV4_EINVAL;
  }
  r->segs = calloc(ns, sizeof(*r->segs));
  if (!r->segs)
    return DSV4_ENOMEM;
  for (size_t s = 0; s < ns; s++) {
    const char *reason = parse_segment(json_array_get(r->segs_doc, s), &r->segs[s]);
    if (reason) {
      snprintf(why, why_len, "segment %zu: %s", s, reason);
      return DSV4_EINVAL;
    }
  }
  r->n_segs = (uint32_t)ns;
  return 0;
}

int dsv4__forward_segments(const char *segs_s, uint32_t max_segments, int fast,
                           dsv4_forward_req_t *r, char *why, size_t why_len) {
  if (fast && segments_fast(segs_s, max_segments, r))
    return 0;
  return segments_json(segs_s, max_segments, r, why, why_len);
}

static int parse_segments(const char *segs_s, const dsv4_forward_limits_t *lim, int64_t n,
                          dsv4_forward_req_t *r, char *why, size_t why_len) {
  int64_t total = 0;
  int rc = dsv4__forward_segments(segs_s, lim->max_segments, 1, r, why, why_len);
  if (rc)
    return rc;
  const size_t ns = r->n_segs;
  /* At most max_segments lengths below 2^32 each: the sum cannot overflow. */
  for (size_t s = 0; s < ns; s++)
    total += r->segs[s].len;
  if (total != n) {
    snprintf(why, why_len, "segment lengths add up to %" PRId64 ", but N = %" PRId64, total, n);
    return DSV4_EINVAL;
  }
  for (size_t s = 0; s < ns; s++) {
    const dsv4_seg_req_t *sg = &r->segs[s];
    /* start may be anything up to INT64_MAX: compare without forming start + len. */
    if (sg->start > lim->max_position_embeddings - (int64_t)sg->len) {
      snprintf(why, why_len,
               "segment %zu: positions from %" PRId64 " (%u of them)"
               " reach past max_position_embeddings = %" PRId64,
               s, sg->start, sg->len, lim->max_position_embeddings);
      return DSV4_EPOSRANGE;
    }
  }
  return 0;
}

int dsv4_forward_parse(const uint8_t *body, size_t len, const dsv4_forward_limits_t *lim,
                       dsv4_forward_req_t *out, char *why, size_t why_len) {
  memset(out, 0, sizeof(*out));
  int rc = dsv4_st_parse(body, len, &out->view);
  if (rc) {
    snprintf(why, why_len, "malformed safetensors body: %s", out->view.error);
    /* A failed parse leaves nothing to free; keep the view empty for dsv4_forward_req_free. */
    memset(&out->view, 0, sizeof(out->view));
    return DSV4_EINVAL;
  }
  return dsv4_forward_parse_view(lim, out, why, why_len);
}

int dsv4_forward_parse_view(const dsv4_forward_limits_t *lim, dsv4_forward_req_t *out, char *why,
                            size_t why_len) {
  dsv4_forward_req_t *r = out;
  const dsv4_st_tensor_t *q, *kv;
  const char *layer_s, *segs_s, *outputs_s;
  uint64_t layer;
  int64_t n, h = lim->heads;
  int rc;

  for (size_t i = 0; i < r->view.n_tensors; i++) {
    const char *name = r->view.tensors[i].name;
    if (strcmp(name, "q") && strcmp(name, "kv") && !is_c_name(name)) {
      snprintf(why, why_len,
               "unknown tensor \"%s\" (a forward body has q and kv, and on a compressed layer "
               "ckv, ikv, iq and iw)",
               name);
      return DSV4_EINVAL;
    }
  }
  q = dsv4_st_find(&r->view, "q");
  kv = dsv4_st_find(&r->view, "kv");
  if (!q || !kv) {
    snprintf(why, why_len, "missing tensor \"%s\"", q ? "kv" : "q");
    return DSV4_EINVAL;
  }
  if (q->ndim < 1 || q->shape[0] < 1) {
    snprintf(why, why_len, "tensor \"q\" must be [N, %" PRId64 ", 512] with N >= 1", h);
    return DSV4_EINVAL;
  }
  n = q->shape[0];
  if (n > (int64_t)lim->max_batch_tokens) {
    snprintf(why, why_len, "N = %" PRId64 " exceeds max_batch_tokens = %u", n,
             lim->max_batch_tokens);
    return DSV4_EINVAL;
  }
  if (q->ndim == 3 && q->shape[1] != h && q->shape[2] == DSV4_HEAD_DIM) {
    snprintf(why, why_len, "q has H = %" PRId64 " heads, this daemon serves heads = %" PRId64,
             q->shape[1], h);
    return DSV4_EINVAL;
  }
  {
    int64_t qs[3] = {n, h, DSV4_HEAD_DIM}, ks[2] = {n, DSV4_HEAD_DIM};
    rc = check_tensor(q, 3, qs, why, why_len);
    if (!rc)
      rc = check_tensor(kv, 2, ks, why, why_len);
    if (rc)
      return rc;
  }

  layer_s = dsv4_st_meta(&r->view, "layer");
  segs_s = r->segs_given ? r->segs_given : dsv4_st_meta(&r->view, "segments");
  outputs_s = dsv4_st_meta(&r->view, "outputs");
  if (!layer_s || !segs_s) {
    snprintf(why, why_len, "__metadata__ must have \"layer\" and \"segments\"");
    return DSV4_EINVAL;
  }
  if (dsv4_parse_decimal(layer_s, strlen(layer_s), UINT32_MAX, &layer)) {
    snprintf(why, why_len, "__metadata__ \"layer\" must be a decimal layer number");
    return DSV4_EINVAL;
  }
  if (!layer_served(lim, (uint32_t)layer)) {
    snprintf(why, why_len, "layer %" PRIu64 " is not served by this daemon", layer);
    return DSV4_ELAYER;
  }
  r->want_q = 1;
  if (outputs_s) {
    rc = parse_outputs(outputs_s, r, why, why_len);
    if (rc)
      return rc;
  }
  rc = parse_attention(dsv4_st_meta(&r->view, "attention"), r, why, why_len);
  if (rc)
    return rc;
  rc = parse_segments(segs_s, lim, n, r, why, why_len);
  if (rc)
    return rc;

  r->layer = (uint32_t)layer;
  r->n_tokens = (uint32_t)n;
  rc = parse_compressed(lim, n, r, why, why_len);
  if (rc)
    return rc;
  r->q = bf16_data(q, &r->q_copy);
  r->kv = bf16_data(kv, &r->kv_copy);
  if (!r->q || !r->kv)
    return DSV4_ENOMEM;
  r->q_bytes = q->nbytes;
  r->kv_bytes = kv->nbytes;
  return 0;
}

void dsv4_forward_req_free(dsv4_forward_req_t *r) {
  free(r->segs);
  free(r->segs_text);
  free(r->segs_given);
  json_decref(r->segs_doc);
  dsv4_st_view_free(&r->view);
  free(r->q_copy);
  free(r->kv_copy);
  for (int i = 0; i < 4; i++)
    free(r->c_copy[i]);
  memset(r, 0, sizeof(*r));
}

/* Copy n bytes at *p into owned aligned memory (kept in *copy) unless *copy already holds them. */
static int own(const void **p, size_t n, void **copy) {
  if (*copy || !*p)
    return 0;
  *copy = aligned_alloc(DSV4_FORWARD_ALIGN,
                        (n + DSV4_FORWARD_ALIGN - 1) & ~(size_t)(DSV4_FORWARD_ALIGN - 1));
  if (!*copy)
    return DSV4_ENOMEM;
  memcpy(*copy, *p, n);
  *p = *copy;
  return 0;
}

int dsv4_forward_req_own_cache_inputs(dsv4_forward_req_t *r) {
  const void *kv = r->kv;
  const void *c[4] = {r->ckv, r->ikv, r->iq, r->iw};
  int rc = own(&kv, r->kv_bytes, (void **)&r->kv_copy);
  for (int i = 0; i < 4 && !rc; i++)
    rc = own(&c[i], r->c_bytes[i], &r->c_copy[i]);
  r->kv = kv;
  r->ckv = c[0];
  r->ikv = c[1];
  r->iq = c[2];
  r->iw = c[3];
  return rc;
}
