// The CPU implementations of specserve's operators (specserve::small_gemm, int8_gemm, tree_attention, the
// element-wise rms_norm, silu_mul and rope, race_exponentials, race_walk, kv_store, decoder_layer, draft_topk,
// draft_level and draft_levels), in C++: what the Python implementations in small_gemm.py, int8_gemm.py,
// tree_attention.py, elementwise.py, race_walk.py, fused_layer.py, draft_topk.py and draft_levels.py do, without
// Python between the dispatcher and the kernel. The operators are defined (schema, fake tensors, Python fallback)
// beside those files; this library, linked with the kernels' sources, registers their CPU kernels (native.py builds
// and loads it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <math.h>
#include <string.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#ifdef SPECSERVE_OPS_AVX2
#include "simd_avx2.h"
#else
#include "simd.h"
#endif

// Built for AVX512-BF16 with small_gemm.cpp, int8_gemm.cpp, tree_attention.cpp and elementwise.cpp, or, with
// SPECSERVE_OPS_AVX2 defined, for AVX2 and FMA with avx2_gemm.cpp, tree_attention_avx2.cpp and elementwise_avx2.cpp:
// then it registers the AVX2 kernels (avx2_gemm, int8_gemm, tree_attention) in place of small_gemm, which keeps its
// Python implementation (its kernel needs AVX512-BF16; the engine does not call it there). Both builds register
// decoder_layer, a whole layer on this build's kernels (fused_layer.py).
extern "C" {
#ifdef SPECSERVE_OPS_AVX2
int avx2_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                   const float* bias, uint16_t* y, int64_t ldy, int threads);
int avx2_int8_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n,
                        const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads);
void avx2_tree_attention_bf16(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh, const uint16_t* kbuf,
                              const uint16_t* vbuf, const int64_t* slots, const uint8_t* mask, int64_t mask_sb,
                              int64_t mask_sq, int64_t batch, int64_t qmax, int64_t heads, int64_t kv_heads,
                              int64_t dim, int64_t kmax, float scale, uint16_t* out, int threads);
#else
void small_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* w, int64_t n,
                     const float* bias, uint16_t* y, int64_t ldy, int threads, int64_t amx_from);
void int8_gemm_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n,
                    const float* scale, const float* bias, uint16_t* y, int64_t ldy, int threads, int64_t amx_from);
void tree_attention_bf16(const uint16_t* q, int64_t q_sb, int64_t q_sq, int64_t q_sh, const uint16_t* kbuf,
                         const uint16_t* vbuf, const int64_t* slots, const uint8_t* mask, int64_t mask_sb,
                         int64_t mask_sq, int64_t batch, int64_t qmax, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t kmax, float scale, uint16_t* out, int threads);
#endif
void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t d, int64_t ldx, const uint16_t* weight, float eps,
                   uint16_t* out);
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t n, int64_t ldg, uint16_t* out);
void rope_bf16(const uint16_t* x, int64_t tokens, int64_t heads, int64_t d, int64_t sx_t, int64_t sx_h,
               const uint16_t* cos, int64_t sc, const uint16_t* sin, int64_t ss, uint16_t* out);
void race_exponentials(const int32_t* k1, const int32_t* k2, int64_t rows, const int32_t* ids, int64_t ldi, int64_t m,
                       float* out, int64_t ldo);
}

