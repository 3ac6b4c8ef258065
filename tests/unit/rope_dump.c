/*
 * Writes rows 0..rows-1 of the built-in plain or YaRN RoPE table to stdout as little-endian fp32,
 * 64 floats per row, so that a test can compare the SHA-256 of the whole table with SPEC §2.3.
 *
 *   rope_dump plain|yarn [rows]      (rows defaults to 1,048,576)
 *
 * Rows are computed by two threads, each taking half of every block, and written in order.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rope.h"

#define BLOCK_ROWS 32768

typedef struct {
  const float *inv_freq;
  int64_t first, count;
  float *out;
} job_t;

static void *run_job(void *arg) {
  job_t *j = arg;
  for (int64_t r = 0; r < j->count; r++)
    dsv4_rope_row_compute(j->inv_freq, j->first + r, j->out + r * DSV4_ROPE_ROW_FLOATS);
  return NULL;
}

/* The table bytes are little-endian fp32; on a big-endian host each word is swapped first. */
static void to_little_endian(float *buf, size_t n) {
  const uint32_t one = 1;
  unsigned char probe;
  memcpy(&probe, &one, 1);
  if (probe == 1)
    return;
  for (size_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &buf[i], 4);
    u = (u >> 24) | ((u >> 8) & 0xff00u) | ((u << 8) & 0xff0000u) | (u << 24);
    memcpy(&buf[i], &u, 4);
  }
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (strcmp(argv[1], "plain") != 0 && strcmp(argv[1], "yarn") != 0)) {
    fprintf(stderr, "usage: %s plain|yarn [rows]\n", argv[0]);
    return 2;
  }
  const dsv4_rope_params_t *p =
      strcmp(argv[1], "plain") == 0 ? &dsv4_rope_plain_default : &dsv4_rope_yarn_default;
  int64_t rows = argc == 3 ? strtoll(argv[2], NULL, 10) : DSV4_MAX_POSITION_DEFAULT;
  if (rows <= 0) {
    fprintf(stderr, "rows must be positive\n");
    return 2;
  }
  float inv_freq[DSV4_ROPE_PAIRS];
  dsv4_rope_inv_freq(p, inv_freq);
  float *buf = malloc((size_t)BLOCK_ROWS * DSV4_ROPE_ROW_FLOATS * sizeof(float));
  if (!buf) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (int64_t first = 0; first < rows; first += BLOCK_ROWS) {
    int64_t n = rows - first < BLOCK_ROWS ? rows - first : BLOCK_ROWS;
    int64_t half = n / 2;
    job_t a = {inv_freq, first, half, buf};
    job_t b = {inv_freq, first + half, n - half, buf + half * DSV4_ROPE_ROW_FLOATS};
    pthread_t tid;
    int threaded = pthread_create(&tid, NULL, run_job, &b) == 0;
    run_job(&a);
    if (threaded)
      pthread_join(tid, NULL);
    else
      run_job(&b);
    size_t floats = (size_t)n * DSV4_ROPE_ROW_FLOATS;
    to_little_endian(buf, floats);
    if (fwrite(buf, sizeof(float), floats, stdout) != floats) {
      fprintf(stderr, "write failed\n");
      free(buf);
      return 1;
    }
  }
  free(buf);
  return fflush(stdout) == 0 ? 0 : 1;
}
