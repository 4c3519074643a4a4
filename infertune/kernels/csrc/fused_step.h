/* The fused decoder step, it_decode_layers, over a library's parts (portable C: the AVX-512 library includes it after
 * its decode_ws.c / attention.c / elementwise.c, the AVX2 one after x86/avx2/fused.c, the NEON one after
 * arm/neon/fused.c). What a library provides:
 * ws_layout / workspace(m, T, max_ctx) (offsets h, qkv, o, gu, act, y, lin, dec, attn, total), rmsnorm_rows,
 * silu_mul_rows, rotary_rows, run_lin / run_lin_add (a linear, and one added into the residual), attention_rows, and
 * kv_write (kv_cache.h). */
#ifndef IT_FUSED_STEP_H
#define IT_FUSED_STEP_H
#include <time.h>

/* The step's split by part for `infertune profile` (it_step.stats, abi.h it_step_stats: the caller's, one per
 * engine), at one clock read a part and layer; none where stats is NULL. */
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* x [T, hidden] bf16 (T decode rows, or the rows of fresh prompts), updated in place through every layer.
 * Returns 0, or -1 if the workspace is too small, -2 if the shapes are outside what this path handles (head_dim
 * not a multiple of 16, ...). */
int it_decode_layers(const it_model* m, const it_layer* layers, const it_step* s, bf16* x) {
    const int64_t T = s->T, H = m->hidden, D = m->head_dim, max_ctx = s->max_blocks * m->block_size;
    if (D % 16 || m->n_heads % m->n_kv_heads || T < 1) return -2;
    const ws_layout l = workspace(m, T, max_ctx);
    if (l.total > s->work_bytes) return -1;
    char* w = (char*)s->work;
    bf16 *h = (bf16*)(w + l.h), *qkv = (bf16*)(w + l.qkv), *o = (bf16*)(w + l.o), *gu = (bf16*)(w + l.gu);
    bf16 *act = (bf16*)(w + l.act), *y = (bf16*)(w + l.y);
    void* lin = w + l.lin;
    bf16* dec = (bf16*)(w + l.dec);
    float* attn = (float*)(w + l.attn);
    const int64_t hkv = m->n_kv_heads, width = (m->n_heads + 2 * hkv) * D, hq = m->n_heads * D;
    it_step_stats* stats = s->stats;
    double t0 = stats ? now_s() : 0.0;
#define PART(i)                                  \
    do {                                         \
        if (stats) {                             \
            const double t1 = now_s();           \
            stats->seconds[i] += t1 - t0;        \
            t0 = t1;                             \
        }                                        \
    } while (0)
    /* Past the last layer's attention only the rows the caller reads go on: the other rows' K / V are all written
       by then, and nothing else reads their hidden states. They are moved to the front here (rows ascending, so
       in place) and back at the end; x's other rows are left undefined. */
    const int sub = s->n_out > 0 && s->n_out < T;
    for (int li = 0; li < m->n_layers; li++) {
        const it_layer* L = layers + li;
        rmsnorm_rows(x, L->input_norm, h, T, H, m->eps, m->nthreads);
        PART(IT_FT_NORM);
        run_lin(&L->qkv, h, H, qkv, width, T, m->nthreads, lin, dec, 0);
        PART(IT_FT_QKV);
        rotary_rows(m, s, qkv);
        for (int64_t t = 0; t < T; t++)
            for (int64_t g = 0; g < hkv; g++) {
                kv_write(m, L->kv_cache, 0, s->slots[t] * hkv + g, qkv + t * width + hq + g * D);
                kv_write(m, L->kv_cache, 1, s->slots[t] * hkv + g, qkv + t * width + hq + (hkv + g) * D);
            }
        PART(IT_FT_ROTARY_KV);
        attention_rows(m, s, qkv, L->kv_cache, o, attn, max_ctx, 1);
        int64_t R = T; /* rows from here on */
        if (sub && li == m->n_layers - 1) {
            for (int64_t i = 0; i < s->n_out; i++)
                if (s->out_rows[i] != i) {
                    memcpy(o + i * hq, o + s->out_rows[i] * hq, (size_t)hq * 2);
                    memcpy(x + i * H, x + s->out_rows[i] * H, (size_t)H * 2);
                }
            R = s->n_out;
        }
        PART(IT_FT_ATTN);
        run_lin_add(&L->o, o, hq, x, y, H, R, m->nthreads, lin, dec); /* (the residual add with it) */
        PART(IT_FT_O);
        rmsnorm_rows(x, L->post_norm, h, R, H, m->eps, m->nthreads);
        PART(IT_FT_NORM);
        if (L->gate_up.kind == IT_KIND_BF16C && L->gate_up.inter) { /* SiLU-and-multiply in the GEMM's epilogue */
            run_lin(&L->gate_up, h, H, act, m->inter, R, m->nthreads, lin, dec, 1);
        } else {
            run_lin(&L->gate_up, h, H, gu, 2 * m->inter, R, m->nthreads, lin, dec, 0);
            silu_mul_rows(gu, act, R, m->inter, m->nthreads);
        }
        PART(IT_FT_GATE_UP);
        run_lin_add(&L->down, act, m->inter, x, y, H, R, m->nthreads, lin, dec);
        PART(IT_FT_DOWN);
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
