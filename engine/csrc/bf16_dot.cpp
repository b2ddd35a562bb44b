// bf16 weights times bf16 rows with fp32 results, on AVX512-BF16 dot products (vdpbf16ps).
//
// The logits head is the one product whose rounding lands on what is sampled: oneDNN's bf16 linear
// returns bf16, so two logits closer than a bf16 step (1/128 of their size) tie or swap. Measured on the
// default model, teacher-forced against fp32 (64 prompts x 64 positions): the same bf16 weights with fp32
// logits agree 98.7% on the argmax instead of 97.1%, and the int8 twin 95.7% instead of 94.9%. This
// kernel keeps the bf16 weight bytes (the head is read once per step, so its time is the bytes) and
// accumulates in fp32, as the products of two bf16 values are exact in fp32.
//
// Layout: the weight [N, K] is packed once into blocks of 16 output channels, K in pairs:
// packed[N/16][K/2][16][2], so one 64-byte load holds the next pair of K for 16 channels, the operand
// vdpbf16ps multiplies by a row's broadcast pair. Each thread owns a contiguous range of channel blocks.
//
// On a CPU with AMX-BF16 (and K a multiple of 32) the products go through AMX tiles instead, from the
// same packed weights; baton::bf16_set_amx_min_rows picks the rows from which they do (1 by default, 0
// never: the tests run both ways), baton::bf16_amx_available says whether they can.
//
// Registered as baton::bf16_pack and baton::bf16_linear (engine/cpu_ops.py loads this file with
// cpu_ops.cpp); baton::bf16_dot_available says whether this build has the instructions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "side_prefetch.h"
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define BATON_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#endif

namespace {

constexpr int64_t kLanes = 16;  // output channels per block (fp32 lanes of a zmm register)

bool bf16_dot_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N, K] bf16 → [ceil(N/16), K/2, 16, 2] bf16; channels past N are zero.
at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack: w must be a [N, K] bf16 tensor");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "bf16_pack: K must be even, got ", k);
  const int64_t blocks = (n + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({blocks * kLanes, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({blocks, kLanes, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
// MT rows (their K pairs transposed: xt[p * MT + m]) times channel blocks b0 .. b1 - 1, NB blocks at a
// time: MT x NB accumulators, every weight load used by every row of the tile. MT is exact (a template
// argument), so the inner loop has no row test and its broadcasts share one base address.
// Where a tile's sums go: fp32 as they are, or bf16 (rounded to nearest even) with an fp32 bias added first.
struct Store {
  float* f32;           // [M, n] or null
  at::BFloat16* bf16;   // [M, n] or null
  const float* bias;    // [n] or null
  int64_t n;

  void operator()(int64_t row, int64_t c0, __m512 v) const {
    const int64_t left = n - c0;
    const __mmask16 mask = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c0));
    if (f32 != nullptr) {
      _mm512_mask_storeu_ps(f32 + row * n + c0, mask, v);
    } else {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(bf16 + row * n + c0, mask, h);
    }
  }
};

template <int MT, int NB>
void dot_tile(const uint32_t* xt, int64_t kp, int64_t m0, const uint16_t* wp, int64_t b0, int64_t b1, const Store& out,
              baton::SideCursor& side) {
  for (int64_t b = b0; b < b1; b += NB) {
    const int nb = static_cast<int>(std::min<int64_t>(NB, b1 - b));
    __m512 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    const uint16_t* wb[NB];
    for (int j = 0; j < NB; ++j) wb[j] = wp + (b + std::min(j, nb - 1)) * kp * 2 * kLanes;
    for (int64_t p = 0; p < kp; ++p) {
      if ((p & 3) == 0) side.next();
      __m512bh w[NB];
      for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb[j] + p * 2 * kLanes);
      const uint32_t* xp = xt + p * MT;
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m]));
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < nb; ++j) out(m0 + m, (b + j) * kLanes, acc[m][j]);
  }
}

