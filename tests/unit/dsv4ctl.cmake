# dsv4ctl (ctl/): arguments, views, verify on dumps built in the test, and the client against a
# scripted HTTP server.
if(TARGET dsv4ctl_core)
  dsv4_unit_test(dsv4ctl_test SOURCES unit/dsv4ctl_test.c LIBS dsv4ctl_core TIMEOUT 120)
endif()
