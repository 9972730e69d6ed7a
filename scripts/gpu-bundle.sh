#!/usr/bin/env bash
# On a CPU machine with the Rust toolchain: builds what scripts/gpu-check.sh
# runs on a GPU machine that has CUDA and Python but no Rust and no network,
# into target/gpu-bundle/bundle.tar.xz (the release xtask, stripped, and
# ONNX Runtime's library; under 64 MiB). Carry target/gpu-bundle there.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p xtask
cargo run --release -q -p xtask -- ort >/dev/null
out=target/gpu-bundle
rm -rf "$out" && mkdir -p "$out/stage"
cp target/release/xtask "$out/stage/xtask"
strip "$out/stage/xtask"
cp target/onnxruntime/libonnxruntime.so.1.31.1 "$out/stage/"
tar -C "$out/stage" -cJf "$out/bundle.tar.xz" .
rm -rf "$out/stage"
ls -l "$out/bundle.tar.xz"
