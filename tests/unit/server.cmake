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
endif()
