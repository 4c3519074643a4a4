/* ------------------------------------------------------------------ GEMVs on NEON
 *
 * The x86 libraries' three small-batch linears with the same entry points and the same contracts, for AArch64
 * (baseline Armv8-A Advanced SIMD: no dot-product, bf16 or SVE extensions needed). Each streams its weights once
 * per MRN rows of x, NRN weight rows at a time, prefetching ahead, threads splitting the output features:
 *   bf16   w and x widened to fp32 by a shift (the high half of an fp32 is a bf16), FMA into fp32 accumulators:
 *          the products are exact, the sums fp32, one rounding to bf16 at the end
 *   W8A16  x rounded per row to int16 (act_i16.h, as the x86 kernels), w sign-extended to int16, widening
 *          multiply-accumulate (SMLAL) into int32 lanes, flushed to an exact int64 every 1024 columns (no lane can
 *          overflow): the exact integer sum, rounded once, times the scales
 *   W4A16  the same int16 x, the nibbles widened to int16 (pack_w4's layout), SMLAL per group, each group's exact
 *          int32 sum times its scale; the zero term from the exact sums of x
 */

/* ---- bf16 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* (rows past nr are never loaded nor used) */
static inline __attribute__((always_inline)) void bf16_blockn(
    const bf16* x, int64_t ldx, int mr, const bf16* w, int nr, int64_t K, float out[MRN][NRN]) {
    float32x4_t acc[MRN][NRN];
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++) acc[i][j] = vdupq_n_f32(0.0f);
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        float32x4_t wl[NRN], wh[NRN];
        for (int j = 0; j < NRN; j++)
            if (j < nr) {
                __builtin_prefetch(w + j * K + k + PFN_BYTES / 2);
                const uint16x8_t wv = vld1q_u16(w + j * K + k);
                wl[j] = bf16x8_lo(wv), wh[j] = bf16x8_hi(wv);
            }
        for (int i = 0; i < MRN; i++)
            if (i < mr) {
                const uint16x8_t xv = vld1q_u16(x + i * ldx + k);
                const float32x4_t xl = bf16x8_lo(xv), xh = bf16x8_hi(xv);
                for (int j = 0; j < NRN; j++)
                    if (j < nr) acc[i][j] = vfmaq_f32(vfmaq_f32(acc[i][j], xl, wl[j]), xh, wh[j]);
            }
    }
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++)
            if (i < mr && j < nr) {
                float t = vaddvq_f32(acc[i][j]);
                for (int64_t k = k8; k < K; k++) t += bf2f(x[i * ldx + k]) * bf2f(w[j * K + k]);
                out[i][j] = t;
            }
}
#pragma GCC diagnostic pop

#define BF16_CASEN(MRC, NRC) bf16_blockn(x + m0 * ldx, ldx, MRC, wb, NRC, K, out)

/* (it_linear_bf16 in gemm.c: this GEMV at a few rows, the GEMM past them) */
static void linear_bf16_gemvn(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                              int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + NRN - 1) / NRN;
    const int nt = pick_threads(nblocks, N * K * 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NRN;
        const int nr = (int)(N - n0 < NRN ? N - n0 : NRN);
        const bf16* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MRN) {
            const int mr = (int)(M - m0 < MRN ? M - m0 : MRN);
            float out[MRN][NRN];
            DISPATCH_BLOCKN(BF16_CASEN)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++)
                    y[(m0 + i) * ldy + n0 + j] = f2bf(out[i][j] + (bias ? bf2f(bias[n0 + j]) : 0.0f));
        }
    }
}

/* ---- int8 weights, int16 activations */
#define W8_FLUSHN 1024 /* columns between flushes: 256 products of <= 32512 * 127 per int32 lane */

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w8_blockn(
    const int16_t* xq, int64_t Kp, int mr, const int8_t* w, int nr, int64_t K, float out[MRN][NRN]) {
    int64_t tot[MRN][NRN];
    int32x4_t acc[MRN][NRN];
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++) tot[i][j] = 0, acc[i][j] = vdupq_n_s32(0);
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k0 = 0; k0 < k8; k0 += W8_FLUSHN) {
        const int64_t k1 = k0 + W8_FLUSHN < k8 ? k0 + W8_FLUSHN : k8;
        for (int64_t k = k0; k < k1; k += 8) {
            int16x8_t wv[NRN];
            for (int j = 0; j < NRN; j++)
                if (j < nr) {
                    __builtin_prefetch(w + j * K + k + PFN_BYTES);
                    wv[j] = vmovl_s8(vld1_s8(w + j * K + k));
                }
            for (int i = 0; i < MRN; i++)
                if (i < mr) {
                    const int16x8_t xv = vld1q_s16(xq + i * Kp + k);
                    for (int j = 0; j < NRN; j++)
                        if (j < nr)
                            acc[i][j] = vmlal_high_s16(vmlal_s16(acc[i][j], vget_low_s16(xv), vget_low_s16(wv[j])), xv,
                                                       wv[j]);
                }
        }
        for (int i = 0; i < MRN; i++)
            for (int j = 0; j < NRN; j++)
                if (i < mr && j < nr) tot[i][j] += hsum4_s32(acc[i][j]), acc[i][j] = vdupq_n_s32(0);
    }
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++)
            if (i < mr && j < nr) {
                for (int64_t k = k8; k < K; k++) tot[i][j] += (int64_t)xq[i * Kp + k] * w[j * K + k];
                out[i][j] = (float)tot[i][j]; /* the exact integer sum, rounded once */
            }
}
#pragma GCC diagnostic pop

