// Paged attention on CPU: every query reads its sequence's keys and values in place,
// through the block table, with no copy of the cache.
//
// Batch invariant by construction: each query's result is computed by the same
// instructions in the same order (keys in fixed chunks of 64 positions, an
// online softmax over the chunks, fp32 accumulation, one formulation per dtype on a
// given machine) whatever else is in the batch, however many queries its sequence
// brings and however the work is split across threads. Masked keys contribute exact zeros, so a token decoded alone and the
// same token verified among drafts get bit-identical outputs.
//
// Layout (see kernels/reference/attention.py, the specification, and kernels/layout.py):
//   query [T, H, Dh] (rows may be strided); key_cache packed [num_blocks, KV, Dh / P, block_size, P]
//   (P = 4 / sizeof(element): the keys of a block are dimension-major, P dims to a 32-bit lane, so 16
//   positions' next P dims are one 64-byte load); value_cache packed [num_blocks, KV, block_size / P,
//   Dh * P] (each dim of P consecutive positions side by side); slot = block * block_size + offset;
//   block_tables [B, W]; query_start [B+1] (sequence b owns query rows query_start[b] ..
//   query_start[b+1]-1, its new tokens, whose K/V already sit at positions context_start[b] + i);
//   tree_offsets [B]: -1 for
//   a chain (new token i sees positions 0 .. context_start + i), else the offset
//   of the sequence's n x n ancestor mask in tree_mask (new token i sees the
//   cached prefix and the new tokens j with tree_mask[offset + i*n + j]).
//
// A tree query is computed as the chain its path will become: its ancestors (and itself) are read as
// if at positions context_start, context_start + 1, ... (their keys and values gathered there), so its
// keys meet the same lanes and 64-key chunks as when the accepted path, moved into place, is decoded
// on; its output is bit-identical to that.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <torch/library.h>

#include "amx.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace specd_cpu;

constexpr int64_t kQueryTile = 32;  // queries of one sequence sharing every key they load
constexpr int64_t kRowGroup = 4;   // query vectors scored and weighted together
constexpr int64_t kSubChunks = 4;  // key positions come in chunks of 4 x 16: one online-softmax update each
constexpr int64_t kChunk = kSubChunks * kLanes;
constexpr int64_t kMaxVecs = 16;   // head_dim up to 256
typedef f32x16 Scores[kSubChunks];
constexpr int64_t kTileRows = 16;  // query rows per AMX tile (see below)

#ifdef SPECD_AMX
// AMX: bf16 attention as tile products of up to 16 query rows at a time. Scores: tile 1 holds a 32-dim
// slice of 16 query rows, tile 2 the same 32 dims of 16 positions (16 rows of the packed key block,
// each a position's dim pair side by side, the layout the instruction reads), tile 0 their 16 x 16
// fp32 products. Values: tile 3 holds 16 rows' weights (bf16) for 16 positions, tile 4 16 dims of
// those positions (8 rows of the packed value block, each dim's position pair side by side), tiles
// 0, 5, 6, 7 the products for 64 dims. Each output is its own dot product, so a row's results do not
// depend on the other rows.
constexpr int64_t kTileDims = 32, kValueTileDims = 64;
#endif

// Elements per 32-bit lane of the packed key cache: the P of its [blocks, KV, Dh / P, block_size, P].
template <typename scalar_t>
constexpr int64_t kPack = 4 / sizeof(scalar_t);

// One 64-byte group of a packed key block: the next kPack dims of 16 positions, one vector per dim.
inline void unpack_keys(const float* group, f32x16* dims) { dims[0] = load16(group); }
inline void unpack_keys(const c10::BFloat16* group, f32x16* dims) {
  const u32x16 lanes = bitcast<u32x16>(*reinterpret_cast<const uint32_t(*)[16]>(group));
  dims[0] = bitcast<f32x16>(lanes << 16);  // the low half of a lane is the even dim
  dims[1] = bitcast<f32x16>(lanes & 0xFFFF0000u);
}
inline void unpack_keys(const c10::Half* group, f32x16* dims) {
  const u32x16 lanes = bitcast<u32x16>(*reinterpret_cast<const uint32_t(*)[16]>(group));
  dims[0] = __builtin_convertvector(bitcast<f16x16>(__builtin_convertvector(lanes & 0xFFFFu, u16x16)), f32x16);
  dims[1] = __builtin_convertvector(bitcast<f16x16>(__builtin_convertvector(lanes >> 16, u16x16)), f32x16);
}

// One position's values as fp32 vectors, 16 dims to a vector (zeros past the n dims), from the row of
// its P positions in the packed value cache (each dim's P values side by side); `lane` picks the position.
inline void load_values(const float* row, int64_t, int64_t n, f32x16* dst) { load_row(row, n, dst); }
template <typename scalar_t>
inline void load_values(const scalar_t* row, int64_t lane, int64_t n, f32x16* dst) {
  for (int64_t d = 0; d < n; d += kLanes) {
    if (d + kLanes <= n) {
      f32x16 both[2];
      unpack_keys(row + 2 * d, both);  // the same lane split as a key group: position 0 low, 1 high
      dst[d / kLanes] = both[lane];
    } else {
      float tail[kLanes] = {};
      for (int64_t i = 0; d + i < n; ++i) tail[i] = static_cast<float>(row[2 * (d + i) + lane]);
      dst[d / kLanes] = bitcast<f32x16>(tail);
    }
  }
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
  bool amx;               // bf16 scores by AMX tile products (see TileRegisters)
};

