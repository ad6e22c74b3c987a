// x @ weight^T on CPU, the weight packed once into blocks of 16 outputs side by side, so that a decode step
// streams each weight once, front to back, and each output is one sum over the inputs in a fixed order.
//
// bf16: [N / 16, K / 32, 16, 32], tile (n, k) row r holding, for the 16 outputs n * 16 .. n * 16 + 15 side by
// side, the input pair k * 32 + 2r, k * 32 + 2r + 1. That layout is both what an AMX tile product reads and,
// row by row, what an AVX512-BF16 dot product (16 outputs x one input pair) reads. With AMX (Intel Xeon 4th
// gen and later) the products are tiles; with AVX512-BF16 only (AMD Zen 4 and later) each output is one fp32
// sum over the input pairs in order. A third way reads the same layout with AVX512F alone: each weight pair
// widened to two fp32 vectors (a shift and a mask: bf16 is fp32's upper half), then two fp32 FMAs a row for
// what one dot product does. Where dot products issue at a quarter of the FMAs' rate (a Xeon whose VM hides
// AMX: 1.4 against 5.5 G instructions a second per core), that is twice the products a second; where there
// are no dot products at all (a Xeon without AVX512-BF16), it is the only way, and it streams half the
// bytes an fp32 weight would.
// Which way a process takes is the caller's (`products`), fixed for the process.
//
// fp32: [N / 16, K, 16], input k of the 16 outputs side by side: one fp32 FMA a row and input. MKL's GEMM
// took a forward of 3-4 tokens at batch 1 nearly twice what one token took on a 2-core Xeon; this streams
// each weight once for up to kVecRows<float> (6) rows at a time.
//
// Each way is its own sequence of products over K in a fixed order, so a row's result is bit-identical
// whatever the row count and however the work is split: batch invariant by construction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace specd_cpu;
using bf16 = c10::BFloat16;

constexpr int64_t kBlockRows = 16;     // rows of x per tile
constexpr int64_t kBlockOutputs = 16;  // outputs per weight tile
constexpr int64_t kBlockInputs = 32;   // inputs per tile: 16 pairs
constexpr int64_t kRowsPerPass = 256;  // rows whose x slice stays in L2 while the weight passes by
constexpr int64_t kChunkBytes = 256 * 1024;  // of weight tiles a thread keeps in L2 for a pass
// How far ahead, in input pairs, the vector kernels ask for each output block's weight: the hardware prefetcher
// alone keeps too few of a weight's cache lines in flight, and a forward's matmuls at 1-4 rows ran 12-19%
// faster with it on a 2-core Xeon (bf16, the default model's weights streamed from memory).
constexpr int64_t kPrefetchPairs = 16;
constexpr int64_t kPrefetchInputs = 16;  // the same for fp32 weights, in inputs (1 KB ahead)

