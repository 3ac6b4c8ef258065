# Writes a C file that holds a SPIR-V module as a byte array, so that the daemon carries its kernels
# with it (no file to install next to the binary, no path to get wrong).
#   cmake -DIN=<module.spv> -DOUT=<file.c> -DSYMBOL=<name> -P embed_spirv.cmake
# defines `const unsigned char <name>[]` and `const size_t <name>_size`, declared in lz_spirv.h.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" digits)
math(EXPR bytes "${digits} / 2")
# A SPIR-V module is a sequence of 32-bit words that starts with the magic number 0x07230203.
if(bytes LESS 20 OR NOT bytes MATCHES "^[0-9]+$")
  message(FATAL_ERROR "${IN}: ${bytes} bytes is not a SPIR-V module")
endif()
math(EXPR rem "${bytes} % 4")
string(SUBSTRING "${hex}" 0 8 magic)
if(NOT rem EQUAL 0 OR NOT magic STREQUAL "03022307")
  message(FATAL_ERROR "${IN}: not a little-endian SPIR-V module (starts ${magic}, ${bytes} bytes)")
endif()
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
# 16 bytes per line (CMake's regular expressions have no {n}).
string(REPEAT "0x[0-9a-f][0-9a-f]," 16 line)
string(REGEX REPLACE "(${line})" "\\1\n  " body "${body}")
file(WRITE "${OUT}.tmp"
  "/* Generated from ${IN} by embed_spirv.cmake at build time; do not edit. */\n"
  "#include \"level_zero/lz_spirv.h\"\n\n"
  "const unsigned char ${SYMBOL}[] = {\n  ${body}\n};\n"
  "const size_t ${SYMBOL}_size = ${bytes};\n")
# Only a changed module rewrites the file, so nothing recompiles for nothing.
execute_process(COMMAND "${CMAKE_COMMAND}" -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
