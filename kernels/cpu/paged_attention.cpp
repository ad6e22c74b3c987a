// Paged attention on CPU: every query reads its sequence's keys and values in place,
// through the block table, with no copy of the cache.
//
// Batch invariant by construction: each query's result is computed by the same
// instructions in the same order (keys in fixed chunks of kChunk positions, an
// online softmax over the chunks, fp32 throughout) whatever else is in the batch,
// however many queries its sequence brings and however the work is split across
// threads. Masked keys contribute exact zeros, so a token decoded alone and the
// same token verified among drafts get bit-identical outputs.
//
// Layout (see kernels/reference/attention.py, the specification):
//   query [T, H, Dh] (rows may be strided); key_cache, value_cache [num_slots, KV, Dh] with slot =
//   block * block_size + offset; block_tables [B, W]; query_start [B+1] (sequence b
//   owns query rows query_start[b] .. query_start[b+1]-1, its new tokens, whose
//   K/V already sit at positions context_start[b] + i); tree_offsets [B]: -1 for
//   a chain (new token i sees positions 0 .. context_start + i), else the offset
//   of the sequence's n x n ancestor mask in tree_mask (new token i sees the
//   cached prefix and the new tokens j with tree_mask[offset + i*n + j]).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;      // key positions scored together: one AVX-512 register of fp32
constexpr int64_t kQueryTile = 8;   // queries of one sequence sharing every key they load
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 from arithmetic alone, so loops over it vectorise (Cephes' expf:
// ~1 ulp). exp(0) is exactly 1 and exp(-inf) exactly 0.
inline float exp_nonpositive(float x) {
  const bool masked = x == kNegInf;
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return masked ? 0.0f : p * two_n;
}

struct Problem {
  int64_t num_heads, num_kv_heads, head_dim, block_size, table_width;
  int64_t query_stride;  // between query rows: queries may be a slice of a wider projection
  float scale;
  const int64_t* block_tables;
  const int64_t* query_start;
  const int64_t* context_start;
  const int64_t* tree_offsets;
  const bool* tree_mask;  // nullptr when every sequence is a chain
};

// One unit of work: queries [first, last) of sequence `seq`, for the query heads of one KV head.
struct Tile {
  int64_t seq, kv_head, first, last, cost;
};

class TileAttention {
 public:
  TileAttention(const Problem& p, const Tile& t)
      : p_(p), t_(t),
        group_(p.num_heads / p.num_kv_heads),
        rows_((t.last - t.first) * group_),
        start_(p.context_start[t.seq]),
        num_new_(p.query_start[t.seq + 1] - p.query_start[t.seq]),
        tree_(p.tree_offsets[t.seq]),
        table_(p.block_tables + t.seq * p.table_width),
        q_(rows_ * p.head_dim), acc_(rows_ * p.head_dim, 0.0f), max_(rows_, kNegInf), sum_(rows_, 0.0f),
        keys_t_(p.head_dim * kChunk), values_(kChunk * p.head_dim), visible_((t.last - t.first) * kChunk) {}

  template <typename scalar_t>
  void run(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache, scalar_t* out) {
    load_queries(query);
    const int64_t limit = tree_ < 0 ? start_ + (t_.last - t_.first) + (t_.first - p_.query_start[t_.seq])
                                    : start_ + num_new_;  // past every position a query of the tile sees
    for (int64_t chunk = 0; chunk < limit; chunk += kChunk) {
      load_chunk(key_cache, value_cache, chunk, limit);
      mark_visible(chunk, limit);
      for (int64_t r = 0; r < rows_; ++r) attend_chunk(r);
    }
    store(out);
  }

 private:
  int64_t query_row(int64_t local) const { return p_.query_start[t_.seq] + local; }  // local: index among new tokens
  int64_t first_local() const { return t_.first - p_.query_start[t_.seq]; }

  template <typename scalar_t>
  void load_queries(const scalar_t* query) {
    const int64_t dh = p_.head_dim;
    for (int64_t i = 0; i < t_.last - t_.first; ++i) {
      for (int64_t g = 0; g < group_; ++g) {
        const scalar_t* src = query + (t_.first + i) * p_.query_stride + (t_.kv_head * group_ + g) * dh;
        float* dst = q_.data() + (i * group_ + g) * dh;
        for (int64_t d = 0; d < dh; ++d) dst[d] = static_cast<float>(src[d]) * p_.scale;
      }
    }
  }

  template <typename scalar_t>
  void load_chunk(const scalar_t* key_cache, const scalar_t* value_cache, int64_t chunk, int64_t limit) {
    const int64_t dh = p_.head_dim;
    for (int64_t j = 0; j < kChunk; ++j) {
      const int64_t pos = chunk + j;
      float* v = values_.data() + j * dh;
      if (pos >= limit) {
        for (int64_t d = 0; d < dh; ++d) keys_t_[d * kChunk + j] = 0.0f;
        std::fill(v, v + dh, 0.0f);
        continue;
      }
      const int64_t slot = table_[pos / p_.block_size] * p_.block_size + pos % p_.block_size;
      const int64_t base = (slot * p_.num_kv_heads + t_.kv_head) * dh;
      for (int64_t d = 0; d < dh; ++d) keys_t_[d * kChunk + j] = static_cast<float>(key_cache[base + d]);
      for (int64_t d = 0; d < dh; ++d) v[d] = static_cast<float>(value_cache[base + d]);
    }
  }

  void mark_visible(int64_t chunk, int64_t limit) {
    for (int64_t i = 0; i < t_.last - t_.first; ++i) {
      const int64_t local = first_local() + i;
      for (int64_t j = 0; j < kChunk; ++j) {
        const int64_t pos = chunk + j;
        bool sees;
        if (pos >= limit) {
          sees = false;
        } else if (tree_ < 0) {
          sees = pos <= start_ + local;
        } else {
          sees = pos < start_ || p_.tree_mask[tree_ + local * num_new_ + (pos - start_)];
        }
        visible_[i * kChunk + j] = sees;
      }
    }
  }

  // Online softmax over one more chunk of keys for query vector r.
  void attend_chunk(int64_t r) {
    const int64_t dh = p_.head_dim;
    const float* q = q_.data() + r * dh;
    const uint8_t* visible = visible_.data() + (r / group_) * kChunk;
    float score[kChunk] = {};
    for (int64_t d = 0; d < dh; ++d) {
      const float qd = q[d];
      const float* k = keys_t_.data() + d * kChunk;
      for (int64_t j = 0; j < kChunk; ++j) score[j] += qd * k[j];
    }
    float chunk_max = kNegInf;
    for (int64_t j = 0; j < kChunk; ++j) {
      score[j] = visible[j] ? score[j] : kNegInf;
      chunk_max = std::max(chunk_max, score[j]);
    }
    if (chunk_max == kNegInf) return;  // nothing visible here: this query's state stays exactly as it was
    const float new_max = std::max(max_[r], chunk_max);
    const float rescale = exp_nonpositive(max_[r] - new_max);  // 0 for the first visible chunk
    float weight[kChunk];
    for (int64_t j = 0; j < kChunk; ++j) weight[j] = exp_nonpositive(score[j] - new_max);
    float total = 0.0f;
    for (int64_t j = 0; j < kChunk; ++j) total += weight[j];
    max_[r] = new_max;
    sum_[r] = sum_[r] * rescale + total;
    float* acc = acc_.data() + r * dh;
    for (int64_t d = 0; d < dh; ++d) acc[d] *= rescale;
    for (int64_t j = 0; j < kChunk; ++j) {
      const float w = weight[j];
      const float* v = values_.data() + j * dh;
      for (int64_t d = 0; d < dh; ++d) acc[d] += w * v[d];
    }
  }

  template <typename scalar_t>
  void store(scalar_t* out) const {
    const int64_t dh = p_.head_dim;
    for (int64_t i = 0; i < t_.last - t_.first; ++i) {
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t r = i * group_ + g;
        const float inv = 1.0f / sum_[r];
        scalar_t* dst = out + ((t_.first + i) * p_.num_heads + t_.kv_head * group_ + g) * dh;
        for (int64_t d = 0; d < dh; ++d) dst[d] = static_cast<scalar_t>(acc_[r * dh + d] * inv);
      }
    }
  }

  const Problem& p_;
  const Tile& t_;
  const int64_t group_, rows_, start_, num_new_, tree_;
  const int64_t* table_;
  std::vector<float> q_, acc_, max_, sum_, keys_t_, values_;
  std::vector<uint8_t> visible_;
};

