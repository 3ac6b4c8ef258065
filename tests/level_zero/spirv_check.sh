#!/bin/sh
# Checks the SPIR-V modules the daemon embeds (kernels/level_zero), in the text form llvm-spirv
# prints, for what no Intel GPU is needed to see:
#   - the kernels are entry points;
#   - nothing may reassociate or contract: every entry point has ExecutionMode ContractionOff, no
#     FPFastMathMode decoration, no mad or fmuladd (what a
#     contracted a*b+c becomes), the fma calls are OpenCL's fma (explicit), and the divide is an
#     FDiv;
#   - no SPIR-V extension is required (any driver that takes SPIR-V 1.0 takes the module);
#   - the fp32 module ("cr") needs no fp64; the fp64 module ("fp64") computes sqrt and divide in
#     double (SPEC §2's fallback).
#   spirv_check.sh <llvm-spirv> <dsv4_kernels_cr.spv> <dsv4_kernels_fp64.spv>
set -u
spirv=$1
fail=0
# The module text goes through a file: it is longer than one command-line argument may be.
txt=$(mktemp)
trap 'rm -f "$txt"' EXIT
check() { # what, command...
  what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
for spv in "$2" "$3"; do
  "$spirv" -to-text "$spv" -o "$txt" || { echo "FAIL: $spv does not parse"; exit 1; }
  name=$(basename "$spv")
  head -1 "$txt" | sed "s/^/$name: /"
  for k in dsv4_map_slots dsv4_qkv_insert dsv4_fp_probe dsv4_attn_check dsv4_attention \
           dsv4_attn_c_check dsv4_compress_check dsv4_compress_emit dsv4_compress_ring \
           dsv4_index_check dsv4_index_select; do
    check "$name: entry point $k" grep -q "EntryPoint 6 [0-9]* \"$k\"" "$txt"
    # Execution mode 31 is ContractionOff: without it SPIR-V allows the device compiler to fuse a
    # multiply and an add even where the source kept them apart.
    id=$(sed -n "s/^[0-9]* EntryPoint 6 \([0-9]*\) \"$k\".*/\1/p" "$txt")
    check "$name: $k has ExecutionMode ContractionOff" grep -Eq "^3 ExecutionMode $id 31 *\$" "$txt"
  done
  check "$name: no FPFastMathMode" sh -c '! grep -q FPFastMathMode "$1"' _ "$txt"
  # A contracted a*b+c becomes OpenCL's mad (which may or may not round once) or an fmuladd.
  check "$name: no mad or fmuladd (contraction)" \
    sh -c '! grep -Eqi "ExtInst [0-9 ]+ mad |fmuladd" "$1"' _ "$txt"
  check "$name: explicit OpenCL fma present" grep -Eq 'ExtInst [0-9 ]+ fma ' "$txt"
  check "$name: no SPIR-V extension needed" sh -c '! grep -Eq "^[0-9]+ Extension " "$1"' _ "$txt"
  case $name in
  *_cr.spv)
    check "$name: no fp64" sh -c '! grep -q "Capability Float64" "$1"' _ "$txt"
    check "$name: fp32 FDiv and sqrt" \
      sh -c 'grep -Eq " FDiv " "$1" && grep -Eq "ExtInst [0-9 ]+ sqrt " "$1"' _ "$txt"
    ;;
  *_fp64.spv)
    check "$name: fp64 used" grep -q 'Capability Float64' "$txt"
    ;;
  esac
done
exit $fail
