// Two 2:4 forms of a V:2:M weight, each built in one pass: its 2:4 view over K (jaxsparse_as_2_4) and its
// transpose W^T as a 2:4 weight over R (jaxsparse_transpose_2_4, for transposable masks).  Both build the forms of
// up to three weights of one shape and pattern in one launch (further weights as extra operands; ViewInputs), stacked
// as the products that read them take them.
//
// The 2:4 view of a V:2:M weight in one pass (jaxsparse.format.as_2_4 is the reference and documents the
// mapping; docs/format.md, "The 2:4 view"): each group of M columns splits into M/4 quads of 4 that hold at most 2
// of the row's values, so the same matrix is 2:4 over the full K.  The kernels that read x [T, K] as it is (the
// TMA row forward, the SDDMM's tma engine) take any M through it; building it with XLA ops cost 0.05 ms per call
// at 1024x4096 (session 8), about 20x this kernel's bytes at HBM speed.
#include "common.cuh"
#include "handlers.h"

namespace jaxsparse {
namespace {

// Copies BYTES (a multiple of 4) from registers to global memory in 16-, 8- or 4-byte stores (dst aligned so).
template <int BYTES>
__device__ __forceinline__ void StoreVec(void* dst, const void* src) {
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
  } else if constexpr (BYTES % 8 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 8; ++i) static_cast<uint2*>(dst)[i] = static_cast<const uint2*>(src)[i];
  } else {
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) static_cast<uint32_t*>(dst)[i] = static_cast<const uint32_t*>(src)[i];
  }
}

// The weights one call stacks (stacked views, session 59: attention's query, key and value, whose stacked forward reads
// them as one weight): part p (blockIdx.y) writes rows [p R, (p+1) R) of each result, so the views come out
// concatenated along R without an XLA concatenation after them.
constexpr int kViewMaxParts = 3;  // calls.SPMM_STACKED_MAX
struct ViewInputs {               // each part's compressed weight; parts past the last repeat the first (never read)
  const void* values[kViewMaxParts];
  const uint8_t* columns[kViewMaxParts];
  const uint32_t* metadata[kViewMaxParts];
};
struct ViewPart {
  const void* values;
  const uint8_t* columns;
  const uint32_t* metadata;
};
// Part `part`'s pointers, selected by constant indices (an indexed kernel parameter would go through local memory).
__device__ __forceinline__ ViewPart PartOf(const ViewInputs& in, int part) {
  return part == 0   ? ViewPart{in.values[0], in.columns[0], in.metadata[0]}
         : part == 1 ? ViewPart{in.values[1], in.columns[1], in.metadata[1]}
                     : ViewPart{in.values[2], in.columns[2], in.metadata[2]};
}

// One thread per (row r, 32-bit word w of the view's metadata): the word covers quads 8w .. 8w + 7, which are the
// 8/NQ whole groups from 8w/NQ on (NQ = M/4 quads per group divides 8: M in {8, 16, 32}).  Per group, with the
// kept columns c0 < c1 in quads q0 <= q1 at offsets a0, a1 (as format.as_2_4): a quad holding both values stores
// them at slots 0, 1 with positions (a0, a1); a value alone sits in slot 1 at position (0, a), or in slot 0 at
// position (0, 1) when a = 0; an empty quad stores two zeros at positions (0, 1).  slots[r, 2g + i] is where value
// i of group g went in the view's row.  The thread's 16 view values and its slots are assembled in registers
// (every index a compile-time constant) and stored in 16-byte pieces: the first version stored them one 2-byte
// value at a time and took 0.06-0.09 ms at 1024x4096 (session 9, device call 6).
template <typename T, int NQ>
__global__ void As24Kernel(const ViewInputs in, T* __restrict__ values24, uint32_t* __restrict__ meta24,
                           int32_t* __restrict__ slots, int rows, int groups, int v) {
  constexpr int kGroupsPerWord = 8 / NQ;
  const int words24 = groups * NQ / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(rows) * words24) return;
  const ViewPart w_in = PartOf(in, static_cast<int>(blockIdx.y));
  const T* __restrict__ values = static_cast<const T*>(w_in.values);
  const uint8_t* __restrict__ columns = w_in.columns;
  const uint32_t* __restrict__ metadata = w_in.metadata;
  const int64_t out_row0 = static_cast<int64_t>(blockIdx.y) * rows;  // this part's first row in the results
  const int r = static_cast<int>(idx / words24), w = static_cast<int>(idx % words24);
  const int g_first = w * kGroupsPerWord;
  T out[16];
  int32_t slot_out[2 * kGroupsPerWord];
  uint32_t word24 = 0;
