/* The fused decoder step, it_decode_layers, over a library's parts (portable C: the AVX-512 library includes it after
 * its decode_ws.c / attention.c / elementwise.c / moe.c, the AVX2 one after x86/avx2/fused.c and moe_gemv.h, the NEON
 * one after arm/neon/fused.c and moe_gemv.h). What a library provides:
 * ws_layout / workspace(m, T, max_ctx) (offsets h, qkv, o, gu, act, y, lin, dec, attn, total), rmsnorm_rows,
 * silu_mul_rows, rotary_rows, run_lin / run_lin_add (a linear, and one added into the residual), add_rows,
 * attention_rows (with a layer's sliding window: kv_window, and Gemma 2's soft-capping: softcap_scores), kv_write
 * (kv_cache.h), gelu_mul_rows (Gemma's GeLU-tanh), and the MoE kernels it_moe_route / it_moe_experts (moe.h). Gemma's
 * fp32 (1 + w) norms are here (portable C: a few of a layer's microseconds). Optionally PX_TAKES / PX_NORM / RUN_LIN_PX
 * / PX_ZERO_TAIL: linears that read their activations packed in their GEMM's tile order (the AVX-512 library with AMX,
 * decode_ws.c; elsewhere they default to rows). */
#ifndef IT_FUSED_STEP_H
#define IT_FUSED_STEP_H
#include <sched.h>
#include <time.h>

/* The step's split by part for `infertune profile` (it_step.stats, abi.h it_step_stats: the caller's, one per
 * engine), at one clock read a part and layer; none where stats is NULL. */
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The routing's part of the workspace, after the library's (ws_layout): a MoE layer's output and its shared expert's
 * [T, hidden], the top-k weights [T, k] fp32, the grouping (ids and order [T k], counts [E]). `experts` is where
 * the routed experts' scratch starts: past everything it_decode_workspace_bytes counts (the caller adds
 * it_moe_experts_ws_bytes for its MoE layers' shapes; moe_mlp checks it got them). */
typedef struct { int64_t y2, weights, ids, order, counts, total, experts; } moe_ws;

static moe_ws moe_workspace(const it_model* m, int64_t T, int64_t base) {
    moe_ws l;
    const int64_t k = m->moe_top_k, E = m->moe_experts;
    int64_t off = base;
    l.y2 = off;      off += (T * m->hidden * 2 + 63) & ~(int64_t)63;
    l.weights = off; off += (T * k * 4 + 63) & ~(int64_t)63;
    l.ids = off;     off += (T * k * 8 + 63) & ~(int64_t)63;
    l.order = off;   off += (T * k * 8 + 63) & ~(int64_t)63;
    l.counts = off;  off += (E * 8 + 63) & ~(int64_t)63;
    l.total = off;
    l.experts = -1; /* (set by it_decode_layers: past the whole of it_decode_workspace_bytes) */
    return l;
}

#include "mla.h"

#ifndef GATE_UP_ACT_TAKES /* (a variant whose W4A16 gate_up can write act itself: x86/avx512/decode_ws.c) */
#define GATE_UP_ACT_TAKES(m, L, R) ((void)(m), (void)(L), (void)(R), 0)
#endif
#ifndef PX_TAKES /* (a variant with a tile GEMM on packed activations defines these: x86/avx512/decode_ws.c) */
#define PX_TAKES(L, rows) ((void)(L), (void)(rows), 0)
#define PX_NORM(x, w, out, T, H, eps, nt) ((void)0)
#define RUN_LIN_PX(L, xp, y, ldy, M, nt, dec, epi, ypk) ((void)0)
#define PX_ZERO_TAIL(xp, M, K) ((void)(xp), (void)(M), (void)(K))
#endif

int64_t it_decode_workspace_bytes(const it_model* m, int64_t T, int64_t max_ctx) {
    return mla_workspace(m, T, moe_workspace(m, T, workspace(m, T, max_ctx).total).total).total;
}

