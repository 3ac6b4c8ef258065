# The SPIR-V modules embedded in the daemon (kernels/level_zero): the embedded bytes are the modules
# llvm-spirv wrote, and the modules keep SPEC §2 (no fast-math, no contraction, explicit fma).
if(TARGET dsv4_lz_spirv)
  set(DSV4_LZ_SPV_DIR ${PROJECT_BINARY_DIR}/kernels/level_zero)
  add_executable(lz_spirv_embed_test ${PROJECT_SOURCE_DIR}/tests/level_zero/lz_spirv_embed_test.c)
  target_link_libraries(lz_spirv_embed_test PRIVATE dsv4_lz_spirv)
  dsv4_strict(lz_spirv_embed_test)
  add_test(NAME lz_spirv_embed COMMAND lz_spirv_embed_test ${DSV4_LZ_SPV_DIR}/dsv4_kernels_cr.spv
                                                           ${DSV4_LZ_SPV_DIR}/dsv4_kernels_fp64.spv)
  add_test(NAME lz_spirv_check
           COMMAND sh ${PROJECT_SOURCE_DIR}/tests/level_zero/spirv_check.sh ${DSV4_LLVM_SPIRV}
                   ${DSV4_LZ_SPV_DIR}/dsv4_kernels_cr.spv ${DSV4_LZ_SPV_DIR}/dsv4_kernels_fp64.spv)
  set_tests_properties(lz_spirv_embed lz_spirv_check PROPERTIES LABELS level_zero)
endif()

# The Level Zero backend's OpenCL C kernels, executed on the CPU through OpenCL (PoCL) against the CPU
# backend (tests/level_zero/lz_kernels_test.c). Without an OpenCL ICD loader at build time nothing is
# registered; without a platform at run time the tests print "skipped" and return 77.
find_package(OpenCL QUIET)
if(NOT OpenCL_FOUND)
  message(STATUS "OpenCL not found: the PoCL tests of the Level Zero kernels are not built")
  return()
endif()

set(DSV4_LZ_TEST_DIR ${PROJECT_SOURCE_DIR}/tests/level_zero)
# The backend's host glue, linked into the tests over the Level Zero test double.
set(DSV4_LZ_GLUE_SOURCES ${PROJECT_SOURCE_DIR}/kernels/level_zero/lz_backend.c
                         ${PROJECT_SOURCE_DIR}/kernels/level_zero/lz_compress.c)
add_executable(lz_kernels_test ${DSV4_LZ_TEST_DIR}/lz_kernels_test.c)
target_link_libraries(lz_kernels_test PRIVATE dsv4_kernels OpenCL::OpenCL)
target_compile_definitions(lz_kernels_test PRIVATE
  DSV4_LZ_CL_SOURCE="${PROJECT_SOURCE_DIR}/kernels/level_zero/dsv4_kernels.cl"
  DSV4_LZ_KERNELS_DIR="${PROJECT_SOURCE_DIR}/kernels")
dsv4_strict(lz_kernels_test)

# PoCL keeps compiled kernels in a cache directory that must be writable; each build tree has its own.
set(DSV4_LZ_TEST_ENV "POCL_CACHE_DIR=${CMAKE_CURRENT_BINARY_DIR}/pocl-cache")
if(DSV4_SANITIZE)
  # PoCL's and the ICD loader's allocations that live until exit are theirs, not ours.
  list(APPEND DSV4_LZ_TEST_ENV "ASAN_OPTIONS=detect_leaks=0")
endif()

