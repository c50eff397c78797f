/* The MPI side of the moex-vs-MPI comparison (Open MPI or MPICH, whichever mpicc built it):
 * MPI_Allreduce (f32 sum), MPI_Reduce_scatter_block (f32 sum), MPI_Allgather and
 * MPI_Alltoall, measured the way `moex bench coll` measures (warm-up, an iteration count
 * agreed from a timed probe, a barrier, a tenth as many untimed operations after it, the
 * slowest rank's mean time, a check of the last result), and printed as the same JSON
 * fields as `moex bench coll --json`, with "transport" the library's name.
 *
 * BYTES is moex bench coll's size: the buffer (AllReduce), the send buffer
 * (ReduceScatter), the receive buffer (AllGather, AlltoAll).
 *
 * usage: mpirun -np P ./mpi_coll allreduce|reducescatter|allgather|alltoall MIN_BYTES MAX_BYTES
 * MPI_COLL_ITERS=N (passed with mpirun -x) times N operations instead, as moex bench coll
 * --iters N does. MPI_COLL_HUGE=1 takes the buffers from 2 MiB pages (mappings 2 MiB aligned,
 * MADV_HUGEPAGE), as moex's obuf gives its buffers from 256 KiB, instead of malloc: the
 * comparison on equal pages. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "hugebuf.h"

enum { ALLREDUCE, REDUCESCATTER, ALLGATHER, ALLTOALL };

/* run times one operation on n floats of the size's buffer. */
static double run(int op, float *send, float *recv, int n, int ranks, MPI_Comm comm) {
    double t = MPI_Wtime();
    switch (op) {
    case ALLREDUCE: MPI_Allreduce(send, recv, n, MPI_FLOAT, MPI_SUM, comm); break;
    case REDUCESCATTER: MPI_Reduce_scatter_block(send, recv, n / ranks, MPI_FLOAT, MPI_SUM, comm); break;
    case ALLGATHER: MPI_Allgather(send, n / ranks, MPI_FLOAT, recv, n / ranks, MPI_FLOAT, comm); break;
    default: MPI_Alltoall(send, n / ranks, MPI_FLOAT, recv, n / ranks, MPI_FLOAT, comm);
    }
    return MPI_Wtime() - t;
}

/* value is element i of rank r's send buffer. */
static float value(int op, int r, int i) {
    return op == ALLTOALL || op == ALLGATHER ? (float)(r * 1000003 + i) : (float)((r + i) % 7 - 3);
}

/* wrongs counts the elements of recv that are not what op must leave on rank r. */
static long wrongs(int op, const float *recv, int n, int r, int ranks) {
    long wrong = 0;
    int blk = n / ranks;
    switch (op) {
    case ALLTOALL:
        for (int q = 0; q < ranks; q++)
            for (int k = 0; k < blk; k++)
                if (recv[q * blk + k] != value(op, q, r * blk + k)) wrong++;
        break;
    case ALLGATHER:
        for (int q = 0; q < ranks; q++)
            for (int k = 0; k < blk; k++)
                if (recv[q * blk + k] != value(op, q, k)) wrong++;
        break;
    default: {
        int lo = op == REDUCESCATTER ? r * blk : 0, len = op == REDUCESCATTER ? blk : n;
        for (int i = 0; i < len; i++) {
            float want = 0;
            for (int q = 0; q < ranks; q++) want += value(op, q, lo + i);
            if (recv[i] != want) wrong++;
        }
    }
    }
    return wrong;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, ranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    static const char *names[] = {"allreduce", "reducescatter", "allgather", "alltoall"};
    int op = -1;
    for (int i = 0; argc == 4 && i < 4; i++)
        if (strcmp(argv[1], names[i]) == 0) op = i;
    if (op < 0) {
        if (rank == 0) fprintf(stderr, "usage: mpi_coll allreduce|reducescatter|allgather|alltoall MIN MAX\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    char lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int liblen;
    MPI_Get_library_version(lib, &liblen);
    const char *name = strstr(lib, "MPICH") ? "mpich" : strstr(lib, "Open MPI") ? "openmpi" : "mpi";
    long minb = atol(argv[2]), maxb = atol(argv[3]);
    const char *hv = getenv("MPI_COLL_HUGE");
    int huge = hv && strcmp(hv, "1") == 0;
    for (long bytes = minb; bytes <= maxb; bytes *= 2) {
        int n = (int)(bytes / 4);
        if (op != ALLREDUCE) n = n / ranks * ranks;
        int sendn = op == ALLGATHER ? n / ranks : n, recvn = op == REDUCESCATTER ? n / ranks : n;
        float *send = buffer((size_t)sendn * 4 + 64, huge), *recv = buffer((size_t)recvn * 4 + 64, huge);
        if (!send || !recv) MPI_Abort(MPI_COMM_WORLD, 3);
        for (int i = 0; i < sendn; i++) send[i] = value(op, rank, i);
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
        long wrong = wrongs(op, recv, n, rank, ranks), wtotal = 0;
        MPI_Allreduce(&wrong, &wtotal, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = (double)n * 4 / elmax / 1e9;
            double bus = op == ALLREDUCE ? 2.0 * (ranks - 1) / ranks : (double)(ranks - 1) / ranks;
            printf("{\"op\":\"%s\",\"ranks\":%d,\"transport\":\"%s\",\"bytes\":%ld,\"count\":%d,\"dtype\":\"f32\","
                   "\"algo\":\"%s\",\"time_us\":%.3f,\"algbw_gbs\":%.4f,\"busbw_gbs\":%.4f,\"wrong\":%ld,\"iters\":%d}\n",
                   names[op], ranks, name, (long)n * 4, recvn, name, elmax * 1e6, algbw, algbw * bus, wtotal, iters);
            fflush(stdout);
        }
        unbuffer(send, (size_t)sendn * 4 + 64, huge);
        unbuffer(recv, (size_t)recvn * 4 + 64, huge);
    }
    MPI_Finalize();
    return 0;
}
