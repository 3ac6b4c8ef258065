/*
 * The compressed branch on the Level Zero backend (SPEC §8.3-§8.6): the compress and indexer ops
 * and the check of attention's compressed candidates, over the kernels of dsv4_compress.cl.
 *
 * Like the rest of the backend, every launch is appended behind a barrier on the one immediate
 * command list, in the order the engine calls them: insert, compress, indexer, attention (SPEC
 * §5.2, §8.4). Arguments the CPU backend refuses and that live in device memory (segments,
 * positions against p0, state slots, block tables, selections) are checked by a check launch that
 * sets bits of the device error word; every later launch of the batch then writes nothing, and
 * sync() answers DSV4_EINVAL. What the host holds (the positions it reads back for the RoPE rows,
 * the RoPE table) it checks before appending anything.
 *
 * RoPE rows. The compressor's entries rotate with the row of their window's first position r * j
 * (SPEC §8.3), which is not a position of the batch: for each emission the host packs that row
 * (after the same check as the CPU backend: the row exists and is materialised) next to the
 * emitting token's index and copies both to the device. The indexer's queries rotate with the
 * row of the token's position, which the batch's insert has already staged (lz_backend.c).
 */
#include <stdlib.h>
#include <string.h>

#include "dsv4-layout.h"
#include "lz-internal.h"
#include "lz_kernels.h"
#include "rope.h"

/* The work-groups of one indexer selection launch at most (each scores its tokens in turn, with
 * a slice of key scratch as large as the most entries a token sees). */
#define LZ_INDEX_GROUPS 64u

/* Whether the RoPE row of pos exists and is materialised (cpu_compress.c's rope_row_ready). */
static int rope_row_ready(const dsv4_rope_table_t *rope, int64_t pos) {
  return pos >= 0 && pos < dsv4_rope_table_positions(rope) &&
         dsv4_rope_table_chunk(rope, pos / DSV4_ROPE_CHUNK_ROWS, NULL) != NULL;
}

/* Device scratch *p of at least bytes (doubling); the old one may still be in use by appended
 * commands, so it is freed only after a wait. */
static ze_result_t scratch_reserve(lz_backend_t *z, void **p, size_t *have, size_t bytes) {
  if (bytes <= *have)
    return ZE_RESULT_SUCCESS;
  size_t cap = *have ? *have : 4096;
  while (cap < bytes)
    cap *= 2;
  ze_result_t r = dsv4__lz_wait(z);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  dsv4__lz_free(z, *p);
  *p = NULL;
  *have = 0;
  r = dsv4__lz_dev_alloc(z, cap, p);
  if (r == ZE_RESULT_SUCCESS)
    *have = cap;
  return r;
}

/* A failed reservation: out of memory refuses this launch only; anything else fails the device. */
static int reserve_rc(lz_backend_t *z, ze_result_t r) {
  if (r == ZE_RESULT_SUCCESS)
    return 0;
  if (r == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY || r == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)
    return DSV4_ENOMEM;
  return dsv4__lz_fail(z);
}

/* The batch's positions in pos_host and their RoPE rows in rope_dev: those the batch's insert
 * staged, else staged here (which reads the positions back and checks them against the table). */
static int positions_on_host(lz_backend_t *z, const int64_t *positions, uint32_t n,
                             const dsv4_rope_table_t *rope) {
  if (z->rope_pos == positions && z->rope_tab == rope && z->rope_n == n)
    return 0;
  return dsv4__lz_stage_rope(z, positions, n, rope);
}

/* The host and device buffers of n emissions: their RoPE rows, then their tokens. */
static ze_result_t emit_reserve(lz_backend_t *z, size_t bytes) {
  if (bytes <= z->emit_bytes)
    return ZE_RESULT_SUCCESS;
  size_t cap = z->emit_bytes ? z->emit_bytes : 16384;
  while (cap < bytes)
    cap *= 2;
  ze_result_t r = dsv4__lz_wait(z); /* the old buffers may still be read by appended copies */
  if (r != ZE_RESULT_SUCCESS)
    return r;
  dsv4__lz_free(z, z->emit_host);
  dsv4__lz_free(z, z->emit_dev);
  z->emit_host = z->emit_dev = NULL;
  z->emit_bytes = 0;
  r = dsv4__lz_host_alloc(z, cap, (void **)&z->emit_host);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_dev_alloc(z, cap, (void **)&z->emit_dev);
  if (r == ZE_RESULT_SUCCESS)
    z->emit_bytes = cap;
  return r;
}

