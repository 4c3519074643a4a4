/* Activations rounded to int16 per row for the W8A16 / W4A16 GEMVs: portable C, shared by every ISA's kernels
 * (so each variant rounds x the same way and is held to the same bound). */
#ifndef IT_ACT_I16_H
#define IT_ACT_I16_H
#include "bf16.h"

/* ------------------------------------------------------------------ activations to int16 */

/* x [M, K] bf16 -> xq [M, Kp] int16 (zero padded to Kp, a multiple of 32), sx[m] = max|x_m| / 32767,
 * xsum[m * G + g] = sum of x over group g (of size gs) when xsum is not NULL. */
/* Activations are rounded to integers in [-X_QMAX, X_QMAX]: 127 * 256, so that the int8 kernel can split each
 * into two signed bytes (w8_block). */
#define X_QMAX 32512.0f

static inline void quantize_rows_i16(const bf16* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int16_t* xq,
                                     float* sx, float* xsum, int64_t gs) {
    for (int64_t m = 0; m < M; m++) {
        const bf16* xr = x + m * ldx;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float a = fabsf(bf2f(xr[k]));
            amax = a > amax ? a : amax;
        }
        float s = amax > 0.0f ? amax / X_QMAX : 1.0f;
        float inv = 1.0f / s;
        sx[m] = s;
        int16_t* q = xq + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            float v = nearbyintf(bf2f(xr[k]) * inv);
            v = v > X_QMAX ? X_QMAX : (v < -X_QMAX ? -X_QMAX : v);
            q[k] = (int16_t)v;
        }
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
        if (xsum) {
            for (int64_t g = 0; g < K / gs; g++) {
                float t = 0.0f;
                for (int64_t k = g * gs; k < (g + 1) * gs; k++) t += bf2f(xr[k]);
                xsum[m * (K / gs) + g] = t;
            }
        }
    }
}

#endif
