#ifndef DSV4_KERNELS_LEVEL_ZERO_LZ_PROBE_H
#define DSV4_KERNELS_LEVEL_ZERO_LZ_PROBE_H

/*
 * The inputs and the expected outputs of dsv4_fp_probe (lz_kernels.h), for the host programs that
 * run it: the Level Zero backend when it opens a device, and the OpenCL tests. Host C only.
 */

#include <stdio.h>

#include "dsv4-numerics.h"
#include "lz_kernels.h"

/* The probe's inputs: the contraction and subnormal operands, then sums of squares over many
 * octaves with every mantissa pattern class, so a divide or sqrt that is not correctly rounded
 * shows in some RMS factor. */
static inline void dsv4__lz_probe_inputs(float in[DSV4_LZ_PROBE_IN]) {
  in[0] = in[1] = 1.0f + 0x1p-12f;
  in[2] = -(1.0f + 0x1p-11f);
  in[3] = in[4] = 0x1p-70f;
  dsv4_u32 x = 0x2545F491u;
  for (int i = 0; i < DSV4_LZ_PROBE_RMS; i++) {
    x = x * 1664525u + 1013904223u;
    dsv4_u32 exponent = 107u + (x >> 26); /* 2^-20 .. 2^43 */
    in[5 + i] = dsv4_u2f((exponent << 23) | (x & 0x7fffffu));
  }
}

/* 0 when out is what SPEC §2 says; else -1 and one line in why. */
static inline int dsv4__lz_probe_check(const float in[DSV4_LZ_PROBE_IN],
                                       const float out[DSV4_LZ_PROBE_OUT], char *why,
                                       size_t why_len) {
  if (dsv4_f2u(out[0]) != 0u) {
    snprintf(why, why_len, "a*b+c gave 0x%08x, not +0: the compiler contracted it into an fma",
             (unsigned)dsv4_f2u(out[0]));
    return -1;
  }
  if (dsv4_f2u(out[1]) != 0x200u) {
    snprintf(why, why_len, "2^-70*2^-70 gave 0x%08x, not the subnormal 0x00000200 (flushed)",
             (unsigned)dsv4_f2u(out[1]));
    return -1;
  }
  for (int i = 0; i < DSV4_LZ_PROBE_RMS; i++) {
    float want = dsv4_rms_factor(in[5 + i], dsv4_u2f(DSV4_RMS_EPS_BITS));
    if (dsv4_f2u(out[2 + i]) != dsv4_f2u(want)) {
      snprintf(why, why_len,
               "the RMS factor of 0x%08x gave 0x%08x, not the correctly rounded 0x%08x "
               "(divide or sqrt not correctly rounded)",
               (unsigned)dsv4_f2u(in[5 + i]), (unsigned)dsv4_f2u(out[2 + i]),
               (unsigned)dsv4_f2u(want));
      return -1;
    }
  }
  return 0;
}

#endif /* DSV4_KERNELS_LEVEL_ZERO_LZ_PROBE_H */
