/*
 * libFuzzer driver for the POST /v1/forward body parser (dsv4_forward_parse). The input is the
 * body. The limits are small so that every rejection is reachable with small inputs: H = 2 keeps a
 * token at 3 KiB, and max_batch_tokens = 8 puts "N too large" within the length limit. An accepted
 * body must satisfy everything the engine relies on; a refused one must say why, the same way
 * however short the message buffer; and dsv4_forward_req_free must release everything
 * (LeakSanitizer). The input is also read as a segments text, by the fast reader and by the JSON
 * parser, which must agree. And the body is fed to its arrival watcher (forward_arrival.h) cut in
 * pieces, as reads would bring it: the header the watcher keeps parses to the same answer, and
 * a check it hands over covers q and kv whole unless a value was out of range.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decimal.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "forward_arrival.h"
#include "forward_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define HEADS 2
#define MAX_TOKENS 8
#define MAX_SEGS 8
#define MAX_POS 65536

static const uint32_t served[] = {0, 1, 2, 3};

/* Layers 2 and 3 run the compressed branch (ratio 4: ckv, ikv, iq, iw; ratio 128: ckv). */
static uint32_t fuzz_ratio(const void *arg, uint32_t layer) {
  (void)arg;
  return layer == 2 ? 4 : layer == 3 ? 128 : 0;
}

static const dsv4_forward_limits_t limits = {
    .heads = HEADS,
    .max_batch_tokens = MAX_TOKENS,
    .max_segments = MAX_SEGS,
    .max_position_embeddings = MAX_POS,
    .served_layers = served,
    .n_served = 4,
    .layer_ratio = fuzz_ratio,
    .index_heads = 2,
};

