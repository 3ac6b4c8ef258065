# The admin dump benchmark (NOTES.md, "dump_bench"): GET /admin/v1/dump against bare_server sending
# the same bytes, and forward latency while dumps stream. A program that prints a table, not a ctest.
include_guard(DIRECTORY)
if(DSV4_SERVER AND DSV4_BENCH AND TARGET bare_server AND TARGET dsv4d)
  add_executable(dump_bench ${CMAKE_CURRENT_LIST_DIR}/dump_bench.c)
  target_link_libraries(dump_bench PRIVATE Threads::Threads)
  dsv4_strict(dump_bench)
  # dump_bench starts bare_server from its own folder and the daemon from the build root.
  add_dependencies(dump_bench bare_server dsv4d)
  set_target_properties(dump_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  if(TARGET benchmarks)
    add_dependencies(benchmarks dump_bench)
  endif()
endif()