std::vector<Tile> tiles_by_cost(const Problem& p, int64_t num_seqs) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t first = p.query_start[b], last = p.query_start[b + 1];
    for (int64_t q = first; q < last; q += kQueryTile) {
      const int64_t end = std::min(q + kQueryTile, last);
      const int64_t keys = p.context_start[b] + (p.tree_offsets[b] < 0 ? end - first : last - first);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) tiles.push_back({b, h, q, end, keys * (end - q)});
    }
  }
  // Largest first, handed out one at a time: the threads finish together.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_start, const c10::optional<at::Tensor>& tree_mask,
                           const at::Tensor& tree_offsets, int64_t block_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3, "query [T, H, Dh] and caches [slots, KV, Dh] expected");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "each query row's heads must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == key_cache.size(2), "query and cache head_dim differ");
  for (const at::Tensor* t : {&block_tables, &query_start, &context_start, &tree_offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  }
  const int64_t num_seqs = context_start.numel();
  TORCH_CHECK(query_start.numel() == num_seqs + 1 && tree_offsets.numel() == num_seqs &&
                  block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "one block table, context start and tree offset per sequence; query_start [B+1]");
  at::Tensor mask;
  if (tree_mask.has_value()) {
    mask = tree_mask->to(at::kBool).contiguous();
  }
  const Problem problem{query.size(1), key_cache.size(1), query.size(2), block_size, block_tables.size(1),
                        query.stride(0), static_cast<float>(scale), block_tables.data_ptr<int64_t>(),
                        query_start.data_ptr<int64_t>(), context_start.data_ptr<int64_t>(),
                        tree_offsets.data_ptr<int64_t>(), mask.defined() ? mask.data_ptr<bool>() : nullptr};
  const std::vector<Tile> tiles = tiles_by_cost(problem, num_seqs);
  at::Tensor out = at::empty(query.sizes(), query.options());
  std::atomic<size_t> next{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = key_cache.data_ptr<scalar_t>();
    const scalar_t* v = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
    at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t begin, int64_t end) {
      for (int64_t worker = begin; worker < end; ++worker) {
        for (size_t i = next++; i < tiles.size(); i = next++) {
          TileAttention(problem, tiles[i]).run(q, k, v, o);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specd, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start, Tensor context_start, Tensor? tree_mask, Tensor tree_offsets, int block_size, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("paged_attention", &paged_attention); }
