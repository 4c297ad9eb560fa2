// The tile unit (AMX) for specserve's kernels on CPUs with AVX512-BF16: whether it runs here, and ldtilecfg's operand.
#pragma once

#include <stdint.h>
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
