/* Latent attention (DeepSeek-V2 / V3) in the fused step: portable C over a library's run_lin, rmsnorm_rows,
 * rotary_apply and the paged cache's kv_rows / kv_write (kv_cache.h), included by fused_step.h.
 *
 * The cache keeps one row a token and layer, [c (mla_rank), k_pe (mla_rope)] = W values (it_model.head_dim, one KV
 * "head"), bf16 or int8 + an fp32 scale, as layers/attention/mla.py MlaAttention / Int8MlaAttention store it. A
 * layer (it_mla_layer) does what models/deepseek.py DeepseekAttention.project and MlaAttention._decode do, rounded
 * where they round:
 *   q = q_b(norm(q_a(h))) (or q_proj(h)); kv = kv_a(h); c = norm(kv[:rank]); q_pe and k_pe de-interleaved (DeepSeek's
 *   pairs) and rotated; the row [c, k_pe] written to the token's slot;
 *   q_lat = bf16(q_nope W_UK) per head (W_UK folded into the query), so a score is (q_lat . c + q_pe . k_pe) scale
 *   against the cached row itself, every head against the same rows (one pass over a sequence's rows for all of a
 *   task's heads, online softmax in fp32); o_lat = bf16(sum p c); o = bf16(o_lat W_UV^T) per head, then o_proj.
 * A step reads each cached row once per task (one task per row at T >= threads, else a row's heads split over the
 * threads), and W_UK / W_UV (kv_b_proj) once. */
#ifndef IT_MLA_H
#define IT_MLA_H

#define MLA_ALIGN(n) (((n) + 63) & ~(int64_t)63)
#define MLA_KEYS 16 /* rows of a sequence scored at a time */

/* 16 floats as one value (GCC's vector extension: one AVX-512 register, two AVX2 ones, four NEON ones), so the
 * accumulators below stay in registers on every ISA; loads and stores through memcpy (no alignment asked) */
typedef float mla_v16 __attribute__((vector_size(64)));
/* a vector's 16 lanes summed in order (by pointer: a 64-byte vector passed by value is not the same ABI on every ISA) */
static inline float mla_sum16(const mla_v16* v) {
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += (*v)[l];
    return sum;
}
/* (macros, not functions: a 64-byte vector passed by value changes the ABI on builds without AVX-512) */
#define MLA_LD16(v, p) memcpy(&(v), (p), sizeof(mla_v16))
#define MLA_ST16(p, v) memcpy((p), &(v), sizeof(mla_v16))
/* 16 bf16 values at p widened to fp32 (the bits shifted up: exact) */
typedef uint16_t mla_u16x16 __attribute__((vector_size(32)));
typedef uint32_t mla_u32x16 __attribute__((vector_size(64)));
#define MLA_LDBF16(v, p)                                                  \
    do {                                                                  \
        mla_u16x16 h_;                                                    \
        memcpy(&h_, (p), sizeof h_);                                      \
        const mla_u32x16 u_ = __builtin_convertvector(h_, mla_u32x16) << 16; \
        memcpy(&(v), &u_, sizeof(mla_v16));                               \
    } while (0)

/* The latent attention's part of the workspace (after moe_ws): q [T, H (nope + rope)], q_a [T, q_rank], kv rows
 * [T, W], the rotary parts [T, H + 1, rope], the absorbed queries [T, H, W], o_lat [T, H, rank], o [T, H v], the
 * attention's partial results (per task of mla_attention: each head's running max and sum, and its unnormalised
 * output [H, rank], fp32; T + threads tasks at most), and per thread thr_bytes of scratch (mla_thread) */
typedef struct { int64_t q, qa, kv, pe, qf, olat, ov, part, part_floats, thr, thr_bytes, total; } mla_ws;

/* A thread's scratch: the task's queries [H, W] and a row-major fp32 copy of W_UK's or W_UV's rows / of o_lat
 * [max(H, T), rank]; a block's scores [H, MLA_KEYS]; its rows in fp32, row-major [MLA_KEYS, W] and transposed
 * [W, MLA_KEYS]; then bf16 [MLA_KEYS, W] (an int8 cache's rows, dequantized) */