// About 24 accumulators whatever the rows: NB = 4 blocks up to 6 rows, 3 up to 8, 2 up to 12, else 1.
constexpr int64_t blocks_for(int64_t rows) { return rows <= 6 ? 4 : rows <= 8 ? 3 : rows <= 12 ? 2 : 1; }

template <int MT>
void run_tile(const uint32_t* xt, int64_t kp, int64_t m0, const uint16_t* wp, int64_t b0, int64_t b1, const Store& out,
              baton::SideCursor& side) {
  dot_tile<MT, static_cast<int>(blocks_for(MT))>(xt, kp, m0, wp, b0, b1, out, side);
}

using TileFn = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, const Store&,
                        baton::SideCursor&);
constexpr TileFn kTiles[16] = {run_tile<1>,  run_tile<2>,  run_tile<3>,  run_tile<4>, run_tile<5>,  run_tile<6>,
                               run_tile<7>,  run_tile<8>,  run_tile<9>,  run_tile<10>, run_tile<11>, run_tile<12>,
                               run_tile<13>, run_tile<14>, run_tile<15>, run_tile<16>};
#endif

#if defined(BATON_AMX)
// AMX (Sapphire Rapids and later): a tile multiply takes 16 rows x 32 K x 16 channels in one instruction,
// where vdpbf16ps takes one row x 2 K x 16. The packed layout above is already AMX's B-tile layout (K/2
// rows of 16 channel pairs, 64 bytes each), so one tile load takes 32 K of a 16-channel block as stored.
// Linux hands a process the tile registers only on request (arch_prctl); asked once, process-wide.
bool amx_ready() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Rows from which bf16_linear takes the tiles (bf16_set_amx_min_rows; 0 = never).
std::atomic<int64_t> g_amx_min_rows{1};

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2: sums of mt rows x 16 channels (fp32); 3: mt rows x 32 K of x; 4-6: 32 K x 16 channels.
void configure(int mt) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 4 ? mt : 16);
  }
  _tile_loadconfig(&cfg);
}

// NB channel blocks from b for rows m0 .. m0 + mt - 1 (the tiles configured for mt rows); K % 32 == 0.
template <int NB>
void amx_blocks(const at::BFloat16* x, int64_t k, int64_t m0, int mt, const uint16_t* wp, int64_t kp, int64_t b,
                float* sums, const Store& out) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  const at::BFloat16* xa = x + m0 * k;
  const uint16_t* w0 = wp + b * kp * 2 * kLanes;
  const int64_t block_elems = kp * 2 * kLanes;
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    _tile_loadd(3, xa + k0, k * 2);
    const uint16_t* wk = w0 + (k0 / 2) * 2 * kLanes;
    _tile_loadd(4, wk, 64);
    if constexpr (NB > 1) _tile_loadd(5, wk + block_elems, 64);
    if constexpr (NB > 2) _tile_loadd(6, wk + 2 * block_elems, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 3, 5);
    if constexpr (NB > 2) _tile_dpbf16ps(2, 3, 6);
  }
  _tile_stored(0, sums, 64);
  if constexpr (NB > 1) _tile_stored(1, sums + 256, 64);
  if constexpr (NB > 2) _tile_stored(2, sums + 512, 64);
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < mt; ++r) out(m0 + r, (b + j) * kLanes, _mm512_loadu_ps(sums + j * 256 + r * 16));
}

void amx_linear(const at::BFloat16* x, int64_t m, int64_t k, const uint16_t* wp, int64_t kp, int64_t b0, int64_t b1,
                const Store& out) {
  alignas(64) float sums[3 * 256];
  int configured = 0;
  for (int64_t m0 = 0; m0 < m; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, m - m0));
    if (mt != configured) {
      configure(mt);
      configured = mt;
    }
    int64_t b = b0;
    for (; b + 3 <= b1; b += 3) amx_blocks<3>(x, k, m0, mt, wp, kp, b, sums, out);
    if (b1 - b == 2) amx_blocks<2>(x, k, m0, mt, wp, kp, b, sums, out);
    if (b1 - b == 1) amx_blocks<1>(x, k, m0, mt, wp, kp, b, sums, out);
  }
  _tile_release();
}
#endif

}  // namespace

