# The POST /v1/forward body parser (server/forward_parse.c).
if(DSV4_SERVER)
  dsv4_unit_test(forward_parse_test SOURCES unit/forward_parse_test.c LIBS dsv4_server)
endif()
