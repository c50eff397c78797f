"""torch.distributed's gloo backend side of the moex-vs-gloo comparison: all_reduce (f32
sum) and all_to_all_single, measured the way `moex bench coll` measures (warm-up, an
iteration count agreed from a timed probe, a barrier, untimed operations after it, the
slowest rank's mean time), printed as the same JSON fields as `moex bench coll --json`.

usage: python3 gloo_coll.py OP RANKS BYTES... (OP: allreduce or alltoall; ranks spawned
here, over TCP on 127.0.0.1)
"""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, ranks, op, sizes, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)

    def once(x, y):
        t = time.perf_counter()
        if op == "alltoall":
            dist.all_to_all_single(y, x)
        else:
            dist.all_reduce(x)
        return time.perf_counter() - t

    for size in sizes:
        n = size // 4 // ranks * ranks
        x = torch.ones(n, dtype=torch.float32)
        y = torch.empty_like(x)
        for _ in range(3):
            once(x, y)
        probe = torch.tensor([once(x, y)], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        iters = int(min(1000, max(5, 0.2 / max(probe.item(), 1e-7))))
        dist.barrier()
        for _ in range(max(5, iters // 10)):
            once(x, y)
        t0 = time.perf_counter()
        for _ in range(iters):
            once(x, y)
        el = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"op": op, "ranks": ranks, "transport": "gloo", "bytes": n * 4, "time_us": el.item() * 1e6, "iters": iters}), flush=True)
    dist.destroy_process_group()


def main():
    op, ranks, sizes = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(ranks, op, sizes, port), nprocs=ranks)


if __name__ == "__main__":
    main()
