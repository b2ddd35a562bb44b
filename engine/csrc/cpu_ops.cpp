// Baton's CPU kernels: the per-layer elementwise work of a decode step fused into single passes, and
// varlen paged decode attention that reads each sequence's own blocks (no gather, no padding).
//
// Registered as torch ops under `baton::` (loaded by engine/cpu_ops.py, which compiles this file once per
// machine with -march=native). Every op has a torch reference in engine/cpu_ops.py that the tests compare
// against, in fp32 and bf16. Math is done in fp32 and rounded once to the tensor's dtype.
//
// Shapes: T tokens, H query heads, KVH KV heads, D head dim, NB cache blocks, BS tokens per block.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "side_prefetch.h"

namespace baton {
const SideRegions* g_side = nullptr;
// engine/csrc/bf16_dot.cpp: bf16 rows times weights packed for AVX512-BF16 dot products.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                       bool fp32_out);
}  // namespace baton

namespace {

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(at::BFloat16* p, float v) { *p = static_cast<at::BFloat16>(v); }  // round to nearest even

// exp(x) for x <= ~88, written so the compiler vectorizes it (std::exp is a scalar libm call): 2^n * p(f)
// with n = round(x / ln 2) and a degree-6 polynomial on the remainder; relative error ~2e-7.
#pragma omp declare simd
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float f = x - n * 0.693145752f - n * 1.42860677e-6f;
  float p = 1.3981999e-3f;
  p = p * f + 8.3334519e-3f;
  p = p * f + 4.1665795e-2f;
  p = p * f + 1.6666665e-1f;
  p = p * f + 5.0000001e-1f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#define BATON_DISPATCH(dtype, NAME, ...)                                          \
  [&] {                                                                           \
    if ((dtype) == at::kFloat) {                                                  \
      using scalar_t = float;                                                     \
      return __VA_ARGS__();                                                       \
    }                                                                             \
    TORCH_CHECK((dtype) == at::kBFloat16, NAME ": float32 or bfloat16 only, got ", (dtype)); \
    using scalar_t = at::BFloat16;                                                \
    return __VA_ARGS__();                                                         \
  }()

// One row: out = r * rsqrt(mean(r^2) + eps) * w, r given in fp32.
template <typename T>
inline void norm_row(const float* r, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += r[i] * r[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) store(out + i, r[i] * inv * load(w + i));
}

// out[T, n] = rms_norm(x[T, n]) * w
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && w.is_contiguous(), "rms_norm: layout");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), "rms_norm: one dtype");
  const int64_t t = x.size(0), n = x.size(1), xs = x.stride(0);
  BATON_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      std::vector<float> r(n);
      for (int64_t row = b; row < e; ++row) {
        for (int64_t i = 0; i < n; ++i) r[i] = load(xp + row * xs + i);
        norm_row(r.data(), wp, op + row * n, n, static_cast<float>(eps));
      }
    });
  });
}

// residual += x, then x = rms_norm(residual) * w; in place. The residual stream is fp32 whatever x's
// dtype: it carries every layer's sum, where bf16 rounding would add up over 30+ layers.
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && w.is_contiguous(), "add_rms_norm: layout");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && w.scalar_type() == x.scalar_type(), "add_rms_norm: fp32 residual");
  const int64_t t = x.size(0), n = x.size(1);
  BATON_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    float* rp = residual.data_ptr<float>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        scalar_t* xr = xp + row * n;
        float* rr = rp + row * n;
        for (int64_t i = 0; i < n; ++i) rr[i] += load(xr + i);
        norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

// out[T, I] = silu(gu[:, :I]) * gu[:, I:]
void silu_and_mul(at::Tensor& out, const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && out.is_contiguous() && out.scalar_type() == gu.scalar_type(),
              "silu_and_mul: layout");
  const int64_t t = gu.size(0), n = gu.size(1) / 2, gs = gu.stride(0);
  BATON_DISPATCH(gu.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gu.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 4, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const scalar_t* g = gp + row * gs;
        const scalar_t* u = g + n;
        scalar_t* o = op + row * n;
        _Pragma("omp simd")  // (a #pragma cannot stand inside a macro argument)
        for (int64_t i = 0; i < n; ++i) {
          const float gv = load(g + i);
          store(o + i, gv / (1.f + fast_exp(-gv)) * load(u + i));
        }
      }
    });
  });
}

// Rotate-half RoPE on q [T, H, D] and k [T, KVH, D] in place (strided views into the qkv output), then
// k and v [T, KVH, D] into their cache slots. cos/sin [P, D/2] fp32 tables, positions/slots [T] int64.
void rope_and_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& positions, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous(), "rope_and_cache: layout");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
              k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "rope_and_cache: q, k, v and the caches in one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && positions.scalar_type() == at::kLong &&
              slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong,
              "rope_and_cache: tables fp32, positions and slots int64");
  const int64_t t = q.size(0), h = q.size(1), kvh = k.size(1), d = q.size(2), half = d / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* blk = slot_blocks.data_ptr<int64_t>();
  const int64_t* off = slot_offsets.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  BATON_DISPATCH(q.scalar_type(), "rope_and_cache", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    auto rotate = [&](scalar_t* x, const float* c, const float* s) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(x + i), x2 = load(x + half + i);
        store(x + i, x1 * c[i] - x2 * s[i]);
        store(x + half + i, x2 * c[i] + x1 * s[i]);
      }
    };
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const float* c = cp + pos[row] * half;
        const float* s = sp + pos[row] * half;
        for (int64_t head = 0; head < h; ++head) rotate(qp + row * q.stride(0) + head * q.stride(1), c, s);
        for (int64_t head = 0; head < kvh; ++head) {
          scalar_t* kr = kp + row * k.stride(0) + head * k.stride(1);
          rotate(kr, c, s);
          const scalar_t* vr = vp + row * v.stride(0) + head * v.stride(1);
          scalar_t* kdst = kc + blk[row] * k_cache.stride(0) + off[row] * k_cache.stride(1) + head * k_cache.stride(2);
          scalar_t* vdst = vc + blk[row] * v_cache.stride(0) + off[row] * v_cache.stride(1) + head * v_cache.stride(2);
          std::memcpy(kdst, kr, d * sizeof(scalar_t));
          std::memcpy(vdst, vr, d * sizeof(scalar_t));
        }
      }
    });
  });
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes (GCC does not vectorize the scalar one: its std::nearbyint has no SIMD clone).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
  __m512 p = _mm512_set1_ps(1.3981999e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// Softmax's two passes over n scores: s[i] = e^(s[i] - max); returns the sum, stores the max.
inline float exp_shifted(float* s, int64_t n, float* max_out) {
#if defined(__AVX512F__)
  const int64_t n16 = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - n16)) - 1u);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = lowest;
  for (int64_t i = 0; i < n16; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
  if (tail) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(lowest, tail, s + n16));
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n16; i += 16) {
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmx));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail) {
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + n16), vmx));
    _mm512_mask_storeu_ps(s + n16, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  *max_out = mx;
  return _mm512_reduce_add_ps(vsum);
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = fast_exp(s[i] - mx);
    sum += s[i];
  }
  *max_out = mx;
  return sum;
