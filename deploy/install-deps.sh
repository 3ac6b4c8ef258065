#!/bin/sh
# Installs every Debian package that dsv4d's build and test suite need. Safe to run again.
set -eu
PKGS="build-essential cmake pkg-config libuv1-dev libjansson-dev node-llhttp libxxhash-dev \
libcmocka-dev python3 python3-numpy python3-xxhash python3-yaml clang clang-format \
libclang-rt-14-dev libze-dev llvm-spirv-14 pocl-opencl-icd ocl-icd-opencl-dev opencl-c-headers"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
