#include "fmt.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decimal.h"
#include "dsv4-layout.h"

void dsv4_ctl_table_init(dsv4_ctl_table_t *t, size_t ncols, const char *const *heads,
                         unsigned right) {
  memset(t, 0, sizeof(*t));
  t->ncols = ncols < DSV4_CTL_TABLE_MAX_COLS ? ncols : DSV4_CTL_TABLE_MAX_COLS;
  for (size_t c = 0; c < t->ncols; c++)
    t->heads[c] = heads[c];
  t->right = right;
}

void dsv4_ctl_table_add(dsv4_ctl_table_t *t, const char *const *cells) {
  if (t->oom)
    return;
  if (t->nrows == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 16;
    char **c = realloc(t->cells, cap * t->ncols * sizeof(*c));
    if (!c) {
      t->oom = 1;
      return;
    }
    t->cells = c;
    t->cap = cap;
  }
  char **row = t->cells + t->nrows * t->ncols;
  for (size_t c = 0; c < t->ncols; c++) {
    row[c] = strdup(cells[c] ? cells[c] : "-");
    if (!row[c]) {
      for (size_t k = 0; k < c; k++)
        free(row[k]);
      t->oom = 1;
      return;
    }
  }
  t->nrows++;
}

static void print_row(const dsv4_ctl_table_t *t, FILE *out, const char *const *cells,
                      const size_t *w) {
  for (size_t c = 0; c < t->ncols; c++) {
    int last = c + 1 == t->ncols;
    int right = (t->right >> c) & 1;
    if (c > 0)
      fputs("  ", out);
    if (right)
      fprintf(out, "%*s", (int)w[c], cells[c]);
    else if (last)
      fputs(cells[c], out);
    else
      fprintf(out, "%-*s", (int)w[c], cells[c]);
  }
  fputc('\n', out);
}

void dsv4_ctl_table_print(dsv4_ctl_table_t *t, FILE *out) {
  size_t w[DSV4_CTL_TABLE_MAX_COLS];
  for (size_t c = 0; c < t->ncols; c++)
    w[c] = strlen(t->heads[c]);
  for (size_t r = 0; r < t->nrows; r++)
    for (size_t c = 0; c < t->ncols; c++) {
      size_t n = strlen(t->cells[r * t->ncols + c]);
      if (n > w[c])
        w[c] = n;
    }
  print_row(t, out, t->heads, w);
  for (size_t r = 0; r < t->nrows; r++)
    print_row(t, out, (const char *const *)(t->cells + r * t->ncols), w);
  if (t->oom)
    fputs("(out of memory: rows missing)\n", out);
  dsv4_ctl_table_free(t);
}

void dsv4_ctl_table_free(dsv4_ctl_table_t *t) {
  for (size_t i = 0; i < t->nrows * t->ncols; i++)
    free(t->cells[i]);
  free(t->cells);
  t->cells = NULL;
  t->nrows = t->cap = 0;
}

void dsv4_ctl_format_value(const json_t *v, char *out, size_t cap) {
  if (json_is_string(v))
    snprintf(out, cap, "%s", json_string_value(v));
  else if (json_is_integer(v))
    snprintf(out, cap, "%lld", (long long)json_integer_value(v));
  else if (json_is_real(v))
    snprintf(out, cap, "%.9g", json_real_value(v));
  else if (json_is_true(v))
    snprintf(out, cap, "true");
  else if (json_is_false(v))
    snprintf(out, cap, "false");
  else
    snprintf(out, cap, "-");
}

/* Append with truncation: the views are for people, and a cut line beats a failed command. */
static void append(char *out, size_t cap, size_t *len, const char *s) {
  size_t n = strlen(s);
  if (*len + n >= cap)
    n = *len < cap - 1 ? cap - 1 - *len : 0;
  memcpy(out + *len, s, n);
  *len += n;
  out[*len] = '\0';
}

void dsv4_ctl_format_layers(const json_t *list, char *out, size_t cap) {
  size_t len = 0, n = json_array_size(list);
  out[0] = '\0';
  if (!json_is_array(list) || n == 0) {
    snprintf(out, cap, "-");
    return;
  }
  for (size_t i = 0; i < n;) {
    long long a = json_integer_value(json_array_get(list, i)), b = a;
    size_t j = i + 1;
    while (j < n && json_integer_value(json_array_get(list, j)) == b + 1) {
      b++;
      j++;
    }
    char piece[48];
    if (a == b)
      snprintf(piece, sizeof(piece), "%s%lld", i ? "," : "", a);
    else
      snprintf(piece, sizeof(piece), "%s%lld-%lld", i ? "," : "", a, b);
    append(out, cap, &len, piece);
    i = j;
  }
}