typedef struct { float *q, *acc, *sc, *rows, *rt; bf16 *tmp, *zero; } mla_thread;

/* the accumulators' floats: [max(H, T), max(rank, nope)] (a task's outputs; a head's rows of q_nope or o_lat) */
static inline int64_t mla_acc_floats(const it_model* m, int64_t T) {
    return (m->n_heads > T ? m->n_heads : T) * (m->mla_rank > m->mla_nope ? m->mla_rank : m->mla_nope);
}

static mla_ws mla_workspace(const it_model* m, int64_t T, int64_t base) {
    mla_ws l;
    memset(&l, 0, sizeof l);
    l.total = base;
    if (m->mla_rank <= 0) return l;
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank, rope = m->mla_rope;
    const int64_t qk = m->mla_nope + rope, qr = m->mla_q_rank > 0 ? m->mla_q_rank : 1;
    const int64_t nthreads = m->nthreads > 0 ? m->nthreads : 1;
    int64_t off = base;
    l.q = off;    off += MLA_ALIGN(T * H * qk * 2);
    l.qa = off;   off += MLA_ALIGN(T * qr * 2);
    l.kv = off;   off += MLA_ALIGN(T * W * 2);
    l.pe = off;   off += MLA_ALIGN(T * (H + 1) * rope * 2);
    l.qf = off;   off += MLA_ALIGN(T * H * W * 2);
    l.olat = off; off += MLA_ALIGN(T * H * R * 2);
    l.ov = off;   off += MLA_ALIGN(T * H * m->mla_v * 2);
    l.part_floats = H * (R + 2);
    l.part = off; off += MLA_ALIGN((T + nthreads) * l.part_floats * 4);
    l.thr_bytes = MLA_ALIGN((H * W + mla_acc_floats(m, T) + H * MLA_KEYS + 2 * MLA_KEYS * W) * 4) +
                  MLA_ALIGN((MLA_KEYS + 1) * W * 2);
    l.thr = off;  off += nthreads * l.thr_bytes;
    l.total = off;
    return l;
}

static mla_thread mla_thread_scratch(const it_model* m, int64_t T, char* base) {
    const int64_t H = m->n_heads, W = m->head_dim;
    mla_thread w;
    float* f = (float*)base;
    w.q = f;     f += H * W;
    w.acc = f;   f += mla_acc_floats(m, T);
    w.sc = f;    f += H * MLA_KEYS;
    w.rows = f;  f += MLA_KEYS * W;
    w.rt = f;    f += MLA_KEYS * W;
    w.tmp = (bf16*)(base + MLA_ALIGN((char*)f - base));
    w.zero = w.tmp + MLA_KEYS * W; /* [W] zeros (a block's rows past its last) */
    return w;
}

static inline void mla_widen(const bf16* x, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] = bf2f(x[i]);
}

static inline float mla_dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The layer's projections: q [T, H (nope + rope)] and kv [T, W] (its latent not yet normed) from h [T, hidden] */
static void mla_project(const it_model* m, const it_mla_layer* A, const bf16* h, int64_t T, char* w,
                        const mla_ws* ml, void* lin, bf16* dec) {
    const int64_t H = m->n_heads, qk = m->mla_nope + m->mla_rope, qr = m->mla_q_rank;
    bf16 *q = (bf16*)(w + ml->q), *qa = (bf16*)(w + ml->qa), *kv = (bf16*)(w + ml->kv);
    if (A->q_a.N) {
        run_lin(&A->q_a, h, m->hidden, qa, qr, T, m->nthreads, lin, dec, 0);
        rmsnorm_rows(qa, A->q_a_norm, qa, T, qr, A->latent_eps, m->nthreads);
        run_lin(&A->q_b, qa, qr, q, H * qk, T, m->nthreads, lin, dec, 0);
    } else {
        run_lin(&A->q_b, h, m->hidden, q, H * qk, T, m->nthreads, lin, dec, 0);
    }
    run_lin(&A->kv_a, h, m->hidden, kv, m->head_dim, T, m->nthreads, lin, dec, 0);
}