namespace {

const int64_t SMALL_COLS = 64;  // small_gemm.py's COLS
const int64_t INT8_COLS = 32;   // int8_gemm.py's COLS

template <typename T>
const T* ptr(const at::Tensor& t) {
    return static_cast<const T*>(t.data_ptr());
}

const float* bias_ptr(const std::optional<at::Tensor>& bias) {
    return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

at::Tensor rows_contiguous(const at::Tensor& x) {
    return x.stride(-1) == 1 ? x : x.contiguous();
}

#ifdef SPECSERVE_OPS_AVX2
// x [M, K] bf16 @ a packed bf16 weight [N / 64, K / 2, 64, 2] (+ a float32 bias [N]) -> [M, N] bf16
at::Tensor avx2_gemm(const at::Tensor& x_, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
    const at::Tensor x = rows_contiguous(x_);
    const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * SMALL_COLS;
    at::Tensor y = at::empty({m, n}, x.options());
    if (m == 0) return y;
    const int status = avx2_gemm_bf16(ptr<uint16_t>(x), m, k, x.stride(0), ptr<uint16_t>(packed), n, bias_ptr(bias),
                                      static_cast<uint16_t*>(y.data_ptr()), n, at::get_num_threads());
    TORCH_CHECK(status == 0, "avx2_gemm: no memory for a float32 copy of the input");
    return y;
}

#else
// x [M, K] bf16 @ a packed bf16 weight [N / 64, K / 2, 64, 2] (+ a float32 bias [N]) -> [M, N] bf16; calls of
// amx_from rows or more on the tile unit where it runs (0: never)
at::Tensor small_gemm(const at::Tensor& x_, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t amx_from) {
    const at::Tensor x = rows_contiguous(x_);
    const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * SMALL_COLS;
    at::Tensor y = at::empty({m, n}, x.options());
    small_gemm_bf16(ptr<uint16_t>(x), m, k, x.stride(0), ptr<uint16_t>(packed), n, bias_ptr(bias),
                    static_cast<uint16_t*>(y.data_ptr()), n, at::get_num_threads(), amx_from);
    return y;
}

#endif

// this build's int8 kernel -> 0, or -1 where the AVX2 one had no memory for its float32 copy of x; amx_from as
// int8_gemm_bf16's (the AVX2 kernel has no tile unit path)
int int8_kernel(const uint16_t* x, int64_t m, int64_t k, int64_t ldx, const int8_t* q, int64_t n, const float* scale,
                const float* bias, uint16_t* y, int64_t ldy, int threads, int64_t amx_from) {
#ifdef SPECSERVE_OPS_AVX2
    (void)amx_from;
    return avx2_int8_gemm_bf16(x, m, k, ldx, q, n, scale, bias, y, ldy, threads);
#else
    int8_gemm_bf16(x, m, k, ldx, q, n, scale, bias, y, ldy, threads, amx_from);
    return 0;
#endif
}

// x [M, K] bf16 @ a packed int8 weight [N / 32, K / 2, 2, 32], times float32 scales [N] (+ a float32 bias [N]); calls
// of amx_from rows or more on the tile unit where it runs (0: never)
at::Tensor int8_gemm(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t amx_from) {
    const at::Tensor x = rows_contiguous(x_);
    const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * INT8_COLS;
    at::Tensor y = at::empty({m, n}, x.options());
    const int status = int8_kernel(ptr<uint16_t>(x), m, k, x.stride(0), ptr<int8_t>(packed), n,
                                   scales.data_ptr<float>(), bias_ptr(bias), static_cast<uint16_t*>(y.data_ptr()), n,
                                   at::get_num_threads(), amx_from);
    TORCH_CHECK(status == 0, "int8_gemm: no memory for a float32 copy of the input");
    return y;
}

// qb [B, Qmax, H, D] bf16 over the pools k_buf / v_buf [S, Hkv, D]; kv_slots [B, Kmax]; mask [B, 1, Qmax, Kmax]
// bool or broadcastable ([B, 1, 1, Kmax]), None: every column visible -> [B * Qmax, H * D] bf16
at::Tensor tree_attention(const at::Tensor& qb_, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& kv_slots_, const std::optional<at::Tensor>& mask_, double scale) {
    const at::Tensor qb = rows_contiguous(qb_);
    const at::Tensor kv_slots = kv_slots_.to(at::kLong).contiguous();
    const int64_t bsz = qb.size(0), max_q = qb.size(1), heads = qb.size(2), dim = qb.size(3);
    at::Tensor out = at::empty({bsz * max_q, heads * dim}, qb.options());
    const uint8_t* mask_ptr = nullptr;
    int64_t stride_b = 0, stride_q = 0;
    at::Tensor mask;
    if (mask_.has_value()) {
        mask = rows_contiguous(*mask_);
        mask_ptr = static_cast<const uint8_t*>(mask.data_ptr());  // bool: one byte each
        stride_b = mask.size(0) > 1 ? mask.stride(0) : 0;
        stride_q = mask.size(2) > 1 ? mask.stride(2) : 0;
    }
#ifdef SPECSERVE_OPS_AVX2
    const auto kernel = avx2_tree_attention_bf16;
#else
    const auto kernel = tree_attention_bf16;
#endif
    kernel(ptr<uint16_t>(qb), qb.stride(0), qb.stride(1), qb.stride(2), ptr<uint16_t>(k_buf), ptr<uint16_t>(v_buf),
           kv_slots.data_ptr<int64_t>(), mask_ptr, stride_b, stride_q, bsz, max_q, heads, k_buf.size(1), dim,
           kv_slots.size(1), static_cast<float>(scale), static_cast<uint16_t*>(out.data_ptr()), at::get_num_threads());
    return out;
}

// Rows per thread of the element-wise operators: a row of a few thousand values takes about a microsecond, so calls
// of fewer rows than two chunks (decode steps, small trees) stay on the calling thread
const int64_t ROW_GRAIN = 16;

uint16_t* out_ptr(at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

// x [..., D] bf16, weight [D] (bf16, or float32 scaled in bf16) -> weight * bf16(x * rsqrt(mean(x^2) + eps))
at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight_, double eps) {
    const int64_t d = x_.size(-1);
    const at::Tensor x = x_.contiguous().view({-1, d});
    const at::Tensor w = weight_.scalar_type() == at::kBFloat16 ? weight_.contiguous() : weight_.to(at::kBFloat16);
    at::Tensor out = at::empty(x_.sizes(), x_.options());
    const uint16_t *xp = ptr<uint16_t>(x), *wp = ptr<uint16_t>(w);
    uint16_t* op = out_ptr(out);
    at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t lo, int64_t hi) {
        rms_norm_bf16(xp + lo * d, hi - lo, d, d, wp, static_cast<float>(eps), op + lo * d);
    });
    return out;
}

// gate_up [..., 2N] bf16 -> [..., N]: silu(gate) * up
at::Tensor silu_mul(const at::Tensor& gate_up_) {
    const int64_t two_n = gate_up_.size(-1), n = two_n / 2;
    const at::Tensor gate_up = gate_up_.contiguous().view({-1, two_n});
    std::vector<int64_t> sizes = gate_up_.sizes().vec();
    sizes.back() = n;
    at::Tensor out = at::empty(sizes, gate_up_.options());
    const uint16_t* gp = ptr<uint16_t>(gate_up);
    uint16_t* op = out_ptr(out);
    at::parallel_for(0, gate_up.size(0), ROW_GRAIN, [&](int64_t lo, int64_t hi) {
        silu_mul_bf16(gp + lo * two_n, hi - lo, n, two_n, op + lo * n);
    });
    return out;
}

// x [T, H, D] bf16 (D contiguous), cos / sin [T, 1, D] (cos | cos, -sin | sin; D contiguous) -> [T, H, D]:
// x * cos + cat(x2, x1) * sin
at::Tensor rope(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_) {
    const at::Tensor x = rows_contiguous(x_), cos = rows_contiguous(cos_), sin = rows_contiguous(sin_);
    const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
    at::Tensor out = at::empty({tokens, heads, d}, x.options());
    const uint16_t *xp = ptr<uint16_t>(x), *cp = ptr<uint16_t>(cos), *sp = ptr<uint16_t>(sin);
    uint16_t* op = out_ptr(out);
    at::parallel_for(0, tokens, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
        rope_bf16(xp + lo * x.stride(0), hi - lo, heads, d, x.stride(0), x.stride(1), cp + lo * cos.stride(0),
                  cos.stride(0), sp + lo * sin.stride(0), sin.stride(0), op + lo * heads * d);
    });
    return out;
}

