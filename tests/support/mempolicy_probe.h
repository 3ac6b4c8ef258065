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

/* maxnode is one past the mask's bits, as the kernel reads it. */
#define PROBE_MAXNODE ((unsigned long)PROBE_MASK_LONGS * 64 + 1)

static inline policy_t policy_now(void) {
  policy_t p = {0};
  if (syscall(SYS_get_mempolicy, &p.mode, p.mask, PROBE_MAXNODE, NULL, 0UL))
    p.mode = -1;
  return p;
}

static inline int has_node(const policy_t *p, int node) {
  return node >= 0 && node < PROBE_MASK_LONGS * 64 && ((p->mask[node / 64] >> (node % 64)) & 1);
}

/* The nodes the thread may allocate on (its cpuset's memory nodes); mode -1 if not told. */
static inline policy_t allowed_nodes(void) {
  policy_t p = {0};
  if (syscall(SYS_get_mempolicy, NULL, p.mask, PROBE_MAXNODE, NULL,
              (unsigned long)MPOL_F_MEMS_ALLOWED))
    p.mode = -1;
  return p;
}

/* The lowest of them, or -1. */
static inline int first_allowed_node(void) {
  policy_t a = allowed_nodes();
  for (int n = 0; a.mode != -1 && n < PROBE_MASK_LONGS * 64; n++)
    if (has_node(&a, n))
      return n;
  return -1;
}

static inline int node_allowed(int n) {
  policy_t a = allowed_nodes();
  return a.mode != -1 && has_node(&a, n);
}

/* The node of the page at a, or -1. */
static inline int page_node(void *a) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, a, (unsigned long)(MPOL_F_NODE | MPOL_F_ADDR)))
    return -1;
  return node;
}

/* Binds the calling thread to node n, as `numactl --membind=n` would: 0 or -1. */
static inline int bind_node(int n) {
  unsigned long m[PROBE_MASK_LONGS] = {0};
  if (n < 0 || n >= PROBE_MASK_LONGS * 64)
    return -1;
  m[n / 64] = 1UL << (n % 64);
  return (int)syscall(SYS_set_mempolicy, MPOL_BIND, m, PROBE_MAXNODE);
}

#endif /* DSV4_TESTS_SUPPORT_MEMPOLICY_PROBE_H */
