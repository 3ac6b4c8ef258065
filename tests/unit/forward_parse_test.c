/*
 * dsv4_forward_parse: valid bodies give the fields the engine needs (pointers into the body, or
 * aligned copies when the sender's data is not 2-aligned), and every rejection path answers with
 * its code and the message clients see. Bodies are built with the safetensors header writer.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dsv4-error.h"
#include "forward_parse.h"

#define HEADS 2

static const uint32_t served[] = {0, 2, 5};

static dsv4_forward_limits_t limits(void) {
  dsv4_forward_limits_t l = {
      .heads = HEADS,
      .max_batch_tokens = 8,
      .max_segments = 4,
      .max_position_embeddings = 1000,
      .served_layers = served,
      .n_served = 3,
  };
  return l;
}

/* One body to build: tensors q and kv (and optionally a third), metadata entries when not NULL. */
typedef struct {
  int q_dtype, q_ndim;
  int64_t q_shape[3];
  int kv_dtype, kv_ndim;
  int64_t kv_shape[3];
  int no_q, no_kv, extra;
  const char *layer, *segments, *outputs;
  const char *attention;
} spec_t;

static spec_t spec_n(int64_t n, const char *segments) {
  spec_t s = {
      DSV4_ST_BF16, 3,   {n, HEADS, 512}, DSV4_ST_BF16, 2, {n, 512, 0}, 0, 0, 0, "0", segments,
      NULL,         NULL};
  return s;
}

static size_t nbytes(int dtype, int ndim, const int64_t *shape) {
  size_t b = dsv4_st_dtype_size(dtype);
  for (int i = 0; i < ndim; i++)
    b *= (size_t)shape[i];
  return b;
}

/* The body at buf + shift (shift 1 makes the data section odd), its length in *len. buf is what to
 * free. Data bytes count up, so a copy can be told from the original. */
static uint8_t *build(const spec_t *s, size_t shift, uint8_t **buf, size_t *len) {
  dsv4_st_desc_t d[3];
  dsv4_st_meta_t m[4];
  size_t nd = 0, nm = 0, hl, dl;
  uint8_t *hdr, *b;
  if (!s->no_q) {
    d[nd] = (dsv4_st_desc_t){
        "q", s->q_dtype, s->q_ndim, {0}, nbytes(s->q_dtype, s->q_ndim, s->q_shape)};
    memcpy(d[nd++].shape, s->q_shape, sizeof(int64_t) * (size_t)s->q_ndim);
  }
  if (!s->no_kv) {
    d[nd] = (dsv4_st_desc_t){
        "kv", s->kv_dtype, s->kv_ndim, {0}, nbytes(s->kv_dtype, s->kv_ndim, s->kv_shape)};
    memcpy(d[nd++].shape, s->kv_shape, sizeof(int64_t) * (size_t)s->kv_ndim);
  }
  if (s->extra)
    d[nd++] = (dsv4_st_desc_t){"bias", DSV4_ST_U8, 1, {4}, 4};
  if (s->layer)
    m[nm++] = (dsv4_st_meta_t){"layer", s->layer};
  if (s->segments)
    m[nm++] = (dsv4_st_meta_t){"segments", s->segments};
  if (s->outputs)
    m[nm++] = (dsv4_st_meta_t){"outputs", s->outputs};
  if (s->attention)
    m[nm++] = (dsv4_st_meta_t){"attention", s->attention};
  assert_int_equal(dsv4_st_build_header(d, nd, m, nm, &hdr, &hl, &dl), 0);
  *buf = malloc(shift + hl + dl + 1);
  assert_non_null(*buf);
  b = *buf + shift;
  memcpy(b, hdr, hl);
  for (size_t i = 0; i < dl; i++)
    b[hl + i] = (uint8_t)(i * 7 + 3);
  free(hdr);
  *len = hl + dl;
  return b;
}