/*
 * The emissions of the batch (tokens with (p + 1) % ratio == 0, in batch order) and the RoPE rows
 * of their entries, staged on the device: rows at emit_dev, the tokens after n_emit rows. Refuses
 * (DSV4_EINVAL) a position outside the table and an emission whose row is not materialised, as the
 * CPU backend does, before anything is appended.
 */
static int stage_emissions(lz_backend_t *z, const dsv4_compress_args_t *a, uint32_t *n_emit) {
  const int64_t rows = dsv4_rope_table_positions(a->rope);
  uint32_t n = 0;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    int64_t p = z->pos_host[t];
    if (p < 0 || p >= rows)
      return DSV4_EINVAL;
    if ((p + 1) % a->ratio == 0) {
      if (!rope_row_ready(a->rope, p / a->ratio * a->ratio))
        return DSV4_EINVAL;
      n++;
    }
  }
  *n_emit = n;
  if (n == 0)
    return 0;
  const size_t row_bytes = DSV4_ROPE_ROW_FLOATS * sizeof(float);
  const size_t bytes = (size_t)n * (row_bytes + sizeof(uint32_t));
  /* The host staging may be the source of a copy still pending (a compress since the last wait). */
  ze_result_t r = z->emit_busy ? dsv4__lz_wait(z) : ZE_RESULT_SUCCESS;
  if (r == ZE_RESULT_SUCCESS)
    r = emit_reserve(z, bytes);
  int rc = reserve_rc(z, r);
  if (rc)
    return rc;
  uint32_t *tok = (uint32_t *)(z->emit_host + (size_t)n * row_bytes);
  for (uint32_t t = 0, e = 0; t < a->n_tokens; t++) {
    int64_t p = z->pos_host[t];
    if ((p + 1) % a->ratio != 0)
      continue;
    memcpy(z->emit_host + (size_t)e * row_bytes,
           dsv4_rope_table_row(a->rope, p / a->ratio * a->ratio), row_bytes);
    tok[e++] = t;
  }
  if (dsv4__lz_copy(z, z->emit_dev, z->emit_host, bytes) != ZE_RESULT_SUCCESS)
    return dsv4__lz_fail(z);
  z->emit_busy = 1;
  return 0;
}

/* dsv4_compress_check over the batch's tokens and segments, after zeroing its counters (c_seen,
 * reserved by the caller). */
static ze_result_t compress_check(lz_backend_t *z, const dsv4_compress_args_t *a, uint32_t groups) {
  ze_result_t r =
      dsv4__lz_zero(z, z->c_seen, ((size_t)a->n_segments + a->n_slots) * sizeof(uint32_t));
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),       LZ_U32(a->n_segments),
      LZ_U32(a->ratio),          LZ_U32(a->block_size),
      LZ_U32(a->n_slots),        LZ_U32(a->c_n_blocks),
      LZ_U32(a->c_bt_entries),   LZ_I64(dsv4_rope_table_positions(a->rope)),
      LZ_PTR(a->positions),      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),         LZ_PTR(a->seg_slot),
      LZ_PTR(a->seg_c_first_lb), LZ_PTR(a->seg_cbt_off),
      LZ_PTR(a->seg_cbt_len),    LZ_PTR(a->c_block_table),
      LZ_PTR(z->c_seen),         LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_COMP_CHECK_NARGS, "lz_kernels.h");
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_set_args(z->k_c_check, 0, args, DSV4_LZ_COMP_CHECK_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_launch(z, z->k_c_check, groups);
  return r;
}

/* Launches of k over n work-groups, at most max_groups_x each, argument 0 the first group's index.
 */
static ze_result_t launch_split(lz_backend_t *z, ze_kernel_handle_t k, uint32_t n) {
  ze_result_t r = ZE_RESULT_SUCCESS;
  for (uint32_t first = 0; r == ZE_RESULT_SUCCESS && first < n; first += z->max_groups_x) {
    uint32_t count = n - first < z->max_groups_x ? n - first : z->max_groups_x;
    r = dsv4__lz_set_u32(k, 0, first);
    if (r == ZE_RESULT_SUCCESS)
      r = dsv4__lz_launch_c(z, k, count);
  }
  return r;
}

