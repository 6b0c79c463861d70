/* Decode attention over a packed (quantized) paged KV cache, float32 arithmetic, one thread: the CPU
 * backend's kernel for kv_cache_dtype int8 / int4 / int2 (sinkserve_kernels/cpu_attention.py builds and calls it;
 * sinkserve_kernels/torch_kernels.py's paged_attention_quant is the ground truth).
 *
 * Same semantics as decode_attention.c (one-token query segments only; null blocks skipped; sliding
 * window lo = max(0, seq_len - window); learned sinks in the denominator; GQA; no visible key -> zeros),
 * but every block the table names is read where it lives (sinkserve_kernels/kv_quant.py's layout):
 *
 *     fp_index[blk] >= 0  -> 16-bit block: fp_k / fp_v [NF, B, H, D] float32, slot fp_index[blk]
 *     fp_index[blk] <  0  -> packed block: codes k_codes / v_codes [NB, B, H, D * bits / 8] uint8,
 *                            keys   x = code * k_scale[blk, h, c] + k_zero[blk, h, c]      (per channel)
 *                            values x = code * v_scale[blk, t, h, c / G] + v_zero[...]     (per token, G channels)
 *                            scales / zeros fp16; outlier key channels (optional): key channel
 *                            outlier_idx[h, o] of token t is k_outlier[blk, t, h, o] (float32), not its code
 *
 *     byte c of a token-head row holds (reference.pack_codes):
 *       int8: channel c                     int4: bits 3..0 channel c, bits 7..4 channel c + D/2
 *       int2: bits 2i+1..2i channel c + i * D/4   (i = 0..3)
 *
 * The keys and values of a packed block are decoded a chunk of tokens at a time into two small float
 * tiles (on the stack), then scored and accumulated exactly as a 16-bit block is read in place. The
 * softmax is online over chunks (running max m, denominator l, rescaled accumulator), so no score
 * scratch sized by the context is needed and each chunk's keys and values are read while in cache:
 *
 *     chunk scores s_j;  m' = max(m, max_j s_j);  a = exp(m - m');  acc = a * acc + sum_j exp(s_j - m') v_j
 *     l = a * l + sum_j exp(s_j - m');  with sinks m, l start at (sink, 1), else at the first chunk.
 *
 * Layouts: q [T, Hq, D] with strides (q_st, q_sh, 1); every cache tensor contiguous; out contiguous
 * [T, Hq, D]; block_tables int32 [S, bt_stride]. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_cache.h"

#define MAX_GROUP 16      /* query heads per KV head handled in registers; larger groups loop over chunks */
#define TILE_FLOATS 2048  /* one decoded key (or value) tile: chunk = TILE_FLOATS / D tokens */
#define MAX_CHUNK 128     /* tokens per chunk at most (the score rows s[]): D = 4, 8 fill half a tile or less */

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && defined(__FLT16_MAX__)
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Codes of n token rows (row stride `stride` bytes) into tile[j * D + c] as floats, no scales. */
static inline void unpack_rows(const uint8_t *codes, int64_t stride, int n, int bits, int D, float *tile) {
    if (bits == 8) {
        for (int j = 0; j < n; j++) {
            const uint8_t *r = codes + j * stride;
            float *t = tile + j * D;
            for (int c = 0; c < D; c++) t[c] = (float)r[c];
        }
    } else if (bits == 4) {
        const int h = D / 2;
        for (int j = 0; j < n; j++) {
            const uint8_t *r = codes + j * stride;
            float *t = tile + j * D;
            for (int c = 0; c < h; c++) {
                t[c] = (float)(r[c] & 15);
                t[c + h] = (float)(r[c] >> 4);
            }
        }
    } else {
        const int qd = D / 4;
        for (int j = 0; j < n; j++) {
            const uint8_t *r = codes + j * stride;
            float *t = tile + j * D;
            for (int c = 0; c < qd; c++) {
                t[c] = (float)(r[c] & 3);
                t[c + qd] = (float)((r[c] >> 2) & 3);
                t[c + 2 * qd] = (float)((r[c] >> 4) & 3);
                t[c + 3 * qd] = (float)(r[c] >> 6);
            }
        }
    }
}

