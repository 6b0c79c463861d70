/* The decode attention's interface (decode_attention.c): the KV a decode query reads -- a float32 paged cache
 * or one layer's packed (quantized) paged cache -- and the routines over it. Shared by decode_attention.c and
 * decode_step.c (the C decode step, which writes a step's new keys and values into the cache and attends
 * through the same routines). Packed layout: sinkserve_kernels/kv_quant.py; QuantCache's field order:
 * sinkserve_kernels/cpu_attention.py's QuantCacheArgs. */
#ifndef SINKSERVE_DECODE_ATTENTION_H
#define SINKSERVE_DECODE_ATTENTION_H
#include <stdint.h>

typedef struct {
    const uint8_t *k_codes, *v_codes;
    const uint16_t *k_scale, *k_zero, *v_scale, *v_zero; /* fp16 bits */
    float *fp_k, *fp_v;         /* the 16-bit side pool [NF, B, H, D] (float32 in the kernels' engines) */
    const int32_t *fp_index;    /* [NB]: the block's side-pool slot, or -1 when it is packed */
    const int64_t *outlier_idx; /* [H, O] or NULL */
    const float *k_outlier;     /* [NB, B, H, O] or NULL */
    int32_t bits, group, n_outlier;
} QuantCache;

/* Decode attention of every one-token query segment over a float32 paged cache k_cache / v_cache
 * [num_blocks, B, Hkv, D] (decode_attention.c's header has the semantics). Returns 0 or -2 (head_dim
 * out of range). */
int sinkserve_decode_attention(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d, int block,
                               float scale, int window, const float *sinks, float *out);

/* The same over a packed cache `kv`. Returns 0, -2 (head_dim out of range), -3 (bits), -4 (value group). */
int sinkserve_decode_attention_quant(const float *q, int64_t q_st, int64_t q_sh, const QuantCache *kv,
                                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                                     const int32_t *query_start_loc, int num_seqs, int hq, int hkv, int d,
                                     int block, float scale, int window, const float *sinks, float *out);

/* Keys of n tokens of block blk from offset off (within the block), KV head hk: a pointer to row 0, rows
 * *stride floats apart -- in place for a 16-bit block, else decoded into tile [n, d] (the attention's own
 * key decode, outlier channels included). */
const float *sinkserve_quant_keys(const QuantCache *kv, int32_t blk, int off, int n, int block, int hkv, int hk,
                                  int d, float *tile, int64_t *stride);

/* One token's keys and values, every KV head ([hkv, d] floats each), at flat slot `slot`: copied from the
 * 16-bit side pool, or decoded as the attention above decodes them (outlier channels included). The C
 * step's trained-indexer attention gathers its selected tokens through this. */
void sinkserve_quant_token(const QuantCache *kv, int64_t slot, int block, int hkv, int d, float *k, float *v);

#endif
