#ifndef DSV4_KERNELS_LEVEL_ZERO_LZ_BACKEND_H
#define DSV4_KERNELS_LEVEL_ZERO_LZ_BACKEND_H

#include "backend.h"

/*
 * The Level Zero backend (Intel GPUs): device memory for the cache and the batch buffers, the
 * kernels of dsv4_kernels.cl from the SPIR-V embedded at build time, one immediate command list
 * with a barrier in front of every command. DSV4_ENODEV with one line in why when zeInit finds no
 * driver, there is no GPU, or the GPU cannot give SPEC §2's numerics.
 */
int dsv4_level_zero_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                                 size_t why_len);

#endif /* DSV4_KERNELS_LEVEL_ZERO_LZ_BACKEND_H */
