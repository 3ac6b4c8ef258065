# Host memory out of the CPU caches before a device copies it (kernels/host_flush.c).
dsv4_unit_test(host_flush_test SOURCES unit/host_flush_test.c LIBS dsv4_kernels_core TIMEOUT 60)