/* The latent's norm, the rotary parts of q and of the shared key (de-interleaved first where the checkpoint pairs
 * them), and each token's cache row [c, k_pe] written to its slot */
static void mla_rope_write(const it_model* m, const it_layer* L, const it_step* ls, int64_t T, char* w,
                           const mla_ws* ml) {
    const it_mla_layer* A = L->mla;
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank, rope = m->mla_rope, nope = m->mla_nope;
    const int64_t qk = nope + rope, half = rope / 2;
    bf16 *q = (bf16*)(w + ml->q), *kv = (bf16*)(w + ml->kv), *pe = (bf16*)(w + ml->pe);
    for (int64_t t = 0; t < T; t++) {
        rmsnorm_rows(kv + t * W, A->kv_a_norm, kv + t * W, 1, R, A->latent_eps, 1);
        for (int64_t hh = 0; hh <= H; hh++) { /* head H: the shared key */
            const bf16* src = hh < H ? q + (t * H + hh) * qk + nope : kv + t * W + R;
            bf16* dst = pe + (t * (H + 1) + hh) * rope;
            if (A->interleaved)
                for (int64_t i = 0; i < half; i++) dst[i] = src[2 * i], dst[half + i] = src[2 * i + 1];
            else
                memcpy(dst, src, (size_t)rope * 2);
        }
    }
    rotary_apply(pe, (H + 1) * rope, T, H + 1, rope, L->cos_sin ? L->cos_sin : m->cos_sin, rope, ls->positions,
                 m->nthreads);
    for (int64_t t = 0; t < T; t++) {
        memcpy(kv + t * W + R, pe + (t * (H + 1) + H) * rope, (size_t)rope * 2);
        kv_write(m, L->kv_cache, 0, ls->slots[t], kv + t * W);
    }
}

/* NB rows (fp32 q_nope, [NB, nope] at qs) times W_UK's columns r .. r + 16 RC - 1 -> out [NB, 16 RC]: NB RC vectors of
 * sums in registers, each weight vector widened once for the NB rows; a row of W_UK is read 32 RC bytes at a time */