// Token ids per thread of race_exponentials: a few microseconds of work, so a draft's candidates stay on one thread
const int64_t ID_GRAIN = 4096;

// k1, k2 [R, 1] int32; ids [R, M] or [1, M] int32 -> E [R, M] float32 (sampling/race.py's exponentials)
at::Tensor race_exponentials_op(const at::Tensor& k1_, const at::Tensor& k2_, const at::Tensor& ids_) {
    const at::Tensor k1 = k1_.contiguous(), k2 = k2_.contiguous(), ids = rows_contiguous(ids_);
    const int64_t rows = k1.size(0), m = ids.size(1);
    const int64_t ldi = ids.size(0) == 1 ? 0 : ids.stride(0);
    at::Tensor out = at::empty({rows, m}, k1.options().dtype(at::kFloat));
    const int32_t *a = ptr<int32_t>(k1), *b = ptr<int32_t>(k2), *ip = ptr<int32_t>(ids);
    float* op = out.data_ptr<float>();
    at::parallel_for(0, m, ID_GRAIN, [&](int64_t lo, int64_t hi) {
        race_exponentials(a, b, rows, ip + lo, ldi, hi - lo, op + lo, m);
    });
    return out;
}

// k_buf / v_buf [S, Hkv, D] (contiguous) <- k / v [T, Hkv, D] (each token's Hkv x D contiguous, any token stride) at
// slots [T]: both pools' writes of a layer in one call, a row copy per token (padding rows may share slot 0)
void kv_store(const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slots_, const at::Tensor& k_,
              const at::Tensor& v_) {
    const at::Tensor slots = slots_.to(at::kLong).contiguous();
    const int64_t tokens = slots.size(0), row = k_buf.stride(0) * k_buf.element_size();
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (const at::Tensor* src : {&k_, &v_})  // a token's row must be the pool's row, byte for byte
        TORCH_CHECK(src->dim() == 3 && src->size(0) == tokens && src->scalar_type() == k_buf.scalar_type() &&
                        src->size(1) * src->size(2) == k_buf.size(1) * k_buf.size(2) && v_buf.sizes() == k_buf.sizes(),
                    "kv_store: k / v must be [slots, Hkv, D] in the pool's dtype and row size");
    for (int64_t t = 0; t < tokens; t++) TORCH_CHECK(sp[t] >= 0 && sp[t] < k_buf.size(0), "kv_store: slot out of range");
    for (auto [buf, src_] : {std::pair<const at::Tensor*, const at::Tensor*>{&k_buf, &k_}, {&v_buf, &v_}}) {
        const at::Tensor src = src_->stride(2) == 1 && src_->stride(1) == src_->size(2) ? *src_ : src_->contiguous();
        const char* from = static_cast<const char*>(src.data_ptr());
        char* to = static_cast<char*>(buf->data_ptr());
        const int64_t step = src.stride(0) * src.element_size();
        for (int64_t t = 0; t < tokens; t++) memcpy(to + sp[t] * row, from + t * step, row);
    }
}

// One linear of decoder_layer: x [M, K] bf16 @ a packed bf16 weight on this build's few-row kernel, or with scales a
// packed int8 one (AVX512-BF16: calls of amx_from rows or more on the tile unit, as small_gemm's and int8_gemm's)
at::Tensor layer_linear(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& linears, int64_t i,
                        int64_t amx_from) {
    const std::optional<at::Tensor> packed = linears.get(3 * i), scales = linears.get(3 * i + 1),
                                    bias = linears.get(3 * i + 2);
    TORCH_CHECK(packed.has_value(), "decoder_layer: linear ", i, " has no weight");
    if (scales.has_value()) return int8_gemm(x, *packed, *scales, bias, amx_from);
#ifdef SPECSERVE_OPS_AVX2
    (void)amx_from;
    return avx2_gemm(x, *packed, bias);
#else
    return small_gemm(x, *packed, bias, amx_from);
#endif
}

// A pre-norm decoder layer (attention, then a SiLU gated MLP) of an eager bf16 forward whose B requests each bring
// T / B new tokens, every step on the operators above, in the order the Python modules call them (same bits):
// x [T, h] -> h = x + o(attention(rope(q, k), v)) over a = rms_norm(x), then h + down(silu_mul(gate_up(rms_norm(h)))).
// With embeds [T, h] (an EAGLE-3 head's layer) the attention reads cat(rms_norm(embeds, embed_norm), a) [T, 2h].
// linears: (packed weight, int8 scales or None, float32 bias or None) of qkv, o, gate_up and down (12 entries);
// norms [h]; cos / sin [T, 1, D]; the new K and V go to k_buf / v_buf [S, Hkv, D] at out_slots [T]; kv_slots
// [B, Kmax] and mask as tree_attention's
at::Tensor decoder_layer(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& linears,
                         const at::Tensor& norm1, const at::Tensor& norm2, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
                         const at::Tensor& out_slots, const at::Tensor& kv_slots,
                         const std::optional<at::Tensor>& mask, int64_t heads, double scale,
                         const std::optional<at::Tensor>& embeds, const std::optional<at::Tensor>& embed_norm,
                         int64_t amx_from) {
    TORCH_CHECK(linears.size() == 12, "decoder_layer: 4 linears of 3 entries each, not ", linears.size());
    const int64_t tokens = x.size(0), kv_heads = k_buf.size(1), dim = k_buf.size(2), bsz = kv_slots.size(0);
    TORCH_CHECK(bsz > 0 && tokens % bsz == 0, "decoder_layer: ", tokens, " tokens over ", bsz, " requests");
    TORCH_CHECK(embeds.has_value() == embed_norm.has_value(), "decoder_layer: embeds and embed_norm go together");
    at::Tensor a = rms_norm(x, norm1, eps);
    if (embeds.has_value()) a = at::cat({rms_norm(*embeds, *embed_norm, eps), a}, 1);
    const at::Tensor qkv = layer_linear(a, linears, 0, amx_from);  // [T, (H + 2 Hkv) D]
    const at::Tensor qk = rope(qkv.narrow(1, 0, (heads + kv_heads) * dim).view({tokens, heads + kv_heads, dim}), cos,
                               sin);  // [T, H + Hkv, D]
    kv_store(k_buf, v_buf, out_slots, qk.narrow(1, heads, kv_heads),
             qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({tokens, kv_heads, dim}));
    const at::Tensor q = qk.narrow(1, 0, heads).view({bsz, tokens / bsz, heads, dim});  // [B, Qmax, H, D]
    const at::Tensor attn = tree_attention(q, k_buf, v_buf, kv_slots, mask, scale);  // [T, H D]
    const at::Tensor h = x + layer_linear(attn, linears, 1, amx_from);
    return h + layer_linear(silu_mul(layer_linear(rms_norm(h, norm2, eps), linears, 2, amx_from)), linears, 3,
                            amx_from);
}

