// New tokens' keys and values into the packed caches of one layer (kernels/layout.py), one call for both:
// per token, each KV head's dims go to their lanes of the key block and the value block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kTokensPerTask = 256;  // a decoding step's few tokens stay on one thread

template <typename scalar_t>
void write_entries(scalar_t* key_cache, scalar_t* value_cache, const scalar_t* keys, const scalar_t* values,
                   const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t pack, int64_t key_stride, int64_t value_stride) {
  const int64_t groups = head_dim / pack, pairs = block_size / pack;
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const scalar_t* k = keys + t * key_stride + h * head_dim;
        const scalar_t* v = values + t * value_stride + h * head_dim;
        // keys [blocks, KV, Dh / P, block_size, P]; values [blocks, KV, block_size / P, Dh * P]
        scalar_t* key_block = key_cache + (block * kv_heads + h) * groups * block_size * pack + offset * pack;
        scalar_t* value_row = value_cache + ((block * kv_heads + h) * pairs + offset / pack) * head_dim * pack +
                              offset % pack;
        for (int64_t d = 0; d < head_dim; ++d) {
          key_block[d / pack * block_size * pack + d % pack] = k[d];
          value_row[d * pack] = v[d];
        }
      }
    }
  });
}

// keys, values [T, KV, Dh] (rows may be strided, each row's heads contiguous); slots [T].
void write_kv(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& keys, const at::Tensor& values,
              const at::Tensor& slots) {
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "packed caches expected: keys [blocks, KV, Dh / P, block_size, P], values [blocks, KV, "
              "block_size / P, Dh * P]");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 && values.stride(2) == 1 &&
                  keys.stride(1) == keys.size(2) && values.stride(1) == values.size(2),
              "keys and values must be [T, KV, Dh] with each row's heads contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == keys.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [T]");
  const int64_t pack = key_cache.size(4), block_size = key_cache.size(3), kv_heads = keys.size(1),
                head_dim = keys.size(2);
  TORCH_CHECK(key_cache.size(1) == kv_heads && key_cache.size(2) * pack == head_dim &&
                  value_cache.size(2) * pack == block_size && value_cache.size(3) == head_dim * pack,
              "the caches and the entries disagree on KV heads, head_dim or block_size");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "write_kv", [&] {
    TORCH_CHECK(key_cache.scalar_type() == keys.scalar_type() && value_cache.scalar_type() == keys.scalar_type() &&
                    values.scalar_type() == keys.scalar_type(),
                "caches and entries must share a dtype");
    write_entries(key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                  values.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), keys.size(0), kv_heads, head_dim,
                  block_size, pack, keys.stride(0), values.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor keys, Tensor values, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("write_kv", &write_kv); }
