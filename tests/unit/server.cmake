# The HTTP layer, its error table, safetensors codec, logs and metrics registry of the daemon
# (server/). Their tests link those libraries alone, so they build and run whatever state the rest
# of server/ is in.
if(DSV4_SERVER)
  foreach(t safetensors_test metrics_test log_test http_test errors_test)
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/unit/${t}.c)
      dsv4_unit_test(${t} SOURCES unit/${t}.c LIBS dsv4_http_core dsv4_safetensors TIMEOUT 120)
      target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
    endif()
  endforeach()
  # An answer written by another thread goes through a duplicate of the connection's socket; a
  # build that used the connection's own descriptor number must fail test_direct_client_gone (the
  # number is closed on a reset and the next accept takes it).
  add_executable(http_test_broken_direct_fd unit/http_test.c ${PROJECT_SOURCE_DIR}/server/http.c)
  target_compile_definitions(http_test_broken_direct_fd PRIVATE DSV4_TEST_BROKEN_DIRECT_NO_DUP)
  target_include_directories(http_test_broken_direct_fd PRIVATE ${CMOCKA_INCLUDE_DIR}
                                                                ${PROJECT_SOURCE_DIR}/tests/support)
  target_link_libraries(http_test_broken_direct_fd PRIVATE dsv4_http_core dsv4_safetensors
                                                           ${CMOCKA_LIBRARY})
  dsv4_strict(http_test_broken_direct_fd)
  add_test(NAME http_test_broken_direct_fd
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/unit/inv_expect_fail.sh
                   "another connection's answer" $<TARGET_FILE:http_test_broken_direct_fd>
                   test_direct_client_gone)
  set_tests_properties(http_test_broken_direct_fd PROPERTIES TIMEOUT 120)
endif()
