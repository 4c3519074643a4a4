/* ------------------------------------------------------------------ the fused decoder step's parts on AVX2 + FMA
 *
 * What csrc/fused_step.h (it_decode_layers: every decoder layer of a step in one call) needs from this library: the
 * workspace layout, the linears (run_lin: the GEMV / FMA GEMM for bf16, the int16 GEMVs for W8A16 / W4A16, their
 * scratch from the workspace), the residual add, and attention over the paged cache. With the elementwise kernels
 * (elementwise.c) and the cache's rows (kv_cache.h) that is a whole step with no allocation and no aten dispatch,
 * which on AVX2 saves the same ~15 ms a step of a 24-layer model as on AVX-512.
 *
 * Attention, one task per (row, KV head), the group of query heads sharing that KV head reading each K/V row once,
 * P in fp32 (as the AVX-512 library's non-AMX path): scores 8 keys a pass (8 dot-product vectors over D, bf16 widened
 * to fp32 by unpacks against zero, FMA; summed across lanes together), times the softmax scale; softmax in fp32;
 * P V over 16 dims a pass for up to ATT2_HEADS heads at a time, one rounding to bf16. */

#define ALIGN64(n) (((n) + 63) & ~(int64_t)63)
#define ATT2_KEYS 8   /* keys per pass of the scores (8 accumulators) */
#define ATT2_HEADS 6  /* query heads per pass of P V: 6 x 2 accumulators, 2 V vectors and a broadcast (15 ymm) */
#define ATT2_PF_KEYS 32 /* how far ahead along a sequence's K/V rows to ask for them */

/* per attention thread: scores [group, max_ctx] fp32, ATT2_KEYS K/V rows of an int8 cache dequantized, a zero row */
static inline int64_t attn2_bytes(int64_t group, int64_t max_ctx, int64_t D) {
    return ALIGN64(group * max_ctx * 4) + ALIGN64(ATT2_KEYS * D * 2) + ALIGN64(D * 2);
}

/* Offsets of the workspace's parts, in bytes (the fields fused_step.h reads; dec is unused here) */
typedef struct { int64_t h, qkv, o, gu, act, y, lin, dec, attn, total; } ws_layout;