#define MLA_ABSORB_ROWS(NB, RC)                                                                                   \
    static inline void mla_absorb_rows_##NB##_##RC(const float* qs, int64_t nope, const bf16* wk, int64_t R,     \
                                                   int64_t r, float* out) {                                       \
        mla_v16 a[NB][RC], wv[RC];                                                                                \
        memset(a, 0, sizeof a);                                                                                   \
        for (int64_t n = 0; n < nope; n++) {                                                                      \
            for (int c = 0; c < RC; c++) MLA_LDBF16(wv[c], wk + n * R + r + 16 * c);                              \
            for (int i = 0; i < NB; i++) {                                                                        \
                const float qv = qs[i * nope + n];                                                                \
                for (int c = 0; c < RC; c++) a[i][c] += qv * wv[c];                                               \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < NB; i++) memcpy(out + i * 128, a[i], sizeof a[i]);                                    \
    }
/* (few rows: wide slices, so each row of W_UK streams in 256 bytes at a time; more rows: narrower, the registers
   go to the rows) */
MLA_ABSORB_ROWS(8, 2)
MLA_ABSORB_ROWS(4, 4)
MLA_ABSORB_ROWS(2, 8)
MLA_ABSORB_ROWS(1, 8)
MLA_ABSORB_ROWS(8, 1)
MLA_ABSORB_ROWS(4, 1)
MLA_ABSORB_ROWS(2, 1)
MLA_ABSORB_ROWS(1, 1)
#undef MLA_ABSORB_ROWS

/* NB rows (fp32 o_lat, [NB, R] at xs) against two of W_UV's rows (fp32, wa and wb) -> out [NB][2]: 2 NB vectors of
 * partial sums over 16-wide slices of rank, summed across their lanes at the end */
#define MLA_UPV_ROWS(NB)                                                                                           \
    static inline void mla_upv_rows_##NB(const float* xs, const float* wa, const float* wb, int64_t R,            \
                                         float out[NB][2]) {                                                        \
        mla_v16 a[NB][2], x, w0, w1;                                                                              \
        memset(a, 0, sizeof a);                                                                                   \
        for (int64_t r = 0; r < R; r += 16) {                                                                     \
            MLA_LD16(w0, wa + r);                                                                                 \
            MLA_LD16(w1, wb + r);                                                                                 \
            for (int i = 0; i < NB; i++) {                                                                        \
                MLA_LD16(x, xs + i * R + r);                                                                      \
                a[i][0] += x * w0;                                                                                \
                a[i][1] += x * w1;                                                                                \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < NB; i++)                                                                              \
            for (int j = 0; j < 2; j++) out[i][j] = mla_sum16(&a[i][j]);                                          \
    }
MLA_UPV_ROWS(8)
MLA_UPV_ROWS(4)
MLA_UPV_ROWS(2)
MLA_UPV_ROWS(1)
#undef MLA_UPV_ROWS

/* NB (1 or 2) rows (fp32 o_lat at xs) against four of W_UV's rows read as bf16 (w, R apart) -> out [NB][4]: for steps of
 * one or two rows, where W_UV streams from memory once per head and widening it into scratch first would cost a
 * second pass */
#define MLA_UPV4_ROWS(NB)                                                                                          \
    static inline void mla_upv4_rows_##NB(const float* xs, const bf16* w, int64_t R, float out[NB][4]) {         \
        mla_v16 a[NB][4], x, wv[4];                                                                               \
        memset(a, 0, sizeof a);                                                                                   \
        for (int64_t r = 0; r < R; r += 16) {                                                                     \
            for (int j = 0; j < 4; j++) MLA_LDBF16(wv[j], w + j * R + r);                                         \
            for (int i = 0; i < NB; i++) {                                                                        \
                MLA_LD16(x, xs + i * R + r);                                                                      \
                for (int j = 0; j < 4; j++) a[i][j] += x * wv[j];                                                 \
            }                                                                                                     \
        }                                                                                                         \
        for (int i = 0; i < NB; i++)                                                                              \
            for (int j = 0; j < 4; j++) out[i][j] = mla_sum16(&a[i][j]);                                          \
    }
MLA_UPV4_ROWS(2)
MLA_UPV4_ROWS(1)
#undef MLA_UPV4_ROWS

/* Rows t0 .. of a step in blocks of 8, then 4, 2, 1: the block's size at t0 */
static inline int64_t mla_block(int64_t T, int64_t t0) {
    const int64_t left = T - t0;
    return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* The absorbed queries qf [T, H, W]: per head bf16(q_nope W_UK) (fp32 sums over nope, in order), then its rotated
 * q_pe. One parallel region over the heads; a head's W_UK [nope, rank] is read once for every block of up to 8 rows
 * (mla_absorb_rows_*: no sums across lanes). */
static void mla_absorb_q(const it_model* m, const it_mla_layer* A, int64_t T, char* w, const mla_ws* ml) {
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank, rope = m->mla_rope, nope = m->mla_nope;
    const int64_t qk = nope + rope, per_head = (nope + m->mla_v) * R;
    const bf16 *q = (const bf16*)(w + ml->q), *pe = (const bf16*)(w + ml->pe);
    bf16* qf = (bf16*)(w + ml->qf);
    const int nt = pick_threads(H, H * per_head * 2, m->nthreads);
#pragma omp parallel num_threads(nt)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
        float* qs = th.acc; /* the head's q_nope of every row, fp32 [T, nope] */
#pragma omp for schedule(static)
        for (int64_t hh = 0; hh < H; hh++) {
            const bf16* wk = A->kv_up + hh * per_head; /* [nope, R] */
            for (int64_t t = 0; t < T; t++) mla_widen(q + (t * H + hh) * qk, qs + t * nope, nope);
            for (int64_t t0 = 0; t0 < T;) {
                const int64_t nb = mla_block(T, t0);
                /* the slices' width for this block (16 RC columns), then 16-column slices for the rest of R */
                const int64_t wide = 16 * (nb == 8 ? 2 : nb == 4 ? 4 : 8);
                for (int64_t r = 0; r < R;) {
                    const int64_t cols = R - r >= wide ? wide : 16;
                    float out[8 * 128];
                    const float* qb = qs + t0 * nope;
                    if (cols == 16) {
                        if (nb == 8) mla_absorb_rows_8_1(qb, nope, wk, R, r, out);
                        else if (nb == 4) mla_absorb_rows_4_1(qb, nope, wk, R, r, out);
                        else if (nb == 2) mla_absorb_rows_2_1(qb, nope, wk, R, r, out);
                        else mla_absorb_rows_1_1(qb, nope, wk, R, r, out);
                    } else if (nb == 8) {
                        mla_absorb_rows_8_2(qb, nope, wk, R, r, out);
                    } else if (nb == 4) {
                        mla_absorb_rows_4_4(qb, nope, wk, R, r, out);
                    } else if (nb == 2) {
                        mla_absorb_rows_2_8(qb, nope, wk, R, r, out);
                    } else {
                        mla_absorb_rows_1_8(qb, nope, wk, R, r, out);
                    }
                    for (int64_t i = 0; i < nb; i++) {
                        bf16* dst = qf + ((t0 + i) * H + hh) * W + r;
                        for (int64_t l = 0; l < cols; l++) dst[l] = f2bf(out[i * 128 + l]);
                    }
                    r += cols;
                }
                t0 += nb;
            }
            for (int64_t t = 0; t < T; t++)
                memcpy(qf + (t * H + hh) * W + R, pe + (t * (H + 1) + hh) * rope, (size_t)rope * 2);
        }
    }
}