// One unit of work: queries [first, last) of sequence `seq`, for the query heads of KV heads
// [kv_head, kv_head_end).
struct Tile {
  int64_t seq, kv_head, kv_head_end, first, last, cost;
};

// Online softmax attention of one tile's query vectors for one KV head (each query times each of the KV
// head's query heads: `rows_`) over the keys they see, a chunk of 64 positions at a time. Every row is
// computed by the same instructions in the same order whichever rows it is grouped with.
template <typename scalar_t>
class TileAttention {
  static constexpr int64_t P = kPack<scalar_t>;
#ifdef __AVX512BF16__
  // bf16 scores straight from the packed cache: one instruction multiplies 16 positions' next two dims
  // by the query's and adds both products to the running sums.
  static constexpr bool kDotProducts = std::is_same_v<scalar_t, c10::BFloat16>;
#else
  static constexpr bool kDotProducts = false;
#endif
#ifdef __AVX512F__
  static constexpr bool kHalves = false;
#else
  // The scores' and weighted values' loops on 8-lane halves (f32x8), each lane summed in the same order: a
  // forward of 512 fp32 prompt tokens after 1,024 took 8.8 s with whole vectors, 2.2 s with halves (the
  // kernel built for AVX2 on a Zen 4 EPYC; AVX-512: 1.1 s). Not in bf16: there, with halves, greedy `none`
  // beside other requests differed from `none` alone (tests/e2e/test_bf16_stack.py, 3 runs of 3; with whole
  // vectors 2 of 2 equal), which no runner-level test reproduced; not understood yet. In fp32 without
  // AVX-512 the matmuls are not batch invariant anyway.
  static constexpr bool kHalves = std::is_same_v<scalar_t, float>;
#endif

 public:
  // Sets the object up for one tile's queries of one KV head. Objects are reused tile after tile, so the
  // buffers keep their capacity and a tile allocates nothing once the first few have run.
  void reset(const Problem& p, const Tile& t, int64_t kv_head) {
    p_ = &p;
    t_ = &t;
    kv_head_ = kv_head;
    group_ = p.num_heads / p.num_kv_heads;
    queries_ = t.last - t.first;
    rows_ = queries_ * group_;
    vecs_ = (p.head_dim + kLanes - 1) / kLanes;
    lanes_ = p.head_dim / P;
    start_ = p.context_start[t.seq];
    num_new_ = p.query_start[t.seq + 1] - p.query_start[t.seq];
    first_new_ = t.first - p.query_start[t.seq];
    tree_ = p.tree_offsets[t.seq];
    table_ = p.block_tables + t.seq * p.table_width;
    path_nodes_.clear();
    path_ends_.clear();
    longest_path_ = 0;
    if (tree_ >= 0) {  // each query's ancestors-or-self among the new tokens, root first
      for (int64_t i = 0; i < queries_; ++i) {
        const int64_t path_start = static_cast<int64_t>(path_nodes_.size());
        for (int64_t j = 0; j < num_new_; ++j) {
          if (p.tree_mask[tree_ + (first_new_ + i) * num_new_ + j]) path_nodes_.push_back(j);
        }
        path_ends_.push_back(static_cast<int64_t>(path_nodes_.size()));
        longest_path_ = std::max(longest_path_, path_ends_.back() - path_start);
      }
    }
    follow_path(-1);
    prepared_chunk_ = -1;
    q_.resize(kDotProducts ? 0 : rows_ * p.head_dim);
    q_lanes_.assign(kDotProducts ? (rows_ + kTileRows - 1) / kTileRows * kTileRows * lanes_ : 0, 0);
    acc_.assign(rows_ * vecs_, f32x16{});
    keys_t_.resize(kDotProducts ? 0 : kSubChunks * p.head_dim);
    chunk_values_.resize(p.amx ? 0 : kChunk * vecs_);
    gathered_.resize(p.block_size % kLanes == 0 && tree_ < 0 ? 0 : kSubChunks * kLanes * p.head_dim);
    gathered_values_.resize(tree_ >= 0 ? kSubChunks * kLanes * p.head_dim : 0);
    chunk_scores_.resize(p.amx ? rows_ * kSubChunks : 0);
    rescale_.resize(p.amx ? rows_ : 0);
    weights_.resize(p.amx ? kTileRows * kChunk : 0);
    visible_.resize(queries_ * kSubChunks);
    max_.assign(rows_, kNegInf);
    sum_.assign(rows_, 0.0f);
  }

  // Past every position a query of the tile sees.
  int64_t limit() const { return tree_ < 0 ? start_ + first_new_ + queries_ : start_ + longest_path_; }

  // A chunk of the cached prefix is the same for every query of a tree, and read once for all of them;
  // a chunk holding new tokens is each tree query's own path, read query by query.
  void attend(const scalar_t* key_cache, const scalar_t* value_cache, int64_t chunk) {
    if (tree_ < 0 || chunk + kChunk <= start_) return attend_queries(key_cache, value_cache, chunk, 0, queries_);
    for (int64_t i = 0; i < queries_; ++i) {
      follow_path(i);
      attend_queries(key_cache, value_cache, chunk, i, i + 1);
    }
  }

