#include "safetensors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

static const struct {
  const char *name;
  size_t size;
} dtypes[] = {
    [DSV4_ST_BF16] = {"BF16", 2}, [DSV4_ST_F32] = {"F32", 4}, [DSV4_ST_I64] = {"I64", 8},
    [DSV4_ST_I32] = {"I32", 4},   [DSV4_ST_U8] = {"U8", 1},   [DSV4_ST_F8_E4M3] = {"F8_E4M3", 1},
};
#define N_DTYPES (sizeof(dtypes) / sizeof(dtypes[0]))
/* A file opens with its header's length, a little-endian u64; the data section that follows the
 * header starts on a boundary of the same size (the header is padded with spaces). */
#define PREFIX_BYTES 8
#define DATA_ALIGN 8

size_t dsv4_st_dtype_size(int dtype) {
  return dtype >= 0 && (size_t)dtype < N_DTYPES ? dtypes[dtype].size : 0;
}

const char *dsv4_st_dtype_name(int dtype) {
  return dtype >= 0 && (size_t)dtype < N_DTYPES ? dtypes[dtype].name : NULL;
}

int dsv4_st_dtype_parse(const char *name, int *out) {
  for (size_t i = 0; i < N_DTYPES; i++) {
    if (strcmp(name, dtypes[i].name) == 0) {
      *out = (int)i;
      return 0;
    }
  }
  return DSV4_EINVAL;
}

/* printf into the view's error buffer and return DSV4_EINVAL, so every rejection is one line. */
__attribute__((format(printf, 2, 3))) static int fail(dsv4_st_view_t *v, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(v->error, sizeof(v->error), fmt, ap);
  va_end(ap);
  return DSV4_EINVAL;
}

/* numel and nbytes for a shape, refusing any product that does not fit in size_t. */
static int shape_bytes(const int64_t *shape, int ndim, size_t elem, size_t *numel, size_t *nbytes) {
  size_t n = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0)
      return DSV4_EINVAL;
    if ((uint64_t)shape[d] > SIZE_MAX || __builtin_mul_overflow(n, (size_t)shape[d], &n))
      return DSV4_ERANGE;
  }
  size_t b;
  if (__builtin_mul_overflow(n, elem, &b))
    return DSV4_ERANGE;
  *numel = n;
  *nbytes = b;
  return 0;
}

static int cmp_by_offset(const void *a, const void *b) {
  const dsv4_st_tensor_t *x = *(const dsv4_st_tensor_t *const *)a;
  const dsv4_st_tensor_t *y = *(const dsv4_st_tensor_t *const *)b;
  size_t xe = x->offset + x->nbytes, ye = y->offset + y->nbytes;
  if (x->offset != y->offset)
    return x->offset < y->offset ? -1 : 1;
  if (xe != ye)
    return xe < ye ? -1 : 1;
  return 0;
}

static int parse_metadata(dsv4_st_view_t *v, json_t *meta) {
  if (!json_is_object(meta))
    return fail(v, "__metadata__ is not a JSON object");
  size_t n = json_object_size(meta);
  if (n == 0)
    return 0;
  v->meta = calloc(n, sizeof(*v->meta));
  if (!v->meta)
    return DSV4_ENOMEM;
  const char *key;
  json_t *val;
  json_object_foreach(meta, key, val) {
    if (!json_is_string(val))
      return fail(v, "__metadata__ value \"%.64s\" is not a string", key);
    v->meta[v->n_meta].key = key;
    v->meta[v->n_meta].value = json_string_value(val);
    v->n_meta++;
  }
  return 0;
}

/* The other dtypes a published checkpoint may hold (safetensors' own list): a checkpoint is parsed
 * with them, a request body never. Their tensors are located and bounds-checked but not decoded. */