/* Scores of a block of MLA_KEYS (16) rows (rt: transposed, [W, 16], zero past the block's rows) for nh heads
 * (q: [nh, W] fp32) into sc [nh, 16], times scale: four heads a pass, each one vector of the block's 16 keys (one
 * broadcast multiply-add per value: no sums across lanes) */
static inline void mla_scores(const float* q, int64_t nh, const float* rt, int64_t W, float scale, float* sc) {
    int64_t i = 0;
    mla_v16 r;
    for (; i + 4 <= nh; i += 4) {
        mla_v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        const float *q0 = q + i * W, *q1 = q0 + W, *q2 = q1 + W, *q3 = q2 + W;
        for (int64_t d = 0; d < W; d++) {
            MLA_LD16(r, rt + d * MLA_KEYS);
            s0 += q0[d] * r;
            s1 += q1[d] * r;
            s2 += q2[d] * r;
            s3 += q3[d] * r;
        }
        s0 *= scale, s1 *= scale, s2 *= scale, s3 *= scale;
        MLA_ST16(sc + i * MLA_KEYS, s0);
        MLA_ST16(sc + (i + 1) * MLA_KEYS, s1);
        MLA_ST16(sc + (i + 2) * MLA_KEYS, s2);
        MLA_ST16(sc + (i + 3) * MLA_KEYS, s3);
    }
    for (; i < nh; i++) {
        mla_v16 s0 = {0};
        for (int64_t d = 0; d < W; d++) {
            MLA_LD16(r, rt + d * MLA_KEYS);
            s0 += q[i * W + d] * r;
        }
        s0 *= scale;
        MLA_ST16(sc + i * MLA_KEYS, s0);
    }
}

#if defined(__AVX512BF16__)
/* The AVX-512 library's scores of a block: the bf16 rows as they are (no widening, no transposing), VDPBF16PS over
 * 32 values a step for the block's 16 keys, their 16 sums reduced together (attention.c reduce16), one head (q: bf16
 * [nh, W]) at a time. bf16 x bf16 products are exact in fp32: only the order of the sums differs from
 * mla_scores'. */
