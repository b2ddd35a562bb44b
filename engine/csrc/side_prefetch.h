// Lines a decode step will read soon, asked for by a weight product's threads while the product runs.
//
// At batch sizes past a few rows a decode layer's MLP products are compute-bound and leave memory
// bandwidth idle, while attention over a cold cache waits on memory: one layer's K of one block is a few
// KB and the same sequence's next block is a whole block (every layer) away, so the hardware prefetchers
// cannot run ahead. decode_layers (cpu_ops.cpp) therefore lists the next layer's K and V lines and sets
// them here around the MLP products; the packed int8 and bf16 kernels (cpu_ops.cpp, bf16_dot.cpp) each
// give every thread its share of the lines and ask for a few of them every few K pairs, spread so that a
// thread's share is covered by the end of its share of the product whatever the context length.
//
// Prefetches never touch values, so results are unchanged with or without them.

#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace baton {

struct SideRegions {
  std::vector<std::pair<const char*, int64_t>> regions;  // (first byte, 64-byte lines)
  std::vector<int64_t> first{0};                          // lines before each region; the last: all of them
  int64_t total() const { return first.back(); }
};

// Set by decode_layers around a layer's MLP products (one caller at a time: the engine's step thread);
// read by the products' threads inside their parallel region. Defined in cpu_ops.cpp.
extern const SideRegions* g_side;

// Sets g_side for a scope, and clears it however the scope ends (a product that throws included).
struct SideScope {
  explicit SideScope(const SideRegions* s) { g_side = s; }
  ~SideScope() { g_side = nullptr; }
  SideScope(const SideScope&) = delete;
  SideScope& operator=(const SideScope&) = delete;
};

// One thread's share of the side regions' lines: the share of [0, total) that its channel blocks
// [b0, b1) are of all `blocks`, asked for `per` lines at a time over about `calls` next() calls.
struct SideCursor {
  const SideRegions* side = nullptr;
  int64_t line = 0, end = 0, region = 0, per = 1;
  SideCursor(const SideRegions* s, int64_t b0, int64_t b1, int64_t blocks, int64_t calls) : side(s) {
    if (s == nullptr || blocks <= 0) return;
    line = s->total() * b0 / blocks;
    end = s->total() * b1 / blocks;
    if (line >= end) return;
    region = std::upper_bound(s->first.begin(), s->first.end(), line) - s->first.begin() - 1;
    const int64_t c = std::max<int64_t>(1, calls);
    per = std::max<int64_t>(1, (end - line + c - 1) / c);
  }
  inline void next() {
    for (int64_t i = 0; i < per && line < end; ++i, ++line) {
      while (side->first[region + 1] <= line) ++region;
      __builtin_prefetch(side->regions[region].first + (line - side->first[region]) * 64, 0, 3);
    }
  }
};

// The next() calls a packed kernel's tiles make over channel blocks [b0, b1) of an m-row product with kp
// K pairs: one every fourth K pair of every nb_for(rows) blocks, for each tile of up to 16 rows.
template <typename NbFor>
int64_t side_calls(int64_t m, int64_t kp, int64_t b0, int64_t b1, NbFor nb_for) {
  int64_t calls = 0;
  for (int64_t m0 = 0; m0 < m; m0 += 16) {
    const int64_t nb = nb_for(std::min<int64_t>(16, m - m0));
    calls += (b1 - b0 + nb - 1) / nb * ((kp + 3) / 4);
  }
  return calls;
}

}  // namespace baton
