/*
 * Error mapping and per-device facts for the CUDA launch wrappers (cuda-kernels.h).
 */
#include "cuda-internal.cuh"

#include <atomic>

#include "dsv4-error.h"

extern "C" int dsv4__cuda_err(cudaError_t e) {
  switch (e) {
  case cudaSuccess:
    return 0;
  case cudaErrorMemoryAllocation:
    return DSV4_ENOMEM;
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver:
  case cudaErrorNoKernelImageForDevice:
  case cudaErrorInvalidDevice:
    return DSV4_ENODEV;
  default:
    return DSV4_EBACKEND;
  }
}

/* One entry per device id below DEV_CACHE: 0 = not read yet, else (sms << 1 | pdl) + 1. Racing
 * readers compute and store the same value. */
static std::atomic<int> dev_cache[DEV_CACHE];

static int read_dev(int dev, dsv4__cuda_dev_t *out) {
  int sms = 0, major = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return dsv4__cuda_err(e);
  }
  out->sms = sms > 0 ? sms : 1;
  out->pdl = major >= 9;
  return 0;
}

int dsv4__cuda_dev_info(dsv4__cuda_dev_t *out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return dsv4__cuda_err(e);
  }
  if (dev < 0 || dev >= DEV_CACHE)
    return read_dev(dev, out);
  int v = dev_cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int err = read_dev(dev, out);
    if (err)
      return err;
    dev_cache[dev].store(((out->sms << 1) | out->pdl) + 1, std::memory_order_relaxed);
    return 0;
  }
  v -= 1;
  out->sms = v >> 1;
  out->pdl = v & 1;
  return 0;
}

extern "C" int dsv4__cuda_pdl_supported(int dev) {
  int major = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major >= 9;
}