/* Parse a spec, returning the code; the message in msg. */
static int parse_spec(const spec_t *s, const dsv4_forward_limits_t *lim, char *msg,
                      size_t msg_len) {
  uint8_t *buf, *b;
  size_t len;
  dsv4_forward_req_t r;
  b = build(s, 0, &buf, &len);
  msg[0] = '\0';
  int rc = dsv4_forward_parse(b, len, lim, &r, msg, msg_len);
  dsv4_forward_req_free(&r);
  free(buf);
  return rc;
}

static void expect(const spec_t *s, int code, const char *message) {
  dsv4_forward_limits_t lim = limits();
  char msg[320];
  int rc = parse_spec(s, &lim, msg, sizeof(msg));
  if (rc != code || strcmp(msg, message) != 0)
    fail_msg("expected %d \"%s\", got %d \"%s\"", code, message, rc, msg);
}

static const char *one_seg = "[{\"seq\":\"a\",\"start\":0,\"len\":1}]";

static void test_valid(void **state) {
  (void)state;
  spec_t s = spec_n(3, "[{\"seq\":\"a.b\",\"start\":0,\"len\":2,\"new\":true},"
                       "{\"seq\":\"c\",\"start\":998,\"len\":1}]");
  dsv4_forward_limits_t lim = limits();
  uint8_t *buf, *b;
  size_t len;
  dsv4_forward_req_t r;
  char msg[320] = "";
  s.layer = "5";
  s.outputs = " q , digest";
  b = build(&s, 0, &buf, &len);
  assert_int_equal(dsv4_forward_parse(b, len, &lim, &r, msg, sizeof(msg)), 0);
  assert_string_equal(msg, "");
  assert_int_equal(r.layer, 5);
  assert_int_equal(r.n_tokens, 3);
  assert_int_equal(r.q_bytes, 3 * HEADS * 512 * 2);
  assert_int_equal(r.kv_bytes, 3 * 512 * 2);
  /* Tensors in writing order right after the header, used in place. */
  assert_ptr_equal((const uint8_t *)r.q, b + len - r.q_bytes - r.kv_bytes);
  assert_ptr_equal((const uint8_t *)r.kv, b + len - r.kv_bytes);
  assert_null(r.q_copy);
  assert_null(r.kv_copy);
  assert_int_equal(r.want_q, 1);
  assert_int_equal(r.want_digest, 1);
  assert_int_equal(r.n_segs, 2);
  assert_int_equal(r.segs[0].name_len, 3);
  assert_memory_equal(r.segs[0].name, "a.b", 3);
  assert_int_equal(r.segs[0].start, 0);
  assert_int_equal(r.segs[0].len, 2);
  assert_int_equal(r.segs[0].is_new, 1);
  assert_int_equal(r.segs[1].name_len, 1);
  assert_memory_equal(r.segs[1].name, "c", 1);
  assert_int_equal(r.segs[1].start, 998);
  assert_int_equal(r.segs[1].len, 1);
  assert_int_equal(r.segs[1].is_new, 0);
  dsv4_forward_req_free(&r);
  assert_null(r.segs);
  assert_null(r.segs_doc);
  assert_null(r.view.doc);
  free(buf);
}

static void test_unaligned_copies(void **state) {
  (void)state;
  spec_t s = spec_n(2, "[{\"seq\":\"a\",\"start\":0,\"len\":2}]");
  dsv4_forward_limits_t lim = limits();
  uint8_t *buf, *b;
  size_t len;
  dsv4_forward_req_t r;
  char msg[320];
  b = build(&s, 1, &buf, &len);
  assert_int_equal(dsv4_forward_parse(b, len, &lim, &r, msg, sizeof(msg)), 0);
  assert_non_null(r.q_copy);
  assert_non_null(r.kv_copy);
  assert_ptr_equal(r.q, r.q_copy);
  assert_ptr_equal(r.kv, r.kv_copy);
  assert_int_equal((uintptr_t)r.q % 64, 0);
  assert_memory_equal(r.q, b + len - r.q_bytes - r.kv_bytes, r.q_bytes);
  assert_memory_equal(r.kv, b + len - r.kv_bytes, r.kv_bytes);
  dsv4_forward_req_free(&r);
  free(buf);
}

