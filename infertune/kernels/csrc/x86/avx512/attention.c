#include "kv_cache.h"

/* Lane j of the result = the sum of the 16 lanes of v[j]: four rounds of shuffles and adds, then one permute. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* quarters 0-1: partials of v[2i]; 2-3: of v[2i + 1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter q: partials of v[4i + q] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* in quarter q: two partials of v[8i + q], two of v[8i + 4 + q] */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* element 4q + s: the total of v[4s + q] */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, r);
}

/* Scores of G query heads (q, rows D apart) against keys 0 .. len - 1 of one sequence and KV head g, times the
 * softmax scale, into sc [G, max_ctx]. 16 keys a pass: per head, 16 dot-product vectors (one per key, over D in
 * bf16 pairs), summed across lanes together. A pass always covers 16 keys (a zero row past the end) so the 16
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void attn_scores(const it_model* m, const void* cache,
                                                              const int64_t* table, int64_t len, int64_t g,
                                                              const bf16* q, const int G, float* sc,
                                                              int64_t max_ctx, bf16* tmp, const bf16* zero) {
    const int64_t D = m->head_dim, ld = m->n_kv_heads * D;
    const __m512 scale = _mm512_set1_ps(m->scale);
    const int chunked = kv_chunked(m);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
        const bf16* kr[16];
        int na;
        const char* ahead = kv_attn_rows(m, cache, 0, table, len, j0, nb, g, tmp, kr, chunked, 1, PF_KEYS, &na);
        for (int jj = nb; jj < 16; jj++) kr[jj] = zero;
        for (int h = 0; h < G; h++) {
            __m512 a[16];
            if (ahead) kv_ask(ahead, ld, D, h * na / G, (h + 1) * na / G); /* spread over the heads */
            for (int jj = 0; jj < 16; jj++) a[jj] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                const __mmask32 mk = D - d >= 32 ? (__mmask32)0xffffffffu : (__mmask32)0xffffu;
                const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mk, q + h * D + d);
                for (int jj = 0; jj < 16; jj++)
                    a[jj] = _mm512_dpbf16_ps(a[jj], qv, (__m512bh)_mm512_maskz_loadu_epi16(mk, kr[jj] + d));
            }
            _mm512_mask_storeu_ps(sc + h * max_ctx + j0, mask16(nb), _mm512_mul_ps(reduce16(a), scale));
        }
    }
}

/* Gemma 2's soft-capping of G rows (ld apart) of len scores (the softmax scale applied): s = cap tanh(s / cap), in
 * fp32 as transformers computes it */
static void softcap_scores(float* sc, int64_t ld, int64_t G, int64_t len, float cap) {
    const __m512 c = _mm512_set1_ps(cap);
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < len; j += 16) {
            const __mmask16 mk = mask16(len - j);
            const __m512 v = _mm512_maskz_loadu_ps(mk, sc + h * ld + j);
            _mm512_mask_storeu_ps(sc + h * ld + j, mk, _mm512_mul_ps(c, tanh512(_mm512_div_ps(v, c))));
        }
}

/* the largest of r[0 .. len - 1], in every lane */
static inline __m512 row_max(const float* r, int64_t len) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, r + j));
    }
    return _mm512_set1_ps(_mm512_reduce_max_ps(mv));
}

/* p = softmax(p) over len entries, in place */
static inline void softmax_row(float* r, int64_t len) {
    const __m512 mx = row_max(r, len);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + j), mx));
        _mm512_mask_storeu_ps(r + j, mk, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 mk = mask16(len - j);
        _mm512_mask_storeu_ps(r + j, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, r + j), inv));
    }
}

/* o[h] = sum_j p[h, j] V[j] for the G heads, 32 dims a pass (one 64-byte line of each V row): the 2G accumulators
 * stay in registers over the whole sequence, and each probability is broadcast once for both 16-dim halves. */
