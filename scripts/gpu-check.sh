#!/usr/bin/env bash
# The checks that need a GPU, as one short run for a GPU host: the cuda
# transport's conformance suite and the engine's GPU L1 tests, then the two
# GPU benchmarks (transfer engine vs cudaMemcpy; L2<->L1 page copies vs one
# copy) and the demo with L1 on the GPU. Output goes to $OUT (default
# build-gpu/out). Builds in build-gpu for sm_90 only, to keep it quick.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build-gpu/out}
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
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