static const struct {
  const char *name;
  size_t size; /* 0: not a whole number of bytes per element (sizes come from data_offsets) */
} other_dtypes[] = {
    {"F16", 2}, {"F64", 8},     {"I8", 1},      {"I16", 2},       {"U16", 2},
    {"U32", 4}, {"U64", 8},     {"BOOL", 1},    {"F8_E5M2", 1},   {"F8_E8M0", 1},
    {"F4", 0},  {"F6_E2M3", 0}, {"F6_E3M2", 0}, {"F8_E4M3FN", 1},
};

/* The size of a checkpoint-only dtype, or -1 when the name is not one. */
static long other_dtype_size(const char *name) {
  for (size_t i = 0; i < sizeof(other_dtypes) / sizeof(other_dtypes[0]); i++)
    if (strcmp(name, other_dtypes[i].name) == 0)
      return (long)other_dtypes[i].size;
  return -1;
}

static int parse_tensor(dsv4_st_view_t *v, const char *name, json_t *obj, dsv4_st_tensor_t *t) {
  if (!json_is_object(obj))
    return fail(v, "tensor \"%.64s\": entry is not a JSON object", name);
  json_t *jd = NULL, *js = NULL, *jo = NULL;
  const char *key;
  json_t *val;
  json_object_foreach(obj, key, val) {
    if (strcmp(key, "dtype") == 0)
      jd = val;
    else if (strcmp(key, "shape") == 0)
      js = val;
    else if (strcmp(key, "data_offsets") == 0)
      jo = val;
    else
      return fail(v, "tensor \"%.64s\": unknown field \"%.32s\"", name, key);
  }
  if (!jd || !js || !jo)
    return fail(v, "tensor \"%.64s\": missing %s", name,
                !jd   ? "dtype"
                : !js ? "shape"
                      : "data_offsets");
  t->name = name;
  if (!json_is_string(jd))
    return fail(v, "tensor \"%.64s\": dtype is not a string", name);
  long other = -1;
  if (dsv4_st_dtype_parse(json_string_value(jd), &t->dtype) != 0) {
    other = v->checkpoint ? other_dtype_size(json_string_value(jd)) : -1;
    if (other < 0)
      return fail(v, "tensor \"%.64s\": unsupported dtype \"%.32s\"", name, json_string_value(jd));
    t->dtype = DSV4_ST_OTHER;
  }

  if (!json_is_array(js))
    return fail(v, "tensor \"%.64s\": shape is not an array", name);
  if (json_array_size(js) > DSV4_ST_MAX_DIMS)
    return fail(v, "tensor \"%.64s\": shape has %zu dimensions, at most %d allowed", name,
                json_array_size(js), DSV4_ST_MAX_DIMS);
  t->ndim = (int)json_array_size(js);
  for (int d = 0; d < t->ndim; d++) {
    json_t *e = json_array_get(js, (size_t)d);
    if (!json_is_integer(e))
      return fail(v, "tensor \"%.64s\": shape[%d] is not an integer", name, d);
    if (json_integer_value(e) < 0)
      return fail(v, "tensor \"%.64s\": shape[%d] = %lld is negative", name, d,
                  (long long)json_integer_value(e));
    t->shape[d] = (int64_t)json_integer_value(e);
  }
  size_t elem = other >= 0 ? (size_t)(other ? other : 1) : dsv4_st_dtype_size(t->dtype);
  if (shape_bytes(t->shape, t->ndim, elem, &t->numel, &t->nbytes) != 0)
    return fail(v, "tensor \"%.64s\": shape product overflows", name);

  if (!json_is_array(jo) || json_array_size(jo) != 2)
    return fail(v, "tensor \"%.64s\": data_offsets is not an array [begin, end]", name);
  json_t *jb = json_array_get(jo, 0), *je = json_array_get(jo, 1);
  if (!json_is_integer(jb) || !json_is_integer(je))
    return fail(v, "tensor \"%.64s\": data_offsets are not integers", name);
  json_int_t b = json_integer_value(jb), e = json_integer_value(je);
  if (b < 0 || e < b)
    return fail(v, "tensor \"%.64s\": data_offsets [%lld, %lld] are not an increasing range", name,
                (long long)b, (long long)e);
  if ((uint64_t)e > v->data_len)
    return fail(v, "tensor \"%.64s\": data_offsets end %lld is past the %s (%zu bytes)", name,
                (long long)e, v->region ? "region" : "data section", v->data_len);
  if (other == 0) /* sub-byte elements: the size is what the offsets say */
    t->nbytes = (size_t)(e - b);
  if ((uint64_t)(e - b) != t->nbytes)
    return fail(v, "tensor \"%.64s\": data_offsets span %lld bytes but shape and dtype %s need %zu",
                name, (long long)(e - b), json_string_value(jd), t->nbytes);
  t->offset = (size_t)b;
  t->data = v->data + t->offset;
  return 0;
}