#endif
}

// Calls fn(p, row) for context positions lo .. lo + n - 1 (p counts from 0), walking the block table
// block by block: no division per position.
template <typename T, typename Fn>
inline void for_each_row(const int64_t* table, int64_t lo, int64_t n, int64_t bs, int64_t block_stride,
                         int64_t row_stride, const T* base, Fn&& fn) {
  int64_t p = 0;
  for (int64_t blk = lo / bs, off = lo % bs; p < n; ++blk, off = 0) {
    const T* rows = base + table[blk] * block_stride;
    for (; off < bs && p < n; ++off, ++p) fn(p, rows + off * row_stride);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Asks for a block's rows (elements contiguous from `base`) ahead of use, one cache line at a time.
template <typename T>
inline void prefetch_block(const T* base, int64_t count) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t i = 0; i < count * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// Lane t of the result is the sum of a[t]'s 16 lanes: 16 horizontal sums in 45 instructions, where
// 16 `_mm512_reduce_add_ps` take about 130 (a serial chain of extracts and adds each).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (row 2i, row 2i+1) partial sums, two each
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: rows 4i .. 4i+3, that lane's share of each
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Lane k of the result must be the sum of c[k]'s four lanes: a 4 x 4 transpose of 128-bit lanes.
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

#if defined(__AVX512BF16__)
// Pass 1 of a span in bf16 on a CPU with AVX512-BF16: the scores of up to 16 context positions at a time
// for each head, q . k by `vdpbf16ps` straight from the bf16 rows (each product exact in fp32, fp32
// sums: the products the fp32 widening computes, summed in another order), then 16 sums at once.
template <int64_t HD>
void span_scores_bf16(const at::BFloat16* q, int64_t qs_head, int64_t nh, int64_t g, const at::BFloat16* kp,
                      const int64_t* table, int64_t lo, int64_t n, int64_t bs, int64_t kb, int64_t kt, int64_t kh,
                      float scale, float* sc, const at::BFloat16* vp, int64_t vb, int64_t vt) {
  constexpr int64_t W = HD / 32;  // 32 bf16 per register
  const int64_t kvh = nh / g;
  const __m512 vscale = _mm512_set1_ps(scale);
  // The next block's K rows (into L1) and V rows (into L2, for pass 2) are asked for a share at a time
  // between the heads' products: one burst of a whole block's lines stalls on L1's fill buffers (perf
  // put 38% of this pass on the prefetch loop), spread out they overlap the products.
  const int64_t klines = bs * kt * static_cast<int64_t>(sizeof(at::BFloat16)) / 64;
  const int64_t vlines = bs * vt * static_cast<int64_t>(sizeof(at::BFloat16)) / 64;
  const int64_t heads = kvh * g;
  int64_t p = 0;
  for (int64_t blk = lo / bs, off = lo % bs; p < n; ++blk, off = 0) {
    const int64_t cnt = std::min(bs - off, n - p);
    const at::BFloat16* kbase = kp + table[blk] * kb + off * kt;
    const bool ahead = p + cnt < n;
    const char* next_k = ahead ? reinterpret_cast<const char*>(kp + table[blk + 1] * kb) : nullptr;
    const char* next_v = ahead ? reinterpret_cast<const char*>(vp + table[blk + 1] * vb) : nullptr;
    int64_t asked = 0;
    for (int64_t t0 = 0; t0 < cnt; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, cnt - t0);
      const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
      for (int64_t x = 0; x < kvh; ++x) {
        for (int64_t j = 0; j < g; ++j) {
          const int64_t hd = x * g + j;
          if (ahead && t0 == 0)
            for (const int64_t until = (hd + 1) * (klines + vlines) / heads; asked < until; ++asked) {
              if (asked < klines) _mm_prefetch(next_k + asked * 64, _MM_HINT_T0);
              else _mm_prefetch(next_v + (asked - klines) * 64, _MM_HINT_T1);
            }
          __m512bh qv[W];
          for (int64_t c = 0; c < W; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + hd * qs_head + c * 32);
          __m512 acc[16];
          for (int64_t t = 0; t < 16; ++t) {
            acc[t] = _mm512_setzero_ps();
            if (t >= m) continue;
            const at::BFloat16* kr = kbase + (t0 + t) * kt + x * kh;
            for (int64_t c = 0; c < W; ++c)
              acc[t] = _mm512_dpbf16_ps(acc[t], qv[c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
          }
          _mm512_mask_storeu_ps(sc + hd * n + p + t0, keep, _mm512_mul_ps(sum_lanes16(acc), vscale));
        }
      }
    }
    p += cnt;
  }
}

// Pass 2 of a span in bf16 with AVX512-BF16: part[h][0 .. HD) = sum_p w_p v_p, two positions per
// `vdpbf16ps` (their V rows interleaved, their weights a bf16 pair), with w = e^(s - m) rounded to bf16
// as flash attention rounds P before P.V; the sums stay fp32, and so does the softmax denominator.
// The interleave leaves the accumulators' columns permuted within each 32-column group; they are put
// back in order once, at the end of the span.
template <int64_t HD>
void span_values_bf16(int64_t nh, int64_t g, const at::BFloat16* vp, const int64_t* table, int64_t lo, int64_t n,
                      int64_t bs, int64_t vb, int64_t vt, int64_t vh, const float* sc, uint16_t* wb, float* part) {
  constexpr int64_t W = HD / 32;
  constexpr int64_t JB = W <= 2 ? 4 : 2;  // heads per pass over V: JB * 2W accumulators in registers
  const int64_t kvh = nh / g;
  for (int64_t h = 0; h < nh; ++h) {  // the weights in bf16, n per head
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + h * n + i),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + h * n + i)));
    for (; i < n; ++i) wb[h * n + i] = c10::BFloat16(sc[h * n + i]).x;
  }
  for (int64_t x = 0; x < kvh; ++x) {
    for (int64_t j0 = 0; j0 < g; j0 += JB) {
      const int64_t gj = std::min<int64_t>(JB, g - j0);
      __m512 acc[JB][2 * W];
      for (int64_t j = 0; j < JB; ++j)
        for (int64_t c = 0; c < 2 * W; ++c) acc[j][c] = _mm512_setzero_ps();
      int64_t p = 0;
      for (int64_t blk = lo / bs, off = lo % bs; p < n; ++blk, off = 0) {
        const int64_t cnt = std::min(bs - off, n - p);
        const at::BFloat16* vbase = vp + table[blk] * vb + off * vt + x * vh;
        for (int64_t t = 0; t < cnt; t += 2) {
          const bool pair = t + 1 < cnt;  // an odd last row pairs with itself at weight 0
          const at::BFloat16* r0 = vbase + t * vt;
          const at::BFloat16* r1 = pair ? r0 + vt : r0;
          __m512i mix[2 * W];
          for (int64_t c = 0; c < W; ++c) {
            const __m512i a = _mm512_loadu_si512(r0 + c * 32), b = _mm512_loadu_si512(r1 + c * 32);
            mix[2 * c] = _mm512_unpacklo_epi16(a, b);
            mix[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
          }
          for (int64_t j = 0; j < gj; ++j) {
            const uint16_t* wj = wb + (x * g + j0 + j) * n + p + t;
            const uint32_t w2 = static_cast<uint32_t>(wj[0]) | (pair ? static_cast<uint32_t>(wj[1]) << 16 : 0u);
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2));
            for (int64_t c = 0; c < 2 * W; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], wv, (__m512bh)mix[c]);
          }
        }
        p += cnt;
      }
      for (int64_t j = 0; j < gj; ++j) {
        float* out = part + (x * g + j0 + j) * (HD + 2);
        for (int64_t c = 0; c < W; ++c) {
          // lo holds columns {0-3, 8-11, 16-19, 24-27} of this group, hi {4-7, 12-15, 20-23, 28-31}.
          const __m512 lo_ = acc[j][2 * c], hi_ = acc[j][2 * c + 1];
          const __m512 first = _mm512_shuffle_f32x4(lo_, hi_, _MM_SHUFFLE(1, 0, 1, 0));
          const __m512 second = _mm512_shuffle_f32x4(lo_, hi_, _MM_SHUFFLE(3, 2, 3, 2));
          _mm512_storeu_ps(out + c * 32, _mm512_shuffle_f32x4(first, first, _MM_SHUFFLE(3, 1, 2, 0)));
          _mm512_storeu_ps(out + c * 32 + 16, _mm512_shuffle_f32x4(second, second, _MM_SHUFFLE(3, 1, 2, 0)));
        }
      }
    }
  }
}
#endif