static inline __attribute__((always_inline)) void attn_values(const it_model* m, const void* cache,
                                                              const int64_t* table, int64_t len, int64_t g,
                                                              const int G, const float* sc, int64_t max_ctx,
                                                              bf16* o, bf16* tmp) {
    const int64_t D = m->head_dim, ld = m->n_kv_heads * D;
    const int chunked = kv_chunked(m);
    for (int64_t d = 0; d < D; d += 32) {
        const int two = D - d >= 32;
        __m512 a0[8], a1[8];
        for (int h = 0; h < G; h++) { a0[h] = _mm512_setzero_ps(); a1[h] = _mm512_setzero_ps(); }
        for (int64_t j0 = 0; j0 < len; j0 += 16) {
            const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
            const bf16* vr[16];
            int na;
            const char* ahead =
                kv_attn_rows(m, cache, 1, table, len, j0, nb, g, tmp, vr, chunked, d == 0, PF_KEYS, &na);
            for (int jj = 0; jj < nb; jj++) {
                if (jj < na) kv_ask(ahead, ld, D, jj, jj + 1); /* a row ahead for each row read */
                const __m512 v0 = load_bf16x16(vr[jj] + d, 0xffff);
                const __m512 v1 = load_bf16x16(vr[jj] + d + 16, two ? 0xffff : 0);
                for (int h = 0; h < G; h++) {
                    const __m512 p = _mm512_set1_ps(sc[h * max_ctx + j0 + jj]);
                    a0[h] = _mm512_fmadd_ps(p, v0, a0[h]);
                    a1[h] = _mm512_fmadd_ps(p, v1, a1[h]);
                }
            }
        }
        for (int h = 0; h < G; h++) {
            _mm256_storeu_si256((__m256i*)(o + h * D + d), round_bf16x16(a0[h]));
            if (two) _mm256_storeu_si256((__m256i*)(o + h * D + d + 16), round_bf16x16(a1[h]));
        }
    }
}

/* One sequence's attention for G (<= 8, a compile-time constant where inlined) query heads of KV head g; the first
 * skip keys masked (kv_window) */
static inline __attribute__((always_inline)) void attn_heads(const it_model* m, const void* cache,
                                                             const int64_t* table, int64_t len, int64_t skip,
                                                             int64_t g, const bf16* q, const int G, float* sc,
                                                             int64_t max_ctx, bf16* o, bf16* tmp, const bf16* zero) {
    attn_scores(m, cache, table, len, g, q, G, sc, max_ctx, tmp, zero);
    if (m->softcap > 0.0f) softcap_scores(sc, max_ctx, G, len, m->softcap);
    if (skip) kv_mask_scores(sc, max_ctx, G, skip);
    for (int h = 0; h < G; h++) softmax_row(sc + h * max_ctx, len);
    if (skip) kv_zero_probs(sc, max_ctx, G, skip);
    attn_values(m, cache, table, len, g, G, sc, max_ctx, o, tmp);
}

#define ATTN_G(G) static void attn_heads_##G(const it_model* m, const void* cache, const int64_t* table, int64_t len, \
    int64_t skip, int64_t g, const bf16* q, float* sc, int64_t max_ctx, bf16* o, bf16* tmp, const bf16* zero) { \
    attn_heads(m, cache, table, len, skip, g, q, G, sc, max_ctx, o, tmp, zero); }
ATTN_G(1) ATTN_G(2) ATTN_G(3) ATTN_G(4) ATTN_G(5) ATTN_G(6) ATTN_G(7) ATTN_G(8)
#undef ATTN_G

typedef void (*attn_heads_fn)(const it_model*, const void*, const int64_t*, int64_t, int64_t, int64_t, const bf16*,
                              float*, int64_t, bf16*, bf16*, const bf16*);
static const attn_heads_fn attn_heads_by_g[9] = {0, attn_heads_1, attn_heads_2, attn_heads_3, attn_heads_4,
                                                  attn_heads_5, attn_heads_6, attn_heads_7, attn_heads_8};

/* ---- the same attention on AMX tiles (head_dim a multiple of 32, up to 16 query heads a pass)
 *
 * Scores: C [16 keys, 16 heads] = K [16 keys, D] Q^T, the K rows loaded as tiles straight from the cache block
 * and Q^T (VNNI pairs, built once per task) as the B operand; the tile is transposed in registers into the
 * head-major rows of sc. Softmax over each head's row in fp32; the unnormalized exponentials e go to P as two bf16
 * parts, P_hi = bf16(e) and P_lo = bf16(e - P_hi) (e to about 2^-17 of itself: the fp32 P of the AVX-512 path, where
 * torch's CPU flash attention rounds P to bf16 once), and their fp32 sums divide the output at the end.
 * Values: C [heads, 16 dims] += P_hi V + P_lo V [32 keys, 16 dims], V's rows interleaved into key pairs: each V tile
 * serves both parts. Measured on a Xeon with AMX: the single bf16 P had made a tiny MoE model's logprobs drift 1.5x
 * the PyTorch path's from HF's; the second part costs 4-8% of the attention's time. The blocks of prompt rows
 * (attn_rows_amx) keep the single bf16 P.
 */
/* words 2i, 2i + 1 of the result = word i of a, word i of b (two rows' 16 bf16, interleaved into key pairs) */
static inline __m512i pair_rows(const bf16* a, const bf16* b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                         _mm256_loadu_si256((const __m256i*)b), 1);
    return _mm512_permutexvar_epi16(idx, x);
}

/* This thread's tiles for attn_heads_amx's scores with G heads: all eight, the PV accumulators (0-3) and P (7) G rows;
 * for its P V (attn_pv_tiles) P_lo's tile 4 too (a reload costs little beside a task's K / V reads) */
