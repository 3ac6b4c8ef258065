#ifndef DSV4_KERNELS_HOST_NUMA_H
#define DSV4_KERNELS_HOST_NUMA_H

/*
 * Host memory near a device: the NUMA node of a PCIe function, and a thread's preference for it.
 * A device backend opens on the daemon's start-up thread before the other threads start, so that
 * the preference it takes there reaches every thread started after (a memory policy is a thread's,
 * inherited by the threads it creates).
 *
 * Thread affinity: any thread; the preference is the calling thread's.
 */

#ifdef __cplusplus
extern "C" {
#endif

/* The node sysfs gives the PCIe function dom:bus:dev.fn, or -1 where the host has none or does not
 * say. */
int dsv4_pci_numa_node(unsigned dom, unsigned bus, unsigned dev, unsigned fn);
/* The same under another directory of devices than /sys/bus/pci/devices (for tests). */
int dsv4__pci_numa_node_in(const char *devices, unsigned dom, unsigned bus, unsigned dev,
                           unsigned fn);

/* The node of the page at a, or -1 (a kernel without NUMA, or nothing mapped at a). Ask only of
 * committed memory: the kernel answers for a mapped page never touched with the node of the zero
 * page it reads in. */
int dsv4_page_numa_node(const void *a);

/*
 * The calling thread prefers node for new pages (MPOL_PREFERRED: a full node falls back), unless
 * the environment variable off_env is "1" or the thread already has a policy of its own (an
 * operator's numactl): the node preferred, or -1 when nothing changed (node < 0 included).
 */
int dsv4_host_prefer_node(int node, const char *off_env);
/* The calling thread back to the default policy, after a dsv4_host_prefer_node that took effect
 * (a backend that fails to open after it: the next backend tried runs on the thread's own). */
void dsv4_host_prefer_undo(void);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_KERNELS_HOST_NUMA_H */
