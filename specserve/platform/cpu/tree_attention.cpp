// Attention of a few queries per request over keys read from the KV pool by slot, on CPUs with AVX512-BF16: the
// arithmetic of tree_attention_items.h's work items (which keys each query vector sees, and how they are shared).
//
// Per (row, head): its scores key by key (blocks of 16 keys summed by a fixed tree), its softmax, then its weighted
// sum of the values, up to max_group<D> query vectors per pass over the values. Scores, the softmax and the weighted
// sums stay float32 (q . k by vdpbf16ps over pairs of dimensions; exp by a polynomial), with the same arithmetic per
// key whatever shares the pass.
#include "simd.h"
#include "tree_attention_items.h"

// 16 vectors of partial sums -> one vector holding each one's total (lane j: v[j]'s), by a fixed tree of adds that is
// the same for every lane, so a key's score does not depend on its place in a block
static inline __m512 sum16(const __m512* v) {
    __m512 s[8], w[4];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
    // lanes of w[0..3] in order, each lane's 4 values already its 4 keys' sums over that lane
    return _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, 0x88), _mm512_shuffle_f32x4(p01, p23, 0xDD));
}

// the lanes of the block of 16 at j that lie below n
static inline __mmask16 tail_mask(int64_t j, int64_t n) {
    return n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
}

// p[0..n) <- exp(p - max p) -> their sum
static float softmax_numerators(float* p, int64_t n) {
    __m512 top = _mm512_set1_ps(p[0]);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(j, n);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, p + j));
    }
    const __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // the maximum, exactly as a scalar loop's
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(j, n);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), topv));
        _mm512_mask_storeu_ps(p + j, m, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(total);
}

// the most query vectors whose weighted sums stay in registers at once (24 vectors of sums)
template <int D>
constexpr int max_group() { return 24 / (D / 16) > 0 ? 24 / (D / 16) : 1; }

// NV query vectors' outputs: sum_j p[j] v_j / total over the shared keys (each value converted once for all of
// them) and then each one's rest, in key order, so a vector's sums are the same whatever vectors share the pass
template <int D, int NV>
static void weighted(QueryVec* qv, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared, int64_t stride) {
    __m512 acc[NV][D / 16];
    for (int g = 0; g < NV; g++)
        for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n_shared; j++) {
        const uint16_t* val = vbuf + shared[j] * stride;
        __m512 w[NV];
        for (int g = 0; g < NV; g++) w[g] = _mm512_set1_ps(qv[g].p[j]);
        for (int c = 0; c < D / 16; c++) {
            const __m512 v = bf16_to_f32(val + 16 * c);
            for (int g = 0; g < NV; g++) acc[g][c] = _mm512_fmadd_ps(w[g], v, acc[g][c]);
        }
    }
    for (int g = 0; g < NV; g++) {
        const float* pg = qv[g].p + n_shared;
        for (int64_t j = 0; j < qv[g].n_rest; j++) {
            const uint16_t* val = vbuf + qv[g].rest[j] * stride;
            const __m512 w = _mm512_set1_ps(pg[j]);
            for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(w, bf16_to_f32(val + 16 * c), acc[g][c]);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / qv[g].total);
        for (int c = 0; c < D / 16; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
            _mm256_storeu_si256((__m256i*)(qv[g].out + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
    }
}

// the first n <= NV vectors of qv (weighted<D, n>)
template <int D, int NV>
static void weighted_upto(QueryVec* qv, int n, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                          int64_t stride) {
    if constexpr (NV > 1)
        if (n < NV) return weighted_upto<D, NV - 1>(qv, n, vbuf, shared, n_shared, stride);
    weighted<D, NV>(qv, vbuf, shared, n_shared, stride);
}

// p[col + j] = scale * q . key j of each of the nq query vectors, for the n keys at pool slots `slots` (D dimensions,
// bf16 pairs by vdpbf16ps, float32 sums), block by block: a block's 16 keys are read from the pool once for all the
// vectors (then from L1). The one place scores are computed: a key's score is the same whatever call, vector group or
// block it is in.
template <int D>
static void scores(QueryVec* qv, int64_t nq, const uint16_t* kbuf, const int64_t* slots, int64_t n, int64_t stride,
                   float scale, int64_t col) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = n - j0 < 16 ? n - j0 : 16;
        const uint16_t* keys[16];
        for (int64_t j = 0; j < m; j++) keys[j] = kbuf + slots[j0 + j] * stride;
        for (int64_t v = 0; v < nq; v++) {
            __m512bh qr[D / 32];
            for (int c = 0; c < D / 32; c++) qr[c] = (__m512bh)_mm512_loadu_si512(qv[v].q + 32 * c);
            __m512 acc[16];
            for (int64_t j = 0; j < 16; j++) {
                acc[j] = _mm512_setzero_ps();
                if (j >= m) continue;
                for (int c = 0; c < D / 32; c++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], qr[c], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c));
            }
            _mm512_mask_storeu_ps(qv[v].p + col + j0, (__mmask16)((1u << m) - 1), _mm512_mul_ps(sum16(acc), sc));
        }
    }
}

// tree_attention_items.h's arithmetic on AVX512-BF16
struct Avx512 {
    template <int D>
    static void scores(QueryVec* qv, int64_t nq, const uint16_t* kbuf, const int64_t* slots, int64_t n,
                       int64_t stride, float scale, int64_t col) {
        ::scores<D>(qv, nq, kbuf, slots, n, stride, scale, col);
    }
    static float softmax_numerators(float* p, int64_t n) { return ::softmax_numerators(p, n); }
    template <int D>
    static constexpr int max_group() { return ::max_group<D>(); }
    template <int D, int NV>
    static void weighted_upto(QueryVec* qv, int n, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                              int64_t stride) {
        ::weighted_upto<D, NV>(qv, n, vbuf, shared, n_shared, stride);
    }
};

// dim: 32, 64, 128 or 256 (the caller checks; any other returns without writing); heads a multiple of kv_heads,
// at most 64 of them per KV head.
extern "C" void tree_attention_bf16(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh,
                                    const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                                    const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, int64_t batch,
                                    int64_t qmax, int64_t heads, int64_t kv_heads, int64_t dim, int64_t kmax,
                                    float scale, uint16_t* out, int threads) {
    attend<Avx512>(q, q_sb, q_sq, q_sh, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, qmax, heads, kv_heads, dim,
                   kmax, scale, out, threads);
}