static inline void attn_tiles(int G) { amx_tiles(8, 4, G); }
static inline void attn_pv_tiles(int G) { amx_tiles(8, 5, G); }

/* The chunk's V rows, dims d .. d + 15, in key pairs, into B tile TB (5 or 6) through vb */
#define ATTN_V_TILE(TB, d, vb)                                                                                  \
    do {                                                                                                        \
        for (int p_ = 0; p_ < 16; p_++)                                                                         \
            _mm512_storeu_si512((vb) + p_ * 32, pair_rows(vr[2 * p_] + (d), vr[2 * p_ + 1] + (d)));             \
        _tile_loadd(TB, (vb), 64);                                                                              \
    } while (0)

/* One sequence's attention for G (<= 16) query heads q (rows D apart) of KV head g into o (rows D apart). Tiles
 * (configured by attn_tiles): 0-3 PV accumulators [G, 16], 4 K rows (P_lo [G, 32 keys] in the P V pass, configured
 * by attn_pv_tiles), 5-6 Q^T / V pairs, 7 P_hi [G, 32 keys]; the score accumulator reuses 6. */
/* A row of scores (its first len keys) -> softmax numerators e in bf16 at p, zero from len up to len32 (P for the
 * tiles, as torch's CPU flash attention rounds it), and where pl is given what that rounding left, bf16(e - p) (the
 * decode rows' P_lo); returns 1 / their fp32 sum */
static inline __attribute__((always_inline)) float softmax_bf16_row(const float* r, int64_t len, int64_t len32,
                                                                    bf16* p, bf16* pl) {
    const __m512 mx = row_max(r, len);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len32; j += 16) {
        const __mmask16 mk = j < len ? mask16(len - j) : 0;
        const __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, r + j), mx)));
        _mm256_storeu_si256((__m256i*)(p + j), round_bf16x16(e));
        if (pl) _mm256_storeu_si256((__m256i*)(pl + j), round_bf16x16(_mm512_sub_ps(e, bf16_round_f32(e))));
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* P V accumulators 0 .. nc - 1 (16 dims each) of nrows rows, times each row's 1 / sum, as bf16 into out (ldo apart) */
__attribute__((target("amx-tile,amx-bf16")))
static inline void attn_pv_out(const attn_ws* w, int nc, int nrows, const float* inv, bf16* out, int64_t ldo) {
    for (int c = 0; c < nc; c++) {
        if (c == 0) _tile_stored(0, w->cbuf, 64);
        if (c == 1) _tile_stored(1, w->cbuf, 64);
        if (c == 2) _tile_stored(2, w->cbuf, 64);
        if (c == 3) _tile_stored(3, w->cbuf, 64);
        for (int i = 0; i < nrows; i++)
            _mm256_storeu_si256((__m256i*)(out + i * ldo + 16 * c),
                                round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(w->cbuf + 16 * i), _mm512_set1_ps(inv[i]))));
    }
}

/* O = P V over the first len keys for the 16 rows of P in w->pb + w->pl (each zero past its own keys up to a
 * multiple of 32), V read straight from the cache 32 keys a step, 64 dims (four accumulator tiles) a pass; row
 * i < nrows of O, times inv[i], is written to out + i * ldo as bf16. Tiles (configured by attn_pv_tiles): 0-3 the
 * accumulators, 7 P_hi, 4 P_lo, 5-6 V in pairs of keys. */
__attribute__((target("amx-tile,amx-bf16")))
static void attn_pv_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                        const attn_ws* w, int nrows, const float* inv, bf16* out, int64_t ldo) {
    const int64_t D = m->head_dim;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nc = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < len; j0 += 32) {
            const bf16* vr[32];
            const int n0 = (int)(len - j0 < 16 ? len - j0 : 16);
            if (d0 == 0) kv_prefetch(m, cache, table, len, g, len + j0 + PF_KEYS);
            kv_rows(m, cache, 1, table, j0, n0, g, w->tmp, vr);
            if (j0 + 16 < len) {
                const int n1 = (int)(len - j0 - 16 < 16 ? len - j0 - 16 : 16);
                if (d0 == 0) kv_prefetch(m, cache, table, len, g, len + j0 + 16 + PF_KEYS);
                kv_rows(m, cache, 1, table, j0 + 16, n1, g, w->tmp + 16 * D, vr + 16);
                for (int jj = 16 + n1; jj < 32; jj++) vr[jj] = w->zero;
            } else {
                for (int jj = n0; jj < 32; jj++) vr[jj] = w->zero;
            }
            /* two accumulators at a time (V in tiles 5, 6), each times P_hi (tile 7), then P_lo (tile 4) */
            _tile_loadd(7, w->pb + j0, w->ldp * 2);
            _tile_loadd(4, w->pl + j0, w->ldp * 2);
            ATTN_V_TILE(5, d0, w->vb);
            if (nc > 1) ATTN_V_TILE(6, d0 + 16, w->vb + 512);
            _tile_dpbf16ps(0, 7, 5);
            if (nc > 1) _tile_dpbf16ps(1, 7, 6);
            _tile_dpbf16ps(0, 4, 5);
            if (nc > 1) _tile_dpbf16ps(1, 4, 6);
            if (nc > 2) {
                ATTN_V_TILE(5, d0 + 32, w->vb);
                if (nc > 3) ATTN_V_TILE(6, d0 + 48, w->vb + 512);
                _tile_dpbf16ps(2, 7, 5);
                if (nc > 3) _tile_dpbf16ps(3, 7, 6);
                _tile_dpbf16ps(2, 4, 5);
                if (nc > 3) _tile_dpbf16ps(3, 4, 6);
            }
        }
        attn_pv_out(w, nc, nrows, inv, out + d0, ldo);
    }
}