#ifdef SPECSERVE_OPS_AVX2
// z[0..v) <- the bf16 row [v] in float32 times s, minus noise [v] where given -> their maximum
float scaled_row(const uint16_t* row, int64_t v, float s, const float* noise, float* z) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    const __m256 scale = _mm256_set1_ps(s);
    int64_t j = 0;
    for (; j + 8 <= v; j += 8) {
        __m256 x = _mm256_mul_ps(load_bf16_8(row + j), scale);
        if (noise) x = _mm256_sub_ps(x, _mm256_loadu_ps(noise + j));
        _mm256_storeu_ps(z + j, x);
        top = _mm256_max_ps(top, x);
    }
    float out[8];
    _mm256_storeu_ps(out, top);
    float m = out[0];
    for (int i = 1; i < 8; i++) m = out[i] > m ? out[i] : m;
    for (; j < v; j++) {
        uint32_t bits = static_cast<uint32_t>(row[j]) << 16;
        memcpy(z + j, &bits, sizeof(float));
        z[j] *= s;
        if (noise) z[j] -= noise[j];
        m = z[j] > m ? z[j] : m;
    }
    return m;
}

// sum of e^(z[j] - top) over z[0..v)
float exp_total(const float* z, int64_t v, float top) {
    __m256 total = _mm256_setzero_ps();
    const __m256 t = _mm256_set1_ps(top);
    int64_t j = 0;
    for (; j + 8 <= v; j += 8) total = _mm256_add_ps(total, exp8(_mm256_sub_ps(_mm256_loadu_ps(z + j), t)));
    float out[8];
    _mm256_storeu_ps(out, total);
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) sum += out[i];
    for (; j < v; j++) sum += std::exp(z[j] - top);
    return sum;
}
#else
// z[0..v) <- the bf16 row [v] in float32 times s, minus noise [v] where given -> their maximum
float scaled_row(const uint16_t* row, int64_t v, float s, const float* noise, float* z) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    const __m512 scale = _mm512_set1_ps(s);
    for (int64_t j = 0; j < v; j += 16) {
        const __mmask16 m = lanes(v - j);
        __m512 x = _mm512_mul_ps(bf16_to_f32(row + j, m), scale);
        if (noise) x = _mm512_sub_ps(x, _mm512_maskz_loadu_ps(m, noise + j));
        _mm512_mask_storeu_ps(z + j, m, x);
        top = _mm512_mask_max_ps(top, m, top, x);
    }
    return _mm512_reduce_max_ps(top);
}

// sum of e^(z[j] - top) over z[0..v)
float exp_total(const float* z, int64_t v, float top) {
    __m512 total = _mm512_setzero_ps();
    const __m512 t = _mm512_set1_ps(top);
    for (int64_t j = 0; j < v; j += 16) {
        const __mmask16 m = lanes(v - j);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, z + j), t));
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(total);
}
#endif

// z[j] <- -inf where the bitmask row words [w] does not allow column j's token (map[j], or j; bit t % 32 of word
// t / 32) -> the maximum of the others (-inf where none is allowed)
float banned(float* z, const int32_t* words, int64_t w, const int64_t* map, int64_t v) {
    float top = -INFINITY;
    for (int64_t j = 0; j < v; j++) {
        const int64_t t = map ? map[j] : j;
        if (t >= 32 * w || !((static_cast<uint32_t>(words[t >> 5]) >> (t & 31)) & 1u)) z[j] = -INFINITY;
        top = z[j] > top ? z[j] : top;
    }
    return top;
}

