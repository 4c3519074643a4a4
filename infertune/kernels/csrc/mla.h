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

/* The latent attention's part of the workspace (after moe_ws): q [T, H (nope + rope)], q_a [T, q_rank], kv rows
 * [T, W], the rotary parts [T, H + 1, rope], the absorbed queries [T, H, W], o_lat [T, H, rank], o [T, H v], and
 * per thread thr_bytes of fp32 scratch (mla_thread) */
typedef struct { int64_t q, qa, kv, pe, qf, olat, ov, thr, thr_bytes, total; } mla_ws;

/* A thread's scratch, in floats: the task's queries [H, W] and accumulators [max(H, T), rank] in fp32, each head's
 * running max and sum [H], a block's scores [H, MLA_KEYS], its rows in fp32 [MLA_KEYS, W]; then bf16 [MLA_KEYS, W]
 * (an int8 cache's rows, dequantized) */
typedef struct { float *q, *acc, *mx, *sum, *sc, *rows; bf16* tmp; } mla_thread;

static inline int64_t mla_acc_rows(const it_model* m, int64_t T) { return m->n_heads > T ? m->n_heads : T; }

static mla_ws mla_workspace(const it_model* m, int64_t T, int64_t base) {
    mla_ws l;
    memset(&l, 0, sizeof l);
    l.total = base;
    if (m->mla_rank <= 0) return l;
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank, rope = m->mla_rope;
    const int64_t qk = m->mla_nope + rope, qr = m->mla_q_rank > 0 ? m->mla_q_rank : 1;
    int64_t off = base;
    l.q = off;    off += MLA_ALIGN(T * H * qk * 2);
    l.qa = off;   off += MLA_ALIGN(T * qr * 2);
    l.kv = off;   off += MLA_ALIGN(T * W * 2);
    l.pe = off;   off += MLA_ALIGN(T * (H + 1) * rope * 2);
    l.qf = off;   off += MLA_ALIGN(T * H * W * 2);
    l.olat = off; off += MLA_ALIGN(T * H * R * 2);
    l.ov = off;   off += MLA_ALIGN(T * H * m->mla_v * 2);
    l.thr_bytes = MLA_ALIGN((H * W + mla_acc_rows(m, T) * R + 2 * H + H * MLA_KEYS + MLA_KEYS * W) * 4) +
                  MLA_ALIGN(MLA_KEYS * W * 2);
    l.thr = off;  off += (m->nthreads > 0 ? m->nthreads : 1) * l.thr_bytes;
    l.total = off;
    return l;
}

