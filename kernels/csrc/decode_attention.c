/* Decode attention over the paged KV cache, float32, one thread: the CPU backend's kernel
 * (kernels/cpu_attention.py builds and calls it; kernels/reference.py is the ground truth).
 *
 * For every sequence s whose query segment is one token (query_start_loc[s+1] - query_start_loc[s] == 1)
 * and every KV head, the G = Hq / Hkv query heads of that KV head read the sequence's keys straight from
 * the cache blocks its table names -- no gathered copy, no mask tensor:
 *
 *     keys of s:  positions lo .. seq_len-1, block = table[s][pos / B], slot pos % B
 *                 lo = max(0, seq_len - window) for a sliding-window layer (window <= 0: 0)
 *                 a table entry 0 (the null block: evicted) contributes nothing
 *     scores[g][j] = scale * <q[g], k_j>;  p = softmax over j (plus exp(sink[h]) in the denominator
 *     when sinks are given);  out[h] = sum_j p_j v_j;  no visible key -> zeros
 *
 * Sequences with longer segments (prefill chunks) are skipped: their rows are left to the caller.
 * Two passes per (sequence, KV head): scores into a scratch row, then max / exp / sum, then the
 * weighted sum of values (accumulated in registers: D is a constant in the 32/64/128 copies). Layouts: q [T, Hq, D] with strides (q_st, q_sh, 1); caches contiguous
 * [num_blocks, B, Hkv, D]; out contiguous [T, Hq, D]; block_tables int32 [S, bt_stride]. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16 /* query heads per KV head handled in registers; larger groups loop over chunks */

/* One (sequence, KV head): G <= MAX_GROUP query heads q[g] (stride q_sh) over the keys at positions
 * lo..len-1 of `table`. D is a compile-time constant in the specialised copies below, so the dot
 * products and the value accumulation unroll into vector registers. */
