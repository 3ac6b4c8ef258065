#ifndef DSV4_KERNELS_CPU_BACKEND_H
#define DSV4_KERNELS_CPU_BACKEND_H

#include "backend.h"

/* The CPU reference backend: host memory, a pool of worker threads over tokens. */
int dsv4_cpu_backend_open(const dsv4_backend_options_t *opt, dsv4_backend_t **out, char *why,
                          size_t why_len);

#endif /* DSV4_KERNELS_CPU_BACKEND_H */
