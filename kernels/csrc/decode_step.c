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
 * Every query segment must be one token (query_start_loc = 0, 1, .., T). The linear weights and lm_head
 * come packed by sinkserve_pack_linear (below); embedding and norm weights as they are, contiguous;
 * caches contiguous [num_blocks, B, Hkv, D]. The per-layer pointers come as one int64 table
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

/* The linear layers read their weights packed in panels of PW output rows, transposed:
 *
 *     W [out, in] row-major                    packed [ceil(out / PW), in, PW]
 *     panel j holds outputs j*PW .. j*PW+PW-1:  packed[j][i][r] = W[j*PW + r][i]   (0 past out)
 *
 *   e.g. PW = 16, W [40, 256]: panels 0, 1 full; panel 2 = rows 32..39 and 8 zero columns.
 *
 * so the product is an outer-product GEMM: for each input index i, one vector of PW weights times the
 * broadcast x[t][i] of each row t of a tile accumulates into registers. A tile of TILE_ROWS rows x two
 * panels keeps 2 * TILE_ROWS accumulators, reads each weight vector once per tile and each x element
 * once per panel pair, and needs no horizontal sums. (The row-at-a-time dot products this replaces
 * reached ~35-50 GFLOP/s at 8-32 rows; the tiles ~75-93 on the development host's AVX-512, a matmul's
 * rate; at one row both stream the weights.) While the first row tile of a panel pair runs, the next pair
 * is prefetched into L2 (prefetcht1), a line per input index: the weights come from L3 or memory every
 * step, and this VM's hardware prefetch alone left the linears ~17 % slower at c=32. PW is one vector:
 * 16 floats with AVX-512, else 8, and GCC's vector extensions compile the same source for either. */
#if defined(__AVX512F__)
#define PW 16
#else
#define PW 8
#endif
#define TILE_ROWS 6
typedef float vf __attribute__((vector_size(PW * sizeof(float))));
typedef float vf_u __attribute__((vector_size(PW * sizeof(float)), aligned(4))); /* unaligned access */

static inline vf vload(const float *p) { return *(const vf_u *)p; }

int sinkserve_pack_width(void) { return PW; }

/* packed (ceil(out / PW) * in * PW floats) <- w [out, in]. */
void sinkserve_pack_linear(const float *w, int out, int in, float *packed) {
    for (int j = 0; j * PW < out; j++) {
        float *pj = packed + (int64_t)j * in * PW;
        for (int i = 0; i < in; i++)
            for (int r = 0; r < PW; r++) {
                const int o = j * PW + r;
                pj[(int64_t)i * PW + r] = o < out ? w[(int64_t)o * in + i] : 0.0f;
            }
    }
}

/* R rows of x (row stride in) times NP panels (NP = 1, 2) -> acc [R][NP]; R and NP are constants at
 * each call site, so the accumulators are registers. */
#define DEFINE_TILE(R, NP)                                                                                 \
    static void tile_##R##_##NP(const float *x, int in, const float *p0, const float *pf, vf *acc) {     \
        vf c[R][NP];                                                                                       \
        for (int r = 0; r < R; r++)                                                                        \
            for (int n = 0; n < NP; n++) c[r][n] = (vf){0};                                                \
        const int64_t pstride = (int64_t)in * PW;                                                          \
        for (int i = 0; i < in; i++) {                                                                     \
            vf b[NP];                                                                                      \
            for (int n = 0; n < NP; n++) b[n] = vload(p0 + n * pstride + (int64_t)i * PW);                 \
            if (pf)                                                                                        \
                for (int n = 0; n < NP; n++) __builtin_prefetch(pf + n * pstride + (int64_t)i * PW, 0, 2); \
            for (int r = 0; r < R; r++) {                                                                  \
                const float a = x[(int64_t)r * in + i];                                                    \
                for (int n = 0; n < NP; n++) c[r][n] += a * b[n];                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int n = 0; n < NP; n++) acc[r * NP + n] = c[r][n];                                        \
    }
#define DEFINE_TILES(NP) DEFINE_TILE(1, NP) DEFINE_TILE(2, NP) DEFINE_TILE(3, NP) DEFINE_TILE(4, NP) \
                         DEFINE_TILE(5, NP) DEFINE_TILE(6, NP)
DEFINE_TILES(1)
DEFINE_TILES(2)

static void tile(const float *x, int rows, int in, const float *p0, const float *pf, int np, vf *acc) {
    typedef void (*tile_fn)(const float *, int, const float *, const float *, vf *);
    static const tile_fn fns[2][TILE_ROWS] = {
        {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
        {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2}};
    fns[np - 1][rows - 1](x, in, p0, pf, acc);
}

/* y[t][o] = x[t] . W[o] (+ b[o]) for rows t, W packed as above. */
static void linear(const float *x, int64_t rows, int in, const float *packed, const float *b, int out, float *y) {
    const int panels = (out + PW - 1) / PW;
    vf acc[TILE_ROWS * 2];
    for (int j = 0; j < panels; j += 2) {
        const int np = panels - j < 2 ? 1 : 2;
        const float *p0 = packed + (int64_t)j * in * PW;
        for (int64_t t = 0; t < rows; t += TILE_ROWS) {
            const int r_n = rows - t < TILE_ROWS ? (int)(rows - t) : TILE_ROWS;
            tile(x + t * in, r_n, in, p0, t == 0 ? p0 + 2 * (int64_t)in * PW : NULL, np, acc);
            for (int r = 0; r < r_n; r++)
                for (int n = 0; n < np; n++) {
                    const int o0 = (j + n) * PW, m = out - o0 < PW ? out - o0 : PW;
                    float *yr = y + (t + r) * out + o0;
                    const float *a = (const float *)&acc[r * np + n];
                    for (int k = 0; k < m; k++) yr[k] = b ? a[k] + b[o0 + k] : a[k];
                }
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