static inline void mla_scores_bf16(const bf16* q, int64_t nh, const bf16* const* rows, int nb, int64_t W, float scale,
                                   float* sc, const bf16* zero) {
    const bf16* kr[MLA_KEYS];
    for (int jj = 0; jj < MLA_KEYS; jj++) kr[jj] = jj < nb ? rows[jj] : zero;
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nh; i++) {
        __m512 a[MLA_KEYS];
        for (int jj = 0; jj < MLA_KEYS; jj++) a[jj] = _mm512_setzero_ps();
        for (int64_t d = 0; d < W; d += 32) {
            const __mmask32 mk = W - d >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (W - d)) - 1u);
            const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mk, q + i * W + d);
            for (int jj = 0; jj < MLA_KEYS; jj++)
                a[jj] = _mm512_dpbf16_ps(a[jj], qv, (__m512bh)_mm512_maskz_loadu_epi16(mk, kr[jj] + d));
        }
        _mm512_storeu_ps(sc + i * MLA_KEYS, _mm512_mul_ps(reduce16(a), s));
    }
}
#endif

/* acc[i] += sum over the block's nb rows of p[i][j] c_j (rows: [16, W], c the first R values of a row; R a multiple
 * of 16) for nh heads: four heads a pass over 16 of the rows' values, in registers over the block's rows */
static inline void mla_values(const float* p, int64_t nh, int nb, const float* rows, int64_t W, int64_t R,
                              float* acc) {
    int64_t i = 0;
    mla_v16 c, x0, x1, x2, x3;
    for (; i + 4 <= nh; i += 4) {
        const float *p0 = p + i * MLA_KEYS, *p1 = p0 + MLA_KEYS, *p2 = p1 + MLA_KEYS, *p3 = p2 + MLA_KEYS;
        float *a0 = acc + i * R, *a1 = a0 + R, *a2 = a1 + R, *a3 = a2 + R;
        for (int64_t r = 0; r < R; r += 16) {
            MLA_LD16(x0, a0 + r);
            MLA_LD16(x1, a1 + r);
            MLA_LD16(x2, a2 + r);
            MLA_LD16(x3, a3 + r);
            for (int j = 0; j < nb; j++) {
                MLA_LD16(c, rows + j * W + r);
                x0 += p0[j] * c;
                x1 += p1[j] * c;
                x2 += p2[j] * c;
                x3 += p3[j] * c;
            }
            MLA_ST16(a0 + r, x0);
            MLA_ST16(a1 + r, x1);
            MLA_ST16(a2 + r, x2);
            MLA_ST16(a3 + r, x3);
        }
    }
    for (; i < nh; i++) {
        const float* p0 = p + i * MLA_KEYS;
        float* a0 = acc + i * R;
        for (int64_t r = 0; r < R; r += 16) {
            MLA_LD16(x0, a0 + r);
            for (int j = 0; j < nb; j++) {
                MLA_LD16(c, rows + j * W + r);
                x0 += p0[j] * c;
            }
            MLA_ST16(a0 + r, x0);
        }
    }
}

/* Every head of one row over its cached rows k0 .. k1 - 1 (a task of mla_attention) -> part: each head's running
 * max and sum [2, H], then its unnormalised output [H, rank], fp32 (online softmax: a block that raises a head's max
 * rescales what that head summed before) */
