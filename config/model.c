#include "model.h"

#include "config-internal.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"

/* The V4-Flash geometry of SPEC §1. */
#define FLASH_HEADS 64
#define FLASH_HIDDEN_LAYERS 43
#define FLASH_NEXTN_LAYERS 1
#define FLASH_ROPE_THETA 10000.0
#define FLASH_COMPRESS_ROPE_THETA 160000.0
#define FLASH_RMS_EPS 1e-6
/* V4-Flash's compression ratios: layers 0 and 1 and the MTP layer uncompressed, then these two
 * alternating from layer 2 (even layers, odd layers). */
#define FLASH_RATIO_EVEN 4
#define FLASH_RATIO_ODD 128
#define MODEL_MAX_LAYERS 1024
#define MODEL_MAX_NEXTN 16
#define MODEL_MAX_RATIO 65536
/* The indexer (SPEC §8.5): V4-Flash keeps 512 entries with 64 heads of 128 dims; V4-Pro keeps 1024.
 * The bounds keep a batch's selection table and the per-token score work finite. */
#define FLASH_INDEX_TOPK 512
#define FLASH_INDEX_HEADS 64
#define DSV4_INDEX_HEAD_DIM 128
#define MODEL_MAX_INDEX_TOPK 65536
#define MODEL_MAX_INDEX_HEADS 128
/* The largest max_position_embeddings taken (2^32): far beyond any model's context, and a bound,
 * like the others here, on what the RoPE tables may be asked to hold. */
#define MODEL_MAX_POSITION ((uint64_t)1 << 32)

static char *model_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d)
    memcpy(d, s, n);
  return d;
}

int dsv4_model_builtin_flash(dsv4_model_t *m) {
  memset(m, 0, sizeof(*m));
  m->num_attention_heads = FLASH_HEADS;
  m->head_dim = DSV4_HEAD_DIM;
  m->qk_rope_head_dim = DSV4_ROPE_DIM;
  m->sliding_window = DSV4_WINDOW;
  m->num_hidden_layers = FLASH_HIDDEN_LAYERS;
  m->num_nextn_predict_layers = FLASH_NEXTN_LAYERS;
  m->n_layers_total = FLASH_HIDDEN_LAYERS + FLASH_NEXTN_LAYERS;
  m->rms_norm_eps = (float)FLASH_RMS_EPS;
  m->max_position_embeddings = DSV4_MAX_POSITION_DEFAULT;
  m->index_topk = FLASH_INDEX_TOPK;
  m->index_n_heads = FLASH_INDEX_HEADS;
  m->index_head_dim = DSV4_INDEX_HEAD_DIM;
  m->compress_ratios = calloc(m->n_layers_total, sizeof(uint32_t));
  m->name = model_strdup("builtin:V4-Flash");
  if (!m->compress_ratios || !m->name) {
    dsv4_model_free(m);
    return DSV4_ENOMEM;
  }
  /* Layers 0 and 1 are uncompressed, then 4 and 128 alternate; the MTP layer is uncompressed. */
  for (uint32_t l = 2; l < FLASH_HIDDEN_LAYERS; l++)
    m->compress_ratios[l] = (l % 2 == 0) ? FLASH_RATIO_EVEN : FLASH_RATIO_ODD;
  /* Copying the shared defaults keeps the built-in inv_freq lists of SPEC §2.3 in force. */
  m->rope_plain = dsv4_rope_plain_default;
  m->rope_compress = dsv4_rope_yarn_default;
  return 0;
}

const dsv4_rope_params_t *dsv4_model_layer_rope(const dsv4_model_t *m, uint32_t layer) {
  if (!m || !m->compress_ratios || layer >= m->n_layers_total)
    return NULL;
  return m->compress_ratios[layer] >= 2 ? &m->rope_compress : &m->rope_plain;
}

void dsv4_model_free(dsv4_model_t *m) {
  if (!m)
    return;
  free(m->compress_ratios);
  free(m->name);
  memset(m, 0, sizeof(*m));
}

/* Parsing context: the file name for messages and the error buffer. */
typedef struct {
  const char *name;
  char *why;
  size_t why_len;
} model_ctx_t;

