/* Decode attention over the paged KV cache, one thread: the CPU backend's kernel and the C decode step's
 * (sinkserve_kernels/cpu_attention.py and decode_step.c call it; sinkserve_kernels/torch_kernels.py is the
 * ground truth). One core for both caches the engine keeps:
 *
 *   float32 cache   k_cache / v_cache [num_blocks, B, Hkv, D], every block read in place
 *   packed cache    one layer's QuantCache (int8 / int4 / int2; sinkserve_kernels/kv_quant.py's layout):
 *     fp_index[blk] >= 0  -> 16-bit block: fp_k / fp_v [NF, B, H, D] float32, slot fp_index[blk], in place
 *     fp_index[blk] <  0  -> packed block: codes k_codes / v_codes [NB, B, H, D * bits / 8] uint8,
 *                            keys   x = code * k_scale[blk, h, c] + k_zero[blk, h, c]      (per channel)
 *                            values x = code * v_scale[blk, t, h, c / G] + v_zero[...]     (per token, G channels)
 *                            scales / zeros fp16; outlier key channels (optional): key channel
 *                            outlier_idx[h, o] of token t is k_outlier[blk, t, h, o] (float32), not its code
 *
 *     byte c of a token-head row holds (torch_kernels.pack_codes):
 *       int8: channel c                     int4: bits 3..0 channel c, bits 7..4 channel c + D/2
 *       int2: bits 2i+1..2i channel c + i * D/4   (i = 0..3)
 *
 * Semantics, for every sequence s whose query segment is one token (query_start_loc[s+1] -
 * query_start_loc[s] == 1) and every KV head, the G = Hq / Hkv query heads of that KV head:
 *
 *     keys of s:  positions lo .. seq_len-1, block = table[s][pos / B], slot pos % B
 *                 lo = max(0, seq_len - window) for a sliding-window layer (window <= 0: 0)
 *                 a table entry 0 (the null block: evicted) contributes nothing
 *     scores[g][j] = scale * <q[g], k_j>;  p = softmax over j (plus exp(sink[h]) in the denominator
 *     when sinks are given);  out[h] = sum_j p_j v_j;  no visible key -> zeros
 *
 * Sequences with longer segments (prefill chunks) are skipped: their rows are left to the caller.
 * Layouts: q [T, Hq, D] with strides (q_st, q_sh, 1); every cache tensor contiguous; out contiguous
 * [T, Hq, D]; block_tables int32 [S, bt_stride].
 *
 * One per-sequence driver (decode_rows) hands each sequence to one of two loops with the same semantics
 * (tests/kernels/test_cpu_attention*.py run both builds against the reference):
 *
 *   the online-softmax core (head_*), any CPU, any D <= 256, either cache: per (sequence, KV head, up to
 *     16 query heads), a chunk of up to TILE_FLOATS / D tokens of one block at a time -- read in place
 *     (float32 and 16-bit blocks) or decoded into two small tiles (packed blocks) -- scored, then
 *
 *       m' = max(m, max_j s_j);  a = exp(m - m');  acc = a * acc + sum_j exp(s_j - m') v_j
 *       l = a * l + sum_j exp(s_j - m');  with sinks m, l start at (sink, 1), else at the first chunk
 *
 *     so no score scratch sized by the context is needed, and a chunk's keys and values are read while
 *     in cache. D is a constant in the 32/64/128 copies.
 *   the AVX-512 path (seq512), float32 cache with D a multiple of 16 on a CPU that has it: one pass per
 *     sequence over every head, the next block prefetched; ~1.5-2x the core with the cache in L2/L3,
 *     ~2-4x from DRAM (bench/cpu_decode_attention.py, docs/cpu_decode_attention.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_attention.h"

#define MAX_GROUP 16      /* query heads per KV head handled in registers; larger groups loop over chunks */
#define TILE_FLOATS 2048  /* one decoded key (or value) tile: chunk = TILE_FLOATS / D tokens */
#define MAX_CHUNK 128     /* tokens per chunk at most (the score rows s[]): D = 4, 8 fill half a tile or less */

/* Where a decode query's keys and values live: a float32 paged cache (kv NULL) or a packed one. */
typedef struct {
    const float *k_cache, *v_cache;
    const QuantCache *kv;
} KVSource;

/* ---- packed blocks: the one decode of codes into floats ----------------------------------------------- */

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

/* ---- the online-softmax core ------------------------------------------------------------------------- */

