/*
 * A test double of the Level Zero API, over OpenCL (PoCL), so that the Level Zero backend's host
 * glue (kernels/level_zero/lz_backend.c) runs end to end on a machine without an Intel GPU: device
 * discovery, the property checks, device and host memory, the immediate command list with its
 * barriers and events, copies and fills, the module, kernel arguments and group counts.
 *
 * It implements exactly the ze* functions the backend calls, with the prototypes of ze_api.h, and
 * is linked into a test program in place of the loader. It is strict where the real API is:
 *   - two commands not separated by a barrier may run in any order on Level Zero; here they run
 *     in the REVERSE of the order they were appended, one at a time (each waits on a gate that
 *     the next barrier opens, last first), so a missing barrier shows on every run rather than
 *     when a scheduler happens to reorder;
 *   - device memory starts as 0xA5 bytes (never zero), so a missing zero-fill shows;
 *   - zeModuleCreate wants SPIR-V (the magic number) and the build flag
 *     -cl-fp32-correctly-rounded-divide-sqrt; since PoCL takes no SPIR-V, it builds the same .cl
 *     source instead, with -DDSV4_CL_RMS_FP64 when handed the fp64 module;
 *   - a kernel argument of the wrong size, an unknown index or a pointer that is not a live device
 *     allocation fails, and allocations still alive when the context is destroyed are counted.
 * Environment: FAKE_ZE_FP32_FLAGS (hex ze_device_fp_flags_t for fp32), FAKE_ZE_MAX_GROUPS
 * (maxGroupCountX), FAKE_ZE_NO_DRIVER (zeInit fails).
 */
#define CL_TARGET_OPENCL_VERSION 200
#include "fake_ze.h"

#include <CL/cl.h>
#include <level_zero/ze_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "level_zero/lz_spirv.h"

struct _ze_driver_handle_t {
  int unused;
};
struct _ze_device_handle_t {
  int unused;
};
struct _ze_context_handle_t {
  int unused;
};
struct _ze_event_pool_handle_t {
  int unused;
};
struct _ze_command_list_handle_t {
  cl_command_queue q; /* out of order: the order is set by the gates and barriers */
  cl_event *gate;     /* since the last barrier: each command's user-event gate ... */
  cl_event *done;     /* ... and its completion */
  size_t n, cap;
};
struct _ze_event_handle_t {
  cl_event ev; /* NULL until a command signals it */
};
struct _ze_module_handle_t {
  cl_program prog;
};
struct _ze_module_build_log_handle_t {
  char *text;
};
struct _ze_kernel_handle_t {
  cl_kernel k;
  size_t group;
  cl_uint nargs;
  int is_ptr[32];
};

static struct {
  int init;
  cl_device_id dev;
  cl_context ctx;
  struct _ze_driver_handle_t driver;
  struct _ze_device_handle_t device;
  struct _ze_context_handle_t context;
  struct _ze_event_pool_handle_t pool;
} g;

/* Live allocations: device (SVM) and host. */
#define MAX_ALLOCS 4096
static struct {
  void *p;
  size_t size;
  int device;
  void *base; /* what clSVMAlloc returned (p is aligned further when asked) */
} allocs[MAX_ALLOCS];

static unsigned modules_built[2]; /* [0] correctly rounded, [1] fp64 */

void fake_ze_modules_built(unsigned *cr, unsigned *fp64) {
  *cr = modules_built[0];
  *fp64 = modules_built[1];
}

size_t fake_ze_live_allocations(void) {
  size_t n = 0;
  for (size_t i = 0; i < MAX_ALLOCS; i++)
    n += allocs[i].p != NULL;
  return n;
}

static int track(void *p, size_t size, int device, void *base) {
  for (size_t i = 0; i < MAX_ALLOCS; i++)
    if (!allocs[i].p) {
      allocs[i].p = p;
      allocs[i].size = size;
      allocs[i].device = device;
      allocs[i].base = base;
      return 0;
    }
  return -1;
}

/* The device allocation holding [p, p + n), or -1. */
static long find_alloc(const void *p, size_t n) {
  const char *c = p;
  for (size_t i = 0; i < MAX_ALLOCS; i++) {
    const char *b = allocs[i].p;
    if (b && c >= b && n <= allocs[i].size && (size_t)(c - b) <= allocs[i].size - n)
      return (long)i;
  }
  return -1;
}