/* Keys of n tokens of packed block blk (from offset off), KV head hk, decoded into tile[j * D + c]: codes
 * times the block's per-channel scales (ksc, kze: float, already read) plus zeros, the outlier channels
 * in 16 bits. The one key decode: the attention below and the C step's block importance read keys here. */
static inline void dequant_keys(const QuantCache *kv, int32_t blk, int off, int n, int block, int hkv, int hk, int D,
                                const float *ksc, const float *kze, float *tile) {
    const int64_t cb = (int64_t)D * kv->bits / 8, tok = (int64_t)blk * block + off;
    unpack_rows(kv->k_codes + (tok * hkv + hk) * cb, (int64_t)hkv * cb, n, kv->bits, D, tile);
    for (int j = 0; j < n; j++) {
        float *kr = tile + j * D;
        for (int i = 0; i < D; i++) kr[i] = kr[i] * ksc[i] + kze[i];
        if (kv->outlier_idx) { /* dense-and-sparse: the kept 16-bit channels */
            const int o_n = kv->n_outlier;
            const int64_t *oi = kv->outlier_idx + (int64_t)hk * o_n;
            const float *ov = kv->k_outlier + ((tok + j) * hkv + hk) * o_n;
            for (int o = 0; o < o_n; o++) kr[oi[o]] = ov[o];
        }
    }
}

/* Values of n tokens from flat token row tok (consecutive tokens of one block), KV head hk, decoded into
 * tile[j * D + c]: codes times their token's per-group scale plus zero (fp16, widened per channel first so
 * the last loop runs over D contiguous floats). The one value decode: the attention below and
 * sinkserve_quant_token read values here. */
static inline void dequant_values(const QuantCache *kv, int64_t tok, int n, int hkv, int hk, int D, float *tile) {
    const int64_t cb = (int64_t)D * kv->bits / 8;
    const int ng = D / kv->group, G = kv->group;
    float vsc[256], vze[256];
    unpack_rows(kv->v_codes + (tok * hkv + hk) * cb, (int64_t)hkv * cb, n, kv->bits, D, tile);
    for (int j = 0; j < n; j++) {
        float *vr = tile + j * D;
        const int64_t vo = ((tok + j) * hkv + hk) * ng;
        for (int e = 0; e < ng; e++) {
            const float a = half_to_float(kv->v_scale[vo + e]), b = half_to_float(kv->v_zero[vo + e]);
            for (int i = 0; i < G; i++) { vsc[e * G + i] = a; vze[e * G + i] = b; }
        }
        for (int i = 0; i < D; i++) vr[i] = vr[i] * vsc[i] + vze[i];
    }
}

static inline void key_scales(const QuantCache *kv, int32_t blk, int hkv, int hk, int D, float *ksc, float *kze) {
    const int64_t so = ((int64_t)blk * hkv + hk) * D;
    for (int i = 0; i < D; i++) {
        ksc[i] = half_to_float(kv->k_scale[so + i]);
        kze[i] = half_to_float(kv->k_zero[so + i]);
    }
}

const float *sinkserve_quant_keys(const QuantCache *kv, int32_t blk, int off, int n, int block, int hkv, int hk,
                                  int d, float *tile, int64_t *stride) {
    const int32_t slot = kv->fp_index[blk];
    if (slot >= 0) { /* a 16-bit block: read in place */
        *stride = (int64_t)hkv * d;
        return kv->fp_k + (((int64_t)slot * block + off) * hkv + hk) * d;
    }
    float ksc[256], kze[256];
    key_scales(kv, blk, hkv, hk, d, ksc, kze);
    dequant_keys(kv, blk, off, n, block, hkv, hk, d, ksc, kze, tile);
    *stride = d;
    return tile;
}

