/* The whole decode step of the native Llama-family forward in one call, float32, on the caller's thread count
 * (sinkserve_kernels/cpu_decode.py builds the arguments and calls it; engine/models/llama.py LlamaForward.forward,
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
 *       packed cache: into the 16-bit side pool, where the block has a slot (write_packed, below)
 *     (sparse pool) bounds[block of slot[t]] = min/max with k      (update_bounds, below)
 *     (trained indexer) index_keys[slot[t]] = int8(Wk . k), scale                (index_key, below)
 *     (importance eviction, full-attention layers) mass[s][j] += block j's largest per-head attention mass
 *                                                                  (block_mass, below)
 *     a = sinkserve_decode_attention(q; the paged cache, window[l])      (decode_attention.c)
 *       packed cache: sinkserve_decode_attention_quant(q; QuantCache, window[l])  (the same core)
 *       (trained indexer, a selecting sequence) over its forced + top-k tokens only   (index_select,
 *       gather_selected, below; then the float32 kernel over the gathered tokens)
 *     h += a W_o^T (+ b);  x = rms_norm(h, post_norm)
 *     gu = x W_gate_up^T (+ b);  m = silu(gate) * up;  h += m W_down^T (+ b)
 *   logits[r] = rms_norm(h[logit_rows[r]], final_norm) lm_head^T
 *
 * Threads (team.c): the caller passes its torch thread count; the step runs as one job on that many
 * threads. Each linear's panel pairs are split into contiguous runs, one per thread; the row loops by rows;
 * attention (with the q/k norms, RoPE and KV write of those rows) by whole sequences of about equal key
 * counts. No output is summed by two threads, so the bits do not depend on the count. Eight barriers per
 * layer and two for the logits (a spinning barrier costs about a microsecond). On this 2-core host, at
 * bench.throughput's concurrency 32, the 243 decode steps took 0.7-1.1 s on 2 threads against 1.5 s on one.
 *
 * Every query segment must be one token (query_start_loc = 0, 1, .., T). The linear weights and lm_head
 * come packed by sinkserve_pack_linear (below), or, with int8 weights (weight_dtype int8), as int8 codes
 * packed by sinkserve_pack_linear_i8 with one float32 scale per output row (a layer's F_*_S fields and
 * lm_head_scale; 0 / NULL: that matrix is float32); embedding and norm weights as they are, contiguous;
 * caches contiguous [num_blocks, B, Hkv, D], or per layer one packed cache (F_KV_QUANT: a QuantCache,
 * decode_attention.h; then F_K_CACHE and F_V_CACHE are 0). The per-layer pointers come as one int64 table
 * [L, LAYER_FIELDS] (field order below; 0 = absent). Returns 0, or < 0 before writing anything when an
 * argument is out of range (-1 a slot past the cache, -3 a token id past the vocabulary, -4 no memory),
 * or the attention kernel's error code minus 10 (-12 head_dim out of range; packed: -13 bits,
 * -14 value group). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F_IN_NORM, F_POST_NORM, F_QKV_W, F_QKV_B, F_O_W, F_O_B, F_QK_NORM, F_GU_W, F_GU_B, F_DOWN_W, F_DOWN_B,
       F_K_CACHE, F_V_CACHE, F_WINDOW, F_KV_QUANT, F_BOUNDS, F_QKV_S, F_O_S, F_GU_S, F_DOWN_S,
       /* the trained lightning indexer (sparse.indexer trained): wq [Hi*Di, Hq*D], wk [Di, Hkv*D], ww [Hi, Hq*D]
        * float32 row-major; the layer's index-key cache: int8 keys [NB, B, Di], float32 scale [NB, B] */
       F_IX_WQ, F_IX_WK, F_IX_WW, F_IX_KEYS, F_IX_SCALE, LAYER_FIELDS };
enum { MAX_INDEX_DIM = 1024 }; /* the index-key width Di at most (cpu_decode.py refuses wider) */


#include "decode_attention.h"
#include "rms_row.h"
#include "team.h"

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
typedef int8_t vi8_u __attribute__((vector_size(PW), aligned(1)));

static inline vf vload(const float *p) { return *(const vf_u *)p; }

/* int8 weights (weight_dtype int8): the same panels of int8 codes, W[o][i] = code[o][i] * scale[o]
 * (symmetric, per output row; engine/worker/weight_quant.py). A panel vector is PW bytes, widened to PW floats
 * in registers (vpmovsxbd + vcvtdq2ps, written as intrinsics:
 * GCC's __builtin_convertvector of a char vector compiled to 16 scalar conversions) and multiplied like a float32 one; the row's scale is
 * applied once to the finished sum: y[o] = scale[o] * sum_i x[i] * code[o][i]. Exact integers times x
 * summed in float32, so the result differs from x . (code * scale) -- what the eager forward computes
 * with the dequantized weights -- by float rounding only. A quarter of float32's weight bytes: a decode
 * step of a model whose weights do not fit in cache streams 4x fewer bytes. */