static ws_layout workspace(const it_model* m, int64_t T, int64_t max_ctx) {
    ws_layout l;
    const int64_t hq = m->n_heads * m->head_dim, qkv = (m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
    int64_t off = 0;
    l.h = off;    off += ALIGN64(T * m->hidden * 2);
    l.qkv = off;  off += ALIGN64(T * qkv * 2);
    l.o = off;    off += ALIGN64(T * hq * 2);
    l.gu = off;   off += ALIGN64(T * 2 * m->inter * 2);
    l.act = off;  off += ALIGN64(T * m->inter * 2);
    l.y = off;    off += ALIGN64(T * m->hidden * 2);
    /* the int16 activations of the W8A16 / W4A16 GEMVs, the largest over the layers' input widths (bf16 linears
       need none: the GEMM's scratch is on its threads' stacks) */
    int64_t lin = 0;
    /* (latent attention: q_b's input, q's low rank, and o_proj's, heads x v) */
    const int64_t widths[5] = {m->hidden, hq, m->inter, m->mla_q_rank, m->n_heads * m->mla_v};
    for (int i = 0; i < 5; i++) { /* (inter is 0 where every MLP is a mixture of experts) */
        if (widths[i] < 1) continue;
        const int64_t b = q_scratch_bytes(T, widths[i]), i8 = i8_scratch_bytes(T, widths[i]);
        lin = b > lin ? b : lin;
        lin = i8 > lin ? i8 : lin; /* (W8A8 rounds every row of x to int8 first, prompts included) */
    }
    l.lin = off;  off += ALIGN64(lin);
    l.dec = off;
    l.attn = off; off += (int64_t)(m->nthreads > 0 ? m->nthreads : 1) *
                         attn2_bytes(m->n_heads / m->n_kv_heads, max_ctx, m->head_dim);
    l.total = off;
    return l;
}


/* x[i] = bf16(x[i] + y[i]), as f2bf rounds (NaN kept quiet) */
static void add_rows(bf16* x, const bf16* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(x + i), round_bf16x8_nan(_mm256_add_ps(load_bf16x8(x + i), load_bf16x8(y + i))));
    for (; i < n; i++) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

/* y = x W^T (+ bias) for one of a layer's linears (no 12-bit weights here: build refuses them) */
static void run_lin(const it_lin* L, const bf16* x, int64_t ldx, bf16* y, int64_t ldy, int64_t M, int nthreads,
                    void* scratch, bf16* dec, int silu) {
    (void)dec, (void)silu;
    if (L->kind == IT_KIND_BF16)
        it_linear_bf16(x, ldx, (const bf16*)L->w, L->bias, y, ldy, M, L->N, L->K, nthreads);
    else if (L->kind == IT_KIND_W8A8) /* (it_decode_layers checked K) */
        linear_w8a8(x, ldx, (const uint32_t*)L->w, (const float*)L->scale, L->zero, L->bias, y, ldy, M, L->N, L->K,
                    nthreads, scratch);
    else if (L->kind == IT_KIND_W4)
        linear_w4(x, ldx, (const uint8_t*)L->w, (const float*)L->scale, L->zero, L->group, L->bias, y, ldy, M, L->N,
                  L->K, nthreads, scratch);
    else
        linear_w8(x, ldx, (const int8_t*)L->w, L->scale, L->scale_is_f32, L->bias, y, ldy, M, L->N, L->K, nthreads,
                  scratch);
}

/* x_res += bf16(x W^T (+ bias)): y, then the residual add */
static void run_lin_add(const it_lin* L, const bf16* x, int64_t ldx, bf16* x_res, bf16* y, int64_t H, int64_t M,
                        int nthreads, void* scratch, bf16* dec) {
    run_lin(L, x, ldx, y, H, M, nthreads, scratch, dec, 0);
    add_rows(x_res, y, M * H);
}

/* Lane j of the result = the sum of the 8 lanes of v[j] */
static inline __m256 reduce8(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* halves: v[0..3] / v[4..7] partials */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __m256i lanes_below(int64_t n) { /* lanes 0 .. n - 1 set */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Scores of G query heads (q, rows D apart) against keys 0 .. len - 1 of one sequence and KV head g, times the
 * softmax scale, into sc [G, max_ctx]. A pass always covers 8 keys (a zero row past the end), so the 8 accumulators
 * stay in registers. */
static void attn2_scores(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                         const bf16* q, int64_t G, float* sc, int64_t max_ctx, bf16* tmp, const bf16* zero) {
    const int64_t D = m->head_dim, ld = m->n_kv_heads * D;
    const __m256 scale = _mm256_set1_ps(m->scale);
    const __m256i z = _mm256_setzero_si256();
    const int chunked = kv_chunked(m);
    for (int64_t j0 = 0; j0 < len; j0 += ATT2_KEYS) {
        const int nb = (int)(len - j0 < ATT2_KEYS ? len - j0 : ATT2_KEYS);
        const bf16* kr[ATT2_KEYS];
        int na; /* (16 keys ahead a call: asked for in a 16-key chunk's first half) */
        const char* ahead =
            kv_attn_rows(m, cache, 0, table, len, j0, nb, g, tmp, kr, chunked, !(j0 & 15), ATT2_PF_KEYS, &na);
        for (int jj = nb; jj < ATT2_KEYS; jj++) kr[jj] = zero;
        for (int64_t h = 0; h < G; h++) {
            __m256 a[ATT2_KEYS];
            if (ahead) kv_ask(ahead, ld, D, (int)(h * na / G), (int)((h + 1) * na / G)); /* spread over the heads */
            for (int jj = 0; jj < ATT2_KEYS; jj++) a[jj] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) { /* (D % 16 == 0: it_decode_layers checks) */
                const __m256i qv = _mm256_loadu_si256((const __m256i*)(q + h * D + d));
                const __m256 ql = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, qv));
                const __m256 qh = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, qv));
                for (int jj = 0; jj < ATT2_KEYS; jj++) {
                    const __m256i kv = _mm256_loadu_si256((const __m256i*)(kr[jj] + d));
                    a[jj] = _mm256_fmadd_ps(ql, _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, kv)), a[jj]);
                    a[jj] = _mm256_fmadd_ps(qh, _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, kv)), a[jj]);
                }
            }
            _mm256_maskstore_ps(sc + h * max_ctx + j0, lanes_below(nb), _mm256_mul_ps(reduce8(a), scale));
        }
    }
}

