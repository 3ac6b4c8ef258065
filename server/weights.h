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

/* What the engine needs of the checkpoint for the served layers. */
typedef struct {
  float *kv_norm; /* [n_served][512] for kv_norm = fused, else NULL */
  float *sinks;   /* [n_served][heads]: attn_sink[head_offset .. head_offset + heads) */
} dsv4_layer_weights_t;

typedef struct {
  const uint32_t *served_layers;
  uint32_t n_served;
  uint32_t total_heads; /* the model's num_attention_heads: attn_sink's length */
  uint32_t head_offset;
  uint32_t heads;
  int kv_norm; /* load the kv_norm weights too */
  int sinks;   /* load the attention sinks */
} dsv4_layer_weights_req_t;

/* Load what req asks for; why names the tensor and the file on failure. */
int dsv4_layer_weights_load(dsv4_weights_t *w, const dsv4_layer_weights_req_t *req,
                            dsv4_layer_weights_t *out, char *why, size_t why_len);
void dsv4_layer_weights_free(dsv4_layer_weights_t *lw);

#endif /* DSV4_SERVER_WEIGHTS_H */
