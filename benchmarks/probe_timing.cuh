// What the standalone CUDA probes (benchmarks/ws_probe.cu, benchmarks/sddmm_gather_probe.cu) share: exit on a
// CUDA error, and the median time of a launch measured with CUDA events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define PROBE_CHECK(x)                                                                             \
  do {                                                                                            \
    cudaError_t st_ = (x);                                                                        \
    if (st_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(st_));   \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace probe_timing {

// Median over `reps` back-to-back launches of `launch()` on the default stream (one event between consecutive
// launches), after `warmup()` has run 10 times; each returns nothing and enqueues its work.
template <typename Warmup, typename Launch>
float MedianEventMs(Warmup warmup, Launch launch, int reps) {
  for (int i = 0; i < 10; ++i) warmup();
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) PROBE_CHECK(cudaEventCreate(&e));
  PROBE_CHECK(cudaEventRecord(ev[0], nullptr));
  for (int i = 0; i < reps; ++i) {
    launch();
    PROBE_CHECK(cudaEventRecord(ev[i + 1], nullptr));
  }
  PROBE_CHECK(cudaEventSynchronize(ev[reps]));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) PROBE_CHECK(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2];
}

}  // namespace probe_timing
