// y = x @ W^T + bias by integer dots (AVX512-VNNI, or AVX2) over GGUF blocks repacked for many rows of x
// (kernels/quant.py repack_for_int8_gemm). int8_dot_cpu.cpp multiplies one weight row with one
// x row per 256-bit dot and converts and scales every one of them: ~7 multiply-adds per
// instruction, a quarter of oneDNN's bf16 rate. Here one 512-bit dpbusd serves 16 output
// columns (4 K-values each, embedded x broadcast), the 16 columns' unpacked block is reused
// for up to 8 rows of x, and the scale work is one convert and two FMAs per block, row and 16
// columns: ~38 multiply-adds per instruction, from 4-bit weights (4x fewer bytes than bf16).
// The AVX2 variant (below) reads the same layout half a group at a time.
//
// Repacked layout, per group of 16 output columns and per 32-block b (u: the unsigned stored
// value, 4-bit q, or 8-bit q + 128):
//   4-bit: 256 bytes, 4 x 64: lane c of vector i holds u[c][4i..4i+3] in its low nibbles and
//          u[c][16+4i..16+4i+3] in its high ones; 8-bit: 512 bytes, 8 x 64: lane c of vector
//          j holds u[c][4j..4j+3]
//   scales d[16] and offsets o[16] float16 (4-bit: o = m, the GGUF min; 8-bit: o = -128 d): GGUF's own
//   half-precision scales, exactly (-128 d only moves the exponent), so a block costs 320 bytes a
//   step (0.625 bytes a weight for 4-bit) instead of 384 with float32 scales
// and x is quantized per 32-block by int8_dot_cpu.cpp's quantize_rows (dx = max|x| / 127,
// qx, and sx = dx * sum qx), so that w x summed over a block is  d dx sum(u qx) + o sx.
#include "cpu_kernels.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CONVEYOR_INT8_GEMM 1
#endif

#ifdef CONVEYOR_INT8_GEMM
namespace {

struct GemmProblem {
  const int8_t* xq;    // [M, K]
  const float* xd;     // [M, blocks]
  const float* xs;     // [M, blocks]
  const uint8_t* w;    // [N / 16, blocks, 256 or 512]
  const uint16_t* d;   // [N / 16, blocks, 16] float16
  const uint16_t* o;   // [N / 16, blocks, 16] float16
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N]
  int64_t M, K, N, blocks;
  bool four_bit;
};

// Every tile of rows: full tiles of MAX_ROWS, then one of the rows left (TILE<rows>).
template <int MT, template <int> class Tile, class... Args>
void tail_tile(int64_t rows, Args... args) {
  if constexpr (MT > 1) {
    if (rows < MT) return tail_tile<MT - 1, Tile>(rows, args...);
  }
  Tile<MT>::run(args...);
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace int8_gemm_avx512vnni {

constexpr int64_t kRowsPerTile = 8;  // rows of x per pass over a column group's blocks (registers)

// The 8 vectors of u (16 columns x 4 K-values each) of one block
inline void unpack_block(const uint8_t* src, bool four_bit, __m512i* w) {
  if (four_bit) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      const __m512i raw = _mm512_loadu_si512(src + 64 * i);
      w[i] = _mm512_and_si512(raw, mask);
      w[i + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    }
  } else {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(src + 64 * j);
  }
}

// One thread streams its weights, scales and offsets at ~8 GB/s from DRAM where the hardware
// prefetchers alone follow them (three streams a group, restarting at every group); asking for
// block gb + kPrefetchBlocks's lines while block gb computes keeps more reads in flight.
constexpr int64_t kPrefetchBlocks = 8;
inline void prefetch_ahead(const GemmProblem& p, int64_t gb, int64_t block_bytes) {
  const int64_t ahead = gb + kPrefetchBlocks;
  const char* w = reinterpret_cast<const char*>(p.w + ahead * block_bytes);
  for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(w + line, _MM_HINT_T0);
  if (ahead % 2 == 0) {  // 2 blocks' 16 float16 scales (or offsets) a line
    _mm_prefetch(reinterpret_cast<const char*>(p.d + ahead * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p.o + ahead * 16), _MM_HINT_T0);
  }
}

// Rows m0..m0+MT of y for the 16 columns of group g
template <int MT>
struct Tile {
  static void run(const GemmProblem& p, int64_t g, int64_t m0) {
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    const int64_t block_bytes = p.four_bit ? 256 : 512;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t gb = g * p.blocks + b;
      prefetch_ahead(p, gb, block_bytes);
      __m512i w[8];
      unpack_block(p.w + gb * block_bytes, p.four_bit, w);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.d + gb * 16)));
      const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.o + gb * 16)));
      for (int m = 0; m < MT; ++m) {
        const int64_t row = m0 + m;
        const int8_t* quads = p.xq + row * p.K + b * 32;
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) {
          int32_t quad;  // 4 int8 of x, broadcast to the 16 columns (memcpy: no aliasing through int32_t*)
          std::memcpy(&quad, quads + 4 * j, sizeof quad);
          sum = _mm512_dpbusd_epi32(sum, w[j], _mm512_set1_epi32(quad));
        }
        const int64_t xb = row * p.blocks + b;
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(p.xd[xb])), acc[m]);
        acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(p.xs[xb]), acc[m]);
      }
    }
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + g * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(p.y + (m0 + m) * p.N + g * 16, _mm512_add_ps(acc[m], bias));
  }
};

