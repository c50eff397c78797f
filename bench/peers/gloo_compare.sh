#!/usr/bin/env bash
# moex against torch.distributed's gloo backend on this host, both over TCP on loopback:
# all_reduce (f32 sum) and all_to_all_single against `moex bench coll --transport tcp`,
# same ranks and sizes, run alternately ROUNDS times each, the best time of each kept.
# Prints one line per (op, ranks, size) with both times and the ratio (gloo's time over
# moex's: above 1, moex is faster). Needs python3 with torch (Debian: python3-torch, which
# it installs when missing, as root).
# MOEX_BIN names a moex binary to use instead of building one.
# usage: bench/peers/gloo_compare.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
py=python3
if [ -x /usr/bin/python3 ]; then py=/usr/bin/python3; fi # Debian's, which holds python3-torch
if ! "$py" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
	echo "# installing python3-torch" >&2
	apt-get update >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-torch >/dev/null
	py=/usr/bin/python3
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${MOEX_BIN:-}" ]; then
	cp "$MOEX_BIN" "$work/moex"
else
	go build -o "$work/moex" ./cmd/moex
fi
echo "# torch $("$py" -c 'import torch; print(torch.__version__)') gloo; moex $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nproc) CPUs; $(date -u +%FT%TZ); best of $rounds alternating rounds"
printf "%-10s %5s %10s %12s %12s %8s\n" op ranks bytes moex_us gloo_us ratio
sizes=(65536 4194304)
for op in allreduce alltoall; do
	for p in 2 4 8; do
		: >"$work/moex.json"
		: >"$work/gloo.json"
		for r in $(seq "$rounds"); do
			for s in "${sizes[@]}"; do
				"$work/moex" bench coll --op "$op" --ranks "$p" --transport tcp --min-bytes "$s" --max-bytes "$s" --json >>"$work/moex.json"
			done
			"$py" bench/peers/gloo_coll.py "$op" "$p" "${sizes[@]}" >>"$work/gloo.json" 2>/dev/null
		done
		for s in "${sizes[@]}"; do
			python3 - "$work/moex.json" "$work/gloo.json" "$op" "$p" "$s" <<'PY'
import json, sys
size = int(sys.argv[5])
def best(path):
    rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    t = [r["time_us"] for r in rows if abs(r["bytes"] - size) <= 64]
    return min(t) if t else float("nan")
m, g = best(sys.argv[1]), best(sys.argv[2])
print(f"{sys.argv[3]:<10} {sys.argv[4]:>5} {size:>10} {m:12.1f} {g:12.1f} {g/m:7.2f}x")
PY
		done
	done
done
