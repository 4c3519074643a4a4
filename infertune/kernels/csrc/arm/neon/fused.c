/* ------------------------------------------------------------------ the fused decoder step's parts on NEON
 *
 * What csrc/fused_step.h (it_decode_layers: every decoder layer of a step in one call) needs from this library, as
 * csrc/x86/avx2/fused.c gives it on AVX2: the workspace layout, the linears (run_lin: the GEMV / GEMM for bf16, the
 * int16 GEMVs for W8A16 / W4A16 with their scratch from the workspace), the residual add, the elementwise parts on
 * rows (elementwise.c) and attention over the paged cache (kv_cache.h's rows, bf16 or int8). No allocation.
 *
 * Attention, one task per (row, KV head), the group of query heads sharing that KV head reading each K/V row once,
 * P in fp32 (as the AVX2 library's): scores one key at a time for each head (D / 4 FMA over 4 lanes, summed across
 * them), times the softmax scale; softmax in fp32 (exp128); P V over 16 dims a pass for up to ATTN_HEADS heads at a
 * time, one rounding to bf16. Correctness under qemu-user only (tests/test_neon.py): not measured on Arm hardware. */

#define ALIGN64(n) (((n) + 63) & ~(int64_t)63)
#define ATTN_KEYS 4  /* K / V rows fetched (an int8 cache: dequantized) per pass */
#define ATTN_HEADS 6 /* query heads per pass of P V: 6 x 4 accumulators, 4 V vectors */

/* per attention thread: scores [group, max_ctx] fp32, ATTN_KEYS K/V rows of an int8 cache dequantized */
static inline int64_t attnn_bytes(int64_t group, int64_t max_ctx, int64_t D) {
    return ALIGN64(group * max_ctx * 4) + ALIGN64(ATTN_KEYS * D * 2);
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
    /* the int16 activations of the W8A16 / W4A16 GEMVs, the largest over the layers' input widths */
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
                         attnn_bytes(m->n_heads / m->n_kv_heads, max_ctx, m->head_dim);
    l.total = off;
    return l;
}


static void rmsnorm_rows(const bf16* x, const bf16* w, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    it_rmsnorm_mt(x, w, out, T, H, eps, nthreads);
}

static void silu_mul_rows(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
    it_silu_mul(gu, act, T, I, nthreads);
}

static void gelu_mul_rows(const bf16* gu, bf16* act, int64_t T, int64_t I, int nthreads) {
    it_gelu_mul(gu, act, T, I, nthreads);
}

/* rotary (rotate-half) of the q and k heads of the fused step's qkv [T, (Hq + 2 Hkv) D] at each row's position */
static void rotary_rows(const it_model* m, const it_step* s, bf16* qkv, const float* cs) {
    const int64_t D = m->head_dim, width = (m->n_heads + 2 * m->n_kv_heads) * D;
    rotary_apply(qkv, width, s->T, m->n_heads + m->n_kv_heads, D, cs, D, s->positions, m->nthreads);
}

/* x[i] = bf16(x[i] + y[i]), as f2bf rounds (NaN kept quiet) */
static void add_rows(bf16* x, const bf16* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

/* y = x W^T (+ bias) for one of a layer's linears (no 12-bit weights here: the build refuses them) */
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

/* Gemma 2's soft-capping of G rows (ld apart) of len scores: s = cap tanh(s / cap), in fp32 */
static void softcap_scores(float* sc, int64_t ld, int64_t G, int64_t len, float cap) {
    const float32x4_t c = vdupq_n_f32(cap);
    for (int64_t h = 0; h < G; h++) {
        float* r = sc + h * ld;
        int64_t j = 0;
        for (; j + 4 <= len; j += 4) vst1q_f32(r + j, vmulq_f32(c, tanh128(vdivq_f32(vld1q_f32(r + j), c))));
        if (j < len) {
            float t[4];
            vst1q_f32(t, vmulq_f32(c, tanh128(vdivq_f32(load_f32_tail4(r + j, len - j), c))));
            memcpy(r + j, t, (size_t)(len - j) * 4);
        }
    }
}

/* r = softmax(r) over len entries, in place, fp32 */
static void softmax_rown(float* r, int64_t len) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; j++) mx = r[j] > mx ? r[j] : mx;
    const float32x4_t mv = vdupq_n_f32(mx);
    float32x4_t sum = vdupq_n_f32(0.0f);
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) {
        const float32x4_t e = exp128(vsubq_f32(vld1q_f32(r + j), mv));
        vst1q_f32(r + j, e);
        sum = vaddq_f32(sum, e);
    }
    float s = vaddvq_f32(sum);
    if (j < len) {
        float t[4];
        vst1q_f32(t, exp128(vsubq_f32(load_f32_tail4(r + j, len - j), mv)));
        for (int64_t i = 0; j + i < len; i++) r[j + i] = t[i], s += t[i];
    }
    const float inv = 1.0f / s;
    for (j = 0; j < len; j++) r[j] *= inv;
}