bool supports_linear(const at::Tensor& weight) {
#ifdef __AVX512F__
  if (weight.dim() != 2 || weight.size(0) % kBlockOutputs != 0) return false;
  if (weight.scalar_type() == at::kFloat) return true;
  return weight.scalar_type() == at::kBFloat16 && weight.size(1) % kBlockInputs == 0;
#else
  return false;
#endif
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(supports_linear(weight), "pack_linear_weight takes an fp32 [N, K] weight with N % 16 == 0, or a "
              "bf16 one with K % 32 == 0 besides, on a CPU with AVX512F");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    return weight.reshape({n / kBlockOutputs, kBlockOutputs, k}).transpose(1, 2).contiguous();
  }
  return weight.reshape({n / kBlockOutputs, kBlockOutputs, k / kBlockInputs, kBlockInputs / 2, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous()
      .view({n / kBlockOutputs, k / kBlockInputs, kBlockInputs / 2, 2 * kBlockOutputs});
}

#ifdef SPECD_AMX
constexpr int64_t kTileElements = kBlockInputs * kBlockOutputs;  // one packed weight tile

// Up to 16 rows of x as a tile reads them.
struct RowBlock {
  const bf16* data;
  int64_t stride_bytes, valid;
};

// The rows of x by blocks of 16: full blocks in place, a last partial one copied into `tail`, zero padded.
class RowBlocks {
 public:
  RowBlocks(const at::Tensor& x) : x_(x.data_ptr<bf16>()), rows_(x.size(0)), stride_(x.stride(0)) {
    const int64_t partial = rows_ % kBlockRows, inputs = x.size(1);
    if (partial == 0) return;
    tail_.assign(kBlockRows * inputs, bf16(0.0f));
    for (int64_t r = 0; r < partial; ++r) {
      std::memcpy(&tail_[r * inputs], x_ + (rows_ - partial + r) * stride_, inputs * sizeof(bf16));
    }
    tail_stride_bytes_ = inputs * sizeof(bf16);
  }

  RowBlock operator[](int64_t first) const {
    if (first + kBlockRows <= rows_) return {x_ + first * stride_, stride_ * int64_t(sizeof(bf16)), kBlockRows};
    return {tail_.data(), tail_stride_bytes_, rows_ - first};
  }

 private:
  const bf16* x_;
  int64_t rows_, stride_, tail_stride_bytes_ = 0;
  std::vector<bf16> tail_;
};

// out[rows of a, outputs of the weight blocks at b] for M_BLOCKS row blocks a[0..] and N_BLOCKS
// consecutive output blocks. Tiles 0..3 the sums, 4 and 5 the rows, 6 and 7 the weights.
template <int M_BLOCKS, int N_BLOCKS>
void tile_products(const RowBlock* a, const bf16* b, int64_t k_blocks, bf16* out, int64_t out_stride) {
  const bf16* b1 = b + k_blocks * kTileElements;  // the next output block's tiles
  _tile_zero(0);
  if constexpr (N_BLOCKS == 2) _tile_zero(1);
  if constexpr (M_BLOCKS == 2) _tile_zero(2);
  if constexpr (M_BLOCKS == 2 && N_BLOCKS == 2) _tile_zero(3);
  for (int64_t k = 0; k < k_blocks; ++k) {
    _tile_loadd(4, a[0].data + k * kBlockInputs, a[0].stride_bytes);
    _tile_loadd(6, b + k * kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (N_BLOCKS == 2) {
      _tile_loadd(7, b1 + k * kTileElements, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (M_BLOCKS == 2) {
      _tile_loadd(5, a[1].data + k * kBlockInputs, a[1].stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (N_BLOCKS == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][kBlockRows * kBlockOutputs];
  _tile_stored(0, sums[0], kBlockOutputs * sizeof(float));
  if constexpr (N_BLOCKS == 2) _tile_stored(1, sums[1], kBlockOutputs * sizeof(float));
  if constexpr (M_BLOCKS == 2) _tile_stored(2, sums[2], kBlockOutputs * sizeof(float));
  if constexpr (M_BLOCKS == 2 && N_BLOCKS == 2) _tile_stored(3, sums[3], kBlockOutputs * sizeof(float));
  for (int m = 0; m < M_BLOCKS; ++m) {
    for (int n = 0; n < N_BLOCKS; ++n) {
      for (int64_t r = 0; r < a[m].valid; ++r) {
        bf16* row = out + (m * kBlockRows + r) * out_stride;
        store16(load16(&sums[2 * m + n][r * kBlockOutputs]), row + n * kBlockOutputs);
      }
    }
  }
}

// Output blocks taken in pairs, split across threads. Rows go in passes of kRowsPerPass; within a pass,
// each thread takes its weight pairs a chunk of about kChunkBytes at a time (kept in L2) and runs every
// pair of row blocks of the pass (each in L1 while it meets the chunk's pairs) through it. The order
// changes only which data is in cache, never how an output is summed.
void amx_linear(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  const RowBlocks blocks(x);
  const int64_t rows = x.size(0), n_blocks = packed.size(0), k_blocks = packed.size(1), outputs = out.size(1);
  const int64_t pair_bytes = 2 * k_blocks * kTileElements * int64_t(sizeof(bf16));
  const int64_t pairs_per_chunk = std::max<int64_t>(1, kChunkBytes / pair_bytes);
  const bf16* weight = packed.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  at::parallel_for(0, (n_blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    const TileRegisters tiles;
    for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
      const int64_t pass_end = std::min(rows, pass + kRowsPerPass);
      for (int64_t chunk = begin; chunk < end; chunk += pairs_per_chunk) {
        const int64_t chunk_end = std::min(end, chunk + pairs_per_chunk);
        for (int64_t m = pass; m < pass_end; m += 2 * kBlockRows) {
          const bool two_m = m + kBlockRows < pass_end;
          const RowBlock a[2] = {blocks[m], two_m ? blocks[m + kBlockRows] : blocks[m]};
          for (int64_t pair = chunk; pair < chunk_end; ++pair) {
            const int64_t n = 2 * pair;
            const bf16* b = weight + n * k_blocks * kTileElements;
            const bool two_n = n + 1 < n_blocks;
            bf16* o = dst + m * outputs + n * kBlockOutputs;
            if (two_m && two_n) tile_products<2, 2>(a, b, k_blocks, o, outputs);
            else if (two_m) tile_products<2, 1>(a, b, k_blocks, o, outputs);
            else if (two_n) tile_products<1, 2>(a, b, k_blocks, o, outputs);
            else tile_products<1, 1>(a, b, k_blocks, o, outputs);
          }
        }
      }
    }
  });
}
#endif

#ifdef __AVX512F__
// The weight kPrefetchPairs pairs past `pair_weights` into L1 (past a weight's end, harmless: a prefetch never faults).
inline void prefetch_ahead(const bf16* pair_weights) {
  _mm_prefetch(reinterpret_cast<const char*>(pair_weights + kPrefetchPairs * 2 * kBlockOutputs), _MM_HINT_T0);
}

// The same for fp32 weights: kPrefetchInputs inputs past `input_weights`.
inline void prefetch_ahead(const float* input_weights) {
  _mm_prefetch(reinterpret_cast<const char*>(input_weights + kPrefetchInputs * kBlockOutputs), _MM_HINT_T0);
}
#endif

#ifdef __AVX512BF16__
// out[ROWS rows, BLOCKS x 16 outputs]: for each output, one fp32 sum over the K / 2 input pairs in order,
// a pair at a time: x's pair broadcast against the 16 outputs' pairs (a row of the packed weight).
template <int ROWS, int BLOCKS>
void dot_products(const bf16* x, int64_t x_stride, const bf16* b, int64_t inputs, bf16* out,
                  int64_t out_stride) {
  const int64_t pairs = inputs / 2, block_elements = inputs * kBlockOutputs;  // one output block's packed weight
  __m512 sums[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) sums[r][n] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[BLOCKS];
    for (int n = 0; n < BLOCKS; ++n) {
      const bf16* pair_weights = b + n * block_elements + p * 2 * kBlockOutputs;
      prefetch_ahead(pair_weights);
      w[n] = (__m512bh)_mm512_loadu_si512(pair_weights);
    }
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < BLOCKS; ++n) sums[r][n] = _mm512_dpbf16_ps(sums[r][n], xr, w[n]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) {
      store16(bitcast<f32x16>(sums[r][n]), out + r * out_stride + n * kBlockOutputs);
    }
  }
}

#endif

#ifdef __AVX512F__
// As dot_products, x widened to fp32 beforehand and each weight pair widened here, and each dot product two
// fp32 FMAs: the pair's second input, then its first, the order in which an AVX512-BF16 dot product rounds
// (Intel's definition; bit for bit on the Xeon measured), with denormals flushed as it flushes them.
template <int ROWS, int BLOCKS>
void widened_products(const float* x, int64_t x_stride, const bf16* b, int64_t inputs, bf16* out,
                      int64_t out_stride) {
  const int64_t pairs = inputs / 2, block_elements = inputs * kBlockOutputs;
  const __m512i upper_halves = _mm512_set1_epi32(int32_t(0xffff0000u));
  __m512 sums[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) sums[r][n] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 x_first[ROWS], x_second[ROWS];  // the pair's two inputs of each row, broadcast
    for (int r = 0; r < ROWS; ++r) {
      x_first[r] = _mm512_set1_ps(x[r * x_stride + 2 * p]);
      x_second[r] = _mm512_set1_ps(x[r * x_stride + 2 * p + 1]);
    }
    for (int n = 0; n < BLOCKS; ++n) {
      const bf16* pair_weights = b + n * block_elements + p * 2 * kBlockOutputs;
      prefetch_ahead(pair_weights);
      const __m512i w = _mm512_loadu_si512(pair_weights);
      const __m512 w_first = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      const __m512 w_second = _mm512_castsi512_ps(_mm512_and_si512(w, upper_halves));
      for (int r = 0; r < ROWS; ++r) {
        sums[r][n] = _mm512_fmadd_ps(x_first[r], w_first, _mm512_fmadd_ps(x_second[r], w_second, sums[r][n]));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) {
      store16(bitcast<f32x16>(sums[r][n]), out + r * out_stride + n * kBlockOutputs);
    }
  }
}

// out[ROWS rows, BLOCKS x 16 outputs] for fp32 weights: for each output, one fp32 FMA per input, in order.
template <int ROWS, int BLOCKS>
void fp32_products(const float* x, int64_t x_stride, const float* b, int64_t inputs, float* out,
                   int64_t out_stride) {
  const int64_t block_elements = inputs * kBlockOutputs;
  __m512 sums[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) sums[r][n] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < inputs; ++k) {
    __m512 w[BLOCKS];
    for (int n = 0; n < BLOCKS; ++n) {
      const float* input_weights = b + n * block_elements + k * kBlockOutputs;
      prefetch_ahead(input_weights);
      w[n] = _mm512_loadu_ps(input_weights);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      for (int n = 0; n < BLOCKS; ++n) sums[r][n] = _mm512_fmadd_ps(xr, w[n], sums[r][n]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int n = 0; n < BLOCKS; ++n) _mm512_storeu_ps(out + r * out_stride + n * kBlockOutputs, sums[r][n]);
  }
}

// Denormal inputs read as zero and denormal results flushed to zero on the calling thread while in scope,
// as a dot product treats them.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040 /* FTZ | DAZ */); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};
#endif

#ifdef __AVX512F__
// Rows of x per micro-kernel call: with kVecBlocks output blocks, 24 fp32 accumulators in registers (a prompt's
// prefill 1.15x faster than at 4 rows), 16 for bf16 (whose widened products hold each row's inputs twice).
template <typename W>
constexpr int kVecRows = std::is_same_v<W, float> ? 6 : 4;
constexpr int kVecBlocks = 4;  // output blocks (of 16) per call

// The micro-kernels by rows and blocks up to kVecRows<W> x kVecBlocks, for x's and the weight's element types
// (bf16 and bf16: dot products; fp32 and bf16: widened products; fp32 and fp32: fp32 products). The output
// has the weight's element type.
template <typename X, typename W>
using Kernel = void (*)(const X*, int64_t, const W*, int64_t, W*, int64_t);

template <typename X, typename W, int ROWS, int BLOCKS>
constexpr Kernel<X, W> kernel_for() {
  if constexpr (std::is_same_v<W, float>) {
    return fp32_products<ROWS, BLOCKS>;
  } else if constexpr (std::is_same_v<X, float>) {
    return widened_products<ROWS, BLOCKS>;
  } else {
#ifdef __AVX512BF16__
    return dot_products<ROWS, BLOCKS>;
#endif
    return nullptr;
  }
}

template <typename X, typename W, int ROWS>
Kernel<X, W> kernel_for(int blocks) {
  return blocks == 1 ? kernel_for<X, W, ROWS, 1>() : blocks == 2 ? kernel_for<X, W, ROWS, 2>()
                     : blocks == 3 ? kernel_for<X, W, ROWS, 3>() : kernel_for<X, W, ROWS, 4>();
}

template <typename X, typename W>
Kernel<X, W> kernel_for(int rows, int blocks) {
  return rows == 1 ? kernel_for<X, W, 1>(blocks) : rows == 2 ? kernel_for<X, W, 2>(blocks)
                   : rows == 3 ? kernel_for<X, W, 3>(blocks) : rows == 4 ? kernel_for<X, W, 4>(blocks)
                   : rows == 5 ? kernel_for<X, W, 5>(blocks) : kernel_for<X, W, 6>(blocks);
}

// As amx_linear: groups of kVecBlocks output blocks split across threads; rows in passes of kRowsPerPass;
// each thread takes its groups a chunk of about kChunkBytes at a time and runs every group of kVecRows<W> rows
// of the pass through it. The order changes only which data is in cache, never how an output is summed.
template <typename X, typename W>
void vector_linear(const X* src, int64_t x_stride, int64_t rows, const at::Tensor& packed, at::Tensor& out) {
  const int64_t n_blocks = packed.size(0), inputs = packed.numel() / (n_blocks * kBlockOutputs);
  const int64_t outputs = out.size(1), block_elements = inputs * kBlockOutputs;
  const int64_t group_bytes = kVecBlocks * block_elements * int64_t(sizeof(W));
  const int64_t groups_per_chunk = std::max<int64_t>(1, kChunkBytes / group_bytes);
  const W* weight = packed.data_ptr<W>();
  W* dst = out.data_ptr<W>();
  at::parallel_for(0, (n_blocks + kVecBlocks - 1) / kVecBlocks, 1, [&](int64_t begin, int64_t end) {
    // What dot products do (for them, a no-op); fp32 weights keep denormals, as torch's fp32 matmuls do.
    std::optional<FlushDenormals> flushed;
    if constexpr (!std::is_same_v<W, float>) flushed.emplace();
    for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
      const int64_t pass_end = std::min(rows, pass + kRowsPerPass);
      for (int64_t chunk = begin; chunk < end; chunk += groups_per_chunk) {
        const int64_t chunk_end = std::min(end, chunk + groups_per_chunk);
        for (int64_t m = pass; m < pass_end; m += kVecRows<W>) {
          const int row_count = int(std::min<int64_t>(kVecRows<W>, pass_end - m));
          for (int64_t group = chunk; group < chunk_end; ++group) {
            const int64_t n = group * kVecBlocks;
            const int block_count = int(std::min<int64_t>(kVecBlocks, n_blocks - n));
            kernel_for<X, W>(row_count, block_count)(src + m * x_stride, x_stride, weight + n * block_elements,
                                                     inputs, dst + m * outputs + n * kBlockOutputs, outputs);
          }
        }
      }
    }
  });
}
#endif

// Whether `linear` can form its products the way `products` names on this CPU: "amx" (granted tiles),
// "dot", "widened".
bool can_form(const std::string& products) {
#ifdef SPECD_AMX
  if (products == "amx") return amx_granted();
#endif
#ifdef __AVX512BF16__
  if (products == "dot") return true;
#endif
#ifdef __AVX512F__
  if (products == "widened") return true;
#endif
  return false;
}

// The ways `linear` can form its products on this CPU.
std::vector<std::string> linear_products() {
  std::vector<std::string> ways;
  for (const char* way : {"amx", "dot", "widened"}) {
    if (can_form(way)) ways.push_back(way);
  }
  return ways;
}

// x [M, K] (rows may be strided) @ fp32 weight^T, the weight as pack_linear_weight returned it -> [M, N].
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be fp32, as the weight is");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kBlockOutputs,
              "the weight must be packed by pack_linear_weight");
  TORCH_CHECK(packed.size(1) == x.size(1), "x has ", x.size(1), " inputs, the weight ", packed.size(1));
  at::Tensor out = at::empty({x.size(0), packed.size(0) * kBlockOutputs}, x.options());
#ifdef __AVX512F__
  if (x.size(0) > 0) vector_linear<float, float>(x.data_ptr<float>(), x.stride(0), x.size(0), packed, out);
#endif
  return out;
}

// x [M, K] (rows may be strided) @ weight^T, the weight as pack_linear_weight returned it -> [M, N]; bf16
// products formed the way `products` names (one of linear_products()); fp32 weights have one way, FMAs.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::string& products) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  if (packed.scalar_type() == at::kFloat) {
    TORCH_CHECK(products == "fma", "fp32 weights take \"fma\" products, not \"", products, "\"");
    return fp32_linear(x, packed);
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bf16, as the weight is");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlockInputs / 2 && packed.size(3) == 2 * kBlockOutputs,
              "the weight must be packed by pack_linear_weight");
  TORCH_CHECK(packed.size(1) * kBlockInputs == x.size(1), "x has ", x.size(1), " inputs, the weight ",
              packed.size(1) * kBlockInputs);
  TORCH_CHECK(can_form(products), "products \"", products, "\" cannot be formed on this CPU; it can form: ",
              c10::Join(", ", linear_products()));
  at::Tensor out = at::empty({x.size(0), packed.size(0) * kBlockOutputs}, x.options());
  if (x.size(0) == 0) return out;
#ifdef SPECD_AMX
  if (products == "amx") amx_linear(x, packed, out);
#endif
#ifdef __AVX512BF16__
  if (products == "dot") vector_linear<bf16, bf16>(x.data_ptr<bf16>(), x.stride(0), x.size(0), packed, out);
#endif
#ifdef __AVX512F__
  if (products == "widened") {
    const at::Tensor wide = x.to(at::kFloat).contiguous();
    vector_linear<float, bf16>(wide.data_ptr<float>(), wide.stride(0), x.size(0), packed, out);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("supports_linear(Tensor weight) -> bool");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_products() -> str[]", &linear_products);
  m.def("linear(Tensor x, Tensor packed, str products) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("linear", &linear);
  m.impl("supports_linear", &supports_linear);
}
