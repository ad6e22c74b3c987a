// The packed caches (kernels/layout.py): new tokens' keys and values into one layer's, one call for both
// (per token, each KV head's dims go to their lanes of the key block and the value block); and entries moved
// between slots in every layer's at once (an accepted tree path taking its positions).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

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

// Where the elements of a slot's entry sit in a packed pool: keys [blocks, KV, Dh / P, block_size, P] (rank 5),
// values [blocks, KV, block_size / P, Dh * P] (rank 4). Element (head, dim) of slot s is at
// entry(s) + head * block_size * Dh + dim_offsets[dim].
struct PackedLayout {
  bool keys;
  int64_t kv_heads, head_dim, block_size, pack;
  std::vector<int64_t> dim_offsets;

  PackedLayout(const at::Tensor& pool) : keys(pool.dim() == 5), kv_heads(pool.size(1)) {
    pack = keys ? pool.size(4) : std::max<int64_t>(1, 4 / pool.element_size());
    head_dim = keys ? pool.size(2) * pack : pool.size(3) / pack;
    block_size = keys ? pool.size(3) : pool.size(2) * pack;
    for (int64_t d = 0; d < head_dim; ++d) {
      dim_offsets.push_back(keys ? d / pack * block_size * pack + d % pack : d * pack);
    }
  }

  int64_t entry(int64_t slot) const {
    const int64_t block = slot / block_size, offset = slot % block_size;
    const int64_t within = keys ? offset * pack : offset / pack * head_dim * pack + offset % pack;
    return block * kv_heads * block_size * head_dim + within;
  }
};

template <typename scalar_t>
void move_entries(scalar_t* pool, const PackedLayout& layout, const int64_t* src, const int64_t* dst,
                  int64_t moves) {
  const int64_t head_stride = layout.block_size * layout.head_dim;
  auto element = [&](int64_t slot, int64_t head, int64_t dim) -> scalar_t& {
    return pool[layout.entry(slot) + head * head_stride + layout.dim_offsets[dim]];
  };
  // Every source is read before any destination is written: a source may be another move's destination.
  std::vector<scalar_t> staged(moves * layout.kv_heads * layout.head_dim);
  scalar_t* next = staged.data();
  for (int64_t m = 0; m < moves; ++m)
    for (int64_t h = 0; h < layout.kv_heads; ++h)
      for (int64_t d = 0; d < layout.head_dim; ++d) *next++ = element(src[m], h, d);
  next = staged.data();
  for (int64_t m = 0; m < moves; ++m)
    for (int64_t h = 0; h < layout.kv_heads; ++h)
      for (int64_t d = 0; d < layout.head_dim; ++d) element(dst[m], h, d) = *next++;
}

// kernels.reference.kv.compact_kv for packed pools: in each pool, entry src_slots[i] to dst_slots[i] ([M] each).
void compact_kv(at::TensorList pools, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  TORCH_CHECK(src_slots.dim() == 1 && dst_slots.sizes() == src_slots.sizes() &&
                  src_slots.scalar_type() == at::kLong && dst_slots.scalar_type() == at::kLong &&
                  src_slots.is_contiguous() && dst_slots.is_contiguous(),
              "src_slots and dst_slots must be contiguous int64 [M]");
  for (const at::Tensor& pool : pools) {
    TORCH_CHECK((pool.dim() == 5 || pool.dim() == 4) && pool.is_contiguous() && pool.device().is_cpu(),
                "packed contiguous CPU pools expected: keys [blocks, KV, Dh / P, block_size, P], values [blocks, "
                "KV, block_size / P, Dh * P]");
  }
  const int64_t moves = src_slots.size(0);
  if (moves == 0) return;
  const int64_t* src = src_slots.data_ptr<int64_t>();
  const int64_t* dst = dst_slots.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(pools.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const at::Tensor& pool = pools[i];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, pool.scalar_type(), "compact_kv", [&] {
        move_entries(pool.data_ptr<scalar_t>(), PackedLayout(pool), src, dst, moves);
      });
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specd, m) {
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor keys, Tensor values, Tensor slots) -> ()");
  m.def("compact_kv(Tensor(a!)[] pools, Tensor src_slots, Tensor dst_slots) -> ()");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("compact_kv", &compact_kv);
}
