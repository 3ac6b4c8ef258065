#ifndef DSV4_TESTS_SUPPORT_MEMPOLICY_PROBE_H
#define DSV4_TESTS_SUPPORT_MEMPOLICY_PROBE_H

/*
 * What the kernel says of a thread's memory policy and of a page's node, for the tests of host
 * memory near a device (host_numa_test, gpu_numa_test). A policy belongs to the calling thread.
 */

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PROBE_MASK_LONGS 16 /* 1024 nodes */

typedef struct {
  int mode; /* MPOL_*, or -1 when the kernel has no NUMA calls */
  unsigned long mask[PROBE_MASK_LONGS];
} policy_t;

static inline policy_t policy_now(void) {
  policy_t p = {0};
  if (syscall(SYS_get_mempolicy, &p.mode, p.mask, (unsigned long)PROBE_MASK_LONGS * 64, NULL, 0UL))
    p.mode = -1;
  return p;
}

static inline int has_node(const policy_t *p, int node) {
  return node >= 0 && node < PROBE_MASK_LONGS * 64 && ((p->mask[node / 64] >> (node % 64)) & 1);
}

/* The node of the page at a, or -1. */
static inline int page_node(void *a) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, a, (unsigned long)(MPOL_F_NODE | MPOL_F_ADDR)))
    return -1;
  return node;
}

/* Binds the calling thread to node 0, as `numactl --membind=0` would: 0 or -1. */
static inline int bind_node0(void) {
  unsigned long m[PROBE_MASK_LONGS] = {1UL};
  return (int)syscall(SYS_set_mempolicy, MPOL_BIND, m, (unsigned long)PROBE_MASK_LONGS * 64);
}

#endif /* DSV4_TESTS_SUPPORT_MEMPOLICY_PROBE_H */
