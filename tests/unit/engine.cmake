if(TARGET dsv4_engine)
  # The staged CPU backend (tests/support): the engine's device staging path without a device.
  add_library(dsv4_test_staged STATIC ${PROJECT_SOURCE_DIR}/tests/support/cpu_staged.c)
  target_include_directories(dsv4_test_staged PUBLIC ${PROJECT_SOURCE_DIR}/tests/support)
  target_link_libraries(dsv4_test_staged PUBLIC dsv4_kernels)
  dsv4_strict(dsv4_test_staged)

  dsv4_unit_test(engine_test SOURCES unit/engine_test.c LIBS dsv4_engine dsv4_test_staged)
  # The staged backend's check of host memory read in place (what the engine's tests rely on).
  dsv4_unit_test(cpu_staged_test SOURCES unit/cpu_staged_test.c LIBS dsv4_test_staged)
  # The same tests with every engine on the staged backend.
  add_test(NAME engine_test_staged COMMAND engine_test cpu_staged)
  # And on the staged backend in overlap mode: every batch through dsv4_engine_forward_begin/end
  # and the backend's batch phases (a device failure included).
  add_test(NAME engine_test_staged_overlap COMMAND engine_test cpu_staged_overlap)
endif()
if(TARGET dsv4_engine AND DSV4_CUDA)
  # The engine on the CUDA backend, compared byte for byte with the CPU backend (needs a device;
  # "skipped" with 77 without one).
  add_test(NAME engine_test_cuda COMMAND engine_test cuda)
  set_tests_properties(engine_test_cuda PROPERTIES SKIP_RETURN_CODE 77 LABELS gpu)
endif()
