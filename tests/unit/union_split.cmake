# The host's choices of fast mode's split union attention (kernels/cuda/attention-split.h), plain C:
# built and run wherever the unit tests are, with or without CUDA.
dsv4_unit_test(union_split_test SOURCES unit/union_split_test.c LIBS dsv4_kernels_core)
target_include_directories(union_split_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels/cuda)
