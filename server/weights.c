#include "weights.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dsv4-numerics.h"

/* The index file a HuggingFace checkpoint directory holds beside its shards. */
#define INDEX_NAME "model.safetensors.index.json"
/* The prefix some checkpoints put before every tensor name. */
#define MODEL_PREFIX "model."
/* Longest tensor name looked up (the prefix included). */
#define NAME_MAX_BYTES 256
/* kv_norm weights are bounded so that (z * r) * w stays finite: |z * r| <= sqrt(512). */
#define KV_NORM_WEIGHT_BOUND 0x1p32f

/* One memory-mapped safetensors file and its parsed header. */
typedef struct {
  char *path;
  const uint8_t *map;
  size_t len;
  dsv4_st_view_t view;
  int state; /* 0 not opened yet, 1 parsed, -1 failed */
} shard_t;

struct dsv4_weights {
  shard_t *shards;
  size_t n_shards;
  json_t *weight_map;    /* name -> shard file name, for a directory; NULL for a single file */
  char *dir;             /* the directory of a sharded checkpoint */
  char shard_error[512]; /* why the last shard that failed to open did */
};

static int shard_open(shard_t *s, char *why, size_t why_len) {
  struct stat st;
  if (s->state)
    return s->state > 0 ? 0 : DSV4_ECONFIG;
  s->state = -1;
  int fd = open(s->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 8) {
    snprintf(why, why_len, "%s: %s", s->path,
             fd < 0 ? strerror(errno) : "is not a regular safetensors file");
    if (fd >= 0)
      close(fd);
    return DSV4_ECONFIG;
  }
  s->len = (size_t)st.st_size;
  void *m = mmap(NULL, s->len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    snprintf(why, why_len, "%s: cannot be mapped: %s", s->path, strerror(errno));
    return DSV4_ECONFIG;
  }
  s->map = m;
  if (dsv4_st_parse_checkpoint(s->map, s->len, &s->view)) {
    snprintf(why, why_len, "%s: %s", s->path, s->view.error);
    return DSV4_ECONFIG;
  }
  s->state = 1;
  return 0;
}

static void shard_close(shard_t *s) {
  if (s->state > 0)
    dsv4_st_view_free(&s->view);
  if (s->map)
    munmap((void *)s->map, s->len);
  free(s->path);
}

static char *join_path(const char *dir, const char *name) {
  size_t n = strlen(dir) + strlen(name) + 2;
  char *p = malloc(n);
  if (p)
    snprintf(p, n, "%s/%s", dir, name);
  return p;
}

/* A directory: read its index and list each shard file once (opened when first needed). */
static int open_index(dsv4_weights_t *w, const char *dir, char *why, size_t why_len) {
  char *index = join_path(dir, INDEX_NAME);
  json_error_t je;
  json_t *doc = index ? json_load_file(index, 0, &je) : NULL;
  json_t *map = doc ? json_object_get(doc, "weight_map") : NULL;
  if (!map || !json_is_object(map)) {
    snprintf(why, why_len, "%s: %s", index ? index : dir,
             !doc ? je.text : "has no \"weight_map\" object");
    free(index);
    json_decref(doc);
    return DSV4_ECONFIG;
  }
  free(index);
  w->weight_map = json_incref(map);
  json_decref(doc);
  w->dir = strdup(dir);
  w->shards = calloc(json_object_size(map) + 1, sizeof(*w->shards));
  if (!w->dir || !w->shards)
    return DSV4_ENOMEM;
  const char *name;
  json_t *file;
  json_object_foreach(map, name, file) {
    if (!json_is_string(file) || strchr(json_string_value(file), '/')) {
      snprintf(why, why_len, "%s/%s: weight_map[\"%.64s\"] is not a file name beside the index",
               dir, INDEX_NAME, name);
      return DSV4_ECONFIG;
    }
    size_t i = 0;
    while (i < w->n_shards && strcmp(strrchr(w->shards[i].path, '/') + 1, json_string_value(file)))
      i++;
    if (i == w->n_shards) {
      if (!(w->shards[i].path = join_path(dir, json_string_value(file))))
        return DSV4_ENOMEM;
      w->n_shards++;
    }
  }
  return 0;
}

