#!/usr/bin/env bash
# Exact vs 1-bit all_reduce between two "hosts" joined by a 1 Gbit/s link: two network
# namespaces on this machine, a veth pair, a token-bucket filter on each end. One rank per
# namespace, TCP transport (shared memory would bypass the link).
#
#   sudo scripts/netns_onebit.sh [SIZES] [RATE]      # defaults: 64M, 1gbit
#
# Needs root (ip netns, tc) and a release build of the CLI (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${1:-64M}
RATE=${2:-1gbit}
BIN=${DISTCOMM_BIN:-$PWD/target/release/distcomm}
A=dcnetA B=dcnetB
cleanup() {
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add "$A"
ip netns add "$B"
ip link add dcvethA netns "$A" type veth peer name dcvethB netns "$B"
ip -n "$A" addr add 10.77.0.1/24 dev dcvethA
ip -n "$B" addr add 10.77.0.2/24 dev dcvethB
for ns in "$A" "$B"; do
    ip -n "$ns" link set lo up
done
ip -n "$A" link set dcvethA up
ip -n "$B" link set dcvethB up
# The link: RATE each way, a 1 MiB queue (about 8 ms at 1 Gbit/s).
tc -n "$A" qdisc add dev dcvethA root tbf rate "$RATE" burst 64kb limit ${QLIMIT:-1mb}
tc -n "$B" qdisc add dev dcvethB root tbf rate "$RATE" burst 64kb limit ${QLIMIT:-1mb}
echo "# link: $(tc -n "$A" qdisc show dev dcvethA)"
export DISTCOMM_SECRET=netns-onebit DISTCOMM_TRANSPORT=tcp DISTCOMM_SHM_ALLREDUCE=0
for op in ${OPS:-all_reduce onebit_all_reduce}; do
    for node in 0 1; do
        ns=$([ "$node" = 0 ] && echo "$A" || echo "$B")
        ip netns exec "$ns" "$BIN" launch -n 1 --nnodes 2 --node-rank "$node" \
            --master-addr 10.77.0.1 --master-port 29533 -- \
            "$BIN" bench "$op" --sizes "$SIZES" &
    done
    wait
done
