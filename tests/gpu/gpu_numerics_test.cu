/*
 * SPEC §2 on the GPU, exhaustively: the device builds of the shared codecs (dsv4-numerics.h,
 * compiled with the kernels' flags) equal the host's over all 2^32 fp32 inputs: the fp8 E4M3FN
 * byte, the UE8M0 code of a tile whose amax is |x| (with the 1e-4 floor, as the insert kernel
 * takes it) and the bf16 rounding, both the shared routine and the one-instruction conversion the
 * kernels use (dsv4__bf16x2_rn: equal for every non-NaN input, a NaN for a NaN), and the fp8 pair
 * conversion they use (dsv4__e4m3x2_rn, the same rule). The host side runs
 * on every core. Also the contraction check:
 * (1+2^-12)*(1+2^-12) - (1+2^-11) from runtime inputs, written a*b+c, is +0 on the device.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda-internal.cuh"
#include "dsv4-numerics.h"
#include "gpu_check.h"

#define CHUNK_BITS 28
#define CHUNK (1ull << CHUNK_BITS)
#define BLOCK 256

/* The UE8M0 code of a one-value tile, as the insert kernel derives it. */
static __host__ __device__ inline uint8_t ue8m0_code(float x) {
  float a = fabsf(x);
  float m = a > DSV4_AMAX_FLOOR ? a : DSV4_AMAX_FLOOR;
  return (uint8_t)(dsv4_ue8m0_exponent(m) + 127);
}

__global__ void convert_kernel(uint32_t hi, uint8_t *e4m3, uint8_t *ue8m0, uint16_t *bf16,
                               uint16_t *bf16hw, uint8_t *e4m3hw) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < CHUNK;
       i += (uint64_t)gridDim.x * blockDim.x) {
    float x = __uint_as_float((hi << CHUNK_BITS) | (uint32_t)i);
    e4m3[i] = dsv4_f32_to_e4m3(x);
    ue8m0[i] = ue8m0_code(x);
    bf16[i] = dsv4_f32_to_bf16(x);
    /* Each half of the pair, so both operand positions of the instruction are covered. */
    uint32_t pair = i & 1 ? dsv4__bf16x2_rn(-1.0f, x) >> 16 : dsv4__bf16x2_rn(x, -1.0f) & 0xffffu;
    bf16hw[i] = (uint16_t)pair;
    uint32_t p8 = i & 1 ? dsv4__e4m3x2_rn(-1.0f, x) >> 8 : dsv4__e4m3x2_rn(x, -1.0f) & 0xffu;
    e4m3hw[i] = (uint8_t)p8;
  }
}

__global__ void contraction_kernel(const float *in, float *out) {
  out[0] = in[0] * in[1] + in[2];
}

typedef struct {
  uint32_t hi;
  uint64_t first, last;
  const uint8_t *e4m3, *ue8m0;
  const uint16_t *bf16, *bf16hw;
  const uint8_t *e4m3hw;
  uint64_t bad;
  uint64_t first_bad;
} job_t;

static void *check(void *arg) {
  job_t *j = (job_t *)arg;
  for (uint64_t i = j->first; i < j->last; i++) {
    uint32_t u = (j->hi << CHUNK_BITS) | (uint32_t)i;
    float x;
    memcpy(&x, &u, 4);
    uint16_t hw = j->bf16hw[i];
    int nan = (u & 0x7fffffffu) > 0x7f800000u;
    int hw_ok = nan ? (hw & 0x7fffu) > 0x7f80u : hw == dsv4_f32_to_bf16(x);
    uint8_t h8 = j->e4m3hw[i];
    hw_ok = hw_ok && (nan ? (h8 & 0x7fu) == 0x7fu : h8 == dsv4_f32_to_e4m3(x));
    if (j->e4m3[i] != dsv4_f32_to_e4m3(x) || j->ue8m0[i] != ue8m0_code(x) ||
        j->bf16[i] != dsv4_f32_to_bf16(x) || !hw_ok) {
      if (j->bad++ == 0)
        j->first_bad = u;
    }
  }
  return NULL;
}

