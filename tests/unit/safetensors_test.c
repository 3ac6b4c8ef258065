/* The strict safetensors parser: one test per way a body can be wrong, and writer round trips. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"
#include "safetensors.h"
#include "st_views.h"

/* A body made of the 8-byte little-endian length of header, the header, then data_len bytes of a
 * recognisable pattern. */
static uint8_t *make(const char *header, size_t data_len, size_t *len) {
  size_t h = strlen(header);
  *len = 8 + h + data_len;
  uint8_t *b = malloc(*len ? *len : 1);
  assert_non_null(b);
  for (int i = 0; i < 8; i++)
    b[i] = (uint8_t)((uint64_t)h >> (8 * i));
  memcpy(b + 8, header, h);
  for (size_t i = 0; i < data_len; i++)
    b[8 + h + i] = (uint8_t)(i * 7 + 1);
  return b;
}

/* Parse and expect a rejection whose message contains want (the tensor's name or the problem). */
static void expect_reject(const char *header, size_t data_len, const char *want) {
  size_t len;
  uint8_t *b = make(header, data_len, &len);
  dsv4_st_view_t v;
  int rc = dsv4_st_parse(b, len, &v);
  if (rc != DSV4_EINVAL || !strstr(v.error, want))
    print_error("header %s: rc %d, error \"%s\", wanted \"%s\"\n", header, rc, v.error, want);
  assert_int_equal(rc, DSV4_EINVAL);
  assert_non_null(strstr(v.error, want));
  assert_null(v.tensors);
  assert_null(v.doc);
  free(b);
}

static void test_valid(void **state) {
  (void)state;
  const char *h = "{\"__metadata__\":{\"layer\":\"3\",\"outputs\":\"q,attn\"},"
                  "\"kv\":{\"dtype\":\"BF16\",\"shape\":[2,4],\"data_offsets\":[24,40]},"
                  "\"q\":{\"dtype\":\"F32\",\"shape\":[3,2],\"data_offsets\":[0,24]},"
                  "\"z\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[40,40]},"
                  "\"s\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[40,41]}}  ";
  size_t len;
  uint8_t *b = make(h, 41, &len);
  dsv4_st_view_t v;
  assert_int_equal(dsv4_st_parse(b, len, &v), 0);
  assert_int_equal(v.n_tensors, 4);
  assert_int_equal(v.n_meta, 2);
  assert_string_equal(dsv4_st_meta(&v, "layer"), "3");
  assert_string_equal(dsv4_st_meta(&v, "outputs"), "q,attn");
  assert_null(dsv4_st_meta(&v, "nope"));
  const dsv4_st_tensor_t *q = dsv4_st_find(&v, "q"), *kv = dsv4_st_find(&v, "kv");
  const dsv4_st_tensor_t *z = dsv4_st_find(&v, "z"), *s = dsv4_st_find(&v, "s");
  assert_non_null(q);
  assert_non_null(kv);
  assert_non_null(z);
  assert_non_null(s);
  assert_null(dsv4_st_find(&v, "__metadata__"));
  assert_int_equal(q->dtype, DSV4_ST_F32);
  assert_int_equal(q->ndim, 2);
  assert_int_equal(q->shape[0], 3);
  assert_int_equal(q->shape[1], 2);
  assert_int_equal(q->numel, 6);
  assert_int_equal(q->nbytes, 24);
  assert_ptr_equal(q->data, b + 8 + strlen(h));
  assert_ptr_equal(kv->data, b + 8 + strlen(h) + 24);
  assert_int_equal(kv->dtype, DSV4_ST_BF16);
  assert_int_equal(z->nbytes, 0);
  assert_int_equal(z->numel, 0);
  assert_int_equal(s->ndim, 0);
  assert_int_equal(s->numel, 1);
  assert_int_equal(s->data[0], (uint8_t)(40 * 7 + 1));
  /* Header order is kept. */
  assert_string_equal(v.tensors[0].name, "kv");
  assert_string_equal(v.tensors[1].name, "q");
  assert_int_equal(v.data_len, 41);
  dsv4_st_view_free(&v);
  free(b);
}

static void test_empty_ok(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = make("{}", 0, &len);
  dsv4_st_view_t v;
  assert_int_equal(dsv4_st_parse(b, len, &v), 0);
  assert_int_equal(v.n_tensors, 0);
  dsv4_st_view_free(&v);
  free(b);
}