static mla_thread mla_thread_scratch(const it_model* m, int64_t T, char* base) {
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank;
    mla_thread w;
    float* f = (float*)base;
    w.q = f;     f += H * W;
    w.acc = f;   f += mla_acc_rows(m, T) * R;
    w.mx = f;    f += H;
    w.sum = f;   f += H;
    w.sc = f;    f += H * MLA_KEYS;
    w.rows = f;  f += MLA_KEYS * W;
    w.tmp = (bf16*)(base + MLA_ALIGN((char*)f - base));
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

static inline void mla_axpy(float a, const float* x, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
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

/* The absorbed queries qf [T, H, W]: per head bf16(q_nope W_UK) (fp32 sums over nope, in order), then its rotated
 * q_pe. One parallel region over the heads, each reading its W_UK [nope, rank] once for every row. */
static void mla_absorb_q(const it_model* m, const it_mla_layer* A, int64_t T, char* w, const mla_ws* ml) {
    const int64_t H = m->n_heads, W = m->head_dim, R = m->mla_rank, rope = m->mla_rope, nope = m->mla_nope;
    const int64_t qk = nope + rope, per_head = (nope + m->mla_v) * R;
    const bf16 *q = (const bf16*)(w + ml->q), *pe = (const bf16*)(w + ml->pe);
    bf16* qf = (bf16*)(w + ml->qf);
    const int nt = pick_threads(H, H * per_head * 2, m->nthreads);
#pragma omp parallel num_threads(nt)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
#pragma omp for schedule(static)
        for (int64_t hh = 0; hh < H; hh++) {
            const bf16* wk = A->kv_up + hh * per_head; /* [nope, R] */
            memset(th.acc, 0, (size_t)(T * R) * 4);
            for (int64_t n = 0; n < nope; n++) {
                mla_widen(wk + n * R, th.rows, R);
                for (int64_t t = 0; t < T; t++) mla_axpy(bf2f(q[(t * H + hh) * qk + n]), th.rows, th.acc + t * R, R);
            }
            for (int64_t t = 0; t < T; t++) {
                bf16* dst = qf + (t * H + hh) * W;
                for (int64_t r = 0; r < R; r++) dst[r] = f2bf(th.acc[t * R + r]);
                memcpy(dst + R, pe + (t * (H + 1) + hh) * rope, (size_t)rope * 2);
            }
        }
    }
}

/* Heads h0 .. h0 + nh - 1 of row t over its first len cached rows -> o_lat (bf16) */
static void mla_attend(const it_model* m, const void* cache, const int64_t* table, int64_t len, const bf16* qf,
                       int64_t h0, int64_t nh, bf16* olat, const mla_thread* th) {
    const int64_t W = m->head_dim, R = m->mla_rank;
    for (int64_t i = 0; i < nh; i++) {
        mla_widen(qf + (h0 + i) * W, th->q + i * W, W);
        th->mx[i] = -INFINITY;
        th->sum[i] = 0.0f;
    }
    memset(th->acc, 0, (size_t)(nh * R) * 4);
    for (int64_t j0 = 0; j0 < len; j0 += MLA_KEYS) {
        const int nb = (int)(len - j0 < MLA_KEYS ? len - j0 : MLA_KEYS);
        const bf16* rows[MLA_KEYS];
        kv_rows(m, cache, 0, table, j0, nb, 0, th->tmp, rows);
        for (int jj = 0; jj < nb; jj++) mla_widen(rows[jj], th->rows + jj * W, W);
        for (int64_t i = 0; i < nh; i++) {
            float* sc = th->sc + i * MLA_KEYS;
            float bmax = -INFINITY;
            for (int jj = 0; jj < nb; jj++) {
                sc[jj] = mla_dot(th->q + i * W, th->rows + jj * W, W) * m->scale;
                bmax = sc[jj] > bmax ? sc[jj] : bmax;
            }
            float* acc = th->acc + i * R;
            if (bmax > th->mx[i]) { /* a new running max: what was summed so far, rescaled to it */
                const float c = expf(th->mx[i] - bmax);
                th->sum[i] *= c;
                for (int64_t r = 0; r < R; r++) acc[r] *= c;
                th->mx[i] = bmax;
            }
            for (int jj = 0; jj < nb; jj++) {
                const float p = expf(sc[jj] - th->mx[i]);
                th->sum[i] += p;
                mla_axpy(p, th->rows + jj * W, acc, R);
            }
        }
    }
    for (int64_t i = 0; i < nh; i++) {
        const float inv = 1.0f / th->sum[i];
        for (int64_t r = 0; r < R; r++) olat[(h0 + i) * R + r] = f2bf(th->acc[i * R + r] * inv);
    }
}

/* Every row's heads over its sequence's cached rows: o_lat [T, H, rank] */
static void mla_attention(const it_model* m, const it_step* ls, const void* cache, int64_t T, char* w,
                          const mla_ws* ml) {
    const int64_t H = m->n_heads, R = m->mla_rank, W = m->head_dim;
    const bf16* qf = (const bf16*)(w + ml->qf);
    bf16* olat = (bf16*)(w + ml->olat);
    const int nthreads = m->nthreads > 0 ? m->nthreads : 1;
    /* a row's heads in chunks, so that there are at least as many tasks as threads */
    int64_t chunks = T >= nthreads ? 1 : (nthreads + T - 1) / T;
    chunks = chunks < H ? chunks : H;
    const int64_t hc = (H + chunks - 1) / chunks;
    chunks = (H + hc - 1) / hc;
    const int64_t tasks = T * chunks;
    const int nt = (int)(tasks < nthreads ? tasks : nthreads);
#pragma omp parallel num_threads(nt)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t t = task / chunks, h0 = (task % chunks) * hc, nh = H - h0 < hc ? H - h0 : hc;
            mla_attend(m, cache, ls->block_tables + t * ls->max_blocks, ls->context_lens[t], qf + t * H * W, h0, nh,
                       olat + t * H * R, &th);
        }
    }
}

/* o [T, H v]: per head bf16(o_lat W_UV^T) (fp32 sums over rank) */
static void mla_up_v(const it_model* m, const it_mla_layer* A, int64_t T, char* w, const mla_ws* ml) {
    const int64_t H = m->n_heads, R = m->mla_rank, nope = m->mla_nope, V = m->mla_v, per_head = (nope + V) * R;
    const bf16* olat = (const bf16*)(w + ml->olat);
    bf16* ov = (bf16*)(w + ml->ov);
    const int nt = pick_threads(H, H * per_head * 2, m->nthreads);
#pragma omp parallel num_threads(nt)
    {
        const mla_thread th = mla_thread_scratch(m, T, w + ml->thr + (int64_t)omp_get_thread_num() * ml->thr_bytes);
#pragma omp for schedule(static)
        for (int64_t hh = 0; hh < H; hh++) {
            const bf16* wv = A->kv_up + hh * per_head + nope * R; /* [V, R] */
            for (int64_t t = 0; t < T; t++) mla_widen(olat + (t * H + hh) * R, th.acc + t * R, R);
            for (int64_t v = 0; v < V; v++) {
                mla_widen(wv + v * R, th.rows, R);
                for (int64_t t = 0; t < T; t++) ov[(t * H + hh) * V + v] = f2bf(mla_dot(th.acc + t * R, th.rows, R));
            }
        }
    }
}

/* A layer's shapes against the model's (0: fine) */
static int mla_check(const it_model* m, const it_layer* L) {
    const it_mla_layer* A = L->mla;
    const int64_t H = m->n_heads, qk = m->mla_nope + m->mla_rope;
    if (m->mla_rank < 1 || m->mla_rope < 2 || m->mla_rope % 2 || m->mla_nope < 1 || m->mla_v < 1) return -2;
    if (m->head_dim != m->mla_rank + m->mla_rope || m->n_kv_heads != 1 || L->window > 0) return -2;
    if (A->q_b.N != H * qk || A->kv_a.N != m->head_dim || A->kv_a.K != m->hidden || L->o.K != H * m->mla_v) return -2;
    if (A->q_a.N ? A->q_a.N != m->mla_q_rank || A->q_b.K != A->q_a.N || !A->q_a_norm : A->q_b.K != m->hidden)
        return -2;
    return 0;
}
#endif
