#ifndef DSV4_SERVER_KVWEIGHTS_H
#define DSV4_SERVER_KVWEIGHTS_H

#include <stddef.h>
#include <stdint.h>

/*
 * Load the per-layer kv_norm weights for kv_norm = fused from a safetensors file: for each served
 * layer L a tensor "layers.L.attn.kv_norm.weight" (or "layers.L.kv_norm.weight"), BF16 or F32,
 * shape [512], finite with |w| < 2^32. *out gets [n_served][512] fp32 (malloc'd). why says what is
 * wrong.
 */
int dsv4_kv_norm_weights_load(const char *path, const uint32_t *served_layers, uint32_t n_served,
                              float **out, char *why, size_t why_len);

#endif /* DSV4_SERVER_KVWEIGHTS_H */
