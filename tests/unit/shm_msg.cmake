# A shared-region forward message read without a document against jansson's reading
# (server/shm_msg.c, tests/support/shm_msg_check.h).
if(DSV4_SERVER)
  dsv4_unit_test(shm_msg_test SOURCES unit/shm_msg_test.c LIBS dsv4_server)
  target_include_directories(shm_msg_test PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
endif()