__attribute__((target("amx-tile,amx-bf16")))
static void attn_heads_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t skip,
                           int64_t g, const bf16* q, int G, bf16* o, const attn_ws* w, int64_t max_ctx) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads;
    /* Q^T: the (k, k + 1) pair of head h is 32-bit word (k / 32) * 256 + ((k % 32) / 2) * 16 + h of qt */
    memset(w->qt, 0, (size_t)D * 32);
    const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int h = 0; h < G; h++)
        for (int64_t k = 0; k < D; k += 32)
            _mm512_i32scatter_epi32((int*)w->qt + (k / 32) * 256 + h, pairs, _mm512_loadu_si512(q + h * D + k), 4);
    const __m512 scale = _mm512_set1_ps(m->scale);
    /* scores, 16 keys a tile */
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int nb = (int)(len - j0 < 16 ? len - j0 : 16);
        kv_prefetch(m, cache, table, len, g, j0 + PF_KEYS);
        const bf16* kb;
        int64_t ldk;
        if (!m->kv_int8 && bs >= 16) { /* 16 keys of one block, rows hkv * D apart (past len: unused slots) */
            kb = (const bf16*)cache + (kv_slot(table, j0, bs) * hkv + g) * D;
            ldk = hkv * D * 2;
        } else {
            const bf16* kr[16];
            kv_rows(m, cache, 0, table, j0, nb, g, w->tmp + 16 * D, kr);
            for (int jj = 0; jj < 16; jj++) memcpy(w->tmp + jj * D, jj < nb ? kr[jj] : w->zero, (size_t)D * 2);
            kb = w->tmp;
            ldk = D * 2;
        }
        _tile_zero(6);
        for (int64_t k = 0; k < D; k += 32) {
            _tile_loadd(4, kb + k, ldk);
            _tile_loadd(5, w->qt + (k / 32) * 512, 64);
            _tile_dpbf16ps(6, 4, 5);
        }
        _tile_stored(6, w->cbuf, 64);
        __m512 s[16];
        transpose16x16_ps(w->cbuf, s); /* s[h] = the 16 keys' scores of head h */
        for (int h = 0; h < G; h++) _mm512_mask_storeu_ps(w->sc + h * max_ctx + j0, mask16(nb), _mm512_mul_ps(s[h], scale));
    }
    /* softmax numerators in bf16, zero up to the next multiple of 32 keys; their sums in fp32 (the first skip keys
       masked: kv_window) */
    float inv[16];
    const int64_t len32 = (len + 31) & ~(int64_t)31;
    if (m->softcap > 0.0f) softcap_scores(w->sc, max_ctx, G, len, m->softcap);
    if (skip) kv_mask_scores(w->sc, max_ctx, G, skip);
    for (int h = 0; h < G; h++)
        inv[h] = softmax_bf16_row(w->sc + h * max_ctx, len, len32, w->pb + h * w->ldp, w->pl + h * w->ldp);
    for (int h = 0; h < G; h++)
        for (int64_t j = 0; j < skip; j++) w->pb[h * w->ldp + j] = w->pl[h * w->ldp + j] = 0;
    if (G < 16) attn_pv_tiles(G); /* (tile 4 from the scores' 16 keys to P_lo's G heads; at 16 the same) */
    attn_pv_amx(m, cache, table, len, g, w, G, inv, o, D);
    if (G < 16) attn_tiles(G);
}

__attribute__((target("amx-tile")))
static void amx_release(void) { _tile_release(); }

/* The block's n rows of scores, key-major in w->sc (key j's 16 rows at w->sc + 16 j, fp32, before the scale; row r
 * attends to its own first len - (n - 1 - r) keys) -> P in bf16 (w->pb's 16 rows: zero past each row's keys up to
 * len32, rows n .. 15 zero) and 1 / each row's fp32 sum. Down the keys: a key's 16 rows are one vector, so the
 * rows' maxima and sums take no reduction across lanes (a row at a time took two a row, each a chain of shuffles;
 * the prompt's attention 0.72x the time this way on an AMX Xeon), and 16 keys' numerators become rows by one
 * transpose. The same scaled scores, maxima and numerators as a row at a time; each row's sum adds its keys in
 * order. */
