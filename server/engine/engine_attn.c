/*
 * Attention in the engine (SPEC §7): which batches may ask for it, the sinks of the served layers,
 * and the arguments of the backend's attention launch, built from the arrays the slot map already
 * uses. The launch itself is ordered after the batch's insert by the backend (SPEC §5.2).
 */
#include "engine-internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-error.h"

int dsv4__engine_attn_setup(dsv4_engine_t *e, char *why, size_t why_len) {
  if (e->p.attention_mode == DSV4_ATTENTION_FAST && !(e->be->ops->caps & DSV4_BE_ATTN_FAST)) {
    snprintf(why, why_len, "attention_mode fast is not offered by backend %s; use exact",
             e->be->ops->name);
    return DSV4_ECONFIG;
  }
  if (!e->p.attn_sinks)
    return 0;
  size_t n = (size_t)e->p.n_served * e->p.heads;
  e->sinks = malloc(n * sizeof(float));
  if (!e->sinks)
    return DSV4_ENOMEM;
  memcpy(e->sinks, e->p.attn_sinks, n * sizeof(float));
  e->p.attn_sinks = NULL; /* the caller's array need not outlive the engine */
  return 0;
}

int dsv4_engine_attention_default(const dsv4_engine_t *e) {
  return e->p.attention_mode == DSV4_ATTENTION_FAST ? DSV4_ATTENTION_FAST : DSV4_ATTENTION_EXACT;
}

int dsv4_engine_attention_mode(const dsv4_engine_t *e, uint32_t layer, int requested) {
  (void)layer; /* every layer the backend runs attention on has both modes (fast: the backend's) */
  if (requested != DSV4_ATTENTION_DEFAULT)
    return requested;
  return dsv4_engine_attention_default(e);
}

int dsv4_engine_attention_check(const dsv4_engine_t *e, uint32_t layer, int mode, char *why,
                                size_t why_len) {
  const dsv4_backend_ops_t *ops = e->be->ops;
  const dsv4_model_t *m = e->p.model;
  if (layer < m->n_layers_total && m->compress_ratios[layer] >= 2 &&
      !dsv4_engine_layer_ratio(e, layer)) {
    uint32_t r = m->compress_ratios[layer];
    char missing[160];
    if (r != 4 && r != 128)
      snprintf(missing, sizeof(missing), "the branch exists for ratios 4 and 128 only");
    else if (!e->sinks)
      snprintf(missing, sizeof(missing),
               "it needs the weights option: a checkpoint with the layer's compressor");
    else
      snprintf(missing, sizeof(missing), "backend %s does not run the branch yet", ops->name);
    snprintf(why, why_len,
             "layer %u has compress ratio %u: its attention includes the compressed branch (SPEC "
             "§8), which this daemon does not run (%s); ask this layer for outputs q or digest",
             layer, r, missing);
    return DSV4_EUNSUPPORTED;
  }
  if (!e->sinks) {
    snprintf(why, why_len,
             "outputs attn and lse need the weights option (a checkpoint holding "
             "layers.L.attn.attn_sink); this daemon was started without it");
    return DSV4_EUNSUPPORTED;
  }
  if (!ops->attention) {
    snprintf(why, why_len,
             "backend %s has no attention on this device; ask this layer for outputs q or digest",
             ops->name);
    return DSV4_EUNSUPPORTED;
  }
  if (mode == DSV4_ATTENTION_FAST && !(ops->caps & DSV4_BE_ATTN_FAST)) {
    snprintf(why, why_len, "attention \"fast\" is not offered by backend %s; use \"exact\"",
             ops->name);
    return DSV4_EUNSUPPORTED;
  }
  return 0;
}

void dsv4__engine_attn_args(dsv4_engine_t *e, uint32_t idx, const dsv4_forward_t *f,
                            const dsv4_map_args_t *ma, dsv4_attn_args_t *aa) {
  *aa = (dsv4_attn_args_t){
      .n_tokens = f->n_tokens,
      .n_segments = f->n_segs,
      .heads = e->p.heads,
      .q = f->q_out,
      .positions = ma->positions,
      .tok_seg = ma->tok_seg,
      .seg_p0 = e->seg_p0,
      .seg_first_lb = ma->seg_first_lb,
      .seg_bt_off = ma->seg_bt_off,
      .seg_bt_len = ma->seg_bt_len,
      .block_table = ma->block_table,
      .bt_entries = ma->bt_entries,
      .cache = e->cache[idx].ptr,
      .block_size = e->p.block_size,
      .n_blocks = e->p.kv_blocks,
      .stride = e->stride,
      .sink = e->sinks + (size_t)idx * e->p.heads,
      .rope = e->rope[idx],
      .out = f->attn,
      .lse = f->lse,
      .fast = f->attention == DSV4_ATTENTION_FAST,
  };
}
