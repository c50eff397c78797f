#!/usr/bin/env bash
# The one check of moex on a host with a core per rank and a GPU (16 cores and an H200
# where this workplace lends one); it also runs on a 2-CPU host, skipping what needs a
# GPU, in under five minutes. It writes one Markdown report:
#   - the machine, and `moex topo --json` of a build with -tags nvml (the GPUs through NVML,
#     NUMA nodes, NICs);
#   - the MoE stages at 8 ranks over shared memory, low-latency and the default (Auto)
#     mode, 1, 16 and 128 tokens per rank: p50, p99 and mean of each stage, over its copy
#     floor and its floor in a step, and whether the tails meet p99 <= 3x p50 and
#     mean <= 1.3x p50;
#   - the same step written with MPI (bench/peers/moe_compare.sh) and the collectives
#     against Open MPI (bench/peers/compare.sh), where mpirun and mpicc are there;
#   - the GPU path through UCX (transport/ucx's tests with -tags ucx), where a GPU, a UCX
#     with CUDA and Go are there; otherwise the report says which was missing.
#
# Where Go is not installed (the device machine has none), it runs the binaries that
# `scripts/device-check.sh --prepare` built on a host that has Go, into .device/ (carry
# that folder). usage: scripts/device-check.sh [--prepare | REPORT.md]
# REPORT.md defaults to $OUT/device-report.md where OUT is set, else device-report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
prebuilt=$root/.device/bin

if [ "${1:-}" = --prepare ]; then
	mkdir -p "$prebuilt"
	go build -tags nvml -o "$prebuilt/moex" ./cmd/moex
	go build -o "$prebuilt/twocopy" ./bench/peers/twocopy
	echo "built $prebuilt/moex and twocopy; carry .device (git ignores it)"
	exit 0
fi

report=${1:-${OUT:+$OUT/device-report.md}}
report=${report:-device-report.md}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
cpus=$(nproc)
say() { echo "$@" >>"$report"; }
log() { echo "device-check: $*" >&2; }
: >"$report"

# ---- the build
if command -v go >/dev/null; then
	log "building moex"
	go build -tags nvml -o "$work/moex" ./cmd/moex
	go build -o "$work/twocopy" ./bench/peers/twocopy
	built="built here with $(go version | cut -d' ' -f3)"
elif [ -x "$prebuilt/moex" ]; then
	cp "$prebuilt/moex" "$prebuilt/twocopy" "$work/"
	built="prebuilt (.device/bin: no Go on this host)"
else
	echo "device-check: no Go here and no .device/bin/moex: run scripts/device-check.sh --prepare where Go is, and carry .device" >&2
	exit 2
fi
moex=$work/moex
export MOEX_BIN=$moex

say "# moex device check"
say ""
say "| | |"
say "| --- | --- |"
say "| date | $(date -u +'%Y-%m-%d %H:%M UTC') |"
say "| commit | $(git rev-parse --short HEAD 2>/dev/null || echo unknown) |"
say "| moex | $built |"
say "| CPU | $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $cpus CPUs |"
say "| memory | $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo) |"
say "| kernel | $(uname -r) |"
gpu=no
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
	gpu=yes
	say "| GPUs | $(nvidia-smi -L | tr '\n' ';' | sed 's/;$//') |"
	say "| driver | $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1) |"
else
	say "| GPUs | none found (nvidia-smi missing or sees none) |"
fi
say ""

# ---- topology
say "## Topology"
say ""
say '`moex topo --json`:'
say ""
say '```json'
"$moex" topo --json >>"$report" 2>&1 || say "(moex topo failed: exit $?)"
say '```'
say ""