// The AVX-512 form, for head dims that are a multiple of 16: one work item is a span of n context
// positions of one sequence, all its heads, walked block by block so that each block's K (then V) rows
// of every head are read once, contiguously. It leaves unnormalized partial results for the merge:
// part[h] = (sum_p e^(s_p - m) v_p [HD floats], m, sum_p e^(s_p - m)).
template <typename T, int64_t HD>
void attend_span_avx512(const T* q, int64_t qs_head, int64_t nh, int64_t g, const T* kp, const T* vp,
                        const int64_t* table, int64_t lo, int64_t n, int64_t bs, int64_t kb, int64_t kt,
                        int64_t kh, int64_t vb, int64_t vt, int64_t vh, float scale, float* part,
                        std::vector<float>& buf) {
  constexpr int64_t V = HD / 16;
  constexpr int64_t JB = V <= 4 ? 4 : 2;  // heads per V pass: JB * V accumulators + V rows in registers
  const int64_t kvh = nh / g;
  buf.resize(nh * HD + nh * n + (nh * n + 1) / 2);  // q, scores, the bf16 weights of pass 2
  float* qf = buf.data();  // [nh][HD], scaled
  float* sc = qf + nh * HD;  // [nh][n]
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < HD; ++i) qf[h * HD + i] = load(q + h * qs_head + i) * scale;
  // Pass 1: scores, block by block.
  int64_t p = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && HD % 32 == 0) {
    span_scores_bf16<HD>(q, qs_head, nh, g, kp, table, lo, n, bs, kb, kt, kh, scale, sc, vp, vb, vt);
    p = n;  // the loop below has nothing left to do
  }
#endif
  for (int64_t blk = lo / bs, off = lo % bs; p < n; ++blk, off = 0) {
    const int64_t cnt = std::min(bs - off, n - p);
    const T* kbase = kp + table[blk] * kb + off * kt;
    if (p + cnt < n) prefetch_block(kp + table[blk + 1] * kb, bs * kt);  // DRAM latency hides behind this block
    for (int64_t x = 0; x < kvh; ++x) {
      for (int64_t t = 0; t < cnt; ++t) {
        const T* kr = kbase + t * kt + x * kh;
        __m512 kv[V];
        for (int64_t c = 0; c < V; ++c) kv[c] = load16(kr + c * 16);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf + (x * g + j) * HD;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
          for (int64_t c = 1; c < V; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + c * 16), kv[c], acc);
          sc[(x * g + j) * n + p + t] = _mm512_reduce_add_ps(acc);
        }
      }
    }
    p += cnt;
  }
  // Softmax statistics of the span, per head; the scores become e^(s - m).
  for (int64_t h = 0; h < nh; ++h) {
    float mx;
    const float sum = exp_shifted(sc + h * n, n, &mx);
    float* out = part + h * (HD + 2);
    std::fill(out, out + HD, 0.f);
    out[HD] = mx;
    out[HD + 1] = sum;
  }
  // Pass 2: weighted V rows, block by block; each block's accumulators live in registers.
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && HD % 32 == 0) {
    span_values_bf16<HD>(nh, g, vp, table, lo, n, bs, vb, vt, vh, buf.data() + nh * HD,
                         reinterpret_cast<uint16_t*>(buf.data() + nh * HD + nh * n), part);
    return;
  }
#endif
  p = 0;
  for (int64_t blk = lo / bs, off = lo % bs; p < n; ++blk, off = 0) {
    const int64_t cnt = std::min(bs - off, n - p);
    const T* vbase = vp + table[blk] * vb + off * vt;
    if (p + cnt < n) prefetch_block(vp + table[blk + 1] * vb, bs * vt);
    for (int64_t x = 0; x < kvh; ++x) {
      for (int64_t j0 = 0; j0 < g; j0 += JB) {
        const int64_t gj = std::min<int64_t>(JB, g - j0);
        __m512 acc[JB][V];
        for (int64_t j = 0; j < gj; ++j)
          for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_loadu_ps(part + (x * g + j0 + j) * (HD + 2) + c * 16);
        for (int64_t t = 0; t < cnt; ++t) {
          const T* vr = vbase + t * vt + x * vh;
          __m512 vv[V];
          for (int64_t c = 0; c < V; ++c) vv[c] = load16(vr + c * 16);
          for (int64_t j = 0; j < gj; ++j) {
            const __m512 w = _mm512_set1_ps(sc[(x * g + j0 + j) * n + p + t]);
            for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_fmadd_ps(w, vv[c], acc[j][c]);
          }
        }
        for (int64_t j = 0; j < gj; ++j)
          for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(part + (x * g + j0 + j) * (HD + 2) + c * 16, acc[j][c]);
      }
    }
    p += cnt;
  }
}
#endif

// One (sequence, KV head) work item of decode attention: its G query heads over n context positions.
// HD is the head dim when known at compile time (64, 128: fully unrolled SIMD), else 0 (runtime d).
template <typename T, int64_t HD>
void attend_item(const T* q, int64_t qh, const T* kp, const T* vp, const int64_t* table, int64_t lo, int64_t n,
                 int64_t bs, int64_t kb, int64_t kt, int64_t vb, int64_t vt, int64_t g, int64_t d_rt, float scale,
                 T* out, int64_t oh, std::vector<float>& buf) {
  const int64_t d = HD > 0 ? HD : d_rt;
  buf.resize(g * d * 2 + g * n + d);
  float* qf = buf.data();
  float* acc = qf + g * d;
  float* scores = acc + g * d;
  float* row = scores + g * n;
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < d; ++i) qf[j * d + i] = load(q + j * qh + i) * scale;
  for_each_row(table, lo, n, bs, kb, kt, kp, [&](int64_t p, const T* kr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) row[i] = load(kr + i);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qf + j * d;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qj[i] * row[i];
      scores[j * n + p] = s;
    }
  });
  for (int64_t j = 0; j < g; ++j) {
    float* sc = scores + j * n;
    float mx;
    const float inv = 1.f / exp_shifted(sc, n, &mx);
#pragma omp simd
    for (int64_t p = 0; p < n; ++p) sc[p] *= inv;
  }
  std::fill(acc, acc + g * d, 0.f);
  for_each_row(table, lo, n, bs, vb, vt, vp, [&](int64_t p, const T* vr) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) row[i] = load(vr + i);
    for (int64_t j = 0; j < g; ++j) {
      const float w = scores[j * n + p];
      float* a = acc + j * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += w * row[i];
    }
  });
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < d; ++i) store(out + j * oh + i, acc[j * d + i]);
}

