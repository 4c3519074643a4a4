/* ------------------------------------------------------------------ bf16 on AMX tiles
 *
 * C^T = W x^T, 16 output features x 16 activation rows per tile: the A operand is 16 rows of W read in place
 * (row stride 2K bytes, so no repacking of the weights), the B operand is x transposed into VNNI pairs
 * (built once per call). Four accumulator tiles cover 64 output features per pass over K.
 */
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1; /* -1 unknown, 0 unusable, 1 usable */
#define AMX_MIN_ROWS 2 /* at one row the AVX-512 path streams as fast */
#define AMX_GEMM_MIN_ROWS 17 /* from here the 2 x 2 blocked GEMM (two row tiles) */


typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Asks Linux for the AMX tile state (once per process; torch's oneDNN asks too). 1 where AMX can run. */
int it_amx_init(int has_amx_flags) {
    if (amx_state < 0)
        amx_state = has_amx_flags && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

void it_amx_disable(void) { amx_state = 0; }

/* This thread's tiles: n tiles of 16 rows x 64 bytes (16 fp32 accumulators, or 16 x 32 bf16 operands), the first
 * n_short of them (and tile 7, where n_short > 0) with `short_rows` rows instead. The barrier keeps the compiler
 * from dropping the stores into cfg (GCC saw them as dead before LDTILECFG, and the CPU then refused the stale
 * bytes of the unused tiles). */
__attribute__((target("amx-tile")))
static void amx_tiles(int n, int n_short, int short_rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < n; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    for (int t = 0; t < n_short; t++) cfg.rows[t] = (uint8_t)short_rows;
    if (n_short > 0) cfg.rows[7] = (uint8_t)short_rows;
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static inline void amx_configure(int n) { amx_tiles(n, 0, 16); }