static ze_result_t from_cl(cl_int e) {
  switch (e) {
  case CL_SUCCESS:
    return ZE_RESULT_SUCCESS;
  case CL_OUT_OF_RESOURCES:
  case CL_MEM_OBJECT_ALLOCATION_FAILURE:
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  case CL_OUT_OF_HOST_MEMORY:
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  case CL_INVALID_ARG_SIZE:
    return ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE;
  case CL_INVALID_ARG_INDEX:
    return ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX;
  case CL_INVALID_WORK_GROUP_SIZE:
    return ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION;
  default:
    fprintf(stderr, "fake_ze: OpenCL error %d\n", (int)e);
    return ZE_RESULT_ERROR_UNKNOWN;
  }
}

static unsigned long env_hex(const char *name, unsigned long dflt) {
  const char *v = getenv(name);
  return v && *v ? strtoul(v, NULL, 0) : dflt;
}

ze_result_t ZE_APICALL zeInit(ze_init_flags_t flags) {
  (void)flags;
  if (getenv("FAKE_ZE_NO_DRIVER"))
    return ZE_RESULT_ERROR_UNINITIALIZED;
  if (g.init)
    return ZE_RESULT_SUCCESS;
  cl_platform_id plat;
  cl_uint n = 0;
  if (clGetPlatformIDs(1, &plat, &n) != CL_SUCCESS || n == 0 ||
      clGetDeviceIDs(plat, CL_DEVICE_TYPE_ALL, 1, &g.dev, &n) != CL_SUCCESS || n == 0)
    return ZE_RESULT_ERROR_UNINITIALIZED;
  cl_int e;
  g.ctx = clCreateContext(NULL, 1, &g.dev, NULL, NULL, &e);
  if (e != CL_SUCCESS)
    return ZE_RESULT_ERROR_UNINITIALIZED;
  g.init = 1;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDriverGet(uint32_t *pCount, ze_driver_handle_t *phDrivers) {
  if (!g.init)
    return ZE_RESULT_ERROR_UNINITIALIZED;
  if (phDrivers && *pCount >= 1)
    phDrivers[0] = &g.driver;
  *pCount = 1;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDeviceGet(ze_driver_handle_t hDriver, uint32_t *pCount,
                                   ze_device_handle_t *phDevices) {
  if (hDriver != &g.driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (phDevices && *pCount >= 1)
    phDevices[0] = &g.device;
  *pCount = 1;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDeviceGetProperties(ze_device_handle_t hDevice,
                                             ze_device_properties_t *p) {
  if (hDevice != &g.device || p->stype != ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  p->type = ZE_DEVICE_TYPE_GPU;
  snprintf(p->name, sizeof(p->name), "fake Level Zero GPU over OpenCL");
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDeviceGetModuleProperties(ze_device_handle_t hDevice,
                                                   ze_device_module_properties_t *p) {
  if (hDevice != &g.device || p->stype != ZE_STRUCTURE_TYPE_DEVICE_MODULE_PROPERTIES)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  p->spirvVersionSupported = ZE_MAKE_VERSION(1, 2);
  p->flags = ZE_DEVICE_MODULE_FLAG_FP64;
  p->fp32flags = (ze_device_fp_flags_t)env_hex(
      "FAKE_ZE_FP32_FLAGS", ZE_DEVICE_FP_FLAG_DENORM | ZE_DEVICE_FP_FLAG_INF_NAN |
                                ZE_DEVICE_FP_FLAG_ROUND_TO_NEAREST | ZE_DEVICE_FP_FLAG_FMA |
                                ZE_DEVICE_FP_FLAG_ROUNDED_DIVIDE_SQRT);
  p->fp64flags = ZE_DEVICE_FP_FLAG_DENORM | ZE_DEVICE_FP_FLAG_ROUND_TO_NEAREST;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDeviceGetComputeProperties(ze_device_handle_t hDevice,
                                                    ze_device_compute_properties_t *p) {
  if (hDevice != &g.device || p->stype != ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  p->maxTotalGroupSize = p->maxGroupSizeX = 1024;
  p->maxGroupSizeY = p->maxGroupSizeZ = 1;
  p->maxGroupCountX = (uint32_t)env_hex("FAKE_ZE_MAX_GROUPS", 0xffffffffu);
  p->maxGroupCountY = p->maxGroupCountZ = 1;
  p->maxSharedLocalMemory = 65536;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeDeviceGetCommandQueueGroupProperties(
    ze_device_handle_t hDevice, uint32_t *pCount, ze_command_queue_group_properties_t *p) {
  if (hDevice != &g.device)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p && *pCount >= 1) {
    if (p[0].stype != ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES)
      return ZE_RESULT_ERROR_INVALID_ARGUMENT;
    p[0].flags =
        ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE | ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY;
    p[0].maxMemoryFillPatternSize = 128;
    p[0].numQueues = 1;
  }
  *pCount = 1;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeContextCreate(ze_driver_handle_t hDriver, const ze_context_desc_t *desc,
                                       ze_context_handle_t *phContext) {
  if (hDriver != &g.driver || desc->stype != ZE_STRUCTURE_TYPE_CONTEXT_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  *phContext = &g.context;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeContextDestroy(ze_context_handle_t hContext) {
  if (hContext != &g.context)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  size_t live = fake_ze_live_allocations();
  if (live)
    fprintf(stderr, "fake_ze: context destroyed with %zu allocations alive\n", live);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeCommandListCreateImmediate(ze_context_handle_t hContext,
                                                    ze_device_handle_t hDevice,
                                                    const ze_command_queue_desc_t *desc,
                                                    ze_command_list_handle_t *phList) {
  if (hContext != &g.context || hDevice != &g.device ||
      desc->stype != ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC || desc->ordinal != 0)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  ze_command_list_handle_t l = calloc(1, sizeof(*l));
  if (!l)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  /* Out of order, as a Level Zero command list is without barriers. */
  cl_queue_properties props[] = {CL_QUEUE_PROPERTIES, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, 0};
  cl_int e;
  l->q = clCreateCommandQueueWithProperties(g.ctx, g.dev, props, &e);
  if (e != CL_SUCCESS) {
    free(l);
    return from_cl(e);
  }
  *phList = l;
  return ZE_RESULT_SUCCESS;
}

/* A closed gate for the next command; *gate is what the command waits on. */
static ze_result_t gate_new(ze_command_list_handle_t l, cl_event *gate) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 8;
    cl_event *g2 = realloc(l->gate, cap * sizeof(*g2));
    if (!g2)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    l->gate = g2;
    cl_event *d2 = realloc(l->done, cap * sizeof(*d2));
    if (!d2)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    l->done = d2;
    l->cap = cap;
  }
  cl_int e;
  *gate = clCreateUserEvent(g.ctx, &e);
  return from_cl(e);
}

/* Records an enqueued command (or, when the enqueue failed, opens and drops its gate). */
static ze_result_t gate_keep(ze_command_list_handle_t l, cl_event gate, cl_event done, cl_int e) {
  if (e != CL_SUCCESS) {
    clSetUserEventStatus(gate, CL_COMPLETE);
    clReleaseEvent(gate);
    return from_cl(e);
  }
  l->gate[l->n] = gate;
  l->done[l->n++] = done;
  return ZE_RESULT_SUCCESS;
}

/* Runs the commands appended since the last barrier, last appended first, one at a time. */
static ze_result_t gates_open(ze_command_list_handle_t l) {
  cl_int e = CL_SUCCESS;
  for (size_t i = l->n; i-- > 0;) {
    cl_int e1 = clSetUserEventStatus(l->gate[i], CL_COMPLETE);
    cl_int e2 = clFlush(l->q);
    cl_int e3 = clWaitForEvents(1, &l->done[i]);
    if (e == CL_SUCCESS)
      e = e1 != CL_SUCCESS ? e1 : e2 != CL_SUCCESS ? e2 : e3;
    clReleaseEvent(l->gate[i]);
    clReleaseEvent(l->done[i]);
  }
  l->n = 0;
  return from_cl(e);
}

ze_result_t ZE_APICALL zeCommandListDestroy(ze_command_list_handle_t l) {
  (void)gates_open(l);
  clFinish(l->q);
  free(l->gate);
  free(l->done);
  clReleaseCommandQueue(l->q);
  free(l);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeCommandListAppendBarrier(ze_command_list_handle_t l,
                                                  ze_event_handle_t hSignalEvent,
                                                  uint32_t numWaitEvents,
                                                  ze_event_handle_t *phWaitEvents) {
  if (numWaitEvents || phWaitEvents)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; /* the backend never waits on events */
  ze_result_t r = gates_open(l);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  cl_event ev = NULL;
  cl_int e = clEnqueueBarrierWithWaitList(l->q, 0, NULL, hSignalEvent ? &ev : NULL);
  if (e == CL_SUCCESS && hSignalEvent) {
    if (hSignalEvent->ev) /* signalled again before a reset: the backend never does that */
      return ZE_RESULT_ERROR_INVALID_ARGUMENT;
    hSignalEvent->ev = ev;
  }
  return from_cl(e);
}

ze_result_t ZE_APICALL zeCommandListAppendMemoryCopy(ze_command_list_handle_t l, void *dst,
                                                     const void *src, size_t size,
                                                     ze_event_handle_t hSignalEvent,
                                                     uint32_t numWaitEvents,
                                                     ze_event_handle_t *phWaitEvents) {
  if (hSignalEvent || numWaitEvents || phWaitEvents)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
  if (find_alloc(dst, size) < 0 || find_alloc(src, size) < 0) {
    fprintf(stderr, "fake_ze: copy of %zu bytes outside the allocations\n", size);
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  cl_event gate, done;
  ze_result_t r = gate_new(l, &gate);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  cl_int e = clEnqueueSVMMemcpy(l->q, CL_FALSE, dst, src, size, 1, &gate, &done);
  return gate_keep(l, gate, done, e);
}

ze_result_t ZE_APICALL zeCommandListAppendMemoryFill(ze_command_list_handle_t l, void *ptr,
                                                     const void *pattern, size_t pattern_size,
                                                     size_t size, ze_event_handle_t hSignalEvent,
                                                     uint32_t numWaitEvents,
                                                     ze_event_handle_t *phWaitEvents) {
  if (hSignalEvent || numWaitEvents || phWaitEvents)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
  if (find_alloc(ptr, size) < 0 || size % pattern_size)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  cl_event gate, done;
  ze_result_t r = gate_new(l, &gate);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  cl_int e = clEnqueueSVMMemFill(l->q, ptr, pattern, pattern_size, size, 1, &gate, &done);
  return gate_keep(l, gate, done, e);
}

ze_result_t ZE_APICALL zeCommandListAppendLaunchKernel(
    ze_command_list_handle_t l, ze_kernel_handle_t k, const ze_group_count_t *groups,
    ze_event_handle_t hSignalEvent, uint32_t numWaitEvents, ze_event_handle_t *phWaitEvents) {
  if (hSignalEvent || numWaitEvents || phWaitEvents)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
  uint32_t max = (uint32_t)env_hex("FAKE_ZE_MAX_GROUPS", 0xffffffffu);
  if (groups->groupCountX == 0 || groups->groupCountX > max || groups->groupCountY != 1 ||
      groups->groupCountZ != 1 || k->group == 0)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  size_t local = k->group, global = (size_t)groups->groupCountX * local;
  cl_event gate, done;
  ze_result_t r = gate_new(l, &gate);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  cl_int e = clEnqueueNDRangeKernel(l->q, k->k, 1, NULL, &global, &local, 1, &gate, &done);
  return gate_keep(l, gate, done, e);
}

ze_result_t ZE_APICALL zeEventPoolCreate(ze_context_handle_t hContext,
                                         const ze_event_pool_desc_t *desc, uint32_t numDevices,
                                         ze_device_handle_t *phDevices,
                                         ze_event_pool_handle_t *phPool) {
  (void)numDevices;
  (void)phDevices;
  if (hContext != &g.context || desc->stype != ZE_STRUCTURE_TYPE_EVENT_POOL_DESC ||
      !(desc->flags & ZE_EVENT_POOL_FLAG_HOST_VISIBLE))
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  *phPool = &g.pool;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeEventPoolDestroy(ze_event_pool_handle_t hPool) {
  return hPool == &g.pool ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
}

ze_result_t ZE_APICALL zeEventCreate(ze_event_pool_handle_t hPool, const ze_event_desc_t *desc,
                                     ze_event_handle_t *phEvent) {
  if (hPool != &g.pool || desc->stype != ZE_STRUCTURE_TYPE_EVENT_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  *phEvent = calloc(1, sizeof(**phEvent));
  return *phEvent ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
}

ze_result_t ZE_APICALL zeEventDestroy(ze_event_handle_t ev) {
  if (ev->ev)
    clReleaseEvent(ev->ev);
  free(ev);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeEventHostSynchronize(ze_event_handle_t ev, uint64_t timeout) {
  (void)timeout;
  if (!ev->ev)
    return ZE_RESULT_NOT_READY; /* nothing will ever signal it */
  return from_cl(clWaitForEvents(1, &ev->ev));
}

ze_result_t ZE_APICALL zeEventHostReset(ze_event_handle_t ev) {
  if (ev->ev)
    clReleaseEvent(ev->ev);
  ev->ev = NULL;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeMemAllocDevice(ze_context_handle_t hContext,
                                        const ze_device_mem_alloc_desc_t *desc, size_t size,
                                        size_t alignment, ze_device_handle_t hDevice, void **pptr) {
  if (hContext != &g.context || hDevice != &g.device ||
      desc->stype != ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC || size == 0)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (alignment & (alignment - 1))
    return ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT;
  /* PoCL aligns SVM to 128 bytes at most: over-allocate and align by hand. */
  void *base =
      clSVMAlloc(g.ctx, CL_MEM_READ_WRITE | CL_MEM_SVM_FINE_GRAIN_BUFFER, size + alignment, 0);
  if (!base)
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  uintptr_t a = alignment ? alignment : 1;
  void *p = (void *)(((uintptr_t)base + a - 1) & ~(a - 1));
  memset(p, 0xA5, size); /* device memory is not zeroed */
  if (track(p, size, 1, base) != 0) {
    clSVMFree(g.ctx, base);
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  }
  *pptr = p;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeMemAllocHost(ze_context_handle_t hContext,
                                      const ze_host_mem_alloc_desc_t *desc, size_t size,
                                      size_t alignment, void **pptr) {
  if (hContext != &g.context || desc->stype != ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC || size == 0)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  void *p = aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
  if (!p)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  if (track(p, size, 0, p) != 0) {
    free(p);
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  }
  *pptr = p;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeMemFree(ze_context_handle_t hContext, void *ptr) {
  if (hContext != &g.context)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  for (size_t i = 0; i < MAX_ALLOCS; i++)
    if (allocs[i].p == ptr) {
      if (allocs[i].device)
        clSVMFree(g.ctx, allocs[i].base);
      else
        free(ptr);
      allocs[i].p = NULL;
      return ZE_RESULT_SUCCESS;
    }
  fprintf(stderr, "fake_ze: zeMemFree of %p, which is not an allocation\n", ptr);
  return ZE_RESULT_ERROR_INVALID_ARGUMENT;
}

static ze_result_t build_log(ze_module_build_log_handle_t *out, const char *text) {
  if (!out)
    return ZE_RESULT_SUCCESS;
  *out = calloc(1, sizeof(**out));
  if (*out)
    (*out)->text = strdup(text);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeModuleCreate(ze_context_handle_t hContext, ze_device_handle_t hDevice,
                                      const ze_module_desc_t *desc, ze_module_handle_t *phModule,
                                      ze_module_build_log_handle_t *phBuildLog) {
  if (hContext != &g.context || hDevice != &g.device ||
      desc->stype != ZE_STRUCTURE_TYPE_MODULE_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  const unsigned char *m = desc->pInputModule;
  if (desc->format != ZE_MODULE_FORMAT_IL_SPIRV || desc->inputSize < 20 || m[0] != 0x03 ||
      m[1] != 0x02 || m[2] != 0x23 || m[3] != 0x07) {
    build_log(phBuildLog, "not a SPIR-V module");
    return ZE_RESULT_ERROR_INVALID_NATIVE_BINARY;
  }
  int fp64 = m == dsv4__lz_spirv_fp64;
  if (!fp64 && m != dsv4__lz_spirv_cr) {
    build_log(phBuildLog, "fake_ze knows only the two embedded modules");
    return ZE_RESULT_ERROR_INVALID_NATIVE_BINARY;
  }
  const char *flags = desc->pBuildFlags ? desc->pBuildFlags : "";
  if (!strstr(flags, "-cl-fp32-correctly-rounded-divide-sqrt")) {
    build_log(phBuildLog, "build flags lack -cl-fp32-correctly-rounded-divide-sqrt");
    return ZE_RESULT_ERROR_MODULE_BUILD_FAILURE;
  }
  FILE *f = fopen(DSV4_LZ_CL_SOURCE, "rb");
  if (!f)
    return ZE_RESULT_ERROR_MODULE_BUILD_FAILURE;
  static char src[1 << 17];
  size_t len = fread(src, 1, sizeof(src) - 1, f);
  fclose(f);
  src[len] = '\0';
  const char *srcs[] = {src};
  cl_int e;
  cl_program prog = clCreateProgramWithSource(g.ctx, 1, srcs, &len, &e);
  if (e != CL_SUCCESS)
    return from_cl(e);
  char opts[1024];
  snprintf(opts, sizeof(opts), "-cl-std=CL1.2 -cl-kernel-arg-info -I%s %s%s", DSV4_LZ_KERNELS_DIR,
           flags, fp64 ? " -DDSV4_CL_RMS_FP64" : "");
  e = clBuildProgram(prog, 1, &g.dev, opts, NULL, NULL);
  if (e != CL_SUCCESS) {
    static char log[1 << 14];
    clGetProgramBuildInfo(prog, g.dev, CL_PROGRAM_BUILD_LOG, sizeof(log), log, NULL);
    build_log(phBuildLog, log);
    clReleaseProgram(prog);
    return ZE_RESULT_ERROR_MODULE_BUILD_FAILURE;
  }
  build_log(phBuildLog, "");
  modules_built[fp64]++;
  *phModule = calloc(1, sizeof(**phModule));
  if (!*phModule)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  (*phModule)->prog = prog;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeModuleDestroy(ze_module_handle_t hModule) {
  clReleaseProgram(hModule->prog);
  free(hModule);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeModuleBuildLogGetString(ze_module_build_log_handle_t hLog, size_t *pSize,
                                                 char *pBuildLog) {
  const char *t = hLog->text ? hLog->text : "";
  if (!pBuildLog) {
    *pSize = strlen(t) + 1;
    return ZE_RESULT_SUCCESS;
  }
  snprintf(pBuildLog, *pSize, "%s", t);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeModuleBuildLogDestroy(ze_module_build_log_handle_t hLog) {
  free(hLog->text);
  free(hLog);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeKernelCreate(ze_module_handle_t hModule, const ze_kernel_desc_t *desc,
                                      ze_kernel_handle_t *phKernel) {
  if (desc->stype != ZE_STRUCTURE_TYPE_KERNEL_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  cl_int e;
  cl_kernel k = clCreateKernel(hModule->prog, desc->pKernelName, &e);
  if (e != CL_SUCCESS)
    return ZE_RESULT_ERROR_INVALID_KERNEL_NAME;
  ze_kernel_handle_t z = calloc(1, sizeof(*z));
  if (!z) {
    clReleaseKernel(k);
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  }
  z->k = k;
  clGetKernelInfo(k, CL_KERNEL_NUM_ARGS, sizeof(z->nargs), &z->nargs, NULL);
  if (z->nargs > 32)
    z->nargs = 32;
  for (cl_uint i = 0; i < z->nargs; i++) {
    cl_kernel_arg_address_qualifier q = 0;
    clGetKernelArgInfo(k, i, CL_KERNEL_ARG_ADDRESS_QUALIFIER, sizeof(q), &q, NULL);
    z->is_ptr[i] = q == CL_KERNEL_ARG_ADDRESS_GLOBAL;
  }
  *phKernel = z;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeKernelDestroy(ze_kernel_handle_t k) {
  clReleaseKernel(k->k);
  free(k);
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeKernelSetGroupSize(ze_kernel_handle_t k, uint32_t x, uint32_t y,
                                            uint32_t z) {
  if (y != 1 || z != 1 || x == 0)
    return ZE_RESULT_ERROR_INVALID_GROUP_SIZE_DIMENSION;
  k->group = x;
  return ZE_RESULT_SUCCESS;
}

ze_result_t ZE_APICALL zeKernelSetArgumentValue(ze_kernel_handle_t k, uint32_t argIndex,
                                                size_t argSize, const void *pArgValue) {
  if (argIndex >= k->nargs)
    return ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_INDEX;
  if (!k->is_ptr[argIndex])
    return from_cl(clSetKernelArg(k->k, argIndex, argSize, pArgValue));
  if (argSize != sizeof(void *) || !pArgValue)
    return ZE_RESULT_ERROR_INVALID_KERNEL_ARGUMENT_SIZE;
  void *p;
  memcpy(&p, pArgValue, sizeof(p));
  /* A device pointer must be a live allocation (the kernels read nothing through host memory). */
  long a = find_alloc(p, 1);
  if (a < 0 || !allocs[a].device) {
    fprintf(stderr, "fake_ze: kernel argument %u is not device memory (%p)\n", argIndex, p);
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  return from_cl(clSetKernelArgSVMPointer(k->k, argIndex, p));
}