#define DEFINE_HEAD(NAME, DCONST)                                                                          \
static void NAME(const float *q, int64_t q_sh, const float *k_cache, const float *v_cache,                \
                 const int32_t *table, int32_t lo, int32_t len, int block, int64_t tok_stride, int hk,    \
                 int g_n, int d_rt, float scale, const float *sinks, float *out, float *scratch) {          \
    const int D = DCONST > 0 ? DCONST : d_rt;                                                              \
    const int64_t cap = len - lo;                                                                          \
    float qs[MAX_GROUP][DCONST > 0 ? DCONST : 256];                                                        \
    for (int g = 0; g < g_n; g++)                                                                          \
        for (int i = 0; i < D; i++) qs[g][i] = q[g * q_sh + i] * scale;                                   \
    int n = 0;                                                                                             \
    for (int32_t pos = lo; pos < len;) {                                                                   \
        const int32_t bi = pos / block;                                                                    \
        const int32_t end = (bi + 1) * block < len ? (bi + 1) * block : len;                               \
        const int32_t blk = table[bi];                                                                     \
        if (blk == 0) { pos = end; continue; }                                                             \
        const float *kb = k_cache + ((int64_t)blk * block) * tok_stride + (int64_t)hk * D;                 \
        for (; pos < end; pos++, n++) {                                                                    \
            const float *kp = kb + (int64_t)(pos % block) * tok_stride;                                    \
            for (int g = 0; g < g_n; g++) {                                                                \
                float acc = 0.0f;                                                                          \
                for (int i = 0; i < D; i++) acc += qs[g][i] * kp[i];                                       \
                scratch[g * cap + n] = acc;                                                                \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    float acc[MAX_GROUP][DCONST > 0 ? DCONST : 256];                                                       \
    for (int g = 0; g < g_n; g++) {                                                                        \
        for (int i = 0; i < D; i++) acc[g][i] = 0.0f;                                                      \
        if (n == 0) continue;                                                                              \
        float *sc = scratch + g * cap;                                                                     \
        float m = sc[0];                                                                                   \
        for (int j = 1; j < n; j++) m = sc[j] > m ? sc[j] : m;                                             \
        const float sink = sinks ? sinks[g] : 0.0f;                                                        \
        if (sinks && sink > m) m = sink;                                                                   \
        float sum = sinks ? expf(sink - m) : 0.0f;                                                         \
        for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }                             \
        const float inv = 1.0f / sum;                                                                      \
        for (int j = 0; j < n; j++) sc[j] *= inv;                                                          \
    }                                                                                                      \
    if (n > 0) {                                                                                           \
        n = 0;                                                                                             \
        for (int32_t pos = lo; pos < len;) {                                                               \
            const int32_t bi = pos / block;                                                                \
            const int32_t end = (bi + 1) * block < len ? (bi + 1) * block : len;                           \
            const int32_t blk = table[bi];                                                                 \
            if (blk == 0) { pos = end; continue; }                                                         \
            const float *vb = v_cache + ((int64_t)blk * block) * tok_stride + (int64_t)hk * D;             \
            for (; pos < end; pos++, n++) {                                                                \
                const float *vp = vb + (int64_t)(pos % block) * tok_stride;                                \
                for (int g = 0; g < g_n; g++) {                                                            \
                    const float p = scratch[g * cap + n];                                                  \
                    for (int i = 0; i < D; i++) acc[g][i] += p * vp[i];                                    \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int g = 0; g < g_n; g++) memcpy(out + (int64_t)g * D, acc[g], sizeof(float) * D);                 \
}

DEFINE_HEAD(head_d32, 32)
DEFINE_HEAD(head_d64, 64)
DEFINE_HEAD(head_d128, 128)
DEFINE_HEAD(head_any, 0)

int sinkserve_decode_attention(const float *q, int64_t q_st, int64_t q_sh,
                               const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride,
                               const int32_t *seq_lens, const int32_t *query_start_loc, int num_seqs,
                               int hq, int hkv, int d, int block, float scale, int window,
                               const float *sinks, float *out, float *scratch, int64_t scratch_len) {
    if (d > 256) return -2;
    const int g_per = hq / hkv;
    const int64_t tok_stride = (int64_t)hkv * d; /* one slot of one block */
    for (int s = 0; s < num_seqs; s++) {
        const int32_t t = query_start_loc[s];
        if (query_start_loc[s + 1] - t != 1) continue;
        const int32_t len = seq_lens[s];
        const int32_t lo = (window > 0 && len > window) ? len - window : 0;
        if ((int64_t)(len - lo) * (g_per < MAX_GROUP ? g_per : MAX_GROUP) > scratch_len) return -1;
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
        for (int hk = 0; hk < hkv; hk++) {
            for (int g0 = 0; g0 < g_per; g0 += MAX_GROUP) {
                const int g_n = g_per - g0 < MAX_GROUP ? g_per - g0 : MAX_GROUP;
                const int h0 = hk * g_per + g0;
                const float *qp = q + t * q_st + h0 * q_sh;
                float *op = out + ((int64_t)t * hq + h0) * d;
                const float *sp = sinks ? sinks + h0 : NULL;
                if (d == 32)
                    head_d32(qp, q_sh, k_cache, v_cache, table, lo, len, block, tok_stride, hk, g_n, d, scale, sp, op, scratch);
                else if (d == 64)
                    head_d64(qp, q_sh, k_cache, v_cache, table, lo, len, block, tok_stride, hk, g_n, d, scale, sp, op, scratch);
                else if (d == 128)
                    head_d128(qp, q_sh, k_cache, v_cache, table, lo, len, block, tok_stride, hk, g_n, d, scale, sp, op, scratch);
                else
                    head_any(qp, q_sh, k_cache, v_cache, table, lo, len, block, tok_stride, hk, g_n, d, scale, sp, op, scratch);
            }
        }
    }
    return 0;
}
