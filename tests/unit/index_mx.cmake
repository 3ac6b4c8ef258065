# The index dot product on matrix units (SPEC §8.5, kernels/dsv4-compress.h): the decomposed d of
# the CUDA indexer's tensor-core path against dsv4_dot128, bit for bit, and its bounds.
dsv4_unit_test(index_mx_test SOURCES unit/index_mx_test.c LIBS dsv4_kernels m TIMEOUT 600)
