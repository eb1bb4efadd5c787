#!/usr/bin/env bash
# Installs the Debian 12 packages tierkv builds and tests with. Idempotent:
# packages already present are skipped, so a warm machine pays nothing.
set -euo pipefail

pkgs=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev libcpp-httplib-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libibverbs-dev libopenblas-dev
  prometheus prometheus-cpp-dev curl procps iproute2 nftables
  python3-dev pybind11-dev python3-pytest python3-numpy python3-torch
  libzmq3-dev libmsgpack-cxx-dev python3-zmq python3-msgpack
  libsystemd-dev systemd python3-yaml liburing-dev
  libhiredis-dev redis-server redis-tools
  libssl-dev openssl
  etcd-server
)
if [ "${TIERKV_WITH_SANITIZERS:-0}" = 1 ]; then
  pkgs+=(clang-14 libclang-rt-14-dev)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
