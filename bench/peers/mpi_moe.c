/* The MoE step written with MPI's collectives, as an engine without moex would write it:
 * the peer of `moex bench moe` in bench/peers/moe_compare.sh.
 *
 * Dispatch: each rank packs each of its tokens once per destination rank (the row, then
 * the token's index and its choices on that rank with their router weights), exchanges
 * the row counts with MPI_Alltoall, moves the rows with MPI_Alltoallv, and unpacks them
 * into expert-major blocks (a copy per (token, expert) choice). Combine: each rank sums,
 * weighted, its experts' outputs for every row it received (the experts are the
 * identity, as in moex bench moe's stages alone), sends the partial sums back with
 * MPI_Alltoallv over the same counts, and each token's rank adds the partial sums of its
 * tokens. Rows are f32 (ELEM=4) or bf16 (ELEM=2: packed as bf16, summed in f32).
 *
 * Routing: every token picks K distinct experts out of E (a fixed pseudo-random draw per
 * rank), weights 1/K; experts are placed contiguously, E/P on each rank.
 *
 * Timing as moex bench moe's: every stage starts after a barrier; per step, a stage's
 * time is its slowest rank's; printed as one JSON line of mean, p50 and p99 (us) of each
 * stage over the steps, and the relative error of the combined rows against the tokens
 * (identity experts and weights that sum to 1 give back each token).
 *
 * MPI_MOE_HUGE=1 (passed with mpirun -x) takes the buffers the rows and the partial sums
 * live in (the tokens, the send and receive buffers of both Alltoallvs, the experts'
 * blocks, the output) from 2 MiB pages instead of malloc: the comparison on the pages
 * moex's buffers have.
 *
 * usage: mpirun -np P ./mpi_moe HIDDEN EXPERTS TOPK TOKENS ITERS ELEM */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hugebuf.h"

static int hidden, experts, topk, tokens, elem, P, me, local;

static uint64_t rng_state;
static uint64_t next_rand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float load(const char *p, int i) {
    if (elem == 4) {
        float f;
        memcpy(&f, p + 4 * (size_t)i, 4);
        return f;
    }
    uint16_t v;
    memcpy(&v, p + 2 * (size_t)i, 2);
    return bf16_to_f32(v);
}

static void store(char *p, int i, float f) {
    if (elem == 4) {
        memcpy(p + 4 * (size_t)i, &f, 4);
    } else {
        uint16_t v = f32_to_bf16(f);
        memcpy(p + 2 * (size_t)i, &v, 2);
    }
}

/* A packed row: the activations, then the token index, the number of choices on the
 * destination, and up to topk (local expert, weight) pairs. */