/* dsv4_compress_emit over the n_emit emissions staged by stage_emissions. */
static ze_result_t compress_emit(lz_backend_t *z, const dsv4_compress_args_t *a, uint32_t n_emit) {
  /* The indexer's inputs of a ratio-128 layer still get a valid address; never read then. */
  const int four = a->ratio == 4u;
  const void *none = z->err;
  const size_t rows_bytes = (size_t)n_emit * DSV4_ROPE_ROW_FLOATS * sizeof(float);
  const lz_arg_t args[] = {
      LZ_U32(n_emit),
      LZ_PTR(z->emit_dev + rows_bytes),
      LZ_PTR(z->emit_dev),
      LZ_U32(a->ratio),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),
      LZ_PTR(a->seg_slot),
      LZ_PTR(a->ckv),
      LZ_PTR(four ? (const void *)a->ikv : none),
      LZ_PTR(a->ring),
      LZ_PTR(a->ape),
      LZ_PTR(a->norm_weight),
      LZ_PTR(four ? (const void *)a->i_ape : none),
      LZ_PTR(four ? (const void *)a->i_norm_weight : none),
      LZ_F32(a->eps),
      LZ_PTR(a->seg_c_first_lb),
      LZ_PTR(a->seg_cbt_off),
      LZ_PTR(a->c_block_table),
      LZ_U32(a->c_n_blocks),
      LZ_PTR(a->c_cache),
      LZ_PTR(four ? (const void *)a->i_cache : none),
      LZ_U32(a->block_size),
      LZ_U64(a->stride),
      LZ_PTR(z->err),
  };
  /* Argument 0, the first emission of a launch, is set per launch. */
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_COMP_EMIT_NARGS - 1, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_c_emit, 1, args, DSV4_LZ_COMP_EMIT_NARGS - 1);
  if (r == ZE_RESULT_SUCCESS)
    r = launch_split(z, z->k_c_emit, n_emit);
  return r;
}

/* dsv4_compress_ring over the batch's tokens, after the emissions that read the old rows. */
static ze_result_t compress_ring(lz_backend_t *z, const dsv4_compress_args_t *a) {
  const int four = a->ratio == 4u;
  const void *none = z->err;
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),
      LZ_U32(a->ratio),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_slot),
      LZ_PTR(a->ckv),
      LZ_PTR(four ? (const void *)a->ikv : none),
      LZ_PTR(a->ring),
      LZ_PTR(a->ape),
      LZ_PTR(four ? (const void *)a->i_ape : none),
      LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_COMP_RING_NARGS - 1, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_c_ring, 1, args, DSV4_LZ_COMP_RING_NARGS - 1);
  if (r == ZE_RESULT_SUCCESS)
    r = launch_split(z, z->k_c_ring, a->n_tokens);
  return r;
}

/*
 * SPEC §8.3 after the batch's insert: the check, the emissions (records and index records from the
 * rows of the inputs and the ring), then the rows that stay in the rings, each behind a barrier.
 */
int dsv4__lz_compress(dsv4_backend_t *be, const dsv4_compress_args_t *a) {
  lz_backend_t *z = dsv4__lz_of(be);
  int rc = dsv4_backend_check_compress_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  uint64_t items = a->n_tokens > a->n_segments ? a->n_tokens : a->n_segments;
  uint64_t groups = (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE;
  if (groups > z->max_groups_x || (uint64_t)a->n_segments + a->n_slots > UINT32_MAX)
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  rc = reserve_rc(z, scratch_reserve(z, &z->c_seen, &z->c_seen_bytes,
                                     ((size_t)a->n_segments + a->n_slots) * sizeof(uint32_t)));
  if (!rc)
    rc = positions_on_host(z, a->positions, a->n_tokens, a->rope);
  uint32_t n_emit = 0;
  if (!rc)
    rc = stage_emissions(z, a, &n_emit);
  if (rc)
    return rc;
  ze_result_t r = compress_check(z, a, (uint32_t)groups);
  if (r == ZE_RESULT_SUCCESS && n_emit)
    r = compress_emit(z, a, n_emit);
  if (r == ZE_RESULT_SUCCESS)
    r = compress_ring(z, a);
  return r == ZE_RESULT_SUCCESS ? 0 : dsv4__lz_fail(z);
}

/* dsv4_index_check over the batch's tokens and segments. */
static ze_result_t index_check(lz_backend_t *z, const dsv4_indexer_args_t *a, uint32_t groups) {
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),
      LZ_U32(a->n_segments),
      LZ_U32(a->topk),
      LZ_U32(a->block_size),
      LZ_U32(a->c_n_blocks),
      LZ_U32(a->c_bt_entries),
      LZ_I64(dsv4_rope_table_positions(a->rope)),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),
      LZ_PTR(a->seg_c_first_lb),
      LZ_PTR(a->seg_cbt_off),
      LZ_PTR(a->seg_cbt_len),
      LZ_PTR(a->c_block_table),
      LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_INDEX_CHECK_NARGS, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_i_check, 0, args, DSV4_LZ_INDEX_CHECK_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_launch(z, z->k_i_check, groups);
  return r;
}