static void test_truncated_prefix(void **state) {
  (void)state;
  uint8_t b[7] = {2, 0, 0, 0, 0, 0, 0};
  dsv4_st_view_t v;
  for (size_t n = 0; n < 8; n++) {
    assert_int_equal(dsv4_st_parse(b, n, &v), DSV4_EINVAL);
    assert_non_null(strstr(v.error, "8-byte"));
  }
}

static void test_header_past_end(void **state) {
  (void)state;
  size_t len;
  uint8_t *b = make("{}", 0, &len);
  b[0] = 3; /* claims 3 header bytes, 2 are there */
  dsv4_st_view_t v;
  assert_int_equal(dsv4_st_parse(b, len, &v), DSV4_EINVAL);
  assert_non_null(strstr(v.error, "past the end"));
  /* A length with the top bit set must not wrap around. */
  b[7] = 0x80;
  b[0] = 2;
  assert_int_equal(dsv4_st_parse(b, len, &v), DSV4_EINVAL);
  free(b);
}

static void test_header_too_big(void **state) {
  (void)state;
  size_t hl = DSV4_ST_MAX_HEADER + 8;
  char *h = malloc(hl + 1);
  assert_non_null(h);
  memset(h, ' ', hl);
  h[0] = '{';
  h[1] = '}';
  h[hl] = 0;
  size_t len;
  uint8_t *b = make(h, 0, &len);
  dsv4_st_view_t v;
  assert_int_equal(dsv4_st_parse(b, len, &v), DSV4_EINVAL);
  assert_non_null(strstr(v.error, "limit"));
  /* Exactly at the limit is fine. */
  b[0] = (uint8_t)DSV4_ST_MAX_HEADER;
  b[1] = (uint8_t)(DSV4_ST_MAX_HEADER >> 8);
  b[2] = (uint8_t)(DSV4_ST_MAX_HEADER >> 16);
  assert_int_equal(dsv4_st_parse(b, 8 + DSV4_ST_MAX_HEADER, &v), 0);
  dsv4_st_view_free(&v);
  free(b);
  free(h);
}

static void test_json_shape(void **state) {
  (void)state;
  expect_reject("[1,2]", 0, "not a JSON object");
  expect_reject("\"x\"", 0, "not a JSON object");
  expect_reject("{\"a\":", 0, "not valid JSON");
  expect_reject("{} x", 0, "not valid JSON");
  expect_reject("{\"q\":[1]}", 0, "\"q\": entry is not a JSON object");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, "\"q\": missing data_offsets");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"x\":1}}", 1,
                "unknown field");
  expect_reject("{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                "not valid JSON");
  /* A field cut short, then the same field again: not JSON, whichever reader sees it first. */
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1,,\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                "not valid JSON");
}

static void test_bad_dtype(void **state) {
  (void)state;
  expect_reject("{\"q\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 2,
                "\"q\": unsupported dtype \"F16\"");
  expect_reject("{\"q\":{\"dtype\":\"bf16\",\"shape\":[1],\"data_offsets\":[0,2]}}", 2,
                "unsupported dtype");
  expect_reject("{\"q\":{\"dtype\":3,\"shape\":[1],\"data_offsets\":[0,2]}}", 2,
                "dtype is not a string");
}

static void test_bad_shape(void **state) {
  (void)state;
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0,
                "\"q\": shape[0] = -1 is negative");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[2.0],\"data_offsets\":[0,2]}}", 2,
                "shape[0] is not an integer");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1,\"2\"],\"data_offsets\":[0,2]}}", 2,
                "shape[1] is not an integer");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}", 3,
                "shape is not an array");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}",
                1, "9 dimensions");
}

static void test_size_mismatch(void **state) {
  (void)state;
  expect_reject("{\"q\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,6]}}", 6,
                "\"q\": data_offsets span 6 bytes but shape and dtype BF16 need 12");
  expect_reject("{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[4],\"data_offsets\":[0,8]}}", 8,
                "need 4");
}

