/* Runs one entry point of the NEON kernels (csrc/arm/neon) on buffers read from files, for tests/test_neon.py,
 * which builds this for AArch64 and runs it under qemu-user:
 *   neon_harness OP SCALARS... BUFFER_FILES...
 * Each buffer file is read whole ("-" is NULL); after the call the last file (the output, which may also be an
 * input: it is read first) is written back. Scalars are integers, eps a decimal float. */
#include "arm/neon/neon.c"
#include <stdio.h>

static void* slurp(const char* path, long* size) {
    if (path[0] == '-' && path[1] == 0) return NULL;
    FILE* f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fseek(f, 0, SEEK_SET);
    void* p = malloc((size_t)*size + 64);
    if (fread(p, 1, (size_t)*size, f) != (size_t)*size) { perror(path); exit(2); }
    fclose(f);
    return p;
}

static void spit(const char* path, const void* p, long size) {
    FILE* f = fopen(path, "wb");
    if (!f || fwrite(p, 1, (size_t)size, f) != (size_t)size) { perror(path); exit(2); }
    fclose(f);
}

#define I(k) atoll(argv[2 + (k)])
#define NEED(n) if (argc != 2 + (n)) { fprintf(stderr, "%s: %d arguments expected\n", op, (n)); return 2; }

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const char* op = argv[1];
    if (!strcmp(op, "it_abi")) { /* OUT: the ABI version, the count of struct sizes / offsets, then those */
        if (argc != 3) return 2;
        const int64_t n = it_struct_sizes(NULL, 0);
        int64_t* v = malloc((size_t)(n + 2) * 8);
        v[0] = it_abi(), v[1] = n;
        it_struct_sizes(v + 2, n);
        spit(argv[2], v, (long)(n + 2) * 8);
        return 0;
    }
    if (!strcmp(op, "it_decode_workspace_bytes") || !strcmp(op, "it_decode_layers")) {
        /* BLOB: a header of 8 int64 (offsets of the it_model, the it_layer array, the it_step and x; n_layers; T and
         * max_ctx for the workspace's size; the return code, written here), then the structs and every buffer they
         * point at, each pointer stored as its offset in the blob (0: NULL). The blob is written back whole. */
        if (argc != 3) return 2;
        long size = 0;
        char* blob = slurp(argv[2], &size);
        int64_t* hdr = (int64_t*)blob;
        it_model* m = (it_model*)(blob + hdr[0]);
        if (!strcmp(op, "it_decode_workspace_bytes")) {
            hdr[7] = it_decode_workspace_bytes(m, hdr[5], hdr[6]);
        } else {
#define RELOC(p) ((p) = (p) ? (void*)(blob + (intptr_t)(p)) : NULL)
            it_layer* layers = (it_layer*)(blob + hdr[1]);
            it_step* st = (it_step*)(blob + hdr[2]);
            RELOC(*(void**)&m->cos_sin);
            for (int64_t i = 0; i < hdr[4]; i++) {
                it_layer* L = layers + i;
                RELOC(*(void**)&L->input_norm), RELOC(*(void**)&L->post_norm), RELOC(L->kv_cache);
                RELOC(*(void**)&L->q_norm), RELOC(*(void**)&L->k_norm), RELOC(*(void**)&L->pre_ff_norm);
                RELOC(*(void**)&L->post_ff_norm), RELOC(*(void**)&L->cos_sin), RELOC(*(void**)&L->mla);
                it_mla_layer* A = (it_mla_layer*)L->mla; /* latent attention: its own linears and tensors */
                if (A) RELOC(*(void**)&A->q_a_norm), RELOC(*(void**)&A->kv_a_norm), RELOC(*(void**)&A->kv_up);
                RELOC(*(void**)&L->moe);
                it_moe_layer* M = (it_moe_layer*)L->moe; /* a MoE layer: its router and experts */
                if (M)
                    RELOC(*(void**)&M->router), RELOC(*(void**)&M->router_f32), RELOC(*(void**)&M->bias),
                        RELOC(*(void**)&M->shared_gate);
                it_lin* lins[11] = {&L->qkv, &L->o, &L->gate_up, &L->down, A ? &A->q_a : NULL, A ? &A->q_b : NULL,
                                    A ? &A->kv_a : NULL, M ? &M->gate_up : NULL, M ? &M->down : NULL,
                                    M ? &M->shared_gate_up : NULL, M ? &M->shared_down : NULL};
                for (int j = 0; j < 11; j++)
                    if (lins[j])
                        RELOC(*(void**)&lins[j]->w), RELOC(*(void**)&lins[j]->scale), RELOC(*(void**)&lins[j]->bias),
                            RELOC(*(void**)&lins[j]->zero);
            }
            RELOC(*(void**)&st->positions), RELOC(*(void**)&st->slots), RELOC(*(void**)&st->block_tables);
            RELOC(*(void**)&st->context_lens), RELOC(*(void**)&st->out_rows), RELOC(*(void**)&st->stats);
            RELOC(*(void**)&st->router_logits), RELOC(*(void**)&st->route_weights), RELOC(*(void**)&st->route_ids);
            RELOC(*(void**)&st->tied_rows), RELOC(*(void**)&st->expert_load), RELOC(st->work);
            for (int64_t g = 0; g < st->n_groups && g < IT_MAX_KV_GROUPS; g++)
                RELOC(*(void**)&st->group_slots[g]), RELOC(*(void**)&st->group_tables[g]);
#undef RELOC
            if (!st->work) /* (a MoE model's is shipped: a hand-back's routing waits in it for the resuming call) */
                st->work = aligned_alloc(64, (size_t)((st->work_bytes + 63) & ~(int64_t)63));
            hdr[7] = it_decode_layers(m, layers, st, (bf16*)(blob + hdr[3]));
        }
        spit(argv[2], blob, size);
        return 0;
    }
    if (!strcmp(op, "it_gemm_rows_fma")) { /* OUT: the library's default row count for the GEMM (int64) */
        if (argc != 3) return 2;
        const int64_t rows = it_gemm_rows_fma(0);
        spit(argv[2], &rows, 8);
        return 0;
    }
    if (!strcmp(op, "it_moe_experts_ws_bytes")) { /* T k E H I nthreads OUT: the MoE experts' workspace (int64) */
        if (argc != 9) return 2;
        const int64_t bytes = it_moe_experts_ws_bytes(atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoll(argv[5]),
                                                      atoll(argv[6]), atoi(argv[7]));
        spit(argv[8], &bytes, 8);
        return 0;
    }
    if (!strcmp(op, "it_moe_max_experts")) { /* OUT: IT_MOE_MAX_EXPERTS (int64) */
        if (argc != 3) return 2;
        const int64_t most = it_moe_max_experts();
        spit(argv[2], &most, 8);
        return 0;
    }
    if (!strcmp(op, "it_w8a8_block")) { /* OUT: the features a block of the packed W8A8 weight holds (int64) */
        if (argc != 3) return 2;
        const int64_t block = it_w8a8_block();
        spit(argv[2], &block, 8);
        return 0;
    }
    void* b[6] = {0};
    long sz[6] = {0};
    int first = 0, nbuf = 0;
    if (!strcmp(op, "it_linear_bf16") || !strcmp(op, "it_linear_bf16_gemv") || !strcmp(op, "it_linear_bf16_gemm_fma")) {
        NEED(9) first = 5, nbuf = 4;                                             /* ldx ldy M N K | x w bias y */
    }
    else if (!strcmp(op, "it_linear_w8")) { NEED(11) first = 6, nbuf = 5; }   /* sf32 ldx ldy M N K | x w s bias y */
    else if (!strcmp(op, "it_linear_w4")) { NEED(12) first = 6, nbuf = 6; }   /* gs ldx ldy M N K | x w s z bias y */
    else if (!strcmp(op, "it_dequant_w8")) { NEED(6) first = 3, nbuf = 3; }   /* sf32 N K | q s out */
    else if (!strcmp(op, "it_dequant_w4")) { NEED(7) first = 3, nbuf = 4; }   /* gs N K | packed s z out */
    else if (!strcmp(op, "it_rmsnorm_mt")) { NEED(6) first = 3, nbuf = 3; }   /* T H eps | x w out */
    else if (!strcmp(op, "it_rmsnorm_f32w")) { NEED(6) first = 3, nbuf = 3; } /* T H eps | x f out */
    else if (!strcmp(op, "it_silu_mul") || !strcmp(op, "it_gelu_mul")) { NEED(4) first = 2, nbuf = 2; } /* T I | gu act */
    else if (!strcmp(op, "it_rotary")) { NEED(7) first = 5, nbuf = 2; }       /* ld T heads D ld_cs | cs qk */
    else if (!strcmp(op, "it_linear_w8a8")) { NEED(11) first = 5, nbuf = 6; } /* ldx ldy M N K | x w s static bias y */
    else if (!strcmp(op, "it_pack_w8a8")) { NEED(4) first = 2, nbuf = 2; }    /* N K | q out */
    else if (!strcmp(op, "it_unpack_w8a8")) { NEED(4) first = 2, nbuf = 2; }  /* N K | packed q */
    else if (!strcmp(op, "it_argmax_rows")) { NEED(5) first = 3, nbuf = 2; }  /* rows n ld | logits out */
    else if (!strcmp(op, "it_argmax_rows_bf16")) { NEED(5) first = 3, nbuf = 2; }  /* rows n ld | logits out */
    else { fprintf(stderr, "unknown op %s\n", op); return 2; }
    for (int i = 0; i < nbuf; i++) b[i] = slurp(argv[2 + first + i], &sz[i]);
    const int nt = 2;
    if (!strcmp(op, "it_linear_bf16"))
        it_linear_bf16(b[0], I(0), b[1], b[2], b[3], I(1), I(2), I(3), I(4), nt);
    else if (!strcmp(op, "it_linear_bf16_gemv"))
        it_linear_bf16_gemv(b[0], I(0), b[1], b[2], b[3], I(1), I(2), I(3), I(4), nt);
    else if (!strcmp(op, "it_linear_bf16_gemm_fma"))
        it_linear_bf16_gemm_fma(b[0], I(0), b[1], b[2], b[3], I(1), I(2), I(3), I(4), nt);
    else if (!strcmp(op, "it_linear_w8"))
        it_linear_w8(b[0], I(1), b[1], b[2], (int)I(0), b[3], b[4], I(2), I(3), I(4), I(5), nt);
    else if (!strcmp(op, "it_linear_w4"))
        it_linear_w4(b[0], I(1), b[1], b[2], b[3], I(0), b[4], b[5], I(2), I(3), I(4), I(5), nt);
    else if (!strcmp(op, "it_dequant_w8"))
        it_dequant_w8(b[0], b[1], (int)I(0), b[2], I(1), I(2), nt);
    else if (!strcmp(op, "it_dequant_w4"))
        it_dequant_w4(b[0], b[1], b[2], I(0), b[3], I(1), I(2), nt);
    else if (!strcmp(op, "it_rmsnorm_mt"))
        it_rmsnorm_mt(b[0], b[1], b[2], I(0), I(1), (float)atof(argv[4]), nt);
    else if (!strcmp(op, "it_rmsnorm_f32w"))
        it_rmsnorm_f32w(b[0], b[1], b[2], I(0), I(1), (float)atof(argv[4]), nt);
    else if (!strcmp(op, "it_silu_mul"))
        it_silu_mul(b[0], b[1], I(0), I(1), nt);
    else if (!strcmp(op, "it_gelu_mul"))
        it_gelu_mul(b[0], b[1], I(0), I(1), nt);
    else if (!strcmp(op, "it_linear_w8a8")) /* (the return code on stdout) */
        printf("%d\n", it_linear_w8a8(b[0], I(0), b[1], b[2], b[3], b[4], b[5], I(1), I(2), I(3), I(4), nt));
    else if (!strcmp(op, "it_pack_w8a8"))
        printf("%d\n", it_pack_w8a8(b[0], I(0), I(1), b[1], nt));
    else if (!strcmp(op, "it_unpack_w8a8"))
        it_unpack_w8a8(b[0], I(0), I(1), b[1]);
    else if (!strcmp(op, "it_argmax_rows"))
        it_argmax_rows(b[0], I(0), I(1), I(2), b[1], nt);
    else if (!strcmp(op, "it_argmax_rows_bf16"))
        it_argmax_rows_bf16(b[0], I(0), I(1), I(2), b[1], nt);
    else
        it_rotary(b[1], I(0), I(1), I(2), I(3), b[0], I(4), nt);
    spit(argv[2 + first + nbuf - 1], b[nbuf - 1], sz[nbuf - 1]);
    return 0;
}