# ---- the MoE stages at 8 ranks
iters() { # timed steps for a token count: fewer on a small host, to stay under 5 minutes
	local t=$1 f=1
	[ "$cpus" -lt 8 ] && f=3
	if [ "$t" -le 1 ]; then echo $((300 / f)); elif [ "$t" -le 16 ]; then echo $((150 / f)); else echo $((45 / f)); fi
}
say "## The MoE stages, 8 ranks over shared memory"
say ""
say "\`moex bench moe --model M --ranks 8 --transport shm --tokens N [--mode low-latency --wire-dtype bf16 --act bf16] --iters I --pairs I --json\`,"
say "experts as the identity. Per stage: p50, p99 and mean (us); p50 over the copy floor (every byte the stage moves copied once"
say "with every CPU) and over its floor in a step (each rank copying its share once, timed as the stage is); the tail"
say "targets: p99 <= 3x p50 and mean <= 1.3x p50 (ok / over). $cpus CPUs for 8 ranks."
say ""
say "| model | mode | tokens | dispatch p50 | p99 | mean | /floor | /step floor | combine p50 | p99 | mean | /floor | /step floor | tails |"
say "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for model in deepseek-v3 qwen3-30b-a3b; do
	for tokens in 1 16 128; do
		for mode in low-latency auto; do
			if [ $mode = auto ] && [ "$tokens" = 128 ]; then continue; fi
			it=$(iters "$tokens")
			args=(--model "$model" --ranks 8 --transport shm --tokens "$tokens" --iters "$it" --pairs "$it" --json)
			if [ $mode = low-latency ]; then args+=(--mode low-latency --wire-dtype bf16 --act bf16); fi
			log "moe $model $mode $tokens"
			if ! "$moex" bench moe "${args[@]}" >"$work/moe.json" 2>"$work/moe.err"; then
				say "| $model | $mode | $tokens | failed: $(tail -1 "$work/moe.err") |"
				continue
			fi
			python3 - "$work/moe.json" "$model" "$mode" "$tokens" >>"$report" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).readline())
model, mode, tokens = sys.argv[2:5]
if r.get("step_mode") and r["step_mode"] != r["mode"]:
    mode += " (" + r["step_mode"] + ")"
cells, ok = [], True
for s in ("dispatch", "combine"):
    x = r[s]
    ok = ok and x["p99_us"] <= 3 * x["p50_us"] and x["mean_us"] <= 1.3 * x["p50_us"]
    cells += [f'{x["p50_us"]:.0f}', f'{x["p99_us"]:.0f}', f'{x["mean_us"]:.0f}', f'{x["p50_over_floor"]:.2f}x', f'{x.get("p50_over_step_floor", 0):.2f}x']
print(f"| {model} | {mode} | {tokens} | " + " | ".join(cells) + f" | {'ok' if ok else 'over'} |")
EOF
		done
	done
done
say ""

# ---- peers
say "## Peers"
say ""
if command -v mpirun >/dev/null && command -v mpicc >/dev/null && echo '#include <mpi.h>' | mpicc -E -x c - >/dev/null 2>&1; then
	say "The MoE step written with MPI (\`bench/peers/moe_compare.sh 1 ...\`: ratio = MPI's mean over moex's, above 1 moex is faster):"
	say ""
	say '```'
	bench/peers/moe_compare.sh 1 qwen3-30b-a3b:8:1 qwen3-30b-a3b:8:16 qwen3-30b-a3b:8:128 >>"$report" 2>&1 || say "(failed: exit $?)"
	say '```'
	say ""
	if [ $(($(date +%s) - start)) -lt 150 ]; then
		say "Collectives against Open MPI (\`bench/peers/compare.sh 1\`):"
		say ""
		say '```'
		bench/peers/compare.sh 1 >>"$report" 2>&1 || say "(failed: exit $?)"
		say '```'
	else
		say "Collectives against Open MPI: skipped, to stay within the time budget (bench/peers/compare.sh runs them)."
	fi
else
	say "Skipped: no Open MPI here (mpirun, mpicc and mpi.h); bench/peers/compare.sh and moe_compare.sh install it from Debian where they can."
fi
say ""

# ---- the GPU path
say "## The GPU path through UCX"
say ""
why=""
if [ $gpu = no ]; then
	why="no GPU on this host"
elif ! command -v go >/dev/null; then
	why="no Go on this host to build the ucx-tagged tests"
elif ! pkg-config --exists ucx 2>/dev/null; then
	why="no UCX development files (libucx-dev) on this host"
elif ! ucx_info -d 2>/dev/null | grep -qi cuda; then
	why="this host's UCX has no CUDA transport (ucx_info -d lists none): GPU memory cannot move through it"
fi
if [ -n "$why" ]; then
	say "Skipped: $why."
else
	say '`go test -tags ucx -run Device ./transport/ucx/`:'
	say ""
	say '```'
	go test -count=1 -tags ucx -run 'Device' -v ./transport/ucx/ >>"$report" 2>&1 || say "(failed: exit $?)"
	say '```'
fi
say ""
say "The check took $(($(date +%s) - start)) s."
log "wrote $report in $(($(date +%s) - start)) s"