/* Gemma's RMSNorm of T rows of H: out = bf16((x / rms(x)) * f), f the fp32 factors 1 + w, one rounding
 * (layers/norm.py GemmaRMSNorm); fp32 sum of squares in 16 lanes. out may be x. */
static void rmsnorm_f32w_rows(const bf16* x, const float* f, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    const int nt = T > 1 && T * H >= (1 << 16) && nthreads > 1 ? (int)(T < nthreads ? T : nthreads) : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16* xr = x + t * H;
        float acc[16] = {0.0f}, ss = 0.0f;
        for (int64_t i = 0; i < H; i++) {
            const float v = bf2f(xr[i]);
            acc[i & 15] += v * v;
        }
        for (int j = 0; j < 16; j++) ss += acc[j];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) out[t * H + i] = f2bf(bf2f(xr[i]) * r * f[i]);
    }
}

/* The final norm of a Gemma step (and the kernel alone, for tests) */
void it_rmsnorm_f32w(const bf16* x, const float* f, bf16* out, int64_t T, int64_t H, float eps, int nthreads) {
    rmsnorm_f32w_rows(x, f, out, T, H, eps, nthreads);
}

/* A layer's RMSNorm of T rows (in place where out is x): Llama's rounding with bf16 weights, Gemma's with fp32 factors
 * (it_model.norm_f32) */
static void norm_rows(const it_model* m, const void* w, const bf16* x, bf16* out, int64_t T, int64_t H, int nthreads) {
    if (m->norm_f32)
        rmsnorm_f32w_rows(x, (const float*)w, out, T, H, m->eps, nthreads);
    else
        rmsnorm_rows(x, (const bf16*)w, out, T, H, m->eps, nthreads);
}

/* The per-head RMSNorm of q and k (before rotary; Qwen3, Gemma 3), in place in qkv [T, (Hq + 2 Hkv) D]: each head as
 * the layers' norms round a row (layers/norm.py) */
static void qk_norm_rows(const it_model* m, const it_layer* L, bf16* qkv, int64_t T) {
    const int64_t D = m->head_dim, hq = m->n_heads, width = (m->n_heads + 2 * m->n_kv_heads) * D;
    /* (a decode step's T (Hq + Hkv) rows of D are a few microseconds on one thread; a prompt's tokens go over the
       threads: one at a time, a 2048-token step's 4096 calls cost ~4 ms a layer in their parallel regions' set-up) */
#ifdef QK_NORM_HEADS /* (a variant's: a token's heads in place, the same rounding and sums as norm_rows with bf16 weights) */
    if (!m->norm_f32 && D % 16 == 0) {
#pragma omp parallel for num_threads(T >= 64 && m->nthreads > 1 ? m->nthreads : 1) schedule(static)
        for (int64_t t = 0; t < T; t++) {
            QK_NORM_HEADS(qkv + t * width, hq, D, (const bf16*)L->q_norm, m->eps);
            QK_NORM_HEADS(qkv + t * width + hq * D, m->n_kv_heads, D, (const bf16*)L->k_norm, m->eps);
        }
        return;
    }
#endif
#pragma omp parallel for num_threads(T >= 64 && m->nthreads > 1 ? m->nthreads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        norm_rows(m, L->q_norm, qkv + t * width, qkv + t * width, hq, D, 1);
        norm_rows(m, L->k_norm, qkv + t * width + hq * D, qkv + t * width + hq * D, m->n_kv_heads, D, 1);
    }
}

/* act [R, inter] = f(gate) * up of h [R, H], f the model's activation (SiLU, or Gemma's GeLU-tanh; gu [R, 2 inter]:
 * scratch) */