/* Gemma 2's soft-capping of G rows (ld apart) of len scores: s = cap tanh(s / cap), in fp32 */
static void softcap_scores(float* sc, int64_t ld, int64_t G, int64_t len, float cap) {
    const __m256 c = _mm256_set1_ps(cap);
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < len; j += 8) {
            const __m256i mk = lanes_below(len - j);
            const __m256 v = _mm256_maskload_ps(sc + h * ld + j, mk);
            _mm256_maskstore_ps(sc + h * ld + j, mk, _mm256_mul_ps(c, tanh256(_mm256_div_ps(v, c))));
        }
}

/* r = softmax(r) over len entries, in place, fp32 */
static void softmax_row2(float* r, int64_t len) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mv = ninf;
    for (int64_t j = 0; j < len; j += 8) {
        const __m256i mk = lanes_below(len - j);
        mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(r + j, mk), _mm256_castsi256_ps(mk)));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j += 8) {
        const __m256i mk = lanes_below(len - j);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(r + j, mk), mx)), _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(r + j, mk, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (int64_t j = 0; j < len; j += 8) {
        const __m256i mk = lanes_below(len - j);
        _mm256_maskstore_ps(r + j, mk, _mm256_mul_ps(_mm256_maskload_ps(r + j, mk), inv));
    }
}

/* o[h] = sum_j p[h, j] V[j] for hn (<= ATT2_HEADS) heads h0 .. over dims d .. d + 15: the 2 hn accumulators stay in
 * registers over the whole sequence, each probability broadcast once for both 8-dim halves */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* (heads past hn are never used) */
static inline __attribute__((always_inline)) void attn2_values16(const it_model* m, const void* cache,
                                                                 const int64_t* table, int64_t len, int64_t g,
                                                                 int64_t d, const float* sc, int hn, int64_t max_ctx,
                                                                 bf16* o, bf16* tmp, int prefetch) {
    const int64_t D = m->head_dim, ld = m->n_kv_heads * D;
    const int chunked = kv_chunked(m);
    __m256 a0[ATT2_HEADS], a1[ATT2_HEADS];
    for (int h = 0; h < ATT2_HEADS; h++) a0[h] = a1[h] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < len; j0 += ATT2_KEYS) {
        const int nb = (int)(len - j0 < ATT2_KEYS ? len - j0 : ATT2_KEYS);
        const bf16* vr[ATT2_KEYS];
        int na;
        const char* ahead = kv_attn_rows(m, cache, 1, table, len, j0, nb, g, tmp, vr, chunked, prefetch && !(j0 & 15),
                                         ATT2_PF_KEYS, &na);
        for (int jj = 0; jj < nb; jj++) {
            if (2 * jj < na) kv_ask(ahead, ld, D, 2 * jj, 2 * jj + 2 < na ? 2 * jj + 2 : na); /* two rows a row read */
            const __m256 v0 = load_bf16x8(vr[jj] + d), v1 = load_bf16x8(vr[jj] + d + 8);
            for (int h = 0; h < ATT2_HEADS; h++)
                if (h < hn) {
                    const __m256 p = _mm256_broadcast_ss(sc + h * max_ctx + j0 + jj);
                    a0[h] = _mm256_fmadd_ps(p, v0, a0[h]);
                    a1[h] = _mm256_fmadd_ps(p, v1, a1[h]);
                }
        }
    }
    for (int h = 0; h < ATT2_HEADS; h++)
        if (h < hn) {
            _mm_storeu_si128((__m128i*)(o + h * D + d), round_bf16x8(a0[h]));
            _mm_storeu_si128((__m128i*)(o + h * D + d + 8), round_bf16x8(a1[h]));
        }
}
#pragma GCC diagnostic pop

