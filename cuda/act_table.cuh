// The feed-forward epilogue's activation table (bf16): GELU and its derivative looked up by the bf16 code of the
// pre-activation z instead of computed.
//
// Why: a feed-forward block's first product writes act(z) and act'(z) from its epilogue (act_mode 1 and 2,
// cuda/spmm_xt.cu).  Computed in float32 (ActivateWithGrad: erff, __expf and a dozen more operations, about 45
// instructions an element with the conversions), that math is about as long as the stores it feeds: at BERT-large's FFN
// in (16384 x 4096) it is about 0.1 ms of issue time on the H100, and act_mode 1 took 0.11 ms longer than the plain
// product (0.244 against 0.132 ms, session 29) where its extra 128 MB of stores explain 0.04 ms.  z is rounded to
// bf16 before the activation either way, so act(z) and act'(z) are functions of 65536 codes; where they are not
// trivial they are read from a table in shared memory (ActGradBf16 in mma_common.cuh does the lookup):
//
//   code range (bf16 magnitude)          act(z), act'(z)
//   |z| < 2^-4                           Taylor polynomials in float32 (through z^4 and z^3)
//   2^-4 <= z < 4                        table (768 codes)
//   -16 < z <= -2^-4                     table (1024 codes)
//   z >= 4                               z, 1
//   z <= -16                             -0, 0
//   NaN or infinite                      NaN, NaN
//
// Every row of that table is the correctly rounded bf16 of the exact function, for both GELUs: each polynomial and
// each limit gives the correctly rounded bf16 of the exact function at every code of its range (checked over all
// 65536 codes in float64, docs/kernel-notes.md, session 30), so outputs may differ from the float32 formula only
// where the formula itself is off by an ulp.  The table (7 KB per activation) is computed at compile time here, in
// double precision, lives in global memory, and a kernel copies it to shared memory once per CTA (LoadActTable).
// Included by cuda/spmm_xt.cu only (the table is one copy per translation unit).
#pragma once

#include <cstdint>

#include "mma_common.cuh"