// A draft head's ranking of its next tokens: x [R, h] bf16 (its pre-norm output) -> rms_norm, its LM head (one
// linear as decoder_layer's: packed weight, int8 scales or None, float32 bias or None) to bf16 logits [R, V], in
// float32 times scale, softmax, the k largest -> (probabilities [R, k] float32, ids [R, k] int64: best first, the
// smaller id among equal values; through to_target [V] where given). With noise [G, V] float32 (a race's log E) and
// inv_temps [G], row r of group g = r / rows_per_group is scored logit * inv_temps[g] - noise[g] instead. With
// allowed [R, W] int32 (a grammar's bitmask rows over the target vocabulary: bit t % 32 of word t / 32 allows token
// t), the tokens a row does not allow score -inf (a row with nothing left: probabilities 0). draft_topk_reference in
// draft_topk.py is the same steps as single operators.
std::tuple<at::Tensor, at::Tensor> draft_topk(const at::Tensor& x, const at::Tensor& norm, double eps,
                                              const c10::List<std::optional<at::Tensor>>& linear, double scale,
                                              int64_t k, const std::optional<at::Tensor>& to_target,
                                              int64_t amx_from, const std::optional<at::Tensor>& noise_,
                                              const std::optional<at::Tensor>& inv_temps_, int64_t rows_per_group,
                                              const std::optional<at::Tensor>& allowed_) {
    TORCH_CHECK(linear.size() == 3, "draft_topk: one linear of 3 entries, not ", linear.size());
    const at::Tensor logits = layer_linear(rms_norm(x, norm, eps), linear, 0, amx_from).contiguous();  // [R, V]
    const int64_t rows = logits.size(0), v = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= v, "draft_topk: k = ", k, " of ", v, " logits");
    const at::Tensor map = to_target.has_value() ? to_target->contiguous() : at::Tensor();
    TORCH_CHECK(!map.defined() || (map.scalar_type() == at::kLong && map.numel() == v),
                "draft_topk: to_target must be int64 [", v, "]");
    const at::Tensor noise = noise_.has_value() ? noise_->to(at::kFloat).contiguous() : at::Tensor();
    const at::Tensor inv_temps = inv_temps_.has_value() ? inv_temps_->to(at::kFloat).contiguous() : at::Tensor();
    TORCH_CHECK(!noise.defined() || (inv_temps.defined() && rows_per_group >= 1 && noise.size(1) == v &&
                                     noise.size(0) * rows_per_group == rows && inv_temps.numel() == noise.size(0)),
                "draft_topk: noise [", rows, " / rows_per_group, ", v, "] goes with inv_temps, one per group");
    const at::Tensor allowed = allowed_.has_value() ? allowed_->contiguous() : at::Tensor();
    TORCH_CHECK(!allowed.defined() || (allowed.scalar_type() == at::kInt && allowed.dim() == 2 &&
                                       allowed.size(0) == rows),
                "draft_topk: allowed must be an int32 bitmask [", rows, ", words]");
    const int32_t* ap = allowed.defined() ? allowed.data_ptr<int32_t>() : nullptr;
    const int64_t words = allowed.defined() ? allowed.size(1) : 0;
    const float* np = noise.defined() ? noise.data_ptr<float>() : nullptr;
    const float* tp = inv_temps.defined() ? inv_temps.data_ptr<float>() : nullptr;
    at::Tensor probs = at::empty({rows, k}, x.options().dtype(at::kFloat));
    at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
    const uint16_t* lp = ptr<uint16_t>(logits);
    const int64_t* mp = map.defined() ? map.data_ptr<int64_t>() : nullptr;
    float* pp = probs.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    const float s = static_cast<float>(scale);
    at::parallel_for(0, rows, 8, [&](int64_t lo, int64_t hi) {
        std::vector<float> z(v);
        std::vector<int64_t> best;
        best.reserve(k + 1);
        for (int64_t r = lo; r < hi; r++) {
            const int64_t g = np ? r / rows_per_group : 0;
            float top = scaled_row(lp + r * v, v, np ? tp[g] : s, np ? np + g * v : nullptr, z.data());
            if (ap) top = banned(z.data(), ap + r * words, words, mp, v);
            if (top == -INFINITY) {  // nothing allowed: probabilities 0 (as torch's NaNs put to 0), the first ids
                for (int64_t i = 0; i < k; i++) {
                    pp[r * k + i] = 0.0f;
                    ip[r * k + i] = mp ? mp[i] : i;
                }
                continue;
            }
            const float total = exp_total(z.data(), v, top);
            best.clear();  // the k largest, best first; a later id goes after equal values
            for (int64_t j = 0; j < v; j++) {
                if ((int64_t)best.size() == k && !(z[j] > z[best.back()])) continue;
                auto at = best.end();
                while (at != best.begin() && z[*(at - 1)] < z[j]) --at;
                best.insert(at, j);
                if ((int64_t)best.size() > k) best.pop_back();
            }
            for (int64_t i = 0; i < k; i++) {
                pp[r * k + i] = std::exp(z[best[i]] - top) / total;
                ip[r * k + i] = mp ? mp[best[i]] : best[i];
            }
        }
    });
    return {probs, ids};
}

// drafting_can_stop over a batch (EagleCandidates.can_stop): live [B, K] the live branches' scores, seen [B, n] every
// candidate's so far. With fewer than `keep` candidates only a positive threshold above every live score stops; else
// each request stops where at least `keep` candidates rank before any deeper one (score >= its best live score) or
// its best live score is below a positive threshold.
bool levels_can_stop(const at::Tensor& live, const at::Tensor& seen, int64_t keep, double threshold) {
    const int64_t B = live.size(0), K = live.size(1), n = seen.size(1);
    const float* lp = live.data_ptr<float>();
    const float* sp = seen.data_ptr<float>();
    if (n < keep) {
        const float best = *std::max_element(lp, lp + B * K);
        return threshold > 0 && best < static_cast<float>(threshold);
    }
    for (int64_t b = 0; b < B; b++) {
        const float best = *std::max_element(lp + b * K, lp + (b + 1) * K);
        int64_t above = 0;
        for (int64_t i = 0; i < n; i++) above += sp[b * n + i] >= best;
        if (above < keep && !(threshold > 0 && best < static_cast<float>(threshold))) return false;
    }
    return true;
}

