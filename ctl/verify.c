#include "verify.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include <xxhash.h>

#include "args.h"
#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "records.h"
#include "safetensors.h"

/* A layout number as the metadata spells it: DSV4_STR(DSV4_WINDOW) is "128". */
#define DSV4_STR_(x) #x
#define DSV4_STR(x) DSV4_STR_(x)

/* The prefixes of a dump's tensor names and of its digest keys. */
#define LAYERS_PREFIX "layers."
#define DIGEST_PREFIX "digest."
#define PREFIX_LEN(p) (sizeof(p) - 1)

__attribute__((format(printf, 2, 3))) static int fail(dsv4_ctl_verify_t *v, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(v->error, sizeof(v->error), fmt, ap);
  va_end(ap);
  return DSV4_EINVAL;
}

static void copy_meta(const dsv4_st_view_t *st, const char *key, char *dst, size_t cap) {
  const char *s = dsv4_st_meta(st, key);
  snprintf(dst, cap, "%s", s ? s : "");
}

int dsv4_ctl_is_digest(const char *s) {
  if (strlen(s) != 16)
    return 0;
  for (int i = 0; i < 16; i++)
    if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
      return 0;
  return 1;
}

/* The per-layer tensors of a dump: the SWA records and positions, then the compressed state. */
enum { T_RECORDS, T_POSITIONS, T_C_RECORDS, T_C_ENTRIES, T_I_RECORDS, T_RING, T_KINDS };
static const char *const kind_suffix[T_KINDS] = {".records",   ".positions", ".c_records",
                                                 ".c_entries", ".i_records", ".ring"};

/* "layers.{L}.records", ".positions" or a compressed kind with L a decimal without leading zeros:
 * the layer and the kind (T_*), or -1 for any other name. */
static int tensor_kind(const char *name, uint32_t *layer) {
  if (strncmp(name, LAYERS_PREFIX, PREFIX_LEN(LAYERS_PREFIX)) != 0)
    return -1;
  const char *d = name + PREFIX_LEN(LAYERS_PREFIX), *p = d + strspn(d, "0123456789");
  uint64_t l;
  if ((p - d > 1 && *d == '0') || dsv4_parse_decimal(d, (size_t)(p - d), INT32_MAX, &l) != 0)
    return -1;
  *layer = (uint32_t)l;
  for (int k = 0; k < T_KINDS; k++)
    if (strcmp(p, kind_suffix[k]) == 0)
      return k;
  return -1;
}

/* A metadata key whose value, when present, must be exactly want. */
static int check_fixed(dsv4_ctl_verify_t *v, const dsv4_st_view_t *st, const char *key,
                       const char *want) {
  const char *s = dsv4_st_meta(st, key);
  if (s && strcmp(s, want) != 0)
    return fail(v, "metadata %s is \"%.64s\", a dump has \"%s\"", key, s, want);
  return 0;
}

static int64_t le64(const uint8_t *p) {
  uint64_t x = 0;
  for (int i = (int)sizeof(x) - 1; i >= 0; i--)
    x = (x << 8) | p[i];
  return (int64_t)x;
}

/* Recompute one layer's digest and check its positions (increasing by one from the first, as the
 * stored range of SPEC §3.1 is, and agreeing with positions.{L} when given). */