#if defined(__AVX512F__)
template <typename T>
using SpanFn = void (*)(const T*, int64_t, int64_t, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*,
                        std::vector<float>&);

// Splits every sequence's context into spans of about the same length (long ones into several, so
// that one long context spreads over the threads), attends the spans in parallel (dynamic schedule),
// then merges each sequence's spans by their softmax statistics (flash-decoding's log-sum-exp merge).
template <typename T>
void split_attention(SpanFn<T> span_fn, T* op, const T* qp, int64_t qs, int64_t qh, int64_t nseq, int64_t nh,
                     int64_t g, int64_t d, const T* kp, const T* vp, const int64_t* tab, int64_t tab_stride,
                     const int64_t* lens, int64_t window, int64_t bs, int64_t kb, int64_t kt, int64_t kh, int64_t vb,
                     int64_t vt, int64_t vh, float scale) {
  struct Span { int64_t seq, lo, n; };
  std::vector<int64_t> first(nseq + 1);
  int64_t total = 0;
  for (int64_t s = 0; s < nseq; ++s) total += lens[s] - (window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t span = std::max<int64_t>(2 * bs, (total + 4 * threads - 1) / (4 * threads));
  span = (span + bs - 1) / bs * bs;
  std::vector<Span> spans;
  for (int64_t s = 0; s < nseq; ++s) {
    first[s] = static_cast<int64_t>(spans.size());
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
    for (int64_t a = lo; a < lens[s]; a += span) spans.push_back({s, a, std::min(span, lens[s] - a)});
  }
  first[nseq] = static_cast<int64_t>(spans.size());
  const int64_t stride = nh * (d + 2);
  std::vector<float> parts(spans.size() * stride);
  const int64_t num_spans = static_cast<int64_t>(spans.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_spans; ++i) {
      const Span& sp = spans[i];
      span_fn(qp + sp.seq * qs, qh, nh, g, kp, vp, tab + sp.seq * tab_stride, sp.lo, sp.n, bs, kb, kt, kh, vb, vt,
              vh, scale, parts.data() + i * stride, buf);
    }
  }
  at::parallel_for(0, nseq, 4, [&](int64_t b, int64_t e) {
    std::vector<float> acc(d);
    for (int64_t s = b; s < e; ++s) {
      for (int64_t h = 0; h < nh; ++h) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[s]; i < first[s + 1]; ++i) mx = std::max(mx, parts[i * stride + h * (d + 2) + d]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t i = first[s]; i < first[s + 1]; ++i) {
          const float* pt = parts.data() + i * stride + h * (d + 2);
          const float w = std::exp(pt[d] - mx);
          sum += w * pt[d + 1];
          for (int64_t c = 0; c < d; ++c) acc[c] += w * pt[c];
        }
        const float inv = 1.f / sum;
        for (int64_t c = 0; c < d; ++c) store(op + (s * nh + h) * d + c, acc[c] * inv);
      }
    }
  });
}
#endif

// Decode attention, one query token per sequence: sequence b attends over its own ctx_lens[b] positions
// (the last `window` of them when window > 0) through block_tables[b]. Work is proportional to the sum of
// the context lengths: one work item per (sequence, KV head), its G = H / KVH query heads together, so
// each K and V row is read once. out [B, H, D] contiguous, q [B, H, D] strided; caches [NB, BS, KVH, D]
// strided; tables [B, W] int64.
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& ctx_lens, double scale, int64_t window) {
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous() && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: layout");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "paged_decode_attention: q, out and the caches in one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong &&
              block_tables.stride(1) == 1, "paged_decode_attention: int64 tables and lengths");
  const int64_t nseq = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2), g = h / kvh;
  TORCH_CHECK(h % kvh == 0, "paged_decode_attention: H must be a multiple of KVH");
  const int64_t* tab = block_tables.data_ptr<int64_t>();
  const int64_t tab_stride = block_tables.stride(0);
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), nb = k_cache.size(0);
  TORCH_CHECK(block_tables.size(0) == nseq && ctx_lens.size(0) == nseq, "paged_decode_attention: one table per sequence");
  for (int64_t s = 0; s < nseq; ++s) {  // a wrong table would read outside the cache: refuse it
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * bs, "paged_decode_attention: context length out of range");
    for (int64_t i = 0; i < (lens[s] + bs - 1) / bs; ++i)
      TORCH_CHECK(tab[s * tab_stride + i] >= 0 && tab[s * tab_stride + i] < nb, "paged_decode_attention: block id out of range");
  }
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t qs = q.stride(0), qh = q.stride(1);
  BATON_DISPATCH(q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
#if defined(__AVX512F__)
    if (d == 64 || d == 128) {
      split_attention<scalar_t>(d == 64 ? &attend_span_avx512<scalar_t, 64> : &attend_span_avx512<scalar_t, 128>,
                                op, qp, qs, qh, nseq, h, g, d, kp, vp, tab, tab_stride, lens, window, bs, kb, kt, kh,
                                vb, vt, vh, static_cast<float>(scale));
      return;
    }
#endif
    at::parallel_for(0, nseq * kvh, 1, [&](int64_t b, int64_t e) {
      std::vector<float> buf;
      for (int64_t item = b; item < e; ++item) {
        const int64_t seq = item / kvh, head = item % kvh;
        const int64_t len = lens[seq];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        attend_item<scalar_t, 0>(qp + seq * qs + head * g * qh, qh, kp + head * kh, vp + head * vh,
                                 tab + seq * tab_stride, lo, len - lo, bs, kb, kt, vb, vt, g, d,
                                 static_cast<float>(scale), op + (seq * h + head * g) * d, d, buf);
      }
    });
  });
}

}  // namespace


