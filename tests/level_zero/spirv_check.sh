#!/bin/sh
# Checks the SPIR-V modules the daemon embeds (kernels/level_zero), in the text form llvm-spirv
# prints, for what no Intel GPU is needed to see:
#   - the five kernels are entry points;
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
check() { # module text, what, command...
  what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}
for spv in "$2" "$3"; do
  txt=$("$spirv" -to-text "$spv" -o /dev/stdout) || { echo "FAIL: $spv does not parse"; exit 1; }
  name=$(basename "$spv")
  printf '%s\n' "$txt" | head -1 | sed "s/^/$name: /"
  for k in dsv4_map_slots dsv4_qkv_insert dsv4_fp_probe dsv4_attn_check dsv4_attention; do
    check "$name: entry point $k" sh -c "printf '%s\n' \"\$1\" | grep -q 'EntryPoint 6 [0-9]* \"$k\"'" _ "$txt"
    # Execution mode 31 is ContractionOff: without it SPIR-V allows the device compiler to fuse a
    # multiply and an add even where the source kept them apart.
    id=$(printf '%s\n' "$txt" | sed -n "s/^[0-9]* EntryPoint 6 \([0-9]*\) \"$k\".*/\1/p")
    check "$name: $k has ExecutionMode ContractionOff" sh -c "printf '%s\n' \"\$1\" | grep -Eq '^3 ExecutionMode $id 31 *\$'" _ "$txt"
  done
  check "$name: no FPFastMathMode" sh -c "! printf '%s\n' \"\$1\" | grep -q FPFastMathMode" _ "$txt"
  # A contracted a*b+c becomes OpenCL's mad (which may or may not round once) or an fmuladd.
  check "$name: no mad or fmuladd (contraction)" sh -c "! printf '%s\n' \"\$1\" | grep -Eqi 'ExtInst [0-9 ]+ mad |fmuladd'" _ "$txt"
  check "$name: explicit OpenCL fma present" sh -c "printf '%s\n' \"\$1\" | grep -Eq 'ExtInst [0-9 ]+ fma '" _ "$txt"
  check "$name: no SPIR-V extension needed" sh -c "! printf '%s\n' \"\$1\" | grep -Eq '^[0-9]+ Extension '" _ "$txt"
  case $name in
  *_cr.spv)
    check "$name: no fp64" sh -c "! printf '%s\n' \"\$1\" | grep -q 'Capability Float64'" _ "$txt"
    check "$name: fp32 FDiv and sqrt" sh -c "printf '%s\n' \"\$1\" | grep -Eq ' FDiv ' && printf '%s\n' \"\$1\" | grep -Eq 'ExtInst [0-9 ]+ sqrt '" _ "$txt"
    ;;
  *_fp64.spv)
    check "$name: fp64 used" sh -c "printf '%s\n' \"\$1\" | grep -q 'Capability Float64'" _ "$txt"
    ;;
  esac
done
exit $fail
