#ifndef DSV4_KERNELS_LEVEL_ZERO_LZ_SPIRV_H
#define DSV4_KERNELS_LEVEL_ZERO_LZ_SPIRV_H

/*
 * The Level Zero backend's kernels (dsv4_kernels.cl) as SPIR-V, compiled at build time by clang
 * (-target spir64) and llvm-spirv and embedded by embed_spirv.cmake.
 *
 * dsv4__lz_spirv_cr: fp32 divide and sqrt as written, for devices that report correctly rounded
 * fp32 divide/sqrt (the module is built with -cl-fp32-correctly-rounded-divide-sqrt, and so is it
 * on the device). dsv4__lz_spirv_fp64: the SPEC §2 double-precision divide and sqrt
 * (DSV4_CL_RMS_FP64), for devices that do not report it but have fp64.
 */

#include <stddef.h>

extern const unsigned char dsv4__lz_spirv_cr[];
extern const size_t dsv4__lz_spirv_cr_size;
extern const unsigned char dsv4__lz_spirv_fp64[];
extern const size_t dsv4__lz_spirv_fp64_size;

#endif /* DSV4_KERNELS_LEVEL_ZERO_LZ_SPIRV_H */