static void mla_attend(const it_model* m, const void* cache, const int64_t* table, int64_t k0, int64_t k1,
                       const bf16* qf, float* part, const mla_thread* th) {
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank;
    float *mx = part, *sum = part + H, *acc = part + 2 * H;
    for (int64_t i = 0; i < H; i++) {
#if !defined(__AVX512BF16__)
        mla_widen(qf + i * W, th->q + i * W, W);
#endif
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
    }
    memset(acc, 0, (size_t)(H * R) * 4);
#if defined(__AVX512BF16__)
    memset(th->zero, 0, (size_t)W * 2);
#endif
    for (int64_t j0 = k0; j0 < k1; j0 += MLA_KEYS) {
        const int nb = (int)(k1 - j0 < MLA_KEYS ? k1 - j0 : MLA_KEYS);
        const bf16* rows[MLA_KEYS];
        kv_rows(m, cache, 0, table, j0, nb, 0, th->tmp, rows);
#if defined(__AVX512BF16__)
        for (int jj = 0; jj < nb; jj++) mla_widen(rows[jj], th->rows + jj * W, R); /* (the values: c only) */
        mla_scores_bf16(qf, H, rows, nb, W, m->scale, th->sc, th->zero);
#else
        for (int jj = 0; jj < nb; jj++) mla_widen(rows[jj], th->rows + jj * W, W);
        for (int64_t d = 0; d < W; d++)
            for (int jj = 0; jj < MLA_KEYS; jj++) th->rt[d * MLA_KEYS + jj] = jj < nb ? th->rows[jj * W + d] : 0.0f;
        mla_scores(th->q, H, th->rt, W, m->scale, th->sc);
#endif
        for (int64_t i = 0; i < H; i++) { /* the scores -> softmax numerators, in place */
            float* sc = th->sc + i * MLA_KEYS;
            float bmax = -INFINITY;
            for (int jj = 0; jj < nb; jj++) bmax = sc[jj] > bmax ? sc[jj] : bmax;
            if (bmax > mx[i]) { /* a new running max: what was summed so far, rescaled to it */
                const float c = expf(mx[i] - bmax);
                sum[i] *= c;
                for (int64_t r = 0; r < R; r++) acc[i * R + r] *= c;
                mx[i] = bmax;
            }
            for (int jj = 0; jj < nb; jj++) {
                sc[jj] = expf(sc[jj] - mx[i]);
                sum[i] += sc[jj];
            }
        }
        mla_values(th->sc, H, nb, th->rows, W, R, acc);
    }
}

/* Every row's heads over its sequence's cached rows: o_lat [T, H, rank]. A task is a row's keys, or, with fewer
 * rows than threads, a share of them (whole blocks of MLA_KEYS); each reads its rows once for all H heads, and a
 * row's shares are merged (each head's sums rescaled to the common max) in a second pass over (row, head). */
static void mla_attention(const it_model* m, const it_step* ls, const void* cache, int64_t T, char* w,
                          const mla_ws* ml) {
    const int64_t H = m->n_heads, R = m->mla_rank, W = m->head_dim, P = ml->part_floats;
    const bf16* qf = (const bf16*)(w + ml->qf);
    bf16* olat = (bf16*)(w + ml->olat);
    float* parts = (float*)(w + ml->part);
    const int nthreads = m->nthreads > 0 ? m->nthreads : 1;
    const int64_t shares = T >= nthreads ? 1 : (nthreads + T - 1) / T, tasks = T * shares;
    const int nt = (int)(tasks < nthreads ? tasks : nthreads);
    int64_t read = 0; /* cache rows the tasks read (it_step_stats.kv_read_bytes) */
#pragma omp parallel num_threads(nt) reduction(+ : read)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t t = task / shares, c = task % shares, len = ls->context_lens[t];
            const int64_t per = (len + MLA_KEYS * shares - 1) / (MLA_KEYS * shares) * MLA_KEYS;
            const int64_t k0 = c * per < len ? c * per : len, k1 = k0 + per < len ? k0 + per : len;
            mla_attend(m, cache, ls->block_tables + t * ls->max_blocks, k0, k1, qf + t * H * W, parts + task * P, &th);
            read += k1 - k0;
        }
#pragma omp for schedule(static)
        for (int64_t th_ = 0; th_ < T * H; th_++) {
            const int64_t t = th_ / H, i = th_ % H;
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < shares; c++) {
                const float v = parts[(t * shares + c) * P + i];
                mx = v > mx ? v : mx;
            }
            for (int64_t c = 0; c < shares; c++) { /* (each share's max becomes its factor: this (row, head)'s own) */
                float* pc = parts + (t * shares + c) * P;
                pc[i] = pc[i] == -INFINITY ? 0.0f : expf(pc[i] - mx);
                sum += pc[H + i] * pc[i];
            }
            const float inv = 1.0f / sum;
            for (int64_t r = 0; r < R; r++) {
                float o = 0.0f;
                for (int64_t c = 0; c < shares; c++) {
                    const float* pc = parts + (t * shares + c) * P;
                    o += pc[2 * H + i * R + r] * pc[i];
                }
                olat[(t * H + i) * R + r] = f2bf(o * inv);
            }
        }
    }
    if (ls->stats) ls->stats->kv_read_bytes += read * (m->kv_int8 ? W + 4 : 2 * W);
}