static int check_layer(const dsv4_st_view_t *st, dsv4_records_digest_t *d,
                       const dsv4_st_tensor_t *rec, const dsv4_st_tensor_t *pos,
                       dsv4_ctl_layer_check_t *c) {
  uint64_t t = (uint64_t)pos->shape[0];
  c->records = t;
  dsv4_records_digest_reset(d);
  for (uint64_t i = 0; i < t; i++) {
    int64_t p = le64(pos->data + sizeof(int64_t) * i);
    if (i == 0)
      c->first = p;
    else if (p != c->last + 1 && !c->problem[0])
      snprintf(c->problem, sizeof(c->problem),
               "positions not consecutive: %lld follows %lld at index %llu", (long long)p,
               (long long)c->last, (unsigned long long)i);
    c->last = p;
    if (p < 0 && !c->problem[0])
      snprintf(c->problem, sizeof(c->problem), "negative position %lld at index %llu", (long long)p,
               (unsigned long long)i);
    dsv4_records_digest_add(d, p, rec->data + (size_t)i * DSV4_RECORD_BYTES);
  }
  dsv4_digest_hex(dsv4_records_digest_value(d), c->computed);

  char key[48];
  snprintf(key, sizeof(key), "positions.%u", c->layer);
  const char *range = dsv4_st_meta(st, key);
  if (range && !c->problem[0]) {
    char want[48] = "";
    if (t > 0)
      snprintf(want, sizeof(want), "%lld-%lld", (long long)c->first, (long long)c->last);
    if (strcmp(range, want) != 0)
      snprintf(c->problem, sizeof(c->problem),
               "metadata %s is \"%.32s\" but the tensor holds \"%s\"", key, range, want);
  }
  c->ok = strcmp(c->expected, c->computed) == 0 && !c->problem[0];
  return 0;
}

/*
 * The metadata "layers": comma-separated runs "a-b" (or "a"), strictly increasing, as the daemon
 * writes them for a served set with gaps ("0-1,3-3"). At most max layers in all. 0 or DSV4_EINVAL.
 */
static int parse_runs(const char *s, size_t max, uint32_t **out, size_t *n_out) {
  uint32_t *v = NULL;
  size_t n = 0;
  int64_t prev = -1;
  const char *p = s;
  for (;;) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char run[32];
    uint32_t a, b;
    if (len == 0 || len >= sizeof(run))
      goto bad;
    memcpy(run, p, len);
    run[len] = '\0';
    if (dsv4_ctl_parse_layers(run, &a, &b) != 0 || (int64_t)a <= prev ||
        (uint64_t)b - a + 1 > max - n)
      goto bad;
    uint32_t *w = realloc(v, (n + ((size_t)b - a + 1)) * sizeof(*v));
    if (!w)
      goto bad;
    v = w;
    for (uint64_t l = a; l <= b; l++)
      v[n++] = (uint32_t)l;
    prev = b;
    if (!comma)
      break;
    p = comma + 1;
  }
  *out = v;
  *n_out = n;
  return 0;
bad:
  free(v);
  return DSV4_EINVAL;
}

/* The index of layer l in the increasing list v[0..n), or -1. */
static long layer_index(const uint32_t *v, size_t n, uint32_t l) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (v[mid] < l)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && v[lo] == l ? (long)lo : -1;
}

/* Verify pass 1: the dump's fixed metadata and its "layers" runs, two tensors per layer. */
static int check_header(dsv4_ctl_verify_t *out, const dsv4_st_view_t *st, uint32_t **layers,
                        size_t *n) {
  const char *layout = dsv4_st_meta(st, "layout");
  const char *range = dsv4_st_meta(st, "layers");
  int rc = 0;
  if (!layout)
    rc = fail(out, "metadata has no \"layout\" (a dump has layout \"" DSV4_RECORD_LAYOUT "\")");
  else if (strcmp(layout, DSV4_RECORD_LAYOUT) != 0)
    rc = fail(out, "metadata layout is \"%.64s\", a dump has \"" DSV4_RECORD_LAYOUT "\"", layout);
  else if ((rc = check_fixed(out, st, "fp8", DSV4_RECORD_FP8)) != 0 ||
           (rc = check_fixed(out, st, "scale", DSV4_RECORD_SCALE)) != 0 ||
           (rc = check_fixed(out, st, "record_bytes", DSV4_RECORD_BYTES_TEXT)) != 0 ||
           (rc = check_fixed(out, st, "window", DSV4_RECORD_WINDOW_TEXT)) != 0)
    ;
  else if (!range)
    rc = fail(out, "metadata has no \"layers\" range");
  else if (parse_runs(range, st->n_tensors / 2 + 1, layers, n) != 0)
    rc = fail(out, "metadata layers \"%.64s\" is not a list of increasing runs a-b", range);
  else if (st->n_tensors < 2 * *n)
    rc = fail(out,
              "metadata layers \"%.64s\" names %zu layers but the file has %zu tensors (two "
              "per layer at least)",
              range, *n, st->n_tensors);
  return rc;
}

