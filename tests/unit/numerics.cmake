# Numerics (SPEC §2) and RoPE tables (SPEC §2.3).
dsv4_unit_test(numerics_test SOURCES unit/numerics_test.c LIBS dsv4_kernels TIMEOUT 600)
dsv4_unit_test(rope_test SOURCES unit/rope_test.c LIBS dsv4_kernels TIMEOUT 300)

# The acceptance check of SPEC §2.3: the SHA-256 of each full built-in table.
add_executable(rope_dump unit/rope_dump.c)
target_link_libraries(rope_dump PRIVATE dsv4_kernels)
dsv4_strict(rope_dump)
foreach(kind_hash "plain:82e5a402b27b92649a5f0220edfc83c7702a3f6fdc3e6c42e00c82d2a629a926"
                  "yarn:c40e5c33c4ec9b5c508c417ebb63854b8d1ab2e3342aa676d776dd3cf9121afc")
  string(REPLACE ":" ";" kh ${kind_hash})
  list(GET kh 0 kind)
  list(GET kh 1 hash)
  add_test(NAME rope_table_sha256_${kind}
           COMMAND sh -c "got=$($<TARGET_FILE:rope_dump> ${kind} | sha256sum | cut -d' ' -f1) && echo \"${kind}: $got\" && test \"$got\" = ${hash}")
  set_tests_properties(rope_table_sha256_${kind} PROPERTIES TIMEOUT 600)
endforeach()

# The correct-rounding fallbacks of rope.c, reached through its static helpers (it compiles rope.c).
dsv4_unit_test(rope_slowpath_test SOURCES unit/rope_slowpath_test.c LIBS m Threads::Threads TIMEOUT 300)
