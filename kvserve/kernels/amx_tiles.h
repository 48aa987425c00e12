// The AMX tile operations amx_matmul.cpp uses, behind one thin layer: KVSERVE_TILE_* macros that
// are the real instructions, or, compiled with -DKVSERVE_AMX_EMULATE (tests on CPUs without AMX,
// build.build_amx_emulation), a scalar emulation of their documented semantics.
//
// Tile numbers must be literals: the real instructions name their registers in the encoding.
// KVSERVE_AMX_SUPPORTED says whether this build can run tile code at all; KVSERVE_AMX_TARGET marks
// the functions that execute tile instructions (the library is built for the host's -march, which
// on a CPU without AMX does not enable them, so the target is enabled per function).

#pragma once

#include <cstdint>
#include <cstring>

namespace kvserve::amx {

constexpr int kTileRows = 16;
constexpr int kTileBytes = 64;  // bytes per tile row: 32 bf16 or 16 float32

// The 64-byte operand of LDTILECFG, palette 1: tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// tmm0-7 all 16 rows x 64 bytes: C tiles 16 x 16 float32, A tiles 16 x 32 bf16, B tiles 16
// k-pairs x 16 columns x 2 bf16
inline TileConfig full_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  return config;
}

}  // namespace kvserve::amx

#if defined(KVSERVE_AMX_EMULATE)

// Emulated: 8 tile registers per thread (real tile state is per thread too). TDPBF16PS follows
// the Intel SDM's pseudo-code: for each row m and column n, for each k-pair p in order,
//   c[m][n] += float(a[m][2p]) * float(b[p][2n]);  c[m][n] += float(a[m][2p+1]) * float(b[p][2n+1])
// with bf16 denormal inputs read as zero and denormal results flushed, as the SDM states. Real
// hardware's internal rounding (fused products, order of the two additions) may differ in the
// last bit: the emulation checks the indexing, layouts and staging, not the last bit of a sum.

#define KVSERVE_AMX_SUPPORTED 1
#define KVSERVE_AMX_TARGET

namespace kvserve::amx {

struct EmulatedTiles {
  TileConfig config;
  alignas(64) uint8_t data[8][kTileRows][kTileBytes];
};

inline thread_local EmulatedTiles emulated;

inline void tile_loadconfig(const TileConfig* config) {
  emulated.config = *config;
  std::memset(emulated.data, 0, sizeof(emulated.data));
}

inline void tile_zero(int t) { std::memset(emulated.data[t], 0, sizeof(emulated.data[t])); }

// rows and bytes past the tile's configured shape read as zero, as the hardware's do
inline void tile_loadd(int t, const void* base, int64_t stride) {
  tile_zero(t);
  for (int r = 0; r < emulated.config.rows[t]; ++r)
    std::memcpy(emulated.data[t][r], static_cast<const uint8_t*>(base) + r * stride, emulated.config.colsb[t]);
}

inline void tile_stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < emulated.config.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, emulated.data[t][r], emulated.config.colsb[t]);
}

inline float bf16_input(const uint8_t* at) {
  uint16_t half;
  std::memcpy(&half, at, 2);
  if ((half & 0x7f80) == 0) half &= 0x8000;  // denormal as zero
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

inline float flush_denormal(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7f800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&value, &bits, 4);
  return value;
}

inline void tile_dpbf16ps(int c, int a, int b) {
  const int rows = emulated.config.rows[c], columns = emulated.config.colsb[c] / 4, pairs = emulated.config.colsb[a] / 4;
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < columns; ++n) {
      float sum;
      std::memcpy(&sum, &emulated.data[c][m][4 * n], 4);
      for (int p = 0; p < pairs; ++p) {
        sum += bf16_input(&emulated.data[a][m][4 * p]) * bf16_input(&emulated.data[b][p][4 * n]);
        sum += bf16_input(&emulated.data[a][m][4 * p + 2]) * bf16_input(&emulated.data[b][p][4 * n + 2]);
      }
      sum = flush_denormal(sum);
      std::memcpy(&emulated.data[c][m][4 * n], &sum, 4);
    }
}

inline void tile_release() {}

}  // namespace kvserve::amx

#define KVSERVE_TILE_LOADCONFIG(config) ::kvserve::amx::tile_loadconfig(config)
#define KVSERVE_TILE_ZERO(t) ::kvserve::amx::tile_zero(t)
#define KVSERVE_TILE_LOADD(t, base, stride) ::kvserve::amx::tile_loadd(t, base, stride)
#define KVSERVE_TILE_DPBF16PS(c, a, b) ::kvserve::amx::tile_dpbf16ps(c, a, b)
#define KVSERVE_TILE_STORED(t, base, stride) ::kvserve::amx::tile_stored(t, base, stride)
#define KVSERVE_TILE_RELEASE() ::kvserve::amx::tile_release()

#elif defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))

#include <immintrin.h>

#define KVSERVE_AMX_SUPPORTED 1
#define KVSERVE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))

namespace kvserve::amx {

// GCC 12's _tile_loadconfig declares an 8-byte memory operand, so stores to the rest of the
// config could be dropped or sunk past it; this operand covers all 64 bytes
KVSERVE_AMX_TARGET inline void tile_loadconfig(const TileConfig* config) { __asm__ volatile("ldtilecfg %0" ::"m"(*config)); }

}  // namespace kvserve::amx

#define KVSERVE_TILE_LOADCONFIG(config) ::kvserve::amx::tile_loadconfig(config)
#define KVSERVE_TILE_ZERO(t) _tile_zero(t)
// GCC 12's _tile_loadd has no memory operand: the barrier keeps the staging buffers' stores
// before the load
#define KVSERVE_TILE_LOADD(t, base, stride)  \
  do {                                      \
    __asm__ volatile("" ::: "memory");      \
    _tile_loadd(t, base, stride);           \
  } while (0)
#define KVSERVE_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
// AMX-INT8's byte products, int32 sums: A and B signed (SSD), A signed and B unsigned (SUD), A
// unsigned and B signed (USD); real tiles only (attention_amx_int8.h, not built for the emulation)
#define KVSERVE_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define KVSERVE_TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define KVSERVE_TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)
#define KVSERVE_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define KVSERVE_TILE_RELEASE() _tile_release()

#else

#define KVSERVE_AMX_SUPPORTED 0
#define KVSERVE_AMX_TARGET

#endif
