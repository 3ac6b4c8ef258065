# The POST /v1/forward body parser (server/forward_parse.c), built on the HTTP core (safetensors)
# and the kvcache module (sequence names) alone, so it runs whatever state the engine is in.
if(DSV4_SERVER)
  dsv4_unit_test(forward_parse_test SOURCES unit/forward_parse_test.c
                 ${PROJECT_SOURCE_DIR}/server/forward_parse.c LIBS dsv4_http_core dsv4_kvcache)
endif()
