if(TARGET dsv4_engine)
  dsv4_unit_test(engine_bounds_test SOURCES unit/engine_bounds_test.c LIBS dsv4_engine
                 dsv4_test_staged)
  add_test(NAME engine_bounds_test_staged COMMAND engine_bounds_test cpu_staged)
endif()
if(TARGET dsv4_engine AND DSV4_CUDA)
  add_test(NAME engine_bounds_test_cuda COMMAND engine_bounds_test cuda)
  set_tests_properties(engine_bounds_test_cuda PROPERTIES SKIP_RETURN_CODE 77 LABELS gpu)
endif()