static void gate_up_rows(const it_model* m, const it_lin* gate_up, const bf16* h, bf16* act, int64_t R, int64_t inter,
                         bf16* gu, void* lin, bf16* dec) {
    if ((gate_up->kind == IT_KIND_BF16C && gate_up->inter) || GATE_UP_ACT_TAKES(m, gate_up, R)) {
        /* SiLU-and-multiply in the GEMM's epilogue */
        run_lin(gate_up, h, m->hidden, act, inter, R, m->nthreads, lin, dec, 1);
    } else {
        run_lin(gate_up, h, m->hidden, gu, 2 * inter, R, m->nthreads, lin, dec, 0);
        if (m->act == IT_ACT_GELU_TANH)
            gelu_mul_rows(gu, act, R, inter, m->nthreads);
        else
            silu_mul_rows(gu, act, R, inter, m->nthreads);
    }
}

/* An fp32 router's logits [R, E] from h [R, H] bf16, as F.linear(h.float(), w) (DeepSeek's): fp32 products and sums
 * (in the order of mla_dot's lanes, not torch's GEMM's: they differ in the last bits) */
static void router_f32_rows(const bf16* h, const float* w, float* logits, int64_t R, int64_t E, int64_t H,
                            int nthreads) {
    const int nt = pick_threads(E, R * E * H * 4, nthreads);
#pragma omp parallel num_threads(nt)
    {
        /* this thread's experts; each piece of a row widened once for all of them (the sums over pieces in order) */
        const int64_t per = (E + nt - 1) / nt, e0 = omp_get_thread_num() * per, e1 = e0 + per < E ? e0 + per : E;
        float x[1024];
        for (int64_t t = 0; t < R; t++) {
            for (int64_t e = e0; e < e1; e++) logits[t * E + e] = 0.0f;
            for (int64_t i0 = 0; i0 < H; i0 += 1024) { /* (the row widened in pieces: no scratch needed) */
                const int64_t n = H - i0 < 1024 ? H - i0 : 1024;
                mla_widen(h + t * H + i0, x, n);
                for (int64_t e = e0; e < e1; e++) logits[t * E + e] += mla_dot(x, w + e * H + i0, n);
            }
        }
    }
}

/* A mixture-of-experts layer's MLP over h [R, H] (the post-attention norm's rows), into y [R, H], as layers/moe.py
 * MoE computes it through the kernels: the router's logits (the bf16 linear), it_moe_route, it_moe_experts, and the
 * shared expert (scaled by bf16(sigmoid(bf16(h . g))) where gated), added as bf16(routed + shared).
 * resume: the caller's routing of the tied rows (s->route_weights / _ids, after a hand-back) over the rest of the
 * rows' from the call that handed back (in the workspace). Returns 0, 1 where the routing hands back (a tie at the
 * top-k boundary: the tied rows' logits packed in s->router_logits, their indices in s->tied_rows, their count in
 * s->route_rows), -2 where the kernels refuse the layer. x: the residual [R, H], or NULL; where given and the layer
 * is the routed experts alone on one rank (no shared expert, no expert parallel), their combine adds into it as
 * add_rows would (bf16(x + y), one pass fewer over the rows) and *added is set; y is then not written. */
