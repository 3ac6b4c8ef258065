/*
 * Host memory near a device (host_numa.h), by the kernel's memory policy system calls: the C
 * library has no wrapper for them, and the calls here are the two libnuma would make.
 */
#include "host_numa.h"

#include <linux/mempolicy.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Nodes a preference may name: the kernel's largest configuration. */
#define MAX_NODES 1024
#define LONG_BITS (8 * sizeof(unsigned long))

int dsv4__pci_numa_node_in(const char *devices, unsigned dom, unsigned bus, unsigned dev,
                           unsigned fn) {
  char path[512];
  int node = -1;
  /* sysfs names a function 0000:1a:00.0: the domain in four digits, lower case. */
  snprintf(path, sizeof(path), "%s/%04x:%02x:%02x.%x/numa_node", devices, dom, bus, dev, fn);
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  if (fscanf(f, "%d", &node) != 1)
    node = -1;
  fclose(f);
  return node;
}

int dsv4_pci_numa_node(unsigned dom, unsigned bus, unsigned dev, unsigned fn) {
  return dsv4__pci_numa_node_in("/sys/bus/pci/devices", dom, bus, dev, fn);
}

int dsv4_host_prefer_node(int node, const char *off_env) {
  const char *off = off_env ? getenv(off_env) : NULL;
  int mode = -1;
  if ((off && !strcmp(off, "1")) || node < 0 || node >= MAX_NODES)
    return -1;
  if (syscall(SYS_get_mempolicy, &mode, NULL, 0UL, NULL, 0UL) != 0 || mode != MPOL_DEFAULT)
    return -1;
  unsigned long mask[MAX_NODES / LONG_BITS] = {0};
  mask[node / LONG_BITS] |= 1UL << (node % LONG_BITS);
  /* maxnode counts one past the mask's bits: the kernel reads maxnode - 1 of them (libnuma's
   * convention too), and would drop the last node's bit otherwise. */
  if (syscall(SYS_set_mempolicy, MPOL_PREFERRED, mask, (unsigned long)MAX_NODES + 1) != 0)
    return -1;
  return node;
}

void dsv4_host_prefer_undo(void) {
  (void)syscall(SYS_set_mempolicy, MPOL_DEFAULT, NULL, 0UL);
}

int dsv4_page_numa_node(const void *a) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, a, (unsigned long)(MPOL_F_NODE | MPOL_F_ADDR)))
    return -1;
  return node;
}