/* A compressed tensor's dtype and shape: U8 [T, 584], I64 [T], U8 [T, 68], F32 [floats]. */
static int ctensor_ok(const dsv4_st_tensor_t *t, int kind) {
  switch (kind) {
  case T_C_RECORDS:
    return t->dtype == DSV4_ST_U8 && t->ndim == 2 && t->shape[1] == DSV4_RECORD_BYTES;
  case T_I_RECORDS:
    return t->dtype == DSV4_ST_U8 && t->ndim == 2 && t->shape[1] == DSV4_INDEX_RECORD_BYTES;
  case T_C_ENTRIES:
    return t->dtype == DSV4_ST_I64 && t->ndim == 1;
  default:
    return t->dtype == DSV4_ST_F32 && t->ndim == 1;
  }
}

/* Verify pass 2: each tensor a layer's records (rec[x]), positions (pos[x]) or compressed state
 * (ct[x * 4 + kind - T_C_RECORDS]); digest keys named. */
static int sort_tensors(dsv4_ctl_verify_t *out, const dsv4_st_view_t *st, const uint32_t *layers,
                        size_t n, const dsv4_st_tensor_t **rec, const dsv4_st_tensor_t **pos,
                        const dsv4_st_tensor_t **ct) {
  const char *range = dsv4_st_meta(st, "layers");
  for (size_t i = 0; i < st->n_tensors; i++) {
    const dsv4_st_tensor_t *t = &st->tensors[i];
    uint32_t l;
    int kind = tensor_kind(t->name, &l);
    if (kind < 0)
      return fail(out,
                  "tensor \"%.64s\" is not layers.{L}.records, layers.{L}.positions or a "
                  "compressed layer's c_records, c_entries, i_records or ring",
                  t->name);
    long x = layer_index(layers, n, l);
    if (x < 0)
      return fail(out, "tensor \"%.64s\" is outside the layers %s of the metadata", t->name, range);
    if (kind >= T_C_RECORDS) {
      if (!ctensor_ok(t, kind))
        return fail(out, "tensor \"%.64s\" has the wrong dtype or shape", t->name);
      ct[(size_t)x * 4 + (size_t)(kind - T_C_RECORDS)] = t;
    } else if (kind == 0) {
      if (t->dtype != DSV4_ST_U8 || t->ndim != 2 || t->shape[1] != DSV4_RECORD_BYTES)
        return fail(out, "tensor \"%.64s\" must be U8 [T, %d]", t->name, DSV4_RECORD_BYTES);
      rec[x] = t;
    } else {
      if (t->dtype != DSV4_ST_I64 || t->ndim != 1)
        return fail(out, "tensor \"%.64s\" must be I64 [T]", t->name);
      pos[x] = t;
    }
  }
  for (size_t i = 0; i < st->n_meta; i++) {
    const char *k = st->meta[i].key;
    if (strncmp(k, DIGEST_PREFIX, PREFIX_LEN(DIGEST_PREFIX)) == 0) {
      char name[64];
      uint32_t l;
      snprintf(name, sizeof(name), LAYERS_PREFIX "%.40s.records", k + PREFIX_LEN(DIGEST_PREFIX));
      if (tensor_kind(name, &l) != 0 || layer_index(layers, n, l) < 0)
        return fail(out, "metadata %.64s names no layer of the range %s", k, range);
    }
  }
  return 0;
}

/* A digest key "{what}.{L}" into dst: "" when absent, else 16 lowercase hex digits. */
static int meta_digest(dsv4_ctl_verify_t *out, const dsv4_st_view_t *st, const char *what,
                       uint32_t layer, char dst[17]) {
  char key[48];
  snprintf(key, sizeof(key), "%s.%u", what, layer);
  const char *v = dsv4_st_meta(st, key);
  if (!v || !dsv4_ctl_is_digest(v))
    return fail(out, "metadata %s is missing or not 16 lowercase hex digits", key);
  memcpy(dst, v, 17);
  return 0;
}

