// AVX512 helpers shared by specserve's CPU kernels (tree_attention.cpp, elementwise.cpp, the few-row kernels): bf16 <->
// float32, e^x, the passes' row counts.
// bf16 values travel as uint16_t; every rounding to bf16 is to nearest even, as PyTorch's float -> bf16 cast.
#pragma once

#include <immintrin.h>
#include <stdint.h>

// rows of the pass that starts at row r0 when m rows go in passes of at most `most` rows, as even as can be, the
// larger first (9 rows, at most 6: 5 then 4): the few-row kernels' passes (small_gemm.cpp, int8_gemm.cpp)
static inline int64_t pass_rows(int64_t m, int64_t r0, int64_t most) {
    const int64_t passes = (m + most - 1) / most, base = m / passes, extra = m % passes;  // `extra` passes of base + 1
    return r0 < extra * (base + 1) ? base + 1 : base;
}

// the n <= 16 lanes of a tail, as a mask
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

static inline __m512 bf16_to_f32(const uint16_t* p) {  // 16 bf16 -> 16 floats
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline __m512 bf16_to_f32(const uint16_t* p, __mmask16 m) {  // the lanes in m (others 0)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// float32 -> the bits of the nearest bf16 (ties to even) in each lane's high half, as c10::BFloat16 rounds (integer
// arithmetic, so subnormals are kept; NaN -> 0x7FC0)
static inline __m512i round_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}

// float32 -> float32 rounded to bf16 (what a bf16 tensor op stores, read back)
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(round_bits(v), _mm512_set1_epi32((int)0xFFFF0000u)));
}

// float32 -> 16 bf16 stored at p (the lanes in m)
static inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m = 0xFFFF) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(v), 16)));
}

// e^x: x = n ln2 + r, e^r by a degree-7 polynomial (relative error about 2e-7 on [-ln2/2, ln2/2]), times 2^n by
// vscalefps; below -87 it underflows to 0 as expf does, above 88.7 it overflows to infinity
static inline __m512 exp_ps(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2's high part (exact product)
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // and its low part
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

// ln x for finite x > 0 (normal): x = 2^e m, m in [sqrt(1/2), sqrt(2)), ln m = t - t^2 / 2 + t^3 P(t) with t = m - 1
// (Cephes' logf polynomial, about 1 ulp); t is exact, so values near 1 keep their relative precision
static inline __m512 log_ps(__m512 x) {
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_src);  // [0.5, 1)
    __m512 e = _mm512_add_ps(_mm512_getexp_ps(x), _mm512_set1_ps(1.0f));
    const __mmask16 low = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm512_mask_sub_ps(e, low, e, _mm512_set1_ps(1.0f));
    m = _mm512_mask_add_ps(m, low, m, m);  // [sqrt(1/2), sqrt(2))
    const __m512 t = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    const __m512 z = _mm512_mul_ps(t, t);
    __m512 p = _mm512_set1_ps(7.0376836292E-2f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.1514610310E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.1676998740E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.2420140846E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.4249322787E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.6668057665E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(2.0000714765E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-2.4999993993E-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(3.3333331174E-1f));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, t), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);  // ln2's low part
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(t, y));  // and its high part
}