  void load_queries(const scalar_t* query) {
    for (int64_t i = 0; i < queries_; ++i) {
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t r = i * group_ + g;
        const scalar_t* src = query + (t_->first + i) * p_->query_stride + (kv_head_ * group_ + g) * p_->head_dim;
        if constexpr (kDotProducts) {  // read as stored by the dot products and tiles
          std::memcpy(&q_lanes_[r * lanes_], src, lanes_ * sizeof(uint32_t));
        } else {
          for (int64_t d = 0; d < p_->head_dim; ++d) q_[r * p_->head_dim + d] = static_cast<float>(src[d]) * p_->scale;
        }
      }
    }
  }

  void store(scalar_t* out) const {
    for (int64_t i = 0; i < queries_; ++i) {
      for (int64_t g = 0; g < group_; ++g) {
        const int64_t r = i * group_ + g;
        scalar_t* dst = out + ((t_->first + i) * p_->num_heads + kv_head_ * group_ + g) * p_->head_dim;
        for (int64_t v = 0; v < vecs_; ++v) {  // lane-wise division: the same bits as dividing one by one
          store_part(acc_[r * vecs_ + v] / sum_[r], dst + v * kLanes, p_->head_dim - v * kLanes);
        }
      }
    }
  }

 private:
  // Queries first_query .. last_query - 1 of the tile through one chunk (a tree query along the path followed).
  void attend_queries(const scalar_t* key_cache, const scalar_t* value_cache, int64_t chunk, int64_t first_query,
                      int64_t last_query) {
    count_ = std::min(kChunk, query_limit(last_query - 1) - chunk);
    if (count_ <= 0) return;  // a tree query whose path ends before the chunk: nothing here for it
    chunk_ = chunk;
    find_keys(key_cache, chunk);
    find_values(value_cache, chunk);
    mark_visible(chunk, first_query, last_query);
    if (p_->amx) return attend_tiles();  // every row of the tile: AMX tiles hold one tree query (tiles_by_cost)
    // A tree's queries go through the chunk holding its new tokens one after another: what the previous one
    // converted of the sub-chunks before the new tokens, read in place by every query, is still here.
    const int64_t kept = chunk == prepared_chunk_ ? cached_sub_chunks(chunk) : 0;
    if constexpr (!kDotProducts) unpack_chunk(kept);
    convert_values(kept * kLanes);
    prepared_chunk_ = chunk;
    for (int64_t r = first_query * group_; r < last_query * group_; r += kRowGroup) {
      switch (std::min(kRowGroup, last_query * group_ - r)) {
        case 1: attend_rows<1>(r); break;
        case 2: attend_rows<2>(r); break;
        case 3: attend_rows<3>(r); break;
        default: attend_rows<4>(r); break;
      }
    }
  }

  // Past every position query i of the tile sees; for a tree query, the path it follows is laid out from
  // start_ (follow_path), so that is past its path's last node. Before any path is followed (the chunks of
  // the cached prefix, which come first) all queries' limits lie beyond the chunk.
  int64_t query_limit(int64_t i) const {
    if (tree_ < 0) return start_ + first_new_ + i + 1;
    return path_ == nullptr ? limit() : start_ + path_length_;
  }

  // Reads the new tokens along tree query i's path (-1: along none, for the cached prefix alone).
  void follow_path(int64_t i) {
    remapped_ = false;
    path_ = nullptr;
    path_length_ = 0;
    if (i < 0) return;
    const int64_t begin = i == 0 ? 0 : path_ends_[i - 1];
    path_ = &path_nodes_[begin];
    path_length_ = path_ends_[i] - begin;
    for (int64_t k = 0; k < path_length_; ++k) remapped_ |= path_[k] != k;
  }

  // Where each 16-position sub-chunk's packed keys are: groups_[c] points at its first group of P dims
  // (16 * P values), the next groups stride_[c] values apart. Where a block holds whole sub-chunks
  // (block_size a multiple of 16) that is the cache itself; otherwise the positions are gathered into
  // gathered_. nullptr: the sub-chunk starts past the limit.
  void find_keys(const scalar_t* key_cache, int64_t chunk) {
    const int64_t block_values = p_->head_dim * p_->block_size;  // of one KV head of one block
    auto head_block = [&](int64_t position) {
      return key_cache + (table_[position / p_->block_size] * p_->num_kv_heads + kv_head_) * block_values;
    };
    for (int64_t c = 0; c < kSubChunks; ++c) {
      const int64_t first = chunk + c * kLanes;
      if (first >= chunk + count_) {
        groups_[c] = nullptr;
      } else if (p_->block_size % kLanes == 0 && !moved(first + kLanes - 1)) {
        groups_[c] = head_block(first) + first % p_->block_size * P;
        stride_[c] = p_->block_size * P;
      } else {
        scalar_t* dst = &gathered_[c * kLanes * p_->head_dim];
        for (int64_t j = 0; j < kLanes; ++j) {
          const int64_t position = slot_position(std::min(first + j, chunk + count_ - 1));  // past the limit: never seen
          const scalar_t* src = head_block(position) + position % p_->block_size * P;
          for (int64_t g = 0; g < lanes_; ++g) std::copy_n(src + g * p_->block_size * P, P, dst + (g * kLanes + j) * P);
        }
        groups_[c] = dst;
        stride_[c] = kLanes * P;
      }
    }
  }

  // Each of the chunk's positions' row of P positions in the packed value cache (its lane: position % P).
  void find_values(const scalar_t* value_cache, int64_t chunk) {
    if (moved(chunk + kChunk - 1)) return gather_values(value_cache, chunk);
    int64_t block = chunk / p_->block_size, offset = chunk % p_->block_size;  // walked, not divided, per key
    for (int64_t j = 0; j < count_; ++j) {
      value_rows_[j] = value_cache + ((table_[block] * p_->num_kv_heads + kv_head_) * p_->block_size + offset / P * P) *
                                         p_->head_dim;
      if (++offset == p_->block_size) {
        offset = 0;
        ++block;
      }
    }
  }

  // A tree query's chunk: each position's values copied from where the path's node sits to where the
  // position would be in a block of the value cache (gathered_values_, 16 positions a sub-chunk), so the
  // weighted sums read them in the same order and lanes as from the cache. A sub-chunk wholly before the
  // new tokens is read in place, as find_keys reads its keys.
  void gather_values(const scalar_t* value_cache, int64_t chunk) {
    const int64_t row = p_->head_dim * P;  // values of P positions, each dim's side by side
    const int64_t in_place = cached_sub_chunks(chunk) * kLanes;
    for (int64_t j = 0; j < count_; ++j) {
      const int64_t position = slot_position(chunk + j);
      const scalar_t* src = value_cache + ((table_[position / p_->block_size] * p_->num_kv_heads + kv_head_) *
                                               p_->block_size + position % p_->block_size / P * P) * p_->head_dim;
      if (j < in_place) {
        value_rows_[j] = src;
        continue;
      }
      scalar_t* dst = &gathered_values_[(j / P) * row];
      for (int64_t d = 0; d < p_->head_dim; ++d) dst[d * P + j % P] = src[d * P + position % P];
      value_rows_[j] = dst;
    }
  }

  // Where the key or value of `position` sits: itself, or for a tree query's path, the node's slot.
  int64_t slot_position(int64_t position) const {
    return remapped_ && position >= start_ ? start_ + path_[position - start_] : position;
  }

  // Whether any position up to `last` is read from elsewhere (a tree path off its positions).
  bool moved(int64_t last) const { return remapped_ && last >= start_; }

  // The chunk's leading sub-chunks that lie wholly before the new tokens: every query reads them in place.
  int64_t cached_sub_chunks(int64_t chunk) const {
    return std::clamp<int64_t>((start_ - chunk) / kLanes, 0, kSubChunks);
  }

  // The chunk's keys as fp32 vectors, for the generic scores (keys_t_[c * Dh + d]: dim d of sub-chunk c).
  // Sub-chunks before `first_sub_chunk` are left as they are.
  void unpack_chunk(int64_t first_sub_chunk) {
    for (int64_t c = first_sub_chunk; c < kSubChunks; ++c) {
      if (groups_[c] == nullptr) continue;  // its positions are never seen
      for (int64_t g = 0; g < lanes_; ++g) unpack_keys(groups_[c] + g * stride_[c], &keys_t_[c * p_->head_dim + g * P]);
    }
  }

  // The chunk's values as fp32 vectors, converted once for all the tile's rows (chunk_values_[j * vecs_ + v]:
  // dims 16 v .. 16 v + 15 of position j); the conversion is exact, so the sums are what they were. Positions
  // before `first` are left as they are.
  void convert_values(int64_t first) {
    for (int64_t j = first; j < count_; ++j) {
      load_values(value_rows_[j], (chunk_ + j) % P, p_->head_dim, &chunk_values_[j * vecs_]);
    }
  }

  // Which of the chunk's positions queries first_query .. last_query - 1 see. Positions before the new tokens
  // are seen by all; a chain query sees up to its own position: both are comparisons, done lane-wise.
  void mark_visible(int64_t chunk, int64_t first_query, int64_t last_query) {
    i32x16 lane;
    for (int32_t j = 0; j < kLanes; ++j) lane[j] = j;
    for (int64_t i = first_query; i < last_query; ++i) {
      // A tree query sees its whole path, laid out as a chain (see follow_path).
      const int64_t last_seen = std::min(chunk + count_, query_limit(i)) - 1;
      for (int64_t c = 0; c < kSubChunks; ++c) {
        const int64_t first = chunk + c * kLanes;
        visible_[i * kSubChunks + c] = lane <= static_cast<int32_t>(std::clamp<int64_t>(last_seen - first, -1, kLanes));
      }
    }
  }

  // N rows (independent chains) through one chunk: scores, softmax weights, weighted values.
  template <int N>
  void attend_rows(int64_t first_row) {
    Scores scores[N] = {};
    if constexpr (kDotProducts) {
      dot_scores<N>(first_row, scores);
    } else {
      fma_scores<N>(first_row, scores);
    }
    float rescale[N];
    bool any = false;
    for (int i = 0; i < N; ++i) any |= softmax(first_row + i, scores[i], rescale[i]);
    if (!any) return;  // nothing visible here: every row's state stays exactly as it was
    switch (vecs_) {  // the value sums in registers for the common head dims
      case 4: return add_values<N, 4>(first_row, scores, rescale);
      case 8: return add_values<N, 8>(first_row, scores, rescale);
      default: return add_values<N, 0>(first_row, scores, rescale);
    }
  }

  // Scores summed over d in order, from the unpacked keys.
  template <int N>
  void fma_scores(int64_t first_row, Scores* scores) const {
    if constexpr (kHalves) return fma_scores_by_halves<N>(first_row, scores);
    const float* q = &q_[first_row * p_->head_dim];
    for (int64_t d = 0; d < p_->head_dim; ++d) {
      for (int64_t c = 0; c < kSubChunks; ++c) {
        const f32x16 keys = keys_t_[c * p_->head_dim + d];
        for (int i = 0; i < N; ++i) scores[i][c] += q[i * p_->head_dim + d] * keys;
      }
    }
  }

  // fma_scores, a half of each sub-chunk's 16 lanes at a time (see kHalves).
  template <int N>
  void fma_scores_by_halves(int64_t first_row, Scores* scores) const {
    const float* q = &q_[first_row * p_->head_dim];
    for (int64_t c = 0; c < kSubChunks; ++c) {
      for (int h = 0; h < 2; ++h) {
        f32x8 sums[N] = {};
        for (int64_t d = 0; d < p_->head_dim; ++d) {
          const f32x8 keys = load_half(keys_t_[c * p_->head_dim + d], h);
          for (int i = 0; i < N; ++i) sums[i] += q[i * p_->head_dim + d] * keys;
        }
        for (int i = 0; i < N; ++i) store_half(scores[i][c], h, sums[i]);
      }
    }
  }