/* The __metadata__ and the tensors of a header object; each tensor's data_offsets are checked
 * against v->data_len and its data points into v->data. */
static int parse_entries(dsv4_st_view_t *v) {
  size_t n = json_object_size(v->doc);
  json_t *meta = json_object_get(v->doc, "__metadata__");
  if (meta)
    n--;
  if (meta) {
    int rc = parse_metadata(v, meta);
    if (rc != 0)
      return rc;
  }
  if (n > 0) {
    v->tensors = calloc(n, sizeof(*v->tensors));
    if (!v->tensors)
      return DSV4_ENOMEM;
  }
  const char *key;
  json_t *val;
  json_object_foreach(v->doc, key, val) {
    if (strcmp(key, "__metadata__") == 0)
      continue;
    int rc = parse_tensor(v, key, val, &v->tensors[v->n_tensors]);
    if (rc != 0)
      return rc;
    v->n_tensors++;
  }
  return 0;
}

/* The tensors sorted by offset, or NULL (DSV4_ENOMEM) when there are some and no memory. */
static dsv4_st_tensor_t **by_offset(dsv4_st_view_t *v) {
  dsv4_st_tensor_t **order = malloc((v->n_tensors ? v->n_tensors : 1) * sizeof(*order));
  if (!order)
    return NULL;
  for (size_t i = 0; i < v->n_tensors; i++)
    order[i] = &v->tensors[i];
  qsort(order, v->n_tensors, sizeof(*order), cmp_by_offset);
  return order;
}

static int parse(const uint8_t *buf, size_t len, dsv4_st_view_t *v) {
  if (len < PREFIX_BYTES)
    return fail(v, "safetensors body of %zu bytes is shorter than the 8-byte header length", len);
  uint64_t hlen = 0;
  for (int i = PREFIX_BYTES - 1; i >= 0; i--)
    hlen = (hlen << 8) | buf[i];
  if (hlen > DSV4_ST_MAX_HEADER)
    return fail(v, "header length %llu exceeds the %zu-byte limit", (unsigned long long)hlen,
                DSV4_ST_MAX_HEADER);
  if (hlen > len - PREFIX_BYTES)
    return fail(v, "header length %llu is past the end of the %zu-byte body",
                (unsigned long long)hlen, len);
  v->header_len = (size_t)hlen;
  v->data = buf + PREFIX_BYTES + hlen;
  v->data_len = len - PREFIX_BYTES - (size_t)hlen;

  json_error_t jerr;
  v->doc = json_loadb((const char *)buf + PREFIX_BYTES, (size_t)hlen,
                      JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
  if (!v->doc)
    return fail(v, "header is not valid JSON: %s (byte %d)", jerr.text, jerr.position);
  if (!json_is_object(v->doc))
    return fail(v, "header is not a JSON object");
  int rc = parse_entries(v);
  if (rc != 0)
    return rc;

  /* Sorted by offset, each tensor must begin where the previous one ended and the last must end
   * at the buffer's end: no byte is shared, none is unaccounted for. */
  size_t n = v->n_tensors, pos = 0;
  dsv4_st_tensor_t **order = by_offset(v);
  if (!order)
    return DSV4_ENOMEM;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const dsv4_st_tensor_t *t = order[i];
    if (t->offset < pos)
      rc = fail(v, "tensor \"%.64s\": data [%zu, %zu) overlaps tensor \"%.64s\"", t->name,
                t->offset, t->offset + t->nbytes, order[i - 1]->name);
    else if (t->offset > pos)
      rc = fail(v, "tensor \"%.64s\": data begins at %zu, leaving a gap after byte %zu", t->name,
                t->offset, pos);
    pos = t->offset + t->nbytes;
  }
  free(order);
  if (rc == 0 && pos != v->data_len)
    rc = fail(v, "tensors cover %zu bytes but the data section has %zu (trailing bytes)", pos,
              v->data_len);
  return rc;
}

