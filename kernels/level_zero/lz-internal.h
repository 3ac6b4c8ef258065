#ifndef DSV4_KERNELS_LEVEL_ZERO_LZ_INTERNAL_H
#define DSV4_KERNELS_LEVEL_ZERO_LZ_INTERNAL_H

/*
 * Private pieces of the Level Zero backend, shared by its host glue files: lz_backend.c (the
 * table, memory, the slot map, the insert and attention) and lz_compress.c (the compressed
 * branch). Nothing outside kernels/level_zero/ includes this header.
 *
 * Thread affinity: one thread at a time (the executor), like every backend.
 */

#include <level_zero/ze_api.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

typedef struct {
  dsv4_backend_t base;
  ze_driver_handle_t driver;
  ze_device_handle_t device;
  ze_context_handle_t ctx;
  ze_command_list_handle_t list; /* immediate, asynchronous */
  ze_event_pool_handle_t pool;
  ze_event_handle_t done; /* signalled by the barrier sync() appends */
  ze_module_handle_t module;
  ze_kernel_handle_t k_map, k_insert, k_probe, k_attn_check, k_attn;
  /* The compressed branch's kernels (lz_compress.c). */
  ze_kernel_handle_t k_attn_c_check, k_c_check, k_c_emit, k_c_ring, k_i_check, k_i_select;
  uint32_t max_groups_x;
  uint8_t *stage; /* host USM, LZ_STAGE_BYTES */
  uint32_t *err;  /* device: the kernels' error word */
  float *rope_host, *rope_dev;
  size_t rope_cap; /* tokens the two RoPE row buffers hold */
  /* What the rows in rope_dev are: the positions (device address) and table they were staged for.
   * Any upload may change what is behind that address, so it clears rope_pos. pos_host holds
   * those positions while rope_pos is set. */
  const int64_t *rope_pos;
  const dsv4_rope_table_t *rope_tab;
  size_t rope_n;
  int64_t *pos_host;
  size_t pos_cap;
  /* The compressor's emissions (lz_compress.c): their RoPE rows then their tokens, staged on the
   * host and copied to the device; emit_busy while a copy from emit_host may still be pending
   * (every completed wait clears it). */
  uint8_t *emit_host, *emit_dev;
  size_t emit_bytes;
  int emit_busy;
  /* Device scratch: the compressor check's counters, the indexer's q^ and score keys. */
  void *c_seen;
  size_t c_seen_bytes;
  void *x_scratch;
  size_t x_scratch_bytes;
  int failed; /* a Level Zero call failed: the device is no longer trusted */
} lz_backend_t;

static inline lz_backend_t *dsv4__lz_of(dsv4_backend_t *be) {
  return (lz_backend_t *)be;
}

/* One kernel argument: its size and where its value is (for a pointer, the address of the
 * pointer). A kernel's arguments are set from an array of these, in the order of lz_kernels.h. */
typedef struct {
  size_t size;
  const void *value;
} lz_arg_t;

/* clang-format off */
#define LZ_U32(v) {sizeof(uint32_t), &(uint32_t){(v)}}
#define LZ_PTR(p) {sizeof(void *), &(const void *){(p)}}
#define LZ_U64(v) {sizeof(uint64_t), &(uint64_t){(v)}}
#define LZ_I64(v) {sizeof(int64_t), &(int64_t){(v)}}
#define LZ_F32(v) {sizeof(float), &(float){(v)}}
/* clang-format on */

/* A failed call after open: the device state is unknown from here on. Returns DSV4_EBACKEND. */
int dsv4__lz_fail(lz_backend_t *z);
/* Every command is preceded by a barrier: commands run in the order they were appended. */
ze_result_t dsv4__lz_barrier(lz_backend_t *z);
/* Waits until everything appended so far has completed. */
ze_result_t dsv4__lz_wait(lz_backend_t *z);
/* A copy behind a barrier. */
ze_result_t dsv4__lz_copy(lz_backend_t *z, void *dst, const void *src, size_t n);
/* n zero bytes at device address p, behind a barrier. */
ze_result_t dsv4__lz_zero(lz_backend_t *z, void *p, size_t n);
ze_result_t dsv4__lz_dev_alloc(lz_backend_t *z, size_t size, void **out);
ze_result_t dsv4__lz_host_alloc(lz_backend_t *z, size_t size, void **out);
void dsv4__lz_free(lz_backend_t *z, void *p);
ze_result_t dsv4__lz_set_u32(ze_kernel_handle_t k, uint32_t i, uint32_t v);
ze_result_t dsv4__lz_set_args(ze_kernel_handle_t k, uint32_t first, const lz_arg_t *args,
                              uint32_t n);
/* A kernel launch of groups work-groups behind a barrier. */
ze_result_t dsv4__lz_launch(lz_backend_t *z, ze_kernel_handle_t k, uint32_t groups);
/*
 * Copies the RoPE rows of n positions (device memory) to rope_dev, after reading the positions
 * back into pos_host (a wait that also retires every earlier command). 0 or an error code.
 */
int dsv4__lz_stage_rope(lz_backend_t *z, const int64_t *positions, size_t n,
                        const dsv4_rope_table_t *rope);

/* The compressed branch (lz_compress.c): the ops of the table, and the check of attention's
 * compressed candidates, appended by lz_attention after its own check. */
int dsv4__lz_compress(dsv4_backend_t *be, const dsv4_compress_args_t *a);
int dsv4__lz_indexer(dsv4_backend_t *be, const dsv4_indexer_args_t *a);
ze_result_t dsv4__lz_attn_c_check(lz_backend_t *z, const dsv4_attn_args_t *a, uint32_t groups);
/* A launch of the compressor's emissions or ring rows, or of attention: behind a barrier, like
 * every command (the test-only build DSV4_TEST_BROKEN_NO_COMPRESS_BARRIER leaves it out). */
ze_result_t dsv4__lz_launch_c(lz_backend_t *z, ze_kernel_handle_t k, uint32_t groups);

#endif /* DSV4_KERNELS_LEVEL_ZERO_LZ_INTERNAL_H */
