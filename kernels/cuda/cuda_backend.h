#ifndef DSV4_KERNELS_CUDA_CUDA_BACKEND_H
#define DSV4_KERNELS_CUDA_CUDA_BACKEND_H

/*
 * The CUDA backend: device 0, one stream, device memory from cudaMalloc (zero-filled on the
 * stream), host copies through pinned staging, the kernels of cuda-kernels.h with programmatic
 * dependent launch on compute capability 9.0 and newer. Device memory is not host memory (no
 * DSV4_BE_HOST_MEMORY), so the engine stages every batch through upload/download.
 *
 * Plain C: this header does not include the CUDA headers, so kernels/backend.c includes it in any
 * build that has DSV4_HAVE_CUDA.
 */

#include <stddef.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DSV4_ENODEV with why = "no CUDA device (cudaGetDeviceCount: ...)" when there is no device or no
 * usable driver; DSV4_ENOMEM / DSV4_EBACKEND for other failures, each with one line in why. */
int dsv4_cuda_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                           size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_CUDA_CUDA_BACKEND_H */