static int parse_as(const uint8_t *buf, size_t len, int checkpoint, dsv4_st_view_t *out) {
  memset(out, 0, sizeof(*out));
  out->checkpoint = checkpoint;
  int rc = parse(buf, len, out);
  if (rc != 0) {
    char keep[DSV4_ST_ERR_LEN];
    if (rc == DSV4_ENOMEM)
      snprintf(out->error, sizeof(out->error), "out of memory parsing the safetensors header");
    memcpy(keep, out->error, sizeof(keep));
    dsv4_st_view_free(out);
    memcpy(out->error, keep, sizeof(keep));
  }
  return rc;
}

/* A region's header: every tensor inside the region, on a multiple of its element size, and no
 * two tensors sharing a byte; gaps are allowed. */
static int parse_region(json_t *header, const uint8_t *base, size_t size, dsv4_st_view_t *v) {
  if (!json_is_object(header))
    return fail(v, "header is not a JSON object");
  v->doc = json_incref(header);
  v->region = 1;
  v->data = base;
  v->data_len = size;
  int rc = parse_entries(v);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < v->n_tensors; i++) {
    const dsv4_st_tensor_t *t = &v->tensors[i];
    size_t elem = dsv4_st_dtype_size(t->dtype);
    if (elem && t->offset % elem)
      return fail(v,
                  "tensor \"%.64s\": data_offsets begin %zu is not a multiple of %zu (its "
                  "element size)",
                  t->name, t->offset, elem);
  }
  dsv4_st_tensor_t **order = by_offset(v);
  if (!order)
    return DSV4_ENOMEM;
  for (size_t i = 1; i < v->n_tensors && rc == 0; i++)
    if (order[i]->offset < order[i - 1]->offset + order[i - 1]->nbytes)
      rc = fail(v, "tensor \"%.64s\": data [%zu, %zu) overlaps tensor \"%.64s\"", order[i]->name,
                order[i]->offset, order[i]->offset + order[i]->nbytes, order[i - 1]->name);
  free(order);
  return rc;
}

int dsv4_st_view_region(json_t *header, const uint8_t *base, size_t size, dsv4_st_view_t *out) {
  memset(out, 0, sizeof(*out));
  int rc = parse_region(header, base, size, out);
  if (rc != 0) {
    char keep[DSV4_ST_ERR_LEN];
    if (rc == DSV4_ENOMEM)
      snprintf(out->error, sizeof(out->error), "out of memory parsing the safetensors header");
    memcpy(keep, out->error, sizeof(keep));
    dsv4_st_view_free(out);
    memcpy(out->error, keep, sizeof(keep));
  }
  return rc;
}

int dsv4_st_parse(const uint8_t *buf, size_t len, dsv4_st_view_t *out) {
  return parse_as(buf, len, 0, out);
}

int dsv4_st_parse_checkpoint(const uint8_t *buf, size_t len, dsv4_st_view_t *out) {
  return parse_as(buf, len, 1, out);
}

void dsv4_st_view_free(dsv4_st_view_t *v) {
  free(v->tensors);
  free(v->meta);
  if (v->doc)
    json_decref(v->doc);
  memset(v, 0, sizeof(*v));
}

const dsv4_st_tensor_t *dsv4_st_find(const dsv4_st_view_t *v, const char *name) {
  for (size_t i = 0; i < v->n_tensors; i++)
    if (strcmp(v->tensors[i].name, name) == 0)
      return &v->tensors[i];
  return NULL;
}