// ---------------------------------------------------------------------------------------------------
// The whole decoder stack of a decode-only step in one call: per layer add+norm, qkv, RoPE + cache
// write, varlen attention, o, add+norm, gate_up, SiLU x up, down — the same ops the Python model calls,
// in the same order, without a Python frame per op. Weights come per layer as 14 tensors: the two norm
// weights, then (weight, bias, scales) for qkv, o, gate_up and down; `kind` says how the projections
// multiply: 0 plain (at::linear), 1 oneDNN-packed bf16, 2 int8 weight-only, 3 bf16 packed for AVX512-BF16
// dot products (engine/csrc/bf16_dot.cpp; N a multiple of 16, an fp32 bias).
namespace {

// The side prefetch of engine/csrc/side_prefetch.h: the next layer's KV lines, asked for while a
// layer's MLP products run (the packed int8 and bf16 kernels). Measured on a Zen 4 EPYC, 2 threads,
// decode steps of ~128-170 tokens timed in turn with and without in one process: batch 16 int8
// 20.6 -> 19.5 ms, bf16 26.6-26.8 -> 25.7-26.1 ms; the 2k row's ratio int8 1.22 -> 1.20, bf16
// 1.13-1.17 -> 1.12-1.14. A first form, one line every fourth K pair whatever the context, reached
// about 70% of the lines at batch 16 (40% with a 2k request) and gained half as much there (20.3 -> 19.8
// ms, int8 only); the cursor now spreads each thread's share over its calls.
using baton::SideCursor;
using baton::SideRegions;
using baton::SideScope;

// Whether decode_layers asks for the next layer's KV (baton::set_side_prefetch; on by default): a switch
// for benchmarks that time steps with and without it in one process.
std::atomic<bool> g_side_prefetch{true};

int64_t set_side_prefetch(int64_t on) { return g_side_prefetch.exchange(on != 0) ? 1 : 0; }

// The K and V lines of the blocks that `tables` and `lens` give each sequence (the last `window`
// positions' blocks when window > 0), in one layer's caches.
void side_kv_regions(SideRegions& out, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                     const at::Tensor& lens, int64_t window) {
  const int64_t nseq = tables.size(0), ts = tables.stride(0), bs = kc.size(1), esz = kc.element_size();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(kc.data_ptr());
  const char* vp = static_cast<const char*>(vc.data_ptr());
  const int64_t klines = (bs * kc.stride(1) * esz + 63) / 64, vlines = (bs * vc.stride(1) * esz + 63) / 64;
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t i = window > 0 ? std::max<int64_t>(0, len[s] - window) / bs : 0; i < (len[s] + bs - 1) / bs; ++i) {
      const int64_t b = tab[s * ts + i];
      out.regions.emplace_back(kp + b * kc.stride(0) * esz, klines);
      out.first.push_back(out.first.back() + klines);
      out.regions.emplace_back(vp + b * vc.stride(0) * esz, vlines);
      out.first.push_back(out.first.back() + vlines);
    }
}

// ---------------------------------------------------------------------------------------------------
// int8 weight-only linear for the few rows of a decode step: out[M, N] = (x[M, K] @ q[N, K]^T) * s[N].
//
// Decode multiplies a handful of rows by every weight once, so the time is the weight bytes read from
// memory. torch's `_weight_int8pack_mm` reaches about half the read bandwidth here; this kernel widens
// each int8 weight to fp32 in registers (never materialising a dequantized copy) and multiplies it into
// up to 16 rows at once, so a weight byte is read once per step. Rows are converted to fp32 first (x
// is small: M x K). Each thread owns a contiguous range of output channels and streams CB of them at
// a time; accumulation is fp32 over the whole K, rounded once to the output dtype.
#if defined(__AVX512F__)
template <int MT, int CB, typename T>
void int8_rows(const float* xf, int64_t m_rows, int64_t k, const int8_t* q, const T* scales, int64_t n0, int64_t n1,
               T* out, int64_t n_total) {
  const int64_t k16 = k / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - k16)) - 1u);
  for (int64_t n = n0; n < n1; n += CB) {
    const int cb = static_cast<int>(std::min<int64_t>(CB, n1 - n));
    const int8_t* rows[CB];
    for (int c = 0; c < CB; ++c) rows[c] = q + (n + std::min(c, cb - 1)) * k;
    // Row tiles of MT share the CB weight rows while they are in L1 (CB x K bytes).
    for (int64_t m0 = 0; m0 < m_rows; m0 += MT) {
      const int mt = static_cast<int>(std::min<int64_t>(MT, m_rows - m0));
      const float* xt = xf + m0 * k;
      __m512 acc[MT][CB];
      for (int m = 0; m < MT; ++m)
        for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_setzero_ps();
      for (int64_t i = 0; i < k16; i += 16) {
        __m512 w[CB];
        for (int c = 0; c < CB; ++c)
          w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + i))));
        for (int m = 0; m < MT; ++m) {
          if (m >= mt) break;
          const __m512 xv = _mm512_loadu_ps(xt + m * k + i);
          for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_fmadd_ps(xv, w[c], acc[m][c]);
        }
      }
      if (tail) {
        __m512 w[CB];
        for (int c = 0; c < CB; ++c)
          w[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, rows[c] + k16)));
        for (int m = 0; m < MT; ++m) {
          if (m >= mt) break;
          const __m512 xv = _mm512_maskz_loadu_ps(tail, xt + m * k + k16);
          for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_fmadd_ps(xv, w[c], acc[m][c]);
        }
      }
      for (int m = 0; m < mt; ++m)
        for (int c = 0; c < cb; ++c)
          store(out + (m0 + m) * n_total + n + c, _mm512_reduce_add_ps(acc[m][c]) * load(scales + n + c));
    }
  }
}
#endif

// Scalar fallback (a CPU without AVX-512): the same sums, in the same fp32.
template <typename T>
void int8_rows_scalar(const float* xf, int64_t m_rows, int64_t k, const int8_t* q, const T* scales, int64_t n0,
                      int64_t n1, T* out, int64_t n_total) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < m_rows; ++m) {
      float s = 0.f;
      const int8_t* row = q + n * k;
      const float* xr = xf + m * k;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < k; ++i) s += xr[i] * static_cast<float>(row[i]);
      store(out + m * n_total + n, s * load(scales + n));
    }
}

constexpr int64_t kInt8MaxRows = 16;
// Rows up to which the one-call decode stack multiplies packed int8 weights with int8_linear rather than
// dequantizing them for at::linear (int8_set_kernel_max_rows; engine/linear.py probes it per machine).
std::atomic<int64_t> g_int8_kernel_max_rows{kInt8MaxRows};
constexpr int64_t kI8Lanes = 16;  // output channels per packed block (int32 lanes of a zmm register)

// The packed form, for bf16 rows on a CPU with AVX512-VNNI (and BF16): the weights packed once like
// bf16_dot.cpp's, [ceil(N/16), ceil(K/2), 16, 2] int8, so one 32-byte load holds the next K pair of 16
// channels and each thread reads one contiguous stream; each row quantized to int16 with one fp32 scale
// (x / max|x| * 16383: 15 bits at the row's largest value, finer than bf16's 8-bit mantissa); the weights
// sign-extended to int16 in registers and `vpdpwssd` adding a broadcast pair of the row times a pair of
// 16 channels into 16 int32 sums — no horizontal sum, every weight load used by every row of the tile.
// 2 * 127 * 16383 * 512 < 2^31: the int32 sums are flushed to fp32 every 512 pairs, so no K overflows.
// The row-major form above widens each weight to fp32 (two instructions per 16 weights and a horizontal
// sum per channel). Measured on a Zen 5 EPYC, 2 threads, 30 different 3072x576 weights (53 MB, out of
// cache): 1 row 4.9 -> 1.7 ms, 4 rows 6.4 -> 1.9, 8 rows 9.3 -> 2.7, 16 rows 18.8 -> 4.7 ms.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BATON_I8_PACKED 1
constexpr float kI8ActMax = 16383.f;
constexpr int64_t kI8FlushPairs = 512;
// How far ahead each weight stream is prefetched, in bytes: the hardware prefetchers alone left a cold
// one-row product at 25 GB/s and the 16-row one 60% slower than from cache (measured, Zen 5, 2 threads;
// 4 KB ahead: 32 GB/s, and 16 rows as fast as from cache).
constexpr int64_t kI8PrefetchBytes = 4096;