/* One (sequence, KV head): G <= MAX_GROUP query heads q[g] (stride q_sh) over the keys at positions
 * lo..len-1 of `table`, read from `src`. D is a compile-time constant in the specialised copies below. */
#define DEFINE_HEAD(NAME, DCONST)                                                                          \
static void NAME(const float *q, int64_t q_sh, const KVSource *src, const int32_t *table, int32_t lo,      \
                 int32_t len, int block, int hkv, int hk, int g_n, int d_rt, float scale,                  \
                 const float *sinks, float *out) {                                                         \
    enum { DM = DCONST > 0 ? DCONST : 256 };                                                               \
    const int D = DCONST > 0 ? DCONST : d_rt;                                                              \
    const int chunk_max = TILE_FLOATS / D < MAX_CHUNK ? TILE_FLOATS / D : MAX_CHUNK;                       \
    const int64_t f_stride = (int64_t)hkv * D;      /* floats between two tokens of a float32 block */    \
    const QuantCache *kv = src->kv;                                                                        \
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
        /* a block read in place (its token 0, KV head hk), or packed: kb NULL */                          \
        const float *kb = NULL, *vb = NULL;                                                                \
        if (!kv) {                                                                                         \
            kb = src->k_cache + (int64_t)blk * block * f_stride + (int64_t)hk * D;                         \
            vb = src->v_cache + (int64_t)blk * block * f_stride + (int64_t)hk * D;                         \
        } else if (kv->fp_index[blk] >= 0) {                                                               \
            kb = kv->fp_k + (int64_t)kv->fp_index[blk] * block * f_stride + (int64_t)hk * D;               \
            vb = kv->fp_v + (int64_t)kv->fp_index[blk] * block * f_stride + (int64_t)hk * D;               \
        } else {                                                                                           \
            key_scales(kv, blk, hkv, hk, D, ksc, kze); /* the block's, once */                             \
        }                                                                                                  \
        while (pos < end) {                                                                                \
            const int n = end - pos < chunk_max ? end - pos : chunk_max;                                   \
            const float *kp, *vp;                                                                          \
            int64_t ks;                                                                                    \
            if (kb) {                                                                                      \
                kp = kb + (pos % block) * f_stride; vp = vb + (pos % block) * f_stride; ks = f_stride;     \
            } else {                                                                                       \
                dequant_keys(kv, blk, pos % block, n, block, hkv, hk, D, ksc, kze, kt);                    \
                dequant_values(kv, (int64_t)blk * block + pos % block, n, hkv, hk, D, vt);                 \
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

DEFINE_HEAD(head_d32, 32)
DEFINE_HEAD(head_d64, 64)
DEFINE_HEAD(head_d128, 128)
DEFINE_HEAD(head_any, 0)

/* ---- the AVX-512 path (float32 cache) ---------------------------------------------------------------- */

#ifdef __AVX512F__
/* The AVX-512 path. Per sequence, one pass over its keys in chunks of up to 16 positions of one block
 * for all its query heads (so a token's row -- every KV head -- is read once, whole), K and V of a chunk
 * together, with an online softmax:
 *
 *   scores   per query head g: 16 partial vectors q[g] * k_j (D/16 FMAs each), summed across lanes by
 *            one transpose-add tree (45 shuffles/adds for 16 keys, not ~8 per key): key j's score in lane j
 *   softmax  where a live score passes the running max m: m' = the chunk's max, a = e^(m - m'), else a = 1;
 *            p = e^(s - m);  l = l * a + p (lane-wise; summed at the end);  acc *= a
 *   values   acc[g] += p[g][j] * v_j in register tiles of up to 4 heads x 64 dims, loaded and stored once
 *            per chunk (not once per FMA)
 *   end      out[g] = acc[g] * r / (l * r + e^(sink - m*))   with m* = max(m, sink), r = e^(m - m*)
 *
 *   e.g. B = 16, Hkv = 2, Hq = 8, D = 32, keys 0..39 in blocks [7 | 0 | 3]:
 *     chunk 0: block 7 slots 0..15 (block 3 prefetched meanwhile)  -- heads 0-3 read K/V[.., 0, :],
 *                                                                     heads 4-7 K/V[.., 1, :]
 *     block 0: null, skipped
 *     chunk 1: block 3 slots 0..7, lanes 8..15 masked (their keys point at a zero row), the next decode
 *              sequence's first block prefetched meanwhile
 *
 * Heads are processed PASS_FLOATS / D at a time (all of them unless Hq x D > 4,096: 32 x 128). */
#include <immintrin.h>

#define KEYS 16 /* keys per chunk: one per vector lane */
#define INLINE static inline __attribute__((always_inline))

static const float zero_row[256] __attribute__((aligned(64)));

/* e^x for x <= 0 (every argument is a score minus the running maximum): Cephes' expf polynomial on
 * r = x - n ln2 (|r| <= ln2 / 2, ~1 ulp), times 2^n by vscalefps. x is clamped at -86: e^-86 ~ 4e-38
 * stays a normal float (no denormal arithmetic), and next to the maximum's weight 1 it is nothing. */
INLINE __m512 exp_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-86.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* The transpose-add tree. Within each 128-bit lane: a, b -> [a b a b] partials (unpack), then
 * ab, cd -> [a b c d] (shuffle); across lanes: two [k0..k3 | k0..k3 | k4..k7 | k4..k7]-style halvings. */
INLINE __m512 add_pair(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
INLINE __m512 add_quad(__m512 ab, __m512 cd) {
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}
INLINE __m512 add_lanes(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* lane j of the result = the sum of part[j]'s 16 lanes */
INLINE __m512 sum16(const __m512 *part) {
    __m512 c[4];
    for (int i = 0; i < 4; i++)
        c[i] = add_quad(add_pair(part[4 * i], part[4 * i + 1]), add_pair(part[4 * i + 2], part[4 * i + 3]));
    return add_lanes(add_lanes(c[0], c[1]), add_lanes(c[2], c[3]));
}

/* acc[gi][d0 .. d0 + 16 DT) = acc * alpha[gi] + sum_j p[gi][j] * v_j[d0 ..] for GT heads: GT x DT
 * accumulators in registers for the chunk's n keys. */
INLINE void value_tile(float *acc, const float *p, const float *alpha, const float *vc, int64_t tok_stride,
                       int n, int D, int d0, const int GT, const int DT) {
    __m512 r[4][4];
    for (int gi = 0; gi < GT; gi++) {
        const __m512 a = _mm512_set1_ps(alpha[gi]);
        for (int c = 0; c < DT; c++) r[gi][c] = _mm512_mul_ps(_mm512_load_ps(acc + gi * D + d0 + 16 * c), a);
    }
    for (int j = 0; j < n; j++) {
        const float *vp = vc + j * tok_stride + d0;
        __m512 v[4];
        for (int c = 0; c < DT; c++) {
            v[c] = _mm512_loadu_ps(vp + 16 * c);
            __asm__("" : "+v"(v[c])); /* keep v_j in a register: GCC would fold the load into every head's FMA */
        }
        for (int gi = 0; gi < GT; gi++) {
            const __m512 pb = _mm512_set1_ps(p[gi * KEYS + j]);
            for (int c = 0; c < DT; c++) r[gi][c] = _mm512_fmadd_ps(pb, v[c], r[gi][c]);
        }
    }
    for (int gi = 0; gi < GT; gi++)
        for (int c = 0; c < DT; c++) _mm512_store_ps(acc + gi * D + d0 + 16 * c, r[gi][c]);
}

#define PASS_FLOATS 4096 /* q and acc floats per pass over a sequence's keys: its heads x D */
#define PF_HINT _MM_HINT_T1
#define PF_DIST 1 /* blocks ahead (1, 2 and 3 measured alike) */

/* The prefetch of one block's K and V rows (into L2: with T0 the random-block read rate stayed where it
 * was), issued a slice at a time between the heads' score loops instead of in one burst: a burst fills
 * the miss queues and stalls the computation behind it. */
typedef struct {
    const char *k, *v;
    int64_t off, end, step;
} Prefetch;

INLINE void pf_some(Prefetch *pf) {
    const int64_t stop = pf->off + pf->step < pf->end ? pf->off + pf->step : pf->end;
    for (; pf->off < stop; pf->off += 64) {
        _mm_prefetch(pf->k + pf->off, PF_HINT);
        _mm_prefetch(pf->v + pf->off, PF_HINT);
    }
}

/* One sequence's keys: positions lo .. len-1 of the blocks `table` names. */
typedef struct {
    const int32_t *table;
    int32_t lo, len;
} Span;

/* Finish the previous block's prefetch, then aim at block bi of `sp` (none past its end or where
 * `sp` is NULL), spread over `slices` calls of pf_some. */
INLINE void pf_start(Prefetch *pf, const float *k_cache, const float *v_cache, const Span *sp, int32_t bi,
                     int block, int64_t tok_stride, int slices) {
    pf->step = pf->end;
    pf_some(pf);
    pf->off = pf->end = 0;
    if (!sp) return;
    const int32_t first = bi * block;
    if (first >= sp->len || sp->table[bi] == 0) return;
    const int32_t rows = sp->len - first < block ? sp->len - first : block;
    const int64_t base = (int64_t)sp->table[bi] * block * tok_stride;
    pf->k = (const char *)(k_cache + base);
    pf->v = (const char *)(v_cache + base);
    pf->end = (int64_t)rows * tok_stride * 4; /* a multiple of 64: D % 16 == 0 */
    pf->step = (pf->end / 64 + slices - 1) / slices * 64;
}

/* One sequence's one-token query (q: its Hq heads, stride q_sh; out: its [Hq, D] rows) over `cur`, D a
 * multiple of 16 (a constant in the specialised copies). The last blocks prefetch the first ones of
 * `next` (the following decode sequence; NULL: none); `primed`: this sequence's first blocks were. */
INLINE void seq512(const float *q, int64_t q_sh, const float *k_cache, const float *v_cache, const Span *cur,
                   const Span *next, int primed, int block, int hq, int hkv, const int D, float scale,
                   const float *sinks, float *out) {
    const int32_t *table = cur->table, lo = cur->lo, len = cur->len;
    const int32_t nblocks = (len + block - 1) / block;
    const int NV = D / 16, G = hq / hkv;
    const int64_t tok_stride = (int64_t)hkv * D;
    __attribute__((aligned(64))) float qs[PASS_FLOATS], acc[PASS_FLOATS];
    __attribute__((aligned(64))) float p[PASS_FLOATS / 16 * KEYS], lsum[PASS_FLOATS / 16 * KEYS];
    float m[PASS_FLOATS / 16], alpha[PASS_FLOATS / 16];
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h0 = 0; h0 < hq;) {
        const int h1 = hq - h0 < PASS_FLOATS / D ? hq : h0 + PASS_FLOATS / D, nh = h1 - h0;
        for (int h = 0; h < nh; h++) {
            for (int c = 0; c < NV; c++) {
                _mm512_store_ps(qs + h * D + 16 * c,
                                _mm512_mul_ps(_mm512_loadu_ps(q + (h0 + h) * q_sh + 16 * c), vscale));
                _mm512_store_ps(acc + h * D + 16 * c, _mm512_setzero_ps());
            }
            _mm512_store_ps(lsum + h * KEYS, _mm512_setzero_ps());
        }
        int seen = 0;
        Prefetch pf = {0};
        for (int i = 0; i < PF_DIST && !(primed && h0 == 0); i++) {
            pf_start(&pf, k_cache, v_cache, cur, lo / block + i, block, tok_stride, 1);
            pf_some(&pf);
        }
        for (int32_t pos = lo; pos < len;) {
            const int32_t bi = pos / block;
            const int32_t end = (bi + 1) * block < len ? (bi + 1) * block : len;
            const int32_t blk = table[bi];
            const int32_t ahead = bi + PF_DIST; /* past the end: the next sequence's first blocks */
            if (ahead < nblocks)
                pf_start(&pf, k_cache, v_cache, cur, ahead, block, tok_stride, (end - pos + KEYS - 1) / KEYS * nh);
            else
                pf_start(&pf, k_cache, v_cache, h1 == hq ? next : NULL,
                         next ? next->lo / block + ahead - nblocks : 0, block, tok_stride,
                         (end - pos + KEYS - 1) / KEYS * nh);
            if (blk == 0) { pos = end; continue; }
            const int64_t base = ((int64_t)blk * block) * tok_stride;
            for (; pos < end;) {
                const int n = end - pos < KEYS ? end - pos : KEYS;
                const int64_t off = base + (int64_t)(pos % block) * tok_stride;
                const __mmask16 live = (__mmask16)((1u << n) - 1u);
                /* the heads h0 .. h1-1 in runs sharing a KV head: [h, hn) reads KV head hk */
                for (int h = h0; h < h1;) {
                    const int hk = h / G, hn = (hk + 1) * G < h1 ? (hk + 1) * G : h1;
                    const float *kc = k_cache + off + (int64_t)hk * D, *vc = v_cache + off + (int64_t)hk * D;
                    const float *kp[KEYS];
                    for (int j = 0; j < KEYS; j++) kp[j] = j < n ? kc + j * tok_stride : zero_row;
                    for (int g = h - h0; g < hn - h0; g++) {
                        pf_some(&pf);
                        const float *qg = qs + g * D;
                        __m512 part[KEYS];
                        for (int j = 0; j < KEYS; j++) {
                            __m512 a = _mm512_mul_ps(_mm512_load_ps(qg), _mm512_loadu_ps(kp[j]));
                            for (int c = 1; c < NV; c++)
                                a = _mm512_fmadd_ps(_mm512_load_ps(qg + 16 * c), _mm512_loadu_ps(kp[j] + 16 * c), a);
                            part[j] = a;
                        }
                        _mm512_store_ps(p + g * KEYS, sum16(part)); /* the scores, for now */
                    }
                    /* softmax apart from the score loop: the heads' exp chains (~15 dependent ops) overlap */
                    for (int g = h - h0; g < hn - h0; g++) {
                        const __m512 s = _mm512_load_ps(p + g * KEYS);
                        /* the horizontal max only when a live score passes the running one (after the
                         * first chunks, rarely): otherwise nothing is rescaled */
                        float a = 1.0f;
                        if (!seen || _mm512_mask_cmp_ps_mask(live, s, _mm512_set1_ps(m[g]), _CMP_GT_OQ)) {
                            const float mx = _mm512_mask_reduce_max_ps(live, s);
                            a = seen ? expf(m[g] - mx) : 0.0f;
                            m[g] = mx;
                        }
                        alpha[g] = a;
                        const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
                        _mm512_store_ps(p + g * KEYS, e);
                        _mm512_store_ps(lsum + g * KEYS,
                                        _mm512_fmadd_ps(_mm512_load_ps(lsum + g * KEYS), _mm512_set1_ps(a), e));
                    }
                    for (int d0 = 0; d0 < D; d0 += 64) {
                        const int dt = D - d0 >= 64 ? 4 : (D - d0) / 16;
                        for (int g0 = h - h0; g0 < hn - h0; g0 += 4) {
                            const int gt = hn - h0 - g0 >= 4 ? 4 : hn - h0 - g0;
                            float *at = acc + g0 * D;
                            const float *pt = p + g0 * KEYS, *al = alpha + g0;
#define VT(GT, DT) case GT * 4 + DT: value_tile(at, pt, al, vc, tok_stride, n, D, d0, GT, DT); break;
                            switch (gt * 4 + dt) {
                                VT(1, 1) VT(1, 2) VT(1, 3) VT(1, 4) VT(2, 1) VT(2, 2) VT(2, 3) VT(2, 4)
                                VT(3, 1) VT(3, 2) VT(3, 3) VT(3, 4) VT(4, 1) VT(4, 2) VT(4, 3) VT(4, 4)
                            }
#undef VT
                        }
                    }
                    h = hn;
                }
                seen = 1;
                pos += n;
            }
        }
        for (int g = 0; g < nh; g++) {
            float *o = out + (int64_t)(h0 + g) * D;
            if (!seen) {
                memset(o, 0, sizeof(float) * D);
                continue;
            }
            /* with a sink: both sides rescaled to max(m, sink), as the portable path's maximum includes it */
            const float sink = sinks ? sinks[h0 + g] : 0.0f;
            const float l = _mm512_reduce_add_ps(_mm512_load_ps(lsum + g * KEYS));
            const float top = sinks && sink > m[g] ? sink : m[g];
            const float r = top == m[g] ? 1.0f : expf(m[g] - top);
            const float f = r / (l * r + (sinks ? expf(sink - top) : 0.0f));
            const __m512 vf = _mm512_set1_ps(f);
            for (int c = 0; c < NV; c++)
                _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + g * D + 16 * c), vf));
        }
        h0 = h1;
    }
}

#define DEFINE_SEQ512(NAME, DCONST)                                                                        \
static void NAME(const float *q, int64_t q_sh, const float *k_cache, const float *v_cache, const Span *cur, \
                 const Span *next, int primed, int block, int hq, int hkv, int d_rt, float scale,          \
                 const float *sinks, float *out) {                                                         \
    seq512(q, q_sh, k_cache, v_cache, cur, next, primed, block, hq, hkv, DCONST > 0 ? DCONST : d_rt, scale, \
           sinks, out);                                                                                    \
}
DEFINE_SEQ512(seq_d32, 32)
DEFINE_SEQ512(seq_d64, 64)
DEFINE_SEQ512(seq_d128, 128)
DEFINE_SEQ512(seq_v16, 0) /* any other multiple of 16 */
#endif

/* ---- the one per-sequence driver --------------------------------------------------------------------- */

static int decode_rows(const float *q, int64_t q_st, int64_t q_sh, const KVSource *src, const int32_t *block_tables,
                       int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc, int num_seqs,
                       int hq, int hkv, int d, int block, float scale, int window, const float *sinks, float *out) {
    const int g_per = hq / hkv;
#ifdef __AVX512F__
    const int wide = !src->kv && d % 16 == 0; /* the AVX-512 path's cache and head dims */
    int primed = 0; /* the previous decode sequence prefetched this one's first blocks */
#endif
    for (int s = 0; s < num_seqs; s++) {
        const int32_t t = query_start_loc[s];
        if (query_start_loc[s + 1] - t != 1) continue;
        const int32_t len = seq_lens[s];
        const int32_t lo = (window > 0 && len > window) ? len - window : 0;
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
#ifdef __AVX512F__
        if (wide) {
            const float *qp = q + t * q_st;
            float *op = out + (int64_t)t * hq * d;
            const Span cur = {table, lo, len};
            Span next = {NULL, 0, 0};
            for (int s2 = s + 1; s2 < num_seqs && !next.table; s2++) /* the next decode sequence */
                if (query_start_loc[s2 + 1] - query_start_loc[s2] == 1) {
                    next.table = block_tables + (int64_t)s2 * bt_stride;
                    next.len = seq_lens[s2];
                    next.lo = (window > 0 && next.len > window) ? next.len - window : 0;
                }
            const Span *np = next.table ? &next : NULL;
            const float *kc = src->k_cache, *vc = src->v_cache;
            if (d == 32)
                seq_d32(qp, q_sh, kc, vc, &cur, np, primed, block, hq, hkv, d, scale, sinks, op);
            else if (d == 64)
                seq_d64(qp, q_sh, kc, vc, &cur, np, primed, block, hq, hkv, d, scale, sinks, op);
            else if (d == 128)
                seq_d128(qp, q_sh, kc, vc, &cur, np, primed, block, hq, hkv, d, scale, sinks, op);
            else
                seq_v16(qp, q_sh, kc, vc, &cur, np, primed, block, hq, hkv, d, scale, sinks, op);
            primed = 1;
            continue;
        }
#endif
        for (int hk = 0; hk < hkv; hk++) {
            for (int g0 = 0; g0 < g_per; g0 += MAX_GROUP) {
                const int g_n = g_per - g0 < MAX_GROUP ? g_per - g0 : MAX_GROUP;
                const int h0 = hk * g_per + g0;
                const float *qp = q + t * q_st + h0 * q_sh;
                float *op = out + ((int64_t)t * hq + h0) * d;
                const float *sp = sinks ? sinks + h0 : NULL;
                if (d == 32)
                    head_d32(qp, q_sh, src, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else if (d == 64)
                    head_d64(qp, q_sh, src, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else if (d == 128)
                    head_d128(qp, q_sh, src, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
                else
                    head_any(qp, q_sh, src, table, lo, len, block, hkv, hk, g_n, d, scale, sp, op);
            }
        }
    }
    return 0;
}

int sinkserve_decode_attention(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d, int block,
                               float scale, int window, const float *sinks, float *out) {
    if (d < 1 || d > 256) return -2;
    const KVSource src = {k_cache, v_cache, NULL};
    return decode_rows(q, q_st, q_sh, &src, block_tables, bt_stride, seq_lens, query_start_loc, num_seqs, hq, hkv,
                       d, block, scale, window, sinks, out);
}

int sinkserve_decode_attention_quant(const float *q, int64_t q_st, int64_t q_sh, const QuantCache *kv,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d,
                                     int block, float scale, int window, const float *sinks, float *out) {
    if (d > 256 || d < 4 || d % 4) return -2; /* the packings need D % 4 == 0 (int2: quarters); chunks >= 8 tokens */
    if (kv->bits != 8 && kv->bits != 4 && kv->bits != 2) return -3;
    if (kv->group <= 0 || d % kv->group) return -4;
    const KVSource src = {NULL, NULL, kv};
    return decode_rows(q, q_st, q_sh, &src, block_tables, bt_stride, seq_lens, query_start_loc, num_seqs, hq, hkv,
                       d, block, scale, window, sinks, out);
}