/* Verify pass 4: a layer's compressed state (t: c_records, c_entries, i_records, ring), its
 * entries consecutive and its three digests recomputed. */
static int check_compressed(dsv4_ctl_verify_t *out, const dsv4_st_view_t *st,
                            const dsv4_st_tensor_t *const *t, dsv4_records_digest_t *d,
                            dsv4_ctl_layer_check_t *c) {
  if (!t[0] && !t[1] && !t[2] && !t[3])
    return 0;
  if (!t[0] || !t[1] || !t[3])
    return fail(out, "layer %u has compressed state without all of c_records, c_entries and ring",
                c->layer);
  uint64_t n = (uint64_t)t[0]->shape[0];
  if ((uint64_t)t[1]->shape[0] != n || (t[2] && (uint64_t)t[2]->shape[0] != n))
    return fail(out, "layer %u: c_records, c_entries and i_records differ in length", c->layer);
  c->compressed = 1;
  c->has_index = t[2] != NULL;
  c->entries = n;
  int rc = meta_digest(out, st, "c_digest", c->layer, c->c_expected);
  if (!rc && c->has_index)
    rc = meta_digest(out, st, "i_digest", c->layer, c->i_expected);
  if (!rc)
    rc = meta_digest(out, st, "ring_digest", c->layer, c->ring_expected);
  if (rc)
    return rc;
  for (int pass = 0; pass < (c->has_index ? 2 : 1); pass++) {
    dsv4_records_digest_reset(d);
    for (uint64_t i = 0; i < n; i++) {
      int64_t j = le64(t[1]->data + 8 * i);
      if (i == 0)
        c->j0 = j;
      if (j != c->j0 + (int64_t)i && !c->problem[0])
        snprintf(c->problem, sizeof(c->problem), "entries not consecutive at index %llu",
                 (unsigned long long)i);
      if (pass == 0)
        dsv4_records_digest_add(d, j, t[0]->data + (size_t)i * DSV4_RECORD_BYTES);
      else
        dsv4_records_digest_add_index(d, j, t[2]->data + (size_t)i * DSV4_INDEX_RECORD_BYTES);
    }
    dsv4_digest_hex(dsv4_records_digest_value(d), pass == 0 ? c->c_computed : c->i_computed);
  }
  dsv4_digest_hex(XXH3_64bits(t[3]->data, t[3]->nbytes), c->ring_computed);
  c->ok = c->ok && strcmp(c->c_expected, c->c_computed) == 0 &&
          strcmp(c->i_expected, c->i_computed) == 0 &&
          strcmp(c->ring_expected, c->ring_computed) == 0 && !c->problem[0];
  return 0;
}

/* Verify pass 3: each layer's two tensors agree in length and its digest.{L} is recomputed. */
static int check_layers(dsv4_ctl_verify_t *out, const dsv4_st_view_t *st, const uint32_t *layers,
                        size_t n, const dsv4_st_tensor_t **rec, const dsv4_st_tensor_t **pos,
                        const dsv4_st_tensor_t **ct, dsv4_records_digest_t *d) {
  for (size_t i = 0; i < n; i++) {
    dsv4_ctl_layer_check_t *c = &out->layers[i];
    c->layer = layers[i];
    if (!rec[i] || !pos[i])
      return fail(out, "layer %u has no layers.%u.%s tensor", c->layer, c->layer,
                  rec[i] ? "positions" : "records");
    if (rec[i]->shape[0] != pos[i]->shape[0])
      return fail(out, "layer %u has %lld records but %lld positions", c->layer,
                  (long long)rec[i]->shape[0], (long long)pos[i]->shape[0]);
    char key[32];
    snprintf(key, sizeof(key), "digest.%u", c->layer);
    const char *want = dsv4_st_meta(st, key);
    if (!want)
      return fail(out, "metadata has no %s", key);
    if (!dsv4_ctl_is_digest(want))
      return fail(out, "metadata %s \"%.64s\" is not 16 lowercase hex digits", key, want);
    memcpy(c->expected, want, 17);
    check_layer(st, d, rec[i], pos[i], c);
    out->n_layers++;
    int rc = check_compressed(out, st, ct + 4 * i, d, c);
    if (rc)
      return rc;
  }
  return 0;
}

