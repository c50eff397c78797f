/* Open MPI side of the moex-vs-MPI comparison: MPI_Alltoall and MPI_Allreduce (f32 sum),
 * measured the way `moex bench coll` measures (warm-up, an iteration count agreed from a
 * timed probe, a barrier, a tenth as many untimed operations after it, the slowest rank's
 * mean time, a check of the last result), and printed as the same JSON fields as
 * `moex bench coll --json`.
 *
 * usage: mpirun -np P ./mpi_coll alltoall|allreduce MIN_BYTES MAX_BYTES
 * MPI_COLL_ITERS=N (passed with mpirun -x) times N operations instead, as moex bench coll
 * --iters N does. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double run(const char *op, float *send, float *recv, int n, int ranks, MPI_Comm comm) {
    double t = MPI_Wtime();
    if (strcmp(op, "alltoall") == 0)
        MPI_Alltoall(send, n / ranks, MPI_FLOAT, recv, n / ranks, MPI_FLOAT, comm);
    else
        MPI_Allreduce(send, recv, n, MPI_FLOAT, MPI_SUM, comm);
    return MPI_Wtime() - t;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (argc != 4) {
        if (rank == 0) fprintf(stderr, "usage: mpi_coll alltoall|allreduce MIN MAX\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *op = argv[1];
    long minb = atol(argv[2]), maxb = atol(argv[3]);
    for (long bytes = minb; bytes <= maxb; bytes *= 2) {
        int n = (int)(bytes / 4);
        if (strcmp(op, "alltoall") == 0) n = n / ranks * ranks;
        float *send = malloc((size_t)n * 4 + 64), *recv = malloc((size_t)n * 4 + 64);
        for (int i = 0; i < n; i++) send[i] = (strcmp(op, "alltoall") == 0) ? (float)(rank * 1000003 + i) : (float)((rank + i) % 7 - 3);
        for (int i = 0; i < 3; i++) run(op, send, recv, n, ranks, MPI_COMM_WORLD);
        double probe = run(op, send, recv, n, ranks, MPI_COMM_WORLD), pmax;
        MPI_Allreduce(&probe, &pmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        int iters = (int)(0.2 / (pmax > 1e-7 ? pmax : 1e-7));
        if (iters < 5) iters = 5;
        if (iters > 1000) iters = 1000;
        const char *fixed = getenv("MPI_COLL_ITERS");
        if (fixed && atoi(fixed) > 0) iters = atoi(fixed);
        MPI_Barrier(MPI_COMM_WORLD);
        /* Untimed after the barrier, as moex bench coll does (skipOf in bench/coll.go). */
        int skip = iters / 10 > 5 ? iters / 10 : 5;
        for (int i = 0; i < skip; i++) run(op, send, recv, n, ranks, MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) run(op, send, recv, n, ranks, MPI_COMM_WORLD);
        double el = (MPI_Wtime() - t0) / iters, elmax;
        MPI_Allreduce(&el, &elmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        long wrong = 0, wtotal = 0;
        if (strcmp(op, "alltoall") == 0) {
            int blk = n / ranks;
            for (int q = 0; q < ranks; q++)
                for (int k = 0; k < blk; k++)
                    if (recv[q * blk + k] != (float)(q * 1000003 + rank * blk + k)) wrong++;
        } else {
            for (int i = 0; i < n; i++) {
                float want = 0;
                for (int q = 0; q < ranks; q++) want += (float)((q + i) % 7 - 3);
                if (recv[i] != want) wrong++;
            }
        }
        MPI_Allreduce(&wrong, &wtotal, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = (double)n * 4 / elmax / 1e9;
            double bus = strcmp(op, "alltoall") == 0 ? (double)(ranks - 1) / ranks : 2.0 * (ranks - 1) / ranks;
            printf("{\"op\":\"%s\",\"ranks\":%d,\"transport\":\"openmpi\",\"bytes\":%ld,\"count\":%d,\"dtype\":\"f32\","
                   "\"algo\":\"ompi\",\"time_us\":%.3f,\"algbw_gbs\":%.4f,\"busbw_gbs\":%.4f,\"wrong\":%ld,\"iters\":%d}\n",
                   op, ranks, (long)n * 4, n, elmax * 1e6, algbw, algbw * bus, wtotal, iters);
            fflush(stdout);
        }
        free(send);
        free(recv);
    }
    MPI_Finalize();
    return 0;
}
