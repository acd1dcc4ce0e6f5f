#!/usr/bin/env bash
# Quick start on a fresh Debian or Ubuntu machine: install the system
# packages that are missing (with sudo unless run as root), build into
# ./build, and run the main job on the default device.
#
#   bash tools/quickstart.sh [--test-deps] [--python] [--deps-only] [moecl-bench options]
#
# By default only what building and running the main job needs (and the
# quick test suite: Check); --test-deps adds what the full test suite
# needs (the list .ci/run installs); --python adds python3-venv for the
# Python package (python/README.md); --deps-only installs and stops there.
# Other arguments go to moecl-bench.
set -euo pipefail
cd "$(dirname "$0")/.."

# The compiler, the build tools, the OpenCL headers and ICD loader, pocl (a
# CPU device), Check (the test suites) and cJSON (the tools' JSON). dpkg-dev:
# meson asks its dpkg-architecture for the multiarch libdir; without it,
# `meson install` puts the library in lib64, where neither pkg-config nor
# ldconfig look on Debian.
packages=(gcc libc6-dev dpkg-dev meson ninja-build pkg-config opencl-c-headers ocl-icd-opencl-dev pocl-opencl-icd
          check libcjson-dev)
# The full suite's, as .ci/run installs them: intel-opencl-icd (ocloc) and
# clang-15 compile every kernel for Intel and AMD GPUs (suite portability);
# g++, binutils, doxygen and cmake the install suite's checks; Open MPI the MPI
# example and its suite mpi; CLBlast the MoE layer example (its test reads
# the layer with numpy); Python with numpy, pytest and pyopencl the
# Python package's tests; valgrind, clang-14 with its sanitizer runtime,
# oclgrind and debootstrap CI's other checks (docs/testing.md).
test_packages=(g++ binutils cmake intel-opencl-icd clang-15 valgrind clang-14 libclang-rt-14-dev doxygen python3
               python3-venv python3-numpy python3-pytest python3-pyopencl oclgrind debootstrap openmpi-bin
               libopenmpi-dev libclblast-dev)

deps_only=0
bench_args=()
for a in "$@"; do
    case $a in
        --test-deps) packages+=("${test_packages[@]}") ;;
        --python) packages+=(python3-venv) ;;
        --deps-only) deps_only=1 ;;
        -h | --help)
            sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) bench_args+=("$a") ;;
    esac
done

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
[ $deps_only -eq 0 ] || exit 0

# --reconfigure: what was installed since the last run is found (the MPI
# example, the docs).
if [ -d build ]; then
    meson setup --reconfigure build
else
    meson setup build
fi
ninja -C build
build/tools/moecl-info
# The main job: every op at the seed shapes and the DeepSeek-V3
# configuration, checked against the float64 reference, then timed.
exec build/tools/moecl-bench --quick "${bench_args[@]}"
