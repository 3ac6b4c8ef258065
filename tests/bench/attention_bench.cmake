# Exact attention on the CPU backend (SPEC §7) against the machine's FMA peak (x86-64: the peak
# loops are written with AVX-512 and AVX2 intrinsics).
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  dsv4_bench(cpu_attention_bench SOURCES cpu_attention_bench.c LIBS dsv4_kernels Threads::Threads)
  add_dependencies(benchmarks cpu_attention_bench)
endif()