/* One sequence's attention for the G query heads q (rows D apart) of KV head g into o (rows D apart); the first skip
 * keys masked (kv_window) */
static void attn2_heads(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t skip,
                        int64_t g, const bf16* q, int64_t G, float* sc, int64_t max_ctx, bf16* o, bf16* tmp,
                        const bf16* zero) {
    attn2_scores(m, cache, table, len, g, q, G, sc, max_ctx, tmp, zero);
    if (m->softcap > 0.0f) softcap_scores(sc, max_ctx, G, len, m->softcap);
    if (skip) kv_mask_scores(sc, max_ctx, G, skip);
    for (int64_t h = 0; h < G; h++) softmax_row2(sc + h * max_ctx, len);
    if (skip) kv_zero_probs(sc, max_ctx, G, skip);
    for (int64_t d = 0; d < m->head_dim; d += 16)
        for (int64_t h0 = 0; h0 < G; h0 += ATT2_HEADS) {
            const int hn = (int)(G - h0 < ATT2_HEADS ? G - h0 : ATT2_HEADS);
            attn2_values16(m, cache, table, len, g, d, sc + h0 * max_ctx, hn, max_ctx, o + h0 * m->head_dim, tmp,
                           d == 0 && h0 == 0);
        }
}

/* Attention of each row over its sequence's paged K/V (row t attends to its first context_lens[t] keys: a decode
 * row to its whole context, a prompt's row to its prompt up to itself; with a window, to the last `window` of them);
 * o [T, Hq, D] bf16. One task per (row, KV head), dynamic schedule. (use_amx: the AVX-512 library's switch; nothing
 * here) */
static void attention_rows(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o,
                           float* scratch, int64_t max_ctx, int use_amx, int64_t window) {
    (void)use_amx;
    const int64_t D = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, T = s->T;
    const int64_t width = (m->n_heads + 2 * hkv) * D, tasks = T * hkv, per = attn2_bytes(group, max_ctx, D);
    const int nt = (int)(tasks < m->nthreads ? tasks : m->nthreads);
#pragma omp parallel num_threads(nt > 0 ? nt : 1)
    {
        char* base = (char*)scratch + (int64_t)omp_get_thread_num() * per;
        float* sc = (float*)base;
        bf16* tmp = (bf16*)(base + ALIGN64(group * max_ctx * 4));
        bf16* zero = (bf16*)((char*)tmp + ALIGN64(ATT2_KEYS * D * 2));
        memset(zero, 0, (size_t)D * 2);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t t = task / hkv, g = task % hkv;
            const int64_t* table = s->block_tables + t * s->max_blocks;
            int64_t len = s->context_lens[t];
            const int64_t skip = kv_window(window, m->block_size, &table, &len);
            attn2_heads(m, cache, table, len, skip, g, qkv + t * width + g * group * D, group, sc, max_ctx,
                        o + (t * m->n_heads + g * group) * D, tmp, zero);
        }
    }
}

/* The attention of it_decode_layers alone, for tests: qkv [T, (Hq + 2 Hkv) D] (the queries are read), one layer's
 * cache, o [T, Hq, D]; s->work as for it_decode_layers. Returns 0, -1 (workspace too small) or -2 (shapes). */
int it_decode_attention(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o, int use_amx) {
    const int64_t max_ctx = s->max_blocks * m->block_size;
    if (m->head_dim % 16 || m->n_heads % m->n_kv_heads || s->T < 1) return -2;
    const ws_layout l = workspace(m, s->T, max_ctx);
    if (l.total > s->work_bytes) return -1;
    attention_rows(m, s, qkv, cache, o, (float*)((char*)s->work + l.attn), max_ctx, use_amx, 0);
    return 0;
}
