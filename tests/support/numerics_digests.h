#ifndef DSV4_TESTS_NUMERICS_DIGESTS_H
#define DSV4_TESTS_NUMERICS_DIGESTS_H

/*
 * The frozen outputs of the shared transcendental routines (kernels/dsv4-numerics.h, SPEC §7): the
 * XXH3-64 (seed 0) of the 2^32 little-endian fp32 results of the routine for the inputs whose bit
 * patterns are 0x00000000, 0x00000001, ..., 0xFFFFFFFF, in that order. The CPU test
 * (tests/unit/expf_logf_test.c) and the CUDA test (tests/gpu/gpu_expf_logf_test.cu) check the
 * same constants, so a change of either routine, or a backend that rounds one operation
 * differently, fails both. A deliberate change of a routine changes the numerics of every backend
 * and is a new version of exact-mode attention: these constants change with it, in the same commit.
 */
#define DSV4_EXPF_DIGEST UINT64_C(0x468658df8dd7c7a8)
#define DSV4_LOGF_DIGEST UINT64_C(0x9c70beb089c16d0e)

#endif /* DSV4_TESTS_NUMERICS_DIGESTS_H */