static inline void attn_rows_softmax(const attn_ws* w, int n, int64_t len, int64_t len32, __m512 scale, float inv[16]) {
    const int64_t first = len - n; /* keys up to it: every row's */
    const __mmask16 rows = (__mmask16)((1u << n) - 1);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j++) {
        const __mmask16 mk = j <= first ? rows : (__mmask16)(rows & (0xffffu << (j - first)));
        mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_mul_ps(_mm512_loadu_ps(w->sc + 16 * j), scale));
    }
    mx = _mm512_maskz_mov_ps(rows, mx); /* (rows past n: no keys) */
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < len32; j0 += 16) {
        if (j0 >= len) { /* (the rest of the last 32 keys: zeros) */
            for (int r = 0; r < 16; r++) _mm256_storeu_si256((__m256i*)(w->pb + r * w->ldp + j0), _mm256_setzero_si256());
            continue;
        }
        for (int jj = 0; jj < 16; jj++) {
            const int64_t j = j0 + jj;
            __m512 e = _mm512_setzero_ps();
            if (j < len) {
                const __mmask16 mk = j <= first ? rows : (__mmask16)(rows & (0xffffu << (j - first)));
                e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(w->sc + 16 * j), scale), mx)));
            }
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(w->cbuf + 16 * jj, e);
        }
        __m512 er[16];
        transpose16x16_ps(w->cbuf, er); /* er[r] = row r's numerators of the 16 keys */
        for (int r = 0; r < 16; r++) _mm256_storeu_si256((__m256i*)(w->pb + r * w->ldp + j0), round_bf16x16(er[r]));
    }
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
}

/* Q^T of rows t0 .. t0 + n - 1 of query head h into w->qt: the (k, k + 1) pair of row r is 32-bit word (k / 2) 16 + r
 * (rows n .. 15 zero; on AMX the B tile of dims k .. k + 31 is the 1 KB at word (k / 32) 256), 16 pairs of the 16
 * rows a 16 x 16 transpose of 32-bit words (scatters are slow on AMD, and a 128-row prompt's attention spent a fifth
 * of its time in them on an AMX Xeon) */
static inline void attn_rows_qt(const attn_ws* w, const bf16* qkv, int64_t width, int64_t t0, int n, int64_t h,
                                int64_t D) {
    for (int64_t k = 0; k < D; k += 32) {
        const __mmask16 mk = D - k >= 32 ? (__mmask16)0xffff : (__mmask16)0x00ff;
        for (int r = 0; r < 16; r++)
            _mm512_store_si512(w->cbuf + 16 * r, r < n ? _mm512_maskz_loadu_epi32(mk, qkv + (t0 + r) * width + h * D + k)
                                                       : _mm512_setzero_si512());
        __m512 qp[16];
        transpose16x16_ps(w->cbuf, qp); /* qp[p] = pair p of every row (words moved as floats, bit for bit) */
        for (int p = 0; p < (D - k >= 32 ? 16 : 8); p++) _mm512_store_ps((float*)w->qt + (k / 2 + p) * 16, qp[p]);
    }
}

/* V of keys 0 .. len - 1 of KV head g (bf16 cache) as the B tiles of P V, once for all the query heads of the
 * group: tile (key block j0 / 32, dims 16 c ..) at vp + ((j0 / 32) (D / 16) + c) 512, pairs past len zero (row p
 * of a tile: key pair p's 16 dims, each dim's two keys side by side; attn_rows_dp reads the same rows) */
static void attn_pack_v(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t g,
                        const attn_ws* w, bf16* vp) {
    const int64_t D = m->head_dim;
    for (int64_t j0 = 0; j0 < len; j0 += 32) {
        const bf16* vr[32];
        const int n0 = (int)(len - j0 < 16 ? len - j0 : 16);
        kv_rows(m, cache, 1, table, j0, n0, g, w->tmp, vr);
        if (j0 + 16 < len) {
            const int n1 = (int)(len - j0 - 16 < 16 ? len - j0 - 16 : 16);
            kv_rows(m, cache, 1, table, j0 + 16, n1, g, w->tmp + 16 * D, vr + 16);
            for (int jj = 16 + n1; jj < 32; jj++) vr[jj] = w->zero;
        } else {
            for (int jj = n0; jj < 32; jj++) vr[jj] = w->zero;
        }
        bf16* t = vp + (j0 / 32) * (D / 16) * 512;
        for (int64_t c = 0; c < D / 16; c++, t += 512)
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(t + p * 32, pair_rows(vr[2 * p] + 16 * c, vr[2 * p + 1] + 16 * c));
    }
}

