# The CUDA forward-step benchmark (tests/bench/cuda_insert_bench.c), where the CUDA backend builds.
if(DSV4_CUDA)
  dsv4_bench(cuda_insert_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_insert_bench.c
             LIBS dsv4_cuda dsv4_kernels)
  add_dependencies(benchmarks cuda_insert_bench)
endif()
