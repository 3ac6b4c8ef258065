# libdsv4client's forward message: the text written directly equals jansson's dump of the document.
if(TARGET dsv4client_static)
  dsv4_unit_test(client_msg_test SOURCES unit/client_msg_test.c LIBS ${JANSSON_LIBRARY})
  target_include_directories(client_msg_test PRIVATE ${PROJECT_SOURCE_DIR}/client
                                                     ${JANSSON_INCLUDE_DIR})
endif()
