#!/usr/bin/env bash
# Two pretend hosts on this machine: network namespaces moexA and moexB joined by a veth
# pair shaped with tc tbf to RATE (default 2gbit), RANKS/2 ranks in each. Ranks of a
# namespace talk through shared memory, the two namespaces over TCP on the veth: the
# shape of a two-node job with a slow network. Runs `moex bench coll --op OP` (OP:
# allreduce by default, allgather or reducescatter) with MOEX_ALGO=OP:ALGO for each ALGO
# in ALGOS (default: the model's choice, then ring, recursive doubling (rechalving for
# reducescatter) and hier forced) and with ranks in blocks (0..n/2-1 on host A) and
# alternating (even ranks on A). OP=alltoall compares linear and hier (two-level).
# OP=moe runs `moex bench moe` instead (MODEL, TOKENS per rank, WIRE dtype; ALGOS is
# ignored); OP=levels runs `moex bench moe --levels L` for L in ALGOS (default: flat,
# two (dispatch.TwoLevel) and auto (the model's choice)), ITERS timed steps after two
# untimed ones. MOEX_NET_GBITS is set from RATE so that the cost model knows the link.
# Every row also gives the bytes that crossed the veth (both ways, TCP's headers
# included) during its run, set-up and untimed steps included.
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
alltoall) algos=${ALGOS:-"auto linear hier"} ;;
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
gbits=$(python3 -c "import re,sys; m=re.fullmatch(r'([0-9.]+)([kmg]?)bit','$rate'); print(float(m[1])*{'k':1e-6,'m':1e-3,'g':1,'':1e-9}[m[2]])")
linkbytes() { # bytes through host A's end of the veth, both ways
	echo $(($(ip netns exec moexA cat /sys/class/net/vmoexA/statistics/tx_bytes) + $(ip netns exec moexA cat /sys/class/net/vmoexA/statistics/rx_bytes)))
}

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
			MOEX_TRANSPORT=auto MOEX_TIMEOUT=120s MOEX_NET_GBITS=$gbits)
		local cmd=(bench coll --op "$op" --transport tcp --min-bytes "$minb" --max-bytes "$maxb" --factor 4 --json)
		if [ "$op" = moe ]; then
			cmd=(bench moe --model "${MODEL:-mixtral-8x7b}" --tokens "${TOKENS:-512}" --wire-dtype "${WIRE:-f32}" --transport tcp --ranks "$ranks" --json)
		elif [ "$op" = levels ]; then
			cmd=(bench moe --model "${MODEL:-deepseek-v3}" --tokens "${TOKENS:-128}" --wire-dtype "${WIRE:-bf16}" --levels "$algo" --iters "${ITERS:-5}" --transport tcp --ranks "$ranks" --json)
		elif [ "$algo" != auto ]; then
			env+=(MOEX_ALGO=$op:$algo)
		fi
		ip netns exec $ns env "${env[@]}" "$work/moex" "${cmd[@]}" >"$work/out.$r" 2>"$work/err.$r" &
		pids+=($!)
	done
	local fail=0 before
	before=$(linkbytes)
	for p in "${pids[@]}"; do wait "$p" || fail=1; done
	local link=$(($(linkbytes) - before))
	if [ $fail = 1 ]; then
		echo "# $layout $algo failed:" >&2
		cat "$work"/err.* >&2
		return 1
	fi
	python3 - "$layout" "$algo" "$work/out.0" "$link" <<'PY'
import json, sys
layout, algo, path, link = sys.argv[1:]
link = f"{int(link)/2**20:.1f}"
for l in open(path):
    if l.startswith("{"):
        r = json.loads(l)
        if "levels" in r:
            print(f"{layout:<12} {r['model']:<14} {r['tokens_per_rank']:>6} {algo:<6} {r['levels']:<10} {r['model_chooses']:<10} {r['dispatch_p50_us']/1000:>9.1f} {r['combine_p50_us']/1000:>9.1f} {r['step_us']/1000:>9.1f} {r['dispatch_across_bytes']/2**20:>10.2f} {r['across_hosts_bytes']/2**20:>10.2f} {link:>9}")
        elif "dispatch" in r:
            print(f"{layout:<12} {r['model']:<14} {r['wire_dtype']:<5} {r['tokens_per_rank']:>6} {r['dispatch']['p50_us']/1000:>10.1f} {r['combine']['p50_us']/1000:>10.1f} {r['tokens_per_s']:>10.0f} {r['dispatch']['wire_bytes']:>12} {link:>9}")
        else:
            print(f"{layout:<12} {algo:<7} {r['algo']:<13} {r['bytes']:>10} {r['time_us']:>12.1f} {r['busbw_gbs']:>8.3f} {r['wrong']:>6} {link:>9}")
PY
}
case $op in
moe)
	algos=auto
	printf "%-12s %-14s %-5s %6s %10s %10s %10s %12s %9s\n" layout model wire tokens disp_ms comb_ms tokens/s wire_bytes link_MiB
	;;
levels)
	algos=${ALGOS:-"flat two auto"}
	printf "%-12s %-14s %6s %-6s %-10s %-10s %9s %9s %9s %10s %10s %9s\n" layout model tokens asked ran chooses disp_ms comb_ms step_ms disp_MiB step_MiB link_MiB
	echo "# disp_MiB, step_MiB: the planner's bytes across hosts for one dispatch, and for a dispatch and its combine"
	;;
*)
	printf "%-12s %-7s %-13s %10s %12s %8s %6s %9s\n" layout asked chosen bytes time_us busbw wrong link_MiB
	;;
esac
for layout in blocks alternating; do
	for algo in $algos; do
		run "$layout" "$algo"
	done
done
