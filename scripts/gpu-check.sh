#!/usr/bin/env bash
# The checks that need a GPU, as one short run for a GPU host: the cuda
# transport's conformance suite and the engine's GPU L1 tests, then the two
# GPU benchmarks (transfer engine vs cudaMemcpy; L2<->L1 page copies vs one
# copy) and the demo with L1 on the GPU. Output goes to $OUT (default
# build-gpu/out). Builds in build-gpu for sm_90 only, to keep it quick.
#
# A GPU host that lacks the Debian packages (and cannot install them) runs
# binaries built elsewhere: `gpu-check.sh --pack [build-dir]` (default
# build) writes build-gpu/pack.tar.xz with the binaries this script runs and
# every shared library they load but the C library and the GPU driver; a
# later `gpu-check.sh` beside that file unpacks it (over whatever binaries
# build-gpu holds) instead of building. The build must have found nvcc.
set -uo pipefail
cd "$(dirname "$0")/.."
readonly BINS=(tests/unit/tierkv_unit_tests tools/tierkv-bench tools/tierkv tools/tierkv-master tools/tierkv-store)

if [ "${1:-}" = "--pack" ]; then
  set -e
  from=${2:-build}
  grep -Eq '^CMAKE_CUDA_COMPILER:[A-Z]+=.+' "$from/CMakeCache.txt" 2>/dev/null ||
    { echo "$from was configured without nvcc: nothing to check on a GPU" >&2; exit 1; }
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  chmod 755 "$stage"
  mkdir -p "$stage/lib"
  for b in "${BINS[@]}"; do
    mkdir -p "$stage/$(dirname "$b")"
    strip -o "$stage/$b" "$from/$b"
    deps=$(ldd "$from/$b" || true)  # a static binary loads nothing
    if grep -q 'not found' <<<"$deps"; then
      echo "$from/$b: $(grep 'not found' <<<"$deps" | tr -s ' \t\n' ' ')" >&2
      exit 1
    fi
    # The C library (all of glibc), the loader and the driver come from
    # the GPU host; a newer glibc there runs what this one linked.
    for lib in $(awk '$3 ~ /^\// {print $3}' <<<"$deps" |
      grep -Ev '/(libc|libm|libmvec|libdl|libpthread|librt|libresolv|libutil|libanl|ld-linux[^/]*|libcuda)\.so' || true); do
      [ -e "$stage/lib/${lib##*/}" ] || cp -L "$lib" "$stage/lib/"
    done
  done
  mkdir -p build-gpu
  tar -C "$stage" -cJf build-gpu/pack.tar.xz .
  echo "build-gpu/pack.tar.xz: $(du -h build-gpu/pack.tar.xz | cut -f1) ($(ls "$stage/lib" | wc -l) libraries)"
  exit 0
fi

OUT=${OUT:-build-gpu/out}
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
if [ -f build-gpu/pack.tar.xz ]; then
  tar -C build-gpu -xJf build-gpu/pack.tar.xz || exit 1
fi
if [ -d build-gpu/lib ]; then
  export LD_LIBRARY_PATH="$PWD/build-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for b in "${BINS[@]}"; do
    ldd "build-gpu/$b" | grep 'not found' | sed "s|^|$b: |" >&2 || true
  done
fi
if [ ! -x build-gpu/tests/unit/tierkv_unit_tests ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DBUILD_TESTING=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/configure.txt" 2>&1 || { tail -20 "$OUT/configure.txt"; exit 1; }
  cmake --build build-gpu -j"$(nproc)" --target tierkv_unit_tests tierkv-bench tierkv tierkv-master tierkv-store \
    >"$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
fi
rc=0
build-gpu/tests/unit/tierkv_unit_tests --gtest_filter='Cuda*:EngineDevice*:EngineTest.*' 2>&1 | tee "$OUT/tests.txt" || rc=1
build-gpu/tools/tierkv-bench transfer --transport cuda --block 4mb --batch 16 --min-time 0.5 2>&1 | tail -3 | tee "$OUT/bench-transfer.txt" || rc=1
build-gpu/tools/tierkv-bench l1 --l1-device cuda:0 --block 1mib --batch 256 --min-time 0.5 2>&1 | tail -1 | tee "$OUT/bench-l1.txt" || rc=1
build-gpu/tools/tierkv-bench l1 --l1-device cuda:0 --block 64kib --batch 1024 --min-time 0.5 2>&1 | tail -1 | tee -a "$OUT/bench-l1.txt" || rc=1
build-gpu/tools/tierkv demo --l1-device cuda:0 --requests 120 --progress=false 2>&1 | tee "$OUT/demo.txt" || rc=1
exit $rc