/* attn_pv_amx on V packed by attn_pack_v: the same tile products in the same order */
__attribute__((target("amx-tile,amx-bf16")))
static void attn_pv_packed(const it_model* m, int64_t len, const attn_ws* w, const bf16* vp, int nrows,
                           const float* inv, bf16* out, int64_t ldo) {
    const int64_t D = m->head_dim;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nc = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j0 = 0; j0 < len; j0 += 32) {
            const bf16* t = vp + ((j0 / 32) * (D / 16) + d0 / 16) * 512;
            _tile_loadd(7, w->pb + j0, w->ldp * 2);
            _tile_loadd(5, t, 64);
            _tile_dpbf16ps(0, 7, 5);
            if (nc > 1) { _tile_loadd(6, t + 512, 64); _tile_dpbf16ps(1, 7, 6); }
            if (nc > 2) { _tile_loadd(5, t + 1024, 64); _tile_dpbf16ps(2, 7, 5); }
            if (nc > 3) { _tile_loadd(6, t + 1536, 64); _tile_dpbf16ps(3, 7, 6); }
        }
        attn_pv_out(w, nc, nrows, inv, out + d0, ldo);
    }
}

/* Rows t0 .. t0 + n - 1 (n <= 16) of one sequence at consecutive positions (a prompt's rows: row i attends to the
 * first len - (n - 1 - i) keys), KV head g, bf16 cache, block_size a multiple of 16: each query head of the group
 * in turn, its 16 rows on the tiles at once (scores as S^T = K Q^T, 16 keys a tile, then P V), so each K/V tile
 * load serves 16 rows where attn_heads_amx serves one. Rounds as attn_heads_amx. */
__attribute__((target("amx-tile,amx-bf16")))
static void attn_rows_amx(const it_model* m, const void* cache, const int64_t* table, int64_t len, int n, int64_t g,
                          const bf16* qkv, int64_t width, int64_t t0, bf16* o, const attn_ws* w) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads, group = m->n_heads / hkv;
    const __m512 scale = _mm512_set1_ps(m->scale);
    const int64_t len32 = (len + 31) & ~(int64_t)31;
    attn_pack_v(m, cache, table, len, g, w, w->vpack); /* (V as tiles once for the group's query heads) */
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        attn_rows_qt(w, qkv, width, t0, n, h, D);
        for (int64_t j0 = 0; j0 < len; j0 += 16) { /* 16 keys of one block, rows hkv * D apart */
            const bf16* kb = (const bf16*)cache + (kv_slot(table, j0, bs) * hkv + g) * D;
            _tile_zero(6);
            for (int64_t k = 0; k < D; k += 32) {
                _tile_loadd(4, kb + k, hkv * D * 2);
                _tile_loadd(5, w->qt + (k / 32) * 512, 64);
                _tile_dpbf16ps(6, 4, 5);
            }
            _tile_stored(6, w->sc + 16 * j0, 64); /* (key-major: keys j0 .. j0 + 15 end within max_ctx) */
        }
        float inv[16];
        attn_rows_softmax(w, n, len, len32, scale, inv);
        attn_pv_packed(m, len, w, w->vpack, n, inv, o + (t0 * m->n_heads + h) * D, m->n_heads * D);
    }
}

/* ---- the same blocks of prompt rows without AMX (Zen 4 / 5, or AMX off): VDPBF16PS with one operand broadcast
 *
 * attn_rows_amx's rows, products and roundings (P rounded to bf16, its fp32 sums dividing at the end) on AVX-512
 * BF16. Scores as S^T = K Q^T: each key's pair of dims (k, k + 1), read straight from its cache row, broadcast
 * against the vector of the 16 rows' pairs (k, k + 1) of Q^T, 16 keys in 16 accumulators (one chain a key, D / 2
 * steps); transposed into rows. P V: each row's pair of probabilities (keys j, j + 1) broadcast against V's key-pair
 * rows (attn_pack_v), 4 rows x 64 dims in 16 accumulators. Against the rows one by one (attn_heads: each row reads
 * every K / V row and sums 16 keys across lanes), one K / V read serves 16 rows and no sum crosses lanes. */

/* P V for rows r0 .. r0 + R - 1 (R <= 4) of P (w->pb), dims d0 .. d0 + 16 nc - 1 (nc <= 4), over key pairs
 * 0 .. np - 1 of V packed by attn_pack_v; row i times inv[i] as bf16 into out + i * ldo */
