# The config module: option table, precedence of sources, model geometry from config.json.
if(DSV4_SERVER)
  dsv4_unit_test(config_test SOURCES unit/config_test.c LIBS dsv4_config)
endif()
