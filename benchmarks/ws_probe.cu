// What bounds the warp-specialized row kernel (cuda/spmm_xt.cu, SpmmWgmmaXtWsKernel on x [T, K], 2:4): the
// kernel timed alone (CUDA events, median of repetitions after warm-up) in its probe modes, each of which
// removes one part of the work: the products (consumers only wait for and release the stages), the loads
// (the producer arrives without copying after the first STAGES stages, so the products run on real data), the
// epilogue.  The decomposition says whether the load pipeline, the tensor pipe or the epilogue sets the time.  Beside
// the extension's tiles: its metadata by 4-byte cp.async (before session 18) and loaded once (no metadata loads).
// Before timing, every tile's full kernel is checked byte for byte against the first tile's output, each run from a
// y poisoned with 0xff, at 16384 tokens and at a 16-token tail (`mismatches_vs_first`, `bad_poison`: both 0 when
// the outputs agree and every valid value, and nothing past the tail, was written).
//
//   bash benchmarks/ws_probe.sh      # builds this file with nvcc (sm_90a) and writes
//                                    # benchmarks/results/<gpu>/ws_probe.json
//
// Built as its own program (it includes the kernel's source), so none of the probe instantiations reach the
// extension.
#include "../cuda/spmm_xt.cu"
#include "probe_problem.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <utility>
#include <vector>