#define CHECK(c)                                                                                   \
  do {                                                                                             \
    if (!(c)) {                                                                                    \
      fprintf(stderr, "fuzz_forward: %s:%d: %s\n", __FILE__, __LINE__, #c);                        \
      abort();                                                                                     \
    }                                                                                              \
  } while (0)

/* Whether p[0..n) lies inside buf[0..len). */
static int inside(const void *p, size_t n, const uint8_t *buf, size_t len) {
  const uint8_t *b = p;
  return b >= buf && n <= len && (size_t)(b - buf) <= len - n;
}

/* The tensor's bytes as the parser hands them out: in the body when 2-aligned, else a copy. */
static void check_data(const uint16_t *x, size_t n, const uint16_t *copy, const char *name,
                       const dsv4_forward_req_t *r, const uint8_t *buf, size_t len) {
  const dsv4_st_tensor_t *t = dsv4_st_find(&r->view, name);
  CHECK(t && t->nbytes == n);
  CHECK(((uintptr_t)x & 1u) == 0);
  if (copy) {
    CHECK(x == copy);
    CHECK(((uintptr_t)t->data & 1u) == 1);
    CHECK(memcmp(copy, t->data, n) == 0);
  } else {
    CHECK((const uint8_t *)x == t->data);
    CHECK(inside(x, n, buf, len));
  }
  /* Touch every byte, so a short copy or a stray pointer shows up under ASan. */
  volatile uint8_t acc = 0;
  for (size_t i = 0; i < n; i++)
    acc ^= ((const uint8_t *)x)[i];
  (void)acc;
}

static void check_accepted(const dsv4_forward_req_t *r, const uint8_t *buf, size_t len) {
  size_t n = r->n_tokens;
  uint64_t total = 0;
  CHECK(n >= 1 && n <= MAX_TOKENS);
  CHECK(r->layer <= 3);
  CHECK(r->q_bytes == n * HEADS * DSV4_HEAD_DIM * 2);
  CHECK(r->kv_bytes == n * DSV4_HEAD_DIM * 2);
  CHECK(r->q_bytes + r->kv_bytes <= len);
  check_data(r->q, r->q_bytes, r->q_copy, "q", r, buf, len);
  check_data(r->kv, r->kv_bytes, r->kv_copy, "kv", r, buf, len);
  /* q and kv never share bytes. */
  CHECK((const uint8_t *)r->q + r->q_bytes <= (const uint8_t *)r->kv ||
        (const uint8_t *)r->kv + r->kv_bytes <= (const uint8_t *)r->q);
  CHECK(r->n_segs >= 1 && r->n_segs <= MAX_SEGS && r->segs);
  for (uint32_t s = 0; s < r->n_segs; s++) {
    const dsv4_seg_req_t *sg = &r->segs[s];
    CHECK(sg->name && dsv4_seq_name_valid(sg->name, sg->name_len));
    CHECK(sg->len >= 1 && sg->start >= 0);
    CHECK(sg->start <= MAX_POS && sg->len <= MAX_POS - sg->start);
    CHECK(sg->is_new == 0 || sg->is_new == 1);
    CHECK(sg->hash == 0);
    total += sg->len;
  }
  CHECK(total == n);
  CHECK(r->want_q == 0 || r->want_q == 1);
  CHECK(r->want_digest == 0 || r->want_digest == 1);
  if (!dsv4_st_meta(&r->view, "outputs"))
    CHECK(r->want_q == 1 && r->want_digest == 0);
}

/* The decimal parser (kernels/decimal.h) with the Dsv4d-Deadline-Ms bound, on the input's first
 * bytes as a string. */
static void check_u64(const uint8_t *data, size_t size) {
  char s[32];
  size_t n = size < 24 ? size : 24, digits = 0;
  uint64_t max = UINT64_MAX / 1000000u, v = 0, ref = 0;
  int overflow = 0;
  memcpy(s, data, n);
  s[n] = '\0';
  n = strlen(s);
  while (digits < n && s[digits] >= '0' && s[digits] <= '9') {
    unsigned d = (unsigned)(s[digits] - '0');
    if (ref > (UINT64_MAX - d) / 10 || ref * 10 + d > max)
      overflow = 1;
    else
      ref = ref * 10 + d;
    digits++;
  }
  int rc = dsv4_parse_decimal(s, n, max, &v);
  if (rc == 0)
    CHECK(n >= 1 && n <= 20 && digits == n && !overflow && v == ref);
  else if (rc == DSV4_ERANGE)
    CHECK(n <= 20 && digits == n && overflow);
  else
    CHECK(rc == DSV4_EINVAL && (n == 0 || n > 20 || digits < n));
}

/* The input as a segments text: the fast reader and the JSON parser give the same answer. */
static void check_segments(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1), why_a[320], why_b[320];
  dsv4_forward_req_t a, b;
  CHECK(text);
  memcpy(text, data, size);
  text[size] = '\0';
  memset(&a, 0, sizeof(a));
  memset(&b, 0, sizeof(b));
  why_a[0] = why_b[0] = '\0';
  int ra = dsv4__forward_segments(text, MAX_SEGS, 0, &a, why_a, sizeof(why_a));
  int rb = dsv4__forward_segments(text, MAX_SEGS, 1, &b, why_b, sizeof(why_b));
  CHECK(ra == rb && strcmp(why_a, why_b) == 0);
  if (ra == 0) {
    CHECK(a.n_segs == b.n_segs);
    for (uint32_t s = 0; s < a.n_segs; s++) {
      CHECK(a.segs[s].name_len == b.segs[s].name_len);
      CHECK(memcmp(a.segs[s].name, b.segs[s].name, a.segs[s].name_len) == 0);
      CHECK(a.segs[s].start == b.segs[s].start && a.segs[s].len == b.segs[s].len);
      CHECK(a.segs[s].is_new == b.segs[s].is_new);
    }
  }
  dsv4_forward_req_free(&a);
  dsv4_forward_req_free(&b);
  free(text);
}

/* The body fed to its watcher in pieces of 1..4096 bytes (cut by an LCG seeded from the body): the
 * view it keeps parses as the body does (rc, the first parse's answer), and a check it hands over
 * (for tensors in place: none was copied) had fed every byte of the batch's tensors, unless a
 * value was out of range (the whole batch fed again then says so). */