static void test_outputs(void **state) {
  (void)state;
  static const struct {
    const char *outputs;
    int want_q, want_digest, want_attn, want_lse;
  } cases[] = {{NULL, 1, 0, 0, 0},       {"digest", 0, 1, 0, 0},         {"q", 1, 0, 0, 0},
               {"", 0, 0, 0, 0},         {"digest,q", 1, 1, 0, 0},       {"attn", 0, 0, 1, 0},
               {" lse , q", 1, 0, 0, 1}, {"attn,lse,digest", 0, 1, 1, 1}};
  dsv4_forward_limits_t lim = limits();
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    spec_t s = spec_n(1, one_seg);
    uint8_t *buf, *b;
    size_t len;
    dsv4_forward_req_t r;
    char msg[320];
    s.outputs = cases[i].outputs;
    b = build(&s, 0, &buf, &len);
    assert_int_equal(dsv4_forward_parse(b, len, &lim, &r, msg, sizeof(msg)), 0);
    assert_int_equal(r.want_q, cases[i].want_q);
    assert_int_equal(r.want_digest, cases[i].want_digest);
    assert_int_equal(r.want_attn, cases[i].want_attn);
    assert_int_equal(r.want_lse, cases[i].want_lse);
    assert_int_equal(r.attention, DSV4_ATTENTION_DEFAULT);
    dsv4_forward_req_free(&r);
    free(buf);
  }
}

/* The "attention" metadata: exact or fast, anything else refused. */
static void test_attention_mode(void **state) {
  (void)state;
  static const struct {
    const char *mode;
    int want;
  } cases[] = {{"exact", DSV4_ATTENTION_EXACT}, {"fast", DSV4_ATTENTION_FAST}};
  dsv4_forward_limits_t lim = limits();
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    spec_t s = spec_n(1, one_seg);
    uint8_t *buf, *b;
    size_t len;
    dsv4_forward_req_t r;
    char msg[320];
    s.outputs = "attn", s.attention = cases[i].mode;
    b = build(&s, 0, &buf, &len);
    assert_int_equal(dsv4_forward_parse(b, len, &lim, &r, msg, sizeof(msg)), 0);
    assert_int_equal(r.attention, cases[i].want);
    dsv4_forward_req_free(&r);
    free(buf);
  }
  const char *bad[] = {"Exact", "", "fast ", "slow"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    spec_t s = spec_n(1, one_seg);
    s.outputs = "attn", s.attention = bad[i];
    expect(&s, DSV4_EINVAL, "__metadata__ \"attention\" must be \"exact\" or \"fast\"");
  }
}

static uint32_t last_asked;

static int only_seven(const void *arg, uint32_t layer) {
  last_asked = layer;
  return arg == &last_asked && layer == 7;
}

static void test_layer_callback(void **state) {
  (void)state;
  dsv4_forward_limits_t lim = limits();
  spec_t s = spec_n(1, one_seg);
  char msg[320];
  lim.layer_served = only_seven;
  lim.layer_arg = &last_asked;
  s.layer = "7";
  assert_int_equal(parse_spec(&s, &lim, msg, sizeof(msg)), 0);
  assert_int_equal(last_asked, 7);
  /* The callback overrides the array, where 0 is served. */
  s.layer = "0";
  assert_int_equal(parse_spec(&s, &lim, msg, sizeof(msg)), DSV4_ELAYER);
  assert_int_equal(last_asked, 0);
}

static void test_reject_body(void **state) {
  (void)state;
  dsv4_forward_limits_t lim = limits();
  dsv4_forward_req_t r;
  char msg[320];
  static const uint8_t junk[] = "\x04\0\0\0\0\0\0\0{}";
  assert_int_equal(dsv4_forward_parse(junk, 5, &lim, &r, msg, sizeof(msg)), DSV4_EINVAL);
  assert_non_null(strstr(msg, "malformed safetensors body: "));
  assert_true(strlen(msg) > strlen("malformed safetensors body: "));
  dsv4_forward_req_free(&r);
}

