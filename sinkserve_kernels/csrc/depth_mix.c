/* One Attention-Residuals depth mix for all of a step's tokens in one call, float32, one thread
 * (sinkserve_kernels/depth_mix.py calls it; its torch path is the reference; engine/models/attnres.py explains
 * the buffers). Per token t, with R = Q + D + 1 floats per slot row:
 *
 *     src   [T, S, R]   slot row = raw dots with every pseudo-query (Q) | values (D) | c
 *     logit [Q, T, S]   logit[q][t][s] = dots_q / |[values, c]| of slot s (c = sqrt(D eps): the rms floor)
 *
 *   1. the slot just written (`slot`): its norm |[v, c]| (the D + 1 columns after the dots), and its
 *      logits for every query, logit[q][t][slot] = dots[q] * (1 / norm)
 *   2. mix `query` over the live slots 0..slot:  p = softmax_s logit[query][t][s]
 *   3. x[t] = sum_s p_s values[t][s]                                   (the mix itself)
 *   4. x[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w                      (the next sub-layer's RMSNorm)
 *
 * Slots past `slot` are never read (the torch path keeps them at -inf instead, which -ffast-math code
 * must not see). x is contiguous [T, D]. */
#include <math.h>
#include <stdint.h>

void sinkserve_depth_mix(const float *src, float *logit, const float *w, float *x, int64_t rows, int slots, int q_n,
                         int d, int slot, int query, float eps) {
    const int64_t r = (int64_t)q_n + d + 1, tok = (int64_t)slots * r, plane = rows * slots;
    for (int64_t t = 0; t < rows; t++) {
        const float *row = src + t * tok + slot * r;
        float ss = 0.0f;
        for (int i = 0; i <= d; i++) ss += row[q_n + i] * row[q_n + i];
        const float inv = 1.0f / sqrtf(ss);
        float *lg = logit + t * slots; /* logit[q][t][s] = lg[q * plane + s] */
        for (int q = 0; q < q_n; q++) lg[q * plane + slot] = row[q] * inv;

        const float *l = lg + query * plane;
        float m = l[0];
        for (int s = 1; s <= slot; s++) m = l[s] > m ? l[s] : m;
        float p[slot + 1], sum = 0.0f;
        for (int s = 0; s <= slot; s++) sum += (p[s] = expf(l[s] - m));
        const float scale = 1.0f / sum;

        float *xt = x + t * d;
        const float *v = src + t * tok + q_n;
        const float p0 = p[0] * scale;
        for (int i = 0; i < d; i++) xt[i] = p0 * v[i];
        for (int s = 1; s <= slot; s++) {
            const float ps = p[s] * scale;
            const float *vs = v + s * r;
            for (int i = 0; i < d; i++) xt[i] += ps * vs[i];
        }
        float sx = 0.0f;
        for (int i = 0; i < d; i++) sx += xt[i] * xt[i];
        const float rn = 1.0f / sqrtf(sx / (float)d + eps);
        for (int i = 0; i < d; i++) xt[i] = (xt[i] * rn) * w[i];
    }
}
