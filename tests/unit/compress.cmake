# The compressed branch on the CPU backend (SPEC §8.3, §8.5): the shared math of
# kernels/dsv4-compress.h (MXFP4, the Hadamard transform, pooling, the index reductions), and the
# compress and indexer ops against a model of the SPEC, their refusals, thread counts and levels.
dsv4_unit_test(compress_test SOURCES unit/compress_test.c LIBS dsv4_kernels m TIMEOUT 600)
