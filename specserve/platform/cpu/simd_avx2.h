// AVX2 helpers shared by specserve's AVX2 kernels (avx2_gemm.cpp, elementwise_avx2.cpp): bf16 <-> float32, e^x and
// ln x on 8 lanes, and loads and stores of a row's last n < 8 values. e^x and ln x take simd.h's AVX512 helpers'
// operations in the same order, lane by lane (not checked against them bit for bit: no machine here runs both).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

// 8 floats -> 8 bf16 bits (round to nearest even, as PyTorch's float -> bf16 cast; NaN -> 0x7FC0) in 32-bit lanes
static inline __m256i bf16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// float32 -> float32 rounded to bf16 (what a bf16 tensor op stores, read back)
static inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }

// 8 bf16 at p -> 8 floats; n < 8: the first n (the others 0)
static inline __m256 load_bf16_8(const uint16_t* p, int64_t n = 8) {
    __m128i h;
    if (n >= 8) {
        h = _mm_loadu_si128((const __m128i*)p);
    } else {
        uint16_t buf[8] = {0};
        memcpy(buf, p, (size_t)n * sizeof(uint16_t));
        h = _mm_loadu_si128((const __m128i*)buf);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats -> bf16 at p; n < 8: the first n only
static inline void store_bf16_8(uint16_t* p, __m256 v, int64_t n = 8) {
    const __m256i b = bf16_bits(v);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (n >= 8) {
        _mm_storeu_si128((__m128i*)p, h);
    } else {
        uint16_t buf[8];
        _mm_storeu_si128((__m128i*)buf, h);
        memcpy(p, buf, (size_t)n * sizeof(uint16_t));
    }
}

// e^x as simd.h's exp_ps: x = n ln2 + r, e^r by the same degree-7 polynomial, times 2^n, which AVX2 builds from the
// exponent bits in two halves (2^(n/2) exactly, then the rest: one rounding, as vscalefps's); below -87 it is 0
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i ni = _mm256_cvtps_epi32(n);  // -126 .. 128
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 pow1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(p, pow1), pow2));
}

// ln x for finite normal x > 0, as simd.h's log_ps: x = 2^e m, m in [sqrt(1/2), sqrt(2)), the same polynomial
static inline __m256 log8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                                   _mm256_set1_epi32(0x3F000000)));  // [0.5, 1)
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
    const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm256_blendv_ps(e, _mm256_sub_ps(e, _mm256_set1_ps(1.0f)), low);
    m = _mm256_blendv_ps(m, _mm256_add_ps(m, m), low);  // [sqrt(1/2), sqrt(2))
    const __m256 t = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    const __m256 z = _mm256_mul_ps(t, t);
    __m256 p = _mm256_set1_ps(7.0376836292E-2f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.1514610310E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.1676998740E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.2420140846E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.4249322787E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.6668057665E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(2.0000714765E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-2.4999993993E-1f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(3.3333331174E-1f));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, t), z);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(t, y));
}
