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
  /* A selection without a compressed cache is a caller's mistake, not an SWA-only launch. */
  if (!a->c_cache)
    return a->c_sel ? DSV4_EINVAL : 0;
  if ((a->ratio != 4 && a->ratio != 128) || !a->seg_c_first_lb || !a->seg_cbt_off ||
      !a->seg_cbt_len || !a->c_block_table || a->c_n_blocks == 0 ||
      (a->c_sel && a->c_sel_stride == 0))
    return DSV4_EINVAL;
  return 0;
}
