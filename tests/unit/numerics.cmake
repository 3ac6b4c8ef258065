# Numerics (SPEC §2) and RoPE tables (SPEC §2.3).
dsv4_unit_test(numerics_test SOURCES unit/numerics_test.c LIBS dsv4_kernels TIMEOUT 600)
