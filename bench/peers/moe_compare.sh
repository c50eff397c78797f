#!/usr/bin/env bash
# The MoE step, moex against the same step written with MPI's collectives
# (bench/peers/mpi_moe.c: pack each token once per destination rank, MPI_Alltoall of the
# counts, MPI_Alltoallv of the rows, unpack expert-major; the partial sums back the same
# way), on this host over shared memory, experts as the identity (the stages alone).
#
# Two pairs per configuration, run alternately ROUNDS times each, the best mean of each
# stage kept (and the median over the rounds):
#   default: `moex bench moe` with Mode left unset, f32 rows, against mpi_moe with f32 rows;
#   ll-bf16: `moex bench moe --mode low-latency --wire-dtype bf16 --act bf16` against
#            mpi_moe with 2-byte rows.
# The MPI step runs twice a round: its buffers malloc'd (4 KiB pages here, THP being
# "madvise") and on 2 MiB pages (MPI_MOE_HUGE=1), the pages moex's buffers have (obuf:
# 2 MiB pages from 256 KiB). ratio = MPI's mean time over moex's (above 1, moex is
# faster): mpi and ratio for malloc'd buffers, mpi_huge and ratio_huge on equal pages; a
# stage's mean includes its tail. One line per (model, ranks, tokens, pair, stage).
#
# Installs Open MPI from Debian's packages when missing (needs root for apt-get).
# MOEX_BIN names a moex binary to use instead of building one (a host without Go).
# usage: bench/peers/moe_compare.sh [ROUNDS] [CONFIGS...], a config being MODEL:RANKS:TOKENS
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
shift || true
configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
	configs=(qwen3-30b-a3b:8:1 qwen3-30b-a3b:8:16 qwen3-30b-a3b:8:128 qwen3-30b-a3b:4:128 qwen3-30b-a3b:4:512
		mixtral-8x7b:8:1 mixtral-8x7b:8:16 mixtral-8x7b:8:128 mixtral-8x7b:4:128 mixtral-8x7b:4:512 mixtral-8x7b:2:512)
fi
if ! command -v mpirun >/dev/null || ! command -v mpicc >/dev/null ||
	! echo '#include <mpi.h>' | mpicc -E -x c - >/dev/null 2>&1; then
	echo "# installing Open MPI (openmpi-bin, libopenmpi-dev)" >&2
	apt-get update >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_moe" bench/peers/mpi_moe.c -lm
if [ -n "${MOEX_BIN:-}" ]; then # a moex built elsewhere (a host without Go)
	cp "$MOEX_BIN" "$work/moex"
else
	go build -o "$work/moex" ./cmd/moex
fi
echo "# $(mpirun --version 2>&1 | head -1); moex $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ); best of $rounds alternating rounds"
printf "%-14s %5s %6s %-8s %-8s %10s %10s %7s %10s %10s %10s %10s %7s %10s %10s %9s %9s\n" model ranks tokens pair stage moex_mean mpi_mean ratio mpi_huge ratio_huge moex_med mpi_med ratio_med mpi_huge_med ratio_huge_med moex_p99 mpi_p99

model_dims() { # hidden experts topk of a model, from moex bench moe -models
	"$work/moex" bench moe -models | awk -v m="$1" '$1 == m { print $3, $8, substr($9, 5) }'
}

iters_for() {
	if [ "$1" -le 1 ]; then echo 300; elif [ "$1" -le 16 ]; then echo 150; elif [ "$1" -le 128 ]; then echo 40; else echo 15; fi
}

for cfg in "${configs[@]}"; do
	IFS=: read -r model ranks tokens <<<"$cfg"
	read -r hidden experts topk <<<"$(model_dims "$model")"
	if [ -z "$hidden" ]; then echo "moe_compare: unknown model $model" >&2; exit 2; fi
	iters=$(iters_for "$tokens")
	for pair in default ll-bf16; do
		: >"$work/moex.json"
		: >"$work/mpi.json"
		: >"$work/mpih.json"
		for r in $(seq "$rounds"); do
			if [ $pair = default ]; then
				"$work/moex" bench moe --model "$model" --ranks "$ranks" --transport shm --tokens "$tokens" --iters "$iters" --pairs 2 --json >>"$work/moex.json"
				elem=4
			else
				"$work/moex" bench moe --model "$model" --ranks "$ranks" --transport shm --tokens "$tokens" --mode low-latency --wire-dtype bf16 --act bf16 --iters "$iters" --pairs 2 --json >>"$work/moex.json"
				elem=2
			fi
			mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$work/mpi_moe" "$hidden" "$experts" "$topk" "$tokens" "$iters" "$elem" >>"$work/mpi.json" 2>/dev/null
			mpirun --allow-run-as-root --oversubscribe -x MPI_MOE_HUGE=1 -np "$ranks" "$work/mpi_moe" "$hidden" "$experts" "$topk" "$tokens" "$iters" "$elem" >>"$work/mpih.json" 2>/dev/null
		done
		python3 - "$work/moex.json" "$work/mpi.json" "$work/mpih.json" "$model" "$ranks" "$tokens" "$pair" <<'EOF'
import json, statistics, sys
moex, mpi, mpih = ([json.loads(l) for l in open(f) if l.startswith("{")] for f in sys.argv[1:4])
model, ranks, tokens, pair = sys.argv[4:8]
for stage in ("dispatch", "combine"):
    m, o, h = ([r[stage]["mean_us"] for r in rs] for rs in (moex, mpi, mpih))
    mp = min(moex, key=lambda r: r[stage]["mean_us"])[stage]["p99_us"]
    op = min(mpi, key=lambda r: r[stage]["mean_us"])[stage]["p99_us"]
    med = statistics.median
    print(f"{model:<14} {ranks:>5} {tokens:>6} {pair:<8} {stage:<8} {min(m):10.1f} {min(o):10.1f} {min(o)/min(m):6.2f}x "
          f"{min(h):10.1f} {min(h)/min(m):9.2f}x {med(m):10.1f} {med(o):10.1f} {med(o)/med(m):6.2f}x "
          f"{med(h):10.1f} {med(h)/med(m):13.2f}x {mp:9.1f} {op:9.1f}")
EOF
	done
done
