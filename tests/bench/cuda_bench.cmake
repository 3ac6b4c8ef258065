# The CUDA forward-step benchmark (tests/bench/cuda_insert_bench.c), where the CUDA backend builds.
if(DSV4_CUDA)
  dsv4_bench(cuda_insert_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_insert_bench.c
             ${CMAKE_CURRENT_LIST_DIR}/cuda_floor.cu LIBS dsv4_cuda dsv4_kernels)
  add_dependencies(benchmarks cuda_insert_bench)
  # Exact attention (tests/bench/cuda_attn_bench.c) against the copy and fp32 FMA ceilings.
  dsv4_bench(cuda_attn_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_attn_bench.c
             ${CMAKE_CURRENT_LIST_DIR}/cuda_fma_peak.cu LIBS dsv4_cuda dsv4_kernels)
  add_dependencies(benchmarks cuda_attn_bench)
  # The compressed branch's decode step and a prefill (tests/bench/cuda_compress_bench.c) against
  # the copy ceiling, and the prefill against the fp32 FMA and tensor-core peaks.
  dsv4_bench(cuda_compress_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_compress_bench.c
             ${CMAKE_CURRENT_LIST_DIR}/cuda_fma_peak.cu LIBS dsv4_cuda dsv4_kernels)
  add_dependencies(benchmarks cuda_compress_bench)
  # Launches that read and write registered host memory in place against the copies they replace
  # (tests/bench/cuda_inplace_bench.cu; backend.h, host_alias).
  dsv4_bench(cuda_inplace_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_inplace_bench.cu
             LIBS CUDA::cudart_static)
  add_dependencies(benchmarks cuda_inplace_bench)
  # How fast one wave of CTAs reads a fast attention CTA's inputs into shared memory, beside the
  # streaming read ceiling (tests/bench/cuda_read_bench.cu).
  dsv4_bench(cuda_read_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_read_bench.cu
             LIBS CUDA::cudart_static)
  add_dependencies(benchmarks cuda_read_bench)
  # What a runtime call costs the calling thread with warm and with cold caches
  # (tests/bench/cuda_launch_bench.cu).
  dsv4_bench(cuda_launch_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_launch_bench.cu
             LIBS CUDA::cudart_static)
  add_dependencies(benchmarks cuda_launch_bench)
endif()

# The same benchmark on a build of the kernels with DSV4_TEST_TUNE, whose rows per warp the
# environment sets (DSV4_ROWS_PER_WARP): for choosing the launcher's rule, not for the table.
if(DSV4_CUDA AND TARGET dsv4_cuda)
  file(GLOB DSV4_TUNE_CU ${PROJECT_SOURCE_DIR}/kernels/cuda/*.cu)
  add_library(dsv4_cuda_tune STATIC ${DSV4_TUNE_CU})
  target_include_directories(dsv4_cuda_tune PUBLIC ${PROJECT_SOURCE_DIR}/kernels/cuda
                                                   ${PROJECT_SOURCE_DIR}/kernels)
  target_compile_definitions(dsv4_cuda_tune PUBLIC DSV4_TEST_TUNE)
  target_compile_options(dsv4_cuda_tune PRIVATE ${DSV4_CUDA_NUMERICS_FLAGS})
  target_link_libraries(dsv4_cuda_tune PUBLIC dsv4_kernels CUDA::cudart_static)
  dsv4_strict(dsv4_cuda_tune)
  dsv4_bench(cuda_insert_bench_tune SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_insert_bench.c
             ${CMAKE_CURRENT_LIST_DIR}/cuda_floor.cu LIBS dsv4_cuda_tune dsv4_kernels)
endif()
