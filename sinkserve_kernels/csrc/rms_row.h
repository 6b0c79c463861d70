/* One RMSNorm row, shared by cpu_ops.c (the native forward's norms) and decode_step.c (the C decode step):
 * out = x / sqrt(mean(x^2) + eps) * w, or without the weight when w is NULL (Qwen3-style unweighted uses). */
#ifndef SINKSERVE_RMS_ROW_H
#define SINKSERVE_RMS_ROW_H
#include <math.h>

static inline void norm_row(const float *x, const float *w, float *out, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    if (w)
        for (int i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
    else
        for (int i = 0; i < n; i++) out[i] = x[i] * r;
}

#endif