/* One sequence's attention for the G query heads q (rows D apart) of KV head g into o (rows D apart); the first skip
 * keys masked (kv_window) */
static void attnn_heads(const it_model* m, const void* cache, const int64_t* table, int64_t len, int64_t skip,
                        int64_t g, const bf16* q, int64_t G, float* sc, int64_t max_ctx, bf16* o, bf16* tmp) {
    const int64_t D = m->head_dim;
    const bf16* rows[ATTN_KEYS];
    for (int64_t j0 = 0; j0 < len; j0 += ATTN_KEYS) { /* scores */
        const int nb = (int)(len - j0 < ATTN_KEYS ? len - j0 : ATTN_KEYS);
        kv_rows(m, cache, 0, table, j0, nb, g, tmp, rows);
        for (int64_t h = 0; h < G; h++)
            for (int jj = 0; jj < nb; jj++) {
                float32x4_t a = vdupq_n_f32(0.0f);
                for (int64_t d = 0; d < D; d += 4)
                    a = vfmaq_f32(a, load_bf16x4(q + h * D + d), load_bf16x4(rows[jj] + d));
                sc[h * max_ctx + j0 + jj] = vaddvq_f32(a) * m->scale;
            }
    }
    if (m->softcap > 0.0f) softcap_scores(sc, max_ctx, G, len, m->softcap);
    if (skip) kv_mask_scores(sc, max_ctx, G, skip);
    for (int64_t h = 0; h < G; h++) softmax_rown(sc + h * max_ctx, len);
    if (skip) kv_zero_probs(sc, max_ctx, G, skip);
    for (int64_t d = 0; d < D; d += 16) /* P V (D % 16 == 0: it_decode_layers checks) */
        for (int64_t h0 = 0; h0 < G; h0 += ATTN_HEADS) {
            const int hn = (int)(G - h0 < ATTN_HEADS ? G - h0 : ATTN_HEADS);
            float32x4_t a[ATTN_HEADS][4];
            for (int h = 0; h < ATTN_HEADS; h++)
                for (int v = 0; v < 4; v++) a[h][v] = vdupq_n_f32(0.0f);
            for (int64_t j0 = 0; j0 < len; j0 += ATTN_KEYS) {
                const int nb = (int)(len - j0 < ATTN_KEYS ? len - j0 : ATTN_KEYS);
                kv_rows(m, cache, 1, table, j0, nb, g, tmp, rows);
                for (int jj = 0; jj < nb; jj++) {
                    float32x4_t vv[4];
                    for (int v = 0; v < 4; v++) vv[v] = load_bf16x4(rows[jj] + d + 4 * v);
                    for (int h = 0; h < hn; h++) {
                        const float p = sc[(h0 + h) * max_ctx + j0 + jj];
                        for (int v = 0; v < 4; v++) a[h][v] = vfmaq_n_f32(a[h][v], vv[v], p);
                    }
                }
            }
            for (int h = 0; h < hn; h++)
                for (int v = 0; v < 4; v++) store_bf16x4(o + (h0 + h) * D + d + 4 * v, a[h][v]);
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
    const int64_t width = (m->n_heads + 2 * hkv) * D, tasks = T * hkv, per = attnn_bytes(group, max_ctx, D);
    const int nt = (int)(tasks < m->nthreads ? tasks : m->nthreads);
#pragma omp parallel num_threads(nt > 0 ? nt : 1)
    {
        char* base = (char*)scratch + (int64_t)omp_get_thread_num() * per;
        float* sc = (float*)base;
        bf16* tmp = (bf16*)(base + ALIGN64(group * max_ctx * 4));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t t = task / hkv, g = task % hkv;
            const int64_t* table = s->block_tables + t * s->max_blocks;
            int64_t len = s->context_lens[t];
            const int64_t skip = kv_window(window, m->block_size, &table, &len);
            attnn_heads(m, cache, table, len, skip, g, qkv + t * width + g * group * D, group, sc, max_ctx,
                        o + (t * m->n_heads + g * group) * D, tmp);
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