static inline __attribute__((always_inline)) void attn_pv_dp(const attn_ws* w, const bf16* vp, int64_t D,
                                                               int64_t np, int r0, const int R, int64_t d0,
                                                               const int nc, const float* inv, bf16* out,
                                                               int64_t ldo) {
    __m512 acc[4][4];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < np; jp++) {
        const bf16* t = vp + ((jp / 16) * (D / 16) + d0 / 16) * 512 + (jp % 16) * 32;
        __m512bh v[4];
        for (int c = 0; c < nc; c++) v[c] = (__m512bh)_mm512_loadu_si512(t + c * 512);
        for (int i = 0; i < R; i++) {
            int32_t pr;
            memcpy(&pr, w->pb + (r0 + i) * w->ldp + 2 * jp, 4);
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(pr);
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], pb);
        }
    }
    for (int i = 0; i < R; i++)
        for (int c = 0; c < nc; c++)
            _mm256_storeu_si256((__m256i*)(out + i * ldo + 16 * c),
                                round_bf16x16(_mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv[r0 + i]))));
}

#define ATTN_PV_DP(R) static void attn_pv_dp_##R(const attn_ws* w, const bf16* vp, int64_t D, int64_t np, int r0, \
    int64_t d0, int nc, const float* inv, bf16* out, int64_t ldo) {                                                \
    if (nc == 4) attn_pv_dp(w, vp, D, np, r0, R, d0, 4, inv, out, ldo);                                           \
    else attn_pv_dp(w, vp, D, np, r0, R, d0, nc, inv, out, ldo); }
ATTN_PV_DP(1) ATTN_PV_DP(2) ATTN_PV_DP(3) ATTN_PV_DP(4)
#undef ATTN_PV_DP
typedef void (*attn_pv_dp_fn)(const attn_ws*, const bf16*, int64_t, int64_t, int, int64_t, int, const float*, bf16*,
                              int64_t);
static const attn_pv_dp_fn attn_pv_dp_by_rows[5] = {0, attn_pv_dp_1, attn_pv_dp_2, attn_pv_dp_3, attn_pv_dp_4};

/* attn_rows_amx's task (rows t0 .. t0 + n - 1 of one sequence, n <= 16, KV head g, bf16 cache, block_size a
 * multiple of 16) without AMX */
static void attn_rows_dp(const it_model* m, const void* cache, const int64_t* table, int64_t len, int n, int64_t g,
                         const bf16* qkv, int64_t width, int64_t t0, bf16* o, const attn_ws* w) {
    const int64_t D = m->head_dim, bs = m->block_size, hkv = m->n_kv_heads, group = m->n_heads / hkv;
    const int64_t ldk = hkv * D; /* (a block's rows of one KV head, in bf16) */
    const __m512 scale = _mm512_set1_ps(m->scale);
    const int64_t len32 = (len + 31) & ~(int64_t)31;
    int32_t* qt = (int32_t*)w->qt;
    attn_pack_v(m, cache, table, len, g, w, w->vpack); /* (V in key pairs once for the group's query heads) */
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        attn_rows_qt(w, qkv, width, t0, n, h, D);
        for (int64_t j0 = 0; j0 < len; j0 += 16) { /* 16 keys of one block (past len: unused slots, never read) */
            const bf16* kb = (const bf16*)cache + (kv_slot(table, j0, bs) * hkv + g) * D;
            __m512 acc[16];
            for (int jj = 0; jj < 16; jj++) acc[jj] = _mm512_setzero_ps();
            for (int64_t p = 0; p < D / 2; p++) {
                const __m512bh qv = (__m512bh)_mm512_load_si512(qt + p * 16);
                for (int jj = 0; jj < 16; jj++) {
                    int32_t kp;
                    memcpy(&kp, kb + jj * ldk + 2 * p, 4);
                    acc[jj] = _mm512_dpbf16_ps(acc[jj], (__m512bh)_mm512_set1_epi32(kp), qv);
                }
            }
            for (int jj = 0; jj < 16; jj++) _mm512_storeu_ps(w->sc + 16 * (j0 + jj), acc[jj]); /* (key-major) */
        }
        float inv[16];
        attn_rows_softmax(w, n, len, len32, scale, inv);
        bf16* out = o + (t0 * m->n_heads + h) * D;
        const int64_t ldo = m->n_heads * D;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int nc = (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
            for (int r0 = 0; r0 < n; r0 += 4) {
                const int R = n - r0 < 4 ? n - r0 : 4;
                /* (row r0 + R - 1 has the most keys: its pairs up to the last it reads) */
                const int64_t np = (len - (n - r0 - R) + 1) / 2;
                attn_pv_dp_by_rows[R](w, w->vpack, D, np, r0, d0, nc, inv, out + r0 * ldo + d0, ldo);
            }
        }
    }
}