static void test_reject_tensors(void **state) {
  (void)state;
  spec_t s;
  s = spec_n(1, one_seg), s.extra = 1;
  expect(&s, DSV4_EINVAL,
         "unknown tensor \"bias\" (a forward body has q and kv, and on a compressed layer "
         "ckv, ikv, iq and iw)");
  s = spec_n(1, one_seg), s.no_q = 1;
  expect(&s, DSV4_EINVAL, "missing tensor \"q\"");
  s = spec_n(1, one_seg), s.no_kv = 1;
  expect(&s, DSV4_EINVAL, "missing tensor \"kv\"");
  s = spec_n(0, one_seg);
  expect(&s, DSV4_EINVAL, "tensor \"q\" must be [N, 2, 512] with N >= 1");
  s = spec_n(1, one_seg), s.q_ndim = 0;
  expect(&s, DSV4_EINVAL, "tensor \"q\" must be [N, 2, 512] with N >= 1");
  s = spec_n(9, one_seg);
  expect(&s, DSV4_EINVAL, "N = 9 exceeds max_batch_tokens = 8");
  s = spec_n(1, one_seg), s.q_shape[1] = 4;
  expect(&s, DSV4_EINVAL, "q has H = 4 heads, this daemon serves heads = 2");
  s = spec_n(1, one_seg), s.q_dtype = DSV4_ST_F32;
  expect(&s, DSV4_EINVAL, "tensor \"q\" must be BF16, not F32");
  s = spec_n(1, one_seg), s.q_ndim = 2, s.q_shape[1] = 1024;
  expect(&s, DSV4_EINVAL, "tensor \"q\" must have 3 dimensions, not 2");
  s = spec_n(1, one_seg), s.q_shape[1] = 4, s.q_shape[2] = 256;
  expect(&s, DSV4_EINVAL, "tensor \"q\" dimension 1 is 4, expected 2");
  s = spec_n(1, one_seg), s.kv_dtype = DSV4_ST_I32;
  expect(&s, DSV4_EINVAL, "tensor \"kv\" must be BF16, not I32");
  s = spec_n(1, one_seg), s.kv_ndim = 3, s.kv_shape[1] = 2, s.kv_shape[2] = 256;
  expect(&s, DSV4_EINVAL, "tensor \"kv\" must have 2 dimensions, not 3");
  s = spec_n(1, one_seg), s.kv_shape[0] = 2;
  expect(&s, DSV4_EINVAL, "tensor \"kv\" dimension 0 is 2, expected 1");
}

static void test_reject_metadata(void **state) {
  (void)state;
  spec_t s;
  s = spec_n(1, one_seg), s.layer = NULL;
  expect(&s, DSV4_EINVAL, "__metadata__ must have \"layer\" and \"segments\"");
  s = spec_n(1, NULL);
  expect(&s, DSV4_EINVAL, "__metadata__ must have \"layer\" and \"segments\"");
  s = spec_n(1, one_seg), s.layer = "+1";
  expect(&s, DSV4_EINVAL, "__metadata__ \"layer\" must be a decimal layer number");
  s = spec_n(1, one_seg), s.layer = "4294967296";
  expect(&s, DSV4_EINVAL, "__metadata__ \"layer\" must be a decimal layer number");
  s = spec_n(1, one_seg), s.layer = "4294967295";
  expect(&s, DSV4_ELAYER, "layer 4294967295 is not served by this daemon");
  s = spec_n(1, one_seg), s.layer = "1";
  expect(&s, DSV4_ELAYER, "layer 1 is not served by this daemon");
  s = spec_n(1, one_seg), s.outputs = "q, slots ";
  expect(&s, DSV4_EINVAL, "unknown output \"slots\" (outputs: q, attn, lse, digest, topk)");
  s = spec_n(1, one_seg), s.outputs = "attn,lsee";
  expect(&s, DSV4_EINVAL, "unknown output \"lsee\" (outputs: q, attn, lse, digest, topk)");
}