#if defined(__AVX512F__)
static inline vf vload_i8(const int8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
static inline vf vload_i8(const int8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else /* GCC's generic conversion: correct, element by element */
static inline vf vload_i8(const int8_t *p) { return __builtin_convertvector(*(const vi8_u *)p, vf); }
#endif

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

/* packed (ceil(out / PW) * in * PW bytes) <- codes [out, in] int8: the layout above, one byte a weight. */
void sinkserve_pack_linear_i8(const int8_t *w, int out, int in, int8_t *packed) {
    for (int j = 0; j * PW < out; j++) {
        int8_t *pj = packed + (int64_t)j * in * PW;
        for (int i = 0; i < in; i++)
            for (int r = 0; r < PW; r++) {
                const int o = j * PW + r;
                pj[(int64_t)i * PW + r] = o < out ? w[(int64_t)o * in + i] : 0;
            }
    }
}

/* R rows of x (row stride in) times NP panels (NP = 1, 2) of element type T -> acc [R][NP]; R and NP are
 * constants at each call site, so the accumulators are registers. The prefetch of the next panel pair
 * touches one cache line per 64 bytes of panel (every input index for float32, every 4th for int8). */
#define DEFINE_TILE(NAME, T, LOAD, R, NP)                                                                  \
    static void NAME##_##R##_##NP(const float *x, int in, const T *p0, const T *pf, vf *acc) {            \
        vf c[R][NP];                                                                                       \
        for (int r = 0; r < R; r++)                                                                        \
            for (int n = 0; n < NP; n++) c[r][n] = (vf){0};                                                \
        const int64_t pstride = (int64_t)in * PW;                                                          \
        const int pf_every = 64 / (PW * (int)sizeof(T)) > 1 ? 64 / (PW * (int)sizeof(T)) : 1;              \
        for (int i = 0; i < in; i++) {                                                                     \
            vf b[NP];                                                                                      \
            for (int n = 0; n < NP; n++) b[n] = LOAD(p0 + n * pstride + (int64_t)i * PW);                  \
            if (pf && i % pf_every == 0)                                                                   \
                for (int n = 0; n < NP; n++) __builtin_prefetch(pf + n * pstride + (int64_t)i * PW, 0, 2); \
            for (int r = 0; r < R; r++) {                                                                  \
                const float a = x[(int64_t)r * in + i];                                                    \
                for (int n = 0; n < NP; n++) c[r][n] += a * b[n];                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R; r++)                                                                        \
            for (int n = 0; n < NP; n++) acc[r * NP + n] = c[r][n];                                        \
    }
#define DEFINE_TILES(NAME, T, LOAD, NP)                                                                     \
    DEFINE_TILE(NAME, T, LOAD, 1, NP) DEFINE_TILE(NAME, T, LOAD, 2, NP) DEFINE_TILE(NAME, T, LOAD, 3, NP) \
    DEFINE_TILE(NAME, T, LOAD, 4, NP) DEFINE_TILE(NAME, T, LOAD, 5, NP) DEFINE_TILE(NAME, T, LOAD, 6, NP)
DEFINE_TILES(tile, float, vload, 1)
DEFINE_TILES(tile, float, vload, 2)
DEFINE_TILES(tile_i8, int8_t, vload_i8, 1)
DEFINE_TILES(tile_i8, int8_t, vload_i8, 2)

/* One tile of rows x np panels; p0, pf: float32 panels, or int8 ones when i8. */
static void tile(const float *x, int rows, int in, const void *p0, const void *pf, int np, int i8, vf *acc) {
    typedef void (*tile_fn)(const float *, int, const float *, const float *, vf *);
    typedef void (*tile_i8_fn)(const float *, int, const int8_t *, const int8_t *, vf *);
    static const tile_fn fns[2][TILE_ROWS] = {
        {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
        {tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2}};
    static const tile_i8_fn fns_i8[2][TILE_ROWS] = {
        {tile_i8_1_1, tile_i8_2_1, tile_i8_3_1, tile_i8_4_1, tile_i8_5_1, tile_i8_6_1},
        {tile_i8_1_2, tile_i8_2_2, tile_i8_3_2, tile_i8_4_2, tile_i8_5_2, tile_i8_6_2}};
    if (i8)
        fns_i8[np - 1][rows - 1](x, in, p0, pf, acc);
    else
        fns[np - 1][rows - 1](x, in, p0, pf, acc);
}

/* y[t][o] = x[t] . W[o] (+ b[o]) for rows t, W packed as above (scale NULL: float32 panels; else int8
 * panels and y[t][o] = scale[o] * (x[t] . code[o]) (+ b[o])): thread tid of nt computes a contiguous
 * run of the panel pairs (its share of the weights; the next-pair prefetch stays within it). Each output
 * is one thread's sum in the order one thread would take: the result does not depend on nt. The caller
 * puts a team_barrier after it before reading y. */
static void linear(const float *x, int64_t rows, int in, const void *packed, const float *scale, const float *b,
                   int out, float *y, int tid, int nt) {
    const int panels = (out + PW - 1) / PW, pairs = (panels + 1) / 2;
    const int j_lo = 2 * (int)((int64_t)pairs * tid / nt), j_hi = 2 * (int)((int64_t)pairs * (tid + 1) / nt);
    const int64_t esize = scale ? 1 : sizeof(float), panel_bytes = (int64_t)in * PW * esize;
    vf acc[TILE_ROWS * 2];
    for (int j = j_lo; j < j_hi && j < panels; j += 2) {
        const int np = panels - j < 2 ? 1 : 2;
        const char *p0 = (const char *)packed + j * panel_bytes;
        for (int64_t t = 0; t < rows; t += TILE_ROWS) {
            const int r_n = rows - t < TILE_ROWS ? (int)(rows - t) : TILE_ROWS;
            tile(x + t * in, r_n, in, p0, t == 0 && j + 2 < j_hi ? p0 + 2 * panel_bytes : NULL, np, scale != NULL, acc);
            for (int r = 0; r < r_n; r++)
                for (int n = 0; n < np; n++) {
                    const int o0 = (j + n) * PW, m = out - o0 < PW ? out - o0 : PW;
                    float *yr = y + (t + r) * out + o0;
                    const float *a = (const float *)&acc[r * np + n];
                    if (scale)
                        for (int k = 0; k < m; k++) yr[k] = b ? a[k] * scale[o0 + k] + b[o0 + k] : a[k] * scale[o0 + k];
                    else
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

/* A new token's k, v [Hkv, D] into a packed cache, where the eager path writes it (reference.write_kv_quant):
 * the 16-bit side-pool slot of its block, at the same offset; a packed block (fp_index -1) is immutable
 * and is not written (the engine only schedules new tokens into side-pool blocks; packing a full block
 * happens before a step, in the model runner's KV ops, whichever path runs the step).
 *
 *   e.g. block 16, slot 53 -> block 3, offset 5; fp_index[3] = 2 -> fp_k[2][5] = k, fp_v[2][5] = v
 */
static void write_packed(QuantCache *kv, int64_t slot, int block, const float *k, const float *v, int hkv, int d) {
    const int32_t fp = kv->fp_index[slot / block];
    if (fp < 0) return;
    const int64_t off = ((int64_t)fp * block + slot % block) * hkv * d;
    memcpy(kv->fp_k + off, k, sizeof(float) * hkv * d);
    memcpy(kv->fp_v + off, v, sizeof(float) * hkv * d);
}

/* The sparse indexer's per-block key bounds (sinkserve_kernels/block_sparse.py BlockBounds: [Hkv, NB, 2, D], kmax
 * then kmin per block), kept current on every write as the eager path's update_bounds keeps them -- a
 * dense step too, so the blocks are ready when a sequence starts selecting. A write at offset 0 starts
 * the block afresh (a reused block forgets its previous owner's keys).
 *
 *   e.g. block 16, slot 48 (block 3, offset 0): kmax[h][3] = kmin[h][3] = k[h]; slot 49: widened by k[h]
 */
static void update_bounds(float *bounds, int64_t num_blocks, int64_t slot, int block, const float *k, int hkv,
                          int d) {
    const int64_t blk = slot / block;
    const int fresh = slot % block == 0;
    for (int h = 0; h < hkv; h++) {
        float *kmax = bounds + (h * num_blocks + blk) * 2 * d, *kmin = kmax + d;
        const float *kh = k + (int64_t)h * d;
        for (int i = 0; i < d; i++) {
            kmax[i] = fresh || kh[i] > kmax[i] ? kh[i] : kmax[i];
            kmin[i] = fresh || kh[i] < kmin[i] ? kh[i] : kmin[i];
        }
    }
}

/* The sequences [*s0, *s1) whose attention thread `tid` of `nt` computes: contiguous runs of about equal
 * key counts (a decode query reads every visible key of its sequence once).
 *
 *   e.g. seq_lens 100, 10, 10, 80 (total 200), 2 threads: thread 0 takes sequence 0 (keys up to 100),
 *   thread 1 sequences 1-3 (keys 100 .. 200). */
static void seq_share(const int32_t *seq_lens, int num_seqs, int tid, int nt, int *s0, int *s1) {
    int64_t total = 0, seen = 0;
    for (int s = 0; s < num_seqs; s++) total += seq_lens[s];
    *s0 = *s1 = num_seqs;
    for (int s = 0; s < num_seqs; s++) {
        /* the owner of sequence s: the thread whose share holds the midpoint of its keys (non-decreasing in s) */
        const int owner = total > 0 ? (int)(((seen * 2 + seq_lens[s]) * nt) / (2 * total)) : 0;
        seen += seq_lens[s];
        if (owner >= tid && *s0 == num_seqs) *s0 = s;
        if (owner > tid) { *s1 = s; return; }
    }
}

/* block_sparse.select_blocks for one decode query: the sequence's table with every block it does not attend
 * set to the null block (0), which the attention kernels skip -- the same tokens as the eager path's
 * compacted table (block_sparse.PagedDecode), in the same logical order.
 *
 *   visible   block j holds a position <= the query's (seq_len - 1) and is not null
 *   forced    visible and (protected, forced[j], or in the local window: j >= (pos - window + 1) / block)
 *   scores    per query head h, over the candidates (visible, not forced): softmax_j(scale * ub(q_h, j)),
 *             ub = relu(q_h) . kmax[j] + min(q_h, 0) . kmin[j] (Quest's bound, block_scores); summed over heads
 *   attended  forced + the top_blocks candidates of largest summed score
 *
 *   e.g. block 16, window 16, top 1, forced {0}, query at 70 (seq_len 71): blocks 0..4 visible, window
 *   (70 - 16 + 1) / 16 = 3 -> forced {0, 3, 4}; candidates {1, 2} score 0.3 / 0.7 -> table [t0, 0, t2, t3, t4].
 *
 * prob, logit: bt_stride floats each (scratch); out: the masked table (bt_stride entries). */
static void select_blocks(const float *q, int hq, int hkv, int d, const float *bounds, int64_t num_blocks,
                          const int32_t *table, int32_t seq_len, int block, const uint8_t *forced, int top,
                          int window, float scale, float *prob, float *logit, int32_t *out) {
    const int32_t last = seq_len - 1, nb = (seq_len + block - 1) / block;
    const int32_t first_window = (last - window + 1 > 0 ? last - window + 1 : 0) / block;
    int n_cand = 0;
    for (int j = 0; j < nb; j++) {
        const int visible = table[j] != 0; /* j * block <= last for every j < nb */
        const int forced_j = visible && (forced[j] || j >= first_window);
        out[j] = forced_j ? table[j] : 0;
        prob[j] = visible && !forced_j ? 0.0f : -1.0f; /* -1: not a candidate */
        n_cand += visible && !forced_j;
    }
    if (top <= 0 || n_cand == 0) return;
    const int g_per = hq / hkv;
    for (int h = 0; h < hq; h++) {
        const float *qh = q + (int64_t)h * d;
        const float *bh = bounds + (int64_t)(h / g_per) * num_blocks * 2 * d;
        float m = -INFINITY, sum = 0.0f;
        for (int j = 0; j < nb; j++) {
            if (prob[j] < 0.0f) continue;
            const float *kmax = bh + (int64_t)table[j] * 2 * d, *kmin = kmax + d;
            float ub = 0.0f;
            for (int c = 0; c < d; c++) ub += qh[c] > 0.0f ? qh[c] * kmax[c] : qh[c] * kmin[c];
            logit[j] = ub * scale;
            m = logit[j] > m ? logit[j] : m;
        }
        for (int j = 0; j < nb; j++)
            if (prob[j] >= 0.0f) { logit[j] = expf(logit[j] - m); sum += logit[j]; }
        for (int j = 0; j < nb; j++)
            if (prob[j] >= 0.0f) prob[j] += logit[j] / sum;
    }
    /* The top candidates, largest first (ties: the lower block index, as a stable sort would). */
    for (int k = 0; k < top && k < n_cand; k++) {
        int best = -1;
        for (int j = 0; j < nb; j++)
            if (prob[j] >= 0.0f && (best < 0 || prob[j] > prob[best])) best = j;
        out[best] = table[best];
        prob[best] = -1.0f;
    }
}

/* The trained indexer's index key of one new token, written as engine/worker/indexer_runtime.py writes it
 * (engine/worker/lightning.py quantize_keys): ki = Wk . k (k: every KV head of the layer's post-RoPE key), then
 * symmetric int8 per token, scale = max(|ki|, 1e-8) / 127, code = round-half-even(ki / scale) in [-127, 127].
 *
 *   e.g. ki = [0.5, -1.27, 0.3] -> scale 0.01, codes [50, -127, 30] */
static void index_key(const float *k, int kd, const float *wk, int di, int8_t *codes, float *scale_out) {
    float ki[MAX_INDEX_DIM], amax = 0.0f;
    for (int e = 0; e < di; e++) {
        const float *w = wk + (int64_t)e * kd;
        float a = 0.0f;
        for (int i = 0; i < kd; i++) a += k[i] * w[i];
        ki[e] = a;
        amax = fabsf(a) > amax ? fabsf(a) : amax;
    }
    const float sc = (amax > 1e-8f ? amax : 1e-8f) / 127.0f;
    for (int e = 0; e < di; e++) {
        float c = nearbyintf(ki[e] / sc);
        codes[e] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
    }
    *scale_out = sc;
}

/* The k-th largest of x[0..n) (1 <= k <= n), x reordered: quickselect with a three-way partition (index
 * scores repeat, e.g. 0 where every head's relu is 0, so a two-way partition would go quadratic). */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n, want = k - 1; /* index in descending order */
    for (;;) {
        const float a = x[lo], b = x[lo + (hi - lo) / 2], c = x[hi - 1];
        const float p = (a > b) == (b > c) ? b : (a > b) == (a > c) ? c : a; /* a median of three */
        int64_t gt = lo, i = lo, lt = hi; /* [lo, gt) > p, [gt, i) == p, [lt, hi) < p */
        while (i < lt) {
            const float v = x[i];
            if (v > p) { x[i] = x[gt]; x[gt++] = v; i++; }
            else if (v < p) { x[i] = x[--lt]; x[lt] = v; }
            else i++;
        }
        if (want < gt) hi = gt;
        else if (want < lt) return p;
        else lo = lt;
    }
}

/* indexed_sparse.select_torch for one decode query of the trained indexer: the positions it attends,
 * ascending, into pos[]; returns their count (min(k, visible tokens)).
 *
 *   iq = Wq . q [Hi, Di], iw = Ww . q [Hi]        (q: every query head, post-RoPE)
 *   score[p] = sum_h iw[h] * relu(iq[h] . (codes[p] * scale[p]))   over the visible positions p
 *   visible  p < seq_len and its block is not null
 *   forced   visible and (in a protected block, or p > pos - window: the newest `window` tokens)
 *   chosen   the k largest of (forced: +inf, else score), ties to the lower position (select_top's rule)
 *
 *   e.g. seq_len 8, block 4, forced block {0}, window 2, k 7: forced 0..3, 6, 7; scores of 4, 5: 0.2, 0.2
 *   -> one more, the tie goes to position 4 -> pos = [0, 1, 2, 3, 4, 6, 7]
 *
 * work: Hi * Di + Hi + Di floats; score, cand: seq_len floats each; state: seq_len bytes. */
static int index_select(const float *q, int qd, const int64_t *L, int hi, int di, const int32_t *table,
                        int32_t seq_len, int block, const uint8_t *forced, int window, int32_t k, float *work,
                        float *score, float *cand, int32_t *pos, uint8_t *state) {
    const float *wq = PTR(L, F_IX_WQ), *ww = PTR(L, F_IX_WW), *ksc = PTR(L, F_IX_SCALE);
    const int8_t *codes = (const int8_t *)(intptr_t)L[F_IX_KEYS];
    float *iq = work, *iw = iq + (int64_t)hi * di, *kf = iw + hi;
    for (int r = 0; r < hi * di + hi; r++) { /* iq rows, then iw rows: one q . w each */
        const float *w = r < hi * di ? wq + (int64_t)r * qd : ww + (int64_t)(r - hi * di) * qd;
        float a = 0.0f;
        for (int i = 0; i < qd; i++) a += q[i] * w[i];
        if (r < hi * di) iq[r] = a; else iw[r - hi * di] = a;
    }
    /* state[p]: 0 not visible, 1 a candidate (score[p] its score), 2 forced. Not NaN / inf sentinels: the
     * library builds with -ffast-math, under which the compiler may assume neither occurs. */
    enum { HIDDEN, CAND, FORCED };
    const int32_t first_window = seq_len - window; /* p > (seq_len - 1) - window */
    int64_t n_valid = 0, n_forced = 0, n_cand = 0;
    for (int32_t p = 0; p < seq_len; p++) {
        const int32_t blk = table[p / block];
        if (blk == 0) { state[p] = HIDDEN; continue; }
        n_valid++;
        if (forced[p / block] || p >= first_window) { state[p] = FORCED; n_forced++; continue; }
        const int64_t slot = (int64_t)blk * block + p % block;
        const int8_t *c = codes + slot * di;
        for (int e = 0; e < di; e++) kf[e] = (float)c[e] * ksc[slot]; /* dequantized first, as the eager path */
        float sc = 0.0f;
        for (int h = 0; h < hi; h++) {
            const float *qh = iq + (int64_t)h * di;
            float a = 0.0f;
            for (int e = 0; e < di; e++) a += qh[e] * kf[e];
            sc += iw[h] * (a > 0.0f ? a : 0.0f);
        }
        state[p] = CAND;
        score[p] = sc;
        cand[n_cand++] = sc;
    }
    int n = 0;
    if (k >= n_valid) { /* every visible token */
        for (int32_t p = 0; p < seq_len; p++)
            if (state[p] != HIDDEN) pos[n++] = p;
        return n;
    }
    if (n_forced >= k) { /* the forced set alone fills k: its lowest positions (all tie at +inf) */
        for (int32_t p = 0; p < seq_len && n < k; p++)
            if (state[p] == FORCED) pos[n++] = p;
        return n;
    }
    const int64_t r = k - n_forced; /* 1 <= r < n_cand */
    const float thr = kth_largest(cand, n_cand, r);
    int64_t above = 0;
    for (int32_t p = 0; p < seq_len; p++) above += state[p] == CAND && score[p] > thr;
    int64_t tied = r - above; /* ties at the threshold go to the lowest positions */
    for (int32_t p = 0; p < seq_len; p++)
        if (state[p] == FORCED || (state[p] == CAND && (score[p] > thr || (score[p] == thr && tied-- > 0))))
            pos[n++] = p;
    return n;
}

/* index_select on its own, for the tests (tests/test_indexer_c_step.py holds it to indexed_sparse.select_torch):
 * one query's selected positions into pos[] (seq_len entries), their count returned; -5 when di is too wide. */
int sinkserve_index_select(const float *q, int qd, const float *wq, const float *ww, const int8_t *keys,
                           const float *key_scale, int hi, int di, const int32_t *table, int32_t seq_len, int block,
                           const uint8_t *forced, int window, int32_t k, int32_t *pos) {
    if (di > MAX_INDEX_DIM) return -5;
    int64_t L[LAYER_FIELDS] = {0};
    L[F_IX_WQ] = (int64_t)(intptr_t)wq, L[F_IX_WW] = (int64_t)(intptr_t)ww;
    L[F_IX_KEYS] = (int64_t)(intptr_t)keys, L[F_IX_SCALE] = (int64_t)(intptr_t)key_scale;
    float *work = malloc(sizeof(float) * ((size_t)hi * di + hi + di + 2 * (size_t)seq_len));
    uint8_t *state = malloc((size_t)seq_len);
    if (!work || !state) { free(work), free(state); return -4; }
    float *score = work + (int64_t)hi * di + hi + di;
    const int n = index_select(q, qd, L, hi, di, table, seq_len, block, forced, window, k, work, score,
                               score + seq_len, pos, state);
    free(work), free(state);
    return n;
}

/* The key and value rows of the selected positions into a float32 paged scratch cache whose block 0 is
 * the null block (never read): token j of the selection at block 1 + j / B, offset j % B, and its table
 * [1, 2, ..]; attention over it is the float32 kernel's. A packed cache's tokens are decoded as its own
 * attention decodes them (sinkserve_quant_token). */
static void gather_selected(const QuantCache *kv, const float *k_cache, const float *v_cache, const int32_t *table,
                            const int32_t *pos, int n, int block, int hkv, int d, float *gk, float *gv,
                            int32_t *gtable) {
    const int64_t row = (int64_t)hkv * d;
    for (int j = 0; j < n; j++) {
        const int64_t slot = (int64_t)table[pos[j] / block] * block + pos[j] % block, at = (block + j) * row;
        if (kv) {
            sinkserve_quant_token(kv, slot, block, hkv, d, gk + at, gv + at);
        } else {
            memcpy(gk + at, k_cache + slot * row, sizeof(float) * row);
            memcpy(gv + at, v_cache + slot * row, sizeof(float) * row);
        }
    }
    for (int b = 0; b * block < n; b++) gtable[b] = b + 1;
}

/* engine/worker/importance.py's accumulate for one decode query (importance eviction): the attention mass each
 * held block of the sequence receives, averaged over query heads, added to mass[j] (logical block j). Every
 * held key counts (no window, no sparse selection, no sink: the scores eviction ranks by, whatever the
 * layer's attention then reads), keys read where the attention kernels read them (float32 cache, or
 * sinkserve_quant_keys: the side pool in place, a packed block decoded). Per KV head and up to 16 of its
 * query heads: scores into scratch [g][n] (n: held key index), softmax, then summed per block.
 *
 *   e.g. block 4, seq_len 10, table [3, 0, 5]: keys 0..3 (block 3) and 8, 9 (block 5); one head with
 *   probabilities .1 .1 .1 .1 | .2 .4  ->  mass += [0.4, 0, 0.6]
 *
 * scratch: seq_len * min(G, 16) floats. */
static void block_mass(const float *q, int hq, int hkv, int d, int block, float scale, const QuantCache *kv,
                       const float *k_cache, const int32_t *table, int32_t seq_len, float *mass, float *scratch) {
    enum { TILE = 4096 };
    float tile[TILE];
    const int g_per = hq / hkv, nb = (seq_len + block - 1) / block, chunk = TILE / d;
    const int64_t cap = seq_len;
    /* This layer's score per block: the largest mass any query head puts on it (engine/worker/importance.py). */
    float *lmax = calloc((size_t)(nb > 0 ? nb : 1), sizeof(float));
    if (!lmax) return;
    for (int hk = 0; hk < hkv; hk++) {
        for (int g0 = 0; g0 < g_per; g0 += 16) {
            const int gn = g_per - g0 < 16 ? g_per - g0 : 16;
            const float *qh = q + (int64_t)(hk * g_per + g0) * d;
            int64_t n = 0;
            for (int j = 0; j < nb; j++) {
                const int32_t blk = table[j];
                if (blk == 0) continue;
                const int cnt = seq_len - j * block < block ? seq_len - j * block : block;
                for (int off = 0; off < cnt; off += chunk) {
                    const int c_n = cnt - off < chunk ? cnt - off : chunk;
                    int64_t ks = (int64_t)hkv * d;
                    const float *k0 = kv ? sinkserve_quant_keys(kv, blk, off, c_n, block, hkv, hk, d, tile, &ks)
                                         : k_cache + (((int64_t)blk * block + off) * hkv + hk) * d;
                    for (int r = 0; r < c_n; r++, n++) {
                        const float *kr = k0 + r * ks;
                        for (int g = 0; g < gn; g++) {
                            const float *qg = qh + (int64_t)g * d;
                            float a = 0.0f;
                            for (int i = 0; i < d; i++) a += qg[i] * kr[i];
                            scratch[g * cap + n] = a * scale;
                        }
                    }
                }
            }
            if (n == 0) { free(lmax); return; } /* nothing held */
            for (int g = 0; g < gn; g++) {
                float *sc = scratch + g * cap, m = sc[0], sum = 0.0f;
                for (int64_t i = 1; i < n; i++) m = sc[i] > m ? sc[i] : m;
                for (int64_t i = 0; i < n; i++) { sc[i] = expf(sc[i] - m); sum += sc[i]; }
                const float f = 1.0f / sum;
                for (int64_t i = 0; i < n; i++) sc[i] *= f;
            }
            n = 0;
            for (int j = 0; j < nb; j++) {
                if (table[j] == 0) continue;
                const int cnt = seq_len - j * block < block ? seq_len - j * block : block;
                for (int g = 0; g < gn; g++) { /* each head's block mass; the layer keeps the largest */
                    float b = 0.0f;
                    for (int r = 0; r < cnt; r++) b += scratch[g * cap + n + r];
                    lmax[j] = b > lmax[j] ? b : lmax[j];
                }
                n += cnt;
            }
        }
    }
    for (int j = 0; j < nb; j++) mass[j] += lmax[j];
    free(lmax);
}

/* Everything one decode step reads and writes; the team's threads share it (step_job). */
typedef struct {
    const int64_t *layers;
    int num_layers, hidden, inter, hq, hkv, d, vocab, block, rows, n_logits;
    const float *embed, *final_norm, *inv_freq, *lm_head_scale;
    const void *lm_head; /* float32 panels, or int8 ones with lm_head_scale */
    float rope_scaling, eps, scale;
    const int64_t *input_ids, *positions, *slots, *logit_rows;
    const int32_t *block_tables, *seq_lens, *starts;
    int64_t bt_stride, scratch_len, num_blocks;
    /* A step in which some sequence selects blocks (sinkserve_kernels/block_sparse.py SparsePlan), else forced NULL:
     * forced [S, forced_stride] uint8 protected logical blocks, top_blocks [S] (-1: dense), the local window
     * in tokens; per-thread scratch for the selection (a table and two score rows of bt_stride each). */
    const uint8_t *forced;
    int64_t forced_stride;
    const int32_t *top_blocks;
    int sparse_window;
    int32_t *sel_tables;
    float *sel_scratch;
    /* Importance eviction's per-block attention mass [S, imp_stride] (block_mass), added to on every
     * full-attention layer; NULL when the step does not score. */
    float *importance;
    int64_t imp_stride;
    /* The trained indexer (layers' F_IX_* set): Hi heads of Di dims; on a sparse step ix_k [S] each
     * sequence's selection width (-1: dense), and per thread its scratch (index_select's work, score and
     * candidate rows, positions; gather_selected's scratch cache and table), ix_len floats/ints apart. */
    int ix_heads, ix_dim;
    const int32_t *ix_k;
    float *ix_scratch;
    int32_t *ix_pos;
    int64_t ix_len, ix_cache_len, ix_pos_len;
    float *logits, *h, *x, *qkv, *att, *o, *gu, *act, *cs, *scratch;
    atomic_int rc;
} Step;

/* Decode attention of sequences s0 .. s0 + n - 1 (tables: theirs, stride bt_stride) through
 * decode_attention.c's core, over the packed cache or the float32 one. starts[] holds
 * absolute rows, so q and att stay the whole step's arrays. An error is the kernel's code minus 10. */
static void attend(Step *S, const QuantCache *kv, const float *k_cache, const float *v_cache, int qkv_n,
                   const int32_t *tables, int s0, int n, int window, int tid) {
    const int hq = S->hq, hkv = S->hkv, d = S->d;
    const int arc = kv ? sinkserve_decode_attention_quant(S->qkv, qkv_n, d, kv, tables, S->bt_stride, S->seq_lens + s0,
                                                          S->starts + s0, n, hq, hkv, d, S->block, S->scale, window,
                                                          NULL, S->att)
                       : sinkserve_decode_attention(S->qkv, qkv_n, d, k_cache, v_cache, tables, S->bt_stride,
                                                    S->seq_lens + s0, S->starts + s0, n, hq, hkv, d, S->block,
                                                    S->scale, window, NULL, S->att);
    if (arc != 0) atomic_store(&S->rc, arc - 10);
}

/* Rows [lo, hi) of n for thread tid of nt. */
#define SHARE(n, lo, hi) const int lo = (int)((int64_t)(n) * tid / nt), hi = (int)((int64_t)(n) * (tid + 1) / nt)

/* The step on thread tid of nt: row loops and the linears' panels are shared out (a barrier after each
 * phase that another thread's rows or panels feed), attention by sequences (seq_share). Every thread
 * takes every branch on shared values, so all reach the same barriers. */
static void step_job(void *arg, int tid, int nt) {
    Step *S = arg;
    const int rows = S->rows, hidden = S->hidden, inter = S->inter, hq = S->hq, hkv = S->hkv, d = S->d;
    const int qkv_n = (hq + 2 * hkv) * d, half = d / 2;
    const float eps = S->eps;
    float *h = S->h, *x = S->x, *qkv = S->qkv, *att = S->att, *o = S->o, *gu = S->gu, *act = S->act, *cs = S->cs;
    SHARE(rows, r_lo, r_hi);
    int a0, a1;
    seq_share(S->seq_lens, rows, tid, nt, &a0, &a1);
    for (int t = r_lo; t < r_hi; t++) {
        memcpy(h + (int64_t)t * hidden, S->embed + S->input_ids[t] * (int64_t)hidden, sizeof(float) * hidden);
        float *c = cs + (int64_t)t * 2 * d, *s = c + d;
        for (int i = 0; i < half; i++) { /* float32 angles, as transformers computes them */
            const float ang = (float)S->positions[t] * S->inv_freq[i];
            c[i] = c[i + half] = cosf(ang) * S->rope_scaling;
            s[i] = s[i + half] = sinf(ang) * S->rope_scaling;
        }
    }
    for (int l = 0; l < S->num_layers; l++) {
        const int64_t *L = S->layers + (int64_t)l * LAYER_FIELDS;
        for (int t = r_lo; t < r_hi; t++) norm_row(h + (int64_t)t * hidden, PTR(L, F_IN_NORM), x + (int64_t)t * hidden, hidden, eps);
        team_barrier(nt);
        linear(x, rows, hidden, PTR(L, F_QKV_W), PTR(L, F_QKV_S), PTR(L, F_QKV_B), qkv_n, qkv, tid, nt);
        team_barrier(nt);
        float *k_cache = (float *)(intptr_t)L[F_K_CACHE], *v_cache = (float *)(intptr_t)L[F_V_CACHE];
        QuantCache *kv = (QuantCache *)(intptr_t)L[F_KV_QUANT];
        float *bounds = (float *)(intptr_t)L[F_BOUNDS];
        const float *qk_norm = PTR(L, F_QK_NORM);
        for (int t = a0; t < a1; t++) { /* the rows of this thread's attention sequences (one token each) */
            float *row = qkv + (int64_t)t * qkv_n; /* q heads, then k heads: adjacent, as qk_norm's rows */
            if (qk_norm)
                for (int hd = 0; hd < hq + hkv; hd++) norm_row(row + (int64_t)hd * d, qk_norm + (int64_t)hd * d, row + (int64_t)hd * d, d, eps);
            const float *c = cs + (int64_t)t * 2 * d;
            rope_heads(row, hq + hkv, d, c, c + d);
            const int64_t slot = S->slots[t];
            if (slot >= 0) {
                const float *k = row + (int64_t)hq * d, *v = row + (int64_t)(hq + hkv) * d;
                if (kv) {
                    write_packed(kv, slot, S->block, k, v, hkv, d);
                } else {
                    memcpy(k_cache + slot * (int64_t)hkv * d, k, sizeof(float) * hkv * d);
                    memcpy(v_cache + slot * (int64_t)hkv * d, v, sizeof(float) * hkv * d);
                }
                if (bounds) update_bounds(bounds, S->num_blocks, slot, S->block, k, hkv, d);
                if (L[F_IX_KEYS])
                    index_key(k, hkv * d, PTR(L, F_IX_WK), S->ix_dim, (int8_t *)(intptr_t)L[F_IX_KEYS] + slot * S->ix_dim,
                              (float *)(intptr_t)L[F_IX_SCALE] + slot);
            }
        }
        const int window = (int)L[F_WINDOW];
        if (S->importance && window == 0) /* after the writes: the new key is scored too, as eagerly */
            for (int s = a0; s < a1; s++)
                block_mass(qkv + (int64_t)S->starts[s] * qkv_n, hq, hkv, d, S->block, S->scale, kv, k_cache,
                           S->block_tables + (int64_t)s * S->bt_stride, S->seq_lens[s],
                           S->importance + (int64_t)s * S->imp_stride, S->scratch + S->scratch_len * tid);
        /* Sparse selection on full-attention layers only (a sliding-window layer is bounded by its window),
         * as engine/worker/attention.py decides; a sequence whose top_blocks is < 0 attends densely. */
        if (S->forced && bounds && window == 0) {
            int32_t *sel = S->sel_tables + (int64_t)tid * S->bt_stride;
            float *prob = S->sel_scratch + (int64_t)tid * 2 * S->bt_stride;
            for (int s = a0; s < a1; s++) {
                const int32_t *table = S->block_tables + (int64_t)s * S->bt_stride;
                if (S->top_blocks[s] >= 0) {
                    select_blocks(qkv + (int64_t)S->starts[s] * qkv_n, hq, hkv, d, bounds, S->num_blocks, table,
                                  S->seq_lens[s], S->block, S->forced + (int64_t)s * S->forced_stride,
                                  S->top_blocks[s], S->sparse_window, S->scale, prob, prob + S->bt_stride, sel);
                    table = sel;
                }
                attend(S, kv, k_cache, v_cache, qkv_n, table, s, 1, 0, tid);
            }
        } else if (S->forced && S->ix_k && L[F_IX_KEYS] && window == 0) {
            /* The trained indexer: token-granular selection, then the float32 kernel over the gathered
             * tokens (ascending positions, the eager path's indexed_sparse_attention). */
            float *work = S->ix_scratch + (int64_t)tid * S->ix_len;
            float *score = work + (int64_t)S->ix_heads * S->ix_dim + S->ix_heads + S->ix_dim;
            float *cand = score + S->ix_pos_len, *gk = cand + S->ix_pos_len, *gv = gk + S->ix_cache_len;
            int32_t *pos = S->ix_pos + (int64_t)tid * 3 * S->ix_pos_len, *gtable = pos + S->ix_pos_len;
            uint8_t *state = (uint8_t *)(gtable + S->ix_pos_len);
            for (int s = a0; s < a1; s++) {
                const int32_t *table = S->block_tables + (int64_t)s * S->bt_stride;
                if (S->ix_k[s] < 0) { /* this sequence attends densely this step */
                    attend(S, kv, k_cache, v_cache, qkv_n, table, s, 1, 0, tid);
                    continue;
                }
                int32_t n = index_select(qkv + (int64_t)S->starts[s] * qkv_n, hq * d, L, S->ix_heads, S->ix_dim, table,
                                         S->seq_lens[s], S->block, S->forced + (int64_t)s * S->forced_stride,
                                         S->sparse_window, S->ix_k[s], work, score, cand, pos, state);
                gather_selected(kv, k_cache, v_cache, table, pos, n, S->block, hkv, d, gk, gv, gtable);
                const int32_t starts[2] = {S->starts[s], S->starts[s] + 1};
                const int arc = sinkserve_decode_attention(qkv, qkv_n, d, gk, gv, gtable, 0, &n, starts, 1, hq, hkv, d,
                                                           S->block, S->scale, 0, NULL, att);
                if (arc != 0) atomic_store(&S->rc, arc - 10);
            }
        } else if (a1 > a0) {
            attend(S, kv, k_cache, v_cache, qkv_n, S->block_tables + (int64_t)a0 * S->bt_stride, a0, a1 - a0, window,
                   tid);
        }
        team_barrier(nt);
        if (atomic_load(&S->rc) != 0) return; /* read after the barrier: every thread leaves here */
        linear(att, rows, hq * d, PTR(L, F_O_W), PTR(L, F_O_S), PTR(L, F_O_B), hidden, o, tid, nt);
        team_barrier(nt);
        for (int t = r_lo; t < r_hi; t++) {
            float *hr = h + (int64_t)t * hidden;
            const float *orow = o + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) hr[i] += orow[i];
            norm_row(hr, PTR(L, F_POST_NORM), x + (int64_t)t * hidden, hidden, eps);
        }
        team_barrier(nt);
        linear(x, rows, hidden, PTR(L, F_GU_W), PTR(L, F_GU_S), PTR(L, F_GU_B), 2 * inter, gu, tid, nt);
        team_barrier(nt);
        for (int t = r_lo; t < r_hi; t++) {
            const float *g = gu + (int64_t)t * 2 * inter, *u = g + inter;
            float *a = act + (int64_t)t * inter;
            for (int i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        team_barrier(nt);
        linear(act, rows, inter, PTR(L, F_DOWN_W), PTR(L, F_DOWN_S), PTR(L, F_DOWN_B), hidden, o, tid, nt);
        team_barrier(nt);
        for (int t = r_lo; t < r_hi; t++) {
            float *hr = h + (int64_t)t * hidden;
            const float *orow = o + (int64_t)t * hidden;
            for (int i = 0; i < hidden; i++) hr[i] += orow[i];
        }
    }
    SHARE(S->n_logits, g_lo, g_hi);
    team_barrier(nt);
    for (int r = g_lo; r < g_hi; r++)
        norm_row(h + S->logit_rows[r] * (int64_t)hidden, S->final_norm, x + (int64_t)r * hidden, hidden, eps);
    team_barrier(nt);
    linear(x, S->n_logits, hidden, S->lm_head, S->lm_head_scale, NULL, S->vocab, S->logits, tid, nt);
}

/* threads: the team size to use (the caller's torch thread count); the result is the same for any. */
int sinkserve_llama_decode(const int64_t *layers, int num_layers, const float *embed, const float *final_norm,
                           const void *lm_head, const float *lm_head_scale, const float *inv_freq, float rope_scaling, int hidden, int inter,
                           int hq, int hkv, int d, int vocab, float eps, float scale, int block,
                           const int64_t *input_ids, const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *starts, int rows, int64_t num_slots, const int64_t *logit_rows,
                           int n_logits, float *logits, int threads, const uint8_t *forced, int64_t forced_stride,
                           const int32_t *top_blocks, int sparse_window, float *importance, int64_t imp_stride,
                           int ix_heads, int ix_dim, const int32_t *ix_k) {
    for (int t = 0; t < rows; t++) {
        if (slots[t] >= num_slots) return -1;
        if (input_ids[t] < 0 || input_ids[t] >= vocab) return -3;
    }
    if (threads < 1) threads = 1;
    const int qkv_n = (hq + 2 * hkv) * d, g_per = hq / hkv;
    int32_t longest = 1;
    for (int t = 0; t < rows; t++) longest = seq_lens[t] > longest ? seq_lens[t] : longest;
    /* block_mass's score rows, per thread (the attention itself needs no scratch: its softmax is online) */
    const int64_t scratch_len = importance ? (int64_t)longest * (g_per < 16 ? g_per : 16) : 0;
    const int64_t per_row = 2 * (int64_t)hidden + qkv_n + (int64_t)hq * d + hidden + 3 * (int64_t)inter + 2 * d;
    float *work = malloc(sizeof(float) * ((size_t)rows * per_row + (size_t)scratch_len * threads));
    int32_t *sel = forced ? malloc(sizeof(int32_t) * (size_t)bt_stride * threads) : NULL;
    float *sel_scratch = forced ? malloc(sizeof(float) * 2 * (size_t)bt_stride * threads) : NULL;
    /* The trained indexer's per-thread scratch (a sparse step only): index_select's rows over the longest
     * sequence, and a scratch cache of the widest selection plus the null block. */
    int64_t ix_len = 0, ix_cache_len = 0, ix_pos_len = 0;
    float *ix_scratch = NULL;
    int32_t *ix_pos = NULL;
    if (forced && ix_k) {
        if (ix_dim > MAX_INDEX_DIM) { free(work), free(sel), free(sel_scratch); return -5; }
        int32_t kmax = 1;
        for (int t = 0; t < rows; t++) kmax = ix_k[t] > kmax ? ix_k[t] : kmax;
        ix_pos_len = longest;
        ix_cache_len = ((int64_t)(kmax + block - 1) / block + 1) * block * hkv * d;
        ix_len = (int64_t)ix_heads * ix_dim + ix_heads + ix_dim + 2 * ix_pos_len + 2 * ix_cache_len;
        ix_scratch = malloc(sizeof(float) * (size_t)ix_len * threads);
        ix_pos = malloc(sizeof(int32_t) * 3 * (size_t)ix_pos_len * threads); /* pos, gtable, state */
    }
    if (!work || (forced && (!sel || !sel_scratch)) || (forced && ix_k && (!ix_scratch || !ix_pos))) {
        free(work), free(sel), free(sel_scratch), free(ix_scratch), free(ix_pos);
        return -4;
    }
    Step S = {.layers = layers, .num_layers = num_layers, .hidden = hidden, .inter = inter, .hq = hq, .hkv = hkv,
              .d = d, .vocab = vocab, .block = block, .rows = rows, .n_logits = n_logits, .embed = embed,
              .final_norm = final_norm, .lm_head = lm_head, .lm_head_scale = lm_head_scale, .inv_freq = inv_freq, .rope_scaling = rope_scaling,
              .eps = eps, .scale = scale, .input_ids = input_ids, .positions = positions, .slots = slots,
              .logit_rows = logit_rows, .block_tables = block_tables, .seq_lens = seq_lens, .starts = starts,
              .bt_stride = bt_stride, .scratch_len = scratch_len, .num_blocks = num_slots / block,
              .forced = forced, .forced_stride = forced_stride, .top_blocks = top_blocks,
              .sparse_window = sparse_window, .sel_tables = sel, .sel_scratch = sel_scratch, .logits = logits,
              .importance = importance, .imp_stride = imp_stride, .ix_heads = ix_heads, .ix_dim = ix_dim,
              .ix_k = ix_k, .ix_scratch = ix_scratch, .ix_pos = ix_pos, .ix_len = ix_len,
              .ix_cache_len = ix_cache_len, .ix_pos_len = ix_pos_len};
    S.h = work, S.x = S.h + (int64_t)rows * hidden, S.qkv = S.x + (int64_t)rows * hidden;
    S.att = S.qkv + (int64_t)rows * qkv_n, S.o = S.att + (int64_t)rows * hq * d;
    S.gu = S.o + (int64_t)rows * hidden, S.act = S.gu + (int64_t)rows * 2 * inter;
    S.cs = S.act + (int64_t)rows * inter, S.scratch = S.cs + (int64_t)rows * 2 * d;
    atomic_init(&S.rc, 0);
    team_run(step_job, &S, threads);
    free(work), free(sel), free(sel_scratch), free(ix_scratch), free(ix_pos);
    return atomic_load(&S.rc);
}