void run(const GemmProblem& p) {
  at::parallel_for(0, p.N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t m = 0;
      for (; m + kRowsPerTile <= p.M; m += kRowsPerTile) Tile<kRowsPerTile>::run(p, g, m);
      if (m < p.M) tail_tile<kRowsPerTile - 1, Tile>(p.M - m, p, g, m);
    }
  });
}

}  // namespace int8_gemm_avx512vnni
#pragma GCC pop_options

// AVX2: the same layout, 8 columns (half a group) per 256-bit register. No dpbusd: maddubs
// multiplies u8 by s8 and adds pairs into int16, madd adds those pairs into int32.
// 4-bit: 2 x 15 x 127 per pair, so a block's 8 maddubs sum in int16 without overflow (30,480)
// and one madd per block widens them. 8-bit: u up to 255 would saturate maddubs, so it runs
// llama.cpp's sign trick on q = u - 128 (|q| times x with q's sign, 2 x 128 x 127 per pair)
// and madds each one; the offset o = -128 d is then already in q.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace int8_gemm_avx2 {

constexpr int64_t kRowsPerTile = 4;  // int16 sums and float32 sums of 4 rows, and a block's vector: 13 registers

inline __m256i broadcast_quad(const int8_t* quads, int j) {
  int32_t quad;
  std::memcpy(&quad, quads + 4 * j, sizeof quad);
  return _mm256_set1_epi32(quad);
}

// Rows m0..m0+MT of y for the 8 columns of half h of group g
template <int MT>
struct Tile {
  static void run(const GemmProblem& p, int64_t g, int64_t h, int64_t m0) {
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
    const int64_t block_bytes = p.four_bit ? 256 : 512;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t gb = g * p.blocks + b;
      const uint8_t* src = p.w + gb * block_bytes + 32 * h;
      const int8_t* quads[MT];
      for (int m = 0; m < MT; ++m) quads[m] = p.xq + (m0 + m) * p.K + b * 32;
      __m256i sum[MT];
      for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
      if (p.four_bit) {
        for (int i = 0; i < 4; ++i) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * i));
          const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          for (int m = 0; m < MT; ++m) {
            sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(lo, broadcast_quad(quads[m], i)));
            sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(hi, broadcast_quad(quads[m], i + 4)));
          }
        }
        for (int m = 0; m < MT; ++m) sum[m] = _mm256_madd_epi16(sum[m], ones);
      } else {
        for (int j = 0; j < 8; ++j) {
          const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * j)), flip);
          const __m256i magnitude = _mm256_sign_epi8(q, q);
          for (int m = 0; m < MT; ++m) {
            const __m256i signed_x = _mm256_sign_epi8(broadcast_quad(quads[m], j), q);
            sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.d + gb * 16 + 8 * h)));
      for (int m = 0; m < MT; ++m) {
        const int64_t xb = (m0 + m) * p.blocks + b;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_mul_ps(d, _mm256_set1_ps(p.xd[xb])), acc[m]);
      }
      if (p.four_bit) {
        const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.o + gb * 16 + 8 * h)));
        for (int m = 0; m < MT; ++m)
          acc[m] = _mm256_fmadd_ps(o, _mm256_set1_ps(p.xs[(m0 + m) * p.blocks + b]), acc[m]);
      }
    }
    const int64_t column = g * 16 + 8 * h;
    const __m256 bias = p.bias ? _mm256_loadu_ps(p.bias + column) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(p.y + (m0 + m) * p.N + column, _mm256_add_ps(acc[m], bias));
  }
};