// One level j (1 .. L) of an EAGLE-3 head's draft tree (eagle.py's _draft_levels where the head's layer is
// decoder_layer's and its ranking draft_topk's, every request with the same K live branches), from the state the level
// before left: x [B K, h] the live branches' hidden states, tokens [B K] their tokens, live [B, K] float32 their
// scores, live_index [B, K] their candidate indices, anc [B, K, L K] bool each one's ancestors over the levels'
// columns, seen [B, n] every candidate's score so far. The live branches' embeddings and hidden states -> the head's
// layer over request b's keys (its base[b] prefix columns of kv_slots, then the levels' scratch columns, each branch
// seeing its ancestors and itself; K and V written at scratch [B K], this level's) -> the ranking's top-K children per
// branch (scores scaled by rank_scale, or with noise [B, V] and inv_temps [B] each request's race at this level; with
// allowed [B K, W] only the tokens a branch's bitmask row allows) -> the candidates: each child scored live score x
// probability (float32), the best K of each request's K K (score desc, equal scores the earlier first) the next live
// branches. cos / sin [B K, 1, D]: this level's rows. -> (the next level's x, tokens, live, live_index, anc (x,
// tokens and anc empty where j = L), seen with this level's scores, this level's scores, tokens and parents
// (candidate indices) [B, K K], whether the level after cannot change the tree (levels_can_stop, or j = L): bool
// [1]).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
draft_level(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& live_, const at::Tensor& live_index_,
            const at::Tensor& anc_, const at::Tensor& seen_, int64_t j, const at::Tensor& embed,
            const c10::List<std::optional<at::Tensor>>& linears, const at::Tensor& norm1, const at::Tensor& norm2,
            const at::Tensor& embed_norm, double eps, int64_t heads, double attn_scale, int64_t amx_from,
            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
            const at::Tensor& scratch, const at::Tensor& kv_slots, at::IntArrayRef base,
            const at::Tensor& head_norm, double head_eps, const c10::List<std::optional<at::Tensor>>& head_linear,
            double rank_scale, const std::optional<at::Tensor>& to_target, int64_t rank_amx_from,
            const std::optional<at::Tensor>& noise, const std::optional<at::Tensor>& inv_temps,
            const std::optional<at::Tensor>& allowed, int64_t keep, double threshold) {
    const int64_t B = live_.size(0), K = live_.size(1);
    const at::Tensor live = live_.to(at::kFloat).contiguous(), live_index = live_index_.to(at::kLong).contiguous();
    const at::Tensor anc = anc_.to(at::kBool).contiguous(), seen = seen_.to(at::kFloat).contiguous();
    TORCH_CHECK(anc.dim() == 3 && anc.size(0) == B && anc.size(1) == K && anc.size(2) % K == 0 &&
                    x.size(0) == B * K && tokens.numel() == B * K && (int64_t)base.size() == B &&
                    scratch.numel() == B * K && seen.size(0) == B && j >= 1 && j * K <= anc.size(2),
                "draft_level: x [B K, h], tokens [B K], live / live_index [B, K], anc [B, K, L K], seen [B, n], "
                "base [B], scratch [B K], 1 <= j <= L");
    const int64_t L = anc.size(2) / K, tree_cols = L * K, done = (j - 1) * K;
    const int64_t max_base = *std::max_element(base.begin(), base.end()), width = max_base + j * K;
    TORCH_CHECK(kv_slots.size(0) == B && kv_slots.size(1) >= width, "draft_level: kv_slots [B, max(base) + j K]");
    const uint8_t* ap = static_cast<const uint8_t*>(anc.data_ptr());
    at::Tensor mask = at::zeros({B, 1, K, width}, x.options().dtype(at::kBool));
    uint8_t* mp = static_cast<uint8_t*>(mask.data_ptr());
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < K; i++) {
            uint8_t* row = mp + (b * K + i) * width;
            memset(row, 1, base[b]);
            memcpy(row + base[b], ap + (b * K + i) * tree_cols, done);
            row[base[b] + done + i] = 1;  // itself
        }
    const at::Tensor out = decoder_layer(
        x, linears, norm1, norm2, eps, cos, sin, k_buf, v_buf, scratch.to(at::kLong).reshape({B * K}),
        kv_slots.narrow(1, 0, width), mask, heads, attn_scale, at::embedding(embed, tokens.reshape({B * K})),
        embed_norm, amx_from);  // [B K, h]
    const auto [probs_, ids_] = draft_topk(out, head_norm, head_eps, head_linear, noise.has_value() ? 1.0 : rank_scale,
                                           K, to_target, rank_amx_from, noise, inv_temps, K, allowed);
    const float* pp = probs_.data_ptr<float>();
    const int64_t* ip = ids_.data_ptr<int64_t>();
    const float* lp = live.data_ptr<float>();
    const int64_t* lip = live_index.data_ptr<int64_t>();
    const int64_t count = seen.size(1);
    at::Tensor scores = at::empty({B, K * K}, live.options()), level_tokens = at::empty({B, K * K}, ids_.options());
    at::Tensor parents = at::empty({B, K * K}, ids_.options());
    at::Tensor next_live = at::empty({B, K}, live.options()), next_index = at::empty({B, K}, ids_.options());
    float* sp = scores.data_ptr<float>();
    float* nlp = next_live.data_ptr<float>();
    int64_t *tp = level_tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>();
    int64_t* nip = next_index.data_ptr<int64_t>();
    std::vector<int64_t> order(K * K), branch(B * K), child(B * K);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t l = 0; l < K; l++)
            for (int64_t c = 0; c < K; c++) {
                const int64_t n = l * K + c;
                sp[b * K * K + n] = lp[b * K + l] * pp[(b * K + l) * K + c];
                tp[b * K * K + n] = ip[(b * K + l) * K + c];
                pa[b * K * K + n] = lip[b * K + l];
            }
        const float* s = sp + b * K * K;
        for (int64_t n = 0; n < K * K; n++) order[n] = n;
        std::stable_sort(order.begin(), order.end(), [s](int64_t a, int64_t c) { return s[a] > s[c]; });
        for (int64_t i = 0; i < K; i++) {
            nip[b * K + i] = count + order[i];
            nlp[b * K + i] = s[order[i]];
            branch[b * K + i] = b * K + order[i] / K;
            child[b * K + i] = order[i] % K;
        }
    }
    const at::Tensor next_seen = at::cat({seen, scores}, 1);
    if (j == L) {  // no level after: no next hidden states, tokens or ancestors
        return {at::empty({0}, x.options()), at::empty({0}, ids_.options()), next_live, next_index,
                at::empty({0}, mask.options()), next_seen, scores, level_tokens, parents,
                at::ones({1}, mask.options())};
    }
    at::Tensor next_tokens = at::empty({B * K}, ids_.options());
    at::Tensor next_anc = at::zeros({B, K, tree_cols}, mask.options());
    int64_t* nt = next_tokens.data_ptr<int64_t>();
    uint8_t* nap = static_cast<uint8_t*>(next_anc.data_ptr());
    for (int64_t r = 0; r < B * K; r++) {
        nt[r] = ip[branch[r] * K + child[r]];
        const int64_t b = r / K, from = branch[r] % K;  // the live branch the new one extends
        memcpy(nap + r * tree_cols, mp + (b * K + from) * width + base[b], done + K);  // its tree row
    }
    const at::Tensor next_x = out.index_select(0, at::from_blob(branch.data(), {B * K}, at::kLong).clone());
    const bool stop = levels_can_stop(next_live, next_seen, keep, threshold);
    return {next_x, next_tokens, next_live, next_index, next_anc, next_seen, scores, level_tokens, parents,
            at::full({1}, stop, mask.options())};
}