int main(void) {
  if (!gpu_available("gpu_numerics_test"))
    return GPU_SKIP;
  int failures = 0;

  float in[3] = {1.0f + 0x1p-12f, 1.0f + 0x1p-12f, -(1.0f + 0x1p-11f)}, out = 1.0f;
  float *din, *dout;
  CK(cudaMalloc(&din, sizeof(in)));
  CK(cudaMalloc(&dout, sizeof(float)));
  CK(cudaMemcpy(din, in, sizeof(in), cudaMemcpyHostToDevice));
  contraction_kernel<<<1, 1>>>(din, dout);
  CK(cudaGetLastError());
  CK(cudaMemcpy(&out, dout, sizeof(float), cudaMemcpyDeviceToHost));
  uint32_t ob;
  memcpy(&ob, &out, 4);
  printf("%s a*b+c with a = b = 1+2^-12, c = -(1+2^-11): %a (bits %08x, expected +0)\n",
         ob == 0 ? "ok  " : "FAIL", out, ob);
  failures += ob != 0;

  uint8_t *de4, *due, *he4, *hue;
  uint16_t *dbf, *hbf, *dbh, *hbh;
  uint8_t *de8h, *he8h;
  CK(cudaMalloc(&de4, CHUNK));
  CK(cudaMalloc(&due, CHUNK));
  CK(cudaMalloc(&dbf, CHUNK * 2));
  CK(cudaMalloc(&dbh, CHUNK * 2));
  CK(cudaMalloc(&de8h, CHUNK));
  CK(cudaMallocHost(&he8h, CHUNK));
  CK(cudaMallocHost(&hbh, CHUNK * 2));
  CK(cudaMallocHost(&he4, CHUNK));
  CK(cudaMallocHost(&hue, CHUNK));
  CK(cudaMallocHost(&hbf, CHUNK * 2));
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = cores < 1 ? 1 : cores > 64 ? 64 : (int)cores;
  uint64_t bad = 0, first_bad = 0;
  for (uint32_t hi = 0; hi < (1u << (32 - CHUNK_BITS)); hi++) {
    convert_kernel<<<4096, BLOCK>>>(hi, de4, due, dbf, dbh, de8h);
    CK(cudaGetLastError());
    CK(cudaMemcpy(he4, de4, CHUNK, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hue, due, CHUNK, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hbf, dbf, CHUNK * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hbh, dbh, CHUNK * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(he8h, de8h, CHUNK, cudaMemcpyDeviceToHost));
    pthread_t th[64];
    job_t jobs[64];
    for (int t = 0; t < threads; t++) {
      jobs[t] =
          job_t{hi, CHUNK * t / threads, CHUNK * (t + 1) / threads, he4, hue, hbf, hbh, he8h, 0, 0};
      pthread_create(&th[t], NULL, check, &jobs[t]);
    }
    for (int t = 0; t < threads; t++) {
      pthread_join(th[t], NULL);
      if (jobs[t].bad && bad == 0)
        first_bad = jobs[t].first_bad;
      bad += jobs[t].bad;
    }
  }
  printf("%s fp8 E4M3, UE8M0, bf16 and the bf16x2 and e4m3x2 instructions over all 2^32 fp32 "
         "inputs: %llu differ from the host",
         bad ? "FAIL" : "ok  ", (unsigned long long)bad);
  if (bad)
    printf(" (first: input bits %08llx)", (unsigned long long)first_bad);
  printf("\n");
  failures += bad != 0;
  cudaFree(de4);
  cudaFree(due);
  cudaFree(dbf);
  cudaFreeHost(he4);
  cudaFreeHost(hue);
  cudaFreeHost(hbf);
  cudaFree(dbh);
  cudaFreeHost(hbh);
  cudaFree(de8h);
  cudaFreeHost(he8h);
  cudaFree(din);
  cudaFree(dout);
  return failures ? 1 : 0;
}