#define W8_CASEN(MRC, NRC) w8_blockn(xq + m0 * Kp, Kp, MRC, wb, NRC, K, out)

/* int16 activations [M, Kp], their scales [M], the group sums of x [M, K / 64 at most] */
static inline int64_t q_scratch_bytes(int64_t M, int64_t K) {
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    return (M * Kp * 2 + M * 4 + M * (K / 64 + 1) * 4 + 255) & ~(int64_t)63;
}

/* scratch: q_scratch_bytes(M, K), 64-byte aligned (the fused step's comes from its workspace) */
static void linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                      const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    const int64_t Kp = (K + 63) & ~(int64_t)63;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, NULL, 1);
    const int64_t nblocks = (N + NRN - 1) / NRN;
    const int nt = pick_threads(nblocks, N * K, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NRN;
        const int nr = (int)(N - n0 < NRN ? N - n0 : NRN);
        const int8_t* wb = w + n0 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MRN) {
            const int mr = (int)(M - m0 < MRN ? M - m0 : MRN);
            float out[MRN][NRN];
            DISPATCH_BLOCKN(W8_CASEN)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int64_t n = n0 + j;
                    const float s = scale_is_f32 ? ((const float*)scale)[n] : bf2f(((const bf16*)scale)[n]);
                    y[(m0 + i) * ldy + n] = f2bf(out[i][j] * sx[m0 + i] * s + (bias ? bf2f(bias[n]) : 0.0f));
                }
        }
    }
}

void it_linear_w8(const bf16* x, int64_t ldx, const int8_t* w, const void* scale, int scale_is_f32,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)q_scratch_bytes(M, K));
    linear_w8(x, ldx, w, scale, scale_is_f32, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* ---- int4 weights, int16 activations (pack_w4: per 64 columns from k0, byte b holds column k0 + b in its low
 * nibble and k0 + 32 + b in its high one; K % gs == 0, gs % 64 == 0, checked by the caller) */
static inline int32x4_t w4_madd16(int32x4_t acc, uint8x8_t nib, const int16_t* xr) { /* 8 nibbles x 8 int16 */
    const int16x8_t wv = vreinterpretq_s16_u16(vmovl_u8(nib));
    const int16x8_t xv = vld1q_s16(xr);
    return vmlal_high_s16(vmlal_s16(acc, vget_low_s16(xv), vget_low_s16(wv)), xv, wv);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
static inline __attribute__((always_inline)) void w4_blockn(
    const int16_t* xq, int64_t Kp, const float* xsum, int mr, const uint8_t* w, int nr, int64_t K, int64_t gs,
    const float* scale, const float* zero, float out[MRN][NRN], float zout[MRN][NRN]) {
    const int64_t G = K / gs;
    float tot[MRN][NRN];
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++) tot[i][j] = 0.0f;
    const uint8x16_t lo4 = vdupq_n_u8(0x0f);
    for (int64_t g = 0; g < G; g++) {
        int32x4_t acc[MRN][NRN];
        for (int i = 0; i < MRN; i++)
            for (int j = 0; j < NRN; j++) acc[i][j] = vdupq_n_s32(0);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 64) {
            for (int j = 0; j < NRN; j++) {
                if (j < nr) {
                    const uint8_t* p = w + j * (K / 2) + k / 2;
                    __builtin_prefetch(p + PFN_BYTES);
                    const uint8x16_t b0 = vld1q_u8(p), b1 = vld1q_u8(p + 16);
                    const uint8x16_t l0 = vandq_u8(b0, lo4), l1 = vandq_u8(b1, lo4); /* columns k .. k + 31 */
                    const uint8x16_t h0 = vshrq_n_u8(b0, 4), h1 = vshrq_n_u8(b1, 4);   /* k + 32 .. k + 63 */
                    for (int i = 0; i < MRN; i++) {
                        if (i < mr) {
                            const int16_t* xr = xq + i * Kp + k;
                            int32x4_t s = acc[i][j];
                            s = w4_madd16(s, vget_low_u8(l0), xr);
                            s = w4_madd16(s, vget_high_u8(l0), xr + 8);
                            s = w4_madd16(s, vget_low_u8(l1), xr + 16);
                            s = w4_madd16(s, vget_high_u8(l1), xr + 24);
                            s = w4_madd16(s, vget_low_u8(h0), xr + 32);
                            s = w4_madd16(s, vget_high_u8(h0), xr + 40);
                            s = w4_madd16(s, vget_low_u8(h1), xr + 48);
                            s = w4_madd16(s, vget_high_u8(h1), xr + 56);
                            acc[i][j] = s;
                        }
                    }
                }
            }
        }
        for (int i = 0; i < MRN; i++)
            for (int j = 0; j < NRN; j++)
                if (i < mr && j < nr) tot[i][j] += (float)hsum4_s32(acc[i][j]) * scale[j * G + g];
    }
    for (int i = 0; i < MRN; i++)
        for (int j = 0; j < NRN; j++)
            if (i < mr && j < nr) {
                float z = 0.0f; /* sum_g zero_g * (sum of x over g), with the exact sums of x */
                for (int64_t g = 0; g < G; g++) z += zero[j * G + g] * xsum[i * G + g];
                out[i][j] = tot[i][j];
                zout[i][j] = z;
            }
}
#pragma GCC diagnostic pop