inline __m512 i8_load_bf16(const at::BFloat16* p, __mmask16 mask) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// r[i] (16 rows of 16 32-bit words) becomes its transpose: r[c] holds column c of the rows, row i in lane i.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i a[16];
  for (int k = 0; k < 8; ++k) {  // within each 128-bit lane: the two rows' words interleaved
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  __m512i g[4][4];  // g[j][q], lane L: column 4L + q of rows 4j .. 4j + 3
  for (int j = 0; j < 4; ++j) {
    g[j][0] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
    g[j][1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
    g[j][2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
    g[j][3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // lane L of g[0..3][q] side by side: column 4L + q, all 16 rows
    const __m512i lo01 = _mm512_shuffle_i32x4(g[0][q], g[1][q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi01 = _mm512_shuffle_i32x4(g[0][q], g[1][q], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i lo23 = _mm512_shuffle_i32x4(g[2][q], g[3][q], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi23 = _mm512_shuffle_i32x4(g[2][q], g[3][q], _MM_SHUFFLE(3, 2, 3, 2));
    r[q] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + q] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + q] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + q] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The tile's rows quantized and transposed: xt[p * mt + r] holds row r's pair p as two int16 (the low
// half the even column); xs[r] the row's scale. Past K the pair is zero.
//
// Vectorised end to end: |x| and its max 16 columns at a time; x * (1 / scale) rounded to nearest even
// by vcvtps2dq (as std::nearbyint in the default rounding mode: the same integers) and narrowed to int16,
// which leaves each even and odd column side by side as one 32-bit pair; then 16 x 16 blocks of pairs
// transposed in registers. The scalar form ran serially on the step thread for ~2.4 ms of a batch-16
// int8 step (perf), the other thread waiting.
void i8_quantize_tile(const at::BFloat16* x, int64_t k, int64_t kp, int mt, uint32_t* xt, float* xs) {
  const int64_t kpad = (kp + 15) / 16 * 16;  // pairs per row in `rows`, whole blocks of 16
  thread_local std::vector<uint32_t> rows;
  if (rows.size() < static_cast<size_t>(16 * kpad)) rows.resize(static_cast<size_t>(16 * kpad));
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  auto cols = [k](int64_t i) {  // the columns of [i, i + 16) inside K
    return k - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << std::max<int64_t>(0, k - i)) - 1u);
  };
  for (int r = 0; r < mt; ++r) {
    const at::BFloat16* row = x + r * k;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __m512i bits = _mm512_castps_si512(i8_load_bf16(row + i, cols(i)));
      const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(bits, abs_mask));
      vmax = _mm512_max_ps(a, vmax);  // a NaN is passed over (the second operand wins), as std::max did
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float scale = amax > 0.f ? amax / kI8ActMax : 1.f;
    xs[r] = scale;
    const __m512 inv = _mm512_set1_ps(1.f / scale);
    uint32_t* out = rows.data() + r * kpad;
    for (int64_t i = 0; i < 2 * kpad; i += 16) {  // columns past K load as zero
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(i8_load_bf16(row + i, cols(i)), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i / 2), _mm512_cvtsepi32_epi16(q));
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << mt) - 1u);
  for (int64_t p0 = 0; p0 < kp; p0 += 16) {
    __m512i block[16];
    for (int r = 0; r < 16; ++r)
      block[r] = r < mt ? _mm512_loadu_si512(rows.data() + r * kpad + p0) : _mm512_setzero_si512();
    transpose16x16_epi32(block);
    for (int64_t j = 0; j < std::min<int64_t>(16, kp - p0); ++j)
      _mm512_mask_storeu_epi32(xt + (p0 + j) * mt, valid, block[j]);
  }
}

// MT rows times channel blocks b0 .. b1 - 1, NB blocks at a time (MT x NB int32 accumulators).
template <int MT, int NB>
void i8_tile(const uint32_t* xt, const float* xs, int64_t kp, int64_t m0, const int8_t* wp, int64_t b0, int64_t b1,
             const at::BFloat16* scales, at::BFloat16* out, int64_t n, SideCursor& side) {
  for (int64_t b = b0; b < b1; b += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, b1 - b));
    const int8_t* wb[NB];
    for (int j = 0; j < NB; ++j) wb[j] = wp + (b + std::min(j, nb - 1)) * kp * 2 * kI8Lanes;
    alignas(64) float sums[MT][NB][kI8Lanes] = {};  // in memory: the registers hold the int32 sums
    for (int64_t pc = 0; pc < kp; pc += kI8FlushPairs) {
      const int64_t pe = std::min(kp, pc + kI8FlushPairs);
      __m512i acc[MT][NB];
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
      for (int64_t p = pc; p < pe; ++p) {
        __m512i w[NB];
        if ((p & 1) == 0) {
          for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wb[j] + p * 2 * kI8Lanes + kI8PrefetchBytes), _MM_HINT_T0);
          if ((p & 3) == 0) side.next();
        }
        for (int j = 0; j < NB; ++j)
          w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[j] + p * 2 * kI8Lanes)));
        const uint32_t* xp = xt + p * MT;
        for (int m = 0; m < MT; ++m) {
          const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[m]));
          for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpwssd_epi32(acc[m][j], xv, w[j]);
        }
      }
      for (int m = 0; m < MT; ++m)
        for (int j = 0; j < NB; ++j)
          _mm512_store_ps(sums[m][j], _mm512_add_ps(_mm512_load_ps(sums[m][j]), _mm512_cvtepi32_ps(acc[m][j])));
    }
    for (int j = 0; j < nb; ++j) {
      const int64_t c0 = (b + j) * kI8Lanes, left = n - c0;
      const __mmask16 mask = left >= kI8Lanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
      const __m512 sc = i8_load_bf16(scales + c0, mask);
      for (int m = 0; m < MT; ++m) {
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(sums[m][j]), _mm512_set1_ps(xs[m])), sc);
        _mm256_mask_storeu_epi16(out + (m0 + m) * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

// Channel blocks per tile: 4 for 1-2 rows, 2 for 3-4, one from 5 up (measured: more blocks per tile made
// 6-12 rows up to 1.8x slower, where 16 rows of one block keep vpdpwssd busy).
constexpr int64_t i8_blocks_for(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

template <int MT>
void i8_run_tile(const uint32_t* xt, const float* xs, int64_t kp, int64_t m0, const int8_t* wp, int64_t b0,
                 int64_t b1, const at::BFloat16* scales, at::BFloat16* out, int64_t n, SideCursor& side) {
  constexpr int kNb = static_cast<int>(i8_blocks_for(MT));
  i8_tile<MT, kNb>(xt, xs, kp, m0, wp, b0, b1, scales, out, n, side);
}

using I8TileFn = void (*)(const uint32_t*, const float*, int64_t, int64_t, const int8_t*, int64_t, int64_t,
                          const at::BFloat16*, at::BFloat16*, int64_t, SideCursor&);
constexpr I8TileFn kI8Tiles[16] = {
    i8_run_tile<1>,  i8_run_tile<2>,  i8_run_tile<3>,  i8_run_tile<4>,  i8_run_tile<5>,  i8_run_tile<6>,
    i8_run_tile<7>,  i8_run_tile<8>,  i8_run_tile<9>,  i8_run_tile<10>, i8_run_tile<11>, i8_run_tile<12>,
    i8_run_tile<13>, i8_run_tile<14>, i8_run_tile<15>, i8_run_tile<16>};

at::Tensor int8_packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1), n = scales.size(0), kp = packed.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  at::Tensor xc = x.contiguous();
  const std::unique_ptr<uint32_t[]> xt(new uint32_t[static_cast<size_t>(m * kp)]);  // written whole below
  const std::unique_ptr<float[]> xs(new float[static_cast<size_t>(m)]);
  for (int64_t m0 = 0; m0 < m; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, m - m0));
    i8_quantize_tile(xc.data_ptr<at::BFloat16>() + m0 * k, k, kp, mt, xt.get() + m0 * kp, xs.get() + m0);
  }
  const int8_t* wp = packed.data_ptr<int8_t>();
  const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = packed.size(0);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(4, (blocks + threads - 1) / threads);
  const SideRegions* side = baton::g_side;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    SideCursor cur(side, b0, b1, blocks, baton::side_calls(m, kp, b0, b1, i8_blocks_for));
    for (int64_t m0 = 0; m0 < m; m0 += 16) {
      const int mt = static_cast<int>(std::min<int64_t>(16, m - m0));
      kI8Tiles[mt - 1](xt.get() + m0 * kp, xs.get() + m0, kp, m0, wp, b0, b1, sp, op, n, cur);
    }
  });
  return out;
}
#endif

