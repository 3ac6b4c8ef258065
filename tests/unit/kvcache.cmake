# The kvcache module: block pool, sequence table / SWA mapper, logical records and digests.
dsv4_unit_test(pool_test SOURCES unit/pool_test.c LIBS dsv4_kvcache)
dsv4_unit_test(seqtable_test SOURCES unit/seqtable_test.c LIBS dsv4_kvcache)
dsv4_unit_test(seqtable_compress_test SOURCES unit/seqtable_compress_test.c LIBS dsv4_kvcache)
dsv4_unit_test(seqtable_prop_test SOURCES unit/seqtable_prop_test.c LIBS dsv4_kvcache TIMEOUT 300)
dsv4_unit_test(digest_test SOURCES unit/digest_test.c LIBS dsv4_kvcache)