namespace jaxsparse {
namespace act_table_detail {

// Double-precision math that a constant expression can use (C++17 constexpr: no <cmath>).  Series stop before their
// terms underflow: a constant expression may not raise a floating-point exception.
constexpr double Exp(double x) {
  constexpr double kLn2 = 0.6931471805599453;
  int n = static_cast<int>(x / kLn2 + (x >= 0 ? 0.5 : -0.5));
  const double r = x - n * kLn2;  // |r| <= ln 2 / 2
  double term = 1.0, sum = 1.0;
  for (int i = 1; i < 24; ++i) {
    term *= r / i;
    sum += term;
    if (term < 1e-30 && term > -1e-30) break;
  }
  for (; n > 0; --n) sum *= 2.0;
  for (; n < 0; ++n) sum *= 0.5;
  return sum;
}

constexpr double kSqrtPi = 1.7724538509055159;

// erfc(x) for x >= 0: the Maclaurin series of erf below 2.5, the continued fraction of erfc above.
constexpr double Erfc(double x) {
  if (x < 2.5) {
    double term = x, sum = x;
    for (int n = 1; n < 80; ++n) {
      term *= -x * x / n;
      sum += term / (2 * n + 1);
      if (term < 1e-30 && term > -1e-30) break;
    }
    return 1.0 - 2.0 / kSqrtPi * sum;
  }
  double f = x;  // x + (1/2) / (x + 1 / (x + (3/2) / (x + ...))), from the tail
  for (int k = 120; k >= 1; --k) f = x + (0.5 * k) / f;
  return Exp(-x * x) / kSqrtPi / f;
}

// The standard normal CDF.
constexpr double Phi(double z) {
  return z < 0 ? 0.5 * Erfc(-z * 0.7071067811865476) : 1.0 - 0.5 * Erfc(z * 0.7071067811865476);
}

// 1 + tanh(u) and 1 - tanh(u), each without cancellation: 2 / (1 + e^(-2u)) and 2 / (1 + e^(2u)).
constexpr double OnePlusTanh(double u) { return 2.0 / (1.0 + Exp(-2.0 * u)); }
constexpr double OneMinusTanh(double u) { return 2.0 / (1.0 + Exp(2.0 * u)); }

// The bf16 code nearest to v (ties to even), subnormals included.  v finite and below bf16's largest value.
constexpr uint32_t Bf16(double v) {
  const uint32_t sign = v < 0 ? 0x8000u : 0u;
  double a = v < 0 ? -v : v;
  if (a == 0.0) return sign;
  int e = 0;
  while (a >= 2.0) a *= 0.5, ++e;
  while (a < 1.0) a *= 2.0, --e;
  // the value in units of the last stored bit: 2^(e - 7), or 2^-133 below the normal range (e < -126)
  double scaled = e < -126 ? a : (a - 1.0) * 128.0;
  for (int s = e; s < -126 && scaled != 0.0; ++s) scaled *= 0.5;  // a 2^e in units of 2^-126 ...
  if (e < -126) scaled *= 128.0;                                  // ... then of 2^-133
  uint32_t m = static_cast<uint32_t>(scaled);
  const double rest = scaled - m;
  if (rest > 0.5 || (rest == 0.5 && (m & 1u))) ++m;
  if (e < -126) return sign | m;  // 128 is the smallest normal's code, as it should be
  if (m == 128) m = 0, ++e;
  return sign | (static_cast<uint32_t>(e + 127) << 7) | m;
}

// The value of a finite, normal bf16 code.
constexpr double FromBf16(uint32_t code) {
  double v = 1.0 + (code & 0x7Fu) / 128.0;
  for (int e = static_cast<int>((code >> 7) & 0xFFu) - 127; e > 0; --e) v *= 2.0;
  for (int e = static_cast<int>((code >> 7) & 0xFFu) - 127; e < 0; ++e) v *= 0.5;
  return (code & 0x8000u) ? -v : v;
}

struct alignas(16) Tables {  // 16-byte rows: LoadActTable copies them by cp.async
  uint32_t words[2][kActTableEntries];  // [activation - 1][entry]: act(z) | act'(z) << 16, as bf16 codes
};

constexpr Tables MakeTables() {
  Tables t{};
  for (int i = 0; i < kActTableEntries; ++i) {
    const double z = FromBf16(ActTableCode(i));
    // 1: GELU, tanh approximation (GeluTanh); 2: GELU, x Phi(x).
    constexpr double k0 = 0.7978845608028654, k1 = 0.044715;
    const double u = k0 * (z + k1 * z * z * z), plus = OnePlusTanh(u), minus = OneMinusTanh(u);
    t.words[0][i] = Bf16(0.5 * z * plus) |
                    (Bf16(0.5 * plus + 0.5 * z * plus * minus * k0 * (1.0 + 3.0 * k1 * z * z)) << 16);
    const double cdf = Phi(z), pdf = Exp(-0.5 * z * z) * 0.3989422804014327;
    t.words[1][i] = Bf16(z * cdf) | (Bf16(cdf + z * pdf) << 16);
  }
  return t;
}

}  // namespace act_table_detail

namespace {
__device__ const act_table_detail::Tables kActTables = act_table_detail::MakeTables();
}  // namespace

// Copies the table of `activation` (1 or 2, as the epilogue's attribute) to shared memory at `dst` (16-byte aligned,
// kActTableBytes) by cp.async from `threads` threads (this one is `thread`); the caller commits and waits.
__device__ __forceinline__ void LoadActTable(uint32_t dst, int activation, int thread, int threads) {
  const unsigned char* src = reinterpret_cast<const unsigned char*>(kActTables.words[activation - 1]);
  for (int i = thread; i < kActTableBytes / 16; i += threads) CpAsync16(dst + 16 * i, src + 16 * i, 16);
}

}  // namespace jaxsparse
