# The CPU reference backend: numerics against a per-element model of SPEC §2, cache layout, threading.
dsv4_unit_test(cpu_backend_test SOURCES unit/cpu_backend_test.c LIBS dsv4_kernels TIMEOUT 300)
