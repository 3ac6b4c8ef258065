#ifndef DSV4_CONFIG_MODEL_H
#define DSV4_CONFIG_MODEL_H

/*
 * Model geometry (SPEC §1): the built-in V4-Flash values, or a HuggingFace-style config.json.
 * The daemon serves one attention geometry (head_dim 512, qk_rope_head_dim 64, sliding_window 128);
 * a config.json with other values is refused with an error naming the key, because silently serving
 * a different geometry would corrupt every cache byte.
 */

#include <stddef.h>
#include <stdint.h>

#include "rope.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  uint32_t num_attention_heads;
  uint32_t head_dim;         /* always 512 */
  uint32_t qk_rope_head_dim; /* always 64 */
  uint32_t sliding_window;   /* always 128 */
  uint32_t num_hidden_layers;
  uint32_t num_nextn_predict_layers;
  uint32_t n_layers_total; /* num_hidden_layers + num_nextn_predict_layers */
  float rms_norm_eps;
  int64_t max_position_embeddings;
  uint32_t *compress_ratios;        /* [n_layers_total], owned */
  dsv4_rope_params_t rope_plain;    /* layers of ratio 0 or 1 */
  dsv4_rope_params_t rope_compress; /* layers of ratio >= 2 */
  /* The indexer of the ratio-4 layers (SPEC §8.5): entries each query keeps, and its heads (the
   * head dim is always 128). */
  uint32_t index_topk;
  uint32_t index_n_heads;
  uint32_t index_head_dim;
  char *name; /* "builtin:V4-Flash" or the file path, owned */
} dsv4_model_t;

/* The V4-Flash defaults of SPEC §1. Returns 0 or DSV4_ENOMEM. Free with dsv4_model_free. */
int dsv4_model_builtin_flash(dsv4_model_t *m);

/*
 * Parse a HuggingFace-style config.json. Keys absent from the file take the V4-Flash value, except
 * num_attention_heads, num_hidden_layers and compress_ratios, which are required, and
 * num_nextn_predict_layers, which is 0 when absent (compress_ratios must then have exactly
 * num_hidden_layers entries). RoPE scaling
 * comes from `rope_parameters` (flat, or nested `main`/`compress`), else from `rope_scaling`;
 * `type` and `rope_type` are synonyms. Returns 0, or DSV4_ECONFIG with a message in why naming the
 * key. On error *m is left zeroed (nothing to free).
 */
int dsv4_model_load_file(dsv4_model_t *m, const char *path, char *why, size_t why_len);
int dsv4_model_load_json(dsv4_model_t *m, const char *json_text, char *why, size_t why_len);

/*
 * The RoPE parameters of one layer: ratio 0/1 gives rope_plain, ratio >= 2 rope_compress (YaRN only
 * when the scaling type is yarn/deepseek_yarn; otherwise the plain recipe with
 * compress_rope_theta). NULL when layer >= n_layers_total.
 */
const dsv4_rope_params_t *dsv4_model_layer_rope(const dsv4_model_t *m, uint32_t layer);

/* Releases what the model owns and zeroes it; safe on a zeroed or already freed model. */
void dsv4_model_free(dsv4_model_t *m);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_CONFIG_MODEL_H */
