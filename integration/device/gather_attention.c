/* vtoken's fused attention over live slots, for every query of a step (gather_attention.py builds and calls it).

   Per (query, KV head): the KV head's G query heads score every live key of the query's request that is at or
   before the query by logical id, take a softmax and sum the values, reading K and V where they lie in the
   paged cache (no gathered copy). Decode queries and prefill chunks alike, on the OpenMP threads torch uses.

   NOTE: every query's result is a function of its request's live tokens' values in logical order only: keys are
   visited in the order of `slots`, keys it does not attend add nothing, and the arithmetic depends on neither the
   slots' positions nor the other queries nor the thread that runs it. That is what keeps lazy compaction
   bit-identical to Naive-Evict on the gather path: they place the same tokens at different slots.

   Memory safety: before anything is read, every query's request must be a row of `slots`, and every slot that is
   not padding (its id is PAD) must lie in [0, blocks * S); else nothing is computed (return 1 or 3). */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define LANES 8   /* partial sums per dot product: fixed, so the order of every sum is fixed */
#define MAX_D 512
#define MAX_G 64
#define PAD INT64_MAX

typedef struct {
    const float *k, *v;        /* element (block, offset, head, d) at p + block*s[0] + offset*s[1] + head*s[2] + d*s[3] */
    int64_t ks[4], vs[4];
    const int64_t *slots;      /* [R, N] each request's live slots in logical order, padded */
    const int64_t *ids;        /* [R, N] their logical ids; PAD for padding */
    const int64_t *qreq;       /* [Q] each query's request (row of slots) */
    const int64_t *qpos;       /* [Q] its logical position: it attends the ids <= qpos */
    const float *q;            /* [Q, H, D] contiguous */
    float *out;                /* [Q, H, D] contiguous, or 0: weights only */
    const int64_t *wrow;       /* [Q] where query i's weights go in `weights` (-1: nowhere), or 0 */
    float *weights;            /* [W, H, N] contiguous: softmax weights, 0 where not attended */
    float *scratch;            /* [threads, G, N] */
    int64_t R, N, Q, H, KVH, D, S, blocks, threads;
    float scale;
} Job;

static void one_pair(const Job *j, int64_t i, int64_t h, float *s) {
    const int64_t G = j->H / j->KVH, N = j->N, D = j->D, r = j->qreq[i], pos = j->qpos[i];
    const int64_t *slots = j->slots + r * N, *ids = j->ids + r * N;
    const float *q = j->q + (i * j->H + h * G) * D;
    float kt[MAX_D], m[MAX_G], sum[MAX_G];
    for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; sum[g] = 0.0f; }
    for (int64_t n = 0; n < N; n++) {
        if (ids[n] > pos) { for (int64_t g = 0; g < G; g++) s[g * N + n] = -INFINITY; continue; }
        const float *k = j->k + (slots[n] / j->S) * j->ks[0] + (slots[n] % j->S) * j->ks[1] + h * j->ks[2];
        for (int64_t d = 0; d < D; d++) kt[d] = k[d * j->ks[3]];
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float acc[LANES] = {0};
            for (int64_t d = 0; d < D; d += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += qg[d + l] * kt[d + l];
            float dot = 0.0f;
            for (int l = 0; l < LANES; l++) dot += acc[l];
            s[g * N + n] = dot * j->scale;
            if (s[g * N + n] > m[g]) m[g] = s[g * N + n];
        }
    }
    const int64_t w = j->wrow ? j->wrow[i] : -1;
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * N;
        for (int64_t n = 0; n < N; n++) { sg[n] = ids[n] <= pos ? expf(sg[n] - m[g]) : 0.0f; sum[g] += sg[n]; }
        const float inv = 1.0f / sum[g];
        for (int64_t n = 0; n < N; n++) sg[n] *= inv;
        if (w >= 0)
            for (int64_t n = 0; n < N; n++) j->weights[(w * j->H + h * G + g) * N + n] = sg[n];
        if (!j->out) continue;  /* weights only (the dense path's score pass) */
        float *o = j->out + (i * j->H + h * G + g) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t n = 0; n < N; n++) {
            if (ids[n] > pos) continue;
            const float *v = j->v + (slots[n] / j->S) * j->vs[0] + (slots[n] % j->S) * j->vs[1] + h * j->vs[2];
            const float wn = sg[n];
            if (j->vs[3] == 1) { for (int64_t d = 0; d < D; d++) o[d] += wn * v[d]; }
            else { for (int64_t d = 0; d < D; d++) o[d] += wn * v[d * j->vs[3]]; }
        }
    }
}

int vtoken_gather_attention(const Job *j) {
    if (j->D < LANES || j->D % LANES || j->D > MAX_D || j->KVH < 1 || j->H % j->KVH || j->H / j->KVH > MAX_G
            || j->threads < 1)
        return 2;
    for (int64_t i = 0; i < j->Q; i++)
        if (j->qreq[i] < 0 || j->qreq[i] >= j->R) return 3;
    const int64_t limit = j->blocks * j->S;
    for (int64_t e = 0; e < j->R * j->N; e++)
        if (j->ids[e] != PAD && (j->slots[e] < 0 || j->slots[e] >= limit)) return 1;
    const int64_t pairs = j->Q * j->KVH, G = j->H / j->KVH;
#pragma omp parallel for schedule(static) num_threads(j->threads)
    for (int64_t p = 0; p < pairs; p++)
        one_pair(j, p / j->KVH, p % j->KVH, j->scratch + omp_get_thread_num() * G * j->N);
    return 0;
}
