#!/usr/bin/env bash
# The quick start's first command: installs what is missing, builds, and
# runs `tierkv demo`: an embedded cluster (a master and two store daemons)
# serving the small transformer and then the repository's trace (data/), printing hit
# rates per tier. Extra arguments go to `tierkv demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j2 --target tierkv
exec "$BUILD_DIR/tools/tierkv" demo --trace data/synthetic_trace.jsonl \
  --csv "$BUILD_DIR/demo-hit-rate.csv" --svg "$BUILD_DIR/demo-hit-rate.svg" "$@"