#pragma unroll
  for (int gi = 0; gi < kGroupsPerWord; ++gi) {
    const int g = g_first + gi;
    const uint32_t nibble = (metadata[static_cast<int64_t>(r) * (groups / 8) + g / 8] >> (4 * (g % 8))) & 0xF;
    const uint8_t* cols = columns + (static_cast<int64_t>(r / v) * groups + g) * 4;
    const int c0 = cols[nibble & 3], c1 = cols[nibble >> 2];
    const T v0 = values[static_cast<int64_t>(r) * 2 * groups + 2 * g];
    const T v1 = values[static_cast<int64_t>(r) * 2 * groups + 2 * g + 1];
    const int q0 = c0 / 4, q1 = c1 / 4, a0 = c0 % 4, a1 = c1 % 4;
    const bool same = q0 == q1;
    const int s0 = same ? 0 : (a0 > 0 ? 1 : 0), s1 = same ? 1 : (a1 > 0 ? 1 : 0);
    slot_out[2 * gi] = (g * NQ + q0) * 2 + s0;
    slot_out[2 * gi + 1] = (g * NQ + q1) * 2 + s1;
#pragma unroll
    for (int qs = 0; qs < NQ; ++qs) {
      const bool in0 = q0 == qs, in1 = q1 == qs;
      const int p0 = same && in0 ? a0 : 0;
      const int p1 = same && in0 ? a1 : in0 && a0 > 0 ? a0 : in1 && a1 > 0 ? a1 : 1;
      out[(gi * NQ + qs) * 2] = in0 && s0 == 0 ? v0 : in1 && s1 == 0 ? v1 : T{};
      out[(gi * NQ + qs) * 2 + 1] = in0 && s0 == 1 ? v0 : in1 && s1 == 1 ? v1 : T{};
      word24 |= static_cast<uint32_t>(p0 | (p1 << 2)) << (4 * (gi * NQ + qs));
    }
  }
  const int64_t row = out_row0 + r;
  StoreVec<sizeof(out)>(values24 + row * groups * NQ * 2 + 16 * w, out);
  StoreVec<sizeof(slot_out)>(slots + row * 2 * groups + 2 * g_first, slot_out);
  meta24[row * words24 + w] = word24;
}

template <typename T, int NQ>
ffi::Error Launch(cudaStream_t stream, const ViewInputs& in, int parts, void* values24, uint32_t* meta24,
                  int32_t* slots, int rows, int groups, int v) {
  const int64_t threads = static_cast<int64_t>(rows) * (groups * NQ / 8);
  if (threads == 0) return ffi::Error::Success();
  const int block = 256;
  As24Kernel<T, NQ><<<dim3(static_cast<unsigned>((threads + block - 1) / block), static_cast<unsigned>(parts)), block,
                      0, stream>>>(in, static_cast<T*>(values24), meta24, slots, rows, groups, v);
  return LastLaunchError("As24Kernel");
}

// M in {8, 16, 32} (NQ = M/4 quads per group); M = 4 is refused before (a 2:4 weight is its own view).
template <typename T>
ffi::Error LaunchM(cudaStream_t stream, int m, const ViewInputs& in, int parts, void* values24, uint32_t* meta24,
                   int32_t* slots, int rows, int groups, int v) {
  return DispatchGroupWidth("jaxsparse_as_2_4", m, [&](auto width) {
    constexpr int kM = decltype(width)::value;
    if constexpr (kM == 4)
      return ffi::Error::InvalidArgument("jaxsparse_as_2_4: a 2:4 weight is its own view");
    else
      return Launch<T, kM / 4>(stream, in, parts, values24, meta24, slots, rows, groups, v);
  });
}

