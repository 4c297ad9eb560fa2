// Any number of rows times a bf16 weight on CPUs with AVX2 and FMA but no AVX512 (e.g. an AMD EPYC of the Zen 3
// generation), where oneDNN packs no bf16 weight and PyTorch's bf16 matmul reads the weight once per row:
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32 sums, rounded to bf16.
//
// W is in small_gemm.cpp's layout, [N / 64][K / 2][64][2]: for each group of 64 output columns, K / 2 steps of 64
// column pairs (w[n, 2j], w[n, 2j + 1]). A 256-bit load holds 8 such pairs; shifting each 32-bit lane left by 16
// gives the 8 columns' weights at k = 2j as floats, masking off the low half gives those at 2j + 1. Each output's sum
// starts from the bias and adds w[n, k] * x[m, k] for k = 0, 1, 2, ... with one FMA each, in that order, whatever
// the call's row count and whichever tile computes it: a row's result has the same bits in a one-row decode, a
// verify tree or a prefill.
//
// One row streams each group's weights once, 64 columns at a time (8 accumulators). More rows go 4 at a time over
// 16 columns (8 accumulators, the 4 weight vectors of a step shared by the 4 rows), the group's weights then re-read
// from the core's caches; rows come in blocks of ROW_BLOCK so that a block's inputs (converted to float32 once per
// call) stay in the core's L2 while the column blocks pass over them. Threads split the column blocks (OpenMP: the
// runtime PyTorch itself uses, linked by the loader).
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

static const int64_t COLS = 64;       // output columns per packed group
static const int64_t ROW_BLOCK = 64;  // rows whose float32 inputs stay in L2 while the column blocks pass over them

static inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }  // k = 2j
static inline __m256 high_half(__m256i v) {                                                        // k = 2j + 1
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// 8 floats -> 8 bf16 bits (round to nearest even, as PyTorch's float -> bf16 cast; NaN -> 0x7FC0) in 32-bit lanes
static inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// 16 floats (a, b: columns 0-7, 8-15) -> 16 bf16 at y
static inline void store16(uint16_t* y, __m256 a, __m256 b) {
    // packus interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute puts them back in order
    const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
    _mm256_storeu_si256((__m256i*)y, _mm256_permute4x64_epi64(packed, 0xD8));
}

// One row (x: k2 pairs as floats) times one group's 64 columns.
static void row_group(const float* x, const uint16_t* wg, int64_t k2, const float* bias, uint16_t* y) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = bias ? _mm256_loadu_ps(bias + 8 * c) : _mm256_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        const __m256i* w = (const __m256i*)(wg + j * 2 * COLS);
        const __m256 xe = _mm256_broadcast_ss(x + 2 * j), xo = _mm256_broadcast_ss(x + 2 * j + 1);
        for (int c = 0; c < 8; c++) {
            const __m256i v = _mm256_loadu_si256(w + c);
            acc[c] = _mm256_fmadd_ps(low_half(v), xe, acc[c]);
            acc[c] = _mm256_fmadd_ps(high_half(v), xo, acc[c]);
        }
    }
    for (int c = 0; c < 8; c += 2) store16(y + 8 * c, acc[c], acc[c + 1]);
}

// R rows (x: row stride ldx floats) times 16 columns: the block at column offset 16 * b of a group (wb = its first
// pair; steps 2 * COLS bf16 apart).
template <int R>
static void rows_block(const float* x, int64_t ldx, const uint16_t* wb, int64_t k2, const float* bias, uint16_t* y,
                       int64_t ldy) {
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) {
        acc[r][0] = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        acc[r][1] = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < k2; j++) {
        const __m256i* w = (const __m256i*)(wb + j * 2 * COLS);
        const __m256i v0 = _mm256_loadu_si256(w), v1 = _mm256_loadu_si256(w + 1);
        const __m256 e0 = low_half(v0), o0 = high_half(v0), e1 = low_half(v1), o1 = high_half(v1);
        for (int r = 0; r < R; r++) {
            const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * j), xo = _mm256_broadcast_ss(x + r * ldx + 2 * j + 1);
            acc[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[r][0]));
            acc[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[r][1]));
        }
    }
    for (int r = 0; r < R; r++) store16(y + r * ldy, acc[r][0], acc[r][1]);
}

static void block_rows(const float* x, int64_t ldx, int64_t m, const uint16_t* wb, int64_t k2, const float* bias,
                       uint16_t* y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float* xs = x + r0 * ldx;
        uint16_t* ys = y + r0 * ldy;
        switch (m - r0 < 4 ? m - r0 : 4) {
            case 1: rows_block<1>(xs, ldx, wb, k2, bias, ys, ldy); break;
            case 2: rows_block<2>(xs, ldx, wb, k2, bias, ys, ldy); break;
            case 3: rows_block<3>(xs, ldx, wb, k2, bias, ys, ldy); break;
            default: rows_block<4>(xs, ldx, wb, k2, bias, ys, ldy); break;
        }
    }
}

// x: m rows of k bf16 (row stride ldx); w: packed (small_gemm.cpp's layout), n a multiple of 64, k even; bias: n
// floats or null; y: m rows of n bf16 (row stride ldy). Returns 0, or -1 where the float32 copy of x could not be
// allocated (nothing written).
extern "C" int avx2_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                              const float* bias, uint16_t* y, int64_t ldy, int threads) {
    const int64_t groups = n / COLS, k2 = k / 2, blocks = n / 16;
    float* xf = (float*)malloc((size_t)(m * k) * sizeof(float));  // x as floats, row stride k
    if (xf == nullptr) return -1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < k; i++) {
                const uint32_t bits = (uint32_t)x[r * ldx + i] << 16;
                float f;
                __builtin_memcpy(&f, &bits, sizeof(f));
                xf[r * k + i] = f;
            }
        if (m == 1) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++)
                row_group(xf, w + g * k * COLS, k2, bias ? bias + g * COLS : nullptr, y + g * COLS);
        } else {
            for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
                const int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
#pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++) {
                    const int64_t g = b / 4, c = b % 4;
                    block_rows(xf + r0 * k, k, rows, w + g * k * COLS + 32 * c, k2, bias ? bias + 16 * b : nullptr,
                               y + r0 * ldy + 16 * b, ldy);
                }
            }
        }
    }
    free(xf);
    return 0;
}