static void test_reject_segments(void **state) {
  (void)state;
  static const struct {
    const char *segments;
    int64_t n;
    int code;
    const char *message;
  } cases[] = {
      {"[{\"seq\":", 1, DSV4_EINVAL, NULL},
      {"{\"seq\":\"a\",\"start\":0,\"len\":1}", 1, DSV4_EINVAL,
       "__metadata__ \"segments\" must be a JSON array: not an array"},
      {"[]", 1, DSV4_EINVAL, "a batch has 1..4 segments, not 0"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1},{\"seq\":\"b\",\"start\":0,\"len\":1},"
       "{\"seq\":\"c\",\"start\":0,\"len\":1},{\"seq\":\"d\",\"start\":0,\"len\":1},"
       "{\"seq\":\"e\",\"start\":0,\"len\":1}]",
       5, DSV4_EINVAL, "a batch has 1..4 segments, not 5"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1},7]", 2, DSV4_EINVAL,
       "segment 1: each segment must be a JSON object"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1,\"end\":1}]", 1, DSV4_EINVAL,
       "segment 0: unknown key in a segment (allowed: seq, start, len, new)"},
      {"[{\"seq\":5,\"start\":0,\"len\":1}]", 1, DSV4_EINVAL,
       "segment 0: segment \"seq\" must be a string"},
      {"[{\"start\":0,\"len\":1}]", 1, DSV4_EINVAL, "segment 0: segment \"seq\" must be a string"},
      {"[{\"seq\":\"a b\",\"start\":0,\"len\":1}]", 1, DSV4_EINVAL,
       "segment 0: segment \"seq\" must be " DSV4_SEQ_NAME_RULE},
      {"[{\"seq\":\"a\",\"start\":-1,\"len\":1}]", 1, DSV4_EINVAL,
       "segment 0: segment \"start\" must be an integer >= 0"},
      {"[{\"seq\":\"a\",\"start\":1.0,\"len\":1}]", 1, DSV4_EINVAL,
       "segment 0: segment \"start\" must be an integer >= 0"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":0}]", 1, DSV4_EINVAL,
       "segment 0: segment \"len\" must be an integer >= 1"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":4294967296}]", 1, DSV4_EINVAL,
       "segment 0: segment \"len\" must be an integer >= 1"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1,\"new\":1}]", 1, DSV4_EINVAL,
       "segment 0: segment \"new\" must be true or false"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1},{\"seq\":\"b\",\"start\":0,\"len\":1}]", 3,
       DSV4_EINVAL, "segment lengths add up to 2, but N = 3"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":4294967295},{\"seq\":\"b\",\"start\":0,\"len\":1}]", 1,
       DSV4_EINVAL, "segment lengths add up to 4294967296, but N = 1"},
      {"[{\"seq\":\"a\",\"start\":0,\"len\":1},{\"seq\":\"b\",\"start\":999,\"len\":2}]", 3,
       DSV4_EPOSRANGE,
       "segment 1: positions from 999 (2 of them) reach past max_position_embeddings = 1000"},
      {"[{\"seq\":\"a\",\"start\":9223372036854775807,\"len\":1}]", 1, DSV4_EPOSRANGE,
       "segment 0: positions from 9223372036854775807 (1 of them) reach past "
       "max_position_embeddings = 1000"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    spec_t s = spec_n(cases[i].n, cases[i].segments);
    if (cases[i].message) {
      expect(&s, cases[i].code, cases[i].message);
    } else {
      /* Invalid JSON: the message carries jansson's reason after the fixed part. */
      dsv4_forward_limits_t lim = limits();
      char msg[320];
      const char *head = "__metadata__ \"segments\" must be a JSON array: ";
      assert_int_equal(parse_spec(&s, &lim, msg, sizeof(msg)), cases[i].code);
      assert_int_equal(strncmp(msg, head, strlen(head)), 0);
      assert_true(strlen(msg) > strlen(head));
    }
  }
}