foreach(mode identity identity-fp64 one-writer)
  string(REPLACE "-" "_" tname "lz_pocl_${mode}")
  add_test(NAME ${tname} COMMAND lz_kernels_test ${mode})
  set_tests_properties(${tname} PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl"
                                           ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
endforeach()
set_tests_properties(lz_pocl_one_writer PROPERTIES LABELS "level_zero;opencl;invariants")

# Exact-mode attention (SPEC §7): the attention kernels against the CPU backend's attention op, attn
# and lse byte for byte (skipped, exit 77, while the CPU backend has no attention op), with the fp32
# and the double-precision divide; and the launch refused, nothing written, for a candidate's block
# missing from its table and each other argument the CPU backend refuses (no reference needed).
foreach(mode attention attention-fp64 attention-errors)
  string(REPLACE "-" "_" tname "lz_pocl_${mode}")
  add_test(NAME ${tname} COMMAND lz_kernels_test ${mode})
  set_tests_properties(${tname} PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl"
                                           ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
endforeach()

# The compressed branch (SPEC §8.3-§8.6): the compressor's, the indexer's and the union attention's
# kernels against the CPU backend over batches of several layers and sequences, the ring, entries,
# index records, selection, attn and lse byte for byte after every batch, with the fp32 and the
# double-precision divide and sqrt; and each argument the CPU backend refuses refused by the check
# launches, with nothing written (tests/level_zero/lz_compress_test.c).
add_executable(lz_compress_test ${DSV4_LZ_TEST_DIR}/lz_compress_test.c)
target_link_libraries(lz_compress_test PRIVATE dsv4_kernels OpenCL::OpenCL m)
target_compile_definitions(lz_compress_test PRIVATE
  DSV4_LZ_CL_SOURCE="${PROJECT_SOURCE_DIR}/kernels/level_zero/dsv4_kernels.cl"
  DSV4_LZ_KERNELS_DIR="${PROJECT_SOURCE_DIR}/kernels")
dsv4_strict(lz_compress_test)
foreach(mode compress compress-fp64 compress-errors)
  string(REPLACE "-" "_" tname "lz_pocl_${mode}")
  add_test(NAME ${tname} COMMAND lz_compress_test ${mode})
  set_tests_properties(${tname} PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl"
                                           ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
endforeach()

# SPEC §5.1's broken build: the unmasked bulk store of the vLLM XPU bug must be caught by the counters.
add_test(NAME lz_pocl_one_writer_broken_bulk_store
         COMMAND sh ${PROJECT_SOURCE_DIR}/tests/unit/inv_expect_fail.sh
                 "invariant violated: SPEC 5[.]1: one writer per byte: cache block [0-9]+ offset [0-9]+ record bytes 448[.][.]575 [[]RoPE[]] [(]128 bytes[)] stored 2 times, expected 1 [[]opencl "
                 $<TARGET_FILE:lz_kernels_test> one-writer-broken)
set_tests_properties(lz_pocl_one_writer_broken_bulk_store PROPERTIES
  TIMEOUT 600 LABELS "level_zero;opencl;invariants" SKIP_REGULAR_EXPRESSION "^skipped: "
  ENVIRONMENT "${DSV4_LZ_TEST_ENV}")

# The backend itself: without a Level Zero driver (as on CI machines), opening it fails with one line
# naming zeInit and "auto" falls back to the CPU; with an Intel GPU, the batches above through the
# backend (upload, map_slots, qkv_insert, sync, download) equal the CPU backend byte for byte.
if(DSV4_LEVEL_ZERO)
  add_test(NAME lz_backend_no_driver COMMAND lz_kernels_test no-driver)
  add_test(NAME lz_backend_device COMMAND lz_kernels_test level-zero)
  add_test(NAME lz_backend_device_attention COMMAND lz_kernels_test level-zero-attention)
  add_test(NAME lz_backend_device_compress COMMAND lz_compress_test level-zero)
  set_tests_properties(lz_backend_no_driver lz_backend_device lz_backend_device_attention
    lz_backend_device_compress PROPERTIES
    TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS level_zero ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
endif()

# The host glue end to end without an Intel GPU: lz_backend.c linked against a test double of the
# Level Zero API over OpenCL (tests/level_zero/fake_ze.c: commands between two barriers run last
# appended first, so only the backend's barriers order its commands; device memory not zeroed; strict argument checks). The
# double builds the same .cl source (PoCL takes no SPIR-V), so this checks the glue, not the SPIR-V.
if(DSV4_LEVEL_ZERO)
  function(dsv4_lz_fake_test name src)
    add_executable(${name} ${DSV4_LZ_TEST_DIR}/${src} ${DSV4_LZ_TEST_DIR}/fake_ze.c
                           ${DSV4_LZ_GLUE_SOURCES})
    target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/kernels
                                               ${PROJECT_SOURCE_DIR}/kernels/level_zero
                                               ${DSV4_LZ_TEST_DIR})
    target_include_directories(${name} SYSTEM PRIVATE ${DSV4_ZE_INCLUDE_DIR})
    target_link_libraries(${name} PRIVATE dsv4_kernels dsv4_lz_spirv OpenCL::OpenCL)
    target_compile_definitions(${name} PRIVATE DSV4_LZ_FAKE_ZE ${ARGN}
      DSV4_LZ_CL_SOURCE="${PROJECT_SOURCE_DIR}/kernels/level_zero/dsv4_kernels.cl"
      DSV4_LZ_KERNELS_DIR="${PROJECT_SOURCE_DIR}/kernels")
    dsv4_strict(${name})
  endfunction()
  dsv4_lz_fake_test(lz_fake_ze_test lz_kernels_test.c)
  # SPEC §5.2's broken build for Level Zero: kernels launched without the barrier in front of them.
  # The double then runs the consumer before the RoPE rows' copy, on every run (the producer is
  # complete by then: qkv_insert waits for the positions it reads back; see INVARIANTS.md).
  dsv4_lz_fake_test(lz_fake_ze_test_no_barrier lz_kernels_test.c DSV4_TEST_BROKEN_NO_BARRIER)
  add_test(NAME lz_fake_ze_backend_broken_no_barrier
           COMMAND sh ${PROJECT_SOURCE_DIR}/tests/unit/inv_expect_fail.sh
                   "MISMATCH [[].*[]] run [0-9]+: (slots|q_out|cache) differs from the CPU backend"
                   $<TARGET_FILE:lz_fake_ze_test_no_barrier> level-zero)
  set_tests_properties(lz_fake_ze_backend_broken_no_barrier PROPERTIES
    TIMEOUT 600 LABELS "level_zero;opencl;invariants" SKIP_REGULAR_EXPRESSION "^skipped: "
    ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  # SPEC §5.2 for attention: the glue without the barrier in front of its attention launches. The
  # double then runs attention before the insert whose q_out and records it reads (attention reuses
  # the RoPE rows the insert staged, so no wait of the host orders them instead).
  dsv4_lz_fake_test(lz_fake_ze_test_no_attn_barrier lz_kernels_test.c
                    DSV4_TEST_BROKEN_NO_ATTN_BARRIER)
  add_test(NAME lz_fake_ze_attention_broken_no_barrier
           COMMAND sh ${PROJECT_SOURCE_DIR}/tests/unit/inv_expect_fail.sh
                   "MISMATCH [[].*[]] run [0-9]+: attn differs from the CPU backend"
                   $<TARGET_FILE:lz_fake_ze_test_no_attn_barrier> level-zero-attention)
  set_tests_properties(lz_fake_ze_attention_broken_no_barrier PROPERTIES
    TIMEOUT 600 LABELS "level_zero;opencl;invariants" SKIP_RETURN_CODE 77
    ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  # The compressed branch through the glue (map_slots, qkv_insert, compress, indexer, attention,
  # sync) against the CPU backend: q_out, the SWA cache, the ring, the entries, the index records,
  # the selection, attn and lse after every batch, and a batch refused at sync leaves no trace;
  # then with the fp64 module and launches split by maxGroupCountX.
  dsv4_lz_fake_test(lz_fake_compress_test lz_compress_test.c)
  add_test(NAME lz_fake_ze_compress COMMAND lz_fake_compress_test level-zero)
  add_test(NAME lz_fake_ze_compress_fp64_split COMMAND lz_fake_compress_test level-zero)
  set_tests_properties(lz_fake_ze_compress lz_fake_ze_compress_fp64_split PROPERTIES
    TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl" ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  set_property(TEST lz_fake_ze_compress_fp64_split APPEND PROPERTY ENVIRONMENT
               "FAKE_ZE_FP32_FLAGS=0x1" "FAKE_ZE_MAX_GROUPS=13")
  # SPEC §8.4 and §5.2 for the compressed branch: the glue without the barriers in front of the
  # compressor's and the attention's launches. The double then runs the attention before the
  # emissions it reads (and the emissions after the ring rows they read are overwritten). Ratio 128
  # only: at ratio 4 the attention would also run before the indexer writes its selection.
  dsv4_lz_fake_test(lz_fake_compress_test_no_barrier lz_compress_test.c
                    DSV4_TEST_BROKEN_NO_COMPRESS_BARRIER)
  add_test(NAME lz_fake_ze_compress_broken_no_barrier
           COMMAND sh ${PROJECT_SOURCE_DIR}/tests/unit/inv_expect_fail.sh
                   "MISMATCH [[].*[]] batch [0-9]+: (attn|lse|c_cache [(]the entries[)]) differs from the CPU backend"
                   $<TARGET_FILE:lz_fake_compress_test_no_barrier> level-zero-c128)
  set_tests_properties(lz_fake_ze_compress_broken_no_barrier PROPERTIES
    TIMEOUT 600 LABELS "level_zero;opencl;invariants" SKIP_RETURN_CODE 77
    ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  # The glue after a batch went wrong: no stale error word, out of memory refuses one batch only.
  add_executable(lz_glue_test ${DSV4_LZ_TEST_DIR}/lz_glue_test.c ${DSV4_LZ_TEST_DIR}/fake_ze.c
                              ${DSV4_LZ_GLUE_SOURCES})
  target_include_directories(lz_glue_test PRIVATE ${PROJECT_SOURCE_DIR}/kernels
                                                  ${PROJECT_SOURCE_DIR}/kernels/level_zero
                                                  ${DSV4_LZ_TEST_DIR})
  target_include_directories(lz_glue_test SYSTEM PRIVATE ${DSV4_ZE_INCLUDE_DIR})
  target_link_libraries(lz_glue_test PRIVATE dsv4_kernels dsv4_lz_spirv OpenCL::OpenCL)
  target_compile_definitions(lz_glue_test PRIVATE DSV4_LZ_FAKE_ZE
    DSV4_LZ_CL_SOURCE="${PROJECT_SOURCE_DIR}/kernels/level_zero/dsv4_kernels.cl"
    DSV4_LZ_KERNELS_DIR="${PROJECT_SOURCE_DIR}/kernels")
  target_link_options(lz_glue_test PRIVATE -Wl,--wrap=zeMemAllocHost)
  dsv4_strict(lz_glue_test)
  add_test(NAME lz_glue_test COMMAND lz_glue_test)
  set_tests_properties(lz_glue_test PROPERTIES TIMEOUT 300 LABELS "level_zero;opencl"
                       ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  add_test(NAME lz_fake_ze_backend COMMAND lz_fake_ze_test level-zero)
  # The fp64 module (no correctly rounded fp32 divide/sqrt) and launches split by maxGroupCountX.
  add_test(NAME lz_fake_ze_backend_fp64_split COMMAND lz_fake_ze_test level-zero)
  set_tests_properties(lz_fake_ze_backend lz_fake_ze_backend_fp64_split PROPERTIES
    TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl" ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  set_property(TEST lz_fake_ze_backend_fp64_split APPEND PROPERTY ENVIRONMENT
               "FAKE_ZE_FP32_FLAGS=0x1" "FAKE_ZE_MAX_GROUPS=7")
  # Attention through the glue (map_slots, qkv_insert, attention, sync) against the CPU backend's
  # attention op (skipped while it has none); then with the fp64 module and split launches.
  add_test(NAME lz_fake_ze_attention COMMAND lz_fake_ze_test level-zero-attention)
  add_test(NAME lz_fake_ze_attention_fp64_split COMMAND lz_fake_ze_test level-zero-attention)
  set_tests_properties(lz_fake_ze_attention lz_fake_ze_attention_fp64_split PROPERTIES
    TIMEOUT 600 SKIP_RETURN_CODE 77 LABELS "level_zero;opencl" ENVIRONMENT "${DSV4_LZ_TEST_ENV}")
  set_property(TEST lz_fake_ze_attention_fp64_split APPEND PROPERTY ENVIRONMENT
               "FAKE_ZE_FP32_FLAGS=0x1" "FAKE_ZE_MAX_GROUPS=7")
endif()

# The daemon itself on the Level Zero backend over the test double: dsv4d_lz_fake (never installed)
# is dsv4d with lz_backend.c and fake_ze.c linked in place of the loader, and the integration suite
# runs against it with DSV4_TEST_BACKEND=level_zero (it_lz_fake_*): the engine's device staging path
# through the real glue, every answer checked against the numpy model.
if(DSV4_LEVEL_ZERO AND TARGET dsv4d AND EXISTS ${PROJECT_SOURCE_DIR}/tests/integration)
  add_executable(dsv4d_lz_fake $<TARGET_OBJECTS:dsv4d_main> ${DSV4_LZ_TEST_DIR}/fake_ze.c
                               ${DSV4_LZ_GLUE_SOURCES})
  target_include_directories(dsv4d_lz_fake PRIVATE ${PROJECT_SOURCE_DIR}/kernels
                                                   ${PROJECT_SOURCE_DIR}/kernels/level_zero
                                                   ${DSV4_LZ_TEST_DIR})
  target_include_directories(dsv4d_lz_fake SYSTEM PRIVATE ${DSV4_ZE_INCLUDE_DIR})
  target_link_libraries(dsv4d_lz_fake PRIVATE dsv4_server dsv4_lz_spirv OpenCL::OpenCL)
  target_compile_definitions(dsv4d_lz_fake PRIVATE
    DSV4_LZ_CL_SOURCE="${PROJECT_SOURCE_DIR}/kernels/level_zero/dsv4_kernels.cl"
    DSV4_LZ_KERNELS_DIR="${PROJECT_SOURCE_DIR}/kernels")
  dsv4_strict(dsv4d_lz_fake)
  file(GLOB DSV4_LZ_IT_TESTS CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/integration/test_*.py)
  foreach(t ${DSV4_LZ_IT_TESTS})
    get_filename_component(n ${t} NAME_WE)
    # Backend selection without a device is what that test is about; here there is one.
    if(n STREQUAL "test_backend_select")
      continue()
    endif()
    add_test(NAME it_lz_fake_${n} COMMAND /usr/bin/python3 ${t} $<TARGET_FILE:dsv4d_lz_fake>
                                          ${PROJECT_SOURCE_DIR}/tests/reference/dsv4_ref.py)
    # Start-up here includes PoCL's own (its LLVM, the kernel build from its cache): 0.4 s on the
    # dev machine, several under ASan on 2 busy cores. The 1 s limit is the daemon's, not the double's.
    set_tests_properties(it_lz_fake_${n} PROPERTIES TIMEOUT 300
      LABELS "integration;level_zero;lz_fake"
      ENVIRONMENT "${DSV4_LZ_TEST_ENV};DSV4_TEST_BACKEND=level_zero;DSV4_IT_STARTUP_LIMIT=10")
    if(TARGET dsv4client)
      set_property(TEST it_lz_fake_${n} APPEND PROPERTY ENVIRONMENT
                   DSV4CLIENT_LIB=$<TARGET_FILE:dsv4client>
                   DSV4CLIENT_EXAMPLE=$<TARGET_FILE:dsv4client_example>)
    endif()
  endforeach()
endif()
