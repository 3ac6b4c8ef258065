# The CUDA backend's host glue (kernels/cuda/cuda_backend.c): needs a device, else "skipped" (77).
if(DSV4_SERVER AND DSV4_CUDA)
  dsv4_unit_test(cuda_backend_test SOURCES unit/cuda_backend_test.c
                 LIBS dsv4_kernels dsv4_test_staged LABELS gpu)
  set_tests_properties(cuda_backend_test PROPERTIES SKIP_RETURN_CODE 77)
endif()
