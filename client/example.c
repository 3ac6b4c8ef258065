/*
 * libdsv4client's example (README, "Shared regions"): a 4-token prefill then a 1-token decode of
 * one sequence through a shared region, q and kv written in place, the outputs read in place.
 *
 *   dsv4client_example /run/dsv4d/shm.sock [heads] [sequence]
 *
 * prints one line per batch: status, cache_digest and the first q_out value, or the error. The
 * inputs are a fixed pattern (value i of q or kv: the bf16 bits 0x3F80 + 7i mod 128, negative when
 * i / 3 is odd), so another client can send the same batch over HTTP and compare.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4client.h"

static void fill(uint16_t *x, size_t n) {
  for (size_t i = 0; i < n; i++)
    x[i] = (uint16_t)(((i / 3) & 1) << 15 | (0x3F80 + (7 * i) % 128));
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s <listen_shm socket> [heads] [sequence]\n", argv[0]);
    return 2;
  }
  uint32_t heads = argc > 2 ? (uint32_t)atoi(argv[2]) : 64;
  const char *seq = argc > 3 ? argv[3] : "example";
  dsv4c_client_t *c;
  dsv4c_region_t *r;
  dsv4c_result_t res;
  int rc = dsv4c_connect(argv[1], getenv("DSV4D_TOKEN"), &c);
  if (rc) {
    fprintf(stderr, "connect: %s\n", strerror(-rc));
    return 1;
  }
  /* Room for 4 tokens: q, kv, q_out and slots, each from a 64-byte boundary. */
  size_t q_bytes = (size_t)4 * heads * 512 * 2, kv_bytes = (size_t)4 * 512 * 2;
  rc = dsv4c_region_create(c, 2 * q_bytes + kv_bytes + 64, &r, &res);
  if (rc) {
    fprintf(stderr, "region: %s %s\n", rc == -EPROTO ? res.code : strerror(-rc), res.message);
    dsv4c_result_free(&res);
    dsv4c_close(c);
    return 1;
  }
  dsv4c_result_free(&res);
  uint8_t *base = dsv4c_region_data(r);
  dsv4c_forward_t f = {
      .layer = 0,
      .heads = heads,
      .outputs = "q,digest",
      .q_off = 0,
      .kv_off = q_bytes,
      .q_out_off = q_bytes + kv_bytes,
      .slots_off = 2 * q_bytes + kv_bytes,
      .deadline_ms = -1,
  };
  for (int step = 0; step < 2 && rc == 0; step++) {
    dsv4c_segment_t seg = {seq, step ? 4 : 0, step ? 1 : 4, !step};
    f.segs = &seg;
    f.n_segs = 1;
    fill((uint16_t *)(void *)(base + f.q_off), (size_t)seg.len * heads * 512);
    fill((uint16_t *)(void *)(base + f.kv_off), (size_t)seg.len * 512);
    rc = dsv4c_forward(c, r, &f, &res);
    if (rc)
      fprintf(stderr, "forward: %s\n", strerror(-rc));
    else if (res.status != 200)
      printf("%d %s %s\n", res.status, res.code, res.message);
    else
      printf("200 %s 0x%04x\n", res.cache_digest, *(const uint16_t *)(void *)(base + f.q_out_off));
    if (!rc && res.status != 200)
      rc = 1;
    dsv4c_result_free(&res);
  }
  if (dsv4c_region_destroy(c, r) && !rc)
    rc = 1;
  dsv4c_close(c);
  return rc ? 1 : 0;
}
