/* The whole decode step of the native Llama-family forward in one call, float32, one thread
 * (kernels/cpu_decode.py builds the arguments and calls it; engine/models/llama.py LlamaForward.forward,
 * the eager torch forward, is the ground truth it is tested against).
 *
 * Why: with one token per sequence and a small batch, the eager step is ~20 ATen calls and their Python
 * per layer, each a few microseconds, around matrix-vector products that take about as long. Here the
 * same arithmetic runs without leaving C:
 *
 *   h[t] = embed[ids[t]]                                      (the residual stream, [T, H])
 *   per layer l:
 *     x = rms_norm(h, input_norm)
 *     qkv = x W_qkv^T (+ b)        -> q [Hq, D] | k [Hkv, D] | v [Hkv, D] per token
 *     (Qwen3) q, k = rms_norm per head (qk_norm [Hq + Hkv, D])
 *     q, k = rope(q, k; positions[t])   cos/sin = cos/sin(pos * inv_freq) * scaling, rotate-half form
 *     k_cache[slot[t]], v_cache[slot[t]] = k, v                (slot < 0: not written)
 *     a = sinkserve_decode_attention(q; the paged cache, window[l])      (decode_attention.c)
 *     h += a W_o^T (+ b);  x = rms_norm(h, post_norm)
 *     gu = x W_gate_up^T (+ b);  m = silu(gate) * up;  h += m W_down^T (+ b)
 *   logits[r] = rms_norm(h[logit_rows[r]], final_norm) lm_head^T
 *
 * Every query segment must be one token (query_start_loc = 0, 1, .., T). Weights are [out, in] row-major,
 * contiguous; caches contiguous [num_blocks, B, Hkv, D]. The per-layer pointers come as one int64 table
 * [L, LAYER_FIELDS] (field order below; 0 = absent). Returns 0, or < 0 before writing anything when an
 * argument is out of range (-1 a slot past the cache, -3 a token id past the vocabulary, -4 no memory),
 * or the attention kernel's error code minus 10 (-11 scratch too small, -12 head_dim over 256). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F_IN_NORM, F_POST_NORM, F_QKV_W, F_QKV_B, F_O_W, F_O_B, F_QK_NORM, F_GU_W, F_GU_B, F_DOWN_W, F_DOWN_B,
       F_K_CACHE, F_V_CACHE, F_WINDOW, LAYER_FIELDS };

int sinkserve_decode_attention(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d, int block,
                               float scale, int window, const float *sinks, float *out, float *scratch,
                               int64_t scratch_len);

#include "rms_row.h"

/* y[t][o] = x[t] . w[o] (+ b[o]) for rows t; four output rows at a time, so each input row is read once
 * per four weight rows and the four dot products vectorise side by side. */
static void linear(const float *x, int64_t rows, int in, const float *w, const float *b, int out, float *y) {
    int o = 0;
    for (; o + 4 <= out; o += 4) {
        const float *w0 = w + (int64_t)o * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
        for (int64_t t = 0; t < rows; t++) {
            const float *xr = x + t * in;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (int i = 0; i < in; i++) {
                const float xi = xr[i];
                a0 += w0[i] * xi;
                a1 += w1[i] * xi;
                a2 += w2[i] * xi;
                a3 += w3[i] * xi;
            }
            float *yr = y + t * out + o;
            yr[0] = a0; yr[1] = a1; yr[2] = a2; yr[3] = a3;
            if (b) { yr[0] += b[o]; yr[1] += b[o + 1]; yr[2] += b[o + 2]; yr[3] += b[o + 3]; }
        }
    }
    for (; o < out; o++) {
        const float *wr = w + (int64_t)o * in;
        for (int64_t t = 0; t < rows; t++) {
            const float *xr = x + t * in;
            float a = 0.0f;
            for (int i = 0; i < in; i++) a += wr[i] * xr[i];
            y[t * out + o] = b ? a + b[o] : a;
        }
    }
}