/* The keys of an object keyed by decimal numbers (layers, blocks), in numeric order; other keys
 * follow in their own order. Returns a malloc'd array of n keys (NULL when empty). */
typedef struct {
  const char *key;
  long long num;
  int numeric;
} key_t_;

static int cmp_keys(const void *x, const void *y) {
  const key_t_ *a = x, *b = y;
  if (a->numeric != b->numeric)
    return a->numeric ? -1 : 1;
  if (a->numeric)
    return a->num < b->num ? -1 : a->num > b->num;
  return strcmp(a->key, b->key);
}

static key_t_ *sorted_keys(const json_t *obj, size_t *n) {
  *n = json_object_size(obj);
  if (!json_is_object(obj) || *n == 0) {
    *n = 0;
    return NULL;
  }
  key_t_ *k = calloc(*n, sizeof(*k));
  if (!k) {
    *n = 0;
    return NULL;
  }
  size_t i = 0;
  const char *key;
  json_t *val;
  json_object_foreach((json_t *)obj, key, val) {
    uint64_t num = 0;
    k[i].key = key;
    k[i].numeric = dsv4_parse_decimal(key, strlen(key), INT64_MAX, &num) == 0;
    k[i].num = (long long)num;
    i++;
  }
  qsort(k, *n, sizeof(*k), cmp_keys);
  return k;
}

/* A per-layer object as "0-1:70 2-3:64": runs of consecutive layers with the same value. */
static void format_by_layer(const json_t *obj, char *out, size_t cap) {
  size_t n, len = 0;
  key_t_ *k = sorted_keys(obj, &n);
  out[0] = '\0';
  if (n == 0)
    snprintf(out, cap, "-");
  for (size_t i = 0; i < n;) {
    char v[64], w[64];
    dsv4_ctl_format_value(json_object_get(obj, k[i].key), v, sizeof(v));
    size_t j = i + 1;
    while (j < n && k[j].numeric && k[j].num == k[j - 1].num + 1) {
      dsv4_ctl_format_value(json_object_get(obj, k[j].key), w, sizeof(w));
      if (strcmp(v, w) != 0)
        break;
      j++;
    }
    char piece[160];
    if (j - i == 1)
      snprintf(piece, sizeof(piece), "%s%s:%s", i ? " " : "", k[i].key, v);
    else
      snprintf(piece, sizeof(piece), "%s%s-%s:%s", i ? " " : "", k[i].key, k[j - 1].key, v);
    append(out, cap, &len, piece);
    i = j;
  }
  free(k);
}

static const char *field(const json_t *doc, const char *key, char *buf, size_t cap) {
  dsv4_ctl_format_value(json_object_get(doc, key), buf, cap);
  return buf;
}

static void kv(FILE *out, const char *key, const char *value) {
  fprintf(out, "%-16s %s\n", key, value);
}