int dsv4_weights_open(const char *path, dsv4_weights_t **out, char *why, size_t why_len) {
  struct stat st;
  int rc;
  *out = NULL;
  if (!path || !*path || stat(path, &st) != 0) {
    snprintf(why, why_len, "%s: %s", path && *path ? path : "weights",
             path && *path ? strerror(errno) : "no checkpoint given");
    return DSV4_ECONFIG;
  }
  dsv4_weights_t *w = calloc(1, sizeof(*w));
  if (!w)
    return DSV4_ENOMEM;
  if (S_ISDIR(st.st_mode)) {
    rc = open_index(w, path, why, why_len);
  } else {
    w->shards = calloc(1, sizeof(*w->shards));
    rc = w->shards && (w->shards[0].path = strdup(path)) ? 0 : DSV4_ENOMEM;
    w->n_shards = rc ? 0 : 1;
    if (!rc)
      rc = shard_open(&w->shards[0], why, why_len);
  }
  if (rc) {
    if (rc == DSV4_ENOMEM)
      snprintf(why, why_len, "%s: out of memory", path);
    dsv4_weights_close(w);
    return rc;
  }
  *out = w;
  return 0;
}

void dsv4_weights_close(dsv4_weights_t *w) {
  if (!w)
    return;
  for (size_t i = 0; i < w->n_shards; i++)
    shard_close(&w->shards[i]);
  free(w->shards);
  json_decref(w->weight_map);
  free(w->dir);
  free(w);
}

/* The shard that should hold name exactly (no prefix rule), or NULL. */
static shard_t *shard_of(dsv4_weights_t *w, const char *name) {
  if (!w->weight_map)
    return &w->shards[0];
  json_t *f = json_object_get(w->weight_map, name);
  if (!f)
    return NULL;
  for (size_t i = 0; i < w->n_shards; i++)
    if (!strcmp(strrchr(w->shards[i].path, '/') + 1, json_string_value(f)))
      return &w->shards[i];
  return NULL;
}

static const dsv4_st_tensor_t *find_exact(dsv4_weights_t *w, const char *name, const char **file) {
  shard_t *s = shard_of(w, name);
  if (!s || shard_open(s, w->shard_error, sizeof(w->shard_error)))
    return NULL;
  *file = s->path;
  return dsv4_st_find(&s->view, name);
}

const dsv4_st_tensor_t *dsv4_weights_find(dsv4_weights_t *w, const char *name, const char **file) {
  char prefixed[NAME_MAX_BYTES + sizeof(MODEL_PREFIX)];
  const dsv4_st_tensor_t *t = find_exact(w, name, file);
  if (t)
    return t;
  snprintf(prefixed, sizeof(prefixed), MODEL_PREFIX "%s", name);
  return find_exact(w, prefixed, file);
}

/* The file to name in a message about a tensor that was not found. */
static const char *where(const dsv4_weights_t *w) {
  return w->weight_map ? w->dir : w->shards[0].path;
}

int dsv4_weights_read_f32(dsv4_weights_t *w, const char *name, int64_t n, int64_t first,
                          int64_t count, float *out, char *why, size_t why_len) {
  const char *file = NULL;
  const dsv4_st_tensor_t *t = dsv4_weights_find(w, name, &file);
  if (!t && w->shard_error[0]) {
    snprintf(why, why_len, "tensor \"%s\": %s", name, w->shard_error);
    return DSV4_ECONFIG;
  }
  if (!t) {
    snprintf(why, why_len, "%s: tensor \"%s\" is missing", where(w), name);
    return DSV4_ECONFIG;
  }
  if (t->ndim != 1 || t->shape[0] != n || (t->dtype != DSV4_ST_F32 && t->dtype != DSV4_ST_BF16)) {
    snprintf(why, why_len, "%s: tensor \"%s\" must be F32 or BF16 [%lld]", file, t->name,
             (long long)n);
    return DSV4_ECONFIG;
  }
  if (first < 0 || count < 0 || first + count > n) {
    snprintf(why, why_len, "%s: tensor \"%s\" has no elements %lld..%lld", file, t->name,
             (long long)first, (long long)(first + count - 1));
    return DSV4_ECONFIG;
  }
  for (int64_t k = 0; k < count; k++) {
    if (t->dtype == DSV4_ST_BF16) {
      uint16_t h;
      memcpy(&h, t->data + 2 * (first + k), 2);
      out[k] = dsv4_bf16_to_f32(h);
    } else {
      memcpy(&out[k], t->data + 4 * (first + k), 4);
    }
  }
  return 0;
}