#ifdef __AVX512BF16__
  // Scores summed over pairs of dims in order, even and odd pairs in two running sums added at the end.
  template <int N>
  void dot_scores(int64_t first_row, Scores* scores) const {
    const uint32_t* q = &q_lanes_[first_row * lanes_];
    for (int64_t c = 0; c < kSubChunks; ++c) {
      if (groups_[c] == nullptr) continue;  // never seen: softmax() masks it
      const scalar_t* keys = groups_[c];
      const int64_t stride = stride_[c];
      __m512 even[N], odd[N];
      for (int i = 0; i < N; ++i) even[i] = odd[i] = _mm512_setzero_ps();
      int64_t g = 0;
      for (; g + 1 < lanes_; g += 2) {
        const __m512bh k_even = (__m512bh)_mm512_loadu_si512(keys + g * stride);
        const __m512bh k_odd = (__m512bh)_mm512_loadu_si512(keys + (g + 1) * stride);
        for (int i = 0; i < N; ++i) {
          even[i] = _mm512_dpbf16_ps(even[i], k_even, (__m512bh)_mm512_set1_epi32(q[i * lanes_ + g]));
          odd[i] = _mm512_dpbf16_ps(odd[i], k_odd, (__m512bh)_mm512_set1_epi32(q[i * lanes_ + g + 1]));
        }
      }
      if (g < lanes_) {
        const __m512bh k_last = (__m512bh)_mm512_loadu_si512(keys + g * stride);
        for (int i = 0; i < N; ++i) {
          even[i] = _mm512_dpbf16_ps(even[i], k_last, (__m512bh)_mm512_set1_epi32(q[i * lanes_ + g]));
        }
      }
      for (int i = 0; i < N; ++i) scores[i][c] = bitcast<f32x16>(_mm512_add_ps(even[i], odd[i])) * p_->scale;
    }
  }