void run(const GemmProblem& p) {
  at::parallel_for(0, p.N / 8, 1, [&](int64_t begin, int64_t end) {
    for (int64_t half = begin; half < end; ++half) {
      const int64_t g = half / 2, h = half % 2;
      int64_t m = 0;
      for (; m + kRowsPerTile <= p.M; m += kRowsPerTile) Tile<kRowsPerTile>::run(p, g, h, m);
      if (m < p.M) tail_tile<kRowsPerTile - 1, Tile>(p.M - m, p, g, h, m);
    }
  });
}

}  // namespace int8_gemm_avx2
#pragma GCC pop_options

// AMX: the same layout is already what a tile multiply reads. A B tile of one block is 8 rows of
// 64 bytes, row j holding 4 K-values of each of 16 columns: the 8-bit vectors as stored, or the
// 4-bit ones unpacked (low nibbles rows 0-3, high ones rows 4-7). An A tile is 16 rows of x's
// block (32 int8), and one tdpbsud gives the 16 x 16 block sums that the VNNI variant builds
// from 128 dpbusd. The scales then run exactly as there (same operations, same order, per row
// and column), so every row's result is bit for bit the VNNI variant's whatever the row count:
// steps of fewer than kAmxMinRows rows run that variant itself (a tile of one row wastes 15).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace int8_gemm_amx {

constexpr int64_t kAmxMinRows = 32;  // at 16 rows the tiles tied the 512-bit dots (2-core Xeon, SmolLM2 shapes)
constexpr int kTileRows = 16;
// Tile registers (the intrinsics take literal numbers): 0, 1 sums; 2, 3 x; 4, 5 weights
enum Tiles { kSums0, kSums1, kX0, kX1, kW0, kW1 };

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's tiles (a thread's tile state is its own): sums 16 x 16 int32, x 16 x 32
// int8, weights 8 x 64 uint8
void configure_tiles() {
  TileConfig config;
  for (int t : {kSums0, kSums1}) config.colsb[t] = 64, config.rows[t] = kTileRows;
  for (int t : {kX0, kX1}) config.colsb[t] = 32, config.rows[t] = kTileRows;
  for (int t : {kW0, kW1}) config.colsb[t] = 64, config.rows[t] = 8;
  // GCC's ldtilecfg operand names only the first 8 bytes: without the barrier it drops the other stores
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Linux hands a process the tiles' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM)
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

// Every block of group g as B tiles: 8 rows x 64 bytes each, into `tiles` (4-bit) or in place (8-bit)
const uint8_t* weight_tiles(const GemmProblem& p, int64_t g, std::vector<uint8_t>& tiles) {
  if (!p.four_bit) return p.w + g * p.blocks * 512;
  tiles.resize(p.blocks * 512);
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i rows[8];  // the 512-bit dots' registers of the block are the tile's rows
    int8_gemm_avx512vnni::unpack_block(p.w + (g * p.blocks + b) * 256, true, rows);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(tiles.data() + b * 512 + 64 * j, rows[j]);
  }
  return tiles.data();
}

// acc[r] += block b's sums of row m0 + r scaled, as int8_gemm_avx512vnni::Tile does
inline void scale_block(const GemmProblem& p, int64_t g, int64_t b, int64_t m0, const int32_t* sums, __m512* acc) {
  const int64_t gb = g * p.blocks + b;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.d + gb * 16)));
  const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.o + gb * 16)));
#pragma GCC unroll 16
  for (int r = 0; r < kTileRows; ++r) {
    const int64_t xb = (m0 + r) * p.blocks + b;
    const __m512i sum = _mm512_load_si512(sums + 16 * r);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(p.xd[xb])), acc[r]);
    acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(p.xs[xb]), acc[r]);
  }
}

// The sums of blocks b and b + 1 (or b alone: one) of a tile of rows, into sums[0] and sums[1]
inline void block_sums(const int8_t* x, int64_t K, const uint8_t* w, bool two, int32_t (*sums)[kTileRows * 16]) {
  _tile_zero(0);
  _tile_loadd(2, x, K);
  _tile_loadd(4, w, 64);
  _tile_dpbsud(0, 2, 4);
  if (two) {
    _tile_zero(1);
    _tile_loadd(3, x + 32, K);
    _tile_loadd(5, w + 512, 64);
    _tile_dpbsud(1, 3, 5);
  }
  _tile_stored(0, sums[0], 64);
  if (two) _tile_stored(1, sums[1], 64);
}

