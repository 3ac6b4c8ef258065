/*
 * The Level Zero backend: host glue over the Level Zero loader for the kernels of dsv4_kernels.cl.
 *
 * One GPU (the first the drivers list), one context, one immediate command list. Level Zero may
 * run the commands of a list concurrently unless a barrier or an event separates them, so every
 * command this backend appends (copy, fill, kernel) is preceded by zeCommandListAppendBarrier: the
 * consumer (qkv_insert) never starts before the producer (map_slots) has written its slots,
 * attention never before the insert has written the q_out and the records it reads, a copy never
 * overtakes the kernel that fills its source, and a released block reused by a later batch is
 * written only after every earlier command has finished (SPEC §5.2). sync() appends a barrier that
 * signals a host-visible event and waits for it.
 *
 * Host <-> device copies go through a pinned host staging buffer (zeMemAllocHost) and return once
 * the copy is done, so the caller may reuse its memory at once. The RoPE rows of a batch come from
 * the host table (the caller materialises them), so qkv_insert reads the batch's positions back,
 * packs their rows ([N, 64] fp32) and copies them to the device before the consumer runs.
 * Attention after the insert of the same positions uses the same rows (its inverse RoPE is at the
 * query's position), so it adds no round trip to the host.
 *
 * The compressed branch (SPEC §8, lz_compress.c) follows the insert in the order insert ->
 * compress -> indexer -> attention, each launch behind its barrier: the emissions are stored
 * before the indexer scores them and before attention reads them (SPEC §8.4).
 *
 * The kernels cannot return an error code: arguments the CPU backend would refuse set bits of a
 * device error word instead (and nothing is read or written out of bounds); sync() reads the word
 * and answers DSV4_EINVAL when a bit is set.
 *
 * Thread affinity: one thread at a time (the executor), like every backend.
 */
#include "lz_backend.h"

#include <level_zero/ze_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dsv4-numerics.h"
#include "lz-internal.h"
#include "lz_kernels.h"
#include "lz_probe.h"
#include "lz_spirv.h"

/* Bytes per staged copy; larger transfers are done in pieces of this size. */
#define LZ_STAGE_BYTES ((size_t)16 << 20)
/* Device allocations are aligned for 16-byte vector access and more. */
#define LZ_ALIGN 256
/* The longest wait for the device: a batch is milliseconds; a device that does not finish in this
 * long is treated as failed (the engine then drops the batch's sequences, SPEC §4). */
#define LZ_WAIT_NS (60ull * 1000 * 1000 * 1000)
/* The build options of the embedded modules on the device (SPEC §2). */
#define LZ_BUILD_FLAGS "-cl-fp32-correctly-rounded-divide-sqrt"
/* The most drivers, devices of a driver and queue groups of a device looked at: far more than one
 * host has. */
#define LZ_MAX_DRIVERS 16
#define LZ_MAX_DEVICES 64
#define LZ_MAX_QUEUE_GROUPS 16
/* The RoPE row buffers' first size, in tokens; they double from there. */
#define LZ_ROPE_ROWS_MIN 256

#define LZ_RESULTS(X)                                                                              \
  X(ZE_RESULT_SUCCESS)                                                                             \
  X(ZE_RESULT_NOT_READY)                                                                           \
  X(ZE_RESULT_ERROR_DEVICE_LOST)                                                                   \
  X(ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY)                                                            \
  X(ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)                                                          \
  X(ZE_RESULT_ERROR_MODULE_BUILD_FAILURE)                                                          \
  X(ZE_RESULT_ERROR_MODULE_LINK_FAILURE)                                                           \
  X(ZE_RESULT_ERROR_DEVICE_REQUIRES_RESET)                                                         \
  X(ZE_RESULT_ERROR_DEVICE_IN_LOW_POWER_STATE)                                                     \
  X(ZE_RESULT_ERROR_INSUFFICIENT_PERMISSIONS)                                                      \
  X(ZE_RESULT_ERROR_NOT_AVAILABLE)                                                                 \
  X(ZE_RESULT_ERROR_DEPENDENCY_UNAVAILABLE)                                                        \
  X(ZE_RESULT_ERROR_UNINITIALIZED)                                                                 \
  X(ZE_RESULT_ERROR_UNSUPPORTED_VERSION)                                                           \
  X(ZE_RESULT_ERROR_UNSUPPORTED_FEATURE)                                                           \
  X(ZE_RESULT_ERROR_INVALID_ARGUMENT)                                                              \
  X(ZE_RESULT_ERROR_INVALID_NULL_HANDLE)                                                           \
  X(ZE_RESULT_ERROR_INVALID_NULL_POINTER)                                                          \
  X(ZE_RESULT_ERROR_INVALID_SIZE)                                                                  \
  X(ZE_RESULT_ERROR_UNSUPPORTED_SIZE)                                                              \
  X(ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT)                                                         \
  X(ZE_RESULT_ERROR_INVALID_ENUMERATION)                                                           \
  X(ZE_RESULT_ERROR_INVALID_NATIVE_BINARY)                                                         \
  X(ZE_RESULT_ERROR_INVALID_KERNEL_NAME)                                                           \
  X(ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX)                                                 \
  X(ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE)                                                  \
  X(ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION)                                                  \
  X(ZE_RESULT_ERROR_UNKNOWN)

/* The enumerator's name, for messages an operator can search for. */
static const char *lz_result_name(ze_result_t r) {
  switch (r) {
#define LZ_RESULT_CASE(name)                                                                       \
  case name:                                                                                       \
    return #name;
    LZ_RESULTS(LZ_RESULT_CASE)
#undef LZ_RESULT_CASE
  default:
    return "ZE_RESULT_(unknown)";
  }
}

/* One line into why (never more than why_len bytes). */
__attribute__((format(printf, 3, 4))) static void say(char *why, size_t why_len, const char *fmt,
                                                      ...) {
  if (!why || !why_len)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, why_len, fmt, ap);
  va_end(ap);
}