/* An optional unsigned integer key; absent or null keeps *out. */
static int get_uint(model_ctx_t *c, json_t *obj, const char *key, uint64_t min, uint64_t max,
                    uint64_t *out) {
  json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v))
    return 0;
  if (!json_is_integer(v))
    return dsv4__config_fail(c->why, c->why_len, "model config %s: key %s must be an integer",
                             c->name, key);
  json_int_t x = json_integer_value(v);
  if (x < 0 || (uint64_t)x < min || (uint64_t)x > max)
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key %s is %lld; allowed: %llu to %llu", c->name, key,
                             (long long)x, (unsigned long long)min, (unsigned long long)max);
  *out = (uint64_t)x;
  return 0;
}

/* An optional positive finite number (integer or real); absent or null keeps *out. */
/*
 * An optional number key within [lo, hi] (lo excluded when lo_open). The bounds are what the
 * numerics can take: every value inside gives finite RoPE rows and a positive fp32 epsilon, so a
 * model config cannot turn finite inputs into NaN outputs.
 */
static int get_number_in(model_ctx_t *c, json_t *obj, const char *key, double lo, int lo_open,
                         double hi, double *out) {
  json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v))
    return 0;
  if (!json_is_number(v))
    return dsv4__config_fail(c->why, c->why_len, "model config %s: key %s must be a number",
                             c->name, key);
  double x = json_number_value(v);
  if (!isfinite(x) || (lo_open ? !(x > lo) : !(x >= lo)) || !(x <= hi))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key %s is %g; it must be %s %g and at most %g",
                             c->name, key, x, lo_open ? "greater than" : "at least", lo, hi);
  *out = x;
  return 0;
}

/* Bounds of the numeric model keys (get_number_in). */
#define EPS_MIN ((double)FLT_MIN) /* the smallest normal fp32: eps stays positive as a float */
#define EPS_MAX 1.0
#define THETA_MIN 1.0 /* excluded: a RoPE base at or below 1 has no decreasing frequencies */
#define THETA_MAX ((double)FLT_MAX)
#define YARN_FACTOR_MAX 65536.0
#define YARN_ORIG_MAX 4294967296.0
#define YARN_BETA_MAX 65536.0

/* The geometry the daemon implements: other values are refused by name rather than served wrongly.
 */
static int check_fixed(model_ctx_t *c, json_t *root, const char *key, uint64_t want) {
  uint64_t v = want;
  int rc = get_uint(c, root, key, 0, UINT32_MAX, &v);
  if (rc)
    return rc;
  if (v != want)
    return dsv4__config_fail(
        c->why, c->why_len, "model config %s: key %s is %llu; the daemon implements only %s = %llu",
        c->name, key, (unsigned long long)v, key, (unsigned long long)want);
  return 0;
}

/* The scaling type of a section: `type` and `rope_type` are synonyms and must agree if both appear.
 */
static int section_type(model_ctx_t *c, json_t *sec, const char *where, const char **out) {
  *out = NULL;
  static const char *const keys[2] = {"type", "rope_type"};
  for (int i = 0; i < 2; i++) {
    json_t *v = json_object_get(sec, keys[i]);
    if (!v || json_is_null(v))
      continue;
    if (!json_is_string(v))
      return dsv4__config_fail(c->why, c->why_len, "model config %s: key %s.%s must be a string",
                               c->name, where, keys[i]);
    if (*out && strcmp(*out, json_string_value(v)) != 0)
      return dsv4__config_fail(c->why, c->why_len,
                               "model config %s: %s.type \"%s\" and %s.rope_type \"%s\" disagree",
                               c->name, where, *out, where, json_string_value(v));
    *out = json_string_value(v);
  }
  return 0;
}