int dsv4_weights_read_f32_shape(dsv4_weights_t *w, const char *name, uint32_t ndim,
                                const int64_t *shape, float *out, char *why, size_t why_len) {
  const char *file = NULL;
  const dsv4_st_tensor_t *t = dsv4_weights_find(w, name, &file);
  char dims[64] = "";
  int64_t n = 1;
  for (uint32_t d = 0; d < ndim; d++) {
    size_t used = strlen(dims);
    snprintf(dims + used, sizeof(dims) - used, "%s%lld", d ? ", " : "", (long long)shape[d]);
    n *= shape[d];
  }
  if (!t) {
    snprintf(why, why_len, "tensor \"%s\": %s", name,
             w->shard_error[0] ? w->shard_error : "is missing");
    if (!w->shard_error[0])
      snprintf(why, why_len, "%s: tensor \"%s\" is missing", where(w), name);
    return DSV4_ECONFIG;
  }
  int ok = t->ndim == (int)ndim && (t->dtype == DSV4_ST_F32 || t->dtype == DSV4_ST_BF16);
  for (uint32_t d = 0; ok && d < ndim; d++)
    ok = t->shape[d] == shape[d];
  if (!ok) {
    snprintf(why, why_len, "%s: tensor \"%s\" must be F32 or BF16 [%s]", file, t->name, dims);
    return DSV4_ECONFIG;
  }
  for (int64_t k = 0; k < n; k++) {
    if (t->dtype == DSV4_ST_BF16) {
      uint16_t h;
      memcpy(&h, t->data + 2 * k, 2);
      out[k] = dsv4_bf16_to_f32(h);
    } else {
      memcpy(&out[k], t->data + 4 * k, 4);
    }
    if (!(out[k] > -INFINITY && out[k] < INFINITY)) {
      snprintf(why, why_len, "%s: tensor \"%s\" has a non-finite element at %lld", file, t->name,
               (long long)k);
      return DSV4_ECONFIG;
    }
  }
  return 0;
}

/* The kv_norm weight of model layer L under either published name. */
static int read_kv_norm(dsv4_weights_t *w, uint32_t layer, float *out, char *why, size_t why_len) {
  char name[NAME_MAX_BYTES], alt[NAME_MAX_BYTES];
  const char *file;
  snprintf(name, sizeof(name), "layers.%u.attn.kv_norm.weight", layer);
  snprintf(alt, sizeof(alt), "layers.%u.kv_norm.weight", layer);
  const char *use =
      dsv4_weights_find(w, name, &file) || !dsv4_weights_find(w, alt, &file) ? name : alt;
  int rc = dsv4_weights_read_f32(w, use, DSV4_HEAD_DIM, 0, DSV4_HEAD_DIM, out, why, why_len);
  for (int k = 0; !rc && k < DSV4_HEAD_DIM; k++)
    if (!(out[k] > -KV_NORM_WEIGHT_BOUND && out[k] < KV_NORM_WEIGHT_BOUND)) {
      dsv4_weights_find(w, use, &file);
      snprintf(why, why_len, "%s: tensor \"%s\"[%d] is not finite or |w| >= 2^32", file, use, k);
      rc = DSV4_ECONFIG;
    }
  return rc;
}

/* The served slice of model layer L's attention sinks; NaN is refused, ±inf is a valid sink. */
static int read_sinks(dsv4_weights_t *w, const dsv4_layer_weights_req_t *req, uint32_t layer,
                      float *out, char *why, size_t why_len) {
  char name[NAME_MAX_BYTES];
  const char *file;
  snprintf(name, sizeof(name), "layers.%u.attn.attn_sink", layer);
  int rc = dsv4_weights_read_f32(w, name, req->total_heads, req->head_offset, req->heads, out, why,
                                 why_len);
  for (uint32_t h = 0; !rc && h < req->heads; h++)
    if (out[h] != out[h]) {
      dsv4_weights_find(w, name, &file);
      snprintf(why, why_len, "%s: tensor \"%s\"[%u] is NaN", file, name, req->head_offset + h);
      rc = DSV4_ECONFIG;
    }
  return rc;
}