static int moe_mlp(const it_model* m, const it_moe_layer* M, it_step* s, int li, int resume, const bf16* h,
                   bf16* y, int64_t R, char* w, const moe_ws* ml, bf16* gu, bf16* act, void* lin, bf16* dec,
                   double* t0, bf16* x, int* added) {
    const int64_t H = m->hidden, E = M->rule.num_experts, k = M->rule.top_k;
    it_step_stats* stats = s->stats;
    float* weights = (float*)(w + ml->weights);
    int64_t *ids = (int64_t*)(w + ml->ids), *order = (int64_t*)(w + ml->order), *counts = (int64_t*)(w + ml->counts);
    if (!resume) {
        if (M->router_f32) {
            router_f32_rows(h, M->router_f32, (float*)s->router_logits, R, E, H, m->nthreads);
        } else {
            const it_lin router = {.kind = IT_KIND_BF16, .w = M->router, .N = E, .K = H};
            run_lin(&router, h, H, s->router_logits, E, R, m->nthreads, lin, dec, 0);
        }
        uint8_t* tie = (uint8_t*)order; /* (the order's room holds the rows' tie flags until the grouping) */
        const int rc = moe_route_rows(s->router_logits, !M->router_f32, E, R, &M->rule, M->bias, weights, ids, tie,
                                      m->nthreads);
        if (rc < 0 || (rc == 1 && !s->tied_rows)) return -2;
        if (rc == 1) { /* the tied rows' logits to the front, in order (a row moves only to an earlier place) */
            const size_t bytes = (size_t)E * (M->router_f32 ? 4 : 2);
            int64_t n = 0;
            for (int64_t t = 0; t < R; t++)
                if (tie[t]) {
                    if (n != t) memmove((char*)s->router_logits + n * bytes, (char*)s->router_logits + t * bytes, bytes);
                    s->tied_rows[n++] = t;
                }
            s->route_rows = n;
            return 1;
        }
    } else {
        for (int64_t i = 0; i < s->route_rows; i++) { /* the caller's picks for the tied rows */
            const int64_t t = s->tied_rows[i];
            for (int64_t j = 0; j < k; j++) /* (an id out of range would index past the grouping's counts) */
                if (t < 0 || t >= R || s->route_ids[i * k + j] < 0 || s->route_ids[i * k + j] >= E) return -2;
            memcpy(weights + t * k, s->route_weights + i * k, (size_t)k * 4);
            memcpy(ids + t * k, s->route_ids + i * k, (size_t)k * 8);
        }
    }
    moe_group(ids, R, k, E, counts, order);
    if (s->expert_load)
        for (int64_t e = 0; e < E; e++) s->expert_load[li * m->moe_experts + e] += counts[e];
    if (stats) {
        const double t1 = now_s();
        stats->seconds[IT_FT_ROUTER] += t1 - *t0;
        *t0 = t1;
    }
    /* (expert parallel: this rank's experts only; the block's all-reduce adds the others') */
    const int64_t local = M->local_experts > 0 ? M->local_experts : E, off = M->local_experts > 0 ? M->expert_offset : 0;
    /* (the experts' scratch: the workspace past it_decode_workspace_bytes, it_moe_experts_ws_bytes of it) */
    const int into_x = x && !M->shared_down.N && M->local_experts <= 0 && s->tp_size <= 1;
    const int rc = moe_experts_ws(h, H, R, &M->gate_up, &M->down, E, off, local, k, weights, order, counts,
                                  into_x ? x : y, m->nthreads, w + ml->experts, s->work_bytes - ml->experts, into_x);
    if (rc) return rc == -1 ? -1 : -2;
    *added = into_x;
    if (stats) {
        const double t1 = now_s();
        stats->seconds[IT_FT_EXPERTS] += t1 - *t0;
        *t0 = t1;
    }
    if (M->shared_down.N) {
        bf16* y2 = (bf16*)(w + ml->y2);
        gate_up_rows(m, &M->shared_gate_up, h, act, R, M->shared_down.K, gu, lin, dec);
        run_lin(&M->shared_down, act, M->shared_down.K, y2, H, R, m->nthreads, lin, dec, 0);
        if (M->shared_gate)
            for (int64_t t = 0; t < R; t++) { /* sigmoid(F.linear(h, g)) * shared, each rounded to bf16 */
                float dot = 0.0f;
                for (int64_t i = 0; i < H; i++) dot += bf2f(h[t * H + i]) * bf2f(M->shared_gate[i]);
                const float g = bf2f(f2bf(1.0f / (1.0f + expf(-bf2f(f2bf(dot))))));
                for (int64_t i = 0; i < H; i++) y2[t * H + i] = f2bf(bf2f(y2[t * H + i]) * g);
            }
        add_rows(y, y2, R * H);
        if (stats) {
            const double t1 = now_s();
            stats->seconds[IT_FT_GATE_UP] += t1 - *t0;
            *t0 = t1;
        }
    }
    return 0;
}

