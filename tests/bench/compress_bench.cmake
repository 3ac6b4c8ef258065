# The compressed branch on the CPU backend (SPEC §8.3, §8.5): the indexer and the compressor against
# the machine's FMA peak and copy rate (x86-64: the peak loops are written with AVX-512 and AVX2
# intrinsics).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  dsv4_bench(cpu_compress_bench SOURCES cpu_compress_bench.c LIBS dsv4_kernels Threads::Threads)
  add_dependencies(benchmarks cpu_compress_bench)
endif()
