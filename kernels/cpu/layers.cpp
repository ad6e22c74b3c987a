// Row-wise Llama layer ops for 16-bit models on CPU: one pass over each row where transformers runs
// several torch ops (each a dispatch and a pass over memory), rounding to the model's dtype at the
// same steps it does (kernels/reference/layers.py is the specification). Every row is computed on its
// own, in a fixed order, so results do not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <cmath>
#include <vector>

namespace {

using namespace specd_cpu;

constexpr int64_t kRowsPerTask = 8;
constexpr int64_t kNormRowsPerTask = 256;  // a decoding step's few rows stay on one thread: cheaper than waking one

// h += delta (rounded to h's dtype) where delta is given; returns weight * (h / rms(h), computed in fp32
// and rounded), as transformers' residual add and LlamaRMSNorm.
template <typename scalar_t>
void add_rms_norm_rows(scalar_t* h, const scalar_t* delta, const scalar_t* weight, scalar_t* out, int64_t rows,
                       int64_t dim, float eps) {
  at::parallel_for(0, rows, kNormRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = h + r * dim;
      f32x16 squares{};
      for (int64_t d = 0; d < dim; d += kLanes) {
        f32x16 x = load_part(row, d, dim);
        if (delta != nullptr) {
          x = rounded<scalar_t>(x + load_part(delta + r * dim, d, dim));
          store_part(x, row + d, dim - d);
        }
        squares += x * x;
      }
      const float inverse_rms = 1.0f / std::sqrt(lane_sum(squares) / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; d += kLanes) {
        const f32x16 normed = rounded<scalar_t>(load_part(row, d, dim) * inverse_rms);
        store_part(load_part(weight, d, dim) * normed, out + r * dim + d, dim - d);
      }
    }
  });
}

at::Tensor add_rms_norm(at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [T, D]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.is_contiguous(), "weight must be [D]");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == h.sizes() && delta->is_contiguous()),
              "delta must be a contiguous tensor of h's shape");
  at::Tensor out = at::empty_like(h);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(h.scalar_type(), "add_rms_norm", [&] {
    TORCH_CHECK(weight.scalar_type() == h.scalar_type() && (!delta || delta->scalar_type() == h.scalar_type()),
                "h, delta and weight must share a dtype");
    add_rms_norm_rows(h.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr,
                      weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), h.size(0), h.size(1),
                      static_cast<float>(eps));
  });
  return out;
}

// silu(x) = x / (1 + exp(-x)), rounded to scalar_t, for each of the 2^16 bit patterns of a 16-bit x,
// as fp32: computed once as torch computes it, then looked up at a gather's cost.
template <typename scalar_t>
const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(1 << 16);
    for (int64_t first = 0; first < int64_t(values.size()); first += kLanes) {
      float activated[kLanes];
      for (int64_t i = 0; i < kLanes; ++i) {
        const float x = c10::bit_cast<scalar_t>(static_cast<uint16_t>(first + i));
        activated[i] = x / (1.0f + std::exp(-x));
      }
      store16(rounded<scalar_t>(load16(activated)), &values[first]);
    }
    return values;
  }();
  return table.data();
}

// silu of gate[i .. i+15] (rounded) from the table.
template <typename scalar_t>
inline f32x16 silu_lookup(const float* table, const scalar_t* gate, int64_t i, int64_t width) {
#ifdef __AVX512F__
  if (i + kLanes <= width) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i));
    return bitcast<f32x16>(_mm512_i32gather_ps(_mm512_cvtepu16_epi32(bits), table, sizeof(float)));
  }
#endif
  float activated[kLanes] = {};
  for (int64_t l = 0; l < kLanes && i + l < width; ++l) activated[l] = table[gate[i + l].x];
  return load16(activated);
}

// [T, 2I] (gate, then up) -> [T, I]: silu(gate) rounded, times up, rounded.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2I]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(gate_up.scalar_type(), "silu_mul", [&] {
    const float* table = silu_table<scalar_t>();
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * width;
        for (int64_t i = 0; i < width; i += kLanes) {
          const f32x16 activated = silu_lookup(table, gate, i, width);
          store_part(activated * load_part(gate + width, i, width), dst + r * width + i, width - i);
        }
      }
    });
  });
  return out;
}

// x [T, n, Dh] (rows may be strided, each row's heads contiguous), cos and sin [T, Dh/2] -> [T, n, Dh]:
// (x1 * cos - x2 * sin, x2 * cos + x1 * sin) for the halves x1, x2, each product and sum rounded.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be [T, n, Dh] with each row's heads contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * half && sin.numel() == rows * half,
              "cos and sin must be contiguous [T, Dh/2]");
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rotate", [&] {
    TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
                "x, cos and sin must share a dtype");
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t* cos_rows = cos.data_ptr<scalar_t>();
    const scalar_t* sin_rows = sin.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* in = src + t * x.stride(0) + h * 2 * half;
          scalar_t* o = dst + (t * heads + h) * 2 * half;
          for (int64_t i = 0; i < half; i += kLanes) {
            const f32x16 c = load_part(cos_rows + t * half, i, half), s = load_part(sin_rows + t * half, i, half);
            const f32x16 x1 = load_part(in, i, half), x2 = load_part(in + half, i, half);
            const int64_t n = half - i;
            store_part(rounded<scalar_t>(x1 * c) - rounded<scalar_t>(x2 * s), o + i, n);
            store_part(rounded<scalar_t>(x2 * c) + rounded<scalar_t>(x1 * s), o + half + i, n);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotate(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotate", &rotate);
}
