#!/usr/bin/env bash
# Quick start on a fresh Debian or Ubuntu machine: install the system
# packages that are missing (with sudo unless run as root), build into
# ./build, and run the main job on the default device.
set -euo pipefail
cd "$(dirname "$0")/.."

# intel-opencl-icd (ocloc) and clang-15: the portability suite's compilers;
# g++, binutils and doxygen: the install suite's (as in .ci/run). dpkg-dev:
# meson asks its dpkg-architecture for the multiarch libdir; without it,
# `meson install` puts the library in lib64, where neither pkg-config nor
# ldconfig look on Debian. openmpi-bin and libopenmpi-dev: the MPI example
# (examples/ep_dispatch) and its suite mpi, built only where MPI is found.
packages=(gcc libc6-dev dpkg-dev meson ninja-build pkg-config opencl-c-headers ocl-icd-opencl-dev pocl-opencl-icd
          check libcjson-dev intel-opencl-icd clang-15 g++ binutils doxygen openmpi-bin libopenmpi-dev)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "quickstart: installing ${missing[*]}" >&2
    $sudo apt-get update
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi

if [ -d build ]; then
    meson setup --reconfigure build
else
    meson setup build
fi
ninja -C build
build/tools/moecl-info
# The main job: both seed ops at the seed shapes, checked against the
# float64 reference, then timed.
exec build/tools/moecl-bench --quick "$@"