/* x [n_heads, D] rotated in place: x*cos + rotate_half(x)*sin, rotate_half(x) = cat(-x2, x1). */
static void rope_heads(float *x, int n_heads, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (int64_t)h * d;
        for (int i = 0; i < half; i++) {
            const float a = xh[i], b = xh[i + half];
            xh[i] = a * cos[i] - b * sin[i];
            xh[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

#define PTR(layer, f) ((const float *)(intptr_t)(layer)[f])

int sinkserve_llama_decode(const int64_t *layers, int num_layers, const float *embed, const float *final_norm,
                           const float *lm_head, const float *inv_freq, float rope_scaling, int hidden, int inter,
                           int hq, int hkv, int d, int vocab, float eps, float scale, int block,
                           const int64_t *input_ids, const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *starts, int rows, int64_t num_slots, const int64_t *logit_rows,
                           int n_logits, float *logits) {
    for (int t = 0; t < rows; t++) {
        if (slots[t] >= num_slots) return -1;
        if (input_ids[t] < 0 || input_ids[t] >= vocab) return -3;
    }
    const int qkv_n = (hq + 2 * hkv) * d, g_per = hq / hkv;
    int32_t longest = 1;
    for (int t = 0; t < rows; t++) longest = seq_lens[t] > longest ? seq_lens[t] : longest;
    const int64_t scratch_len = (int64_t)longest * (g_per < 16 ? g_per : 16);
    const int64_t per_row = 2 * (int64_t)hidden + qkv_n + (int64_t)hq * d + hidden + 3 * (int64_t)inter + 2 * d;
    float *work = malloc(sizeof(float) * ((size_t)rows * per_row + (size_t)scratch_len));
    if (!work) return -4;
    float *h = work, *x = h + (int64_t)rows * hidden, *qkv = x + (int64_t)rows * hidden;
    float *att = qkv + (int64_t)rows * qkv_n, *o = att + (int64_t)rows * hq * d;
    float *gu = o + (int64_t)rows * hidden, *act = gu + (int64_t)rows * 2 * inter;
    float *cs = act + (int64_t)rows * inter, *scratch = cs + (int64_t)rows * 2 * d;
    const int half = d / 2;

    for (int t = 0; t < rows; t++) {
        memcpy(h + (int64_t)t * hidden, embed + input_ids[t] * (int64_t)hidden, sizeof(float) * hidden);
        float *c = cs + (int64_t)t * 2 * d, *s = c + d;
        for (int i = 0; i < half; i++) { /* float32 angles, as transformers computes them */
            const float ang = (float)positions[t] * inv_freq[i];
            c[i] = c[i + half] = cosf(ang) * rope_scaling;
            s[i] = s[i + half] = sinf(ang) * rope_scaling;
        }
    }
    int rc = 0;
    for (int l = 0; l < num_layers && rc == 0; l++) {
        const int64_t *L = layers + (int64_t)l * LAYER_FIELDS;
        for (int t = 0; t < rows; t++) norm_row(h + (int64_t)t * hidden, PTR(L, F_IN_NORM), x + (int64_t)t * hidden, hidden, eps);
        linear(x, rows, hidden, PTR(L, F_QKV_W), PTR(L, F_QKV_B), qkv_n, qkv);
        float *k_cache = (float *)(intptr_t)L[F_K_CACHE], *v_cache = (float *)(intptr_t)L[F_V_CACHE];
        const float *qk_norm = PTR(L, F_QK_NORM);
        for (int t = 0; t < rows; t++) {
            float *row = qkv + (int64_t)t * qkv_n; /* q heads, then k heads: adjacent, as qk_norm's rows */
            if (qk_norm)
                for (int hd = 0; hd < hq + hkv; hd++) norm_row(row + (int64_t)hd * d, qk_norm + (int64_t)hd * d, row + (int64_t)hd * d, d, eps);
            const float *c = cs + (int64_t)t * 2 * d;
            rope_heads(row, hq + hkv, d, c, c + d);
            if (slots[t] >= 0) {
                const int64_t off = slots[t] * (int64_t)hkv * d;
                memcpy(k_cache + off, row + (int64_t)hq * d, sizeof(float) * hkv * d);
                memcpy(v_cache + off, row + (int64_t)(hq + hkv) * d, sizeof(float) * hkv * d);
            }
        }
        rc = sinkserve_decode_attention(qkv, qkv_n, d, k_cache, v_cache, block_tables, bt_stride, seq_lens, starts,
                                        rows, hq, hkv, d, block, scale, (int)L[F_WINDOW], NULL, att, scratch,
                                        scratch_len);
        if (rc != 0) { rc -= 10; break; } /* the attention kernel's code, shifted out of this file's range */
        linear(att, rows, hq * d, PTR(L, F_O_W), PTR(L, F_O_B), hidden, o);
        for (int t = 0; t < rows; t++) {
            float *hr = h + (int64_t)t * hidden;
            const float *orow = o + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) hr[i] += orow[i];
            norm_row(hr, PTR(L, F_POST_NORM), x + (int64_t)t * hidden, hidden, eps);
        }
        linear(x, rows, hidden, PTR(L, F_GU_W), PTR(L, F_GU_B), 2 * inter, gu);
        for (int t = 0; t < rows; t++) {
            const float *g = gu + (int64_t)t * 2 * inter, *u = g + inter;
            float *a = act + (int64_t)t * inter;
            for (int i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        linear(act, rows, inter, PTR(L, F_DOWN_W), PTR(L, F_DOWN_B), hidden, o);
        for (int t = 0; t < rows; t++) {
            float *hr = h + (int64_t)t * hidden;
            const float *orow = o + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) hr[i] += orow[i];
        }
    }
    if (rc == 0) {
        for (int r = 0; r < n_logits; r++)
            norm_row(h + logit_rows[r] * (int64_t)hidden, final_norm, x + (int64_t)r * hidden, hidden, eps);
        linear(x, n_logits, hidden, lm_head, NULL, vocab, logits);
    }
    free(work);
    return rc;
}