int dsv4_ctl_verify_buffer(const uint8_t *buf, size_t len, dsv4_ctl_verify_t *out) {
  memset(out, 0, sizeof(*out));
  out->file_bytes = len;
  dsv4_st_view_t st;
  int rc = dsv4_st_parse(buf, len, &st);
  if (rc != 0) {
    if (rc == DSV4_ENOMEM)
      return fail(out, "out of memory reading the header");
    return fail(out, "not a safetensors file: %s", st.error);
  }
  copy_meta(&st, "seq", out->seq, sizeof(out->seq));
  copy_meta(&st, "p0", out->p0, sizeof(out->p0));
  copy_meta(&st, "instance", out->instance, sizeof(out->instance));
  copy_meta(&st, "version", out->version, sizeof(out->version));

  const dsv4_st_tensor_t **rec = NULL, **pos = NULL, **ct = NULL;
  dsv4_records_digest_t *d = NULL;
  uint32_t *layers = NULL;
  size_t n = 0;
  rc = check_header(out, &st, &layers, &n);
  if (rc != 0)
    goto done;
  rec = calloc(n, sizeof(*rec));
  pos = calloc(n, sizeof(*pos));
  ct = calloc(4 * n, sizeof(*ct));
  out->layers = calloc(n, sizeof(*out->layers));
  if (!rec || !pos || !ct || !out->layers) {
    rc = fail(out, "out of memory");
    goto done;
  }
  rc = sort_tensors(out, &st, layers, n, rec, pos, ct);
  if (rc != 0)
    goto done;
  rc = dsv4_records_digest_create(&d);
  if (rc != 0) {
    rc = fail(out, "out of memory");
    goto done;
  }
  rc = check_layers(out, &st, layers, n, rec, pos, ct, d);

done:
  if (d)
    dsv4_records_digest_destroy(d);
  free(rec);
  free(pos);
  free(ct);
  free(layers);
  dsv4_st_view_free(&st);
  return rc;
}

int dsv4_ctl_verify_file(const char *path, dsv4_ctl_verify_t *out) {
  memset(out, 0, sizeof(*out));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    snprintf(out->error, sizeof(out->error), "%s: %s", path, strerror(errno));
    return DSV4_EIO;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    snprintf(out->error, sizeof(out->error), "%s: not a regular file", path);
    close(fd);
    return DSV4_EIO;
  }
  size_t len = (size_t)sb.st_size;
  const uint8_t *buf = (const uint8_t *)"";
  void *map = NULL;
  if (len > 0) {
    map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      snprintf(out->error, sizeof(out->error), "%s: mmap: %s", path, strerror(errno));
      close(fd);
      return DSV4_EIO;
    }
    buf = map;
  }
  close(fd);
  int rc = dsv4_ctl_verify_buffer(buf, len, out);
  if (map)
    munmap(map, len);
  return rc;
}

void dsv4_ctl_verify_free(dsv4_ctl_verify_t *v) {
  free(v->layers);
  v->layers = NULL;
  v->n_layers = 0;
}

int dsv4_ctl_verify_all_ok(const dsv4_ctl_verify_t *v) {
  for (size_t i = 0; i < v->n_layers; i++)
    if (!v->layers[i].ok)
      return 0;
  return 1;
}

/* {"entries", "first", "c_digest": {"expected", "computed"}, "i_digest"?, "ring_digest"}. */
static json_t *compressed_json(const dsv4_ctl_layer_check_t *c) {
  json_t *o = json_pack("{s:I, s:o, s:{s:s, s:s}, s:{s:s, s:s}}", "entries", (json_int_t)c->entries,
                        "first", c->entries ? json_integer(c->j0) : json_null(), "c_digest",
                        "expected", c->c_expected, "computed", c->c_computed, "ring_digest",
                        "expected", c->ring_expected, "computed", c->ring_computed);
  if (o && c->has_index)
    json_object_set_new(
        o, "i_digest",
        json_pack("{s:s, s:s}", "expected", c->i_expected, "computed", c->i_computed));
  return o;
}

