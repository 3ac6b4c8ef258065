#ifndef DSV4_SERVER_WEIGHTS_H
#define DSV4_SERVER_WEIGHTS_H

/*
 * The small per-layer tensors the daemon reads from a published checkpoint (SPEC §7, §8.2): the
 * attention sinks and the kv_norm weights. `weights` names a safetensors file, or a directory with
 * a HuggingFace `model.safetensors.index.json` and its shards. Files are memory-mapped and only the
 * headers and the few tensors asked for are read, so a checkpoint of hundreds of gigabytes costs
 * its headers' pages. Names are looked up as given and with a `model.` prefix.
 *
 * Thread affinity: start-up only (one thread).
 */

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

typedef struct dsv4_weights dsv4_weights_t;

/* Open a checkpoint; why says which file and what is wrong. */
int dsv4_weights_open(const char *path, dsv4_weights_t **out, char *why, size_t why_len);
void dsv4_weights_close(dsv4_weights_t *w);

/* A tensor by name (or "model." + name) and the file holding it; NULL when no file has it. */
const dsv4_st_tensor_t *dsv4_weights_find(dsv4_weights_t *w, const char *name, const char **file);

/*
 * Read elements first..first+count-1 of the 1-D tensor `name` of length n as fp32: F32 as stored,
 * BF16 widened exactly. Missing, another dtype or another shape: DSV4_ECONFIG, and why names the
 * tensor, the file and what was expected.
 */
int dsv4_weights_read_f32(dsv4_weights_t *w, const char *name, int64_t n, int64_t first,
                          int64_t count, float *out, char *why, size_t why_len);

/*
 * Read the whole tensor `name` of the given shape as fp32 (F32 as stored, BF16 widened exactly),
 * refusing a non-finite element. Errors as dsv4_weights_read_f32.
 */
int dsv4_weights_read_f32_shape(dsv4_weights_t *w, const char *name, uint32_t ndim,
                                const int64_t *shape, float *out, char *why, size_t why_len);

/* The compressor's small tensors of one served layer of ratio 4 or 128 (SPEC §8.2), fp32. */
typedef struct {
  float *ape;    /* [ratio, coff * 512] */
  float *norm;   /* [512] */
  float *i_ape;  /* ratio 4: [4, 256] the indexer compressor's, else NULL */
  float *i_norm; /* ratio 4: [128], else NULL */
} dsv4_compressor_weights_t;

/* What the engine needs of the checkpoint for the served layers. */
typedef struct {
  float *kv_norm; /* [n_served][512] for kv_norm = fused, else NULL */
  float *sinks;   /* [n_served][heads]: attn_sink[head_offset .. head_offset + heads) */
  /* [n_served], or NULL when not asked for; an entry of a layer without a compressed branch (ratio
   * other than 4 and 128) has NULL members. */
  dsv4_compressor_weights_t *comp;
  uint32_t n_comp;
} dsv4_layer_weights_t;

typedef struct {
  const uint32_t *served_layers;
  uint32_t n_served;
  uint32_t total_heads; /* the model's num_attention_heads: attn_sink's length */
  uint32_t head_offset;
  uint32_t heads;
  int kv_norm; /* load the kv_norm weights too */
  int sinks;   /* load the attention sinks */
  /* [n_served] compress ratio of each served layer, or NULL: load the compressor tensors of every
   * served layer of ratio 4 or 128. */
  const uint32_t *ratios;
} dsv4_layer_weights_req_t;

/* Load what req asks for; why names the tensor and the file on failure. */
int dsv4_layer_weights_load(dsv4_weights_t *w, const dsv4_layer_weights_req_t *req,
                            dsv4_layer_weights_t *out, char *why, size_t why_len);
void dsv4_layer_weights_free(dsv4_layer_weights_t *lw);

#endif /* DSV4_SERVER_WEIGHTS_H */