/* Tensor parallel: y [n] bf16 (this rank's partial sums of a row-parallel linear) <- their sum over the ranks, as
 * layers/shm_allreduce.py ShmAllReduce.all_reduce computes it (and with it, call for call: the same segment and
 * sequence numbers): in pieces of tp_max_numel, each published in this rank's fp32 slot of buffer seq % 2, then,
 * once every rank's counter reaches seq, the slots summed in rank order in fp32 and rounded once. */
static void tp_allreduce(const it_step* s, bf16* y, int64_t n) {
    if (s->tp_size <= 1) return;
    const double start = s->stats ? now_s() : 0.0;
    if (!s->tp_shm) { /* the caller's collective (it_step.tp_reduce_fn), which counts its own calls and bytes */
        ((int (*)(bf16*, int64_t))s->tp_reduce_fn)(y, n);
        if (s->stats) s->stats->seconds[IT_FT_ALLREDUCE] += now_s() - start;
        return;
    }
    const int64_t size = s->tp_size, max = s->tp_max_numel;
    int64_t* counters = (int64_t*)s->tp_shm;
    float* buffers = (float*)((char*)s->tp_shm + 8 * size);
    for (int64_t i0 = 0; i0 < n; i0 += max) {
        const int64_t m = n - i0 < max ? n - i0 : max, seq = ++*s->tp_seq;
        float* slots = buffers + (seq % 2) * size * max;
        float* mine = slots + s->tp_rank * max;
        for (int64_t i = 0; i < m; i++) mine[i] = bf2f(y[i0 + i]);
        __atomic_store_n(&counters[s->tp_rank], seq, __ATOMIC_RELEASE);
        for (int64_t r = 0, spins = 0; r < size; r++)
            while (__atomic_load_n(&counters[r], __ATOMIC_ACQUIRE) < seq)
                if (++spins > 2000) sched_yield(); /* (SPINS_BEFORE_YIELD: more ranks than CPUs) */
        for (int64_t i = 0; i < m; i++) {
            float acc = slots[i];
            for (int64_t r = 1; r < size; r++) acc += slots[r * max + i];
            y[i0 + i] = f2bf(acc);
        }
        if (s->stats) {
            s->stats->allreduce_calls++;
            s->stats->allreduce_bytes += 4 * m;
        }
    }
    if (s->stats) s->stats->seconds[IT_FT_ALLREDUCE] += now_s() - start;
}

/* A row-parallel linear's output into the residual: x += bf16(sum over the ranks of x_in W^T) (one rank: the
 * library's run_lin_add) */
static void run_lin_add_tp(const it_lin* L, const bf16* xin, int64_t ldx, bf16* x, bf16* y, int64_t H, int64_t R,
                           const it_model* m, const it_step* s, void* lin, bf16* dec) {
    if (s->tp_size <= 1) {
        run_lin_add(L, xin, ldx, x, y, H, R, m->nthreads, lin, dec);
        return;
    }
    run_lin(L, xin, ldx, y, H, R, m->nthreads, lin, dec, 0);
    tp_allreduce(s, y, R * H);
    add_rows(x, y, R * H);
}

/* x [T, hidden] bf16 (T decode rows, or the rows of fresh prompts), updated in place through every layer from
 * s->first_layer (resuming at its MLP where s->route_weights is set: see it_step). Returns 0; 1 where a MoE layer's
 * routing is handed back to the caller (it_step); -1 if the workspace is too small, -2 if the shapes are outside what
 * this path handles (head_dim not a multiple of 16, a MoE layer the kernels refuse, ...). */
