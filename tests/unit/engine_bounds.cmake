if(DSV4_SERVER)
  dsv4_unit_test(engine_bounds_test SOURCES unit/engine_bounds_test.c LIBS dsv4_server)
endif()