void dsv4_ctl_print_cache(FILE *out, const json_t *doc) {
  char a[128], b[128], c[128], line[512];
  kv(out, "instance", field(doc, "instance", a, sizeof(a)));
  snprintf(line, sizeof(line), "%s (backend %s)", field(doc, "version", a, sizeof(a)),
           field(doc, "backend", b, sizeof(b)));
  kv(out, "version", line);
  char fp8[64], scale[64], rb[32];
  snprintf(line, sizeof(line), "%s (NoPE %s, scales %s, %s-byte records)",
           field(doc, "layout", a, sizeof(a)), field(doc, "fp8", fp8, sizeof(fp8)),
           field(doc, "scale", scale, sizeof(scale)), field(doc, "record_bytes", rb, sizeof(rb)));
  kv(out, "layout", line);
  snprintf(line, sizeof(line), "%s tokens, stride %s bytes, window %s",
           field(doc, "block_size", a, sizeof(a)), field(doc, "stride", b, sizeof(b)),
           field(doc, "window", c, sizeof(c)));
  kv(out, "block_size", line);
  kv(out, "heads", field(doc, "heads", a, sizeof(a)));
  const json_t *served = json_object_get(doc, "served_layers");
  dsv4_ctl_format_layers(served, a, sizeof(a));
  snprintf(line, sizeof(line), "%s (%zu served)", a, json_array_size(served));
  kv(out, "layers", line);
  char used[32], freeb[32], total[32];
  const json_t *ratio = json_object_get(doc, "usage_ratio");
  snprintf(line, sizeof(line), "%s used, %s free of %s (%.2f %%)",
           field(doc, "blocks_used", used, sizeof(used)),
           field(doc, "blocks_free", freeb, sizeof(freeb)),
           field(doc, "kv_blocks", total, sizeof(total)),
           json_is_number(ratio) ? 100.0 * json_number_value(ratio) : 0.0);
  kv(out, "blocks", line);
  const json_t *cb = json_object_get(doc, "cache_bytes");
  if (json_is_integer(cb))
    snprintf(line, sizeof(line), "%lld (%.1f MiB)", (long long)json_integer_value(cb),
             (double)json_integer_value(cb) / (1024.0 * 1024.0));
  else
    snprintf(line, sizeof(line), "-");
  kv(out, "cache_bytes", line);
  kv(out, "sequences", field(doc, "sequences", a, sizeof(a)));

  const json_t *pd = json_object_get(doc, "pool_digests");
  size_t n;
  key_t_ *k = sorted_keys(pd, &n);
  if (n > 0) {
    static const char *const heads[] = {"LAYER", "POOL_DIGEST"};
    dsv4_ctl_table_t t;
    dsv4_ctl_table_init(&t, 2, heads, 1u);
    for (size_t i = 0; i < n; i++) {
      const char *row[2] = {k[i].key, field(pd, k[i].key, a, sizeof(a))};
      dsv4_ctl_table_add(&t, row);
    }
    fputc('\n', out);
    dsv4_ctl_table_print(&t, out);
  }
  free(k);
}

void dsv4_ctl_print_sequences(FILE *out, const json_t *doc) {
  static const char *const heads[] = {"SEQ", "P0", "BLOCKS", "IDLE_MS", "NEXT"};
  dsv4_ctl_table_t t;
  dsv4_ctl_table_init(&t, 5, heads, 0xEu);
  const json_t *list = json_object_get(doc, "sequences");
  size_t i;
  const json_t *s;
  json_array_foreach((json_t *)list, i, s) {
    char name[160], p0[32], blocks[32], idle[32], next[1024];
    format_by_layer(json_object_get(s, "next"), next, sizeof(next));
    const char *row[5] = {field(s, "seq", name, sizeof(name)), field(s, "p0", p0, sizeof(p0)),
                          field(s, "blocks", blocks, sizeof(blocks)),
                          field(s, "idle_ms", idle, sizeof(idle)), next};
    dsv4_ctl_table_add(&t, row);
  }
  dsv4_ctl_table_print(&t, out);
  char c[32];
  fprintf(out, "%s sequence(s)\n", field(doc, "count", c, sizeof(c)));
}

void dsv4_ctl_print_sequence(FILE *out, const json_t *doc) {
  char a[160];
  kv(out, "seq", field(doc, "seq", a, sizeof(a)));
  kv(out, "instance", field(doc, "instance", a, sizeof(a)));
  kv(out, "p0", field(doc, "p0", a, sizeof(a)));
  kv(out, "blocks", field(doc, "blocks", a, sizeof(a)));
  kv(out, "release_held_by", field(doc, "release_held_by", a, sizeof(a)));

  /* One row per layer named by any of the per-layer objects. */
  const json_t *next = json_object_get(doc, "next"), *ls = json_object_get(doc, "last_start"),
               *stored = json_object_get(doc, "stored");
  size_t n;
  key_t_ *k = sorted_keys(next, &n);
  static const char *const heads[] = {"LAYER", "NEXT", "LAST_START", "STORED"};
  dsv4_ctl_table_t t;
  dsv4_ctl_table_init(&t, 4, heads, 0x7u);
  for (size_t i = 0; i < n; i++) {
    char nx[32], st[32], range[64] = "-";
    const json_t *r = json_object_get(stored, k[i].key);
    if (json_is_array(r) && json_array_size(r) == 2) {
      char f[32], l[32];
      dsv4_ctl_format_value(json_array_get(r, 0), f, sizeof(f));
      dsv4_ctl_format_value(json_array_get(r, 1), l, sizeof(l));
      snprintf(range, sizeof(range), "%s-%s", f, l);
    }
    const char *row[4] = {k[i].key, field(next, k[i].key, nx, sizeof(nx)),
                          field(ls, k[i].key, st, sizeof(st)), range};
    dsv4_ctl_table_add(&t, row);
  }
  free(k);
  fputc('\n', out);
  dsv4_ctl_table_print(&t, out);

  static const char *const bheads[] = {"LOGICAL", "BLOCK", "FIRST", "LAST"};
  dsv4_ctl_table_init(&t, 4, bheads, 0xFu);
  size_t i;
  const json_t *b;
  json_array_foreach(json_object_get(doc, "block_table"), i, b) {
    char lg[32], bl[32], f[32], l[32];
    const char *row[4] = {field(b, "logical", lg, sizeof(lg)), field(b, "block", bl, sizeof(bl)),
                          field(b, "first", f, sizeof(f)), field(b, "last", l, sizeof(l))};
    dsv4_ctl_table_add(&t, row);
  }
  fputc('\n', out);
  dsv4_ctl_table_print(&t, out);
}

