# The page-locked pool's allocator for request bodies and answers (server/pinned_pool.c).
if(DSV4_SERVER)
  dsv4_unit_test(pinned_pool_test SOURCES unit/pinned_pool_test.c LIBS dsv4_server TIMEOUT 60)
endif()