/* Fill the compress-layer parameters from a scaling section (NULL = no scaling). */
static int compress_params(model_ctx_t *c, json_t *sec, const char *where, double theta,
                           dsv4_rope_params_t *out) {
  const char *type = NULL;
  int rc;
  if (sec && (rc = section_type(c, sec, where, &type)))
    return rc;
  if (!type || (strcmp(type, "yarn") != 0 && strcmp(type, "deepseek_yarn") != 0)) {
    /* Without YaRN a compressed layer uses the plain recipe with its own theta. */
    *out = dsv4_rope_plain_default;
    out->theta = theta;
    return 0;
  }
  *out = dsv4_rope_yarn_default;
  out->theta = theta;
  double factor = 0, orig = 0;
  double beta_fast = dsv4_rope_yarn_default.beta_fast, beta_slow = dsv4_rope_yarn_default.beta_slow;
  char key[96];
  if ((rc = get_number_in(c, sec, "factor", 1.0, 0, YARN_FACTOR_MAX, &factor)) ||
      (rc = get_number_in(c, sec, "original_max_position_embeddings", 1.0, 0, YARN_ORIG_MAX,
                          &orig)) ||
      (rc = get_number_in(c, sec, "beta_fast", 0.0, 1, YARN_BETA_MAX, &beta_fast)) ||
      (rc = get_number_in(c, sec, "beta_slow", 0.0, 1, YARN_BETA_MAX, &beta_slow)))
    return rc;
  if (factor == 0) {
    snprintf(key, sizeof(key), "%s.factor", where);
    return dsv4__config_fail(c->why, c->why_len, "model config %s: YaRN scaling needs key %s",
                             c->name, key);
  }
  if (orig == 0) {
    snprintf(key, sizeof(key), "%s.original_max_position_embeddings", where);
    return dsv4__config_fail(c->why, c->why_len, "model config %s: YaRN scaling needs key %s",
                             c->name, key);
  }
  if (!(beta_fast > beta_slow))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: %s.beta_fast (%g) must exceed %s.beta_slow (%g)",
                             c->name, where, beta_fast, where, beta_slow);
  /* The YaRN correction range divides by ln(theta): theta = 1 would make every inv_freq NaN. */
  if (!(theta > 1.0))
    return dsv4__config_fail(
        c->why, c->why_len,
        "model config %s: YaRN scaling (%s) needs a compress RoPE theta above 1, "
        "not %g",
        c->name, where, theta);
  out->yarn = 1;
  out->factor = factor;
  out->original_max_position = orig;
  out->beta_fast = beta_fast;
  out->beta_slow = beta_slow;
  return 0;
}

/* What model_parse reads from the file before it fills the model. */
typedef struct {
  uint64_t heads, hidden, nextn, total, maxpos;
  uint64_t topk, iheads; /* index_topk, index_n_heads */
  double eps, theta, ctheta;
  json_t *ratios;
  json_t *rp, *rs;   /* rope_parameters, rope_scaling; NULL when absent or null */
  json_t *sec_main;  /* the section that holds the plain layers' RoPE keys, or NULL */
  json_t *sec_comp;  /* the section that holds the compressed layers' scaling, or NULL */
  const char *where; /* sec_comp's name in messages */
  int nested;        /* rope_parameters has main / compress sections */
} model_keys_t;

/* Model pass 1: the top level is an object, the fixed geometry is ours, the required keys exist. */
static int model_check_keys(json_t *root, model_ctx_t *c) {
  int rc;
  if (!json_is_object(root))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: the top level must be a JSON object", c->name);
  if ((rc = check_fixed(c, root, "head_dim", DSV4_HEAD_DIM)) ||
      (rc = check_fixed(c, root, "qk_rope_head_dim", DSV4_ROPE_DIM)) ||
      (rc = check_fixed(c, root, "sliding_window", DSV4_WINDOW)))
    return rc;
  static const char *const required[] = {"num_attention_heads", "num_hidden_layers",
                                         "compress_ratios"};
  for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
    /* A null value counts as missing: the readers below would otherwise keep a zero. */
    json_t *v = json_object_get(root, required[i]);
    if (!v || json_is_null(v))
      return dsv4__config_fail(c->why, c->why_len, "model config %s: required key %s is missing",
                               c->name, required[i]);
  }
  return 0;
}

