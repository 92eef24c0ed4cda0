#!/usr/bin/env bash
# The CUDA device on a machine with an NVIDIA GPU and driver: the staging suite (every op, copy
# counts, failures that publish nothing) on CUDA buffers, the device's own test, and the staging
# benchmark. On a machine without CUDA the CUDA tests report themselves skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L || echo "nvidia-smi not found: is there a GPU driver?" >&2
cargo test -p distcomm --features cuda --lib device::cuda -- --nocapture
cargo test -p distcomm --features cuda --test staging cuda:: -- --nocapture
cargo run --release -p distcomm-cli --features cuda -- bench staging --device cuda --sizes 8,1M,64M
