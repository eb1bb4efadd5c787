#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit and
# integration). Extra arguments go to ctest (e.g. -R Index).
#   SANITIZE=address,undefined | thread   build with that sanitizer
#   BUILD_DIR=dir                          where to build (default: build)
#   FUZZ=ON                                also build the libFuzzer targets (ctest label
#                                          `fuzz`; needs CXX=clang++-14)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=ON \
  -DTIERKV_SANITIZE="${SANITIZE:-}" -DTIERKV_FUZZ="${FUZZ:-OFF}" >/dev/null
cmake --build "$BUILD_DIR" -j2
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 600 -j2 "$@"
