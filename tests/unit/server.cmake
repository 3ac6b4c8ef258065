# The HTTP layer, safetensors codec, logs and metrics registry of the daemon (server/). Their tests
# link these four sources alone, so they build and run whatever state the rest of server/ is in.
if(DSV4_SERVER)
  set(DSV4_HTTP_CORE_SOURCES)
  foreach(f http.c log.c metrics.c safetensors.c)
    if(EXISTS ${PROJECT_SOURCE_DIR}/server/${f})
      list(APPEND DSV4_HTTP_CORE_SOURCES ${PROJECT_SOURCE_DIR}/server/${f})
    endif()
  endforeach()
  add_library(dsv4_http_core STATIC ${DSV4_HTTP_CORE_SOURCES})
  target_include_directories(dsv4_http_core PUBLIC ${PROJECT_SOURCE_DIR}/server ${UV_INCLUDE_DIR}
                                                   ${JANSSON_INCLUDE_DIR})
  target_link_libraries(dsv4_http_core PUBLIC dsv4_kernels dsv4_llhttp ${UV_LIBRARY}
                                              ${JANSSON_LIBRARY} Threads::Threads m)
  dsv4_strict(dsv4_http_core)

  foreach(t safetensors_test metrics_test log_test http_test)
    if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/unit/${t}.c)
      dsv4_unit_test(${t} SOURCES unit/${t}.c LIBS dsv4_http_core TIMEOUT 120)
    endif()
  endforeach()
endif()
