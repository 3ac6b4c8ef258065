/*
 * A shared-region forward message read without a document (server/shm_msg.c) against jansson's
 * reading of the same message (tests/support/shm_msg_check.h): generated messages of the usual
 * shape and every way out of it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>

#define TEST_RNG_SEED 0x5E6A7E0F0Dull
#include "shm_msg_check.h"
#include "test_rng.h"

typedef struct {
  char p[8192];
  size_t n;
} text_t;

static void put(text_t *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(t->p + t->n, sizeof(t->p) - t->n, fmt, ap);
  va_end(ap);
  assert_true(k >= 0 && (size_t)k < sizeof(t->p) - t->n);
  t->n += (size_t)k;
}

static const char *pick(const char *const *v, size_t n) {
  return v[rng() % n];
}
#define PICK(v) pick(v, sizeof(v) / sizeof(v[0]))

static void ws(text_t *t) {
  static const char *const w[] = {"", "", "", "", "", " ", "\n", "\t "};
  put(t, "%s", PICK(w));
}

/* An integer, now and then in a form only jansson reads (or refuses). */
static void put_int(text_t *t, long long v) {
  static const char *const odd[] = {
      "01",   "-1",    "1.5", "2e3", "12345678901234567890", "123456789012345678",
      "true", "\"7\"", "null"};
  if (rng() % 12)
    put(t, "%lld", v);
  else
    put(t, "%s", PICK(odd));
}

static void put_header(text_t *t) {
  static const char *const names[] = {"q", "kv", "ckv", "q", "iw", "a\\u0041"};
  static const char *const meta[] = {
      "\"layer\":\"3\",\"outputs\":\"q\"",
      "\"layer\":\"3\",\"segments\":\"[{\\\"name\\\":\\\"s\\\",\\\"start\\\":0,\\\"len\\\":1}]\"",
      "\"layer\":4", "\"outputs\":\"q,attn\",\"outputs\":\"q\"", ""};
  if (rng() % 25 == 0) {
    put(t, "%s", rng() % 2 ? "[]" : "\"x\"");
    return;
  }
  put(t, "{");
  int n = (int)(rng() % 3);
  long long pos = (long long)(rng() % 3) * 8;
  for (int i = 0; i < n; i++) {
    long long tok = 1 + (long long)(rng() % 3), bytes = tok * 512 * 2;
    put(t, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "",
        rng() % 4 ? (i ? "kv" : "q") : PICK(names), rng() % 15 ? "BF16" : "F32");
    put_int(t, tok);
    put(t, ",512],\"data_offsets\":[");
    put_int(t, pos);
    put(t, ",");
    ws(t);
    put_int(t, pos + bytes + (rng() % 20 == 0));
    put(t, "]}");
    pos += bytes + (long long)(rng() % 2) * 16;
  }
  if (rng() % 3)
    put(t, "%s\"__metadata__\":{%s}", n ? "," : "", PICK(meta));
  put(t, "}");
}

static void put_out(text_t *t) {
  static const char *const names[] = {"q_out", "slots", "attn", "lse", "topk", "bogus", "q_out"};
  if (rng() % 25 == 0) {
    put(t, "[1]");
    return;
  }
  put(t, "{");
  int n = rng() % 20 == 0 ? 9 : (int)(rng() % 4);
  for (int i = 0; i < n; i++) {
    put(t, "%s\"%s\":", i ? "," : "", rng() % 3 ? names[i % 5] : PICK(names));
    ws(t);
    put_int(t, (long long)(rng() % 100000));
  }
  put(t, "}");
}

/* A forward message: its fields in some order, some missing, some twice, some odd; then the
 * segments text, white space or something else. */
static void gen_message(text_t *t) {
  int order[7] = {0, 1, 2, 3, 4, 5, 6};
  for (int i = 6; i > 0; i--) {
    int j = (int)(rng() % (uint64_t)(i + 1)), x = order[i];
    order[i] = order[j];
    order[j] = x;
  }
  t->n = 0;
  put(t, "{");
  int first = 1, segs = 0;
  for (int k = 0; k < 7; k++) {
    int f = order[k];
    if ((f >= 4 && rng() % 2) || rng() % 40 == 0)
      continue; /* optional, or a required one missing now and then */
    put(t, "%s", first ? "" : ",");
    first = 0;
    ws(t);
    switch (f) {
    case 0:
      put(t, "\"op\":%s",
          rng() % 20  ? "\"forward\""
          : rng() % 2 ? "\"for\\u0077ard\""
                      : "\"register\"");
      break;
    case 1:
      put(t, "\"region\":");
      put_int(t, (long long)(rng() % 3));
      break;
    case 2:
      put(t, "\"header\":");
      ws(t);
      put_header(t);
      break;
    case 3:
      put(t, "\"out\":");
      put_out(t);
      break;
    case 4:
      put(t, "\"deadline_ms\":");
      put_int(t, (long long)(rng() % 5000));
      break;
    case 5:
      segs = 1;
      put(t, "\"segments_bytes\":");
      put_int(t, 30);
      break;
    default:
      put(t, "\"%s\":1", rng() % 2 ? "extra" : "region");
    }
  }
  ws(t);
  put(t, "}");
  if (segs || rng() % 10 == 0)
    put(t, "%s", rng() % 2 ? "[{\"name\":\"s\",\"start\":0,\"len\":1}]" : " x");
  else if (rng() % 4 == 0)
    put(t, "\n ");
  if (rng() % 25 == 0)
    t->n = (size_t)(rng() % (t->n + 1));
}

/* 50,000 messages: every one the scan reads, jansson reads the same way; both kinds occur often. */
static void test_scan_matches_document(void **state) {
  (void)state;
  text_t t;
  size_t scanned = 0, runs = 50000;
  for (size_t r = 0; r < runs; r++) {
    gen_message(&t);
    const char *why = NULL;
    size_t region = (size_t)(rng() % 8) * 1024;
    int rc = shm_msg_check(t.p, t.n, region, &why);
    if (rc < 0)
      print_error("%s: %.*s\n", why, (int)t.n, t.p);
    assert_true(rc >= 0);
    scanned += (size_t)rc;
  }
  assert_true(scanned > runs / 10);
  assert_true(scanned < runs - runs / 10);
}

/* What libdsv4client writes is read without a document. */
static void test_client_form_scanned(void **state) {
  (void)state;
  const char *m =
      "{\"op\":\"forward\",\"region\":1,\"header\":{\"q\":{\"dtype\":\"BF16\",\"shape\":"
      "[1,64,512],\"data_offsets\":[0,65536]},\"kv\":{\"dtype\":\"BF16\",\"shape\":"
      "[1,512],\"data_offsets\":[65536,66560]},\"__metadata__\":{\"layer\":\"3\","
      "\"outputs\":\"q\"}},\"out\":{\"q_out\":66560,\"slots\":132096},"
      "\"segments_bytes\":30}[{\"name\":\"s\",\"start\":0,\"len\":1}]";
  const char *why = NULL;
  assert_int_equal(shm_msg_check(m, strlen(m), 1 << 20, &why), 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scan_matches_document),
      cmocka_unit_test(test_client_form_scanned),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
