# The one decimal parser (kernels/decimal.c) that config, the server and dsv4ctl share.
dsv4_unit_test(decimal_test SOURCES unit/decimal_test.c LIBS dsv4_kernels_core)
