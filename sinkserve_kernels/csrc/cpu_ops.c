/* Small fused float32 CPU ops of the native forward (sinkserve_kernels/cpu_attention.py builds and calls them),
 * each one call where torch issues several kernels on a few hundred floats:
 *
 *   rms_norm:      out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w          (7 ATen ops in torch 2.13 on CPU)
 *   add_rms_norm:  h[t] += r[t]; out[t] = rms_norm(h[t])                  (the residual add fused in)
 *   write_kv:      k_cache[slot[t]] = k[t], v_cache[slot[t]] = v[t]; slot < 0 skipped (no mask, no sync);
 *                  a slot past the cache writes nothing and returns -1. With fp_index (a packed cache,
 *                  sinkserve_kernels/kv_quant.py): slot = block * B + off goes to the 16-bit pool's slot
 *                  fp_index[block] * B + off, and a token of a packed block (fp_index < 0) is skipped
 *   greedy:        token[r] = argmax(logits[r]) (the first of equal maxima, as torch.argmax),
 *                  logprob[r] = logits[r, token] - logsumexp(logits[r])  (argmax + log_softmax + gather)
 *
 * Rows are contiguous in their last dimension; strides are in elements. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rms_row.h"

void sinkserve_rms_norm(const float *x, int64_t x_st, const float *w, float *out, int64_t rows, int n, float eps) {
    for (int64_t t = 0; t < rows; t++) norm_row(x + t * x_st, w, out + t * n, n, eps);
}

void sinkserve_add_rms_norm(float *h, const float *r, int64_t r_st, const float *w, float *out, int64_t rows, int n,
                            float eps) {
    for (int64_t t = 0; t < rows; t++) {
        float *hr = h + t * n;
        const float *rr = r + t * r_st;
        for (int i = 0; i < n; i++) hr[i] += rr[i];
        norm_row(hr, w, out + t * n, n, eps);
    }
}

int sinkserve_write_kv(const float *k, int64_t k_st, int64_t k_sh, const float *v, int64_t v_st, int64_t v_sh,
                       float *k_cache, float *v_cache, const int64_t *slots, int64_t rows, int hkv, int d,
                       int64_t num_slots, const int32_t *fp_index, int block, int64_t num_fp_slots) {
    const int64_t slot_elems = (int64_t)hkv * d;
    /* Checked before any write: an error leaves the cache as it was. */
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] >= num_slots) return -1;
        if (fp_index && slots[t] >= 0 && (int64_t)fp_index[slots[t] / block] * block >= num_fp_slots) return -1;
    }
    for (int64_t t = 0; t < rows; t++) {
        int64_t s = slots[t];
        if (s < 0) continue;
        if (fp_index) { /* a packed cache: the token's block lives in the 16-bit pool, or is immutable */
            const int32_t f = fp_index[s / block];
            if (f < 0) continue;
            s = (int64_t)f * block + s % block;
        }
        for (int h = 0; h < hkv; h++) {
            memcpy(k_cache + s * slot_elems + (int64_t)h * d, k + t * k_st + h * k_sh, sizeof(float) * d);
            memcpy(v_cache + s * slot_elems + (int64_t)h * d, v + t * v_st + h * v_sh, sizeof(float) * d);
        }
    }
    return 0;
}

void sinkserve_greedy(const float *logits, int64_t rows, int64_t vocab, int64_t *token, float *logprob) {
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        int64_t best = 0;
        float m = x[0];
        for (int64_t i = 1; i < vocab; i++)
            if (x[i] > m) { m = x[i]; best = i; }
        /* float partial sums over chunks (vectorised expf), added in double: a 150k vocabulary summed
         * in one float loses digits the reference keeps */
        double sum = 0.0;
        for (int64_t c = 0; c < vocab; c += 1024) {
            const int64_t end = c + 1024 < vocab ? c + 1024 : vocab;
            float part = 0.0f;
            for (int64_t i = c; i < end; i++) part += expf(x[i] - m);
            sum += part;
        }
        token[r] = best;
        logprob[r] = (float)(-log(sum));
    }
}
