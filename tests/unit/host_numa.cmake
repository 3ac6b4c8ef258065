# Host memory near a device (kernels/host_numa.c): a PCIe function's node, a thread's preference.
dsv4_unit_test(host_numa_test SOURCES unit/host_numa_test.c LIBS dsv4_kernels_core TIMEOUT 60)