int64_t int8_set_kernel_max_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "int8_set_kernel_max_rows: rows must be >= 1");
  return g_int8_kernel_max_rows.exchange(rows);
}

bool int8_packed_available() {
#if defined(BATON_I8_PACKED)
  return true;
#else
  return false;
#endif
}

// [N, K] int8 → [ceil(N/16), ceil(K/2), 16, 2]; channels and the column past N and K are zero.
at::Tensor int8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8_pack: q must be a [N, K] int8 tensor");
  const int64_t n = q.size(0), k = q.size(1), blocks = (n + kI8Lanes - 1) / kI8Lanes, kp = (k + 1) / 2;
  at::Tensor padded = at::zeros({blocks * kI8Lanes, kp * 2}, q.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(q);
  return padded.view({blocks, kI8Lanes, kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The packed weights back as [N, K] (a prefill's dequantized product, the tests' reference).
at::Tensor int8_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kI8Lanes && packed.size(3) == 2 && packed.scalar_type() == at::kChar,
              "int8_unpack: weights must come from int8_pack");
  TORCH_CHECK(n > (packed.size(0) - 1) * kI8Lanes && n <= packed.size(0) * kI8Lanes && (k + 1) / 2 == packed.size(1),
              "int8_unpack: n and k do not fit the packed blocks");
  return packed.permute({0, 2, 1, 3}).reshape({packed.size(0) * kI8Lanes, packed.size(1) * 2}).narrow(0, 0, n).narrow(1, 0, k).contiguous();
}

}  // namespace

// out[M, N] = x[M, K] @ (q[N, K] * scales[N])^T for M <= 16 rows; x, scales and out fp32 or bf16, q int8
// — [N, K], or packed by int8_pack (bf16 x and scales, a CPU with AVX512-VNNI: the packed form above).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  if (q.dim() == 4) {
    TORCH_CHECK(int8_packed_available(), "int8_linear: this build has no packed int8 form (AVX512-VNNI)");
    TORCH_CHECK(x.dim() == 2 && scales.dim() == 1, "int8_linear: x [M, K], scales [N]");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.size(2) == kI8Lanes && q.size(3) == 2,
                "int8_linear: packed weights must come from int8_pack");
    const int64_t n = scales.size(0);
    TORCH_CHECK((x.size(1) + 1) / 2 == q.size(1) && n > (q.size(0) - 1) * kI8Lanes && n <= q.size(0) * kI8Lanes,
                "int8_linear: shapes do not match");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
                "int8_linear: packed weights take bf16 rows and contiguous bf16 scales");
#if defined(BATON_I8_PACKED)
    return int8_packed_linear(x, q, scales);
#endif
  }
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 1, "int8_linear: x [M, K], q [N, K], scales [N]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "int8_linear: q must be contiguous int8");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) == k && scales.size(0) == n, "int8_linear: shapes do not match");
  TORCH_CHECK(m <= kInt8MaxRows, "int8_linear: at most ", kInt8MaxRows, " rows, got ", m);
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.is_contiguous(),
              "int8_linear: scales must be contiguous, in x's dtype");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const int8_t* qp = q.data_ptr<int8_t>();
  return BATON_DISPATCH(x.scalar_type(), "int8_linear", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* sp = scales.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // One block of output channels per thread (each a contiguous stretch of q, read once); each converts
    // the few rows of x to fp32 for itself.
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t grain = std::max<int64_t>(16, (n + threads - 1) / threads);
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      std::vector<float> xf(static_cast<size_t>(m * k));
      for (int64_t i = 0; i < m * k; ++i) xf[i] = load(xp + i);
#if defined(__AVX512F__)
      if (m <= 4) int8_rows<4, 4>(xf.data(), m, k, qp, sp, n0, n1, op, n);
      else int8_rows<8, 2>(xf.data(), m, k, qp, sp, n0, n1, op, n);
#else
      int8_rows_scalar(xf.data(), m, k, qp, sp, n0, n1, op, n);
#endif
    });
    return out;
  });
}