/* Numbers of a JSON array, per per_row on a line with the index of the first. */
static void print_numbers(FILE *out, const json_t *list, size_t first, size_t count, size_t per_row,
                          int hex_width) {
  for (size_t i = first; i < first + count; i += per_row) {
    fprintf(out, "  %4zu:", i);
    for (size_t j = i; j < i + per_row && j < first + count; j++) {
      const json_t *v = json_array_get(list, j);
      if (hex_width && json_is_integer(v)) {
        fprintf(out, " %0*llx", hex_width, (unsigned long long)json_integer_value(v));
      } else {
        char s[48];
        dsv4_ctl_format_value(v, s, sizeof(s));
        fprintf(out, " %15s", s);
      }
    }
    fputc('\n', out);
  }
}

/* A 584-byte record's fields as the tokens and entries routes decode them: the digest, then each
 * NoPE tile with its scale, then the RoPE values. */
static void print_record(FILE *out, const json_t *doc) {
  char s[160];
  kv(out, "record_digest", field(doc, "record_digest", s, sizeof(s)));

  const json_t *codes = json_object_get(doc, "scale_codes"),
               *scales = json_object_get(doc, "scales");
  const json_t *nope = json_object_get(doc, "nope"), *fp8 = json_object_get(doc, "fp8");
  size_t groups = json_array_size(codes);
  for (size_t g = 0; g < groups; g++) {
    char c[32], v[48];
    dsv4_ctl_format_value(json_array_get(codes, g), c, sizeof(c));
    dsv4_ctl_format_value(json_array_get(scales, g), v, sizeof(v));
    size_t first = (size_t)DSV4_TILE * g;
    fprintf(out, "\nNoPE dims %zu-%zu: scale code %s = %s\n", first, first + DSV4_TILE - 1, c, v);
    if (json_array_size(nope) >= first + DSV4_TILE)
      print_numbers(out, nope, first, DSV4_TILE, 8, 0);
    if (json_array_size(fp8) >= first + DSV4_TILE) {
      fprintf(out, "  e4m3 bytes:\n");
      print_numbers(out, fp8, first, DSV4_TILE, 16, 2);
    }
  }
  const json_t *rope = json_object_get(doc, "rope"), *rb = json_object_get(doc, "rope_bf16");
  if (json_array_size(rope) > 0) {
    fprintf(out, "\nRoPE (%zu values):\n", json_array_size(rope));
    print_numbers(out, rope, 0, json_array_size(rope), 8, 0);
  }
  if (json_array_size(rb) > 0) {
    fprintf(out, "  bf16 bits:\n");
    print_numbers(out, rb, 0, json_array_size(rb), 16, 4);
  }
}

void dsv4_ctl_print_token(FILE *out, const json_t *doc) {
  char s[160], l[32], p[32], b[32], o[32], sl[32];
  fprintf(out, "seq %s  layer %s  position %s  block %s  offset %s  slot %s\n",
          field(doc, "seq", s, sizeof(s)), field(doc, "layer", l, sizeof(l)),
          field(doc, "position", p, sizeof(p)), field(doc, "block", b, sizeof(b)),
          field(doc, "offset", o, sizeof(o)), field(doc, "slot", sl, sizeof(sl)));
  print_record(out, doc);
}

