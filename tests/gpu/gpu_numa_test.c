/*
 * The CUDA backend's page-locked memory near the device (cuda_backend.c, prefer_device_node): after
 * the backend opens, the opening thread and the threads it starts prefer the device's NUMA node,
 * and memory registered then (as start-up registers the daemon's pool) lies on that node. A policy
 * the operator set (numactl) is kept, and DSV4_CUDA_NO_NUMA=1 leaves the thread's policy alone.
 * Each case runs on a thread of its own, since a memory policy belongs to a thread.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../support/mempolicy_probe.h"
#include "backend.h"
#include "gpu_check.h"

#define REGION ((size_t)8 << 20)

static int failures;

static void expect(int ok, const char *what) {
  if (!ok) {
    fprintf(stderr, "gpu_numa_test: FAILED: %s\n", what);
    failures++;
  }
}

/* The device's node as sysfs says, found here apart from the backend's own lookup. */
static int sysfs_node(void) {
  char bus[64], path[128];
  unsigned dom = 0, b = 0, d = 0, fn = 0;
  int node = -1;
  CK(cudaDeviceGetPCIBusId(bus, (int)sizeof(bus), 0));
  if (sscanf(bus, "%x:%x:%x.%x", &dom, &b, &d, &fn) != 4)
    fprintf(stderr, "gpu_numa_test: cannot read the bus id %s\n", bus);
  snprintf(path, sizeof(path), "/sys/bus/pci/devices/%04x:%02x:%02x.%x/numa_node", dom, b, d, fn);
  printf("gpu_numa_test: bus id %s, %s\n", bus, path);
  FILE *f = fopen(path, "r");
  if (f) {
    if (fscanf(f, "%d", &node) != 1)
      node = -1;
    fclose(f);
  }
  return node;
}

static void *read_policy(void *out) {
  *(policy_t *)out = policy_now();
  return NULL;
}

typedef struct {
  int preset; /* the thread binds itself to bind_to before the backend opens, as numactl would */
  int bind_to;
  policy_t got; /* the opening thread's policy after the open */
  policy_t child;
  int first_page, last_page; /* nodes of a region registered after the open */
} case_t;

static void *run_case(void *arg) {
  case_t *k = arg;
  char why[256] = "";
  dsv4_backend_t *be = NULL;
  dsv4_backend_options_t opt = {.threads = 2};
  if (k->preset) {
    if (bind_node(k->bind_to))
      perror("set_mempolicy");
  }
  if (dsv4_backend_open("cuda", &opt, &be, why, sizeof(why))) {
    fprintf(stderr, "gpu_numa_test: cannot open the cuda backend: %s\n", why);
    exit(1);
  }
  k->got = policy_now();
  pthread_t t;
  pthread_create(&t, NULL, read_policy, &k->child);
  pthread_join(t, NULL);
  uint8_t *r = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED || be->ops->host_register(be, r, REGION)) {
    fprintf(stderr, "gpu_numa_test: cannot map and register %zu bytes\n", REGION);
    exit(1);
  }
  k->first_page = page_node(r);
  k->last_page = page_node(r + REGION - 1);
  be->ops->host_unregister(be, r);
  munmap(r, REGION);
  dsv4_backend_close(be);
  return NULL;
}

static case_t run_on_thread(int preset, const char *no_numa, int bind_to) {
  case_t k = {.preset = preset, .bind_to = bind_to};
  if (no_numa)
    setenv("DSV4_CUDA_NO_NUMA", no_numa, 1);
  else
    unsetenv("DSV4_CUDA_NO_NUMA");
  pthread_t t;
  pthread_create(&t, NULL, run_case, &k);
  pthread_join(t, NULL);
  return k;
}

int main(void) {
  if (!gpu_available("gpu_numa_test"))
    return GPU_SKIP;
  int node = sysfs_node(), allowed = first_allowed_node();
  printf("gpu_numa_test: the device's node (sysfs): %d\n", node);
  if (policy_now().mode == -1 || allowed < 0) {
    printf("gpu_numa_test: skipped: the kernel answers no memory policy calls here\n");
    return GPU_SKIP;
  }
  /* A cpuset that leaves the device's node out: the preference is still taken, the pages go
   * where the cpuset lets them. */
  int near_ok = node >= 0 && node_allowed(node);

  case_t k = run_on_thread(0, NULL, 0);
  if (node >= 0) {
    expect(k.got.mode == MPOL_PREFERRED && has_node(&k.got, node),
           "the opening thread prefers the device's node");
    expect(k.child.mode == MPOL_PREFERRED && has_node(&k.child, node),
           "a thread started after the open prefers it too");
    expect(!near_ok || (k.first_page == node && k.last_page == node),
           "memory registered after the open lies on the device's node");
  } else {
    expect(k.got.mode == MPOL_DEFAULT, "no node known: the thread's policy is left alone");
  }
  printf("gpu_numa_test: default: policy %d, registered pages on nodes %d and %d\n", k.got.mode,
         k.first_page, k.last_page);

  k = run_on_thread(0, "1", 0);
  expect(k.got.mode == MPOL_DEFAULT, "DSV4_CUDA_NO_NUMA=1 leaves the policy alone");

  k = run_on_thread(1, NULL, allowed);
  expect(k.got.mode == MPOL_BIND && has_node(&k.got, allowed),
         "an operator's policy (bound to one node) is kept");
  expect(k.first_page == allowed && k.last_page == allowed, "and the registered pages follow it");

  if (failures)
    return 1;
  printf("gpu_numa_test: passed\n");
  return 0;
}