static void test_overflow(void **state) {
  (void)state;
  /* 2^32 * 2^32 overflows 64 bits; so does 2^62 * 8 bytes. */
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],"
                "\"data_offsets\":[0,0]}}",
                0, "\"q\": shape product overflows");
  expect_reject("{\"q\":{\"dtype\":\"I64\",\"shape\":[4611686018427387904],"
                "\"data_offsets\":[0,0]}}",
                0, "overflows");
  /* A zero dimension makes the product 0 however large the others are, which is not an overflow. */
  size_t len;
  uint8_t *b = make("{\"q\":{\"dtype\":\"I64\",\"shape\":[0,4611686018427387904],"
                    "\"data_offsets\":[0,0]}}",
                    0, &len);
  dsv4_st_view_t v;
  int rc = dsv4_st_parse(b, len, &v);
  /* 0 * 2^62 is 0 before the second factor, and 0 * 8 cannot overflow. */
  assert_int_equal(rc, 0);
  dsv4_st_view_free(&v);
  free(b);
}

static void test_offsets(void **state) {
  (void)state;
  /* Out of range. */
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", 3,
                "\"q\": data_offsets end 4 is past the data section (3 bytes)");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}", 0,
                "not an increasing range");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,1]}}", 2,
                "not an increasing range");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1,
                "data_offsets is not an array");
  expect_reject("{\"q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.5]}}", 1,
                "not integers");
  /* Overlap. */
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
                6, "\"b\": data [2, 6) overlaps tensor \"a\"");
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
                4, "overlaps");
  /* Gap at the start and in the middle. */
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[1,5]}}", 5,
                "\"a\": data begins at 1, leaving a gap");
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[3,5]}}",
                5, "\"b\": data begins at 3");
  /* Trailing bytes after the last tensor, and data with no tensors. */
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 3,
                "trailing bytes");
  expect_reject("{}", 1, "trailing bytes");
}

static void test_duplicates_and_metadata(void **state) {
  (void)state;
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                2, "duplicate");
  expect_reject("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                1, "duplicate");
  expect_reject("{\"__metadata__\":{\"layer\":3}}", 0,
                "__metadata__ value \"layer\" is not a string");
  expect_reject("{\"__metadata__\":[\"x\"]}", 0, "__metadata__ is not a JSON object");
  expect_reject("{\"__metadata__\":{\"a\":\"x\",\"a\":\"y\"}}", 0, "duplicate");
}

static void roundtrip(const dsv4_st_desc_t *d, size_t n, const dsv4_st_meta_t *m, size_t nm) {
  uint8_t *hdr;
  size_t hlen, dlen;
  assert_int_equal(dsv4_st_build_header(d, n, m, nm, &hdr, &hlen, &dlen), 0);
  assert_int_equal(hlen % 8, 0);
  size_t want = 0;
  for (size_t i = 0; i < n; i++)
    want += d[i].nbytes;
  assert_int_equal(dlen, want);
  uint8_t *body = malloc(hlen + dlen + 1);
  assert_non_null(body);
  memcpy(body, hdr, hlen);
  for (size_t i = 0; i < dlen; i++)
    body[hlen + i] = (uint8_t)(i * 13 + 5);
  dsv4_st_view_t v;
  int rc = dsv4_st_parse(body, hlen + dlen, &v);
  if (rc)
    print_error("%s\n", v.error);
  assert_int_equal(rc, 0);
  assert_int_equal(v.n_tensors, n);
  assert_int_equal(v.n_meta, nm);
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    const dsv4_st_tensor_t *t = dsv4_st_find(&v, d[i].name);
    assert_non_null(t);
    assert_int_equal(t->dtype, d[i].dtype);
    assert_int_equal(t->ndim, d[i].ndim);
    for (int k = 0; k < d[i].ndim; k++)
      assert_int_equal(t->shape[k], d[i].shape[k]);
    assert_int_equal(t->nbytes, d[i].nbytes);
    /* Tensors are laid out back to back in the order given. */
    assert_int_equal(t->offset, off);
    assert_ptr_equal(t->data, body + hlen + off);
    off += d[i].nbytes;
  }
  for (size_t i = 0; i < nm; i++)
    assert_string_equal(dsv4_st_meta(&v, m[i].key), m[i].value);
  dsv4_st_view_free(&v);
  /* One byte more is trailing data and must be refused. */
  assert_int_equal(dsv4_st_parse(body, hlen + dlen + 1, &v), DSV4_EINVAL);
  free(body);
  free(hdr);
}