static size_t meta_bytes(void) { return 8 + (size_t)topk * 8; }
static size_t row_bytes(void) { return (size_t)hidden * elem + meta_bytes(); }

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double q) {
    qsort(v, n, sizeof(double), cmp_double);
    int i = (int)ceil(q * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return v[i];
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &P);
    if (argc != 7) {
        if (me == 0) fprintf(stderr, "usage: mpi_moe HIDDEN EXPERTS TOPK TOKENS ITERS ELEM\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    hidden = atoi(argv[1]), experts = atoi(argv[2]), topk = atoi(argv[3]), tokens = atoi(argv[4]);
    int iters = atoi(argv[5]);
    elem = atoi(argv[6]);
    if (experts % P != 0 || topk > experts || (elem != 2 && elem != 4)) {
        if (me == 0) fprintf(stderr, "mpi_moe: experts must divide among the ranks, topk <= experts, elem 2 or 4\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    local = experts / P;
    rng_state = 0x9e3779b97f4a7c15ULL ^ (uint64_t)(me + 1) * 0x100000001b3ULL;
    int *choice = malloc(sizeof(int) * tokens * topk);
    for (int t = 0; t < tokens; t++)
        for (int k = 0; k < topk; k++) {
            int e, dup;
            do {
                e = (int)(next_rand() % experts);
                dup = 0;
                for (int j = 0; j < k; j++) dup |= choice[t * topk + j] == e;
            } while (dup);
            choice[t * topk + k] = e;
        }
    const char *hv = getenv("MPI_MOE_HUGE");
    int huge = hv && strcmp(hv, "1") == 0;
    char *x = buffer((size_t)tokens * hidden * elem + 64, huge);
    for (int t = 0; t < tokens; t++)
        for (int i = 0; i < hidden; i++) store(x + (size_t)t * hidden * elem, i, (float)((t * 7 + i + me) % 13 - 6) / 8);
    size_t rb = row_bytes(), pb = (size_t)hidden * 4; /* partial sums travel in f32 */
    int *scount = calloc(P, sizeof(int)), *rcount = calloc(P, sizeof(int));
    int *sdispl = calloc(P, sizeof(int)), *rdispl = calloc(P, sizeof(int));
    int *sbytes = calloc(P, sizeof(int)), *rbytes = calloc(P, sizeof(int));
    int *sboff = calloc(P, sizeof(int)), *rboff = calloc(P, sizeof(int));
    int *fill = calloc(P, sizeof(int)), *dest = malloc(sizeof(int) * tokens * P);
    char *sendb = buffer(rb * tokens * P + 64, huge);
    char *recvb = NULL, *expin = NULL, *partial = NULL, *back = buffer(pb * tokens * P + 64, huge);
    float *out = buffer(sizeof(float) * (size_t)tokens * hidden + 64, huge);
    size_t recv_cap = 0, exp_cap = 0;
    double *tdisp = malloc(sizeof(double) * iters), *tcomb = malloc(sizeof(double) * iters);
    int *ecount = calloc(local, sizeof(int)), *eoff = calloc(local + 1, sizeof(int));
    double err = 0;
    for (int it = -3; it < iters; it++) {
        /* ---- dispatch ---- */
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        memset(scount, 0, sizeof(int) * P);
        for (int t = 0; t < tokens; t++)
            for (int q = 0; q < P; q++) {
                int has = 0;
                for (int k = 0; k < topk; k++) has |= choice[t * topk + k] / local == q;
                dest[t * P + q] = has;
                scount[q] += has;
            }
        for (int q = 0, off = 0; q < P; q++) sdispl[q] = off, off += scount[q], fill[q] = 0;
        for (int t = 0; t < tokens; t++)
            for (int q = 0; q < P; q++) {
                if (!dest[t * P + q]) continue;
                char *row = sendb + rb * (size_t)(sdispl[q] + fill[q]++);
                memcpy(row, x + (size_t)t * hidden * elem, (size_t)hidden * elem);
                int32_t *m = (int32_t *)(row + (size_t)hidden * elem);
                m[0] = t, m[1] = 0;
                for (int k = 0; k < topk; k++) {
                    int e = choice[t * topk + k];
                    if (e / local != q) continue;
                    float w = 1.0f / topk;
                    m[2 + 2 * m[1]] = e % local;
                    memcpy(&m[3 + 2 * m[1]], &w, 4);
                    m[1]++;
                }
            }
        MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
        int nrecv = 0;
        for (int q = 0; q < P; q++) {
            rdispl[q] = nrecv, nrecv += rcount[q];
            sbytes[q] = (int)(scount[q] * rb), sboff[q] = (int)(sdispl[q] * rb);
            rbytes[q] = (int)(rcount[q] * rb), rboff[q] = (int)(rdispl[q] * rb);
        }
        if ((size_t)nrecv * rb > recv_cap) {
            size_t rows = recv_cap / rb;
            recvb = rebuffer(recvb, recv_cap + 64, (size_t)nrecv * rb + 64, huge);
            partial = rebuffer(partial, rows * pb + 64, (size_t)nrecv * pb + 64, huge);
            recv_cap = (size_t)nrecv * rb;
        }
        MPI_Alltoallv(sendb, sbytes, sboff, MPI_BYTE, recvb, rbytes, rboff, MPI_BYTE, MPI_COMM_WORLD);
        /* Unpack into expert-major blocks: a copy per (row, local expert). */
        memset(ecount, 0, sizeof(int) * local);
        for (int i = 0; i < nrecv; i++) {
            int32_t *m = (int32_t *)(recvb + rb * i + (size_t)hidden * elem);
            for (int c = 0; c < m[1]; c++) ecount[m[2 + 2 * c]]++;
        }
        for (int e = 0; e < local; e++) eoff[e + 1] = eoff[e] + ecount[e];
        if ((size_t)eoff[local] * hidden * elem > exp_cap) {
            expin = rebuffer(expin, exp_cap + 64, (size_t)eoff[local] * hidden * elem + 64, huge);
            exp_cap = (size_t)eoff[local] * hidden * elem;
        }
        memset(ecount, 0, sizeof(int) * local);
        for (int i = 0; i < nrecv; i++) {
            char *row = recvb + rb * i;
            int32_t *m = (int32_t *)(row + (size_t)hidden * elem);
            for (int c = 0; c < m[1]; c++) {
                int e = m[2 + 2 * c];
                memcpy(expin + (size_t)(eoff[e] + ecount[e]++) * hidden * elem, row, (size_t)hidden * elem);
            }
        }
        double td = MPI_Wtime() - t0;
        /* ---- experts: the identity (their outputs are expin) ---- */
        /* ---- combine ---- */
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        memset(ecount, 0, sizeof(int) * local);
        for (int i = 0; i < nrecv; i++) {
            int32_t *m = (int32_t *)(recvb + rb * i + (size_t)hidden * elem);
            float *ps = (float *)(partial + pb * i);
            memset(ps, 0, pb);
            for (int c = 0; c < m[1]; c++) {
                int e = m[2 + 2 * c];
                float w;
                memcpy(&w, &m[3 + 2 * c], 4);
                const char *y = expin + (size_t)(eoff[e] + ecount[e]++) * hidden * elem;
                for (int j = 0; j < hidden; j++) ps[j] += w * load(y, j);
            }
        }
        for (int q = 0; q < P; q++) {
            sbytes[q] = (int)(rcount[q] * pb), sboff[q] = (int)(rdispl[q] * pb);
            rbytes[q] = (int)(scount[q] * pb), rboff[q] = (int)(sdispl[q] * pb);
        }
        MPI_Alltoallv(partial, sbytes, sboff, MPI_BYTE, back, rbytes, rboff, MPI_BYTE, MPI_COMM_WORLD);
        memset(out, 0, sizeof(float) * (size_t)tokens * hidden);
        for (int q = 0; q < P; q++) fill[q] = 0;
        for (int t = 0; t < tokens; t++)
            for (int q = 0; q < P; q++) {
                if (!dest[t * P + q]) continue;
                const float *ps = (const float *)(back + pb * (size_t)(sdispl[q] + fill[q]++));
                float *o = out + (size_t)t * hidden;
                for (int j = 0; j < hidden; j++) o[j] += ps[j];
            }
        double tc = MPI_Wtime() - t0;
        double tmax[2], tl[2] = {td, tc};
        MPI_Allreduce(tl, tmax, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it >= 0) tdisp[it] = tmax[0] * 1e6, tcomb[it] = tmax[1] * 1e6;
    }
    double num = 0, den = 0;
    for (int t = 0; t < tokens; t++)
        for (int j = 0; j < hidden; j++) {
            double want = load(x + (size_t)t * hidden * elem, j), d = out[(size_t)t * hidden + j] - want;
            num += d * d, den += want * want;
        }
    double sums[2] = {num, den}, tot[2];
    MPI_Reduce(sums, tot, 2, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (me == 0) {
        double md = 0, mc = 0;
        for (int i = 0; i < iters; i++) md += tdisp[i], mc += tcomb[i];
        md /= iters, mc /= iters;
        err = tot[1] > 0 ? sqrt(tot[0] / tot[1]) : 0;
        double d50 = pct(tdisp, iters, 0.5), d99 = pct(tdisp, iters, 0.99);
        double c50 = pct(tcomb, iters, 0.5), c99 = pct(tcomb, iters, 0.99);
        printf("{\"peer\":\"mpi\",\"huge\":%d,\"ranks\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,\"tokens\":%d,\"elem\":%d,\"iters\":%d,"
               "\"dispatch\":{\"mean_us\":%.2f,\"p50_us\":%.2f,\"p99_us\":%.2f},\"combine\":{\"mean_us\":%.2f,\"p50_us\":%.2f,\"p99_us\":%.2f},"
               "\"error\":%.3g}\n",
               huge, P, hidden, experts, topk, tokens, elem, iters, md, d50, d99, mc, c50, c99, err);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