/* The compressed state's line under its layer in the table. */
static void print_compressed(FILE *out, const dsv4_ctl_layer_check_t *c) {
  fprintf(out, "       entries %llu from %lld: c_digest %s/%s%s%s%s%s ring_digest %s/%s\n",
          (unsigned long long)c->entries, (long long)c->j0, c->c_expected, c->c_computed,
          c->has_index ? " i_digest " : "", c->has_index ? c->i_expected : "",
          c->has_index ? "/" : "", c->has_index ? c->i_computed : "", c->ring_expected,
          c->ring_computed);
}

void dsv4_ctl_verify_print(FILE *out, const char *path, const dsv4_ctl_verify_t *v, int json) {
  if (json) {
    json_t *doc = json_object();
    json_t *layers = json_array();
    for (size_t i = 0; i < v->n_layers; i++) {
      const dsv4_ctl_layer_check_t *c = &v->layers[i];
      json_t *l = json_pack("{s:I, s:I, s:o, s:o, s:s, s:s, s:b}", "layer", (json_int_t)c->layer,
                            "records", (json_int_t)c->records, "first",
                            c->records ? json_integer(c->first) : json_null(), "last",
                            c->records ? json_integer(c->last) : json_null(), "expected",
                            c->expected, "computed", c->computed, "ok", c->ok);
      if (c->problem[0])
        json_object_set_new(l, "problem", json_string(c->problem));
      if (c->compressed)
        json_object_set_new(l, "compressed", compressed_json(c));
      json_array_append_new(layers, l);
    }
    json_object_set_new(doc, "file", json_string(path));
    json_object_set_new(doc, "ok", json_boolean(dsv4_ctl_verify_all_ok(v)));
    json_object_set_new(doc, "bytes", json_integer((json_int_t)v->file_bytes));
    json_object_set_new(doc, "seq", json_string(v->seq));
    json_object_set_new(doc, "p0", json_string(v->p0));
    json_object_set_new(doc, "instance", json_string(v->instance));
    json_object_set_new(doc, "layers", layers);
    json_dumpf(doc, out, JSON_COMPACT);
    fputc('\n', out);
    json_decref(doc);
    return;
  }
  fprintf(out, "%s: %llu bytes, seq %s, p0 %s, instance %s\n", path,
          (unsigned long long)v->file_bytes, v->seq[0] ? v->seq : "-", v->p0[0] ? v->p0 : "-",
          v->instance[0] ? v->instance : "-");
  fprintf(out, "%-5s  %7s  %-17s  %-16s  %-16s  %s\n", "LAYER", "RECORDS", "POSITIONS", "EXPECTED",
          "COMPUTED", "OK");
  size_t bad = 0;
  for (size_t i = 0; i < v->n_layers; i++) {
    const dsv4_ctl_layer_check_t *c = &v->layers[i];
    char range[48] = "-";
    if (c->records)
      snprintf(range, sizeof(range), "%lld-%lld", (long long)c->first, (long long)c->last);
    const char *verdict = c->ok ? "ok" : strcmp(c->expected, c->computed) != 0 ? "MISMATCH" : "BAD";
    fprintf(out, "%-5u  %7llu  %-17s  %-16s  %-16s  %s", c->layer, (unsigned long long)c->records,
            range, c->expected, c->computed, verdict);
    if (c->problem[0])
      fprintf(out, " (%s)", c->problem);
    fputc('\n', out);
    if (c->compressed)
      print_compressed(out, c);
    bad += !c->ok;
  }
  if (bad)
    fprintf(out, "%zu of %zu layers do not match\n", bad, v->n_layers);
  else
    fprintf(out, "all %zu layers match\n", v->n_layers);
}
