#!/usr/bin/env bash
# The quick start's first command: installs what is missing, builds, and
# runs `tierkv demo`: an embedded cluster (a master and two store daemons)
# serving the small transformer and then the shared trace, printing hit
# rates per tier. Extra arguments go to `tierkv demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j2 --target tierkv
trace=../shared/data/synthetic_trace.jsonl
[ -f "$trace" ] || trace=shared/data/synthetic_trace.jsonl
exec "$BUILD_DIR/tools/tierkv" demo --trace "$trace" \
  --csv "$BUILD_DIR/demo-hit-rate.csv" --svg "$BUILD_DIR/demo-hit-rate.svg" "$@"