// Rows m0..m0+16 of y (those below M) for the 16 columns of group g; x is padded to whole tiles.
// Software-pipelined: the tiles multiply blocks b + 2 and b + 3 (into the other half of `sums`)
// before the vector units scale blocks b and b + 1, so the two run side by side.
void tile_rows(const GemmProblem& p, int64_t g, int64_t m0, const uint8_t* w) {
  alignas(64) int32_t sums[2][2][kTileRows * 16];
  __m512 acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = p.xq + m0 * p.K;
  block_sums(x, p.K, w, p.blocks > 1, sums[0]);
  for (int64_t b = 0; b < p.blocks; b += 2) {
    int32_t (*ready)[kTileRows * 16] = sums[(b / 2) % 2];
    if (b + 2 < p.blocks) block_sums(x + (b + 2) * 32, p.K, w + (b + 2) * 512, b + 3 < p.blocks, sums[(b / 2 + 1) % 2]);
    scale_block(p, g, b, m0, ready[0], acc);
    if (b + 1 < p.blocks) scale_block(p, g, b + 1, m0, ready[1], acc);
  }
  const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + g * 16) : _mm512_setzero_ps();
  const int64_t rows = std::min<int64_t>(kTileRows, p.M - m0);
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(p.y + (m0 + r) * p.N + g * 16, _mm512_add_ps(acc[r], bias));
}

// p.xq, p.xd and p.xs hold whole tiles of rows (zeros past M)
void run(const GemmProblem& p) {
  at::parallel_for(0, p.N / 16, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> tiles;
    configure_tiles();
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* w = weight_tiles(p, g, tiles);
      for (int64_t m = 0; m < p.M; m += kTileRows) tile_rows(p, g, m, w);
    }
    _tile_release();
  });
}

}  // namespace int8_gemm_amx
#pragma GCC pop_options
#endif

std::vector<std::string> int8_gemm_isas() {
  static const std::vector<std::string> isas = [] {  // the decoder asks every projection of every step
    std::vector<std::string> found;
#ifdef CONVEYOR_INT8_GEMM
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      found.push_back("avx2");
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      found.push_back("avx512vnni");
    if (!found.empty() && found.back() == "avx512vnni" && __builtin_cpu_supports("amx-tile") &&
        __builtin_cpu_supports("amx-int8") && int8_gemm_amx::tiles_permitted())
      found.push_back("amx");
#endif
    return found;
  }();
  return isas;
}

torch::Tensor int8_gemm_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                               c10::optional<torch::Tensor> bias, const std::string& isa) {
  static const auto runnable = int8_gemm_isas();
  TORCH_CHECK(std::find(runnable.begin(), runnable.end(), isa) != runnable.end(), "int8_gemm_linear: isa '", isa,
              "' does not run on this CPU (int8_gemm_isas() lists what does)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "int8_gemm_linear: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  (packed.size(2) == 256 || packed.size(2) == 512),
              "int8_gemm_linear: packed uint8 [N / 16, K / 32, 256 or 512] (repack_for_int8_gemm)");
  const int64_t groups = packed.size(0), blocks = packed.size(1), M = x.size(0), K = x.size(1), N = groups * 16;
  TORCH_CHECK(K == blocks * 32, "int8_gemm_linear: x has ", K, " features, the weight ", blocks * 32);
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->numel() == groups * blocks * 16,
                "int8_gemm_linear: scales and offsets float16 [N / 16, K / 32, 16]");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b = bias.has_value() && bias->defined() && bias->numel() ? bias->contiguous() : torch::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == torch::kFloat && b.numel() == N), "int8_gemm_linear: bias [N]");
  if (M == 0) return y;
#ifdef CONVEYOR_INT8_GEMM
  QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);  // as the row dots quantize
  const bool tiles = isa == "amx" && M >= int8_gemm_amx::kAmxMinRows;
  if (tiles) {  // whole tiles of rows: the padding rows multiply zeros and are not stored
    const int64_t padded = (M + int8_gemm_amx::kTileRows - 1) / int8_gemm_amx::kTileRows * int8_gemm_amx::kTileRows;
    xq.values.resize(padded * K, 0);
    xq.scales.resize(padded * blocks, 0.f);
    xq.sums.resize(padded * blocks, 0.f);
  }
  const GemmProblem p{xq.values.data(),
                      xq.scales.data(),
                      xq.sums.data(),
                      packed.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                      reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>()),
                      b.defined() ? b.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(),
                      M,
                      K,
                      N,
                      blocks,
                      packed.size(2) == 256};
  if (tiles)
    int8_gemm_amx::run(p);
  else if (isa == "avx512vnni" || isa == "amx")
    int8_gemm_avx512vnni::run(p);
  else
    int8_gemm_avx2::run(p);
#endif
  return y;
}