namespace baton {

// out[M, n] = x[M, K] bf16 @ w^T (+ bias), w packed by bf16_pack (n = the unpadded N); fp32 or bf16 out.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                       bool fp32_out) {
  TORCH_CHECK(bf16_dot_available(), "bf16_linear: this build has no AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x must be a [M, K] bf16 tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kLanes && packed.size(3) == 2,
              "bf16_linear: weights must come from bf16_pack");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(k == 2 * kp, "bf16_linear: x has ", k, " columns, the weights ", 2 * kp);
  TORCH_CHECK(n > (blocks - 1) * kLanes && n <= blocks * kLanes, "bf16_linear: n does not fit the packed blocks");
  const bool has_bias = bias.has_value() && bias->defined() && bias->numel() > 0;
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bf16_linear: bias must be a contiguous fp32 [n] tensor");
  at::Tensor out = at::empty({m, n}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (m == 0 || n == 0) return out;
#if defined(__AVX512BF16__)
  at::Tensor xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const Store store{fp32_out ? out.data_ptr<float>() : nullptr, fp32_out ? nullptr : out.data_ptr<at::BFloat16>(),
                    has_bias ? bias->data_ptr<float>() : nullptr, n};
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(4, (blocks + threads - 1) / threads);
#if defined(BATON_AMX)
  const int64_t amx_rows = g_amx_min_rows.load(std::memory_order_relaxed);
  if (k % 32 == 0 && amx_rows > 0 && m >= amx_rows && amx_ready()) {
    const at::BFloat16* xb = xc.data_ptr<at::BFloat16>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { amx_linear(xb, m, k, wp, kp, b0, b1, store); });
    return out;
  }
#endif
  // Each tile's rows transposed once (each K pair's rows side by side), left uninitialised until written.
  const std::unique_ptr<uint32_t[]> xt(new uint32_t[static_cast<size_t>(m * kp)]);
  for (int64_t m0 = 0; m0 < m; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, m - m0));
    uint32_t* tile = xt.get() + m0 * kp;
    for (int64_t p = 0; p < kp; ++p)
      for (int r = 0; r < mt; ++r) tile[p * mt + r] = xp[(m0 + r) * kp + p];
  }
  const baton::SideRegions* side = baton::g_side;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    baton::SideCursor cur(side, b0, b1, blocks, baton::side_calls(m, kp, b0, b1, blocks_for));
    for (int64_t m0 = 0; m0 < m; m0 += 16) {
      const int mt = static_cast<int>(std::min<int64_t>(16, m - m0));
      kTiles[mt - 1](xt.get() + m0 * kp, kp, m0, wp, b0, b1, store, cur);
    }
  });
#endif
  return out;
}

}  // namespace baton

namespace {

bool available() { return bf16_dot_available(); }

bool amx_available() {
#if defined(BATON_AMX)
  return amx_ready();
#else
  return false;
#endif
}

// Sets the rows from which bf16_linear multiplies on AMX tiles (0: never) and returns the previous value.
int64_t set_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "bf16_set_amx_min_rows: rows must be >= 0");
#if defined(BATON_AMX)
  return g_amx_min_rows.exchange(rows);
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("bf16_dot_available() -> bool", &available);
  m.def("bf16_amx_available() -> bool", &amx_available);
  m.def("bf16_set_amx_min_rows(int rows) -> int", &set_amx_min_rows);
  m.def("bf16_pack(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("bf16_pack", &bf16_pack);
  m.impl("bf16_linear", &baton::bf16_linear);
}