// The levels 1 .. L of an EAGLE-3 head's draft tree in one call: draft_level's, from the root's children (root_p /
// root_ids [B, K], all live, hidden [B, h] the root's draft hidden), stopping first where levels_can_stop holds.
// cos / sin [L, B K, 1, D]: each level's rows; scratch [B, L, K]: each level's K and V slots; noise [B, S, V]: each
// request's race noise by level (level j's at [:, j]). -> (scores, tokens, parents) [B, n K K] of the n levels
// drafted, candidate order after level 0's K (parents: candidate indices, level 0's 0 .. K - 1).
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_levels(
    const at::Tensor& root_p, const at::Tensor& root_ids, const at::Tensor& hidden, const at::Tensor& embed,
    const c10::List<std::optional<at::Tensor>>& linears, const at::Tensor& norm1, const at::Tensor& norm2,
    const at::Tensor& embed_norm, double eps, int64_t heads, double attn_scale, int64_t amx_from,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
    const at::Tensor& scratch_,
    const at::Tensor& kv_slots, at::IntArrayRef base, const at::Tensor& head_norm, double head_eps,
    const c10::List<std::optional<at::Tensor>>& head_linear, double rank_scale,
    const std::optional<at::Tensor>& to_target, int64_t rank_amx_from, const std::optional<at::Tensor>& noise,
    const std::optional<at::Tensor>& inv_temps, int64_t keep, double threshold) {
    const int64_t B = root_p.size(0), K = root_p.size(1), L = cos.size(0);
    TORCH_CHECK(root_ids.size(0) == B && root_ids.size(1) == K && hidden.size(0) == B &&
                    (int64_t)base.size() == B && scratch_.dim() == 3 && scratch_.size(0) == B &&
                    scratch_.size(1) == L && scratch_.size(2) == K && cos.size(1) == B * K &&
                    sin.sizes() == cos.sizes(),
                "draft_levels: root [B, K], hidden [B, h], base [B], scratch [B, L, K], cos / sin [L, B K, 1, D]");
    const at::Tensor scratch = scratch_.to(at::kLong).contiguous();
    at::Tensor live = root_p.to(at::kFloat).contiguous(), seen = live;
    at::Tensor live_index = at::arange(K, root_ids.options().dtype(at::kLong)).expand({B, K}).contiguous();
    at::Tensor tokens = root_ids.to(at::kLong).reshape({B * K}).contiguous();  // [B K] the live branches' tokens
    at::Tensor x = hidden.repeat_interleave(K, 0).contiguous();                 // [B K, h] their hidden states
    at::Tensor anc = at::zeros({B, K, L * K}, hidden.options().dtype(at::kBool));
    std::vector<at::Tensor> out_scores, out_tokens, out_parents;
    bool stop = levels_can_stop(live, seen, keep, threshold);
    for (int64_t j = 1; j <= L && !stop; j++) {
        std::optional<at::Tensor> level_noise;
        if (noise.has_value()) level_noise = noise->select(1, j);  // [B, V]
        auto [nx, nt, nl, ni, na, ns, scores, level_tokens, parents, done] = draft_level(
            x, tokens, live, live_index, anc, seen, j, embed, linears, norm1, norm2, embed_norm, eps, heads,
            attn_scale, amx_from, cos.select(0, j - 1), sin.select(0, j - 1), k_buf, v_buf, scratch.select(1, j - 1),
            kv_slots, base, head_norm, head_eps, head_linear, rank_scale, to_target, rank_amx_from, level_noise,
            inv_temps, std::nullopt, keep, threshold);
        x = nx;
        tokens = nt;
        live = nl;
        live_index = ni;
        anc = na;
        seen = ns;
        out_scores.push_back(scores);
        out_tokens.push_back(level_tokens);
        out_parents.push_back(parents);
        stop = done.item<bool>();
    }
    if (out_scores.empty()) {
        const at::Tensor none = at::empty({B, 0}, root_ids.options().dtype(at::kLong));
        return {at::empty({B, 0}, live.options()), none, none.clone()};
    }
    return {at::cat(out_scores, 1), at::cat(out_tokens, 1), at::cat(out_parents, 1)};
}