int dsv4__lz_fail(lz_backend_t *z) {
  z->failed = 1;
  return DSV4_EBACKEND;
}

ze_result_t dsv4__lz_barrier(lz_backend_t *z) {
  return zeCommandListAppendBarrier(z->list, NULL, 0, NULL);
}

ze_result_t dsv4__lz_wait(lz_backend_t *z) {
  ze_result_t r = zeCommandListAppendBarrier(z->list, z->done, 0, NULL);
  if (r == ZE_RESULT_SUCCESS)
    r = zeEventHostSynchronize(z->done, LZ_WAIT_NS);
  if (r == ZE_RESULT_SUCCESS)
    r = zeEventHostReset(z->done);
  if (r == ZE_RESULT_SUCCESS)
    z->emit_busy = 0; /* every copy from the host staging has completed */
  return r;
}

ze_result_t dsv4__lz_copy(lz_backend_t *z, void *dst, const void *src, size_t n) {
  ze_result_t r = dsv4__lz_barrier(z);
  if (r == ZE_RESULT_SUCCESS)
    r = zeCommandListAppendMemoryCopy(z->list, dst, src, n, NULL, 0, NULL);
  return r;
}

ze_result_t dsv4__lz_zero(lz_backend_t *z, void *p, size_t n) {
  uint8_t zero = 0;
  ze_result_t r = dsv4__lz_barrier(z);
  if (r == ZE_RESULT_SUCCESS)
    r = zeCommandListAppendMemoryFill(z->list, p, &zero, 1, n, NULL, 0, NULL);
  return r;
}

