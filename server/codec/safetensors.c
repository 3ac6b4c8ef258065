#include "safetensors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "json_scan.h"

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

/* A tensor entry's fields as read, before their values are checked (tensor_check). */
typedef struct {
  const char *name;
  const char *dtype;
  int ndim;
  int64_t shape[DSV4_ST_MAX_DIMS];
  int64_t begin, end;
} raw_tensor_t;

/* A document's tensor entry into r: its shape as JSON (fields, their types, at most
 * DSV4_ST_MAX_DIMS dimensions); the values are tensor_check's. */
static int tensor_json(dsv4_st_view_t *v, const char *name, json_t *obj, raw_tensor_t *r) {
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
  r->name = name;
  if (!json_is_string(jd))
    return fail(v, "tensor \"%.64s\": dtype is not a string", name);
  r->dtype = json_string_value(jd);
  if (!json_is_array(js))
    return fail(v, "tensor \"%.64s\": shape is not an array", name);
  if (json_array_size(js) > DSV4_ST_MAX_DIMS)
    return fail(v, "tensor \"%.64s\": shape has %zu dimensions, at most %d allowed", name,
                json_array_size(js), DSV4_ST_MAX_DIMS);
  r->ndim = (int)json_array_size(js);
  for (int d = 0; d < r->ndim; d++) {
    json_t *e = json_array_get(js, (size_t)d);
    if (!json_is_integer(e))
      return fail(v, "tensor \"%.64s\": shape[%d] is not an integer", name, d);
    r->shape[d] = (int64_t)json_integer_value(e);
  }
  if (!json_is_array(jo) || json_array_size(jo) != 2)
    return fail(v, "tensor \"%.64s\": data_offsets is not an array [begin, end]", name);
  json_t *jb = json_array_get(jo, 0), *je = json_array_get(jo, 1);
  if (!json_is_integer(jb) || !json_is_integer(je))
    return fail(v, "tensor \"%.64s\": data_offsets are not integers", name);
  r->begin = (int64_t)json_integer_value(jb);
  r->end = (int64_t)json_integer_value(je);
  return 0;
}

/* A tensor entry's values: its dtype, its shape's size and its data_offsets against the data. */
static int tensor_check(dsv4_st_view_t *v, const raw_tensor_t *r, dsv4_st_tensor_t *t) {
  const char *name = r->name;
  t->name = name;
  long other = -1;
  if (dsv4_st_dtype_parse(r->dtype, &t->dtype) != 0) {
    other = v->checkpoint ? other_dtype_size(r->dtype) : -1;
    if (other < 0)
      return fail(v, "tensor \"%.64s\": unsupported dtype \"%.32s\"", name, r->dtype);
    t->dtype = DSV4_ST_OTHER;
  }
  t->ndim = r->ndim;
  for (int d = 0; d < t->ndim; d++) {
    if (r->shape[d] < 0)
      return fail(v, "tensor \"%.64s\": shape[%d] = %lld is negative", name, d,
                  (long long)r->shape[d]);
    t->shape[d] = r->shape[d];
  }
  size_t elem = other >= 0 ? (size_t)(other ? other : 1) : dsv4_st_dtype_size(t->dtype);
  if (shape_bytes(t->shape, t->ndim, elem, &t->numel, &t->nbytes) != 0)
    return fail(v, "tensor \"%.64s\": shape product overflows", name);
  int64_t b = r->begin, e = r->end;
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
                name, (long long)(e - b), r->dtype, t->nbytes);
  t->offset = (size_t)b;
  t->data = v->data + t->offset;
  return 0;
}