void dsv4_ctl_print_entry(FILE *out, const json_t *doc) {
  char s[160], l[32], j[32], r[32], w0[32], w1[32], b[32], o[32], sl[32];
  const json_t *win = json_object_get(doc, "window");
  dsv4_ctl_format_value(json_array_get(win, 0), w0, sizeof(w0));
  dsv4_ctl_format_value(json_array_get(win, 1), w1, sizeof(w1));
  fprintf(out,
          "seq %s  layer %s  entry %s  ratio %s  positions %s-%s  block %s  offset %s  slot %s\n",
          field(doc, "seq", s, sizeof(s)), field(doc, "layer", l, sizeof(l)),
          field(doc, "entry", j, sizeof(j)), field(doc, "ratio", r, sizeof(r)), w0, w1,
          field(doc, "block", b, sizeof(b)), field(doc, "offset", o, sizeof(o)),
          field(doc, "slot", sl, sizeof(sl)));
  print_record(out, doc);
  const json_t *ix = json_object_get(doc, "index");
  if (!json_is_object(ix))
    return;
  const json_t *codes = json_object_get(ix, "scale_codes"), *scales = json_object_get(ix, "scales");
  const json_t *vals = json_object_get(ix, "values"), *nib = json_object_get(ix, "e2m1");
  fprintf(out, "\nindex record (MXFP4)\n");
  kv(out, "record_digest", field(ix, "record_digest", s, sizeof(s)));
  for (size_t g = 0; g < json_array_size(codes); g++) {
    char c[32], v[48];
    const size_t block = 32, first = block * g;
    dsv4_ctl_format_value(json_array_get(codes, g), c, sizeof(c));
    dsv4_ctl_format_value(json_array_get(scales, g), v, sizeof(v));
    fprintf(out, "\ndims %zu-%zu: scale code %s = %s\n", first, first + block - 1, c, v);
    if (json_array_size(vals) >= first + block)
      print_numbers(out, vals, first, block, 8, 0);
    if (json_array_size(nib) >= first + block) {
      fprintf(out, "  e2m1 nibbles:\n");
      print_numbers(out, nib, first, block, 16, 1);
    }
  }
}

void dsv4_ctl_print_checksums(FILE *out, const json_t *doc) {
  char l[32], p[32];
  fprintf(out, "layer %s  pool %s\n", field(doc, "layer", l, sizeof(l)),
          field(doc, "pool", p, sizeof(p)));
  const json_t *blocks = json_object_get(doc, "blocks");
  size_t n;
  key_t_ *k = sorted_keys(blocks, &n);
  static const char *const bheads[] = {"BLOCK", "DIGEST"};
  dsv4_ctl_table_t t;
  dsv4_ctl_table_init(&t, 2, bheads, 1u);
  for (size_t i = 0; i < n; i++) {
    char d[64];
    const char *row[2] = {k[i].key, field(blocks, k[i].key, d, sizeof(d))};
    dsv4_ctl_table_add(&t, row);
  }
  free(k);
  fputc('\n', out);
  dsv4_ctl_table_print(&t, out);

  const json_t *seqs = json_object_get(doc, "sequences");
  static const char *const sheads[] = {"SEQ", "FIRST", "LAST", "RECORDS", "DIGEST"};
  dsv4_ctl_table_init(&t, 5, sheads, 0xEu);
  const char *key;
  json_t *s;
  json_object_foreach((json_t *)seqs, key, s) {
    char f[32], la[32], r[32], d[64];
    const char *row[5] = {key, field(s, "first", f, sizeof(f)), field(s, "last", la, sizeof(la)),
                          field(s, "records", r, sizeof(r)), field(s, "digest", d, sizeof(d))};
    dsv4_ctl_table_add(&t, row);
  }
  fputc('\n', out);
  dsv4_ctl_table_print(&t, out);
}

void dsv4_ctl_format_error(int status, const char *body, size_t len, char *out, size_t cap) {
  json_t *doc = body ? json_loadb(body, len, 0, NULL) : NULL;
  const json_t *e = json_object_get(doc, "error");
  const char *code = json_string_value(json_object_get(e, "code"));
  const char *msg = json_string_value(json_object_get(e, "message"));
  if (code) {
    snprintf(out, cap, "%d %s: %s", status, code, msg ? msg : "(no message)");
  } else {
    /* Not the contract's error: show the start of whatever came, without control characters. */
    char excerpt[121];
    size_t n = 0;
    for (size_t i = 0; body && i < len && n < sizeof(excerpt) - 1; i++)
      excerpt[n++] = (body[i] >= 0x20 && body[i] < 0x7f) ? body[i] : ' ';
    excerpt[n] = '\0';
    snprintf(out, cap, "%d (not a JSON error%s%s)", status, n ? ": " : "", excerpt);
  }
  json_decref(doc);
}
