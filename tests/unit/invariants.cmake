# The ordering invariants of SPEC §5, each with its test and a deliberately broken build of the same
# sources that the test must catch (tests/unit/INVARIANTS.md). The broken builds define one
# DSV4_TEST_BROKEN_* macro and run under inv_expect_fail.sh, which passes only when the test
# fails with the invariant's own message.
set(DSV4_INV_DIR ${CMAKE_CURRENT_LIST_DIR})
set(DSV4_INV_ROOT ${PROJECT_SOURCE_DIR})

# The kernels library again, with test macros: the generic sources once, the CPU backend per variant.
file(GLOB DSV4_INV_KERNEL_SOURCES CONFIGURE_DEPENDS ${DSV4_INV_ROOT}/kernels/*.c)
file(GLOB DSV4_INV_CPU_SOURCES CONFIGURE_DEPENDS ${DSV4_INV_ROOT}/kernels/cpu/*.c)
# The host pool carries a test hook of the broken-order build: compiled per variant as well.
list(REMOVE_ITEM DSV4_INV_KERNEL_SOURCES ${DSV4_INV_ROOT}/kernels/host_pool.c)
list(APPEND DSV4_INV_CPU_SOURCES ${DSV4_INV_ROOT}/kernels/host_pool.c)
# As in kernels/CMakeLists.txt; source properties are per directory, so they are repeated here.
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  file(GLOB DSV4_INV_AVX512 CONFIGURE_DEPENDS ${DSV4_INV_ROOT}/kernels/cpu/*_avx512.c)
  file(GLOB DSV4_INV_AVX2 CONFIGURE_DEPENDS ${DSV4_INV_ROOT}/kernels/cpu/*_avx2.c)
  set_source_files_properties(${DSV4_INV_AVX512} PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mfma")
  set_source_files_properties(${DSV4_INV_AVX2} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma")
endif()
add_library(dsv4_inv_kernels_base OBJECT ${DSV4_INV_KERNEL_SOURCES})
target_include_directories(dsv4_inv_kernels_base PUBLIC ${DSV4_INV_ROOT}/kernels)
dsv4_strict(dsv4_inv_kernels_base)

function(dsv4_inv_kernels name)
  add_library(${name} STATIC ${DSV4_INV_CPU_SOURCES} $<TARGET_OBJECTS:dsv4_inv_kernels_base>)
  target_include_directories(${name} PUBLIC ${DSV4_INV_ROOT}/kernels)
  target_link_libraries(${name} PUBLIC Threads::Threads m)
  # PUBLIC: the test sees the same hook declarations as the library.
  target_compile_definitions(${name} PUBLIC ${ARGN})
  dsv4_strict(${name})
endfunction()

# A test executable of a broken build, registered through the expect-fail wrapper.
function(dsv4_inv_broken name)
  cmake_parse_arguments(T "" "SOURCE;EXPECT;TIMEOUT;TARGET" "LIBS;ARGS" ${ARGN})
  # TARGET: run the executable of another broken variant (with other ARGS) instead of building one.
  if(T_TARGET)
    add_test(NAME ${name} COMMAND sh ${DSV4_INV_DIR}/inv_expect_fail.sh "${T_EXPECT}"
                                   $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
    set_tests_properties(${name} PROPERTIES LABELS invariants)
    if(T_TIMEOUT)
      set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT})
    endif()
    return()
  endif()
  add_executable(${name} ${DSV4_INV_DIR}/${T_SOURCE})
  target_include_directories(${name} PRIVATE ${CMOCKA_INCLUDE_DIR})
  target_link_libraries(${name} PRIVATE ${T_LIBS} ${CMOCKA_LIBRARY})
  dsv4_strict(${name})
  add_test(NAME ${name} COMMAND sh ${DSV4_INV_DIR}/inv_expect_fail.sh "${T_EXPECT}"
                                 $<TARGET_FILE:${name}> ${T_ARGS})
  set_tests_properties(${name} PROPERTIES LABELS invariants)
  if(T_TIMEOUT)
    set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT})
  endif()
endfunction()

# 5.1 One writer per byte: every store into q_out and the cache is counted per byte.
dsv4_inv_kernels(dsv4_inv_kernels_count DSV4_TEST_COUNT_STORES)
dsv4_inv_kernels(dsv4_inv_kernels_bulk DSV4_TEST_COUNT_STORES DSV4_TEST_BROKEN_BULK_STORE)
dsv4_unit_test(inv_one_writer SOURCES unit/inv_one_writer.c LIBS dsv4_inv_kernels_count
               TIMEOUT 120 LABELS invariants)
dsv4_inv_broken(inv_one_writer_broken_bulk_store SOURCE inv_one_writer.c
                LIBS dsv4_inv_kernels_bulk TIMEOUT 120
                EXPECT "invariant violated: SPEC 5[.]1: one writer per byte: cache block [0-9]+ offset [0-9]+ record bytes 448[.][.]575 [[]RoPE[]] [(]128 bytes[)] stored 2 times")
# The same broken build on the AVX2 kernels alone (x86-64 machines have them since 2013-2015).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  dsv4_inv_broken(inv_one_writer_broken_bulk_store_avx2 TARGET inv_one_writer_broken_bulk_store
                  ARGS avx2 TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5[.]1: one writer per byte: cache block [0-9]+ offset [0-9]+ record bytes 448[.][.]575 [[]RoPE[]] [(]128 bytes[)] stored 2 times, expected 1 [[]cache, avx2 ")
  # And on the AVX-512 kernels alone, where the CPU has them (skipped elsewhere, as a GPU test is).
  dsv4_inv_broken(inv_one_writer_broken_bulk_store_avx512 TARGET inv_one_writer_broken_bulk_store
                  ARGS avx512 TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5[.]1: one writer per byte: cache block [0-9]+ offset [0-9]+ record bytes 448[.][.]575 [[]RoPE[]] [(]128 bytes[)] stored 2 times, expected 1 [[]cache, avx512 ")
  set_tests_properties(inv_one_writer_broken_bulk_store_avx512 PROPERTIES SKIP_RETURN_CODE 77)
endif()

# 5.2 Nothing touches mutable memory before the dependency wait: a delayed map_slots producer.
dsv4_inv_kernels(dsv4_inv_kernels_delay DSV4_TEST_DELAY_PRODUCER)
dsv4_inv_kernels(dsv4_inv_kernels_nojoin DSV4_TEST_DELAY_PRODUCER DSV4_TEST_BROKEN_NO_JOIN)
dsv4_unit_test(inv_no_early_read SOURCES unit/inv_no_early_read.c LIBS dsv4_inv_kernels_delay
               TIMEOUT 120 LABELS invariants)
dsv4_inv_broken(inv_no_early_read_broken_no_join SOURCE inv_no_early_read.c
                LIBS dsv4_inv_kernels_nojoin TIMEOUT 120
                EXPECT "invariant violated: SPEC 5[.]2: the consumer wrote [0-9]+ bytes of canary block")

# 5.3 Slots are unique within a launch: random multi-sequence batches through the sequence table.
file(GLOB DSV4_INV_KVCACHE_SOURCES CONFIGURE_DEPENDS ${DSV4_INV_ROOT}/kvcache/*.c)
add_library(dsv4_inv_kvcache_shared STATIC ${DSV4_INV_KVCACHE_SOURCES})
target_include_directories(dsv4_inv_kvcache_shared PUBLIC ${DSV4_INV_ROOT}/kvcache)
target_link_libraries(dsv4_inv_kvcache_shared PUBLIC dsv4_kernels)
target_compile_definitions(dsv4_inv_kvcache_shared PUBLIC DSV4_TEST_BROKEN_SHARED_BLOCK)
if(DSV4_HAVE_XXHASH)
  target_include_directories(dsv4_inv_kvcache_shared PUBLIC ${XXHASH_INCLUDE_DIR})
  target_link_libraries(dsv4_inv_kvcache_shared PUBLIC ${XXHASH_LIBRARY})
  target_compile_definitions(dsv4_inv_kvcache_shared PUBLIC DSV4_HAVE_XXHASH=1)
endif()
dsv4_strict(dsv4_inv_kvcache_shared)
dsv4_unit_test(inv_unique_slots SOURCES unit/inv_unique_slots.c LIBS dsv4_kvcache dsv4_kernels TIMEOUT 120
               LABELS invariants)
dsv4_inv_broken(inv_unique_slots_broken_shared_block SOURCE inv_unique_slots.c
                LIBS dsv4_inv_kvcache_shared TIMEOUT 120
                EXPECT "invariant violated: SPEC 5[.]3: (block [0-9]+ is held by sequence|slot [0-9]+ is written twice in one launch)")

# 5.4 Determinism: the same batch, 20 runs on 1, 2 and 4 threads, from zeroed and non-zero caches.
dsv4_inv_kernels(dsv4_inv_kernels_order DSV4_TEST_BROKEN_ORDER)
dsv4_unit_test(inv_determinism SOURCES unit/inv_determinism.c LIBS dsv4_kernels TIMEOUT 120
               LABELS invariants)
dsv4_inv_broken(inv_determinism_broken_order SOURCE inv_determinism.c
                LIBS dsv4_inv_kernels_order TIMEOUT 120
                EXPECT "invariant violated: SPEC 5[.]4: determinism: .* with [24] threads, .* differ from the 1-thread run")

# The engine's own sources again as library name, with the test-only macro that breaks one rule.
function(dsv4_inv_engine name macro)
  set(dir ${DSV4_INV_ROOT}/server/engine)
  add_library(${name} STATIC ${dir}/engine.c ${dir}/engine_admin.c ${dir}/engine_attn.c
                             ${dir}/engine_check.c ${dir}/engine_compress.c ${dir}/engine_restore.c
                             ${dir}/range_check.c)
  target_include_directories(${name} PUBLIC ${dir} ${XXHASH_INCLUDE_DIR})
  target_link_libraries(${name} PUBLIC dsv4_config dsv4_kvcache dsv4_kernels ${XXHASH_LIBRARY} m)
  target_compile_definitions(${name} PRIVATE ${macro})
  dsv4_strict(${name})
endfunction()

# 5.2 for the compressed branch (SPEC §8.4): a batch's emissions are stored before its indexer and
# its attention read the entry caches. The broken build is the engine's own sources again with the
# launch order reversed.
if(TARGET dsv4_engine)
  dsv4_inv_engine(dsv4_inv_engine_emit_late DSV4_TEST_BROKEN_EMIT_LATE)
  dsv4_unit_test(inv_emit_first SOURCES unit/inv_emit_first.c LIBS dsv4_engine TIMEOUT 120
                 LABELS invariants)
  dsv4_inv_broken(inv_emit_first_broken_emit_late SOURCE inv_emit_first.c
                  LIBS dsv4_inv_engine_emit_late TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5[.]2: layer [0-9]+ token at position [0-9]+ [(][0-9]+ entries visible[)]: its attention did not see the entries its own batch emitted")
endif()

# SPEC §5 across overlapped batches (dsv4_engine_forward_begin/end on a DSV4_BE_OVERLAP backend):
# batch k + 1 stages through buffers of its own while batch k is in flight. The test runs on the
# staged CPU backend in overlap mode (its batch downloads read their sources only when the batch is
# waited for); the broken build is the engine's sources again with one staging half for every batch.
if(TARGET dsv4_engine AND TARGET dsv4_test_staged)
  dsv4_inv_engine(dsv4_inv_engine_one_half DSV4_TEST_BROKEN_ONE_STAGING_HALF)
  dsv4_unit_test(inv_overlap SOURCES unit/inv_overlap.c LIBS dsv4_engine dsv4_test_staged
                 TIMEOUT 120 LABELS invariants)
  dsv4_inv_broken(inv_overlap_broken_one_staging_half SOURCE inv_overlap.c
                  LIBS dsv4_inv_engine_one_half dsv4_test_staged TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5: overlapped batches: .* differs from .* run alone")
endif()

# SPEC §5.2 for q's half of the insert in pieces (engine.c, q_early_launch): each piece's q_out is
# downloaded after its own launch only (backend.h, mark and download_marked). The test runs on the
# staged CPU backend, whose marked downloads deliver 0xa5 bytes when their mark does not follow
# every launch that wrote what they copy; the broken build is the engine's sources again with each
# mark before its piece's launch.
if(TARGET dsv4_engine AND TARGET dsv4_test_staged)
  dsv4_inv_engine(dsv4_inv_engine_mark_early DSV4_TEST_BROKEN_MARK_EARLY)
  dsv4_unit_test(inv_q_pieces SOURCES unit/inv_q_pieces.c LIBS dsv4_engine dsv4_test_staged
                 TIMEOUT 120 LABELS invariants)
  dsv4_inv_broken(inv_q_pieces_broken_mark_early SOURCE inv_q_pieces.c
                  LIBS dsv4_inv_engine_mark_early dsv4_test_staged TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5[.]2: q half in pieces: batch [0-9]+ .*: its q_out differs")
  # The same with nothing read in place (as DSV4_CUDA_NO_ALIAS=1 makes the CUDA backend): the q
  # half runs on q uploaded piece by piece and the positions uploaded ahead of it.
  add_test(NAME inv_q_pieces_uploaded COMMAND inv_q_pieces)
  dsv4_inv_broken(inv_q_pieces_uploaded_broken_mark_early TARGET inv_q_pieces_broken_mark_early
                  TIMEOUT 120
                  EXPECT "invariant violated: SPEC 5[.]2: q half in pieces: batch [0-9]+ .*: its q_out differs")
  set_tests_properties(inv_q_pieces_uploaded inv_q_pieces_uploaded_broken_mark_early PROPERTIES
                       ENVIRONMENT DSV4_CUDA_NO_ALIAS=1 LABELS invariants TIMEOUT 120)
endif()