namespace {

// An empty tensor stands for "no bias" in the weight list (a Tensor[] cannot hold None).
inline bool present(const at::Tensor& b) { return b.defined() && b.numel() > 0; }

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(present(b) ? c10::IValue(b) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor project(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& b, const at::Tensor& s) {
  if (kind == 1) return packed_linear(x, w, b);
  if (kind == 3) return baton::bf16_linear(x, w, w.size(0) * 16, present(b) ? std::optional<at::Tensor>(b) : std::nullopt, false);
  if (kind == 2) {  // int8 weight-only: as engine/linear.py Int8Linear
    if (x.size(0) <= (w.dim() == 4 ? g_int8_kernel_max_rows.load(std::memory_order_relaxed) : kInt8MaxRows)) {
      at::Tensor out = int8_linear(x, w, s);
      return present(b) ? out + b : out;
    }
    const at::Tensor q = w.dim() == 4 ? int8_unpack(w, s.size(0), x.size(1)) : w;
    at::Tensor out = at::linear(x, q.to(x.scalar_type())) * s;
    return present(b) ? out + b : out;
  }
  return present(b) ? at::linear(x, w, b) : at::linear(x, w);
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x0, at::TensorList weights, int64_t kind, const at::Tensor& positions,
                         const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                         const at::Tensor& ctx_lens, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList k_caches, at::TensorList v_caches, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double eps, double scale, int64_t window) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 14 * num_layers, "decode_layers: 14 weights per layer");
  const int64_t t = x0.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x0;
  at::Tensor residual = x0.to(at::kFloat);
  at::Tensor h = at::empty_like(x0);
  rms_norm(h, x0, weights[0], eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + 14 * l;
    if (l > 0) {
      add_rms_norm(x, residual, w[0], eps);
      h = x;
    }
    at::Tensor qkv = project(h, kind, w[2], w[3], w[4]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    rope_and_cache(q, k, v, cos, sin, positions, kc, vc, slot_blocks, slot_offsets);
    at::Tensor attn = at::empty({t, num_heads, head_dim}, x0.options());
    paged_decode_attention(attn, q, kc, vc, block_tables, ctx_lens, scale, window);
    at::Tensor o = project(attn.view({t, q_size}), kind, w[5], w[6], w[7]);
    add_rms_norm(o, residual, w[1], eps);
    SideRegions next_kv;  // the next layer's KV, asked for while the MLP's products run (packed kernels)
    if ((kind == 2 || kind == 3) && l + 1 < num_layers && g_side_prefetch.load(std::memory_order_relaxed))
      side_kv_regions(next_kv, k_caches[l + 1], v_caches[l + 1], block_tables, ctx_lens, window);
    const SideScope scope(&next_kv);
    at::Tensor gu = project(o, kind, w[8], w[9], w[10]);
    at::Tensor act = at::empty({t, gu.size(1) / 2}, x0.options());
    silu_and_mul(act, gu);
    x = project(act, kind, w[11], w[12], w[13]);
  }
  return (residual + x.to(at::kFloat)).to(x0.scalar_type());
}

// A decode step's projections alone, as decode_layers multiplies them (the same `project` calls, no
// norms, RoPE or attention between them): the floor that benchmarks/step_floor.py holds the step against.
// xs: one input per projection kind, [T, K] for qkv, o, gate_up and down in that order; returns the last
// down projection's output.
at::Tensor project_layers(at::TensorList xs, at::TensorList weights, int64_t kind) {
  TORCH_CHECK(xs.size() == 4 && weights.size() % 14 == 0, "project_layers: 4 inputs and 14 weights per layer");
  at::Tensor out;
  for (size_t l = 0; l < weights.size() / 14; ++l) {
    const at::Tensor* w = weights.data() + 14 * l;
    for (int64_t i = 0; i < 4; ++i) out = project(xs[i], kind, w[2 + 3 * i], w[3 + 3 * i], w[4 + 3 * i]);
  }
  return out;
}

// Structured outputs: sets to -inf every logit of the rows `rows` whose bit in `bitmask` is 0 (a grammar
// engine's mask: int32 words, bit i of word w is token 32 w + i). One pass over the mask, skipping the
// words that allow all 32 tokens; torch's bit unpacking takes milliseconds for a batch of 16.
template <typename T>
void mask_rows(T* logits, int64_t vocab, const uint32_t* words, int64_t num_words, const int64_t* rows, int64_t n) {
  const T ninf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    T* row = logits + rows[i] * vocab;
    const uint32_t* mask = words + rows[i] * num_words;
    for (int64_t w = 0; w < num_words; ++w) {
      const uint32_t word = mask[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, end = std::min<int64_t>(32, vocab - base);
      for (int64_t b = 0; b < end; ++b) {
        if (!((word >> b) & 1u)) row[base + b] = ninf;
      }
    }
  }
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [B, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask must be a contiguous [B, W] int32 tensor");
  TORCH_CHECK(bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bitmask does not cover the logits");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64");
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "row out of range");
  }
  if (logits.scalar_type() == at::kFloat) {
    mask_rows(logits.data_ptr<float>(), logits.size(1), words, bitmask.size(1), r, rows.size(0));
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "logits must be fp32 or bf16");
    mask_rows(logits.data_ptr<at::BFloat16>(), logits.size(1), words, bitmask.size(1), r, rows.size(0));
  }
}

// Greedy sampling: each row's first maximal index, as torch.max(dim=-1).indices gives it (a NaN counts as
// the maximum, the first NaN then). One pass per row, 16 lanes each keeping its best value and index;
// torch's reduction over a [16, 49k] fp32 batch took ~0.37 ms of a ~20 ms decode step here.
int64_t argmax_row(const float* p, int64_t v) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_idx = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 unordered = 0;
  if (v < (int64_t{1} << 31) - 16) {  // lane indices in int32
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) {
      const __m512 x = _mm512_loadu_ps(p + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, gt, x);
      best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    if (unordered == 0) {  // else the scalar pass below finds the first NaN
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, best);
      _mm512_store_si512(bi, best_idx);
      float m = bv[0];
      int64_t at = i > 0 ? bi[0] : -1;
      for (int j = 1; j < 16 && i > 0; ++j)
        if (bv[j] > m || (bv[j] == m && bi[j] < at)) m = bv[j], at = bi[j];
      for (int64_t t = i; t < v; ++t) {  // the tail, after every full lane group (larger indices)
        if (p[t] != p[t]) return t;
        if (at < 0 || p[t] > m) m = p[t], at = t;
      }
      return at;
    }
  }
#endif
  int64_t at = 0;
  float m = p[0];
  if (m != m) return 0;
  for (int64_t i = 1; i < v; ++i) {
    if (p[i] != p[i]) return i;
    if (p[i] > m) m = p[i], at = i;
  }
  return at;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: x must be a [B, V] fp32 tensor with contiguous rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t n = x.size(0), v = x.size(1), rs = x.stride(0);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * rs, v);
  });
  return out;
}

TORCH_LIBRARY(baton, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor w, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gu) -> ()");
  m.def("rope_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_blocks, Tensor slot_offsets) -> ()");
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, float scale, int window) -> ()");
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("int8_pack(Tensor q) -> Tensor");
  m.def("int8_unpack(Tensor packed, int n, int k) -> Tensor");
  m.def("int8_packed_available() -> bool", &int8_packed_available);
  m.def("int8_set_kernel_max_rows(int rows) -> int", &int8_set_kernel_max_rows);
  m.def("set_side_prefetch(int on) -> int", &set_side_prefetch);
  m.def("project_layers(Tensor[] xs, Tensor[] weights, int kind) -> Tensor", &project_layers);
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("decode_layers(Tensor x, Tensor[] weights, int kind, Tensor positions, Tensor slot_blocks, "
        "Tensor slot_offsets, Tensor block_tables, Tensor ctx_lens, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_unpack", &int8_unpack);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_layers", &decode_layers);
}

// oneDNN-packed weights are MkldnnCPU tensors: the weight list then dispatches there.
TORCH_LIBRARY_IMPL(baton, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