#else
  template <int N>
  void dot_scores(int64_t, Scores*) const {}
#endif

#ifdef SPECD_AMX
  // Every row's scores for the chunk (chunk_scores_[r * 4 + c]), 16 rows by 16 positions a tile
  // product, summed over the head dims 32 at a time. Query rows past rows_ are zeros.
  void tile_scores() {
    alignas(64) float tile[kTileRows * kLanes];
    const auto* queries = reinterpret_cast<const uint16_t*>(q_lanes_.data());
    for (int64_t first = 0; first < rows_; first += kTileRows) {
      for (int64_t c = 0; c < kSubChunks; ++c) {
        if (groups_[c] == nullptr) continue;  // never seen: softmax() masks it
        _tile_zero(0);
        for (int64_t d = 0; d < p_->head_dim; d += kTileDims) {
          _tile_loadd(1, queries + first * p_->head_dim + d, p_->head_dim * sizeof(uint16_t));
          _tile_loadd(2, groups_[c] + d / P * stride_[c], stride_[c] * sizeof(scalar_t));
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, kLanes * sizeof(float));
        for (int64_t r = first; r < std::min(first + kTileRows, rows_); ++r) {
          chunk_scores_[r * kSubChunks + c] = load16(&tile[(r - first) * kLanes]) * p_->scale;
        }
      }
    }
  }

  // The whole chunk for every row: the scores, each row's online softmax, then the weighted values,
  // 16 rows by 64 dims a pass, accumulated over the chunk's 16-position sub-chunks.
  void attend_tiles() {
    tile_scores();
    bool any = false;
    for (int64_t r = 0; r < rows_; ++r) {
      any |= softmax(r, *reinterpret_cast<Scores*>(&chunk_scores_[r * kSubChunks]), rescale_[r]);
    }
    if (!any) return;  // nothing visible here: every row's state stays exactly as it was
    alignas(64) float products[4][kTileRows * kLanes];
    const int64_t pair_row = p_->head_dim * P * sizeof(scalar_t);  // bytes between a block's position pairs
    for (int64_t first = 0; first < rows_; first += kTileRows) {
      const int64_t last = std::min(first + kTileRows, rows_);
      for (int64_t r = first; r < last; ++r) {
        for (int64_t c = 0; c < kSubChunks; ++c) {
          store16(chunk_scores_[r * kSubChunks + c], &weights_[(r - first) * kChunk + c * kLanes]);
        }
      }
      for (int64_t d = 0; d < p_->head_dim; d += kValueTileDims) {
        _tile_zero(0);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t c = 0; c < kSubChunks; ++c) {
          if (groups_[c] == nullptr) continue;  // past the limit
          _tile_loadd(3, &weights_[c * kLanes], kChunk * sizeof(scalar_t));
          const scalar_t* values = value_rows_[c * kLanes] + d * P;  // one block holds the 16 positions
          _tile_loadd(4, values, pair_row);
          _tile_dpbf16ps(0, 3, 4);
          _tile_loadd(4, values + kLanes * P, pair_row);
          _tile_dpbf16ps(5, 3, 4);
          _tile_loadd(4, values + 2 * kLanes * P, pair_row);
          _tile_dpbf16ps(6, 3, 4);
          _tile_loadd(4, values + 3 * kLanes * P, pair_row);
          _tile_dpbf16ps(7, 3, 4);
        }
        _tile_stored(0, products[0], kLanes * sizeof(float));
        _tile_stored(5, products[1], kLanes * sizeof(float));
        _tile_stored(6, products[2], kLanes * sizeof(float));
        _tile_stored(7, products[3], kLanes * sizeof(float));
        for (int64_t r = first; r < last; ++r) {
          for (int64_t s = 0; s < 4; ++s) {
            f32x16& acc = acc_[r * vecs_ + d / kLanes + s];
            acc = acc * rescale_[r] + load16(&products[s][(r - first) * kLanes]);
          }
        }
      }
    }
  }
