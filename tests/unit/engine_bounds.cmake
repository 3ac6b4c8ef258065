if(DSV4_SERVER)
  dsv4_unit_test(engine_bounds_test SOURCES unit/engine_bounds_test.c LIBS dsv4_server
                 dsv4_test_staged)
  add_test(NAME engine_bounds_test_staged COMMAND engine_bounds_test cpu_staged)
endif()
