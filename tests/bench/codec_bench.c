/*
 * codec_bench: a forward's safetensors headers on the loop thread, µs a call. The request header
 * of a decode of T one-token segments parsed (dsv4_st_parse, which reads the usual header without
 * a JSON document, against dsv4__st_parse_reference, jansson's document), and the answer's header
 * written (dsv4_st_build_header against dsv4__st_build_header_reference), and its segments text
 * read (dsv4__forward_segments, without a document and with one). Ceiling: a memcpy of the same
 * header bytes, what they cost without the work.
 *
 *   codec_bench [--tokens 1,16,64] [--calls N]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dsv4-layout.h"
#include "forward_parse.h"
#include "safetensors.h"

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static volatile size_t sink;

/* The segments text of T one-token segments, as a gateway writes it. */
static void segments_text(int tokens, char *segs, size_t cap) {
  size_t n = 0;
  n += (size_t)snprintf(segs + n, cap - n, "[");
  for (int s = 0; s < tokens; s++)
    n += (size_t)snprintf(segs + n, cap - n, "%s{\"seq\":\"seq-%d\",\"start\":%d,\"len\":1}",
                          s ? "," : "", s, 1000 + s);
  snprintf(segs + n, cap - n, "]");
}

static double time_segments(const char *text, int fast, int calls) {
  char why[320];
  double t0 = now_us();
  for (int i = 0; i < calls; i++) {
    dsv4_forward_req_t r;
    memset(&r, 0, sizeof(r));
    if (dsv4__forward_segments(text, 4096, fast, &r, why, sizeof(why)))
      exit(1);
    sink += r.n_segs;
    dsv4_forward_req_free(&r);
  }
  return (now_us() - t0) / calls;
}

/* The request body of T one-token segments of 64 heads, as a client sends it (its header written
 * by the reference writer, the segments text escaped in the metadata). */
static uint8_t *request(int tokens, size_t *len, size_t *hlen) {
  char segs[8192];
  segments_text(tokens, segs, sizeof(segs));
  const int64_t t = tokens;
  dsv4_st_desc_t d[2] = {
      {"q", DSV4_ST_BF16, 3, {t, 64, DSV4_HEAD_DIM}, (size_t)t * 64 * DSV4_HEAD_DIM * 2},
      {"kv", DSV4_ST_BF16, 2, {t, DSV4_HEAD_DIM}, (size_t)t * DSV4_HEAD_DIM * 2}};
  dsv4_st_meta_t m[3] = {{"layer", "3"}, {"segments", segs}, {"outputs", "q"}};
  uint8_t *h;
  size_t dl;
  if (dsv4__st_build_header_reference(d, 2, m, 3, &h, hlen, &dl))
    exit(1);
  uint8_t *body = calloc(1, *hlen + dl);
  if (!body)
    exit(1);
  memcpy(body, h, *hlen);
  free(h);
  *len = *hlen + dl;
  return body;
}

typedef int (*parse_fn)(const uint8_t *, size_t, dsv4_st_view_t *);
typedef int (*build_fn)(const dsv4_st_desc_t *, size_t, const dsv4_st_meta_t *, size_t, uint8_t **,
                        size_t *, size_t *);

static double time_parse(parse_fn f, const uint8_t *b, size_t len, int calls) {
  double t0 = now_us();
  for (int i = 0; i < calls; i++) {
    dsv4_st_view_t v;
    if (f(b, len, &v))
      exit(1);
    sink += v.n_tensors;
    dsv4_st_view_free(&v);
  }
  return (now_us() - t0) / calls;
}

static double time_build(build_fn f, int tokens, int calls) {
  const int64_t t = tokens;
  dsv4_st_desc_t d[2] = {
      {"q_out", DSV4_ST_BF16, 3, {t, 64, DSV4_HEAD_DIM}, (size_t)t * 64 * DSV4_HEAD_DIM * 2},
      {"slots", DSV4_ST_I64, 1, {t}, (size_t)t * 8}};
  dsv4_st_meta_t m[1] = {{"cache_digest", "0123456789abcdef"}};
  double t0 = now_us();
  for (int i = 0; i < calls; i++) {
    uint8_t *h;
    size_t hl, dl;
    if (f(d, 2, m, 1, &h, &hl, &dl))
      exit(1);
    sink += hl;
    free(h);
  }
  return (now_us() - t0) / calls;
}

static double time_copy(const uint8_t *b, size_t n, int calls) {
  char *dst = malloc(n);
  if (!dst)
    exit(1);
  double t0 = now_us();
  for (int i = 0; i < calls; i++) {
    memcpy(dst, b, n);
    __asm__ volatile("" : : "r"(dst) : "memory");
  }
  double us = (now_us() - t0) / calls;
  free(dst);
  return us;
}

int main(int argc, char **argv) {
  const char *tokens = "1,16,64";
  int calls = 100000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--tokens"))
      tokens = argv[i + 1];
    else if (!strcmp(argv[i], "--calls"))
      calls = atoi(argv[i + 1]);
  }
  printf("# codec_bench: a decode's request header parsed and its answer's header written, us a "
         "call (%d calls)\n",
         calls);
  printf(
      "tokens  header B | parse  parse(doc)  copy | write  write(doc) | segments  segments(doc)\n");
  for (const char *p = tokens; *p;) {
    int t = atoi(p);
    size_t len, hlen;
    uint8_t *b = request(t, &len, &hlen);
    double pf = time_parse(dsv4_st_parse, b, len, calls);
    double pr = time_parse(dsv4__st_parse_reference, b, len, calls);
    double cp = time_copy(b, hlen, calls);
    double wf = time_build(dsv4_st_build_header, t, calls);
    double wr = time_build(dsv4__st_build_header_reference, t, calls);
    char segs[8192];
    segments_text(t, segs, sizeof(segs));
    double sf = time_segments(segs, 1, calls), sr = time_segments(segs, 0, calls);
    printf("%6d  %8zu | %5.2f  %10.2f  %4.2f | %5.2f  %10.2f | %8.2f  %13.2f\n", t, hlen, pf, pr,
           cp, wf, wr, sf, sr);
    free(b);
    const char *comma = strchr(p, ',');
    p = comma ? comma + 1 : p + strlen(p);
  }
  printf("# ceiling: copy = a memcpy of the request header's bytes; segments: the segments text "
         "read (doc: with jansson's document)\n");
  return sink == 0;
}