static void test_writer_roundtrip(void **state) {
  (void)state;
  dsv4_st_desc_t d[] = {
      {"q_out", DSV4_ST_BF16, 3, {5, 64, 512}, 5 * 64 * 512 * 2},
      {"slots", DSV4_ST_I64, 1, {5}, 40},
      {"empty", DSV4_ST_F32, 2, {0, 7}, 0},
      {"layers.3.records", DSV4_ST_U8, 2, {3, 584}, 3 * 584},
      {"x\"quoted\\name", DSV4_ST_F8_E4M3, 1, {3}, 3},
      {"scalar", DSV4_ST_I32, 0, {0}, 4},
  };
  dsv4_st_meta_t m[] = {{"cache_digest", "0123abcd"},
                        {"segments", "[{\"seq\": \"a\", \"start\": 0, \"len\": 5}]"},
                        {"empty", ""}};
  roundtrip(d, 6, m, 3);
  roundtrip(d, 1, NULL, 0);
  roundtrip(NULL, 0, m, 1);
  roundtrip(NULL, 0, NULL, 0);
  /* Every header length modulo 8 pads to a multiple of 8. */
  char name[16];
  for (int k = 1; k <= 9; k++) {
    memset(name, 'n', (size_t)k);
    name[k] = 0;
    dsv4_st_desc_t one = {name, DSV4_ST_U8, 1, {3}, 3};
    roundtrip(&one, 1, NULL, 0);
  }
}