/* o [T, H v]: per head bf16(o_lat W_UV^T) (fp32 sums over rank): the head's o_lat rows widened once, W_UV's rows
 * two at a time, against blocks of up to 8 rows (mla_upv_rows_*) */
static void mla_up_v(const it_model* m, const it_mla_layer* A, int64_t T, char* w, const mla_ws* ml) {
    const int64_t H = m->n_heads, R = m->mla_rank, nope = m->mla_nope, V = m->mla_v, per_head = (nope + V) * R;
    const bf16* olat = (const bf16*)(w + ml->olat);
    bf16* ov = (bf16*)(w + ml->ov);
    const int nt = pick_threads(H, H * per_head * 2, m->nthreads);
#pragma omp parallel num_threads(nt)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
        float *xs = th.acc, *wf = th.rows; /* the head's o_lat rows [T, R]; two W_UV rows [2, R] */
#pragma omp for schedule(static)
        for (int64_t hh = 0; hh < H; hh++) {
            const bf16* wv = A->kv_up + hh * per_head + nope * R; /* [V, R] */
            for (int64_t t = 0; t < T; t++) mla_widen(olat + (t * H + hh) * R, xs + t * R, R);
            if (T <= 2 && V % 4 == 0) { /* one or two rows: W_UV's rows straight from memory, four at a time */
                for (int64_t v0 = 0; v0 < V; v0 += 4) {
                    float out[2][4];
                    if (T == 2)
                        mla_upv4_rows_2(xs, wv + v0 * R, R, out);
                    else
                        mla_upv4_rows_1(xs, wv + v0 * R, R, out);
                    for (int64_t i = 0; i < T; i++)
                        for (int j = 0; j < 4; j++) ov[(i * H + hh) * V + v0 + j] = f2bf(out[i][j]);
                }
                continue;
            }
            for (int64_t v0 = 0; v0 < V; v0 += 2) {
                const int64_t v1 = v0 + 1 < V ? v0 + 1 : v0; /* (an odd V's last row twice: stored once) */
                mla_widen(wv + v0 * R, wf, R);
                mla_widen(wv + v1 * R, wf + R, R);
                for (int64_t t0 = 0; t0 < T;) {
                    const int64_t nb = mla_block(T, t0);
                    float out[8][2];
                    const float* xb = xs + t0 * R;
                    if (nb == 8) mla_upv_rows_8(xb, wf, wf + R, R, out);
                    else if (nb == 4) mla_upv_rows_4(xb, wf, wf + R, R, out);
                    else if (nb == 2) mla_upv_rows_2(xb, wf, wf + R, R, out);
                    else mla_upv_rows_1(xb, wf, wf + R, R, out);
                    for (int64_t i = 0; i < nb; i++) {
                        ov[((t0 + i) * H + hh) * V + v0] = f2bf(out[i][0]);
                        if (v1 != v0) ov[((t0 + i) * H + hh) * V + v1] = f2bf(out[i][1]);
                    }
                    t0 += nb;
                }
            }
        }
    }
}

/* A layer's shapes against the model's (0: fine) */
static int mla_check(const it_model* m, const it_layer* L) {
    const it_mla_layer* A = L->mla;
    const int64_t H = m->n_heads, qk = m->mla_nope + m->mla_rope;
    if (m->mla_rank < 16 || m->mla_rank % 16 || m->mla_rope < 2 || m->mla_rope % 2 || m->mla_nope < 1 || m->mla_v < 1)
        return -2; /* (the rank a multiple of 16: mla_values' vectors) */
    if (m->head_dim != m->mla_rank + m->mla_rope || m->n_kv_heads != 1 || L->window > 0) return -2;
    if (A->q_b.N != H * qk || A->kv_a.N != m->head_dim || A->kv_a.K != m->hidden || L->o.K != H * m->mla_v) return -2;
    if (A->q_a.N ? A->q_a.N != m->mla_q_rank || A->q_b.K != A->q_a.N || !A->q_a_norm : A->q_b.K != m->hidden)
        return -2;
    return 0;
}
#endif
