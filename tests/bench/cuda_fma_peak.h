#ifndef DSV4_TESTS_BENCH_CUDA_FMA_PEAK_H
#define DSV4_TESTS_BENCH_CUDA_FMA_PEAK_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The fp32 FMA rate of the current device in GFLOP/s (2 per fma), measured on s
 * (cuda_fma_peak.cu); 0 when a CUDA call failed. */
double bench_fma_peak_gflops(cudaStream_t s);
/* The bf16 tensor-core rate (mma.sync m16n8k16, fp32 accumulation) in GFLOP/s; 0 on failure or
 * before compute capability 8.0. */
double bench_mma_peak_gflops(cudaStream_t s);
/* Both measured on s and printed, peak[0] the fp32 FMA rate and, with tensor_cores, peak[1] the
 * tensor-core rate (else 0); -1 with a line naming `bench` on stderr when a measurement failed. */
int bench_peaks(const char *bench, cudaStream_t s, int tensor_cores, double peak[2]);

#ifdef __cplusplus
}
#endif

#endif
