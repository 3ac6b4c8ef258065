#ifndef DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H
#define DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H

/* The Level Zero test double over OpenCL (fake_ze.c). */

#include <stddef.h>

/* Device and host allocations not yet freed with zeMemFree. */
size_t fake_ze_live_allocations(void);

/* Modules built so far from the embedded SPIR-V: the correctly rounded one and the fp64 one. */
void fake_ze_modules_built(unsigned *cr, unsigned *fp64);

#endif /* DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H */