/* The compressor tensors of model layer L of ratio r (4 or 128), SPEC §8.2. */
static int read_compressor(dsv4_weights_t *w, uint32_t layer, uint32_t r,
                           dsv4_compressor_weights_t *c, char *why, size_t why_len) {
  char name[NAME_MAX_BYTES];
  int64_t coff = r == 4 ? 2 : 1;
  int64_t ape_shape[2] = {r, coff * DSV4_HEAD_DIM}, norm_shape[1] = {DSV4_HEAD_DIM};
  int64_t i_ape_shape[2] = {4, 256}, i_norm_shape[1] = {128};
  c->ape = malloc(sizeof(float) * (size_t)(r * coff * DSV4_HEAD_DIM));
  c->norm = malloc(sizeof(float) * DSV4_HEAD_DIM);
  if (r == 4) {
    c->i_ape = malloc(sizeof(float) * 4 * 256);
    c->i_norm = malloc(sizeof(float) * 128);
  }
  if (!c->ape || !c->norm || (r == 4 && (!c->i_ape || !c->i_norm)))
    return DSV4_ENOMEM;
  snprintf(name, sizeof(name), "layers.%u.attn.compressor.ape", layer);
  int rc = dsv4_weights_read_f32_shape(w, name, 2, ape_shape, c->ape, why, why_len);
  snprintf(name, sizeof(name), "layers.%u.attn.compressor.norm.weight", layer);
  if (!rc)
    rc = dsv4_weights_read_f32_shape(w, name, 1, norm_shape, c->norm, why, why_len);
  snprintf(name, sizeof(name), "layers.%u.attn.indexer.compressor.ape", layer);
  if (!rc && r == 4)
    rc = dsv4_weights_read_f32_shape(w, name, 2, i_ape_shape, c->i_ape, why, why_len);
  snprintf(name, sizeof(name), "layers.%u.attn.indexer.compressor.norm.weight", layer);
  if (!rc && r == 4)
    rc = dsv4_weights_read_f32_shape(w, name, 1, i_norm_shape, c->i_norm, why, why_len);
  return rc;
}

int dsv4_layer_weights_load(dsv4_weights_t *w, const dsv4_layer_weights_req_t *req,
                            dsv4_layer_weights_t *out, char *why, size_t why_len) {
  size_t n = req->n_served ? req->n_served : 1;
  int rc = 0;
  memset(out, 0, sizeof(*out));
  if (req->kv_norm && !(out->kv_norm = malloc(sizeof(float) * DSV4_HEAD_DIM * n)))
    rc = DSV4_ENOMEM;
  if (!rc && req->sinks && !(out->sinks = malloc(sizeof(float) * req->heads * n)))
    rc = DSV4_ENOMEM;
  if (!rc && req->ratios && !(out->comp = calloc(n, sizeof(*out->comp))))
    rc = DSV4_ENOMEM;
  out->n_comp = out->comp ? req->n_served : 0;
  for (uint32_t i = 0; !rc && i < req->n_served; i++) {
    uint32_t layer = req->served_layers[i];
    if (req->ratios && (req->ratios[i] == 4 || req->ratios[i] == 128))
      rc = read_compressor(w, layer, req->ratios[i], &out->comp[i], why, why_len);
    if (req->kv_norm)
      rc = read_kv_norm(w, layer, out->kv_norm + (size_t)i * DSV4_HEAD_DIM, why, why_len);
    if (!rc && req->sinks)
      rc = read_sinks(w, req, layer, out->sinks + (size_t)i * req->heads, why, why_len);
  }
  if (rc == DSV4_ENOMEM)
    snprintf(why, why_len, "out of memory loading the layers' weights");
  if (rc)
    dsv4_layer_weights_free(out);
  return rc;
}

void dsv4_layer_weights_free(dsv4_layer_weights_t *lw) {
  for (uint32_t i = 0; i < lw->n_comp; i++) {
    free(lw->comp[i].ape);
    free(lw->comp[i].norm);
    free(lw->comp[i].i_ape);
    free(lw->comp[i].i_norm);
  }
  free(lw->comp);
  lw->comp = NULL;
  lw->n_comp = 0;
  free(lw->kv_norm);
  free(lw->sinks);
  lw->kv_norm = lw->sinks = NULL;
}
