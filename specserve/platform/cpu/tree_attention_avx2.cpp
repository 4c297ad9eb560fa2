// Attention of a few queries per request over keys read from the KV pool by slot, on CPUs with AVX2 and FMA: the
// arithmetic of tree_attention_items.h's work items (which keys each query vector sees, and how they are shared), in
// 8-lane float32.
//
// Per (row, head): its scores key by key (a key's D products summed lane by lane over D / 8 FMAs, then its 8 lanes
// by a fixed tree), its softmax (exp by simd_avx2.h's polynomial), then its weighted sum of the values, 8 output
// dimensions per vector, over 32 dimensions of up to max_group<D> = 3 query vectors per pass over the values.
// All float32, with the same arithmetic per key whatever shares the pass: a verify tree's node gets bit for bit what
// a one-row decode of the same token gets, as on the AVX512 kernel (whose bits these are not: other sums).
#include "simd_avx2.h"
#include "tree_attention_items.h"

// 8 vectors of partial sums -> one vector holding each one's total (lane j: v[j]'s), by a fixed tree of adds that is
// the same for every lane ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), so a key's score does not depend on its place
// in a block
static inline __m256 sum8(const __m256* v) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    // [v0..v3 lanes 0-3 sums | v0..v3 lanes 4-7 sums], the same for v4..v7
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// the first n lanes' mask (all bits set) of a block of 8, n <= 8
static inline __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// the 8 lanes' total, by a fixed tree: (lanes 0-3 + lanes 4-7), then pairs
static inline float total8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

struct Avx2 {
    // the query vectors' scores over the n keys at `slots` (tree_attention_items.h), block by block: a block's 8 keys
    // are read from the pool and widened to float32 once for all the vectors, and each vector's D values once a call
    template <int D>
    static void scores(QueryVec* qv, int64_t nq, const uint16_t* kbuf, const int64_t* slots, int64_t n,
                       int64_t stride, float scale, int64_t col) {
        static thread_local std::vector<float> qf;  // [nq, D] the vectors in float32
        qf.resize(nq * D);
        for (int64_t v = 0; v < nq; v++)
            for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(&qf[v * D + 8 * c], load_bf16_8(qv[v].q + 8 * c));
        const __m256 sc = _mm256_set1_ps(scale);
        alignas(32) float kf[8][D];  // the block's keys in float32
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int64_t m = n - j0 < 8 ? n - j0 : 8;
            for (int64_t j = 0; j < m; j++) {
                const uint16_t* key = kbuf + slots[j0 + j] * stride;
                for (int c = 0; c < D / 8; c++) _mm256_store_ps(kf[j] + 8 * c, load_bf16_8(key + 8 * c));
            }
            for (int64_t v = 0; v < nq; v++) {
                const float* q = &qf[v * D];
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < D / 8; c++) {  // each key's lanes sum its dimensions c = 0, 1, .. in order
                    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
                    for (int j = 0; j < 8; j++)
                        if (j < m) acc[j] = _mm256_fmadd_ps(qc, _mm256_load_ps(kf[j] + 8 * c), acc[j]);
                }
                _mm256_maskstore_ps(qv[v].p + col + j0, first_lanes(m), _mm256_mul_ps(sum8(acc), sc));
            }
        }
    }

    // p[0..n) <- exp(p - max p) -> their sum: lane l sums the numerators at indices l mod 8, then total8
    static float softmax_numerators(float* p, int64_t n) {
        float top = p[0];
        for (int64_t j = 1; j < n; j++) top = p[j] > top ? p[j] : top;
        const __m256 topv = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            const __m256i m = first_lanes(n - j < 8 ? n - j : 8);
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + j, m), topv)),
                                           _mm256_castsi256_ps(m));
            _mm256_maskstore_ps(p + j, m, e);
            total = _mm256_add_ps(total, e);
        }
        return total8(total);
    }

    // NV query vectors' output dimensions [8 C0, 8 (C0 + CB)): sum_j p[j] v_j / total over the shared keys (each
    // value's slice converted once for all of them), then each one's rest, in key order
    template <int D, int C0, int CB, int NV>
    static void weighted_slice(QueryVec* qv, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                               int64_t stride) {
        __m256 acc[NV][CB];
        for (int g = 0; g < NV; g++)
            for (int c = 0; c < CB; c++) acc[g][c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n_shared; j++) {
            const uint16_t* val = vbuf + shared[j] * stride + 8 * C0;
            for (int c = 0; c < CB; c++) {
                const __m256 x = load_bf16_8(val + 8 * c);
                for (int g = 0; g < NV; g++) acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(qv[g].p[j]), x, acc[g][c]);
            }
        }
        for (int g = 0; g < NV; g++) {
            const float* pg = qv[g].p + n_shared;
            for (int64_t j = 0; j < qv[g].n_rest; j++) {
                const uint16_t* val = vbuf + qv[g].rest[j] * stride + 8 * C0;
                const __m256 w = _mm256_set1_ps(pg[j]);
                for (int c = 0; c < CB; c++) acc[g][c] = _mm256_fmadd_ps(w, load_bf16_8(val + 8 * c), acc[g][c]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / qv[g].total);
            for (int c = 0; c < CB; c++)  // round to nearest even, as PyTorch's float -> bf16 cast
                store_bf16_8(qv[g].out + 8 * (C0 + c), _mm256_mul_ps(acc[g][c], inv));
        }
    }

    // slices of at most 4 vectors (32 dimensions) each, so that 3 query vectors share each value's widening: against
    // 8-vector slices for one vector at a time, 10-25% less time a call for verify trees over 200-1000 keys with
    // head dimensions 64 and 128 (the same bits: a sum's order does not depend on the slices)
    static constexpr int slice_width(int d) { return d / 8 < 4 ? d / 8 : 4; }

    template <int D, int NV, int C0 = 0>
    static void weighted_group(QueryVec* qv, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                               int64_t stride) {
        constexpr int CB = slice_width(D);
        weighted_slice<D, C0, CB, NV>(qv, vbuf, shared, n_shared, stride);
        if constexpr (C0 + CB < D / 8) weighted_group<D, NV, C0 + CB>(qv, vbuf, shared, n_shared, stride);
    }

    // the most query vectors whose sums over one slice stay in registers with a value and their weights (16 ymm)
    template <int D>
    static constexpr int max_group() { return 12 / slice_width(D) > 0 ? 12 / slice_width(D) : 1; }

    template <int D, int NV>
    static void weighted_upto(QueryVec* qv, int n, const uint16_t* vbuf, const int64_t* shared, int64_t n_shared,
                              int64_t stride) {
        if constexpr (NV > 1)
            if (n < NV) return weighted_upto<D, NV - 1>(qv, n, vbuf, shared, n_shared, stride);
        weighted_group<D, NV>(qv, vbuf, shared, n_shared, stride);
    }
};

// dim: 32, 64, 128 or 256 (the caller checks; any other returns without writing); heads a multiple of kv_heads,
// at most 64 of them per KV head.
extern "C" void avx2_tree_attention_bf16(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh,
                                         const uint16_t* kbuf, const uint16_t* vbuf, const int64_t* slots,
                                         const uint8_t* mask, int64_t mask_sb, int64_t mask_sq, int64_t batch,
                                         int64_t qmax, int64_t heads, int64_t kv_heads, int64_t dim, int64_t kmax,
                                         float scale, uint16_t* out, int threads) {
    attend<Avx2>(q, q_sb, q_sq, q_sh, kbuf, vbuf, slots, mask, mask_sb, mask_sq, batch, qmax, heads, kv_heads, dim,
                 kmax, scale, out, threads);
}