#define W4_CASEN(MRC, NRC) w4_blockn(xq + m0 * Kp, Kp, xsum + m0 * G, MRC, wb, NRC, K, gs, scale + n0 * G, \
                                     zero + n0 * G, out, zout)

static void linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero,
                      int64_t gs, const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads,
                      void* scratch) {
    const int64_t Kp = (K + 63) & ~(int64_t)63, G = K / gs;
    int16_t* xq = (int16_t*)scratch;
    float* sx = (float*)(xq + M * Kp);
    float* xsum = sx + M;
    quantize_rows_i16(x, ldx, M, K, Kp, xq, sx, xsum, gs);
    const int64_t nblocks = (N + NRN - 1) / NRN;
    const int nt = pick_threads(nblocks, N * K / 2, nthreads);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * NRN;
        const int nr = (int)(N - n0 < NRN ? N - n0 : NRN);
        const uint8_t* wb = w + n0 * (K / 2);
        for (int64_t m0 = 0; m0 < M; m0 += MRN) {
            const int mr = (int)(M - m0 < MRN ? M - m0 : MRN);
            float out[MRN][NRN], zout[MRN][NRN];
            DISPATCH_BLOCKN(W4_CASEN)
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int64_t n = n0 + j;
                    y[(m0 + i) * ldy + n] = f2bf(out[i][j] * sx[m0 + i] + zout[i][j] + (bias ? bf2f(bias[n]) : 0.0f));
                }
        }
    }
}

void it_linear_w4(const bf16* x, int64_t ldx, const uint8_t* w, const float* scale, const float* zero, int64_t gs,
                  const bf16* bias, bf16* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)q_scratch_bytes(M, K));
    linear_w4(x, ldx, w, scale, zero, gs, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}

/* ---- dense weights for prefills: w = bf16(q * bf16(s)) for int8, bf16(q * s + z) (fp32 multiply, then add) for
 * int4, bit for bit the PyTorch references (as the x86 libraries) */
static inline float w8_scalen(const void* scale, int scale_is_f32, int64_t n) {
    return bf2f(scale_is_f32 ? f2bf(((const float*)scale)[n]) : ((const bf16*)scale)[n]);
}

void it_dequant_w8(const int8_t* q, const void* scale, int scale_is_f32, bf16* out, int64_t N, int64_t K,
                   int nthreads) {
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float s = w8_scalen(scale, scale_is_f32, n);
        const float32x4_t sv = vdupq_n_f32(s);
        const int8_t* qr = q + n * K;
        bf16* o = out + n * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const int16x8_t v = vmovl_s8(vld1_s8(qr + k));
            store_bf16x4(o + k, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(v))), sv));
            store_bf16x4(o + k + 4, vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(v)), sv));
        }
        for (; k < K; k++) o[k] = f2bf((float)qr[k] * s);
    }
}

void it_dequant_w4(const uint8_t* packed, const float* scale, const float* zero, int64_t gs, bf16* out, int64_t N,
                   int64_t K, int nthreads) {
    const int64_t G = K / gs;
#pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* p = packed + n * (K / 2);
        bf16* o = out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const int64_t g = k0 / gs;
            const float32x4_t sv = vdupq_n_f32(scale[n * G + g]), zv = vdupq_n_f32(zero[n * G + g]);
            for (int64_t h = 0; h < 8; h++) { /* bytes 4 h .. 4 h + 3: columns k0 + 4 h .. (low), k0 + 32 + 4 h .. */
                uint8_t b4[8] = {0};
                memcpy(b4, p + k0 / 2 + 4 * h, 4);
                const uint32x4_t b = vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(b4))));
                const float32x4_t lo = vcvtq_f32_u32(vandq_u32(b, vdupq_n_u32(0xF)));
                const float32x4_t hi = vcvtq_f32_u32(vshrq_n_u32(b, 4));
                store_bf16x4(o + k0 + 4 * h, vaddq_f32(vmulq_f32(lo, sv), zv));
                store_bf16x4(o + k0 + 32 + 4 * h, vaddq_f32(vmulq_f32(hi, sv), zv));
            }
        }
    }
}
