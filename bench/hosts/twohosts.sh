#!/usr/bin/env bash
# Two pretend hosts on this machine: network namespaces moexA and moexB joined by a veth
# pair shaped with tc tbf to RATE (default 2gbit), RANKS/2 ranks in each. Ranks of a
# namespace talk through shared memory, the two namespaces over TCP on the veth: the
# shape of a two-node job with a slow network. Runs `moex bench coll --op OP` (OP:
# allreduce by default, allgather or reducescatter) with MOEX_ALGO=OP:ALGO for each ALGO
# in ALGOS (default: the model's choice, then ring, recursive doubling (rechalving for
# reducescatter) and hier forced) and with ranks in blocks (0..n/2-1 on host A) and
# alternating (even ranks on A). OP=moe runs `moex bench moe` instead
# (MODEL, TOKENS per rank, WIRE dtype; ALGOS is ignored).
#
# Needs root (ip netns, tc). Sends nothing outside the two namespaces it creates, and
# removes them on exit.
# usage: bench/hosts/twohosts.sh [RANKS] [RATE] [MIN_BYTES] [MAX_BYTES]
set -euo pipefail
cd "$(dirname "$0")/../.."
ranks=${1:-8}
rate=${2:-2gbit}
minb=${3:-65536}
maxb=${4:-16777216}
op=${OP:-allreduce}
case $op in
reducescatter) algos=${ALGOS:-"auto ring rechalving hier"} ;;
*) algos=${ALGOS:-"auto ring recdbl hier"} ;;
esac
work=$(mktemp -d)
cleanup() {
	ip netns del moexA 2>/dev/null || true
	ip netns del moexB 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
cleanup
mkdir -p "$work"
go build -o "$work/moex" ./cmd/moex
ip netns add moexA
ip netns add moexB
ip link add vmoexA type veth peer name vmoexB
ip link set vmoexA netns moexA
ip link set vmoexB netns moexB
ip -n moexA addr add 10.77.0.1/24 dev vmoexA
ip -n moexB addr add 10.77.0.2/24 dev vmoexB
for ns in moexA moexB; do
	ip -n $ns link set lo up
	ip -n $ns link set v$ns up
	ip netns exec $ns tc qdisc add dev v$ns root tbf rate "$rate" burst 256kbit latency 50ms
done
echo "# $op; two namespaces joined by a veth shaped to $rate each way; $ranks ranks; $(nproc) CPUs; $(date -u +%FT%TZ)"

run() { # layout algo
	local layout=$1 algo=$2 port=$((29500 + RANDOM % 2000)) token
	token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
	local pids=()
	for r in $(seq 0 $((ranks - 1))); do
		local host
		if [ "$layout" = blocks ]; then
			host=$((r * 2 / ranks))
		else
			host=$((r % 2))
		fi
		local ns=moexA addr=10.77.0.1
		if [ $host = 1 ]; then ns=moexB addr=10.77.0.2; fi
		local env=(MOEX_BENCH_WORKER=1 MOEX_RANK=$r MOEX_WORLD_SIZE=$ranks MOEX_LOCAL_SIZE=$((ranks / 2))
			MOEX_ADDR=10.77.0.1:$port MOEX_JOB_TOKEN=$token MOEX_BIND=$addr MOEX_HOST_ID=host-$ns
			MOEX_TRANSPORT=auto MOEX_TIMEOUT=120s)
		local cmd=(bench coll --op "$op" --transport tcp --min-bytes "$minb" --max-bytes "$maxb" --factor 4 --json)
		if [ "$op" = moe ]; then
			cmd=(bench moe --model "${MODEL:-mixtral-8x7b}" --tokens "${TOKENS:-512}" --wire-dtype "${WIRE:-f32}" --transport tcp --ranks "$ranks" --json)
		elif [ "$algo" != auto ]; then
			env+=(MOEX_ALGO=$op:$algo)
		fi
		ip netns exec $ns env "${env[@]}" "$work/moex" "${cmd[@]}" >"$work/out.$r" 2>"$work/err.$r" &
		pids+=($!)
	done
	local fail=0
	for p in "${pids[@]}"; do wait "$p" || fail=1; done
	if [ $fail = 1 ]; then
		echo "# $layout $algo failed:" >&2
		cat "$work"/err.* >&2
		return 1
	fi
	python3 - "$layout" "$algo" "$work/out.0" <<'PY'
import json, sys
layout, algo, path = sys.argv[1:]
for l in open(path):
    if l.startswith("{"):
        r = json.loads(l)
        if "dispatch_us" in r:
            print(f"{layout:<12} {r['model']:<14} {r['wire_dtype']:<5} {r['tokens_per_rank']:>6} {r['dispatch_us']/1000:>10.1f} {r['combine_us']/1000:>10.1f} {r['tokens_per_s']:>10.0f} {r['wire_bytes']:>12}")
        else:
            print(f"{layout:<12} {algo:<7} {r['algo']:<13} {r['bytes']:>10} {r['time_us']:>12.1f} {r['busbw_gbs']:>8.3f} {r['wrong']:>6}")
PY
}
if [ "$op" = moe ]; then
	algos=auto
	printf "%-12s %-14s %-5s %6s %10s %10s %10s %12s\n" layout model wire tokens disp_ms comb_ms tokens/s wire_bytes
else
	printf "%-12s %-7s %-13s %10s %12s %8s %6s\n" layout asked chosen bytes time_us busbw wrong
fi
for layout in blocks alternating; do
	for algo in $algos; do
		run "$layout" "$algo"
	done
done