const char *dsv4_st_meta(const dsv4_st_view_t *v, const char *key) {
  for (size_t i = 0; i < v->n_meta; i++)
    if (strcmp(v->meta[i].key, key) == 0)
      return v->meta[i].value;
  return NULL;
}

static int build_doc(const dsv4_st_desc_t *tensors, size_t n_tensors, const dsv4_st_meta_t *meta,
                     size_t n_meta, json_t *doc, size_t *data_len) {
  if (n_meta > 0) {
    json_t *m = json_object();
    if (!m || json_object_set_new(doc, "__metadata__", m) != 0)
      return DSV4_ENOMEM;
    for (size_t i = 0; i < n_meta; i++) {
      if (!meta[i].key || !meta[i].value || json_object_get(m, meta[i].key))
        return DSV4_EINVAL;
      json_t *s = json_string(meta[i].value);
      if (!s || json_object_set_new(m, meta[i].key, s) != 0)
        return DSV4_EINVAL; /* not UTF-8 */
    }
  }
  size_t pos = 0;
  for (size_t i = 0; i < n_tensors; i++) {
    const dsv4_st_desc_t *t = &tensors[i];
    size_t numel, nbytes, end;
    if (!t->name || strcmp(t->name, "__metadata__") == 0 || json_object_get(doc, t->name) ||
        dsv4_st_dtype_size(t->dtype) == 0 || t->ndim < 0 || t->ndim > DSV4_ST_MAX_DIMS)
      return DSV4_EINVAL;
    int rc = shape_bytes(t->shape, t->ndim, dsv4_st_dtype_size(t->dtype), &numel, &nbytes);
    if (rc != 0)
      return rc;
    if (nbytes != t->nbytes || __builtin_add_overflow(pos, nbytes, &end) || end > (size_t)INT64_MAX)
      return DSV4_EINVAL;
    json_t *shape = json_array();
    json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype", dtypes[t->dtype].name, "shape", shape,
                          "data_offsets", (json_int_t)pos, (json_int_t)end);
    if (!e)
      return DSV4_ENOMEM;
    if (json_object_set_new(doc, t->name, e) != 0)
      return DSV4_EINVAL; /* not UTF-8 */
    for (int d = 0; d < t->ndim; d++)
      if (json_array_append_new(shape, json_integer((json_int_t)t->shape[d])) != 0)
        return DSV4_ENOMEM;
    pos = end;
  }
  *data_len = pos;
  return 0;
}

int dsv4_st_build_header(const dsv4_st_desc_t *tensors, size_t n_tensors,
                         const dsv4_st_meta_t *meta, size_t n_meta, uint8_t **out, size_t *out_len,
                         size_t *data_len) {
  json_t *doc = json_object();
  if (!doc)
    return DSV4_ENOMEM;
  size_t dlen = 0;
  int rc = build_doc(tensors, n_tensors, meta, n_meta, doc, &dlen);
  char *text = NULL;
  if (rc == 0) {
    text = json_dumps(doc, JSON_COMPACT);
    if (!text)
      rc = DSV4_ENOMEM;
  }
  json_decref(doc);
  if (rc != 0)
    return rc;
  size_t tlen = strlen(text);
  /* Pad with spaces (JSON whitespace) so the data section starts on an 8-byte boundary. */
  size_t hlen = (tlen + DATA_ALIGN - 1) & ~(size_t)(DATA_ALIGN - 1);
  if (hlen > DSV4_ST_MAX_HEADER) {
    free(text);
    return DSV4_ETOOBIG;
  }
  uint8_t *buf = malloc(PREFIX_BYTES + hlen);
  if (!buf) {
    free(text);
    return DSV4_ENOMEM;
  }
  for (int i = 0; i < PREFIX_BYTES; i++)
    buf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
  memcpy(buf + PREFIX_BYTES, text, tlen);
  memset(buf + PREFIX_BYTES + tlen, ' ', hlen - tlen);
  free(text);
  *out = buf;
  *out_len = PREFIX_BYTES + hlen;
  *data_len = dlen;
  return 0;
}
