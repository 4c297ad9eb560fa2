// The tile unit (AMX) for specserve's kernels on CPUs with AVX512-BF16: whether it runs here, the tile configuration,
// and the zero-padded copy of a call's last rows.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

// The tile unit runs here: the CPU has it (CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24), and Linux grants
// the process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18; without it
// the first tile instruction faults). Decided once per library.
static inline bool amx_ready() {
    static const bool ready = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;
        return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }();
    return ready;
}

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Each thread's tile configuration for a call of up to 16 rows (tile_rows): tiles 0 .. row_tiles - 1 hold that many
// rows (sums and x), the next weight_tiles 16 (weights); every tile row 64 bytes.
__attribute__((target("amx-tile")))
static inline void load_tile_config(int64_t tile_rows, int row_tiles, int weight_tiles) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < row_tiles; t++) cfg.rows[t] = (uint8_t)tile_rows, cfg.colsb[t] = 64;
    for (int t = row_tiles; t < row_tiles + weight_tiles; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

// Past 16 rows, the m % 16 last rows of x (m rows of k bf16, row stride ldx) copied into 16 zero-padded ones, so that
// every block of rows keeps the 16-row tile configuration (a tile row's sums depend on that row alone: the padding
// changes no other row's bits). -> false where that copy cannot be allocated; *pad null where none is needed; the
// caller frees it.
static inline bool padded_tail(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, uint16_t** pad) {
    const int64_t tail = m > 16 ? m % 16 : 0;
    *pad = nullptr;
    if (tail == 0) return true;
    *pad = (uint16_t*)calloc(16 * k, sizeof(uint16_t));
    if (*pad == nullptr) return false;
    for (int64_t r = 0; r < tail; r++) memcpy(*pad + r * k, x + (m - tail + r) * ldx, k * sizeof(uint16_t));
    return true;
}
