# The host thread pool (kernels/host_pool.c): wake-ups after sleep, every item once, destroy.
dsv4_unit_test(host_pool_test SOURCES unit/host_pool_test.c LIBS dsv4_kernels_core TIMEOUT 120)