/* Model pass 2: heads, layers, positions, epsilon, and compress_ratios of one entry per layer. */
static int model_read_geometry(json_t *root, model_ctx_t *c, model_keys_t *k) {
  int rc;
  k->maxpos = DSV4_MAX_POSITION_DEFAULT;
  k->eps = FLASH_RMS_EPS;
  if ((rc = get_uint(c, root, "num_attention_heads", 1, DSV4_MAX_HEADS, &k->heads)) ||
      (rc = get_uint(c, root, "num_hidden_layers", 1, MODEL_MAX_LAYERS, &k->hidden)) ||
      (rc = get_uint(c, root, "num_nextn_predict_layers", 0, MODEL_MAX_NEXTN, &k->nextn)) ||
      (rc = get_uint(c, root, "max_position_embeddings", 1, MODEL_MAX_POSITION, &k->maxpos)))
    return rc;
  if ((rc = get_number_in(c, root, "rms_norm_eps", EPS_MIN, 0, EPS_MAX, &k->eps)))
    return rc;
  k->topk = FLASH_INDEX_TOPK;
  k->iheads = FLASH_INDEX_HEADS;
  if ((rc = check_fixed(c, root, "index_head_dim", DSV4_INDEX_HEAD_DIM)) ||
      (rc = get_uint(c, root, "index_topk", 1, MODEL_MAX_INDEX_TOPK, &k->topk)) ||
      (rc = get_uint(c, root, "index_n_heads", 1, MODEL_MAX_INDEX_HEADS, &k->iheads)))
    return rc;

  k->ratios = json_object_get(root, "compress_ratios");
  k->total = k->hidden + k->nextn;
  if (!json_is_array(k->ratios))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key compress_ratios must be an array", c->name);
  if (json_array_size(k->ratios) != k->total)
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key compress_ratios has %zu entries; it must have "
                             "num_hidden_layers + num_nextn_predict_layers = %llu + %llu = %llu",
                             c->name, json_array_size(k->ratios), (unsigned long long)k->hidden,
                             (unsigned long long)k->nextn, (unsigned long long)k->total);
  return 0;
}

/* Model pass 3: the RoPE sections, rope_parameters (flat or main/compress), else rope_scaling. */
static int model_rope_sections(json_t *root, model_ctx_t *c, model_keys_t *k) {
  k->rp = json_object_get(root, "rope_parameters");
  k->rs = json_object_get(root, "rope_scaling");
  if (k->rp && json_is_null(k->rp))
    k->rp = NULL;
  if (k->rs && json_is_null(k->rs))
    k->rs = NULL;
  if (k->rp && !json_is_object(k->rp))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key rope_parameters must be an object", c->name);
  if (k->rs && !json_is_object(k->rs))
    return dsv4__config_fail(c->why, c->why_len,
                             "model config %s: key rope_scaling must be an object", c->name);
  k->nested = k->rp && (json_object_get(k->rp, "main") || json_object_get(k->rp, "compress"));
  if (k->nested) {
    k->sec_main = json_object_get(k->rp, "main");
    k->sec_comp = json_object_get(k->rp, "compress");
    if ((k->sec_main && !json_is_object(k->sec_main)) ||
        (k->sec_comp && !json_is_object(k->sec_comp)))
      return dsv4__config_fail(
          c->why, c->why_len, "model config %s: rope_parameters.main and .compress must be objects",
          c->name);
    k->where = "rope_parameters.compress";
  } else if (k->rp) {
    k->sec_main = k->rp;
    k->sec_comp = k->rp;
    k->where = "rope_parameters";
  }
  return 0;
}

/* Model pass 4: the RoPE bases, and the section whose scaling the compressed layers use. */
static int model_rope_thetas(json_t *root, model_ctx_t *c, model_keys_t *k) {
  int rc;
  /* The top-level keys, overridden by rope_parameters (the newer, more specific format). */
  k->theta = FLASH_ROPE_THETA;
  k->ctheta = FLASH_COMPRESS_ROPE_THETA;
  if ((rc = get_number_in(c, root, "rope_theta", THETA_MIN, 1, THETA_MAX, &k->theta)) ||
      (rc = get_number_in(c, root, "compress_rope_theta", THETA_MIN, 1, THETA_MAX, &k->ctheta)))
    return rc;
  if (k->sec_main &&
      (rc = get_number_in(c, k->sec_main, "rope_theta", THETA_MIN, 1, THETA_MAX, &k->theta)))
    return rc;
  if (!k->nested && k->rp &&
      (rc = get_number_in(c, k->rp, "compress_rope_theta", THETA_MIN, 1, THETA_MAX, &k->ctheta)))
    return rc;
  if (k->nested && k->sec_comp &&
      (rc = get_number_in(c, k->sec_comp, "rope_theta", THETA_MIN, 1, THETA_MAX, &k->ctheta)))
    return rc;

  /*
   * A rope_parameters section for the compressed layers (flat, or nested compress) without a type
   * carries no scaling: then rope_scaling decides, in the nested form as in the flat one.
   */
  if (k->sec_comp) {
    const char *t = NULL;
    if ((rc = section_type(c, k->sec_comp, k->where, &t)))
      return rc;
    if (!t) {
      k->sec_comp = NULL;
      k->where = NULL;
    }
  }
  if (!k->sec_comp && k->rs) {
    k->sec_comp = k->rs;
    k->where = "rope_scaling";
  }
  return 0;
}

