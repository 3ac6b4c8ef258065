#ifndef DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H
#define DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H

/* The Level Zero test double over OpenCL (fake_ze.c). */

#include <stddef.h>

/* Device and host allocations not yet freed with zeMemFree. */
size_t fake_ze_live_allocations(void);

#endif /* DSV4_TESTS_LEVEL_ZERO_FAKE_ZE_H */