// The exponential race's winner over one row of probabilities [v] for keys (k1, k2): argmax p[x] / E(x) with torch's
// arithmetic (a float32 division per token; the first index among equal values, as max(dim)), over chunks of ID_GRAIN
// token ids in parallel, reduced in id order
int64_t race_winner(const float* p, int64_t v, int32_t k1, int32_t k2, const int32_t* ids) {
    const int64_t chunks = (v + ID_GRAIN - 1) / ID_GRAIN;
    std::vector<float> best_value(chunks, -INFINITY);
    std::vector<int64_t> best_id(chunks, -1);
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
        std::vector<float> e(ID_GRAIN);
        for (int64_t c = lo; c < hi; c++) {
            const int64_t first = c * ID_GRAIN, m = std::min(ID_GRAIN, v - first);
            race_exponentials(&k1, &k2, 1, ids + first, 0, m, e.data(), m);
            float top = -INFINITY;
            int64_t at = -1;
            for (int64_t j = 0; j < m; j++) {
                const float r = p[first + j] / e[j];
                if (at < 0 || r > top || (r != r && top == top)) {  // NaN wins, as in torch's max
                    top = r;
                    at = first + j;
                }
            }
            best_value[c] = top;
            best_id[c] = at;
        }
    });
    int64_t winner = best_id[0];
    float top = best_value[0];
    for (int64_t c = 1; c < chunks; c++)
        if (best_value[c] > top || (best_value[c] != best_value[c] && top == top)) {
            top = best_value[c];
            winner = best_id[c];
        }
    return winner;
}

// Sampled verification of draft trees by the exponential race in one call: verify.py's verify_greedy over
// race_node_ids, racing only the nodes the walk reaches. From the root, the current node's winner (its depth's keys)
// is the token plain decoding samples there for the request's seed; the first child carrying it is accepted, and the
// walk stops at a node none of whose children does, whose winner is the bonus token.
// probs [B, N, V] float32; tokens, parents, depth [B, N] int64 (parents -1 for the root); num_nodes [B] (nodes past
// a request's count are padding); keys [B, D + 1, 2] int32, column d keying a node of depth d
// -> (accept_len [B], accepted_nodes [B, D + 1], bonus [B], last [B], new_tokens [B, D + 1]) int64, VerifyResult's
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> race_walk(
    const at::Tensor& probs_, const at::Tensor& tokens_, const at::Tensor& parents_, const at::Tensor& depth_,
    const at::Tensor& num_nodes_, const at::Tensor& keys_) {
    const at::Tensor probs = probs_.to(at::kFloat).contiguous(), keys = keys_.to(at::kInt).contiguous();
    const at::Tensor tokens = tokens_.to(at::kLong).contiguous(), parents = parents_.to(at::kLong).contiguous();
    const at::Tensor depth = depth_.to(at::kLong).contiguous(), num_nodes = num_nodes_.to(at::kLong).contiguous();
    const int64_t B = probs.size(0), N = probs.size(1), V = probs.size(2), D1 = keys.size(1);
    TORCH_CHECK(tokens.size(0) == B && tokens.size(1) == N && parents.sizes() == tokens.sizes() &&
                    depth.sizes() == tokens.sizes() && num_nodes.numel() == B && keys.size(0) == B && keys.size(2) == 2,
                "race_walk: probs [B, N, V], tokens / parents / depth [B, N], num_nodes [B], keys [B, D + 1, 2]");
    std::vector<int32_t> ids(V);
    for (int64_t x = 0; x < V; x++) ids[x] = static_cast<int32_t>(x);
    const at::TensorOptions longs = tokens.options();
    at::Tensor accept_len = at::zeros({B}, longs), path = at::full({B, D1}, -1, longs), bonus = at::empty({B}, longs);
    at::Tensor last = at::empty({B}, longs), new_tokens = at::full({B, D1}, -1, longs);
    const float* pp = probs.data_ptr<float>();
    const int32_t* kp = keys.data_ptr<int32_t>();
    const int64_t *tp = tokens.data_ptr<int64_t>(), *pa = parents.data_ptr<int64_t>(), *dp = depth.data_ptr<int64_t>();
    const int64_t* np = num_nodes.data_ptr<int64_t>();
    int64_t *al = accept_len.data_ptr<int64_t>(), *ph = path.data_ptr<int64_t>(), *bo = bonus.data_ptr<int64_t>();
    int64_t *la = last.data_ptr<int64_t>(), *nt = new_tokens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; b++) {
        int64_t cur = 0, accepted = 0;
        ph[b * D1] = 0;
        for (;;) {
            const int64_t d = std::min(dp[b * N + cur], D1 - 1);
            const int32_t* key = kp + (b * D1 + d) * 2;
            const int64_t winner = race_winner(pp + (b * N + cur) * V, V, key[0], key[1], ids.data());
            int64_t next = -1;
            for (int64_t c = 1; c < np[b] && next < 0; c++)
                if (pa[b * N + c] == cur && tp[b * N + c] == winner) next = c;
            if (next < 0 || accepted + 1 >= D1) {
                bo[b] = winner;
                break;
            }
            cur = next;
            nt[b * D1 + accepted] = tp[b * N + cur];
            ph[b * D1 + ++accepted] = cur;
        }
        al[b] = accepted;
        la[b] = cur;
        nt[b * D1 + accepted] = bo[b];
    }
    return {accept_len, path, bonus, last, new_tokens};
}

}  // namespace

TORCH_LIBRARY_IMPL(specserve, CPU, m) {
#ifdef SPECSERVE_OPS_AVX2
    m.impl("avx2_gemm", TORCH_FN(avx2_gemm));
#else
    m.impl("small_gemm", TORCH_FN(small_gemm));
#endif
    m.impl("decoder_layer", TORCH_FN(decoder_layer));
    m.impl("draft_topk", TORCH_FN(draft_topk));
    m.impl("draft_level", TORCH_FN(draft_level));
    m.impl("draft_levels", TORCH_FN(draft_levels));
    m.impl("race_walk", TORCH_FN(race_walk));
    m.impl("tree_attention", TORCH_FN(tree_attention));
    m.impl("int8_gemm", TORCH_FN(int8_gemm));
    m.impl("rms_norm", TORCH_FN(rms_norm));
    m.impl("silu_mul", TORCH_FN(silu_mul));
    m.impl("rope", TORCH_FN(rope));
    m.impl("race_exponentials", TORCH_FN(race_exponentials_op));
    m.impl("kv_store", TORCH_FN(kv_store));
}