ze_result_t dsv4__lz_dev_alloc(lz_backend_t *z, size_t size, void **out) {
  ze_device_mem_alloc_desc_t d = {.stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
  return zeMemAllocDevice(z->ctx, &d, size ? size : 1, LZ_ALIGN, z->device, out);
}

ze_result_t dsv4__lz_host_alloc(lz_backend_t *z, size_t size, void **out) {
  ze_host_mem_alloc_desc_t d = {.stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC};
  return zeMemAllocHost(z->ctx, &d, size ? size : 1, LZ_ALIGN, out);
}

void dsv4__lz_free(lz_backend_t *z, void *p) {
  if (p)
    zeMemFree(z->ctx, p);
}

static ze_result_t lz_set_ptr(ze_kernel_handle_t k, uint32_t i, const void *p) {
  return zeKernelSetArgumentValue(k, i, sizeof(p), &p);
}

ze_result_t dsv4__lz_set_u32(ze_kernel_handle_t k, uint32_t i, uint32_t v) {
  return zeKernelSetArgumentValue(k, i, sizeof(v), &v);
}

ze_result_t dsv4__lz_set_args(ze_kernel_handle_t k, uint32_t first, const lz_arg_t *args,
                              uint32_t n) {
  ze_result_t r = ZE_RESULT_SUCCESS;
  for (uint32_t i = 0; i < n && r == ZE_RESULT_SUCCESS; i++)
    r = zeKernelSetArgumentValue(k, first + i, args[i].size, args[i].value);
  return r;
}

ze_result_t dsv4__lz_launch(lz_backend_t *z, ze_kernel_handle_t k, uint32_t groups) {
  ze_group_count_t g = {.groupCountX = groups, .groupCountY = 1, .groupCountZ = 1};
#ifdef DSV4_TEST_BROKEN_NO_BARRIER
  /* Test-only (tests/unit/level_zero.cmake): kernels without the barrier in front of them, so
   * the consumer may run before the producer and the RoPE rows' copy (SPEC §5.2). */
  ze_result_t r = ZE_RESULT_SUCCESS;
#else
  ze_result_t r = dsv4__lz_barrier(z);
#endif
  if (r == ZE_RESULT_SUCCESS)
    r = zeCommandListAppendLaunchKernel(z->list, k, &g, NULL, 0, NULL);
  return r;
}

/* ---- the backend table ---- */

static void lz_destroy(dsv4_backend_t *be) {
  lz_backend_t *z = dsv4__lz_of(be);
  if (z->list && z->done && !z->failed)
    (void)dsv4__lz_wait(z);
  dsv4__lz_free(z, z->err);
  dsv4__lz_free(z, z->stage);
  dsv4__lz_free(z, z->rope_host);
  dsv4__lz_free(z, z->rope_dev);
  dsv4__lz_free(z, z->emit_host);
  dsv4__lz_free(z, z->emit_dev);
  dsv4__lz_free(z, z->c_seen);
  dsv4__lz_free(z, z->x_scratch);
  free(z->pos_host);
  ze_kernel_handle_t c_kernels[] = {z->k_attn_c_check, z->k_c_check, z->k_c_emit,
                                    z->k_c_ring,       z->k_i_check, z->k_i_select};
  for (size_t i = 0; i < sizeof(c_kernels) / sizeof(c_kernels[0]); i++)
    if (c_kernels[i])
      zeKernelDestroy(c_kernels[i]);
  if (z->k_probe)
    zeKernelDestroy(z->k_probe);
  if (z->k_attn)
    zeKernelDestroy(z->k_attn);
  if (z->k_attn_check)
    zeKernelDestroy(z->k_attn_check);
  if (z->k_insert)
    zeKernelDestroy(z->k_insert);
  if (z->k_map)
    zeKernelDestroy(z->k_map);
  if (z->module)
    zeModuleDestroy(z->module);
  if (z->done)
    zeEventDestroy(z->done);
  if (z->pool)
    zeEventPoolDestroy(z->pool);
  if (z->list)
    zeCommandListDestroy(z->list);
  if (z->ctx)
    zeContextDestroy(z->ctx);
  free(z);
}

static int lz_buf_alloc(dsv4_backend_t *be, size_t size, dsv4_devbuf_t *out) {
  lz_backend_t *z = dsv4__lz_of(be);
  void *p = NULL;
  if (!out)
    return DSV4_EINVAL;
  ze_result_t r = dsv4__lz_dev_alloc(z, size, &p);
  if (r == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY || r == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY ||
      r == ZE_RESULT_ERROR_UNSUPPORTED_SIZE)
    return DSV4_ENOMEM;
  if (r != ZE_RESULT_SUCCESS)
    return dsv4__lz_fail(z);
  /* Zero-filled, as on every backend (SPEC §3). */
  uint8_t zero = 0;
  r = dsv4__lz_barrier(z);
  if (r == ZE_RESULT_SUCCESS)
    r = zeCommandListAppendMemoryFill(z->list, p, &zero, 1, size ? size : 1, NULL, 0, NULL);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_wait(z);
  if (r != ZE_RESULT_SUCCESS) {
    dsv4__lz_free(z, p);
    return dsv4__lz_fail(z);
  }
  out->ptr = p;
  out->size = size;
  return 0;
}

static void lz_buf_free(dsv4_backend_t *be, dsv4_devbuf_t *buf) {
  lz_backend_t *z = dsv4__lz_of(be);
  if (!buf || !buf->ptr)
    return;
  z->rope_pos = NULL; /* the address may come back with other contents */
  /* Commands already appended may still use the buffer. */
  if (!z->failed && dsv4__lz_wait(z) != ZE_RESULT_SUCCESS)
    z->failed = 1;
  dsv4__lz_free(z, buf->ptr);
  buf->ptr = NULL;
  buf->size = 0;
}

static int lz_upload(dsv4_backend_t *be, const dsv4_devbuf_t *dst, size_t off, const void *src,
                     size_t n) {
  lz_backend_t *z = dsv4__lz_of(be);
  if (!dst || off > dst->size || n > dst->size - off || (n && !src))
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  z->rope_pos = NULL; /* the staged rows' positions may be what this overwrites */
  for (size_t done = 0; done < n;) {
    size_t chunk = n - done < LZ_STAGE_BYTES ? n - done : LZ_STAGE_BYTES;
    /* The staging buffer is free: every earlier copy from it has been waited for. */
    memcpy(z->stage, (const uint8_t *)src + done, chunk);
    ze_result_t r = dsv4__lz_copy(z, (uint8_t *)dst->ptr + off + done, z->stage, chunk);
    if (r == ZE_RESULT_SUCCESS)
      r = dsv4__lz_wait(z);
    if (r != ZE_RESULT_SUCCESS)
      return dsv4__lz_fail(z);
    done += chunk;
  }
  return 0;
}

static int lz_download(dsv4_backend_t *be, void *dst, const dsv4_devbuf_t *src, size_t off,
                       size_t n) {
  lz_backend_t *z = dsv4__lz_of(be);
  if (!src || off > src->size || n > src->size - off || (n && !dst))
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  for (size_t done = 0; done < n;) {
    size_t chunk = n - done < LZ_STAGE_BYTES ? n - done : LZ_STAGE_BYTES;
    ze_result_t r = dsv4__lz_copy(z, z->stage, (const uint8_t *)src->ptr + off + done, chunk);
    if (r == ZE_RESULT_SUCCESS)
      r = dsv4__lz_wait(z);
    if (r != ZE_RESULT_SUCCESS)
      return dsv4__lz_fail(z);
    memcpy((uint8_t *)dst + done, z->stage, chunk);
    done += chunk;
  }
  return 0;
}

/* Appends the zeroing of the kernels' error word, after everything appended before. */
static ze_result_t lz_clear_err(lz_backend_t *z) {
  return dsv4__lz_zero(z, z->err, sizeof(uint32_t));
}

static int lz_map_slots(dsv4_backend_t *be, const dsv4_map_args_t *a) {
  lz_backend_t *z = dsv4__lz_of(be);
  int rc = dsv4_backend_check_map_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  /* A work-item per token, and one per segment for the table-length check. */
  uint64_t items = a->n_tokens > a->n_segments ? a->n_tokens : a->n_segments;
  uint64_t groups = (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE;
  if (groups > z->max_groups_x)
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  /* A table without entries still needs a valid address; the kernel never reads it then. */
  const void *bt = a->block_table ? (const void *)a->block_table : (const void *)z->err;
  const lz_arg_t args[DSV4_LZ_MAP_NARGS] = {
      LZ_U32(a->n_tokens),   LZ_U32(a->block_size), LZ_U32(a->n_blocks),
      LZ_PTR(a->positions),  LZ_PTR(a->tok_seg),    LZ_PTR(a->seg_first_lb),
      LZ_PTR(a->seg_bt_off), LZ_PTR(a->seg_bt_len), LZ_PTR(bt),
      LZ_U32(a->n_segments), LZ_PTR(a->slots),      LZ_PTR(z->err),
      LZ_U32(a->bt_entries),
  };
  ze_kernel_handle_t k = z->k_map;
  /* A batch starts with a clear error word: what an earlier batch that failed before its sync
   * left there is not this batch's. */
  ze_result_t r = lz_clear_err(z);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_set_args(k, 0, args, DSV4_LZ_MAP_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_launch(z, k, (uint32_t)groups);
  return r == ZE_RESULT_SUCCESS ? 0 : dsv4__lz_fail(z);
}

/* Grows the RoPE row buffers (host staging and device) to hold n tokens. */
static ze_result_t lz_rope_reserve(lz_backend_t *z, size_t n) {
  if (n <= z->rope_cap)
    return ZE_RESULT_SUCCESS;
  size_t cap = z->rope_cap ? z->rope_cap : LZ_ROPE_ROWS_MIN;
  while (cap < n)
    cap *= 2;
  /* The old buffers may still be read by appended commands. */
  ze_result_t r = dsv4__lz_wait(z);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  dsv4__lz_free(z, z->rope_host);
  dsv4__lz_free(z, z->rope_dev);
  z->rope_host = z->rope_dev = NULL;
  z->rope_cap = 0;
  size_t bytes = cap * DSV4_ROPE_ROW_FLOATS * sizeof(float);
  r = dsv4__lz_host_alloc(z, bytes, (void **)&z->rope_host);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_dev_alloc(z, bytes, (void **)&z->rope_dev);
  if (r == ZE_RESULT_SUCCESS)
    z->rope_cap = cap;
  return r;
}

/*
 * Copies the RoPE rows of n positions (device memory) to the device. The positions are read back
 * first; that wait also retires every earlier command, so the host staging buffer of the previous
 * batch is free again.
 */
int dsv4__lz_stage_rope(lz_backend_t *z, const int64_t *positions, size_t n,
                        const dsv4_rope_table_t *rope) {
  z->rope_pos = NULL;
  if (n > z->pos_cap) {
    int64_t *p = realloc(z->pos_host, n * sizeof(int64_t));
    if (!p)
      return DSV4_ENOMEM;
    z->pos_host = p;
    z->pos_cap = n;
  }
  ze_result_t rr = lz_rope_reserve(z, n);
  /* Out of memory refuses this batch only: the buffers are released and regrown next time. */
  if (rr == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY || rr == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)
    return DSV4_ENOMEM;
  if (rr != ZE_RESULT_SUCCESS)
    return dsv4__lz_fail(z);
  dsv4_devbuf_t pos = {.ptr = (void *)positions, .size = n * sizeof(int64_t)};
  int rc = lz_download(&z->base, z->pos_host, &pos, 0, pos.size);
  if (rc)
    return rc;
  /* Checks every position against the table and materialises rows the caller has not. */
  rc = dsv4_rope_table_ensure((dsv4_rope_table_t *)rope, z->pos_host, n);
  if (rc)
    return rc;
  for (size_t t = 0; t < n; t++)
    memcpy(z->rope_host + t * DSV4_ROPE_ROW_FLOATS, dsv4_rope_table_row(rope, z->pos_host[t]),
           DSV4_ROPE_ROW_FLOATS * sizeof(float));
  if (dsv4__lz_copy(z, z->rope_dev, z->rope_host, n * DSV4_ROPE_ROW_FLOATS * sizeof(float)) !=
      ZE_RESULT_SUCCESS)
    return dsv4__lz_fail(z);
  z->rope_pos = positions;
  z->rope_tab = rope;
  z->rope_n = n;
  return 0;
}

static int lz_qkv_insert(dsv4_backend_t *be, const dsv4_insert_args_t *a) {
  lz_backend_t *z = dsv4__lz_of(be);
  int rc = dsv4_backend_check_insert_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  if (!a->rope)
    return DSV4_EINVAL;
  uint64_t rows = (uint64_t)a->n_tokens * a->heads + (a->write_kv ? a->n_tokens : 0);
  if (rows > UINT32_MAX)
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  rc = dsv4__lz_stage_rope(z, a->positions, a->n_tokens, a->rope);
  if (rc)
    return rc;

  /* Unused pointers (prenormed weight, the cache of a replay) still get a valid address. */
  const void *w = a->kv_norm_weight ? (const void *)a->kv_norm_weight : (const void *)z->err;
  const void *cache = a->write_kv ? (const void *)a->cache : (const void *)z->err;
  uint64_t stride = a->stride;
  float eps = a->eps;
  /* Argument 0, the first row of a launch, is set per launch below. */
  const lz_arg_t args[DSV4_LZ_INSERT_NARGS - 1] = {
      LZ_U32((uint32_t)rows),
      LZ_U32(a->n_tokens),
      LZ_U32(a->heads),
      LZ_U32(a->write_kv ? 1u : 0u),
      LZ_PTR(a->q),
      LZ_PTR(a->kv),
      LZ_PTR(a->slots),
      LZ_PTR(z->rope_dev),
      LZ_PTR(w),
      LZ_U32(a->kv_norm_weight ? 1u : 0u),
      {sizeof(eps), &eps},
      LZ_PTR(a->q_out),
      LZ_PTR(cache),
      LZ_U32(a->block_size),
      LZ_U32(a->n_blocks),
      {sizeof(stride), &stride},
      LZ_PTR(z->err),
  };
  ze_kernel_handle_t k = z->k_insert;
  ze_result_t r = dsv4__lz_set_args(k, 1, args, DSV4_LZ_INSERT_NARGS - 1);
  /* Launches of at most max_groups_x groups; the arguments are captured at each append. */
  uint64_t per_launch = (uint64_t)z->max_groups_x * DSV4_LZ_ROWS_PER_GROUP;
  for (uint64_t row0 = 0; r == ZE_RESULT_SUCCESS && row0 < rows; row0 += per_launch) {
    uint64_t chunk = rows - row0 < per_launch ? rows - row0 : per_launch;
    r = dsv4__lz_set_u32(k, 0, (uint32_t)row0);
    if (r == ZE_RESULT_SUCCESS)
      r = dsv4__lz_launch(
          z, k, (uint32_t)((chunk + DSV4_LZ_ROWS_PER_GROUP - 1) / DSV4_LZ_ROWS_PER_GROUP));
  }
  return r == ZE_RESULT_SUCCESS ? 0 : dsv4__lz_fail(z);
}

/* The host-side checks of an attention launch (the block tables, positions, segments and the
 * selection are checked on the device by dsv4_attn_check and dsv4_attn_c_check). Only exact mode:
 * this backend has no DSV4_BE_ATTN_FAST. */
static int lz_check_attn_args(const dsv4_attn_args_t *a) {
  if (!a || a->fast)
    return DSV4_EINVAL;
  return dsv4_backend_check_attn_args(a);
}

/* Appends an attention launch behind a barrier: after the batch's insert, which writes the q_out
 * and the records it reads, after its compressor and indexer, which write the entries and the
 * selection it reads, and after the check launches before it (SPEC §5.2, §8.4). */
static ze_result_t lz_launch_attn(lz_backend_t *z, ze_kernel_handle_t k, uint32_t groups) {
#if defined(DSV4_TEST_BROKEN_NO_ATTN_BARRIER) || defined(DSV4_TEST_BROKEN_NO_COMPRESS_BARRIER)
  /* Test-only (tests/unit/level_zero.cmake): the attention launches without the barrier in front
   * of them, so they may run before the insert whose output they read (or, with the compressor's
   * launches unordered too, before the emissions they read). */
  ze_group_count_t g = {.groupCountX = groups, .groupCountY = 1, .groupCountZ = 1};
  return zeCommandListAppendLaunchKernel(z->list, k, &g, NULL, 0, NULL);
#else
  return dsv4__lz_launch(z, k, groups);
#endif
}

ze_result_t dsv4__lz_launch_c(lz_backend_t *z, ze_kernel_handle_t k, uint32_t groups) {
#ifdef DSV4_TEST_BROKEN_NO_COMPRESS_BARRIER
  /* Test-only (tests/unit/level_zero.cmake): the compressor's emissions and ring rows without the
   * barrier in front of them; with the attention's unordered as well, the attention may run before
   * the emissions it reads (SPEC §8.4), and the emissions after the ring rows they read are
   * overwritten. */
  ze_group_count_t g = {.groupCountX = groups, .groupCountY = 1, .groupCountZ = 1};
  return zeCommandListAppendLaunchKernel(z->list, k, &g, NULL, 0, NULL);
#else
  return dsv4__lz_launch(z, k, groups);
#endif
}

/* dsv4_attn_check over the batch's tokens and segments, in groups of 64 items. */
static ze_result_t lz_attn_check(lz_backend_t *z, const dsv4_attn_args_t *a, uint32_t groups) {
  const lz_arg_t args[] = {
      LZ_U32(a->n_tokens),   LZ_U32(a->n_segments), LZ_U32(a->block_size),  LZ_U32(a->n_blocks),
      LZ_PTR(a->positions),  LZ_PTR(a->tok_seg),    LZ_PTR(a->seg_p0),      LZ_PTR(a->seg_first_lb),
      LZ_PTR(a->seg_bt_off), LZ_PTR(a->seg_bt_len), LZ_PTR(a->block_table), LZ_U32(a->bt_entries),
      LZ_PTR(z->err),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_ATTN_CHECK_NARGS, "lz_kernels.h");
  ze_result_t r = dsv4__lz_set_args(z->k_attn_check, 0, args, DSV4_LZ_ATTN_CHECK_NARGS);
  if (r == ZE_RESULT_SUCCESS)
    r = lz_launch_attn(z, z->k_attn_check, groups);
  return r;
}

/* dsv4_attention over rows t * H + h, in launches of at most max_groups_x groups. */
static ze_result_t lz_attn_rows(lz_backend_t *z, const dsv4_attn_args_t *a, uint32_t rows) {
  /* A missing sink, lse, selection or compressed branch still gets a valid address; the kernel
   * never touches it then. */
  const void *sink = a->sink ? (const void *)a->sink : (const void *)z->err;
  const void *lse = a->lse ? (const void *)a->lse : (const void *)z->err;
  const int c = a->c_cache != NULL;
  const void *none = z->err;
  uint64_t stride = a->stride;
  /* Argument 0, the first row of a launch, is set per launch below. */
  const lz_arg_t args[] = {
      LZ_U32(rows),
      LZ_U32(a->heads),
      LZ_PTR(a->q),
      LZ_PTR(a->positions),
      LZ_PTR(a->tok_seg),
      LZ_PTR(a->seg_p0),
      LZ_PTR(a->seg_first_lb),
      LZ_PTR(a->seg_bt_off),
      LZ_PTR(a->block_table),
      LZ_PTR(a->cache),
      LZ_U32(a->block_size),
      {sizeof(stride), &stride},
      LZ_PTR(sink),
      LZ_U32(a->sink ? 1u : 0u),
      LZ_PTR(z->rope_dev),
      LZ_PTR(a->out),
      LZ_PTR(lse),
      LZ_U32(a->lse ? 1u : 0u),
      LZ_PTR(z->err),
      LZ_U32(c ? a->ratio : 0u),
      LZ_PTR(c ? (const void *)a->c_cache : none),
      LZ_PTR(c ? (const void *)a->seg_c_first_lb : none),
      LZ_PTR(c ? (const void *)a->seg_cbt_off : none),
      LZ_PTR(c ? (const void *)a->c_block_table : none),
      LZ_PTR(c && a->c_sel ? (const void *)a->c_sel : none),
      LZ_U32(c && a->c_sel ? a->c_sel_stride : 0u),
  };
  _Static_assert(sizeof(args) / sizeof(args[0]) == DSV4_LZ_ATTN_NARGS - 1, "lz_kernels.h");
  ze_kernel_handle_t k = z->k_attn;
  ze_result_t r = dsv4__lz_set_args(k, 1, args, DSV4_LZ_ATTN_NARGS - 1);
  uint64_t per_launch = (uint64_t)z->max_groups_x * DSV4_LZ_ROWS_PER_GROUP;
  for (uint64_t row0 = 0; r == ZE_RESULT_SUCCESS && row0 < rows; row0 += per_launch) {
    uint64_t chunk = rows - row0 < per_launch ? rows - row0 : per_launch;
    r = dsv4__lz_set_u32(k, 0, (uint32_t)row0);
    if (r == ZE_RESULT_SUCCESS)
      r = lz_launch_attn(z, k,
                         (uint32_t)((chunk + DSV4_LZ_ROWS_PER_GROUP - 1) / DSV4_LZ_ROWS_PER_GROUP));
  }
  return r;
}

/*
 * Exact-mode attention (SPEC §7, and §8.6 on a compressed layer): the check launch (and the check
 * of the compressed candidates), then the attention rows, each behind a barrier. A candidate's
 * block missing from its table (or any other argument the CPU backend refuses) sets the error
 * word; the rows then write nothing and sync() answers DSV4_EINVAL.
 */
static int lz_attention(dsv4_backend_t *be, const dsv4_attn_args_t *a) {
  lz_backend_t *z = dsv4__lz_of(be);
  int rc = lz_check_attn_args(a);
  if (rc || a->n_tokens == 0)
    return rc;
  uint64_t rows = (uint64_t)a->n_tokens * a->heads;
  uint64_t items = a->n_tokens > a->n_segments ? a->n_tokens : a->n_segments;
  uint64_t groups = (items + DSV4_LZ_MAP_GROUP_SIZE - 1) / DSV4_LZ_MAP_GROUP_SIZE;
  if (rows > UINT32_MAX || groups > z->max_groups_x)
    return DSV4_EINVAL;
  if (z->failed)
    return DSV4_EBACKEND;
  /* The inverse RoPE's rows: those the batch's insert staged for the same positions, else staged
   * here (a round trip to read the positions back). */
  if (z->rope_pos != a->positions || z->rope_tab != a->rope || z->rope_n != a->n_tokens) {
    rc = dsv4__lz_stage_rope(z, a->positions, a->n_tokens, a->rope);
    if (rc)
      return rc;
  }
  ze_result_t r = lz_attn_check(z, a, (uint32_t)groups);
  if (r == ZE_RESULT_SUCCESS && a->c_cache)
    r = dsv4__lz_attn_c_check(z, a, (uint32_t)groups);
  if (r == ZE_RESULT_SUCCESS)
    r = lz_attn_rows(z, a, (uint32_t)rows);
  return r == ZE_RESULT_SUCCESS ? 0 : dsv4__lz_fail(z);
}

static int lz_sync(dsv4_backend_t *be) {
  lz_backend_t *z = dsv4__lz_of(be);
  if (z->failed)
    return DSV4_EBACKEND;
  uint32_t err = 0;
  /* Waits for everything appended, then reads the kernels' error word. */
  dsv4_devbuf_t word = {.ptr = z->err, .size = sizeof(uint32_t)};
  int rc = lz_download(be, &err, &word, 0, sizeof(err));
  if (rc)
    return rc;
  if (err == 0)
    return 0;
  ze_result_t r = lz_clear_err(z);
  if (r == ZE_RESULT_SUCCESS)
    r = dsv4__lz_wait(z);
  return r == ZE_RESULT_SUCCESS ? DSV4_EINVAL : dsv4__lz_fail(z);
}

static const dsv4_backend_ops_t lz_ops = {
    .name = "level_zero",
    .caps = 0, /* device memory: the engine stages batches through upload/download */
    .destroy = lz_destroy,
    .buf_alloc = lz_buf_alloc,
    .buf_free = lz_buf_free,
    .upload = lz_upload,
    .download = lz_download,
    .map_slots = lz_map_slots,
    .qkv_insert = lz_qkv_insert,
    .sync = lz_sync,
    .attention = lz_attention,
    .compress = dsv4__lz_compress,
    .indexer = dsv4__lz_indexer,
    .host_parallel = NULL,
};

/* ---- opening a device ---- */

/* The first GPU of any driver. */
static int lz_pick_gpu(lz_backend_t *z, char *why, size_t why_len) {
  uint32_t n_drv = 0;
  ze_result_t r = zeDriverGet(&n_drv, NULL);
  if (r != ZE_RESULT_SUCCESS || n_drv == 0) {
    say(why, why_len, "no driver (zeDriverGet: %s, %u drivers)", lz_result_name(r), n_drv);
    return DSV4_ENODEV;
  }
  ze_driver_handle_t drivers[LZ_MAX_DRIVERS];
  if (n_drv > LZ_MAX_DRIVERS)
    n_drv = LZ_MAX_DRIVERS;
  r = zeDriverGet(&n_drv, drivers);
  for (uint32_t i = 0; r == ZE_RESULT_SUCCESS && i < n_drv; i++) {
    uint32_t n_dev = 0;
    if (zeDeviceGet(drivers[i], &n_dev, NULL) != ZE_RESULT_SUCCESS || n_dev == 0)
      continue;
    ze_device_handle_t devs[LZ_MAX_DEVICES];
    if (n_dev > LZ_MAX_DEVICES)
      n_dev = LZ_MAX_DEVICES;
    if (zeDeviceGet(drivers[i], &n_dev, devs) != ZE_RESULT_SUCCESS)
      continue;
    for (uint32_t j = 0; j < n_dev; j++) {
      ze_device_properties_t p = {.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES};
      if (zeDeviceGetProperties(devs[j], &p) == ZE_RESULT_SUCCESS && p.type == ZE_DEVICE_TYPE_GPU) {
        z->driver = drivers[i];
        z->device = devs[j];
        return 0;
      }
    }
  }
  say(why, why_len, "no GPU among the devices of %u drivers", n_drv);
  return DSV4_ENODEV;
}

/*
 * SPEC §2 on this device: fp32 denormals are required; correctly rounded fp32 divide and sqrt
 * select the fp32 module, else fp64 selects the double-precision one, else the device is refused.
 */
static int lz_check_device(lz_backend_t *z, const char *name, const unsigned char **spv,
                           size_t *spv_size, char *why, size_t why_len) {
  ze_device_module_properties_t m = {.stype = ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES};
  ze_device_compute_properties_t c = {.stype = ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES};
  ze_result_t r = zeDeviceGetModuleProperties(z->device, &m);
  if (r == ZE_RESULT_SUCCESS)
    r = zeDeviceGetComputeProperties(z->device, &c);
  if (r != ZE_RESULT_SUCCESS) {
    say(why, why_len, "%s: cannot read its properties (%s)", name, lz_result_name(r));
    return DSV4_ENODEV;
  }
  if (!(m.fp32flags & ZE_DEVICE_FP_FLAG_DENORM)) {
    say(why, why_len, "%s does not keep fp32 denormals (no ZE_DEVICE_FP_FLAG_DENORM)", name);
    return DSV4_ENODEV;
  }
  if (m.spirvVersionSupported < ZE_MAKE_VERSION(1, 0)) {
    say(why, why_len, "%s takes no SPIR-V", name);
    return DSV4_ENODEV;
  }
  if (m.fp32flags & ZE_DEVICE_FP_FLAG_ROUNDED_DIVIDE_SQRT) {
    *spv = dsv4__lz_spirv_cr;
    *spv_size = dsv4__lz_spirv_cr_size;
  } else if (m.flags & ZE_DEVICE_MODULE_FLAG_FP64) {
    *spv = dsv4__lz_spirv_fp64;
    *spv_size = dsv4__lz_spirv_fp64_size;
  } else {
    say(why, why_len, "%s has neither correctly rounded fp32 divide/sqrt nor fp64 (SPEC §2)", name);
    return DSV4_ENODEV;
  }
  size_t slm = 2 * DSV4_LZ_GROUP_SIZE * sizeof(float);
  if (slm < DSV4_LZ_ATTN_LOCAL_BYTES)
    slm = DSV4_LZ_ATTN_LOCAL_BYTES;
  if (c.maxTotalGroupSize < DSV4_LZ_GROUP_SIZE || c.maxGroupSizeX < DSV4_LZ_GROUP_SIZE ||
      c.maxSharedLocalMemory < slm || c.maxGroupCountX == 0) {
    say(why, why_len, "%s cannot run work-groups of %d items with %zu bytes of local memory", name,
        DSV4_LZ_GROUP_SIZE, slm);
    return DSV4_ENODEV;
  }
  z->max_groups_x = c.maxGroupCountX;
  return 0;
}

/* The compute queue group (the one that also copies). */
static int lz_compute_ordinal(lz_backend_t *z, uint32_t *ordinal) {
  uint32_t n = 0;
  if (zeDeviceGetCommandQueueGroupProperties(z->device, &n, NULL) != ZE_RESULT_SUCCESS || n == 0)
    return -1;
  ze_command_queue_group_properties_t props[LZ_MAX_QUEUE_GROUPS];
  if (n > LZ_MAX_QUEUE_GROUPS)
    n = LZ_MAX_QUEUE_GROUPS;
  for (uint32_t i = 0; i < n; i++)
    props[i] = (ze_command_queue_group_properties_t){
        .stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES};
  if (zeDeviceGetCommandQueueGroupProperties(z->device, &n, props) != ZE_RESULT_SUCCESS)
    return -1;
  for (uint32_t i = 0; i < n; i++)
    if (props[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE) {
      *ordinal = i;
      return 0;
    }
  return -1;
}

static int lz_build_module(lz_backend_t *z, const char *name, const unsigned char *spv,
                           size_t spv_size, char *why, size_t why_len) {
  ze_module_desc_t d = {
      .stype = ZE_STRUCTURE_TYPE_MODULE_DESC,
      .format = ZE_MODULE_FORMAT_IL_SPIRV,
      .inputSize = spv_size,
      .pInputModule = spv,
      .pBuildFlags = LZ_BUILD_FLAGS,
  };
  ze_module_build_log_handle_t log = NULL;
  ze_result_t r = zeModuleCreate(z->ctx, z->device, &d, &z->module, &log);
  if (r != ZE_RESULT_SUCCESS) {
    char first[160] = "";
    size_t len = 0;
    if (log && zeModuleBuildLogGetString(log, &len, NULL) == ZE_RESULT_SUCCESS && len > 0) {
      char *text = malloc(len);
      if (text && zeModuleBuildLogGetString(log, &len, text) == ZE_RESULT_SUCCESS) {
        text[len - 1] = '\0';
        snprintf(first, sizeof(first), "%.*s", (int)strcspn(text, "\n"), text);
      }
      free(text);
    }
    say(why, why_len, "%s: the kernels do not build (%s): %s", name, lz_result_name(r), first);
    z->module = NULL;
  }
  if (log)
    zeModuleBuildLogDestroy(log);
  if (r != ZE_RESULT_SUCCESS)
    return DSV4_ENODEV;
  struct {
    const char *name;
    ze_kernel_handle_t *k;
    uint32_t group;
  } ks[] = {
      {DSV4_LZ_MAP_KERNEL, &z->k_map, DSV4_LZ_MAP_GROUP_SIZE},
      {DSV4_LZ_INSERT_KERNEL, &z->k_insert, DSV4_LZ_GROUP_SIZE},
      {DSV4_LZ_PROBE_KERNEL, &z->k_probe, 1},
      {DSV4_LZ_ATTN_CHECK_KERNEL, &z->k_attn_check, DSV4_LZ_MAP_GROUP_SIZE},
      {DSV4_LZ_ATTN_KERNEL, &z->k_attn, DSV4_LZ_GROUP_SIZE},
      {DSV4_LZ_ATTN_C_CHECK_KERNEL, &z->k_attn_c_check, DSV4_LZ_MAP_GROUP_SIZE},
      {DSV4_LZ_COMP_CHECK_KERNEL, &z->k_c_check, DSV4_LZ_MAP_GROUP_SIZE},
      {DSV4_LZ_COMP_EMIT_KERNEL, &z->k_c_emit, DSV4_LZ_GROUP_SIZE},
      {DSV4_LZ_COMP_RING_KERNEL, &z->k_c_ring, DSV4_LZ_GROUP_SIZE},
      {DSV4_LZ_INDEX_CHECK_KERNEL, &z->k_i_check, DSV4_LZ_MAP_GROUP_SIZE},
      {DSV4_LZ_INDEX_KERNEL, &z->k_i_select, DSV4_LZ_GROUP_SIZE},
  };
  for (size_t i = 0; i < sizeof(ks) / sizeof(ks[0]); i++) {
    ze_kernel_desc_t kd = {.stype = ZE_STRUCTURE_TYPE_KERNEL_DESC, .pKernelName = ks[i].name};
    r = zeKernelCreate(z->module, &kd, ks[i].k);
    if (r == ZE_RESULT_SUCCESS)
      r = zeKernelSetGroupSize(*ks[i].k, ks[i].group, 1, 1);
    if (r != ZE_RESULT_SUCCESS) {
      say(why, why_len, "%s: kernel %s (%s)", name, ks[i].name, lz_result_name(r));
      return DSV4_ENODEV;
    }
  }
  return 0;
}

/*
 * SPEC §2 on the device itself, through the same compiler as the kernels (lz_probe.h): a * b + c as
 * written is not contracted, a subnormal product is not flushed, and the RMS factor's divide and
 * sqrt round correctly.
 */
static int lz_probe(lz_backend_t *z, const char *name, char *why, size_t why_len) {
  float in[DSV4_LZ_PROBE_IN], out[DSV4_LZ_PROBE_OUT];
  dsv4__lz_probe_inputs(in);
  dsv4_devbuf_t din = {0}, dout = {0};
  int rc = lz_buf_alloc(&z->base, sizeof(in), &din);
  if (rc == 0)
    rc = lz_buf_alloc(&z->base, sizeof(out), &dout);
  if (rc == 0)
    rc = lz_upload(&z->base, &din, 0, in, sizeof(in));
  if (rc == 0 && (lz_set_ptr(z->k_probe, 0, din.ptr) != ZE_RESULT_SUCCESS ||
                  lz_set_ptr(z->k_probe, 1, dout.ptr) != ZE_RESULT_SUCCESS ||
                  dsv4__lz_launch(z, z->k_probe, 1) != ZE_RESULT_SUCCESS))
    rc = dsv4__lz_fail(z);
  if (rc == 0)
    rc = lz_download(&z->base, out, &dout, 0, sizeof(out));
  lz_buf_free(&z->base, &din);
  lz_buf_free(&z->base, &dout);
  if (rc) {
    say(why, why_len, "%s: the numerics probe did not run (%s)", name, dsv4_strerror(rc));
    return DSV4_ENODEV;
  }
  char what[192];
  if (dsv4__lz_probe_check(in, out, what, sizeof(what)) != 0) {
    say(why, why_len, "%s breaks SPEC §2: %s", name, what);
    return DSV4_ENODEV;
  }
  return 0;
}

static int lz_open_device(lz_backend_t *z, char *why, size_t why_len) {
  ze_device_properties_t p = {.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES};
  char name[ZE_MAX_DEVICE_NAME + 1] = "GPU";
  if (zeDeviceGetProperties(z->device, &p) == ZE_RESULT_SUCCESS)
    snprintf(name, sizeof(name), "%.*s", (int)ZE_MAX_DEVICE_NAME, p.name);
  const unsigned char *spv = NULL;
  size_t spv_size = 0;
  int rc = lz_check_device(z, name, &spv, &spv_size, why, why_len);
  if (rc)
    return rc;
  uint32_t ordinal = 0;
  if (lz_compute_ordinal(z, &ordinal) != 0) {
    say(why, why_len, "%s has no compute queue", name);
    return DSV4_ENODEV;
  }
  ze_context_desc_t cd = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  ze_command_queue_desc_t qd = {
      .stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
      .ordinal = ordinal,
      .index = 0,
      .mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
      .priority = ZE_COMMAND_QUEUE_PRIORITY_NORMAL,
  };
  ze_event_pool_desc_t pd = {
      .stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
      .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE,
      .count = 1,
  };
  ze_event_desc_t ed = {
      .stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
      .index = 0,
      .signal = ZE_EVENT_SCOPE_FLAG_HOST,
      .wait = ZE_EVENT_SCOPE_FLAG_HOST,
  };
  const char *step = "zeContextCreate";
  ze_result_t r = zeContextCreate(z->driver, &cd, &z->ctx);
  if (r == ZE_RESULT_SUCCESS) {
    step = "zeCommandListCreateImmediate";
    r = zeCommandListCreateImmediate(z->ctx, z->device, &qd, &z->list);
  }
  if (r == ZE_RESULT_SUCCESS) {
    step = "zeEventPoolCreate";
    r = zeEventPoolCreate(z->ctx, &pd, 1, &z->device, &z->pool);
  }
  if (r == ZE_RESULT_SUCCESS) {
    step = "zeEventCreate";
    r = zeEventCreate(z->pool, &ed, &z->done);
  }
  if (r == ZE_RESULT_SUCCESS) {
    step = "zeMemAllocHost";
    r = dsv4__lz_host_alloc(z, LZ_STAGE_BYTES, (void **)&z->stage);
  }
  if (r != ZE_RESULT_SUCCESS) {
    say(why, why_len, "%s: %s failed (%s)", name, step, lz_result_name(r));
    return DSV4_ENODEV;
  }
  dsv4_devbuf_t err = {0};
  rc = lz_buf_alloc(&z->base, sizeof(uint32_t), &err);
  if (rc) {
    say(why, why_len, "%s: cannot allocate device memory", name);
    return DSV4_ENODEV;
  }
  z->err = err.ptr;
  rc = lz_build_module(z, name, spv, spv_size, why, why_len);
  if (rc == 0)
    rc = lz_probe(z, name, why, why_len);
  return rc;
}

int dsv4_level_zero_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                                 size_t why_len) {
  (void)opt; /* the host threads option is the CPU backend's */
  if (!out)
    return DSV4_EINVAL;
  if (why_len)
    why[0] = '\0';
  ze_result_t r = zeInit(ZE_INIT_FLAG_GPU_ONLY);
  if (r != ZE_RESULT_SUCCESS) {
    say(why, why_len, "zeInit found no driver (%s)", lz_result_name(r));
    return DSV4_ENODEV;
  }
  lz_backend_t *z = calloc(1, sizeof(*z));
  if (!z) {
    say(why, why_len, "out of memory");
    return DSV4_ENOMEM;
  }
  z->base.ops = &lz_ops;
  int rc = lz_pick_gpu(z, why, why_len);
  if (rc == 0)
    rc = lz_open_device(z, why, why_len);
  if (rc) {
    lz_destroy(&z->base);
    return rc;
  }
  *out = &z->base;
  return 0;
}
