
/* out = w * bf16(x / rms(x)), as RMSNorm in layers/norm.py rounds */
static inline int rows_threads(int64_t T, int64_t elems, int nthreads) {
    return (T > 1 && elems >= (1 << 16) && nthreads > 1) ? (int)(T < nthreads ? T : nthreads) : 1;
}


static void rmsnorm_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows_threads(T, T * H, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* xr = x + t * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = mask16(H - i);
            const __m512 v = load_bf16x16(xr + i, m);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = mask16(H - i);
            const __m512 n = bf16_round_f32(_mm512_mul_ps(load_bf16x16(xr + i, m), r));
            _mm256_mask_storeu_epi16(out + t * H + i, m, round_bf16x16(_mm512_mul_ps(load_bf16x16(w + i, m), n)));
        }
    }
}


/* act[i] = bf16(bf16(f(g)) * u) over one row, gate g and up u [I] each (layers/activation.py), f SiLU (silu_mul_row)
 * or GeLU-tanh (gelu_mul_row); and over rows, gate | up side by side in gu [T, 2I] (silu_mul_rows, gelu_mul_rows) */
#define ACT_MUL(row, rows, f)                                                                                          \
    static void row(const bf16* g, const bf16* u, bf16* a, int64_t I) {                                               \
        int64_t i = 0;                                                                                                 \
        for (; i + 64 <= I; i += 64) { /* four independent vectors a pass: the exp chains overlap */                   \
            __m512 sv[4];                                                                                              \
            for (int j = 0; j < 4; j++) sv[j] = f(load_bf16x16(g + i + 16 * j, 0xffff));                              \
            for (int j = 0; j < 4; j++)                                                                                \
                _mm256_storeu_si256((__m256i*)(a + i + 16 * j),                                                        \
                                    round_bf16x16(_mm512_mul_ps(bf16_round_f32(sv[j]), load_bf16x16(u + i + 16 * j, 0xffff)))); \
        }                                                                                                              \
        for (; i < I; i += 16) {                                                                                       \
            const __mmask16 m = mask16(I - i);                                                                         \
            const __m512 s = f(load_bf16x16(g + i, m));                                                                \
            _mm256_mask_storeu_epi16(a + i, m, round_bf16x16(_mm512_mul_ps(bf16_round_f32(s), load_bf16x16(u + i, m)))); \
        }                                                                                                              \
    }                                                                                                                  \
    static void rows(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {                                  \
        _Pragma("omp parallel for num_threads(rows_threads(T, T * I, nthreads)) schedule(static)")                     \
        for (int64_t t = 0; t < T; t++) row(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);                       \
    }
ACT_MUL(silu_mul_row, silu_mul_rows, silu512)
ACT_MUL(gelu_mul_row, gelu_mul_rows, gelu512)
#undef ACT_MUL

/* rotary (rotate-half) of q and k heads in qkv [T, (Hq + 2 Hkv) D], in fp32, rounded once to bf16 */
/* Rotate `heads` heads of D at the start of each row of qk (row stride ld) in place: cs[t] (row stride ld_cs)
 * holds the D / 2 cosines then the D / 2 sines of row t's position. fp32 products, one rounding to bf16. */
static void rotary_apply(bf16* qk, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cs, int64_t ld_cs,
                         const int64_t* positions, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(rows_threads(T, T * heads * D, nthreads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cs + (positions ? positions[t] : t) * ld_cs;
        for (int64_t h = 0; h < heads; h++) {
            bf16* v = qk + t * ld + h * D;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = mask16(half - i);
                const __m512 x1 = load_bf16x16(v + i, m), x2 = load_bf16x16(v + half + i, m);
                const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, c + half + i);
                const __m512 o1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
                const __m512 o2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
                _mm256_mask_storeu_epi16(v + i, m, round_bf16x16(o1));
                _mm256_mask_storeu_epi16(v + half + i, m, round_bf16x16(o2));
            }
        }
    }
}

static void rotary_rows(const it_model* m, const it_step* s, bf16* qkv, const float* cs) {
    const int64_t D = m->head_dim, width = (m->n_heads + 2 * m->n_kv_heads) * D;
    rotary_apply(qkv, width, s->T, m->n_heads + m->n_kv_heads, D, cs, D, s->positions, m->nthreads);
}

/* The elementwise work of prefills (any T), on rows: RMSNorm (also the final norm of a fused decode step),
 * SiLU-and-multiply, rotary. */
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