namespace jaxsparse {
namespace {

using probe_problem::Launcher;
using probe_problem::MedianMs;

template <int BR, int BT, int STAGES, int NWMAX, int PROBE>
ffi::Error Launch(cudaStream_t s, const SpmmXtParams& p) {
  return LaunchWs<__nv_bfloat16, BR, BT, STAGES, true, NWMAX, PROBE>(s, p);
}
struct Mode {
  int probe;
  const char* name;
};

// The probe modes, as PROBE bit sets (cuda/spmm_xt.cu, XtProbe).
constexpr Mode kModes[] = {{0, "full"},
                           {kProbeNoEpilogue, "no epilogue"},
                           {kProbeNoMma | kProbeNoEpilogue, "loads only"},
                           {kProbeNoLoad | kProbeNoEpilogue, "products only"},
                           {kProbeNoLoad | kProbeNoMma, "epilogue only"},
                           {kProbeNoLoad | kProbeNoMma | kProbeNoEpilogue, "barriers only"}};
const char* ModeName(int probe) {
  for (const Mode& m : kModes)
    if (m.probe == (probe & ~kProbeMetaOnce)) return m.name;
  return "?";
}

struct Timed {
  int probe;
  Launcher launch;
};
// The tile in the probe modes PROBES (the first is the full kernel, whose output is checked; 0 but in the "meta
// once" rows).
template <int BR, int BT, int STAGES, int NWMAX, int... PROBES>
std::vector<Timed> Launchers() {
  return {Timed{PROBES, Launch<BR, BT, STAGES, NWMAX, PROBES>}...};
}
constexpr int kNoEpi = kProbeNoEpilogue, kEpiOnly = kProbeNoLoad | kProbeNoMma;

int Main() {
  const int tokens = 16384, reps = 50;
  const int shapes[][2] = {{1024, 4096}, {4096, 1024}};  // (K, R)
  cudaDeviceProp prop;
  PROBE_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(0);
  std::printf("{\"gpu\": \"%s\", \"sms\": %d, \"tokens\": %d, \"reps\": %d, \"spec\": \"2:4\", \"results\": [\n",
              prop.name, prop.multiProcessorCount, tokens, reps);
  bool first = true;
  for (const auto& shape : shapes) {
    const int k = shape[0], rows = shape[1], groups = k / 4;
    probe_problem::RowProblem problem(tokens, k, rows, rng);
    SpmmXtParams p = problem.Params(problem.Device(probe_problem::Random24Metadata(problem.MetaWords(), rng)));
    struct Tile {
      const char* name;
      int br, bt;
      int meta_pairs;  // SpmmXtParams::meta_pairs: the metadata by TMA pairs where they fit, as the extension asks
      std::vector<Timed> launchers;
    };
    // The row kernel's tiles as cuda/spmm_xt.cu's Dispatch launches them (stages as there).  Session 15's variants
    // (Y stored from registers, deferred stores, a ping-pong kernel, 5 stages with the metadata fetched a stage
    // early) are in git history (3928b21, 5f4a2b6).
    constexpr int kAll[] = {0, kNoEpi, kProbeNoMma | kNoEpi, kProbeNoLoad | kNoEpi, kEpiOnly, kEpiOnly | kNoEpi};
    // Session 18: the metadata loads.  ws128x256 takes TMA pairs (MetaPairsFit), ws64x256's odd ring the 4-byte
    // cp.async.  "meta cp.async" is ws128x256 on the 4-byte copies (the extension before session 18); "meta once"
    // loads the first stages' words only (kProbeMetaOnce): its outputs differ, and it times the kernel without
    // metadata loads.
    constexpr int kOnce = kProbeMetaOnce;
    const Tile tiles[] = {
        {"ws128x256", 128, 256, 1, Launchers<128, 256, 4, 256, kAll[0], kAll[1], kAll[2], kAll[3], kAll[4], kAll[5]>()},
        {"ws64x256", 64, 256, 1, Launchers<64, 256, 5, 128, kAll[0], kAll[1], kAll[4]>()},
        {"ws128x256 meta cp.async", 128, 256, 0, Launchers<128, 256, 4, 256, kAll[0], kAll[1], kAll[2]>()},
        {"ws128x256 meta once", 128, 256, 1,
         Launchers<128, 256, 4, 256, kOnce | kAll[0], kOnce | kAll[1], kOnce | kAll[2]>()}};
    // Correctness: every tile's full kernel against the first one's output, byte for byte, each from a y poisoned
    // with 0xff, at all tokens and at a tail (tokens - 24: 16-token remainder of the last 256-token tile; the
    // rows past it must stay poisoned).
    // WS_PROBE_TILES=N runs the first N tiles only (all by default).
    const char* limit = std::getenv("WS_PROBE_TILES");
    const size_t n_tiles = limit != nullptr ? std::min<size_t>(std::strtoul(limit, nullptr, 10), std::size(tiles))
                                            : std::size(tiles);
    std::vector<unsigned char> ref, got;
    long long mismatches[std::size(tiles)] = {}, poisoned[std::size(tiles)] = {};
    for (const int t : {tokens, tokens - 24}) {
      p.tokens = t;
      for (size_t i = 0; i < n_tiles; ++i) {
        p.meta_pairs = tiles[i].meta_pairs;
        problem.RunPoisoned(tiles[i].launchers[0].launch, p, i == 0 ? ref : got);
        const size_t valid = static_cast<size_t>(t) * rows * 2;
        for (size_t b = 0; b + 1 < problem.ybytes; b += 2) {
          const unsigned char* v = (i == 0 ? ref : got).data() + b;
          if (b < valid && v[0] == 0xff && v[1] == 0xff) ++poisoned[i];  // 0xffff is a NaN: never a product here
          if (b >= valid && !(v[0] == 0xff && v[1] == 0xff)) ++poisoned[i];  // written past the tail
          if (i > 0 && (v[0] != ref[b] || v[1] != ref[b + 1])) ++mismatches[i];
        }
      }
    }
    p.tokens = tokens;
    // Bytes the SMs take in: x once per feature tile, the compressed values once per token tile.
    for (size_t ti = 0; ti < n_tiles; ++ti) {
      const Tile& tile = tiles[ti];
      const int br = tile.br, bt = tile.bt;
      p.meta_pairs = tile.meta_pairs;
      const double bytes = 2.0 * tokens * k * (rows / br) + 2.0 * rows * (2.0 * groups) * ((tokens + bt - 1) / bt);
      for (const Timed& timed : tile.launchers) {
        const float ms = MedianMs(timed.launch, p, reps);
        std::printf("%s  {\"K\": %d, \"N\": %d, \"tile\": \"%s\", \"mode\": \"%s\", \"probe\": %d, \"ms\": %.5f, "
                    "\"operand_bytes\": %.0f, \"intake_TBps\": %.3f, \"mismatches_vs_first\": %lld, "
                    "\"bad_poison\": %lld}",
                    first ? "" : ",\n", k, rows, tile.name, ModeName(timed.probe), timed.probe, ms, bytes,
                    (timed.probe & kProbeNoLoad) ? 0.0 : bytes / (ms * 1e-3) / 1e12, mismatches[ti], poisoned[ti]);
        first = false;
        std::fflush(stdout);
      }
    }
  }
  std::printf("\n]}\n");
  return 0;
}

}  // namespace
}  // namespace jaxsparse

int main() { return jaxsparse::Main(); }
