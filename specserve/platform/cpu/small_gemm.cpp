// A few rows times a bf16 weight on CPUs with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32 sums.
//
// W is packed by specserve/platform/cpu/small_gemm.py as [N / 64][K / 2][64][2]: for each group of 64 output
// columns, K / 2 steps of 64 column pairs (w[n, 2j], w[n, 2j + 1]), i.e. 256 contiguous bytes a step. One
// vdpbf16ps multiplies 16 such pairs by a broadcast pair of x and adds both products to 16 fp32 sums, so a step
// takes 4 loads and 4 vdpbf16ps per row. Rows are handled 4 at a time (16 accumulators), so the weights stream from
// memory once for up to 4 rows; more rows re-read a group (K x 128 bytes) from the core's L2. Threads split the
// column groups (OpenMP: the runtime PyTorch itself uses, linked by the loader).
#include <immintrin.h>
#include <stdint.h>

static const int64_t COLS = 64;  // output columns per packed group: 4 vectors of 16 fp32 sums
// Bytes ahead of the step being read that each step asks the core to fetch (its 4 cache lines, 16 steps ahead; 0 =
// none, for benchmarks/bench_prefetch.py): with the hardware prefetchers alone a SmolLM2-sized pass was slower on a
// 2-core Xeon whose memory was shared with a neighbour (docs/benchmarks.md). A prefetch past the weights' end does
// not fault.
#ifndef SPECSERVE_PREFETCH_BYTES
#define SPECSERVE_PREFETCH_BYTES 4096
#endif
static const int64_t PREFETCH_BYTES = SPECSERVE_PREFETCH_BYTES;

template <int R>
static inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* wg, int64_t k2, const float* bias,
                        uint16_t* y, int64_t ldy) {
    __m512 acc[R][4];
    for (int c = 0; c < 4; c++) {
        __m512 b = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) acc[r][c] = b;
    }
    const int32_t* xr[R];
    for (int r = 0; r < R; r++) xr[r] = (const int32_t*)(x + r * ldx);  // x's pairs as 32-bit words
    for (int64_t j = 0; j < k2; j++) {
        const __m512i* w = (const __m512i*)(wg + j * 2 * COLS);
        if (PREFETCH_BYTES > 0)
            for (int line = 0; line < 4; line++) _mm_prefetch((const char*)(w + line) + PREFETCH_BYTES, _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 1);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2), w3 = (__m512bh)_mm512_loadu_si512(w + 3);
        for (int r = 0; r < R; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][j]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

static void group_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* wg, int64_t k2, const float* bias,
                       uint16_t* y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const uint16_t* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: tile<1>(xs, ldx, wg, k2, bias, ys, ldy); break;
            case 2: tile<2>(xs, ldx, wg, k2, bias, ys, ldy); break;
            case 3: tile<3>(xs, ldx, wg, k2, bias, ys, ldy); break;
            default: tile<4>(xs, ldx, wg, k2, bias, ys, ldy); break;
        }
    }
}

// x: m rows of k bf16 (row stride ldx); w: packed, n a multiple of 64, k even; bias: n floats or null;
// y: m rows of n bf16 (row stride ldy).
extern "C" void small_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                                const float* bias, uint16_t* y, int64_t ldy, int threads) {
    const int64_t groups = n / COLS, k2 = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        group_rows(x, ldx, m, w + g * k * COLS, k2, bias ? bias + g * COLS : nullptr, y + g * COLS, ldy);
}
