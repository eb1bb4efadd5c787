#!/usr/bin/env bash
# The quick start's first command: installs what is missing, builds, starts
# a master on free loopback ports and shows it answering over HTTP.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$BUILD_DIR" -j2 --target tierkv-master

out=$(mktemp)
"$BUILD_DIR/tools/tierkv-master" --rpc-port=0 --http-port=0 >"$out" 2>"$out.err" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$out" "$out.err"' EXIT
for _ in $(seq 100); do grep -q listening "$out" && break; sleep 0.1; done
line=$(head -1 "$out")
http=${line##*http=}
echo "== tierkv-master: $line"
base="http://127.0.0.1:$http"
echo "== GET /health";  curl -fsS "$base/health"
echo "== PUT /metadata?key=demo/segment"; curl -fsS -X PUT --data '{"name":"demo"}' "$base/metadata?key=demo/segment"; echo
echo "== GET /metadata?key=demo/segment"; curl -fsS "$base/metadata?key=demo/segment"; echo
echo "== GET /v1/stats"; curl -fsS "$base/v1/stats"; echo
echo "== GET /metrics (first lines)"; curl -fsS "$base/metrics" | head -12
