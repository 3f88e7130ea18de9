// What the row-kernel probes (benchmarks/ws_probe.cu, benchmarks/rs_probe.cu) share: a 2:4 problem of
// cuda/spmm_xt.cu's row kernel with random operands on the device, one launch into a poisoned y, and the median
// time of a launcher.  Include after cuda/spmm_xt.cu.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "probe_timing.cuh"

namespace jaxsparse {
namespace probe_problem {

using Launcher = ffi::Error (*)(cudaStream_t, const SpmmXtParams&);

// One launch on the default stream; a failed launch prints its message and ends the program.
inline void LaunchOrExit(Launcher launch, const SpmmXtParams& p) {
  if (ffi::Error e = launch(nullptr, p); e.failure()) {
    std::fprintf(stderr, "launch failed: %s\n", e.message().c_str());
    std::exit(1);
  }
}

// Random 2:4 metadata words: 8 groups of (i0, i1), i0 < i1, per word.
inline std::vector<uint32_t> Random24Metadata(size_t words, std::mt19937& rng) {
  const uint32_t pairs[6] = {0x4, 0x8, 0xc, 0x9, 0xd, 0xe};  // i1 << 2 | i0
  std::vector<uint32_t> out(words);
  for (auto& w : out) {
    w = 0;
    for (int g = 0; g < 8; ++g) w |= pairs[rng() % 6] << (4 * g);
  }
  return out;
}

template <typename V>
void* ToDevice(const std::vector<V>& host) {
  void* dev = nullptr;
  PROBE_CHECK(cudaMalloc(&dev, host.size() * sizeof(V)));
  PROBE_CHECK(cudaMemcpy(dev, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice));
  return dev;
}

// x [tokens, k] and the compressed values [rows, k / 2] (bf16 in [1, 2) and thereabouts, so no product is NaN and
// 0xffff marks an unwritten output), y [tokens, rows]; 2:4 (v = 1, m = 4, no column table).  Metadata buffers are the
// caller's (Params).
struct RowProblem {
  int tokens, k, rows, groups;
  void *dx, *dv, *dy;
  size_t ybytes;
  std::vector<void*> owned;  // metadata buffers made by Device()

  RowProblem(int tokens_, int k_, int rows_, std::mt19937& rng)
      : tokens(tokens_), k(k_), rows(rows_), groups(k_ / 4), ybytes(static_cast<size_t>(tokens_) * rows_ * 2) {
    std::vector<uint16_t> hx(static_cast<size_t>(tokens) * k), hv(static_cast<size_t>(rows) * 2 * groups);
    std::uniform_int_distribution<int> bits(0x3c00, 0x3f80);
    for (auto& v : hx) v = static_cast<uint16_t>(bits(rng));
    for (auto& v : hv) v = static_cast<uint16_t>(bits(rng));
    dx = ToDevice(hx);
    dv = ToDevice(hv);
    PROBE_CHECK(cudaMalloc(&dy, ybytes));
  }
  RowProblem(const RowProblem&) = delete;
  RowProblem& operator=(const RowProblem&) = delete;
  ~RowProblem() {
    cudaFree(dx);
    cudaFree(dv);
    cudaFree(dy);
    for (void* m : owned) cudaFree(m);
  }
  size_t MetaWords() const { return static_cast<size_t>(rows) * groups / 8; }
  // A metadata buffer on the device, freed with the problem.
  const uint32_t* Device(const std::vector<uint32_t>& words) {
    owned.push_back(ToDevice(words));
    return static_cast<const uint32_t*>(owned.back());
  }
  SpmmXtParams Params(const uint32_t* meta) const {
    SpmmXtParams p{};
    p.xt = dx;
    p.values = dv;
    p.meta = meta;
    p.cols = nullptr;
    p.bias = nullptr;
    p.y = dy;
    p.tokens = tokens;
    p.k = k;
    p.rows = rows;
    p.groups = groups;
    p.v = 1;
    p.m = 4;
    p.meta_pairs = 1;  // as the extension asks (SpmmXtImpl)
    p.x_blocks = 1;    // one block: x [T, K]
    return p;
  }
  // One launch into y poisoned with 0xff; y's bytes into `out`.
  void RunPoisoned(Launcher launch, const SpmmXtParams& p, std::vector<unsigned char>& out) const {
    out.resize(ybytes);
    PROBE_CHECK(cudaMemset(dy, 0xff, ybytes));
    LaunchOrExit(launch, p);
    PROBE_CHECK(cudaDeviceSynchronize());
    PROBE_CHECK(cudaMemcpy(out.data(), dy, ybytes, cudaMemcpyDeviceToHost));
  }
};

// Median milliseconds of `launch` (probe_timing::MedianEventMs; the warm-up launches are checked).
inline float MedianMs(Launcher launch, const SpmmXtParams& p, int reps) {
  return probe_timing::MedianEventMs([&] { LaunchOrExit(launch, p); }, [&] { (void)launch(nullptr, p); }, reps);
}

}  // namespace probe_problem
}  // namespace jaxsparse