// The weights of a stacked call: the first (values, columns, metadata) and `further` more triples of the first's shapes,
// dtype and pattern, at most kViewMaxParts in all, into `in` (unused parts repeat the first); their count, or an
// InvalidArgument naming `name`.
ffi::Error StackedInputs(const char* name, const ffi::AnyBuffer& values, const ffi::Buffer<ffi::U8>& columns,
                         const ffi::Buffer<ffi::U32>& metadata, ffi::RemainingArgs& further, int64_t rows,
                         int64_t groups, int v, int m, ViewInputs* in, int* parts) {
  const std::string target(name);
  if (further.size() % 3 || further.size() / 3 + 1 > kViewMaxParts)
    return ffi::Error::InvalidArgument(target + ": the further weights come as (values, columns, metadata) triples, "
                                       "at most " + std::to_string(kViewMaxParts - 1) + ", got " +
                                       std::to_string(further.size()) + " operands");
  *parts = static_cast<int>(further.size() / 3) + 1;
  for (int p = 0; p < kViewMaxParts; ++p) {
    in->values[p] = values.untyped_data();
    in->columns[p] = columns.typed_data();
    in->metadata[p] = metadata.typed_data();
  }
  for (int p = 1; p < *parts; ++p) {
    auto pv = further.get<ffi::AnyBuffer>(3 * (p - 1));
    auto pc = further.get<ffi::Buffer<ffi::U8>>(3 * (p - 1) + 1);
    auto pm = further.get<ffi::Buffer<ffi::U32>>(3 * (p - 1) + 2);
    if (pv.has_error()) return pv.error();
    if (pc.has_error()) return pc.error();
    if (pm.has_error()) return pm.error();
    if (pv->element_type() != values.element_type() || pv->dimensions().size() != 2 || Dim(*pv, 0) != rows ||
        Dim(*pv, 1) != 2 * groups || pc->element_count() != columns.element_count())
      return ffi::Error::InvalidArgument(target + ": stacked weight " + std::to_string(p) + " differs from the first: "
                                         "values " + ShapeString(*pv) + " against " + ShapeString(values) +
                                         ", columns " + ShapeString(*pc) + " against " + ShapeString(columns));
    if (ffi::Error e = CheckSparseWeight(name, rows, groups, *pc, *pm, v, m); e.failure()) return e;
    in->values[p] = pv->untyped_data();
    in->columns[p] = pc->typed_data();
    in->metadata[p] = pm->typed_data();
  }
  return ffi::Error::Success();
}

