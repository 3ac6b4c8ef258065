# Exact-mode attention (SPEC §7): the shared exp and log routines over all 2^32 inputs, frozen by
# digest (tests/support/numerics_digests.h, shared with the CUDA test of the same digests).
if(DSV4_HAVE_XXHASH)
  dsv4_unit_test(expf_logf_test SOURCES unit/expf_logf_test.c
                 LIBS dsv4_kernels ${XXHASH_LIBRARY} Threads::Threads m TIMEOUT 600)
  target_include_directories(expf_logf_test PRIVATE ${XXHASH_INCLUDE_DIR}
                                                    ${PROJECT_SOURCE_DIR}/tests/support)
endif()
# The CPU backend's attention against a model of SPEC §7, its edges, levels and refusals.
dsv4_unit_test(attention_test SOURCES unit/attention_test.c LIBS dsv4_kernels m TIMEOUT 600)
# Attention over the SWA window and the compressed entries (SPEC §8.6) against a model of its own,
# at every level and worker count, with long lists and refusals.
dsv4_unit_test(attention_union_test SOURCES unit/attention_union_test.c LIBS dsv4_kernels m
               TIMEOUT 600)
