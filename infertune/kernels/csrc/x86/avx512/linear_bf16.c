/* ------------------------------------------------------------------ bf16 linear: AVX-512 or AMX by shape */

static inline int64_t bf16_scratch_bytes(int64_t M, int64_t K) {
    /* the GEMM's blocks hold at least 32 rows, more than amx_rows_per_block allows for K past 12288 */
    const int64_t amx = amx_rows_per_block(K), gemm = gemm_rows_per_block(K);
    const int64_t mb = M >= AMX_GEMM_MIN_ROWS && gemm > amx ? gemm : amx;
    const int64_t rows = M < mb ? (M + 15) & ~(int64_t)15 : mb;
    return (rows * K * 2 + 63) & ~(int64_t)63;
}

static void linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                        int64_t M, int64_t N, int64_t K, int nthreads, void* scratch) {
    const int64_t n16 = N & ~(int64_t)15;
    if (amx_state == 1 && K % 32 == 0 && n16 > 0 && M >= AMX_MIN_ROWS) {
        if (M >= AMX_GEMM_MIN_ROWS)
            linear_bf16_amx_gemm(x, ldx, w, bias, y, ldy, M, n16, K, nthreads, (bf16*)scratch);
        else
            linear_bf16_amx(x, ldx, w, bias, y, ldy, M, n16, K, nthreads, (bf16*)scratch);
        if (n16 < N)
            linear_bf16_avx512(x, ldx, w + n16 * K, bias ? bias + n16 : NULL, y + n16, ldy, M, N - n16, K, nthreads);
        return;
    }
    if (amx_state != 1 && gemm_noamx_takes(M, K)) { /* (AMX machines never come here) */
        linear_bf16_dpbf16_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
        return;
    }
    linear_bf16_avx512(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

/* Sets (rows > 0) and returns gemm_rows_noamx (gemm_dpbf16.c) */
int64_t it_gemm_rows_noamx(int64_t rows) {
    if (rows > 0) gemm_rows_noamx = rows;
    return gemm_rows_noamx;
}

/* The two non-AMX paths on their own, whatever the rows (benchmarks and tests): the GEMV, and the GEMM (K even) */
void it_linear_bf16_gemv(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
    linear_bf16_avx512(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
}

int it_linear_bf16_gemm_noamx(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                              int64_t M, int64_t N, int64_t K, int nthreads) {
    if (K % 2) return -1;
    linear_bf16_dpbf16_gemm(x, ldx, w, bias, y, ldy, M, N, K, nthreads);
    return 0;
}

void it_linear_bf16(const bf16* x, int64_t ldx, const bf16* w, const bf16* bias, bf16* y, int64_t ldy,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    void* scratch = aligned_alloc(64, (size_t)bf16_scratch_bytes(M, K));
    linear_bf16(x, ldx, w, bias, y, ldy, M, N, K, nthreads, scratch);
    free(scratch);
}


/* Sets (rows >= 0) and returns the rows up to which 12-bit weights without AMX take the register path
 * (bf16c_noamx.c bf16c_reg_max, at most BF16C_REG_ROWS; 0: the slab GEMM at every row count) */
int64_t it_bf16c_reg_rows(int64_t rows) {
    if (rows >= 0) bf16c_reg_max = (int)(rows < BF16C_REG_ROWS ? rows : BF16C_REG_ROWS);
    return bf16c_reg_max;
}
