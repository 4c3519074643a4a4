
/* out = w * bf16(x / rms(x)), as RMSNorm in layers/norm.py rounds */
static inline int rows_threads(int64_t T, int64_t elems, int nthreads) {
    return (T > 1 && elems >= (1 << 16) && nthreads > 1) ? (int)(T < nthreads ? T : nthreads) : 1;
}


/* rmsnorm_rows of up to 16 short rows at once: x holds n <= 16 rows of D (a multiple of 16) D apart (a token's q or
 * k heads: Qwen3's per-head norm, where a row is one head and its reduction dominated), out (x itself, or another
 * [n, D]) gets them normalized. The same sums in the same order, bit for bit: each row's 16 lanes of fp32 squares
 * (the same FMA chain), then the 16 rows' lanes reduced together in _mm512_reduce_add_ps's tree (lanes i and i + 8,
 * then i and i + 4, i and i + 2, i and i + 1), and 1 / sqrt(sum / D + eps) for all of them in one vector (IEEE
 * division and root: the scalar's bits). */
static void head_norm16(const bf16* x, bf16* out, int n, int64_t D, const bf16* w, float eps) {
    __m512 s[16];
    for (int h = 0; h < 16; h++) {
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; h < n && i < D; i += 16) {
            const __m512 v = load_bf16x16(x + h * D + i, 0xffff);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        s[h] = ss;
    }
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) /* head 2j's lanes i + (i + 8) in lanes 0-7, head 2j + 1's in 8-15 */
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; j++) /* quarter q: head 4j + q's four sums of (i, i + 4) */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++) /* quarter q: heads 8j + q and 8j + 4 + q, two sums of (i, i + 2) each */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4q + j: head 4j + q's whole sum */
    const __m512 tot = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_sqrt_ps(_mm512_add_ps(
                                                             _mm512_div_ps(tot, _mm512_set1_ps((float)D)), _mm512_set1_ps(eps))));
    for (int h = 0; h < n; h++) {
        const __m512 rh = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * (h % 4) + h / 4), r);
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 v = bf16_round_f32(_mm512_mul_ps(load_bf16x16(x + h * D + i, 0xffff), rh));
            _mm256_storeu_si256((__m256i*)(out + h * D + i), round_bf16x16(_mm512_mul_ps(load_bf16x16(w + i, 0xffff), v)));
        }
    }
}

/* heads of D at x (n of them, D apart) each normalized as a row of rmsnorm_rows, in place (fused_step.h's per-head
 * q / k norm with bf16 weights) */
static void head_norms(bf16* x, int64_t n, int64_t D, const bf16* w, float eps) {
    for (int64_t h = 0; h < n; h += 16) head_norm16(x + h * D, x + h * D, (int)(n - h < 16 ? n - h : 16), D, w, eps);
}
#define QK_NORM_HEADS head_norms

/* rows of H (any length) one at a time: out's row t at out + t H, or packed (px_index) */
static void rmsnorm_long_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads,
                              int packed) {
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
            bf16* o = packed ? out + px_index(t, i, H) : out + t * H + i;
            _mm256_mask_storeu_epi16(o, m, round_bf16x16(_mm512_mul_ps(load_bf16x16(w + i, m), n)));
        }
    }
}

static void rmsnorm_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    if (T > 1 && H % 16 == 0 && H <= 256) { /* short rows (per-head norms): 16 at a time, the same bits */
        const int64_t groups = (T + 15) / 16;
#pragma omp parallel for num_threads(rows_threads(groups, T * H, nthreads)) schedule(static)
        for (int64_t t = 0; t < T; t += 16) head_norm16(x + t * H, out + t * H, (int)(T - t < 16 ? T - t : 16), H, w, eps);
        return;
    }
    rmsnorm_long_rows(x, w, out, T, H, eps, nthreads, 0);
}

/* rmsnorm_rows into out packed for the tile GEMM (px_index; H a multiple of 32), the rows past T up to a multiple
 * of 16 zeros: a fused prompt's normed rows for 12-bit linears on AMX (linear_bf16c_px). The same bits. */
static void rmsnorm_rows_px(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    rmsnorm_long_rows(x, w, out, T, H, eps, nthreads, 1);
    px_zero_tail(out, T, H);
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

