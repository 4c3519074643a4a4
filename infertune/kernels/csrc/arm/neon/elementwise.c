/* ------------------------------------------------------------------ the elementwise work of prefills, NEON
 *
 * RMSNorm, SiLU-and-multiply and rotary on rows, rounded as the PyTorch formulas (layers/norm.py, activation.py,
 * rotary.py) and as the x86 libraries round them: fp32 statistics and products, bf16 where the formula rounds.
 * Tails shorter than 4 run the same vector code on a zero-padded copy. */

static inline int rows_threadsn(int64_t T, int64_t elems, int nthreads) {
    return (T > 1 && elems >= (1 << 16) && nthreads > 1) ? (int)(T < nthreads ? T : nthreads) : 1;
}

/* out = w * bf16(x / rms(x)) */
void it_rmsnorm_mt(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows_threadsn(T, T * H, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* xr = x + t * H;
        bf16* o = out + t * H;
        const int64_t h4 = H & ~(int64_t)3;
        /* The sum of squares in 16 lanes (four vectors of 4), reduced pairwise as the x86 kernels reduce theirs */
        float32x4_t s[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int64_t i = 0; i < H; i += 16)
            for (int j = 0; j < 4; j++) {
                const int64_t left = H - i - 4 * j, n = left < 0 ? 0 : (left < 4 ? left : 4);
                const float32x4_t v = n == 4 ? load_bf16x4(xr + i + 4 * j) : load_bf16_tail4(xr + i + 4 * j, n);
                s[j] = vfmaq_f32(s[j], v, v);
            }
        const float32x4_t ss = vaddq_f32(vaddq_f32(s[0], s[2]), vaddq_f32(s[1], s[3]));
        const float32x4_t r = vdupq_n_f32(1.0f / sqrtf(vaddvq_f32(ss) / (float)H + eps));
        for (int64_t i = 0; i < h4; i += 4) {
            const float32x4_t n = bf16_round_f32x4(vmulq_f32(load_bf16x4(xr + i), r));
            store_bf16x4(o + i, vmulq_f32(load_bf16x4(w + i), n));
        }
        if (h4 < H) {
            const float32x4_t n = bf16_round_f32x4(vmulq_f32(load_bf16_tail4(xr + h4, H - h4), r));
            store_bf16_tail4(o + h4, vmulq_f32(load_bf16_tail4(w + h4, H - h4), n), H - h4);
        }
    }
}

/* act[t, i] = bf16(bf16(f(g)) * u), gate | up side by side in gu [T, 2I]: f SiLU (it_silu_mul) or GeLU-tanh
 * (it_gelu_mul) */
#define ACT_MUL(name, f)                                                                                               \
    void name(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {                                         \
        _Pragma("omp parallel for num_threads(rows_threadsn(T, T * I, nthreads)) schedule(static)")                    \
        for (int64_t t = 0; t < T; t++) {                                                                              \
            const bf16* g = gu + t * 2 * I;                                                                            \
            const bf16* u = g + I;                                                                                     \
            bf16* a = act + t * I;                                                                                     \
            int64_t i = 0;                                                                                             \
            for (; i + 16 <= I; i += 16) { /* four independent vectors a pass: the exp chains overlap */               \
                float32x4_t sv[4];                                                                                     \
                for (int j = 0; j < 4; j++) sv[j] = f(load_bf16x4(g + i + 4 * j));                                     \
                for (int j = 0; j < 4; j++)                                                                            \
                    store_bf16x4(a + i + 4 * j, vmulq_f32(bf16_round_f32x4(sv[j]), load_bf16x4(u + i + 4 * j)));       \
            }                                                                                                          \
            for (; i + 4 <= I; i += 4)                                                                                 \
                store_bf16x4(a + i, vmulq_f32(bf16_round_f32x4(f(load_bf16x4(g + i))), load_bf16x4(u + i)));           \
            if (i < I) {                                                                                               \
                const float32x4_t s = bf16_round_f32x4(f(load_bf16_tail4(g + i, I - i)));                              \
                store_bf16_tail4(a + i, vmulq_f32(s, load_bf16_tail4(u + i, I - i)), I - i);                           \
            }                                                                                                          \
        }                                                                                                              \
    }
ACT_MUL(it_silu_mul, silu128)
ACT_MUL(it_gelu_mul, gelu128)
#undef ACT_MUL

/* Rotate `heads` heads of D at the start of each row of qk (row stride ld) in place: cs[p] (row stride ld_cs)
 * holds the D / 2 cosines then the D / 2 sines of position p, row t's position positions[t] (NULL: t). fp32
 * products, one rounding to bf16: bit for bit the PyTorch formula (no FMA: x1 c - x2 s as two products and a
 * difference). */
static void rotary_apply(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
                         const int64_t* positions, int nthreads) {
    const int64_t half = D / 2, h4 = half & ~(int64_t)3;
#pragma omp parallel for num_threads(rows_threadsn(T, T * heads * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cs + (positions ? positions[t] : t) * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            bf16* v = qk + t * ld + h * D;
            for (int64_t i = 0; i < h4; i += 4) {
                const float32x4_t x1 = load_bf16x4(v + i), x2 = load_bf16x4(v + half + i);
                const float32x4_t cv = vld1q_f32(c + i), sv = vld1q_f32(c + half + i);
                const float32x4_t o1 = vsubq_f32(vmulq_f32(x1, cv), vmulq_f32(x2, sv));
                const float32x4_t o2 = vaddq_f32(vmulq_f32(x2, cv), vmulq_f32(x1, sv));
                store_bf16x4(v + i, o1);
                store_bf16x4(v + half + i, o2);
            }
            if (h4 < half) {
                const int64_t n = half - h4;
                const float32x4_t x1 = load_bf16_tail4(v + h4, n), x2 = load_bf16_tail4(v + half + h4, n);
                const float32x4_t cv = load_f32_tail4(c + h4, n), sv = load_f32_tail4(c + half + h4, n);
                const float32x4_t o1 = vsubq_f32(vmulq_f32(x1, cv), vmulq_f32(x2, sv));
                const float32x4_t o2 = vaddq_f32(vmulq_f32(x2, cv), vmulq_f32(x1, sv));
                store_bf16_tail4(v + h4, o1, n);
                store_bf16_tail4(v + half + h4, o2, n);
            }
        }
    }
}

void it_rotary(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
               int nthreads) {
    rotary_apply(qk, ld, T, heads, D, cs, ld_cs, NULL, nthreads);
}
