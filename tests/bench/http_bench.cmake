# The HTTP benchmark (NOTES.md, "HTTP path"): the daemon against a bare libuv + llhttp server moving
# the same payload and against the CPU op alone. Programs that print a table, not ctests.
# Guarded, since tests/bench/CMakeLists.txt may reach this file both by name and by its *.cmake glob.
include_guard(DIRECTORY)
if(DSV4_SERVER AND DSV4_BENCH)
  add_executable(bare_server ${CMAKE_CURRENT_LIST_DIR}/bare_server.c)
  target_include_directories(bare_server PRIVATE ${UV_INCLUDE_DIR})
  target_link_libraries(bare_server PRIVATE dsv4_llhttp ${UV_LIBRARY})
  dsv4_strict(bare_server)

  add_executable(http_bench ${CMAKE_CURRENT_LIST_DIR}/http_bench.c)
  target_link_libraries(http_bench PRIVATE dsv4_kernels dsv4_llhttp)
  dsv4_strict(http_bench)
  # http_bench starts bare_server from its own folder.
  add_dependencies(http_bench bare_server)
  set_target_properties(bare_server http_bench PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                                                          ${CMAKE_CURRENT_BINARY_DIR})
endif()
if(TARGET benchmarks AND TARGET http_bench)
  add_dependencies(benchmarks http_bench bare_server)
endif()
