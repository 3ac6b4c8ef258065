/*
 * SPEC §7 on the GPU: the device builds of dsv4_expf and dsv4_logf (kernels/dsv4-numerics.h,
 * compiled with the kernels' numerics flags) over all 2^32 fp32 inputs give the outputs the CPU
 * gives, bit for bit: the XXH3-64 of their output bit patterns, in input order, equals the frozen
 * constants that tests/unit/expf_logf_test.c checks on the CPU (tests/support/numerics_digests.h).
 * The device computes the outputs in chunks of 2^28 inputs; the host hashes them in order.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Header-only XXH3: the test needs no library on a machine that has only the CUDA toolkit. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "dsv4-numerics.h"
#include "gpu_check.h"
#include "numerics_digests.h"

#define CHUNK_BITS 28
#define CHUNK (1ull << CHUNK_BITS)
#define BLOCK 256

__global__ void expf_logf_kernel(uint32_t hi, uint32_t *ex, uint32_t *lg) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < CHUNK;
       i += (uint64_t)gridDim.x * blockDim.x) {
    float x = __uint_as_float((hi << CHUNK_BITS) | (uint32_t)i);
    ex[i] = __float_as_uint(dsv4_expf(x));
    lg[i] = __float_as_uint(dsv4_logf(x));
  }
}

static int report(const char *name, uint64_t got, uint64_t frozen) {
  int ok = got == frozen;
  printf("%s %s over all 2^32 fp32 inputs on the device: digest %016llx (frozen %016llx)\n",
         ok ? "ok  " : "FAIL", name, (unsigned long long)got, (unsigned long long)frozen);
  return ok ? 0 : 1;
}

int main(void) {
  if (!gpu_available("gpu_expf_logf_test"))
    return GPU_SKIP;
  uint32_t *dex, *dlg, *hex, *hlg;
  CK(cudaMalloc(&dex, CHUNK * 4));
  CK(cudaMalloc(&dlg, CHUNK * 4));
  CK(cudaMallocHost(&hex, CHUNK * 4));
  CK(cudaMallocHost(&hlg, CHUNK * 4));
  XXH3_state_t *sex = XXH3_createState(), *slg = XXH3_createState();
  if (!sex || !slg || XXH3_64bits_reset(sex) != XXH_OK || XXH3_64bits_reset(slg) != XXH_OK) {
    fprintf(stderr, "gpu_expf_logf_test: cannot set up XXH3\n");
    return 1;
  }
  for (uint32_t hi = 0; hi < (1u << (32 - CHUNK_BITS)); hi++) {
    expf_logf_kernel<<<4096, BLOCK>>>(hi, dex, dlg);
    CK(cudaGetLastError());
    CK(cudaMemcpy(hex, dex, CHUNK * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hlg, dlg, CHUNK * 4, cudaMemcpyDeviceToHost));
    /* The host is little-endian (x86-64 or aarch64 with CUDA): the buffers are the LE bytes. */
    XXH3_64bits_update(sex, hex, CHUNK * 4);
    XXH3_64bits_update(slg, hlg, CHUNK * 4);
  }
  int failures = report("dsv4_expf", XXH3_64bits_digest(sex), DSV4_EXPF_DIGEST);
  failures += report("dsv4_logf", XXH3_64bits_digest(slg), DSV4_LOGF_DIGEST);
  XXH3_freeState(sex);
  XXH3_freeState(slg);
  cudaFree(dex);
  cudaFree(dlg);
  cudaFreeHost(hex);
  cudaFreeHost(hlg);
  return failures ? 1 : 0;
}