static int parse_tensor(dsv4_st_view_t *v, const char *name, json_t *obj, dsv4_st_tensor_t *t) {
  raw_tensor_t r = {0};
  int rc = tensor_json(v, name, obj, &r);
  return rc ? rc : tensor_check(v, &r, t);
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

/*
 * ---- The usual header without a JSON document ----
 *
 * A header of the usual shape is read in one pass: an object of at most FAST_MAX_ENTRIES entries,
 * keyed by tensor names and "__metadata__"; tensor entries of exactly dtype, shape and
 * data_offsets, in any order; integers of 1 to 18 digits without sign or leading zeros; strings of
 * printable ASCII, escapes (\" \\ \/ \b \f \n \r \t) only in metadata values; white space anywhere.
 * Its strings are copied (unescaped) into memory of the view's own. Anything else (another escape,
 * a duplicate key, a number of another form, an empty entry) answers FAST_NO and the header is
 * read with jansson, so every answer, error or not, is the document's (safetensors_test and
 * fuzz_safetensors compare the two). A request's header costs jansson a few microseconds.
 */
#define FAST_NO DSV4_ST_NOT_USUAL
#define FAST_MAX_ENTRIES 16

/* [i, ...] of at most max integers into v. */
static int sc_ints(dsv4_scan_t *s, int64_t *v, int max, int *n) {
  *n = 0;
  if (!dsv4_scan_take(s, '['))
    return 0;
  if (dsv4_scan_take(s, ']'))
    return 1;
  do {
    if (*n == max || !dsv4_scan_int(s, &v[*n]))
      return 0;
    (*n)++;
  } while (dsv4_scan_take(s, ','));
  return dsv4_scan_take(s, ']');
}

static int sc_tensor(dsv4_scan_t *s, raw_tensor_t *r) {
  unsigned seen = 0;
  if (!dsv4_scan_take(s, '{'))
    return 0;
  do {
    const char *k = dsv4_scan_string(s, 0);
    int64_t o[2];
    int n = 0;
    if (!k || !dsv4_scan_take(s, ':'))
      return 0;
    if (!strcmp(k, "dtype") && !(seen & 1u) && (r->dtype = dsv4_scan_string(s, 0)) != NULL) {
      seen |= 1u;
    } else if (!strcmp(k, "shape") && !(seen & 2u) &&
               sc_ints(s, r->shape, DSV4_ST_MAX_DIMS, &r->ndim)) {
      seen |= 2u;
    } else if (!strcmp(k, "data_offsets") && !(seen & 4u) && sc_ints(s, o, 2, &n) && n == 2) {
      r->begin = o[0];
      r->end = o[1];
      seen |= 4u;
    } else {
      return 0;
    }
  } while (dsv4_scan_take(s, ','));
  return seen == 7u && dsv4_scan_take(s, '}');
}

static int sc_meta(dsv4_scan_t *s, dsv4_st_meta_t *m, size_t *n) {
  if (!dsv4_scan_take(s, '{'))
    return 0;
  if (dsv4_scan_take(s, '}'))
    return 1;
  do {
    const char *k = *n < FAST_MAX_ENTRIES ? dsv4_scan_string(s, 0) : NULL;
    const char *val = k && dsv4_scan_take(s, ':') ? dsv4_scan_string(s, 1) : NULL;
    if (!val)
      return 0;
    for (size_t i = 0; i < *n; i++)
      if (!strcmp(m[i].key, k))
        return 0;
    m[(*n)++] = (dsv4_st_meta_t){k, val};
  } while (dsv4_scan_take(s, ','));
  return dsv4_scan_take(s, '}');
}

/* The entries of the header object: metadata, tensors (names and duplicates checked); 0 on a
 * header that is not of the usual shape. */
static int sc_header(dsv4_scan_t *s, raw_tensor_t *raw, size_t *nt, dsv4_st_meta_t *meta,
                     size_t *nm) {
  int has_meta = 0;
  if (!dsv4_scan_take(s, '{'))
    return 0;
  if (dsv4_scan_take(s, '}'))
    return 1;
  do {
    const char *k = dsv4_scan_string(s, 0);
    if (!k || !dsv4_scan_take(s, ':'))
      return 0;
    if (!strcmp(k, "__metadata__")) {
      if (has_meta || !sc_meta(s, meta, nm))
        return 0;
      has_meta = 1;
      continue;
    }
    for (size_t i = 0; i < *nt; i++)
      if (!strcmp(raw[i].name, k))
        return 0;
    if (*nt == FAST_MAX_ENTRIES || !sc_tensor(s, &raw[*nt]))
      return 0;
    raw[(*nt)++].name = k;
  } while (dsv4_scan_take(s, ','));
  return dsv4_scan_take(s, '}');
}

/* A header of the usual shape as read (sc_header), its values not yet checked: what
 * dsv4_st_scan_header hands its caller until the data they point at is known. */
struct dsv4_st_raw {
  raw_tensor_t raw[FAST_MAX_ENTRIES];
  dsv4_st_meta_t meta[FAST_MAX_ENTRIES];
  size_t nt, nm;
  char *mem; /* the strings */
};

void dsv4_st_raw_free(dsv4_st_raw_t *r) {
  if (r) {
    free(r->mem);
    free(r);
  }
}

int dsv4_st_scan_header(const char *text, size_t len, size_t *used, dsv4_st_raw_t **out) {
  *out = NULL;
  dsv4_st_raw_t *r = calloc(1, sizeof(*r));
  /* Every string is shorter unescaped than its quoted text: len bytes hold them all. */
  char *mem = r ? malloc(len + 1) : NULL;
  if (!mem) {
    free(r);
    return DSV4_ENOMEM;
  }
  r->mem = mem;
  dsv4_scan_t s = {text, text + len, mem};
  int ok = sc_header(&s, r->raw, &r->nt, r->meta, &r->nm);
  if (used) /* the object alone: what follows it is the caller's */
    *used = (size_t)(s.p - text);
  else
    dsv4_scan_ws(&s);
  if (!ok || (!used && s.p != s.end)) {
    dsv4_st_raw_free(r);
    return FAST_NO;
  }
  *out = r;
  return 0;
}

/* A scanned header's entries into v (taking r), as parse_entries reads them from a document. */
static int raw_entries(dsv4_st_view_t *v, dsv4_st_raw_t *r) {
  const size_t nt = r->nt, nm = r->nm;
  v->strings = r->mem;
  r->mem = NULL;
  if (nm) {
    if (!(v->meta = malloc(nm * sizeof(*v->meta)))) {
      dsv4_st_raw_free(r);
      return DSV4_ENOMEM;
    }
    memcpy(v->meta, r->meta, nm * sizeof(*v->meta));
    v->n_meta = nm;
  }
  int rc = nt && !(v->tensors = calloc(nt, sizeof(*v->tensors))) ? DSV4_ENOMEM : 0;
  for (size_t i = 0; i < nt && !rc; i++) {
    rc = tensor_check(v, &r->raw[i], &v->tensors[i]);
    v->n_tensors += rc == 0;
  }
  dsv4_st_raw_free(r);
  return rc;
}

/* The header text[0..len) of the usual shape into v, as parse_entries reads it from a document;
 * FAST_NO when it is not of that shape (nothing then changed). */
static int fast_entries(dsv4_st_view_t *v, const char *text, size_t len) {
  dsv4_st_raw_t *r;
  int rc = dsv4_st_scan_header(text, len, NULL, &r);
  return rc ? rc : raw_entries(v, r);
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

static int parse(const uint8_t *buf, size_t len, int reference, dsv4_st_view_t *v) {
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

  int rc = reference ? FAST_NO : fast_entries(v, (const char *)buf + PREFIX_BYTES, (size_t)hlen);
  if (rc == FAST_NO) {
    json_error_t jerr;
    v->doc = json_loadb((const char *)buf + PREFIX_BYTES, (size_t)hlen,
                        JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!v->doc)
      return fail(v, "header is not valid JSON: %s (byte %d)", jerr.text, jerr.position);
    if (!json_is_object(v->doc))
      return fail(v, "header is not a JSON object");
    rc = parse_entries(v);
  }
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

static int parse_as(const uint8_t *buf, size_t len, int checkpoint, int reference,
                    dsv4_st_view_t *out) {
  memset(out, 0, sizeof(*out));
  out->checkpoint = checkpoint;
  int rc = parse(buf, len, reference, out);
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
/* A region's tensors: each on a multiple of its element size, no two sharing a byte. */
static int region_checks(dsv4_st_view_t *v) {
  int rc = 0;
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

/* A region's header: every tensor inside the region, on a multiple of its element size, and no
 * two tensors sharing a byte; gaps are allowed. From the document header, or (header NULL) from
 * the scanned raw (taken). */
static int parse_region(json_t *header, dsv4_st_raw_t *raw, const uint8_t *base, size_t size,
                        dsv4_st_view_t *v) {
  if (header && !json_is_object(header))
    return fail(v, "header is not a JSON object");
  v->doc = header ? json_incref(header) : NULL;
  v->region = 1;
  v->data = base;
  v->data_len = size;
  int rc = header ? parse_entries(v) : raw_entries(v, raw);
  return rc ? rc : region_checks(v);
}

static int view_region(json_t *header, dsv4_st_raw_t *raw, const uint8_t *base, size_t size,
                       dsv4_st_view_t *out) {
  memset(out, 0, sizeof(*out));
  int rc = parse_region(header, raw, base, size, out);
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

int dsv4_st_view_region(json_t *header, const uint8_t *base, size_t size, dsv4_st_view_t *out) {
  if (!header) {
    memset(out, 0, sizeof(*out));
    return fail(out, "header is not a JSON object");
  }
  return view_region(header, NULL, base, size, out);
}

int dsv4_st_view_region_raw(dsv4_st_raw_t *raw, const uint8_t *base, size_t size,
                            dsv4_st_view_t *out) {
  return view_region(NULL, raw, base, size, out);
}

int dsv4_st_parse(const uint8_t *buf, size_t len, dsv4_st_view_t *out) {
  return parse_as(buf, len, 0, 0, out);
}

int dsv4__st_parse_reference(const uint8_t *buf, size_t len, dsv4_st_view_t *out) {
  return parse_as(buf, len, 0, 1, out);
}

int dsv4_st_parse_checkpoint(const uint8_t *buf, size_t len, dsv4_st_view_t *out) {
  return parse_as(buf, len, 1, 0, out);
}

void dsv4_st_view_free(dsv4_st_view_t *v) {
  free(v->tensors);
  free(v->meta);
  free(v->strings);
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

/* A tensor the writer lays out at pos: a name that is not "__metadata__", a dtype of the six, its
 * shape's bytes its nbytes, ending (*end) within int64. 0, or why not (DSV4_EINVAL, DSV4_ERANGE).
 */
static int desc_check(const dsv4_st_desc_t *t, size_t pos, size_t *end) {
  size_t numel, nbytes;
  if (!t->name || strcmp(t->name, "__metadata__") == 0 || dsv4_st_dtype_size(t->dtype) == 0 ||
      t->ndim < 0 || t->ndim > DSV4_ST_MAX_DIMS)
    return DSV4_EINVAL;
  int rc = shape_bytes(t->shape, t->ndim, dsv4_st_dtype_size(t->dtype), &numel, &nbytes);
  if (rc != 0)
    return rc;
  if (nbytes != t->nbytes || __builtin_add_overflow(pos, nbytes, end) || *end > (size_t)INT64_MAX)
    return DSV4_EINVAL;
  return 0;
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
    size_t end;
    if (t->name && json_object_get(doc, t->name))
      return DSV4_EINVAL;
    int rc = desc_check(t, pos, &end);
    if (rc != 0)
      return rc;
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

/* The 8-byte prefix, then text padded with spaces (JSON white space) so that the data section
 * starts on an 8-byte boundary. Takes text (malloc'd). */
static int frame_header(char *text, size_t tlen, uint8_t **out, size_t *out_len) {
  size_t hlen = (tlen + DATA_ALIGN - 1) & ~(size_t)(DATA_ALIGN - 1);
  uint8_t *buf = hlen > DSV4_ST_MAX_HEADER ? NULL : malloc(PREFIX_BYTES + hlen);
  if (!buf) {
    free(text);
    return hlen > DSV4_ST_MAX_HEADER ? DSV4_ETOOBIG : DSV4_ENOMEM;
  }
  for (int i = 0; i < PREFIX_BYTES; i++)
    buf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
  memcpy(buf + PREFIX_BYTES, text, tlen);
  memset(buf + PREFIX_BYTES + tlen, ' ', hlen - tlen);
  free(text);
  *out = buf;
  *out_len = PREFIX_BYTES + hlen;
  return 0;
}

int dsv4__st_build_header_reference(const dsv4_st_desc_t *tensors, size_t n_tensors,
                                    const dsv4_st_meta_t *meta, size_t n_meta, uint8_t **out,
                                    size_t *out_len, size_t *data_len) {
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
  if (rc == 0)
    rc = frame_header(text, strlen(text), out, out_len);
  if (rc == 0)
    *data_len = dlen;
  return rc;
}

/* Whether jansson writes s as itself between quotes: printable ASCII, no quote, no backslash. */
static int plain(const char *s) {
  for (; *s; s++)
    if (*s < 0x20 || *s > 0x7e || *s == '"' || *s == '\\')
      return 0;
  return 1;
}

/* Whether build_doc takes these and writes them as they are: no name repeated, every tensor
 * valid (desc_check), every string plain; 0 sends the call to the document. */
static int direct_ok(const dsv4_st_desc_t *t, size_t n, const dsv4_st_meta_t *m, size_t nm) {
  size_t pos = 0;
  for (size_t i = 0; i < nm; i++) {
    if (!m[i].key || !m[i].value || !plain(m[i].key) || !plain(m[i].value))
      return 0;
    for (size_t k = 0; k < i; k++)
      if (!strcmp(m[k].key, m[i].key))
        return 0;
  }
  for (size_t i = 0; i < n; i++) {
    if (desc_check(&t[i], pos, &pos) || !plain(t[i].name))
      return 0;
    for (size_t k = 0; k < i; k++)
      if (!strcmp(t[k].name, t[i].name))
        return 0;
  }
  return 1;
}

void dsv4_st_put_entry(FILE *x, const char *name, int dtype, int ndim, const int64_t *shape,
                       size_t begin, size_t end) {
  fprintf(x, "\"%s\":{\"dtype\":\"%s\",\"shape\":[", name, dsv4_st_dtype_name(dtype));
  for (int d = 0; d < ndim; d++)
    fprintf(x, "%s%lld", d ? "," : "", (long long)shape[d]);
  fprintf(x, "],\"data_offsets\":[%zu,%zu]}", begin, end);
}

/*
 * The header of plain names and values written directly, as jansson's compact dump of build_doc's
 * document would write it (a response's header otherwise costs a document built and dumped);
 * FAST_NO for anything else, which the document then answers.
 */
static int build_direct(const dsv4_st_desc_t *t, size_t n, const dsv4_st_meta_t *m, size_t nm,
                        uint8_t **out, size_t *out_len, size_t *data_len) {
  if (!direct_ok(t, n, m, nm))
    return FAST_NO;
  char *text = NULL;
  size_t len = 0, pos = 0;
  FILE *x = open_memstream(&text, &len);
  if (!x)
    return DSV4_ENOMEM;
  fputc('{', x);
  if (nm) {
    fputs("\"__metadata__\":{", x);
    for (size_t i = 0; i < nm; i++)
      fprintf(x, "%s\"%s\":\"%s\"", i ? "," : "", m[i].key, m[i].value);
    fputc('}', x);
  }
  for (size_t i = 0; i < n; i++) {
    if (i || nm)
      fputc(',', x);
    dsv4_st_put_entry(x, t[i].name, t[i].dtype, t[i].ndim, t[i].shape, pos, pos + t[i].nbytes);
    pos += t[i].nbytes;
  }
  fputc('}', x);
  if (fclose(x) != 0) {
    free(text);
    return DSV4_ENOMEM;
  }
  int rc = frame_header(text, len, out, out_len);
  if (rc == 0)
    *data_len = pos;
  return rc;
}

int dsv4_st_build_header(const dsv4_st_desc_t *tensors, size_t n_tensors,
                         const dsv4_st_meta_t *meta, size_t n_meta, uint8_t **out, size_t *out_len,
                         size_t *data_len) {
  int rc = build_direct(tensors, n_tensors, meta, n_meta, out, out_len, data_len);
  if (rc != FAST_NO)
    return rc;
  return dsv4__st_build_header_reference(tensors, n_tensors, meta, n_meta, out, out_len, data_len);
}