#else
  void attend_tiles() {}
#endif

  // Online softmax: folds one chunk's scores into row r's running max and sum and turns them into the
  // keys' weights; `rescale` is what the row's accumulated values are multiplied by. False (and zero
  // weights) when the row sees nothing here.
  bool softmax(int64_t r, Scores& scores, float& rescale) {
    const i32x16* visible = &visible_[(r / group_) * kSubChunks];
    f32x16 most = f32x16{} + kNegInf;
    for (int64_t c = 0; c < kSubChunks; ++c) {
      scores[c] = visible[c] ? scores[c] : f32x16{} + kNegInf;
      most = most > scores[c] ? most : scores[c];
    }
    const float chunk_max = lane_max(most);
    rescale = 1.0f;
    if (chunk_max == kNegInf) {
      for (int64_t c = 0; c < kSubChunks; ++c) scores[c] = f32x16{};
      return false;
    }
    const float new_max = std::max(max_[r], chunk_max);
    rescale = max_[r] == kNegInf ? 0.0f : exp_nonpositive(f32x16{} + (max_[r] - new_max))[0];
    f32x16 total{};
    for (int64_t c = 0; c < kSubChunks; ++c) {
      scores[c] = exp_nonpositive(scores[c] - new_max);  // now the keys' weights
      total += scores[c];
    }
    max_[r] = new_max;
    sum_[r] = sum_[r] * rescale + lane_sum(total);
    return true;
  }

  // acc = acc * rescale + the chunk's values weighted, summed over positions in order. VECS: the vectors
  // per row, 0 = vecs_.
  template <int N, int VECS>
  void add_values(int64_t first_row, const Scores* weights, const float* rescale) {
    if constexpr (kHalves) return add_values_by_halves<N>(first_row, weights, rescale);
    constexpr int64_t kMost = VECS ? VECS : kMaxVecs;
    const int64_t vecs = VECS ? VECS : vecs_;
    float w[N][kChunk];
    std::memcpy(w, weights, sizeof(w));
    f32x16 sums[N][kMost];
    for (int i = 0; i < N; ++i) {
      for (int64_t v = 0; v < vecs; ++v) sums[i][v] = f32x16{};
    }
    for (int64_t j = 0; j < count_; ++j) {
      const f32x16* values = &chunk_values_[j * vecs_];
      for (int i = 0; i < N; ++i) {
        for (int64_t v = 0; v < vecs; ++v) sums[i][v] += w[i][j] * values[v];
      }
    }
    for (int i = 0; i < N; ++i) {
      f32x16* acc = &acc_[(first_row + i) * vecs_];
      for (int64_t v = 0; v < vecs; ++v) acc[v] = acc[v] * rescale[i] + sums[i][v];
    }
  }

  // add_values, a half of each 16-dim vector at a time (see kHalves).
  template <int N>
  void add_values_by_halves(int64_t first_row, const Scores* weights, const float* rescale) {
    float w[N][kChunk];
    std::memcpy(w, weights, sizeof(w));
    for (int64_t v = 0; v < vecs_; ++v) {
      for (int h = 0; h < 2; ++h) {
        f32x8 sums[N] = {};
        for (int64_t j = 0; j < count_; ++j) {
          const f32x8 values = load_half(chunk_values_[j * vecs_ + v], h);
          for (int i = 0; i < N; ++i) sums[i] += w[i][j] * values;
        }
        for (int i = 0; i < N; ++i) {
          f32x16& acc = acc_[(first_row + i) * vecs_ + v];
          store_half(acc, h, load_half(acc, h) * rescale[i] + sums[i]);
        }
      }
    }
  }

  const Problem* p_ = nullptr;
  const Tile* t_ = nullptr;
  int64_t kv_head_ = 0;
  int64_t group_ = 0, queries_ = 0, rows_ = 0, vecs_ = 0, lanes_ = 0, start_ = 0, num_new_ = 0, first_new_ = 0, tree_ = 0;
  const int64_t* table_ = nullptr;
  std::vector<float> q_;                    // for the FMA scores, [rows][Dh], scaled
  std::vector<uint32_t> q_lanes_;           // for dot products and tiles, [rows padded to 16][Dh / P] as stored
  std::vector<f32x16> acc_, keys_t_;        // [rows][vecs]; [4][Dh] (see unpack_chunk)
  std::vector<f32x16> chunk_values_;        // [64][vecs] (see convert_values)
  std::vector<scalar_t> gathered_;          // [4][Dh / P][16][P] (see find_keys)
  std::vector<scalar_t> gathered_values_;   // a tree path's values, [4 * 16 / P][Dh * P] (see gather_values)
  std::vector<int64_t> path_nodes_;         // each tree query's ancestors-or-self among the new tokens, root first
  std::vector<int64_t> path_ends_;          // [queries]: where each query's path ends in path_nodes_
  int64_t longest_path_ = 0;
  const int64_t* path_ = nullptr;           // the path followed (follow_path), of path_length_ nodes
  int64_t path_length_ = 0;
  bool remapped_ = false;                   // the path is not at its positions (not the first nodes)
  std::vector<f32x16> chunk_scores_;        // with AMX, [rows][4]: the chunk's scores, then weights
  std::vector<float> rescale_;              // with AMX, [rows]: the chunk's rescale of each row's sums
  std::vector<scalar_t> weights_;           // with AMX, [16][64]: a tile's rows' weights as the model dtype
  int64_t chunk_ = 0, count_ = 0;           // the chunk's first position; its positions up to the limit
  int64_t prepared_chunk_ = -1;             // the chunk whose keys and values were last unpacked and converted
  const scalar_t* groups_[kSubChunks];
  int64_t stride_[kSubChunks];
  const scalar_t* value_rows_[kChunk];
  std::vector<i32x16> visible_;             // [queries][4]: which of the chunk's positions each query sees
  std::vector<float> max_, sum_;            // [rows]: the online softmax's running max and sum
};