void sinkserve_quant_token(const QuantCache *kv, int64_t slot, int block, int hkv, int d, float *k, float *v) {
    const int32_t blk = (int32_t)(slot / block), off = (int)(slot % block), fp = kv->fp_index[blk];
    if (fp >= 0) { /* a 16-bit block */
        const int64_t o = ((int64_t)fp * block + off) * hkv * d;
        memcpy(k, kv->fp_k + o, sizeof(float) * hkv * d);
        memcpy(v, kv->fp_v + o, sizeof(float) * hkv * d);
        return;
    }
    float ksc[256], kze[256];
    for (int hk = 0; hk < hkv; hk++) {
        key_scales(kv, blk, hkv, hk, d, ksc, kze);
        dequant_keys(kv, blk, off, 1, block, hkv, hk, d, ksc, kze, k + (int64_t)hk * d);
        dequant_values(kv, slot, 1, hkv, hk, d, v + (int64_t)hk * d);
    }
}

/* One (sequence, KV head): G <= MAX_GROUP query heads q[g] (stride q_sh) over the keys at positions
 * lo..len-1 of `table`. D is a compile-time constant in the specialised copies below. */
#define DEFINE_QHEAD(NAME, DCONST)                                                                         \
static void NAME(const float *q, int64_t q_sh, const QuantCache *kv, const int32_t *table, int32_t lo,     \
                 int32_t len, int block, int hkv, int hk, int g_n, int d_rt, float scale,                  \
                 const float *sinks, float *out) {                                                         \
    enum { DM = DCONST > 0 ? DCONST : 256 };                                                               \
    const int D = DCONST > 0 ? DCONST : d_rt;                                                              \
    const int chunk_max = TILE_FLOATS / D < MAX_CHUNK ? TILE_FLOATS / D : MAX_CHUNK;                       \
    const int64_t f_stride = (int64_t)hkv * D;      /* floats between two tokens of a 16-bit block */     \
    float qs[MAX_GROUP][DM], acc[MAX_GROUP][DM], m[MAX_GROUP], l[MAX_GROUP];                               \
    float s[MAX_GROUP][MAX_CHUNK];                                                                         \
    float kt[TILE_FLOATS], vt[TILE_FLOATS], ksc[DM], kze[DM];                                              \
    for (int g = 0; g < g_n; g++) {                                                                        \
        for (int i = 0; i < D; i++) { qs[g][i] = q[g * q_sh + i] * scale; acc[g][i] = 0.0f; }              \
        m[g] = sinks ? sinks[g] : 0.0f;                                                                    \
        l[g] = sinks ? 1.0f : 0.0f;                                                                        \
    }                                                                                                      \
    int started = sinks != NULL, seen = 0;                                                                 \
    for (int32_t pos = lo; pos < len;) {                                                                   \
        const int32_t bi = pos / block;                                                                    \
        const int32_t end = (bi + 1) * block < len ? (bi + 1) * block : len;                               \
        const int32_t blk = table[bi];                                                                     \
        if (blk == 0) { pos = end; continue; }                                                             \
        const int32_t slot = kv->fp_index[blk];                                                            \
        if (slot < 0) key_scales(kv, blk, hkv, hk, D, ksc, kze); /* the block's, once */                  \
        while (pos < end) {                                                                                \
            const int n = end - pos < chunk_max ? end - pos : chunk_max;                                   \
            const int64_t tok = (int64_t)blk * block + pos % block; /* first token row of the chunk */    \
            const float *kp, *vp;                                                                          \
            int64_t ks;                                                                                    \
            if (slot >= 0) {                                                                               \
                const int64_t fo = (((int64_t)slot * block + pos % block) * hkv + hk) * D;                 \
                kp = kv->fp_k + fo; vp = kv->fp_v + fo; ks = f_stride;                                     \
            } else {                                                                                       \
                dequant_keys(kv, blk, pos % block, n, block, hkv, hk, D, ksc, kze, kt);                    \
                dequant_values(kv, tok, n, hkv, hk, D, vt);                                                \
                kp = kt; vp = vt; ks = D;                                                                  \
            }                                                                                              \
            for (int j = 0; j < n; j++) {                                                                  \
                const float *kr = kp + j * ks;                                                             \
                for (int g = 0; g < g_n; g++) {                                                            \
                    float a = 0.0f;                                                                        \
                    for (int i = 0; i < D; i++) a += qs[g][i] * kr[i];                                     \
                    s[g][j] = a;                                                                           \
                }                                                                                          \
            }                                                                                              \
            for (int g = 0; g < g_n; g++) {                                                                \
                float bm = s[g][0];                                                                        \
                for (int j = 1; j < n; j++) bm = s[g][j] > bm ? s[g][j] : bm;                              \
                if (!started || bm > m[g]) {                                                               \
                    const float a = started ? expf(m[g] - bm) : 0.0f;                                      \
                    for (int i = 0; i < D; i++) acc[g][i] *= a;                                            \
                    l[g] *= a;                                                                             \
                    m[g] = bm;                                                                             \
                }                                                                                          \
                float sum = 0.0f;                                                                          \
                for (int j = 0; j < n; j++) { s[g][j] = expf(s[g][j] - m[g]); sum += s[g][j]; }            \
                l[g] += sum;                                                                               \
            }                                                                                              \
            started = 1;                                                                                   \
            for (int j = 0; j < n; j++) {                                                                  \
                const float *vr = vp + j * ks;                                                             \
                for (int g = 0; g < g_n; g++) {                                                            \
                    const float p = s[g][j];                                                               \
                    for (int i = 0; i < D; i++) acc[g][i] += p * vr[i];                                    \
                }                                                                                          \
            }                                                                                              \
            pos += n;                                                                                      \
            seen += n;                                                                                     \
        }                                                                                                  \
    }                                                                                                      \
    for (int g = 0; g < g_n; g++) {                                                                        \
        const float inv = seen ? 1.0f / l[g] : 0.0f;                                                       \
        for (int i = 0; i < D; i++) out[(int64_t)g * D + i] = acc[g][i] * inv;                             \
    }                                                                                                      \
}