static int layer_kinds_ok(const it_layer* L) {
    int ok = lin_kind_ok(&L->qkv) && lin_kind_ok(&L->o) && lin_kind_ok(&L->gate_up) && lin_kind_ok(&L->down);
    if (L->mla) ok = ok && lin_kind_ok(&L->mla->q_a) && lin_kind_ok(&L->mla->q_b) && lin_kind_ok(&L->mla->kv_a);
    if (L->moe) ok = ok && lin_kind_ok(&L->moe->shared_gate_up) && lin_kind_ok(&L->moe->shared_down) &&
                     lin_kind_ok(&L->moe->gate_up) && lin_kind_ok(&L->moe->down);
    return ok;
}

int it_decode_layers(const it_model* m, const it_layer* layers, it_step* s, bf16* x) {
    const int64_t T = s->T, H = m->hidden, D = m->head_dim, max_ctx = s->max_blocks * m->block_size;
    if (D % 16 || m->n_heads % m->n_kv_heads || T < 1) return -2;
    const ws_layout l = workspace(m, T, max_ctx);
    moe_ws ml = moe_workspace(m, T, l.total);
    const mla_ws al = mla_workspace(m, T, ml.total);
    if (al.total > s->work_bytes) return -1;
    ml.experts = al.total;
    if (s->first_layer < 0 || s->first_layer >= m->n_layers) return -2;
    if (s->n_groups < 0 || s->n_groups > IT_MAX_KV_GROUPS) return -2;
    if (m->act != IT_ACT_SILU && m->act != IT_ACT_GELU_TANH) return -2;
    if (s->tp_size > 1 && (s->tp_rank < 0 || s->tp_rank >= s->tp_size ||
                           (s->tp_shm ? !s->tp_seq || s->tp_max_numel < 1 : !s->tp_reduce_fn)))
        return -2;
    for (int li = 0; li < m->n_layers; li++) {
        const it_layer* L = layers + li;
        if (L->mla && mla_check(m, L)) return -2;
        if (!layer_kinds_ok(L)) return -2;
        /* each layer's KV cache group one of the step's (0 where it has none) */
        if (L->group < 0 || L->group >= (s->n_groups > 0 ? s->n_groups : 1)) return -2;
        /* a gate_up packed for SiLU in its epilogue (rows interleaved) under another activation; half a sandwich */
        if (m->act != IT_ACT_SILU && L->gate_up.kind == IT_KIND_BF16C && L->gate_up.inter) return -2;
        if (!L->pre_ff_norm != !L->post_ff_norm) return -2;
    }
    char* w = (char*)s->work;
    bf16 *h = (bf16*)(w + l.h), *qkv = (bf16*)(w + l.qkv), *o = (bf16*)(w + l.o), *gu = (bf16*)(w + l.gu);
    bf16 *act = (bf16*)(w + l.act), *y = (bf16*)(w + l.y);
    void* lin = w + l.lin;
    bf16* dec = (bf16*)(w + l.dec);
    float* attn = (float*)(w + l.attn);
    const int64_t hkv = m->n_kv_heads, width = (m->n_heads + 2 * hkv) * D, hq = m->n_heads * D;
    it_step_stats* stats = s->stats;
    double t0 = stats ? now_s() : 0.0;
    double ar0 = stats ? stats->seconds[IT_FT_ALLREDUCE] : 0.0; /* (a part's all-reduces count there, not in it) */
#define PART(i)                                                                  \
    do {                                                                         \
        if (stats) {                                                             \
            const double t1 = now_s(), ar = stats->seconds[IT_FT_ALLREDUCE];     \
            stats->seconds[i] += t1 - t0 - (ar - ar0);                           \
            t0 = t1;                                                             \
            ar0 = ar;                                                            \
        }                                                                        \
    } while (0)
    /* Past the last layer's attention only the rows the caller reads go on: the other rows' K / V are all written
       by then, and nothing else reads their hidden states. They are moved to the front here (rows ascending, so
       in place) and back at the end; x's other rows are left undefined. */
    const int sub = s->n_out > 0 && s->n_out < T;
    for (int li = s->first_layer; li < m->n_layers; li++) {
        const it_layer* L = layers + li;
        /* rows from the last layer's o_proj on */
        const int64_t R = sub && li == m->n_layers - 1 ? s->n_out : T;
        /* resuming at this layer's MoE with the caller's routing: its attention (and the move of the read rows to
           the front) ran in the call that handed back */
        const int resume = li == s->first_layer && s->route_weights != NULL;
        if (resume && (!L->moe || s->route_rows > R || !s->tied_rows)) return -2;
        if (!resume) {
            /* the layer's KV cache group: its slots and block tables (the same max_blocks columns as every group's) */
            it_step ls = *s;
            if (s->n_groups > 0) {
                ls.slots = s->group_slots[L->group];
                ls.block_tables = s->group_tables[L->group];
            }
            /* (a dense attention's 12-bit qkv on AMX past 16 rows: h packed for the tile GEMM, which is all that reads it) */
            const int px_qkv = !L->mla && !m->norm_f32 && PX_TAKES(&L->qkv, T);
            if (px_qkv)
                PX_NORM(x, (const bf16*)L->input_norm, h, T, H, m->eps, m->nthreads);
            else
                norm_rows(m, L->input_norm, x, h, T, H, m->nthreads);
            PART(IT_FT_NORM);
            /* the attention's output, o_proj's input: [T, o_width] */
            bf16* ao = o;
            int64_t o_width = hq;
            if (L->mla) { /* latent attention (mla.h): W_UK counts as qkv, W_UV as o_proj */
                mla_project(m, L->mla, h, T, w, &al, lin, dec);
                PART(IT_FT_QKV);
                mla_rope_write(m, L, &ls, T, w, &al);
                PART(IT_FT_ROTARY_KV);
                mla_absorb_q(m, L->mla, T, w, &al);
                PART(IT_FT_QKV);
                mla_attention(m, &ls, L->kv_cache, T, w, &al);
                PART(IT_FT_ATTN);
                mla_up_v(m, L->mla, T, w, &al);
                ao = (bf16*)(w + al.ov);
                o_width = m->n_heads * m->mla_v;
                PART(IT_FT_O);
            } else {
                if (px_qkv)
                    RUN_LIN_PX(&L->qkv, h, qkv, width, T, m->nthreads, dec, 0, 0);
                else
                    run_lin(&L->qkv, h, H, qkv, width, T, m->nthreads, lin, dec, 0);
                PART(IT_FT_QKV);
                if (L->q_norm) qk_norm_rows(m, L, qkv, T);
                rotary_rows(m, s, qkv, L->cos_sin ? L->cos_sin : m->cos_sin);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t g = 0; g < hkv; g++) {
                        kv_write(m, L->kv_cache, 0, ls.slots[t] * hkv + g, qkv + t * width + hq + g * D);
                        kv_write(m, L->kv_cache, 1, ls.slots[t] * hkv + g, qkv + t * width + hq + (hkv + g) * D);
                    }
                PART(IT_FT_ROTARY_KV);
                attention_rows(m, &ls, qkv, L->kv_cache, o, attn, max_ctx, 1, L->window);
            }
            if (R < T)
                for (int64_t i = 0; i < R; i++)
                    if (s->out_rows[i] != i) {
                        memcpy(ao + i * o_width, ao + s->out_rows[i] * o_width, (size_t)o_width * 2);
                        memcpy(x + i * H, x + s->out_rows[i] * H, (size_t)H * 2);
                    }
            PART(IT_FT_ATTN);
            if (L->pre_ff_norm) { /* Gemma: o_proj's output normed (post_norm) before its residual add */
                run_lin(&L->o, ao, o_width, y, H, R, m->nthreads, lin, dec, 0);
                tp_allreduce(s, y, R * H);
                PART(IT_FT_O);
                norm_rows(m, L->post_norm, y, y, R, H, m->nthreads);
                PART(IT_FT_NORM);
                add_rows(x, y, R * H);
                PART(IT_FT_RESIDUAL);
            } else {
                run_lin_add_tp(&L->o, ao, o_width, x, y, H, R, m, s, lin, dec); /* (the residual add with it) */
                PART(IT_FT_O);
            }
        }
        /* (a dense SiLU MLP of 12-bit linears on AMX past 16 rows, one rank: h and act packed for the tile GEMM, the
           residual added in down's epilogue) */
        const int px_mlp = !L->moe && !L->pre_ff_norm && !L->post_ff_norm && !m->norm_f32 && m->act == IT_ACT_SILU &&
                           s->tp_size <= 1 && L->gate_up.inter && PX_TAKES(&L->gate_up, R) && PX_TAKES(&L->down, R);
        if (px_mlp)
            PX_NORM(x, (const bf16*)L->post_norm, h, R, H, m->eps, m->nthreads);
        else
            norm_rows(m, L->pre_ff_norm ? L->pre_ff_norm : L->post_norm, x, h, R, H, m->nthreads);
        PART(IT_FT_NORM);
        int added = 0; /* (the MoE layer's output already in x) */
        if (L->moe) {
            /* (its output straight into x where nothing comes between: no post-feedforward norm) */
            const int rc = moe_mlp(m, L->moe, s, li, resume, h, y, R, w, &ml, gu, act, lin, dec, &t0,
                                   L->post_ff_norm ? NULL : x, &added);
            if (rc == 1) { /* the caller routes this layer's tied rows (it_step) and calls again from here */
                s->handed_back = li;
                return 1;
            }
            if (rc) return rc;
            /* tensor parallel: each rank's experts (and shared expert) hold a share of their features, so y is this
               rank's part of the block's output, summed over the ranks as layers/moe.py's MoE block is, once */
            if (!added) tp_allreduce(s, y, R * H);
        } else if (px_mlp) {
            const int64_t inter = L->down.K;
            PX_ZERO_TAIL(act, R, inter); /* (act's rows past R: zeros, as the normed rows') */
            RUN_LIN_PX(&L->gate_up, h, act, inter, R, m->nthreads, dec, 1, inter);
            PART(IT_FT_GATE_UP);
            RUN_LIN_PX(&L->down, act, x, H, R, m->nthreads, dec, 1, 0);
            PART(IT_FT_DOWN);
        } else {
            gate_up_rows(m, &L->gate_up, h, act, R, L->down.K, gu, lin, dec);
            PART(IT_FT_GATE_UP);
            if (!L->post_ff_norm) {
                run_lin_add_tp(&L->down, act, L->down.K, x, y, H, R, m, s, lin, dec);
                PART(IT_FT_DOWN);
            } else {
                run_lin(&L->down, act, L->down.K, y, H, R, m->nthreads, lin, dec, 0);
                tp_allreduce(s, y, R * H);
                PART(IT_FT_DOWN);
            }
        }
        if ((L->moe && !added) || L->post_ff_norm) { /* the MLP's output y (Gemma: normed first) into the residual */
            if (L->post_ff_norm) {
                norm_rows(m, L->post_ff_norm, y, y, R, H, m->nthreads);
                PART(IT_FT_NORM);
            }
            add_rows(x, y, R * H);
            PART(IT_FT_RESIDUAL);
        }
        if (R < T)
            for (int64_t i = R - 1; i >= 0; i--)
                if (s->out_rows[i] != i) memcpy(x + s->out_rows[i] * H, x + i * H, (size_t)H * 2);
        PART(IT_FT_RESIDUAL);
    }
#undef PART
    if (stats) {
        stats->calls++;
        stats->rows += T;
    }
    return 0;
}
#endif
