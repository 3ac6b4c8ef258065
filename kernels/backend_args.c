/*
 * The argument checks every backend makes before it writes anything (backend.h). They live apart
 * from the registry (backend.c) so that each backend can call them without linking the others.
 */
#include "backend.h"

int dsv4_backend_check_map_args(const dsv4_map_args_t *a) {
  if (!a || !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->positions || !a->tok_seg || !a->seg_first_lb || !a->seg_bt_off || !a->seg_bt_len ||
      !a->slots || ((a->n_segments || a->bt_entries) && !a->block_table))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_backend_check_insert_args(const dsv4_insert_args_t *a) {
  if (!a || a->heads < 1 || a->heads > DSV4_MAX_HEADS)
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->q || !a->kv || !a->positions || !a->slots || !a->q_out)
    return DSV4_EINVAL;
  if (a->write_kv && (!a->cache || !DSV4_BLOCK_SIZE_VALID(a->block_size) ||
                      a->stride != DSV4_BLOCK_STRIDE(a->block_size)))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_backend_check_attn_args(const dsv4_attn_args_t *a) {
  if (!a || a->heads < 1 || a->heads > DSV4_MAX_HEADS || !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->q || !a->positions || !a->tok_seg || !a->seg_p0 || !a->seg_first_lb || !a->seg_bt_off ||
      !a->seg_bt_len || !a->cache || !a->rope || !a->out || a->n_segments == 0 ||
      a->n_blocks == 0 || !a->block_table || a->stride != DSV4_BLOCK_STRIDE(a->block_size))
    return DSV4_EINVAL;
  /* The fused decode path is a backend's own (DSV4_BE_ATTN_FUSED_Q), checked where it runs: a
   * backend that takes this check computes from q_out and must not read a raw q as one. */
  if (a->q_raw)
    return DSV4_EINVAL;
  if ((uintptr_t)a->win % 16 != 0)
    return DSV4_EINVAL;
  /* A selection without a compressed cache is a caller's mistake, not an SWA-only launch. */
  if (!a->c_cache)
    return a->c_sel ? DSV4_EINVAL : 0;
  if ((a->ratio != 4 && a->ratio != 128) || !a->seg_c_first_lb || !a->seg_cbt_off ||
      !a->seg_cbt_len || !a->c_block_table || a->c_n_blocks == 0 ||
      (a->c_sel && a->c_sel_stride == 0))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_attn_windows(const dsv4_attn_args_t *a, dsv4_attn_win_t *win) {
  _Static_assert(sizeof(dsv4_attn_win_t) == 64, "a window is one 64-byte line");
  _Static_assert(DSV4_ATTN_WIN_BLOCKS >= DSV4_WINDOW / DSV4_MIN_BLOCK_SIZE + 1, "window blocks");
  const int64_t bs = a->block_size;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    const int32_t s = a->tok_seg[t];
    if (s < 0 || (uint32_t)s >= a->n_segments)
      return DSV4_EINVAL;
    const int64_t p = a->positions[t], p0 = a->seg_p0[s];
    if (p0 < 0 || p < p0)
      return DSV4_EINVAL;
    dsv4_attn_win_t *w = &win[t];
    w->lo = DSV4_WINDOW_LO(p, p0);
    w->n = (uint32_t)(p - w->lo + 1);
    w->reserved = 0;
    for (int64_t k = 0; k < DSV4_ATTN_WIN_BLOCKS; k++) {
      const int64_t lb = w->lo / bs + k, idx = lb - a->seg_first_lb[s];
      w->blk[k] = -1;
      if (lb > p / bs)
        continue;
      if (idx < 0 || idx >= (int64_t)a->seg_bt_len[s])
        return DSV4_EINVAL;
      const uint64_t e = (uint64_t)a->seg_bt_off[s] + (uint64_t)idx;
      if (a->bt_entries && e >= a->bt_entries)
        return DSV4_EINVAL;
      const int32_t b = a->block_table[e];
      if (b < 0 || (uint32_t)b >= a->n_blocks)
        return DSV4_EINVAL;
      w->blk[k] = b;
    }
  }
  return 0;
}

int dsv4_backend_check_compress_args(const dsv4_compress_args_t *a) {
  if (!a || (a->ratio != 4u && a->ratio != 128u) || !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->positions || !a->tok_seg || !a->seg_p0 || !a->seg_slot || !a->ckv || !a->ring ||
      !a->ape || !a->norm_weight || !a->rope || !a->seg_c_first_lb || !a->seg_cbt_off ||
      !a->seg_cbt_len || !a->c_block_table || !a->c_cache || a->n_segments == 0 ||
      a->n_slots == 0 || a->stride != DSV4_BLOCK_STRIDE(a->block_size))
    return DSV4_EINVAL;
  if (a->ratio == 4u && (!a->ikv || !a->i_ape || !a->i_norm_weight || !a->i_cache))
    return DSV4_EINVAL;
  return 0;
}

int dsv4_backend_check_indexer_args(const dsv4_indexer_args_t *a) {
  if (!a || a->topk == 0 || a->n_heads == 0 || a->n_heads > DSV4_MAX_HEADS ||
      !DSV4_BLOCK_SIZE_VALID(a->block_size))
    return DSV4_EINVAL;
  if (a->n_tokens == 0)
    return 0;
  if (!a->positions || !a->tok_seg || !a->seg_p0 || !a->iq || !a->iw || !a->rope ||
      !a->seg_c_first_lb || !a->seg_cbt_off || !a->seg_cbt_len || !a->c_block_table ||
      !a->i_cache || !a->sel || a->n_segments == 0)
    return DSV4_EINVAL;
  return 0;
}
