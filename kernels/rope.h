#ifndef DSV4_KERNELS_ROPE_H
#define DSV4_KERNELS_ROPE_H

/*
 * RoPE tables (SPEC §2.3). Row `pos` holds cos[0..31] then sin[0..31] (fp32) of the fp32 angle
 * (float)pos * inv_freq[i], correctly rounded. Tables are computed on the host and shared bit for
 * bit by every backend. Rows are materialised lazily in chunks, so a daemon that only ever sees
 * positions below 10,000 never pays for the 256 MiB a full table would take.
 */

#include <stddef.h>
#include <stdint.h>

#include "dsv4-layout.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_MAX_POSITION_DEFAULT 1048576
#define DSV4_ROPE_CHUNK_ROWS 256

typedef struct {
  double theta;  /* rope_theta (plain layers) or compress_rope_theta */
  int yarn;      /* 1: YaRN scaling (ratio >= 2 layers with type yarn/deepseek_yarn) */
  double factor; /* YaRN factor */
  double original_max_position; /* YaRN original_max_position_embeddings */
  double beta_fast, beta_slow;  /* YaRN correction range, default 32 and 1 */
} dsv4_rope_params_t;

/* The built-in V4 parameters: plain (theta 10000) and YaRN (theta 160000, factor 16, 65536, 32/1).
 */
extern const dsv4_rope_params_t dsv4_rope_plain_default;
extern const dsv4_rope_params_t dsv4_rope_yarn_default;

/*
 * The 32 fp32 inverse frequencies for p. For the built-in parameter sets these are the exact bit
 * patterns SPEC §2.3 lists; otherwise the SPEC recipe computes them.
 */
void dsv4_rope_inv_freq(const dsv4_rope_params_t *p, float inv_freq[DSV4_ROPE_PAIRS]);

/* The SPEC recipe alone, never the built-in lists (for tests and custom geometries). */
void dsv4_rope_inv_freq_recipe(const dsv4_rope_params_t *p, float inv_freq[DSV4_ROPE_PAIRS]);

/* One table row: out[i] = cos, out[32 + i] = sin of (float)pos * inv_freq[i], correctly rounded. */
void dsv4_rope_row_compute(const float inv_freq[DSV4_ROPE_PAIRS], int64_t pos,
                           float out[DSV4_ROPE_ROW_FLOATS]);

typedef struct dsv4_rope_table dsv4_rope_table_t;

/* A lazily materialised table for positions 0..max_positions-1. */
int dsv4_rope_table_create(const float inv_freq[DSV4_ROPE_PAIRS], int64_t max_positions,
                           dsv4_rope_table_t **out);
void dsv4_rope_table_destroy(dsv4_rope_table_t *t);

/*
 * Materialise the rows of positions[0..n-1] (each 0 <= pos < max_positions). Call from one thread
 * at a time (the executor); rows once materialised never change, so any thread may read them
 * afterwards.
 */
int dsv4_rope_table_ensure(dsv4_rope_table_t *t, const int64_t *positions, size_t n);
/* Materialise rows first..first+count-1. */
int dsv4_rope_table_ensure_range(dsv4_rope_table_t *t, int64_t first, int64_t count);

/* The row of pos; it must have been materialised. */
const float *dsv4_rope_table_row(const dsv4_rope_table_t *t, int64_t pos);

/* Bytes currently materialised (for metrics and the README's memory statement). */
size_t dsv4_rope_table_bytes(const dsv4_rope_table_t *t);

/* The positions the table covers (max_positions at creation). Any thread. */
int64_t dsv4_rope_table_positions(const dsv4_rope_table_t *t);

/*
 * For a device backend that mirrors the rows: the rows of chunk c (positions from
 * c * DSV4_ROPE_CHUNK_ROWS, *rows of them, fewer in the last chunk), contiguous, or NULL while the
 * chunk is not materialised. A chunk appears only in dsv4_rope_table_ensure*, and
 * dsv4_rope_table_bytes grows with every one, so a mirror rescans only when that changed. Any
 * thread.
 */
const float *dsv4_rope_table_chunk(const dsv4_rope_table_t *t, int64_t c, int64_t *rows);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_ROPE_H */