static void test_writer_rejects(void **state) {
  (void)state;
  uint8_t *hdr = NULL;
  size_t hlen, dlen;
  dsv4_st_desc_t wrong = {"q", DSV4_ST_BF16, 1, {4}, 4};
  assert_int_equal(dsv4_st_build_header(&wrong, 1, NULL, 0, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_desc_t dup[] = {{"q", DSV4_ST_U8, 1, {1}, 1}, {"q", DSV4_ST_U8, 1, {1}, 1}};
  assert_int_equal(dsv4_st_build_header(dup, 2, NULL, 0, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_desc_t meta_name = {"__metadata__", DSV4_ST_U8, 1, {1}, 1};
  assert_int_equal(dsv4_st_build_header(&meta_name, 1, NULL, 0, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_desc_t baddt = {"q", 17, 1, {1}, 1};
  assert_int_equal(dsv4_st_build_header(&baddt, 1, NULL, 0, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_desc_t neg = {"q", DSV4_ST_U8, 1, {-1}, 0};
  assert_int_equal(dsv4_st_build_header(&neg, 1, NULL, 0, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_desc_t ovf = {"q", DSV4_ST_U8, 2, {INT64_MAX, 4}, 0};
  assert_int_equal(dsv4_st_build_header(&ovf, 1, NULL, 0, &hdr, &hlen, &dlen), DSV4_ERANGE);
  dsv4_st_meta_t mdup[] = {{"a", "1"}, {"a", "2"}};
  assert_int_equal(dsv4_st_build_header(NULL, 0, mdup, 2, &hdr, &hlen, &dlen), DSV4_EINVAL);
  dsv4_st_meta_t notutf8 = {"a", "\xff"};
  assert_int_equal(dsv4_st_build_header(NULL, 0, &notutf8, 1, &hdr, &hlen, &dlen), DSV4_EINVAL);
  assert_null(hdr);
}

static void test_dtypes(void **state) {
  (void)state;
  const char *names[] = {"BF16", "F32", "I64", "I32", "U8", "F8_E4M3"};
  const size_t sizes[] = {2, 4, 8, 4, 1, 1};
  for (int i = 0; i < 6; i++) {
    int dt = -1;
    assert_int_equal(dsv4_st_dtype_parse(names[i], &dt), 0);
    assert_int_equal(dsv4_st_dtype_size(dt), sizes[i]);
    assert_string_equal(dsv4_st_dtype_name(dt), names[i]);
  }
  int dt;
  assert_int_equal(dsv4_st_dtype_parse("F64", &dt), DSV4_EINVAL);
  assert_int_equal(dsv4_st_dtype_size(6), 0);
  assert_null(dsv4_st_dtype_name(-1));
}

/* A region's header (dsv4_st_view_region): gaps allowed; past the end, misaligned or overlapping
 * tensors refused with a message naming the tensor. */
static void region_expect(const char *header, size_t size, const char *want) {
  static uint8_t region[4096];
  json_t *doc = json_loads(header, 0, NULL);
  dsv4_st_view_t v;
  assert_non_null(doc);
  int rc = dsv4_st_view_region(doc, region, size, &v);
  if (!want) {
    assert_int_equal(rc, 0);
    const dsv4_st_tensor_t *kv = dsv4_st_find(&v, "kv");
    assert_non_null(kv);
    assert_ptr_equal(kv->data, region + kv->offset);
    assert_string_equal(dsv4_st_meta(&v, "layer"), "0");
    dsv4_st_view_free(&v);
  } else {
    assert_int_equal(rc, DSV4_EINVAL);
    if (!strstr(v.error, want))
      fail_msg("error \"%s\" lacks \"%s\"", v.error, want);
  }
  json_decref(doc);
}

static void test_region(void **state) {
  (void)state;
  /* q at 0, kv at 1024 with a gap between, outputs would go after. */
  region_expect("{\"__metadata__\":{\"layer\":\"0\"},"
                "\"q\":{\"dtype\":\"BF16\",\"shape\":[2,8],\"data_offsets\":[0,32]},"
                "\"kv\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[1024,1032]}}",
                4096, NULL);
  region_expect("{\"kv\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[4092,4100]}}", 4096,
                "past the region");
  region_expect("{\"kv\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[6,22]}}", 4096,
                "not a multiple of 4");
  region_expect("{\"q\":{\"dtype\":\"BF16\",\"shape\":[8],\"data_offsets\":[0,16]},"
                "\"kv\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[8,16]}}",
                4096, "overlaps");
  region_expect("{\"kv\":{\"dtype\":\"BF16\",\"shape\":[4],\"data_offsets\":[0,6]}}", 4096,
                "need 8");
  region_expect("[1,2]", 4096, "not a JSON object");
}

/* ---- the usual header without a document, held to the document's answers ---- */

#define TEST_RNG_SEED 0x5AFE7E450Full
#include "test_rng.h"

typedef struct {
  char *p;
  size_t n, cap;
} text_t;

static void put(text_t *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(t->p + t->n, t->cap - t->n, fmt, ap);
  va_end(ap);
  assert_true(k >= 0 && (size_t)k < t->cap - t->n);
  t->n += (size_t)k;
}

static const char *pick(const char *const *v, size_t n) {
  return v[rng() % n];
}

/* White space now and then. */
static void ws(text_t *t) {
  static const char *const w[] = {"", "", "", "", "", "", " ", "\n  ", "\t", "\r\n"};
  put(t, "%s", pick(w, sizeof(w) / sizeof(w[0])));
}

/* An integer, mostly plain, sometimes in a form only the document reads (or refuses). */
static void put_int(text_t *t, long long v) {
  static const char *const odd[] = {
      "01", "-1", "1.0", "1e2", "99999999999999999999", "123456789012345678", "1234567890123456789",
      "-0", "0"};
  if (rng() % 16)
    put(t, "%lld", v);
  else
    put(t, "%s", pick(odd, sizeof(odd) / sizeof(odd[0])));
}

static const char *const names[] = {"q",        "kv",     "ckv",      "x y",          "q",
                                    "\xc3\xa9", "a\\\"b", "a\\u0041", "__metadata__", ""};
static const char *const dts[] = {
    "BF16", "F32", "I64", "I32", "U8", "F8_E4M3", "F16", "bogus", "BF\\u0031\\u0036", "BF16"};

/* One tensor entry at *pos with n elements of a dtype, its fields in some order. */
static void put_tensor(text_t *t, size_t *pos) {
  const char *dt = pick(dts, sizeof(dts) / sizeof(dts[0]));
  int ndim = (int)(rng() % 4), fields[3] = {0, 1, 2};
  if (rng() % 20 == 0)
    ndim = 9;
  long long shape[9], numel = 1;
  for (int d = 0; d < ndim; d++) {
    shape[d] = (long long)(rng() % 5);
    numel *= shape[d];
  }
  size_t elem = !strcmp(dt, "F32") || !strcmp(dt, "I32") ? 4 : !strcmp(dt, "I64") ? 8 : 2;
  size_t bytes = (size_t)numel * elem + (rng() % 12 == 0);
  for (int i = 2; i > 0; i--) {
    int j = (int)(rng() % (uint64_t)(i + 1)), x = fields[i];
    fields[i] = fields[j];
    fields[j] = x;
  }
  put(t, "{");
  int nf = rng() % 15 == 0 ? 2 : rng() % 15 == 0 ? 4 : 3;
  for (int f = 0; f < nf; f++) {
    put(t, "%s", f ? "," : "");
    ws(t);
    switch (f < 3 ? fields[f] : (int)(rng() % 4)) {
    case 0:
      put(t, "\"dtype\":");
      ws(t);
      put(t, rng() % 30 ? "\"%s\"" : "%s", rng() % 30 ? dt : "7");
      break;
    case 1:
      put(t, "\"shape\":[");
      for (int d = 0; d < ndim; d++) {
        put(t, "%s", d ? "," : "");
        ws(t);
        put_int(t, shape[d]);
      }
      put(t, "]");
      break;
    case 2:
      put(t, "\"data_offsets\":[");
      put_int(t, (long long)*pos);
      put(t, ",");
      ws(t);
      put_int(t, (long long)(*pos + bytes));
      put(t, "]");
      break;
    default:
      put(t, "\"extra\":1");
    }
  }
  put(t, "}");
  *pos += bytes;
}

static void put_meta(text_t *t) {
  static const char *const keys[] = {"layer", "segments", "outputs", "layer", "\\n", "k\xc3\xa9"};
  static const char *const vals[] = {"3",        "[{\\\"name\\\":\\\"s0\\\",\\\"len\\\":1}]",
                                     "q,attn",   "a\\/b\\\\c\\b\\f\\n\\r\\t",
                                     "\\u0041",  "",
                                     "\xc3\xa9", "\\x"};
  put(t, "{");
  int n = (int)(rng() % 4);
  for (int i = 0; i < n; i++) {
    put(t, "%s", i ? "," : "");
    ws(t);
    put(t, "\"%s\":", pick(keys, sizeof(keys) / sizeof(keys[0])));
    ws(t);
    if (rng() % 20)
      put(t, "\"%s\"", pick(vals, sizeof(vals) / sizeof(vals[0])));
    else
      put(t, "%d", 3);
  }
  put(t, "}");
}

/* A header of the usual shape mostly, with every way out of it now and then; *data_len is what its
 * offsets need (or not quite). */
static void gen_header(text_t *t, size_t *data_len) {
  size_t pos = 0;
  t->n = 0;
  int n = rng() % 25 == 0 ? 17 + (int)(rng() % 3) : (int)(rng() % 5);
  put(t, rng() % 40 ? "{" : "[");
  int meta_at = rng() % 3 ? (int)(rng() % (uint64_t)(n + 1)) : -1;
  for (int i = 0, first = 1; i <= n; i++) {
    if (i == meta_at || i < n) {
      put(t, "%s", first ? "" : ",");
      ws(t);
      first = 0;
    }
    if (i == meta_at) {
      put(t, "\"__metadata__\":");
      put_meta(t);
      if (i < n)
        put(t, ",");
    }
    if (i < n) {
      /* Names from a short list (repeats happen), or numbered. */
      if (rng() % 3)
        put(t, "\"%s\":", pick(names, sizeof(names) / sizeof(names[0])));
      else
        put(t, "\"t%d\":", i);
      ws(t);
      put_tensor(t, &pos);
    }
  }
  ws(t);
  put(t, "}");
  if (rng() % 20 == 0)
    put(t, "%s", rng() % 2 ? "x" : "  ");
  if (rng() % 20 == 0)
    t->n = (size_t)(rng() % (t->n + 1)); /* cut short */
  *data_len = rng() % 10 || pos == 0 ? pos : pos + (rng() % 3) - 1;
}

/* The two parses of one body: the same answer, field by field. */
static int same_parse(const uint8_t *b, size_t len) {
  dsv4_st_view_t x, y;
  int rx = dsv4_st_parse(b, len, &x), ry = dsv4__st_parse_reference(b, len, &y);
  const char *why = st_views_differ(rx, &x, ry, &y);
  if (why)
    print_error("%s: \"%s\" against \"%s\"\n", why, x.error, y.error);
  assert_null(why);
  int fast = rx == 0 && x.doc == NULL;
  dsv4_st_view_free(&x);
  dsv4_st_view_free(&y);
  return fast;
}

/* 40,000 generated headers: read without a document where they have the usual shape, every answer
 * (tensors, metadata, errors and their messages) the document's; both kinds occur often. */
static void test_fast_matches_document(void **state) {
  (void)state;
  text_t t = {malloc(1 << 16), 0, 1 << 16};
  assert_non_null(t.p);
  size_t fast = 0, ok = 0, runs = 40000;
  for (size_t r = 0; r < runs; r++) {
    size_t data_len, len;
    gen_header(&t, &data_len);
    t.p[t.n] = '\0';
    uint8_t *b = make(t.p, data_len, &len);
    dsv4_st_view_t v;
    ok += dsv4__st_parse_reference(b, len, &v) == 0;
    dsv4_st_view_free(&v);
    fast += (size_t)same_parse(b, len);
    free(b);
  }
  free(t.p);
  /* Both paths well exercised: most accepted bodies without a document, many refusals. */
  assert_true(fast > runs / 10);
  assert_true(ok - fast > runs / 50);
  assert_true(runs - ok > runs / 4);
}

/* The header writer's direct text against the document's dump, byte for byte, over plain and
 * escaped names and values, repeats and invalid tensors. */
static void test_writer_direct_matches_document(void **state) {
  (void)state;
  static const char *const tn[] = {"q_out",    "slots", "attn",         "lse",  "a\"b",
                                   "\xc3\xa9", "x/y",   "__metadata__", "q_out"};
  static const char *const mk[] = {"cache_digest", "attention", "replayed", "a\\b", "attention"};
  static const char *const mv[] = {"0123456789abcdef", "exact", "true", "\n", "\xff"};
  size_t direct = 0;
  for (int r = 0; r < 20000; r++) {
    dsv4_st_desc_t d[5];
    dsv4_st_meta_t m[3];
    size_t n = rng() % 5, nm = rng() % 4;
    for (size_t i = 0; i < n; i++) {
      d[i].name = rng() % 6 ? tn[i] : pick(tn, sizeof(tn) / sizeof(tn[0]));
      d[i].dtype = (int)(rng() % 7) - (rng() % 30 == 0);
      d[i].ndim = (int)(rng() % 4) + (rng() % 30 == 0 ? 6 : 0);
      size_t numel = 1;
      for (int k = 0; k < DSV4_ST_MAX_DIMS; k++) {
        d[i].shape[k] = (int64_t)(rng() % 70) - (rng() % 50 == 0);
        if (k < d[i].ndim)
          numel *= (size_t)d[i].shape[k];
      }
      d[i].nbytes = numel * dsv4_st_dtype_size(d[i].dtype) + (rng() % 25 == 0);
    }
    for (size_t i = 0; i < nm && i < 3; i++)
      m[i] = (dsv4_st_meta_t){rng() % 5 ? mk[i] : pick(mk, 5), rng() % 5 ? mv[i] : pick(mv, 5)};
    uint8_t *x = NULL, *y = NULL;
    size_t xl = 0, yl = 0, xd = 0, yd = 0;
    int rx = dsv4_st_build_header(d, n, m, nm < 3 ? nm : 3, &x, &xl, &xd);
    int ry = dsv4__st_build_header_reference(d, n, m, nm < 3 ? nm : 3, &y, &yl, &yd);
    assert_int_equal(rx, ry);
    if (rx == 0) {
      assert_int_equal(xl, yl);
      assert_memory_equal(x, y, xl);
      assert_int_equal(xd, yd);
      direct++;
    }
    free(x);
    free(y);
  }
  assert_true(direct > 2000);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_valid),
      cmocka_unit_test(test_empty_ok),
      cmocka_unit_test(test_truncated_prefix),
      cmocka_unit_test(test_header_past_end),
      cmocka_unit_test(test_header_too_big),
      cmocka_unit_test(test_json_shape),
      cmocka_unit_test(test_bad_dtype),
      cmocka_unit_test(test_bad_shape),
      cmocka_unit_test(test_size_mismatch),
      cmocka_unit_test(test_overflow),
      cmocka_unit_test(test_offsets),
      cmocka_unit_test(test_duplicates_and_metadata),
      cmocka_unit_test(test_writer_roundtrip),
      cmocka_unit_test(test_writer_rejects),
      cmocka_unit_test(test_dtypes),
      cmocka_unit_test(test_region),
      cmocka_unit_test(test_fast_matches_document),
      cmocka_unit_test(test_writer_direct_matches_document),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