std::vector<Tile> tiles_by_cost(const Problem& p, int64_t num_seqs, int64_t workers) {
  int64_t query_tiles = 0, total_cost = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t queries = p.query_start[b + 1] - p.query_start[b];
    query_tiles += (queries + kQueryTile - 1) / kQueryTile;
    total_cost += (p.context_start[b] + queries) * queries;
  }
  // Every KV head of a sequence in one tile reads each cached position's K/V rows whole, in order;
  // one KV head per tile only where there would be too few tiles to keep the threads busy...
  const int64_t heads_per_tile = query_tiles >= 4 * workers ? p.num_kv_heads : 1;
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t first = p.query_start[b], last = p.query_start[b + 1];
    // ...or where one sequence holds much of the work in few tiles (a short prompt chunk deep in a long
    // prompt, beside decodes): its queries go in tiles of one KV head, small enough to give every
    // thread a few.
    const bool heavy = (p.context_start[b] + last - first) * (last - first) * 2 * workers > total_cost &&
                       (last - first + kQueryTile - 1) / kQueryTile < 2 * workers;
    const int64_t seq_heads_per_tile = heavy ? 1 : heads_per_tile;
    const int64_t query_tile = p.tree_offsets[b] >= 0 && p.amx ? 1  // AMX: each tree query in its own tiles
                               : heavy ? std::clamp<int64_t>((last - first) * p.num_kv_heads / (4 * workers),
                                                             kRowGroup, kQueryTile)
                                       : kQueryTile;
    for (int64_t q = first; q < last; q += query_tile) {
      const int64_t end = std::min(q + query_tile, last);
      const int64_t keys = p.context_start[b] + (p.tree_offsets[b] < 0 ? end - first : last - first);
      for (int64_t h = 0; h < p.num_kv_heads; h += seq_heads_per_tile) {
        const int64_t heads_end = std::min(h + seq_heads_per_tile, p.num_kv_heads);
        tiles.push_back({b, h, heads_end, q, end, keys * (end - q) * (heads_end - h)});
      }
    }
  }
  // Largest first: the last tiles handed out are the small ones.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