/* dsv4_index_select in g work-groups, each with keys_per_group keys and its q^ in x_scratch. */
static ze_result_t index_select(lz_backend_t *z, const dsv4_indexer_args_t *a, uint32_t g,
                                uint64_t keys_per_group) {
  const size_t qhat_bytes = (size_t)g * DSV4_LZ_QHAT_FLOATS(a->n_heads) * sizeof(float);
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),
      LZ_U32(a->topk),
      LZ_U32(a->n_heads),
      LZ_F32(a->w_scale),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),
      LZ_PTR(a->iq),
      LZ_PTR(a->iw),
      LZ_PTR(z->rope_dev),
      LZ_PTR(a->seg_c_first_lb),
      LZ_PTR(a->seg_cbt_off),
      LZ_PTR(a->c_block_table),
      LZ_PTR(a->i_cache),
      LZ_U32(a->block_size),
      LZ_PTR(a->sel),
      LZ_PTR((uint8_t *)z->x_scratch + qhat_bytes),
      LZ_U64(keys_per_group),
      LZ_PTR(z->x_scratch),
      LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_INDEX_NARGS, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_i_select, 0, args, DSV4_LZ_INDEX_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_launch(z, z->k_i_select, g);
  return r;
}

/*
 * SPEC §8.5 after the batch's compress: the check, then the selection of every token. The key
 * scratch of a group holds the most entries a token of the batch can see, floor((p + 1) / 4) (p0
 * is at least 0), counting only tokens that may score at all.
 */
int dsv4__lz_indexer(dsv4_backend_t *be, const dsv4_indexer_args_t *a) {
  lz_backend_t *z = dsv4__lz_of(be);
  int rc = dsv4_backend_check_indexer_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  uint64_t items = a->n_tokens > a->n_segments ? a->n_tokens : a->n_segments;
  uint64_t groups = (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE;
  if (groups > z->max_groups_x)
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  rc = positions_on_host(z, a->positions, a->n_tokens, a->rope);
  if (rc)
    return rc;
  uint64_t keys = 1;
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    uint64_t most = (uint64_t)(z->pos_host[t] + 1) / 4;
    if (most > a->topk && most > keys)
      keys = most;
  }
  uint32_t g = a->n_tokens < LZ_INDEX_GROUPS ? a->n_tokens : LZ_INDEX_GROUPS;
  g = g < z->max_groups_x ? g : z->max_groups_x;
  size_t bytes = (size_t)g * (DSV4_LZ_QHAT_FLOATS(a->n_heads) * sizeof(float) +
                              (size_t)keys * sizeof(uint32_t));
  rc = reserve_rc(z, scratch_reserve(z, &z->x_scratch, &z->x_scratch_bytes, bytes));
  if (rc)
    return rc;
  ze_result_t r = index_check(z, a, (uint32_t)groups);
  if (r == ZE_RESULT_SUCCESS)
    r = index_select(z, a, g, keys);
  return r == ZE_RESULT_SUCCESS ? 0 : dsv4__lz_fail(z);
}

ze_result_t dsv4__lz_attn_c_check(lz_backend_t *z, const dsv4_attn_args_t *a, uint32_t groups) {
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),
      LZ_U32(a->n_segments),
      LZ_U32(a->ratio),
      LZ_U32(a->block_size),
      LZ_U32(a->c_n_blocks),
      LZ_U32(a->c_bt_entries),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),
      LZ_PTR(a->seg_c_first_lb),
      LZ_PTR(a->seg_cbt_off),
      LZ_PTR(a->seg_cbt_len),
      LZ_PTR(a->c_block_table),
      LZ_PTR(a->c_sel ? (const void *)a->c_sel : (const void *)z->err),
      LZ_U32(a->c_sel ? a->c_sel_stride : 0u),
      LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_ATTN_C_CHECK_NARGS, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_attn_c_check, 0, args, DSV4_LZ_ATTN_C_CHECK_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_launch_c(z, z->k_attn_c_check, groups);
  return r;
}