/* Attention of each decode row over its sequence's paged K/V; o [T, Hq, D] bf16. One task per (row, KV head):
 * the group of query heads sharing that KV head (up to 16 at a time on AMX, 8 on AVX-512) reads each K/V row once.
 * With a bf16 cache, rows that continue the previous row's sequence (same block table, one more key: a prompt's
 * rows) go in blocks of up to 16 to attn_rows_amx (AMX) or attn_rows_dp instead, a task per (block, KV head). */
static void attention_rows(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o,
                           float* scratch, int64_t max_ctx, int use_amx, int64_t window) {
    const int64_t D = m->head_dim, hkv = m->n_kv_heads, group = m->n_heads / hkv, T = s->T;
    const int64_t width = (m->n_heads + 2 * hkv) * D;
    const int amx = use_amx && amx_state == 1 && D % 32 == 0, step = amx ? 16 : 8;
    const int64_t G = attn_score_rows(group, T);
    /* blocks of rows: start[b], rows[b] (1: a row on its own); on the stack (16 bytes a row: 2 KB for a 128-row
       prompt step; the step allocates nothing) */
    int64_t blocks[2 * T];
    int64_t *start = blocks, *rows = blocks + T, nblocks = 0;
    const int blocks_ok = T > 16 && !m->kv_int8 && m->block_size % 16 == 0 && window <= 0 &&
                        m->softcap <= 0.0f; /* (soft-capped scores: each row on its own) */
    for (int64_t t = 0; t < T; t++) {
        const int64_t* tab = s->block_tables + t * s->max_blocks;
        if (blocks_ok && nblocks > 0 && rows[nblocks - 1] < 16 && s->context_lens[t] == s->context_lens[t - 1] + 1 &&
            start[nblocks - 1] + rows[nblocks - 1] == t &&
            memcmp(tab, tab - s->max_blocks, (size_t)s->max_blocks * sizeof(int64_t)) == 0) {
            rows[nblocks - 1]++;
        } else {
            start[nblocks] = t;
            rows[nblocks++] = 1;
        }
    }
    const int64_t tasks = nblocks * hkv;
    const int nt = (int)(tasks < m->nthreads ? tasks : m->nthreads);
#pragma omp parallel num_threads(nt > 0 ? nt : 1)
    {
        const attn_ws w = attn_workspace(scratch + (int64_t)omp_get_thread_num() * attn_floats(G, max_ctx, D, T > 16), G,
                                         max_ctx, D);
        memset(w.zero, 0, (size_t)D * 2);
        int tiles = 0; /* the G the tiles are configured for */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / hkv, g = task % hkv, t = start[b];
            const int64_t* table = s->block_tables + t * s->max_blocks;
            int64_t len = s->context_lens[t];
            const int64_t skip = rows[b] > 1 ? 0 : kv_window(window, m->block_size, &table, &len);
            if (rows[b] > 1 && !amx) {
                attn_rows_dp(m, cache, table, s->context_lens[t + rows[b] - 1], (int)rows[b], g, qkv, width, t, o, &w);
                continue;
            }
            if (rows[b] > 1) {
                if (tiles != 16) { attn_tiles(16); tiles = 16; }
                attn_rows_amx(m, cache, table, s->context_lens[t + rows[b] - 1], (int)rows[b], g, qkv, width, t, o, &w);
                continue;
            }
            for (int64_t h0 = 0; h0 < group; h0 += step) {
                const int Gh = (int)(group - h0 < step ? group - h0 : step);
                const bf16* q = qkv + t * width + (g * group + h0) * D;
                bf16* out = o + (t * m->n_heads + g * group + h0) * D;
                if (amx) {
                    if (tiles != Gh) { attn_tiles(Gh); tiles = Gh; }
                    attn_heads_amx(m, cache, table, len, skip, g, q, Gh, out, &w, max_ctx);
                } else {
                    attn_heads_by_g[Gh](m, cache, table, len, skip, g, q, w.sc, max_ctx, out, w.tmp, w.zero);
                }
            }
        }
        if (tiles) amx_release();
    }
}
/* The decode attention of it_decode_layers alone, for tests: qkv [T, (Hq + 2 Hkv) D] (the queries are read), one
 * layer's cache, o [T, Hq, D]; s->work as for it_decode_layers. use_amx = 0 takes the AVX-512 path where the AMX
 * one would run. Returns 0, -1 (workspace too small) or -2 (shapes, as it_decode_layers). */
int it_decode_attention(const it_model* m, const it_step* s, const bf16* qkv, const void* cache, bf16* o, int use_amx) {
    const int64_t max_ctx = s->max_blocks * m->block_size;
    if (m->head_dim % 16 || m->n_heads % m->n_kv_heads || s->T < 1) return -2;
    const ws_layout l = workspace(m, s->T, max_ctx);
    if (l.total > s->work_bytes) return -1;
    attention_rows(m, s, qkv, cache, o, (float*)((char*)s->work + l.attn), max_ctx, use_amx, 0);
    return 0;
}