// A tile's KV heads advance chunk by chunk together, so each position's rows are read back to back.
// `heads`: the calling thread's objects, one per KV head of the problem, reused tile after tile.
template <typename scalar_t>
void run_tile(const Problem& problem, const Tile& tile, const scalar_t* q, const scalar_t* k, const scalar_t* v,
              scalar_t* o, std::vector<TileAttention<scalar_t>>& heads) {
  const auto tile_heads = heads.begin(), tile_heads_end = heads.begin() + (tile.kv_head_end - tile.kv_head);
  for (auto head = tile_heads; head != tile_heads_end; ++head) {
    head->reset(problem, tile, tile.kv_head + (head - tile_heads));
    head->load_queries(q);
  }
  for (int64_t chunk = 0; chunk < tile_heads->limit(); chunk += kChunk) {
    for (auto head = tile_heads; head != tile_heads_end; ++head) head->attend(k, v, chunk);
  }
  for (auto head = tile_heads; head != tile_heads_end; ++head) head->store(o);
}

// Tiles handed out one at a time to every thread, so that the threads finish together.
template <typename scalar_t>
void run_tiles(const Problem& problem, const std::vector<Tile>& tiles, const at::Tensor& query,
               const at::Tensor& key_cache, const at::Tensor& value_cache, at::Tensor& out) {
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  std::atomic<size_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tiles.size()));
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t begin, int64_t end) {
#ifdef SPECD_AMX
    std::optional<TileRegisters> registers;
    using Shape = TileRegisters::Shape;
    if (problem.amx) registers.emplace({Shape{3, 16, 32},   // 16 positions' weights, bf16
                                        Shape{4, 8, 64}});  // 8 position pairs; the rest 16 x 64 bytes
#endif
    // Kept by the thread from call to call (a step makes one per layer), so their buffers are allocated once.
    thread_local std::vector<TileAttention<scalar_t>> heads;
    if (static_cast<int64_t>(heads.size()) < problem.num_kv_heads) heads.resize(problem.num_kv_heads);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (size_t i = next++; i < tiles.size(); i = next++) run_tile(problem, tiles[i], q, k, v, o, heads);
    }
  });
}

// AMX where it is compiled in (with AVX512-BF16, whose query form the tiles read too), granted, and
// head dims and blocks fill whole tiles. Fixed for a given model on a given machine, so every query of
// a deployment is scored the same way.
bool uses_amx(const at::Tensor& query, int64_t block_size) {
#ifdef SPECD_AMX
  return query.scalar_type() == at::kBFloat16 && query.size(2) % kValueTileDims == 0 && block_size % kLanes == 0 &&
         amx_granted();
#else
  return false;
#endif
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start,
                           const at::Tensor& context_start, const c10::optional<at::Tensor>& tree_mask,
                           const at::Tensor& tree_offsets, int64_t block_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 5 && value_cache.dim() == 4,
              "query [T, H, Dh], key_cache [blocks, KV, Dh / P, block_size, P], value_cache [blocks, KV, "
              "block_size / P, Dh * P] expected");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "each query row's heads must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(key_cache.size(4) * query.element_size() == 4, "key_cache packs 4 bytes of dims per lane");
  TORCH_CHECK(key_cache.size(1) == value_cache.size(1) && key_cache.size(2) * key_cache.size(4) == query.size(2) &&
                  value_cache.size(3) == query.size(2) * key_cache.size(4) && key_cache.size(3) == block_size &&
                  value_cache.size(2) * key_cache.size(4) == block_size && key_cache.size(0) == value_cache.size(0),
              "key_cache, value_cache and query disagree on KV heads, head_dim or block_size");
  TORCH_CHECK(query.size(1) % value_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) <= kMaxVecs * kLanes, "head_dim above ", kMaxVecs * kLanes);
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
  const Problem problem{query.size(1), value_cache.size(1), query.size(2), block_size, block_tables.size(1),
                        query.stride(0), static_cast<float>(scale), block_tables.data_ptr<int64_t>(),
                        query_start.data_ptr<int64_t>(), context_start.data_ptr<int64_t>(),
                        tree_offsets.data_ptr<int64_t>(), mask.defined() ? mask.data_ptr<bool>() : nullptr,
                        uses_amx(query, block_size)};
  const std::vector<Tile> tiles = tiles_by_cost(problem, num_seqs, at::get_num_threads());
  at::Tensor out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
    case at::kFloat: run_tiles<float>(problem, tiles, query, key_cache, value_cache, out); break;
    case at::kBFloat16: run_tiles<c10::BFloat16>(problem, tiles, query, key_cache, value_cache, out); break;
    case at::kHalf: run_tiles<c10::Half>(problem, tiles, query, key_cache, value_cache, out); break;
    default: TORCH_CHECK(false, "paged_attention takes float32, bfloat16 or float16, not ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specd, m) {
  m.def("paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start, Tensor context_start, Tensor? tree_mask, Tensor tree_offsets, int block_size, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd, CPU, m) { m.impl("paged_attention", &paged_attention); }