static void check_arrival(const uint8_t *buf, size_t size, int rc) {
  dsv4_arrival_t *a = dsv4_arrival_begin(&limits, size);
  CHECK(a);
  uint64_t x = size * 0x9E3779B97F4A7C15ull + (size ? buf[size / 2] : 0);
  for (size_t have = 0; have < size;) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const size_t step = 1 + (size_t)(x >> 33) % 4096;
    have = step < size - have ? have + step : size;
    dsv4_arrival_seen(a, buf, have);
  }
  dsv4_forward_req_t r;
  char msg[320];
  memset(&r, 0, sizeof(r));
  int rc2;
  if (dsv4_arrival_take_view(a, buf, size, &r.view))
    rc2 = dsv4_forward_parse_view(&limits, &r, msg, sizeof(msg));
  else
    rc2 = dsv4_forward_parse(buf, size, &limits, &r, msg, sizeof(msg));
  CHECK(rc2 == rc);
  dsv4_check_t *c = rc2 == 0 ? dsv4_arrival_take_check(a, &r) : NULL;
  if (c) {
    CHECK(!r.q_copy && !r.kv_copy && !r.c_copy[0] && !r.c_copy[1] && !r.c_copy[2] && !r.c_copy[3]);
    const void *all[DSV4_CHECK_TENSORS] = {r.q, r.kv, r.ckv, r.ikv, r.iq, r.iw};
    const size_t bytes[DSV4_CHECK_TENSORS] = {r.q_bytes,    r.kv_bytes,   r.c_bytes[0],
                                              r.c_bytes[1], r.c_bytes[2], r.c_bytes[3]};
    const size_t sizes[DSV4_CHECK_TENSORS] = {2, 2, 4, 4, 2, 4};
    size_t vals[DSV4_CHECK_TENSORS], total = 0;
    for (int k = 0; k < DSV4_CHECK_TENSORS; k++) {
      vals[k] = k < dsv4_check_tensors(r.ratio) ? bytes[k] / sizes[k] : 0;
      total += vals[k] * sizes[k];
    }
    const size_t fed = dsv4_check_fed_bytes(c);
    CHECK(dsv4_check_feed(c, all, vals) == 1 || fed == total);
    dsv4_check_free(c);
  }
  dsv4_forward_req_free(&r);
  dsv4_arrival_end(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A private copy, so reads past the end are caught by ASan whatever libFuzzer's buffer is. */
  uint8_t *buf = malloc(size ? size : 1);
  dsv4_forward_req_t r, r2;
  char msg[320], small[12];
  CHECK(buf);
  memcpy(buf, data, size);
  check_u64(data, size);
  check_segments(data, size);

  msg[0] = '\0';
  int rc = dsv4_forward_parse(buf, size, &limits, &r, msg, sizeof(msg));
  if (rc == 0) {
    check_accepted(&r, buf, size);
  } else {
    CHECK(rc == DSV4_EINVAL || rc == DSV4_ELAYER || rc == DSV4_EPOSRANGE || rc == DSV4_ENOMEM);
    /* Every refusal but a failed allocation says why. */
    CHECK(rc == DSV4_ENOMEM || msg[0] != '\0');
  }

  /* The same body again with a tiny message buffer: same answer, the message cut short. */
  small[0] = '\0';
  int rc2 = dsv4_forward_parse(buf, size, &limits, &r2, small, sizeof(small));
  CHECK(rc2 == rc);
  if (rc) {
    CHECK(strlen(small) < sizeof(small));
    CHECK(strncmp(small, msg, strlen(small)) == 0);
  } else {
    CHECK(r2.n_tokens == r.n_tokens && r2.n_segs == r.n_segs && r2.layer == r.layer);
  }
  dsv4_forward_req_free(&r2);
  check_arrival(buf, size, rc);

  dsv4_forward_req_free(&r);
  /* Released means emptied: a second free is harmless. */
  CHECK(r.segs == NULL && r.segs_doc == NULL && r.q_copy == NULL && r.kv_copy == NULL &&
        r.view.doc == NULL && r.view.tensors == NULL);
  dsv4_forward_req_free(&r);
  free(buf);
  return 0;
}