static void test_duplicate_keys(void **state) {
  (void)state;
  spec_t s = spec_n(1, "[{\"seq\":\"a\",\"seq\":\"b\",\"start\":0,\"len\":1}]");
  dsv4_forward_limits_t lim = limits();
  char msg[320];
  assert_int_equal(parse_spec(&s, &lim, msg, sizeof(msg)), DSV4_EINVAL);
  assert_non_null(strstr(msg, "__metadata__ \"segments\" must be a JSON array: "));
}

static void test_short_message_buffer(void **state) {
  (void)state;
  spec_t s = spec_n(9, one_seg);
  dsv4_forward_limits_t lim = limits();
  char msg[8];
  memset(msg, 'x', sizeof(msg));
  assert_int_equal(parse_spec(&s, &lim, msg, sizeof(msg)), DSV4_EINVAL);
  assert_string_equal(msg, "N = 9 e");
}

/* ---- the segments' two readers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(uint32_t n) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (uint32_t)(rng_state % n);
}

/* White space between tokens: none, JSON's own, or (rarely) a character JSON does not allow. */
static void put_ws(char *b, size_t *o) {
  static const char *const ws[] = {"", "", "", " ", "\n", "\t ", "\r\n  ", "\v", "\f"};
  const char *w = ws[rnd(9)];
  if ((w[0] == '\v' || w[0] == '\f') && rnd(64))
    w = "";
  *o += (size_t)sprintf(b + *o, "%s", w);
}

static void put_name(char *b, size_t *o) {
  static const char ok[] = "abcXYZ019._:-";
  static const char *const odd[] = {"", ".hidden", "a\\u0041", "a b", "\\\"q", "\xc3\xa9", "a/b"};
  if (rnd(16) == 0) {
    *o += (size_t)sprintf(b + *o, "\"%s\"", odd[rnd(7)]);
    return;
  }
  uint32_t n = rnd(24) == 0 ? 120 + rnd(20) : 1 + rnd(16);
  b[(*o)++] = '"';
  for (uint32_t i = 0; i < n; i++)
    b[(*o)++] = ok[rnd(sizeof(ok) - 1)];
  b[(*o)++] = '"';
}

static void put_int(char *b, size_t *o) {
  static const char *const odd[] = {"-1",
                                    "0",
                                    "-0",
                                    "01",
                                    "1.0",
                                    "1e3",
                                    "4294967296",
                                    "4294967295",
                                    "999999999999999999",
                                    "9999999999999999999",
                                    "-",
                                    "\"1\"",
                                    "null",
                                    "true"};
  if (rnd(16) == 0)
    *o += (size_t)sprintf(b + *o, "%s", odd[rnd(14)]);
  else
    *o += (size_t)sprintf(b + *o, "%u", rnd(5000));
}