// further: the stacked weights after the first, as (values, columns, metadata) triples of the first's shapes, dtype
// and pattern (none for one weight's view); part p's view is rows [p R, (p+1) R) of each result.
ffi::Error As24Impl(cudaStream_t stream, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                    ffi::Buffer<ffi::U32> metadata, ffi::RemainingArgs further, ffi::Result<ffi::AnyBuffer> values24,
                    ffi::Result<ffi::Buffer<ffi::U32>> meta24, ffi::Result<ffi::Buffer<ffi::S32>> slots, int32_t v,
                    int32_t m) {
  const char* name = "jaxsparse_as_2_4";
  if (values.dimensions().size() != 2 || values24->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_as_2_4: values and the view's values must be 2-D");
  const int64_t rows = Dim(values, 0), groups = Dim(values, 1) / 2, k = groups * m;
  if (ffi::Error e = CheckSparseWeight(name, rows, groups, columns, metadata, v, m); e.failure()) return e;
  if (m == 4) return ffi::Error::InvalidArgument("jaxsparse_as_2_4: a 2:4 weight is its own view");
  ViewInputs in{};
  int parts = 1;
  if (ffi::Error e = StackedInputs(name, values, columns, metadata, further, rows, groups, v, m, &in, &parts);
      e.failure())
    return e;
  const int64_t all_rows = parts * rows;
  if (values24->dimensions()[0] != all_rows || values24->dimensions()[1] != k / 2 ||
      meta24->dimensions().size() != 2 || meta24->dimensions()[0] != all_rows || meta24->dimensions()[1] != k / 32 ||
      slots->dimensions().size() != 2 || slots->dimensions()[0] != all_rows || slots->dimensions()[1] != 2 * groups)
    return ffi::Error::InvalidArgument("jaxsparse_as_2_4: inconsistent shapes: values " + ShapeString(values) + " (" +
                                       std::to_string(parts) + " stacked), view values " + ShapeString(*values24) +
                                       ", view metadata " + ShapeString(*meta24) + ", slots " + ShapeString(*slots));
  if (values.element_type() != values24->element_type())
    return ffi::Error::InvalidArgument("jaxsparse_as_2_4: the view's values must have the values' dtype");
  if (all_rows >= (int64_t(1) << 30) || k >= (int64_t(1) << 30))
    return ffi::Error::InvalidArgument("jaxsparse_as_2_4: shape too large");
  const auto r = static_cast<int>(rows), g = static_cast<int>(groups);
  switch (ffi::ByteWidth(values.element_type())) {
    case 2:
      return LaunchM<uint16_t>(stream, m, in, parts, values24->untyped_data(), meta24->typed_data(),
                               slots->typed_data(), r, g, v);
    case 4:
      return LaunchM<uint32_t>(stream, m, in, parts, values24->untyped_data(), meta24->typed_data(),
                               slots->typed_data(), r, g, v);
    default:
      return ffi::Error::InvalidArgument("jaxsparse_as_2_4: values must be a 2- or 4-byte float type");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// W^T as a 2:4 weight (jaxsparse.format.transpose_2_4 is the reference and documents the result): for a mask chosen
// with select_mask(..., transposable=True) each input feature k keeps at most 2 of every 4 consecutive output
// features, so W^T (Flax shape (R, K): values [K, R/2], metadata [K, R/32]) is 2:4 along R and the input gradient
// dy @ W^T runs on the 2:4 forward kernel.  It is rebuilt every step (the values change every step); the pure-JAX
// build took 0.06-0.13 ms per BERT-large layer on the H100 (session 20, ten fusions), about the dense dX itself.
//
// A CTA of 8 warps takes 32 output features r0 .. r0+31 (one metadata word of W^T) and 8 groups g, one a warp: it
// stages their value pairs and metadata words in shared memory (each row's 8 pairs one 32-byte sector), then lane =
// 4 * quad + q builds W^T's two values and metadata nibble of its quad (4 output features) at the input feature k the
// block keeps as its q-th column (a 2:4 weight keeps every column: k = 4g + q).  Per quad of 4 output features the
// stored values come first, ascending, and a quad with fewer pads with its lowest free positions and zeros (as
// format._first_two).  A quad with more than 2 stored values (the mask is not transposable there) gets NaN in both
// slots, so the product is NaN exactly where it would otherwise be wrong.  The 8 quads' nibbles are OR-ed across the
// warp into the metadata word; each k's 16 values are 8 lanes' 4-byte stores (one 32-byte sector).  A column the block
// does not keep is an all-zero stretch of W^T: zeros, positions (0, 1).
// History (H200 kernel time; docs/kernel-notes.md, session 40): session 21's one thread per (32 output features, k)
// scanned all 32 rows for its column, M threads loading the same rows: 5.1 us at 1024 x 1024 and 9.2 us at the FFN
// shapes (64:2:8), 2.2-2.8x an XLA pass of the same bytes.  This kernel: 3.5 and 8.8 us.  Two variants measured and not
// kept: that thread's rows split over 4 lanes (4.3 and 10.7 us), and this one with 1, 2 or 4 groups a warp chosen at
// launch to keep the grid within one wave (4.2 and 9.3 us: the runtime tile cost more than the second wave).
// Stacked views (session 55): one call builds the W^T of up to kViewMaxParts weights of one shape and pattern, part p
// (blockIdx.y) into columns [p R/2, (p+1) R/2) of each W^T values row and [p R/32, (p+1) R/32) of each metadata row,
// so the views come out concatenated along their reduction, as the summed input-gradient product reads them
// (calls.spmm_t_sum), without a launch per weight and an XLA concatenation after them.
constexpr int kT24Groups = 8;  // groups per CTA, one per warp
static_assert(kViewMaxParts == 3, "Transpose24Kernel stacks up to calls.SPMM_SUM_MAX = 3 weights");
__global__ void __launch_bounds__(32 * kT24Groups) Transpose24Kernel(const ViewInputs in, uint16_t* __restrict__ values_t,
                                                                     uint32_t* __restrict__ meta_t, int rows,
                                                                     int groups, int v, int m, uint16_t nan) {
  __shared__ uint32_t pairs_s[32][kT24Groups + 1];  // +1: the 8 rows one warp's load reads sit in 8 banks
  __shared__ uint32_t meta_s[32];                   // the rows' metadata words of these 8 groups
  const int part = static_cast<int>(blockIdx.y), parts = static_cast<int>(gridDim.y);
  const ViewPart w_in = PartOf(in, part);
  const uint32_t* __restrict__ value_pairs = static_cast<const uint32_t*>(w_in.values);
  const uint8_t* __restrict__ columns = w_in.columns;
  const uint32_t* __restrict__ metadata = w_in.metadata;
  values_t += static_cast<int64_t>(part) * (rows / 2);
  meta_t += static_cast<int64_t>(part) * (rows / 32);
  const int tiles = groups / kT24Groups;            // G % 8 == 0
  const int chunk = static_cast<int>(blockIdx.x / tiles), g0 = static_cast<int>(blockIdx.x % tiles) * kT24Groups;
  const int r0 = 32 * chunk, lane = threadIdx.x % 32, gl = threadIdx.x / 32;
  {
    const int row = threadIdx.x / kT24Groups, col = threadIdx.x % kT24Groups;
    pairs_s[row][col] = value_pairs[static_cast<int64_t>(r0 + row) * groups + g0 + col];
    if (threadIdx.x < 32)
      meta_s[threadIdx.x] = metadata[static_cast<int64_t>(r0 + threadIdx.x) * (groups / 8) + g0 / 8];
  }
  __syncthreads();
  // W^T's values and metadata words per input feature, every part's
  const int64_t row_t = static_cast<int64_t>(parts) * (rows / 2), words_t = static_cast<int64_t>(parts) * (rows / 32);
  const int quad = lane / 4, q = lane % 4, g = g0 + gl;
  int c = q;  // M = 4: the group's columns are the kept ones
  uint32_t kept = 0xF;
  if (m > 4) {
    // v % 32 == 0: the 32 output features are in one block
    const uchar4 cols = *reinterpret_cast<const uchar4*>(columns + (static_cast<int64_t>(r0 / v) * groups + g) * 4);
    c = q == 0 ? cols.x : q == 1 ? cols.y : q == 2 ? cols.z : cols.w;
    kept = (1u << cols.x) | (1u << cols.y) | (1u << cols.z) | (1u << cols.w);
  }
  int count = 0, pa = 0, pb = 1;
  uint16_t va = 0, vb = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = 4 * quad + i;
    const uint32_t nib = (meta_s[row] >> (4 * gl)) & 0xF;
    const uint32_t pair = pairs_s[row][gl];
    const bool first = (nib & 3) == static_cast<uint32_t>(q), second = (nib >> 2) == static_cast<uint32_t>(q);
    if (first || second) {
      const uint16_t value = static_cast<uint16_t>(first ? pair : pair >> 16);
      if (count == 0) {
        pa = i;
        va = value;
      } else if (count == 1) {
        pb = i;
        vb = value;
      }
      ++count;
    }
  }
  if (count == 1) pb = pa == 0 ? 1 : 0;  // the lowest free position, with a zero value
  if (count > 2) va = vb = nan;
  uint32_t word = static_cast<uint32_t>(pa | (pb << 2)) << (4 * quad);
#pragma unroll
  for (int offset = 4; offset < 32; offset *= 2) word |= __shfl_xor_sync(0xFFFFFFFFu, word, offset);
  const int64_t k = static_cast<int64_t>(g) * m + c;
  *reinterpret_cast<uint32_t*>(values_t + k * row_t + 16 * chunk + 2 * quad) = va | (static_cast<uint32_t>(vb) << 16);
  if (quad == 0) meta_t[k * words_t + chunk] = word;
  // The columns the block does not keep (M > 4): 4 of them per pass, 8 lanes each.
  for (int c0 = 0; c0 < m && m > 4; c0 += 4) {
    const int cz = c0 + lane / 8;
    if (!((kept >> cz) & 1)) {
      const int64_t kz = static_cast<int64_t>(g) * m + cz;
      *reinterpret_cast<uint32_t*>(values_t + kz * row_t + 16 * chunk + 2 * (lane % 8)) = 0;
      if (lane % 8 == 0) meta_t[kz * words_t + chunk] = 0x44444444u;  // positions (0, 1) in each of the 8 quads
    }
  }
}

// further: the stacked weights after the first, as (values, columns, metadata) triples of the first's shapes, dtype
// and pattern (none for one weight's W^T).
ffi::Error Transpose24Impl(cudaStream_t stream, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                           ffi::Buffer<ffi::U32> metadata, ffi::RemainingArgs further,
                           ffi::Result<ffi::AnyBuffer> values_t, ffi::Result<ffi::Buffer<ffi::U32>> meta_t, int32_t v,
                           int32_t m) {
  const char* name = "jaxsparse_transpose_2_4";
  if (values.dimensions().size() != 2 || values_t->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_transpose_2_4: values and W^T's values must be 2-D");
  const int64_t rows = Dim(values, 0), groups = Dim(values, 1) / 2, k = groups * m;
  if (ffi::Error e = CheckSparseWeight(name, rows, groups, columns, metadata, v, m); e.failure()) return e;
  ViewInputs in{};
  int parts = 1;
  if (ffi::Error e = StackedInputs(name, values, columns, metadata, further, rows, groups, v, m, &in, &parts);
      e.failure())
    return e;
  if (rows % 32)
    return ffi::Error::InvalidArgument("jaxsparse_transpose_2_4: needs R % 32 == 0 (W^T's metadata words hold 32 "
                                       "output features), got R = " + std::to_string(rows));
  if (values_t->dimensions()[0] != k || values_t->dimensions()[1] != parts * rows / 2 ||
      meta_t->dimensions().size() != 2 || meta_t->dimensions()[0] != k || meta_t->dimensions()[1] != parts * rows / 32)
    return ffi::Error::InvalidArgument("jaxsparse_transpose_2_4: inconsistent shapes: values " + ShapeString(values) +
                                       " (" + std::to_string(parts) + " stacked), W^T's values " +
                                       ShapeString(*values_t) + ", W^T's metadata " + ShapeString(*meta_t));
  if (values.element_type() != values_t->element_type() ||
      (values.element_type() != ffi::BF16 && values.element_type() != ffi::F16))
    return ffi::Error::InvalidArgument("jaxsparse_transpose_2_4: values and W^T's values must share bf16 or fp16");
  if (parts * rows >= (int64_t(1) << 30) || k >= (int64_t(1) << 30))
    return ffi::Error::InvalidArgument("jaxsparse_transpose_2_4: shape too large");
  const int64_t blocks = rows / 32 * (groups / kT24Groups);
  if (blocks == 0) return ffi::Error::Success();
  const uint16_t nan = values.element_type() == ffi::BF16 ? 0x7FC0 : 0x7E00;
  Transpose24Kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(parts)), 32 * kT24Groups, 0,
                      stream>>>(in, static_cast<uint16_t*>(values_t->untyped_data()), meta_t->typed_data(),
                                static_cast<int>(rows), static_cast<int>(groups), v, m, nan);
  return LastLaunchError("Transpose24Kernel");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseAs24, jaxsparse::As24Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // values [R, 2G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .RemainingArgs()                          // up to 2 more (values, columns, metadata)
                                  .Ret<xla::ffi::AnyBuffer>()               // the view's values [n R, K/2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()   // the view's metadata [n R, K/32]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()   // slots [n R, 2G]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseTranspose24, jaxsparse::Transpose24Impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // values [R, 2G], bf16 or fp16
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .RemainingArgs()                          // up to 2 more (values, columns, metadata)
                                  .Ret<xla::ffi::AnyBuffer>()               // W^T's values [K, n R/2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()   // W^T's metadata [K, n R/32]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);
