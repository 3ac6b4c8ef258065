# The executor's scheduling (decode first, same-sequence order, queue limit) with fake jobs.
if(DSV4_SERVER)
  dsv4_unit_test(executor_test SOURCES unit/executor_test.c ${PROJECT_SOURCE_DIR}/server/executor.c
                 LIBS dsv4_http_core TIMEOUT 60)
endif()
