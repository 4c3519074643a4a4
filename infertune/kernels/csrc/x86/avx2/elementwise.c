/* ------------------------------------------------------------------ the elementwise work of prefills, AVX2
 *
 * RMSNorm, SiLU-and-multiply and rotary on rows, rounded as the PyTorch formulas (layers/norm.py, activation.py,
 * rotary.py) and as the AVX-512 library rounds them: fp32 statistics and products, bf16 where the formula rounds.
 * Tails shorter than 8 run the same vector code on a zero-padded copy. */

static inline int rows_threads2(int64_t T, int64_t elems, int nthreads) {
    return (T > 1 && elems >= (1 << 16) && nthreads > 1) ? (int)(T < nthreads ? T : nthreads) : 1;
}

/* out = w * bf16(x / rms(x)) */
static void rmsnorm_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows_threads2(T, T * H, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* xr = x + t * H;
        bf16* o = out + t * H;
        const int64_t h8 = H & ~(int64_t)7;
        /* The sum of squares in 16 lanes (two vectors of 8), reduced as the AVX-512 kernel reduces its one vector of
         * 16: the same sums in the same order, so both variants give the same statistics. */
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const int64_t n0 = H - i < 8 ? H - i : 8, n1 = H - i - 8 < 0 ? 0 : (H - i - 8 < 8 ? H - i - 8 : 8);
            const __m256 v0 = n0 == 8 ? load_bf16x8(xr + i) : load_bf16_tail(xr + i, n0);
            const __m256 v1 = n1 == 8 ? load_bf16x8(xr + i + 8) : load_bf16_tail(xr + i + 8, n1);
            s0 = _mm256_fmadd_ps(v0, v0, s0);
            s1 = _mm256_fmadd_ps(v1, v1, s1);
        }
        const __m256 ss = _mm256_add_ps(s1, s0);
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)H + eps));
        for (int64_t i = 0; i < h8; i += 8) {
            const __m256 n = bf16_round_f32x8(_mm256_mul_ps(load_bf16x8(xr + i), r));
            _mm_storeu_si128((__m128i*)(o + i), round_bf16x8(_mm256_mul_ps(load_bf16x8(w + i), n)));
        }
        if (h8 < H) {
            const __m256 n = bf16_round_f32x8(_mm256_mul_ps(load_bf16_tail(xr + h8, H - h8), r));
            store_bf16_tail(o + h8, _mm256_mul_ps(load_bf16_tail(w + h8, H - h8), n), H - h8);
        }
    }
}

/* act[t, i] = bf16(bf16(f(g)) * u), gate | up side by side in gu [T, 2I]: f SiLU (silu_mul_rows) or GeLU-tanh
 * (gelu_mul_rows) */
#define ACT_MUL(rows, f)                                                                                               \
    static void rows(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {                                  \
        _Pragma("omp parallel for num_threads(rows_threads2(T, T * I, nthreads)) schedule(static)")                    \
        for (int64_t t = 0; t < T; t++) {                                                                              \
            const bf16* g = gu + t * 2 * I;                                                                            \
            const bf16* u = g + I;                                                                                     \
            bf16* a = act + t * I;                                                                                     \
            int64_t i = 0;                                                                                             \
            for (; i + 32 <= I; i += 32) { /* four independent vectors a pass: the exp chains overlap */               \
                __m256 sv[4];                                                                                          \
                for (int j = 0; j < 4; j++) sv[j] = f(load_bf16x8(g + i + 8 * j));                                    \
                for (int j = 0; j < 4; j++)                                                                            \
                    _mm_storeu_si128((__m128i*)(a + i + 8 * j),                                                        \
                                     round_bf16x8(_mm256_mul_ps(bf16_round_f32x8(sv[j]), load_bf16x8(u + i + 8 * j)))); \
            }                                                                                                          \
            for (; i + 8 <= I; i += 8)                                                                                 \
                _mm_storeu_si128((__m128i*)(a + i),                                                                    \
                                 round_bf16x8(_mm256_mul_ps(bf16_round_f32x8(f(load_bf16x8(g + i))), load_bf16x8(u + i)))); \
            if (i < I) {                                                                                               \
                const __m256 s = bf16_round_f32x8(f(load_bf16_tail(g + i, I - i)));                                    \
                store_bf16_tail(a + i, _mm256_mul_ps(s, load_bf16_tail(u + i, I - i)), I - i);                         \
            }                                                                                                          \
        }                                                                                                              \
    }
ACT_MUL(silu_mul_rows, silu256)
ACT_MUL(gelu_mul_rows, gelu256)
#undef ACT_MUL

/* Rotate `heads` heads of D at the start of each row of qk (row stride ld) in place: cs[p] (row stride ld_cs)
 * holds the D / 2 cosines then the D / 2 sines of position p, row t's position positions[t] (NULL: t). fp32
 * products, one rounding to bf16: bit for bit the PyTorch formula (no FMA: x1 c - x2 s as two products and a
 * difference). */
static void rotary_apply(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
                         const int64_t* positions, int nthreads) {
    const int64_t half = D / 2, h8 = half & ~(int64_t)7;
#pragma omp parallel for num_threads(rows_threads2(T, T * heads * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cs + (positions ? positions[t] : t) * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            bf16* v = qk + t * ld + h * D;
            for (int64_t i = 0; i < h8; i += 8) {
                const __m256 x1 = load_bf16x8(v + i), x2 = load_bf16x8(v + half + i);
                const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(c + half + i);
                const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
                const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
                _mm_storeu_si128((__m128i*)(v + i), round_bf16x8(o1));
                _mm_storeu_si128((__m128i*)(v + half + i), round_bf16x8(o2));
            }
            if (h8 < half) {
                const int64_t n = half - h8;
                const __m256 x1 = load_bf16_tail(v + h8, n), x2 = load_bf16_tail(v + half + h8, n);
                const __m256 cv = load_f32_tail(c + h8, n), sv = load_f32_tail(c + half + h8, n);
                const __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv));
                const __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv));
                store_bf16_tail(v + h8, o1, n);
                store_bf16_tail(v + half + h8, o2, n);
            }
        }
    }
}

/* rotary (rotate-half) of the q and k heads of the fused step's qkv [T, (Hq + 2 Hkv) D] at each row's position, from
 * the layer's table cs (it_model.cos_sin's layout) */
static void rotary_rows(const it_model* m, const it_step* s, bf16* qkv, const float* cs) {
    const int64_t D = m->head_dim, width = (m->n_heads + 2 * m->n_kv_heads) * D;
    rotary_apply(qkv, width, s->T, m->n_heads + m->n_kv_heads, D, cs, D, s->positions, m->nthreads);
}

/* The elementwise work of prefills (any T), on rows */
void it_rmsnorm_mt(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    rmsnorm_rows(x, w, out, T, H, eps, nthreads);
}

void it_silu_mul(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
    silu_mul_rows(gu, act, T, I, nthreads);
}

void it_gelu_mul(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
    gelu_mul_rows(gu, act, T, I, nthreads);
}

void it_rotary(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
               int nthreads) {
    rotary_apply(qk, ld, T, heads, D, cs, ld_cs, NULL, nthreads);
}