/* A segments text: mostly the usual shape, with odd keys, values and spacing mixed in. */
static void make_segments(char *b, size_t cap) {
  size_t o = 0;
  uint32_t n = rnd(12) == 0 ? 0 : rnd(8) == 0 ? 5 + rnd(2) : 1 + rnd(4);
  put_ws(b, &o);
  b[o++] = '[';
  for (uint32_t s = 0; s < n && o + 600 < cap; s++) {
    if (s)
      b[o++] = ',';
    put_ws(b, &o);
    b[o++] = '{';
    static const char *const keys[] = {"seq", "start", "len", "new", "seq", "other"};
    uint32_t order[4] = {0, 1, 2, 3}, nk = 3 + rnd(2);
    for (int i = 3; i > 0; i--) {
      uint32_t j = rnd((uint32_t)i + 1), t = order[i];
      order[i] = order[j];
      order[j] = t;
    }
    for (uint32_t k = 0, first = 1; k < 4; k++) {
      uint32_t key = order[k];
      if (key == 3 && nk == 3)
        continue;
      if (rnd(30) == 0)
        key = 4 + rnd(2); /* a repeated or unknown key */
      else if (rnd(40) == 0)
        continue; /* a missing one */
      if (!first)
        b[o++] = ',';
      first = 0;
      put_ws(b, &o);
      o += (size_t)sprintf(b + o, "\"%s\"", keys[key]);
      put_ws(b, &o);
      b[o++] = ':';
      put_ws(b, &o);
      if (key == 0 || key == 4)
        put_name(b, &o);
      else if (key == 3)
        o += (size_t)sprintf(b + o, "%s", rnd(32) == 0 ? "1" : rnd(2) ? "true" : "false");
      else
        put_int(b, &o);
      put_ws(b, &o);
    }
    b[o++] = '}';
    put_ws(b, &o);
  }
  b[o++] = ']';
  put_ws(b, &o);
  b[o] = '\0';
  /* One in six: a byte deleted, changed or inserted somewhere. */
  size_t len = strlen(b);
  if (rnd(6) == 0 && len > 1) {
    static const char set[] = "{}[],:\"\\ e.-0a";
    size_t at = rnd((uint32_t)len);
    switch (rnd(3)) {
    case 0:
      memmove(b + at, b + at + 1, len - at);
      break;
    case 1:
      b[at] = set[rnd(sizeof(set) - 1)];
      break;
    default:
      memmove(b + at + 1, b + at, len - at + 1);
      b[at] = set[rnd(sizeof(set) - 1)];
    }
  }
}

/* Both readers give the same answer to every text: the same segments, or the same error and
 * message; and the fast one reads the usual shape itself. */
static void test_segments_fast_matches_json(void **state) {
  (void)state;
  char text[8192], why_a[320], why_b[320];
  unsigned fast_taken = 0, valid = 0;
  for (int i = 0; i < 20000; i++) {
    make_segments(text, sizeof(text));
    dsv4_forward_req_t a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    why_a[0] = why_b[0] = '\0';
    int ra = dsv4__forward_segments(text, 4, 0, &a, why_a, sizeof(why_a));
    int rb = dsv4__forward_segments(text, 4, 1, &b, why_b, sizeof(why_b));
    if (ra != rb || strcmp(why_a, why_b))
      fail_msg("text %s: json %d \"%s\", fast %d \"%s\"", text, ra, why_a, rb, why_b);
    if (ra == 0) {
      valid++;
      fast_taken += b.segs_text != NULL;
      assert_int_equal(a.n_segs, b.n_segs);
      for (uint32_t s = 0; s < a.n_segs; s++) {
        assert_int_equal(a.segs[s].name_len, b.segs[s].name_len);
        assert_memory_equal(a.segs[s].name, b.segs[s].name, a.segs[s].name_len);
        assert_int_equal(a.segs[s].start, b.segs[s].start);
        assert_int_equal(a.segs[s].len, b.segs[s].len);
        assert_int_equal(a.segs[s].is_new, b.segs[s].is_new);
      }
    } else {
      assert_null(b.segs_text);
    }
    dsv4_forward_req_free(&a);
    dsv4_forward_req_free(&b);
  }
  /* The generator's texts are valid often enough, and the fast reader takes most of those. */
  assert_true(valid > 3000);
  assert_true(fast_taken > valid / 10 * 9);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_valid),
      cmocka_unit_test(test_unaligned_copies),
      cmocka_unit_test(test_outputs),
      cmocka_unit_test(test_attention_mode),
      cmocka_unit_test(test_layer_callback),
      cmocka_unit_test(test_reject_body),
      cmocka_unit_test(test_reject_tensors),
      cmocka_unit_test(test_reject_metadata),
      cmocka_unit_test(test_reject_segments),
      cmocka_unit_test(test_duplicate_keys),
      cmocka_unit_test(test_short_message_buffer),
      cmocka_unit_test(test_segments_fast_matches_json),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
