// 16-lane fp32 vectors and the loads, sums and exp the CPU kernels share.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace specd_cpu {

// Explicit 16-lane vectors (GCC/Clang vector extensions): one AVX-512 register, two AVX2
// ones, or whatever the target has.
constexpr int64_t kLanes = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef _Float16 f16x16 __attribute__((vector_size(32)));

// Without AVX-512 no register holds an f32x16: GCC keeps such values in memory, and a loop adding into
// them goes through the stack at every step. Hot loops there may work on 8-lane halves instead, in
// registers (see TileAttention::kHalves).
typedef float f32x8 __attribute__((vector_size(32)));
inline f32x8 load_half(const f32x16& v, int h) {
  f32x8 part;
  std::memcpy(&part, reinterpret_cast<const char*>(&v) + h * sizeof(part), sizeof(part));
  return part;
}
inline void store_half(f32x16& v, int h, f32x8 part) {
  std::memcpy(reinterpret_cast<char*>(&v) + h * sizeof(part), &part, sizeof(part));
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T, typename F>
inline T bitcast(const F& from) {
  T to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// 16 contiguous values as fp32.
inline f32x16 load16(const float* p) { return bitcast<f32x16>(*reinterpret_cast<const float(*)[16]>(p)); }
inline f32x16 load16(const c10::BFloat16* p) {
#ifdef __AVX512F__  // one widening load; the portable form below compiles to four instructions
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bitcast<f32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  return bitcast<f32x16>(__builtin_convertvector(bitcast<u16x16>(*reinterpret_cast<const uint16_t(*)[16]>(p)),
                                                 u32x16) << 16);
#endif
}
inline f32x16 load16(const c10::Half* p) {
  return __builtin_convertvector(bitcast<f16x16>(*reinterpret_cast<const uint16_t(*)[16]>(p)), f32x16);
}

// Values d .. d+15 of a row of `n` as fp32, zeros past its end.
template <typename scalar_t>
inline f32x16 load_part(const scalar_t* row, int64_t d, int64_t n) {
  if (d + kLanes <= n) return load16(row + d);
  float tail[kLanes] = {};
  for (int64_t i = 0; d + i < n; ++i) tail[i] = static_cast<float>(row[d + i]);
  return bitcast<f32x16>(tail);
}

// v rounded to the nearest even bf16, still in the upper 16 bits of each lane; NaN stays NaN.
inline u32x16 bf16_bits(f32x16 v) {
  const u32x16 bits = bitcast<u32x16>(v);
  const u32x16 nan = bitcast<u32x16>(v != v);
  return ((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u & ~nan) | (0x7FC00000u & nan);
}

// v as the given type holds it: what storing it and loading it back gives.
template <typename scalar_t>
inline f32x16 rounded(f32x16 v);
template <>
inline f32x16 rounded<float>(f32x16 v) { return v; }
template <>
inline f32x16 rounded<c10::BFloat16>(f32x16 v) { return bitcast<f32x16>(bf16_bits(v)); }
template <>
inline f32x16 rounded<c10::Half>(f32x16 v) {
  return __builtin_convertvector(__builtin_convertvector(v, f16x16), f32x16);
}

// 16 values, rounded to nearest even.
inline void store16(f32x16 v, float* dst) { std::memcpy(dst, &v, sizeof(v)); }
inline void store16(f32x16 v, c10::BFloat16* dst) {
  const u16x16 halves = __builtin_convertvector(bf16_bits(v) >> 16, u16x16);
  std::memcpy(dst, &halves, sizeof(halves));
}
inline void store16(f32x16 v, c10::Half* dst) {
  const f16x16 halves = __builtin_convertvector(v, f16x16);
  std::memcpy(dst, &halves, sizeof(halves));
}

// Lanes 0 .. n-1 (at most 16) of v, rounded to the destination's type.
template <typename scalar_t>
inline void store_part(f32x16 v, scalar_t* dst, int64_t n) {
  if (n >= kLanes) return store16(v, dst);
  scalar_t lanes[kLanes];
  store16(v, lanes);
  std::copy_n(lanes, n, dst);
}

// Row of `n` values as ceil(n / 16) vectors, the tail padded with zeros.
template <typename scalar_t>
inline void load_row(const scalar_t* src, int64_t n, f32x16* dst) {
  for (int64_t d = 0; d < n; d += kLanes) dst[d / kLanes] = load_part(src, d, n);
}

// Sum of the 16 lanes, always in the same order: halves added lane by lane, 8 + 8, 4 + 4, 2 + 2, 1 + 1.
inline float lane_sum(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(v);  // the same tree, by shuffles
#endif
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

// Largest of the 16 lanes.
inline float lane_max(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_max_ps(v);
#endif
  float most = v[0];
  for (int64_t j = 1; j < kLanes; ++j) most = std::max(most, v[j]);
  return most;
}

// exp(x) for x <= 0, lane-wise (Cephes' expf, ~1 ulp). exp(0) is exactly 1, exp(-inf) exactly 0.
inline f32x16 exp_nonpositive(f32x16 x) {
  const i32x16 masked = x == kNegInf;
  x = x < -87.0f ? f32x16{} - 87.0f : x;
  const f32x16 y = x * 1.44269504088896341f + 0.5f;
  i32x16 n = __builtin_convertvector(y, i32x16);  // truncates; floor for the negative y below
  n += __builtin_convertvector(n, f32x16) > y;    // a true comparison is -1
  const f32x16 nf = __builtin_convertvector(n, f32x16);
  const f32x16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f32x16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const f32x16 result = p * bitcast<f32x16>((n + 127) << 23);
  return bitcast<f32x16>(bitcast<i32x16>(result) & ~masked);
}

}  // namespace specd_cpu