static int model_parse(dsv4_model_t *m, json_t *root, model_ctx_t *c) {
  model_keys_t k = {0};
  int rc;
  if ((rc = model_check_keys(root, c)) || (rc = model_read_geometry(root, c, &k)) ||
      (rc = model_rope_sections(root, c, &k)) || (rc = model_rope_thetas(root, c, &k)))
    return rc;

  m->num_attention_heads = (uint32_t)k.heads;
  m->head_dim = DSV4_HEAD_DIM;
  m->qk_rope_head_dim = DSV4_ROPE_DIM;
  m->sliding_window = DSV4_WINDOW;
  m->num_hidden_layers = (uint32_t)k.hidden;
  m->num_nextn_predict_layers = (uint32_t)k.nextn;
  m->n_layers_total = (uint32_t)k.total;
  m->rms_norm_eps = (float)k.eps;
  m->max_position_embeddings = (int64_t)k.maxpos;
  m->index_topk = (uint32_t)k.topk;
  m->index_n_heads = (uint32_t)k.iheads;
  m->index_head_dim = DSV4_INDEX_HEAD_DIM;
  m->rope_plain = dsv4_rope_plain_default;
  m->rope_plain.theta = k.theta;
  if ((rc = compress_params(c, k.sec_comp, k.where ? k.where : "rope_scaling", k.ctheta,
                            &m->rope_compress)))
    return rc;

  m->compress_ratios = calloc(k.total, sizeof(uint32_t));
  if (!m->compress_ratios)
    return DSV4_ENOMEM;
  for (size_t i = 0; i < k.total; i++) {
    json_t *v = json_array_get(k.ratios, i);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > MODEL_MAX_RATIO)
      return dsv4__config_fail(
          c->why, c->why_len,
          "model config %s: compress_ratios[%zu] must be an integer from 0 to %d", c->name, i,
          MODEL_MAX_RATIO);
    m->compress_ratios[i] = (uint32_t)json_integer_value(v);
  }
  m->name = model_strdup(c->name);
  if (!m->name)
    return DSV4_ENOMEM;
  return 0;
}

static int model_load_root(dsv4_model_t *m, json_t *root, const char *name, char *why,
                           size_t why_len) {
  model_ctx_t c = {name, why, why_len};
  memset(m, 0, sizeof(*m));
  int rc = model_parse(m, root, &c);
  if (rc) {
    if (rc == DSV4_ENOMEM)
      dsv4__config_fail(why, why_len, "model config %s: out of memory", name);
    dsv4_model_free(m);
  }
  return rc;
}

int dsv4_model_load_json(dsv4_model_t *m, const char *json_text, char *why, size_t why_len) {
  json_error_t je;
  memset(m, 0, sizeof(*m));
  json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return dsv4__config_fail(why, why_len, "model config (inline): invalid JSON at line %d: %s",
                             je.line, je.text);
  int rc = model_load_root(m, root, "(inline)", why, why_len);
  json_decref(root);
  return rc;
}

int dsv4_model_load_file(dsv4_model_t *m, const char *path, char *why, size_t why_len) {
  json_error_t je;
  memset(m, 0, sizeof(*m));
  json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
  if (!root)
    return dsv4__config_fail(why, why_len, "model config %s: cannot load: %s (line %d)", path,
                             je.text, je.line);
  int rc = model_load_root(m, root, path, why, why_len);
  json_decref(root);
  return rc;
}
