// Intel AMX tile registers for the bf16 kernels: the compile-time switch, the process's permission,
// and a tile configuration held by the calling thread while in scope.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SPECD_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <initializer_list>

namespace specd_cpu {

// Linux lends the tile registers to a process that asks; asked once, the answer kept for good.
inline bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// The 8 tiles' shapes on the calling thread while in scope: 16 rows of 64 bytes each unless listed.
class TileRegisters {
 public:
  struct Shape {
    int tile;
    uint8_t rows;
    uint16_t bytes_per_row;
  };

  explicit TileRegisters(std::initializer_list<Shape> changes = {}) {
    struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_per_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int tile = 0; tile < 8; ++tile) {
      config.bytes_per_row[tile] = 64;
      config.rows[tile] = 16;
    }
    for (const Shape& shape : changes) {
      config.bytes_per_row[shape.tile] = shape.bytes_per_row;
      config.rows[shape.tile] = shape.rows;
    }
    _tile_loadconfig(&config);
  }
  ~TileRegisters() { _tile_release(); }
  TileRegisters(const TileRegisters&) = delete;
  TileRegisters& operator=(const TileRegisters&) = delete;
};

}  // namespace specd_cpu
#endif