DEFINE_QHEAD(qhead_d32, 32)
DEFINE_QHEAD(qhead_d64, 64)
DEFINE_QHEAD(qhead_d128, 128)
DEFINE_QHEAD(qhead_any, 0)

int sinkserve_decode_attention_quant(const float *q, int64_t q_st, int64_t q_sh, const QuantCache *kv,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d,
                                     int block, float scale, int window, const float *sinks, float *out) {
    if (d > 256 || d < 4 || d % 4) return -2; /* the packings need D % 4 == 0 (int2: quarters); chunks >= 8 tokens */
    if (kv->bits != 8 && kv->bits != 4 && kv->bits != 2) return -3;
    if (kv->group <= 0 || d % kv->group) return -4;
    const int g_per = hq / hkv;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t t = query_start_loc[s];
        if (query_start_loc[s + 1] - t != 1) continue;
        const int32_t len = seq_lens[s];
        const int32_t lo = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
        for (int hk = 0; hk < hkv; hk++) {
            for (int g0 = 0; g0 < g_per; g0 += MAX_GROUP) {
                const int g_n = g_per - g0 < MAX_GROUP ? g_per - g0 : MAX_GROUP;
                const int h0 = hk * g_per + g0;
                const float *qp = q + t * q_st + h0 * q_sh;
                float *op = out + ((int64_t)t * hq + h0) * d;
                const float *sp = sinks ? sinks + h0 : NULL;
                if (d == 32)
                    qhead_d32(qp, q_sh, kv, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else if (d == 64)
                    qhead_d64(qp, q_sh, kv, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else if (d == 128)
                    qhead_d128(qp, q_sh, kv, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else
                    qhead_any(qp, q_sh, kv, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
            }
        }
    }
    return 0;
}
