// Compile-time choices of the sparse attention kernels: every tile size and shared-memory
// layout in one place (see docs/kernels.md for the reasoning and the byte/FLOP counts).
#pragma once

namespace dsv41 {
namespace attn {

// ---- Tensor-core kernels: what every head dim shares ------------------------------------
// One CTA = one query token x one group of 64 heads x one key split. The 64 heads form the
// M dimension of S = Q K^T (MQA: one KV entry serves every head), keys stream in tiles.
// H need not be a multiple of 64: the last group's rows past H hold zero queries, are
// skipped where a whole warp's rows are, and are never written.
constexpr int kHeadsPerCta = 64;   // M
constexpr int kTileKeys = 64;      // keys per tile
constexpr int kThreads = 256;      // 8 warps (mma.sync kernel)
constexpr int kWarps = kThreads / 32;
constexpr int kMaxKeys = 4096;     // W + K per query staged in shared memory (else: generic)
constexpr int kPBytes = kHeadsPerCta * kTileKeys * 2;          // 8192: bf16 P [64][64]
constexpr int kStatFloats = 2 * 64 + 64 + 2 * 64 + 64 + 64;    // red max, alpha, l, scale, lse
constexpr int kMiscInts = 16;
// Splits: at least this many tiles per split (a split re-reads q and writes a partial O,
// which is worth it only over a couple of tiles).
constexpr int kMinTilesPerSplit = 2;
constexpr int kMaxSplits = 32;

// Warp roles of the S phase: warp w computes S[16 heads x 32 keys]: heads 16*(w%4), keys
// 32*(w/4), K = the head dim.
constexpr int kSRows = 16;
constexpr int kSKeys = 32;

// ---- mma.sync kernel (m16n8k16 bf16, sm_80+), one instantiation per head dim -----------
// The head dims of the presets that read stored KV through the op (docs/kernels.md):
// v41-flash 512, v41-small 128, v41-tiny 64. Each has its own translation unit
// (csrc/cuda/attention_mma_d<D>.cu); any other D runs the generic kernel (counted).
constexpr int kMmaHeadDims[] = {64, 128, 512};
constexpr bool is_mma_head_dim(int d) { return d == 64 || d == 128 || d == 512; }

template <int kD>
struct MmaTile {
  static_assert(is_mma_head_dim(kD), "no mma.sync instantiation for this head dim");
  static constexpr int kHeadDim = kD;
  // Q and K tiles are bf16 [rows][kD]: rows of kD/8 16-byte chunks, chunk c of row r stored
  // at chunk c ^ (r & 7) (conflict-free ldmatrix; kD >= 64 gives every row 8 chunks).
  static constexpr int kRowBytes = kD * 2;
  static constexpr int kQBytes = kHeadsPerCta * kRowBytes;
  static constexpr int kKBytes = kTileKeys * kRowBytes;
  // Raw tiles: the stored bytes of 64 gathered rows, double-buffered and filled by cp.async
  // two tiles ahead. Value/code rows are kD (FP8) or kD/2 (NVFP4) bytes of 16-byte chunks,
  // chunk c at c ^ (r & swz) with swz = min(7, chunks - 1); scale rows are padded to 16 (FP8)
  // or max(16, kD/16) (NVFP4) bytes in shared memory, whatever the pool's row stride.
  static constexpr int kFp8Chunks = kD / 16;
  static constexpr int kFp8Swz = kFp8Chunks >= 8 ? 7 : kFp8Chunks - 1;
  static constexpr int kFp8ScaleBytes = kD / 32;                 // per pool row: 16, 4, 2
  static constexpr int kFp8ScaleStride = 16;
  static constexpr int kNvfp4Chunks = kD / 32;
  static constexpr int kNvfp4Swz = kNvfp4Chunks >= 8 ? 7 : kNvfp4Chunks - 1;
  static constexpr int kNvfp4ScaleBytes = kD / 16;               // per pool row: 32, 8, 4
  static constexpr int kNvfp4ScalePiece = kNvfp4ScaleBytes < 16 ? kNvfp4ScaleBytes : 16;
  static constexpr int kNvfp4ScaleStride = kNvfp4ScaleBytes < 16 ? 16 : kNvfp4ScaleBytes;
  static constexpr int kRawFp8Values = kTileKeys * kD;
  static constexpr int kRawFp8Bytes = kRawFp8Values + kTileKeys * kFp8ScaleStride;
  static constexpr int kRawNvfp4Codes = kTileKeys * kD / 2;
  static constexpr int kRawNvfp4Bytes = kRawNvfp4Codes + kTileKeys * kNvfp4ScaleStride;
  static constexpr int kRawBytes = kRawFp8Bytes > kRawNvfp4Bytes ? kRawFp8Bytes : kRawNvfp4Bytes;
  // Dequant: thread (row tid % 64, quarter tid / 64) decodes kD/4 dims = kDqUnits units of
  // 16 values (an FP8 raw chunk, or an NVFP4 block of 8 code bytes).
  static constexpr int kDqUnits = kD / 64;
  // PV phase: warp w owns O[64 / kPvHeadGroups heads x kODims dims]: heads
  // (w / kPvDimGroups) * (64 / kPvHeadGroups).., dims kODims * (w % kPvDimGroups)..; every
  // warp covers at least 16 dims (one ldmatrix.x4.trans of V per 16 keys).
  static constexpr int kPvHeadGroups = kD >= 128 ? 1 : 2;
  static constexpr int kPvDimGroups = kWarps / kPvHeadGroups;
  static constexpr int kODims = kD / kPvDimGroups;              // 64, 16, 16
  static constexpr int kOMt = 4 / kPvHeadGroups;                // m-tiles (16 heads) per warp
  static constexpr int kONt = kODims / 8;                       // n-tiles (8 dims) per warp
  // Shared memory (bytes).
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffRaw0 = kOffK + kKBytes;
  static constexpr int kOffRaw1 = kOffRaw0 + kRawBytes;
  static constexpr int kOffP = kOffRaw1 + kRawBytes;
  static constexpr int kOffStats = kOffP + kPBytes;
  static constexpr int kOffIdx = kOffStats + kStatFloats * 4;
  static constexpr int kOffMisc = kOffIdx + kMaxKeys * 4;
  static constexpr int kSmemBytes = kOffMisc + kMiscInts * 4;   // 225088 at kD = 512 (Hopper allows 232448)
  // Small tiles leave room (registers and shared memory) for two CTAs per SM.
  static constexpr int kMinCtasPerSm = kD == 512 ? 1 : 2;
  static_assert(kSmemBytes * kMinCtasPerSm <= 232448, "attention tile does not fit Hopper shared memory");
  static_assert(kOffRaw0 % 128 == 0 && kOffRaw1 % 128 == 0 && kOffP % 128 == 0, "alignment");
  static_assert(kODims >= 16 && kODims % 16 == 0 && kFp8Chunks >= 4, "warp roles");
};

// The D = 512 figures the wgmma kernel and the docs quote.
using Mma512 = MmaTile<512>;
constexpr int kHeadDim = 512;      // the wgmma kernel's (only) head dim
constexpr int kQBytes = Mma512::kQBytes;                       // 65536
constexpr int kKBytes = Mma512::kKBytes;                       // 65536
constexpr int kRawFp8Values = Mma512::kRawFp8Values;           // 32768
constexpr int kRawNvfp4Codes = Mma512::kRawNvfp4Codes;         // 16384
constexpr int kSmemBytes = Mma512::kSmemBytes;

// ---- wgmma kernel (sm_90a: attention_wgmma.cu) -------------------------------------------
// Same CTA work as the mma.sync kernel (one query x 64 heads x one key split, 64-key tiles),
// warp-specialized: two consumer warpgroups run S = Q K^T by wgmma m64n32k16 (warpgroup g:
// keys 32g..) and O += P V by wgmma m64n256k16 (warpgroup g: dims 256g..), A and B read from
// shared memory through descriptors; one producer warpgroup gathers the next tile's stored
// bytes with cp.async and dequantizes them into the other K buffer meanwhile. Tiles are
// 128-byte-swizzled K-major: [D/64 blocks][64 rows][128 B], chunk c of row r at (c ^ (r & 7));
// the K tile, read K-major for S, is read MN-major (transposed) as V.
//
// Shared memory: Q + two bf16 K buffers take 192 KiB of the 227 KiB, which leaves no room
// for a separate raw tile (FP8: 33 KiB). The raw values of tile j are therefore staged in
// the upper half of the K buffer that will hold tile j (blocks 4..7, dims 256..511): the
// producer decodes dims 0..255 first (they land in blocks 0..3, below the stage), then reads
// its share of dims 256..511 into registers, waits for the whole producer warpgroup, and
// only then writes over the stage. The scales (at most 2 KiB a tile) have their own two
// buffers.
constexpr int kWgConsumerThreads = 256;                // warpgroups 0, 1: the MMAs
constexpr int kWgProducerThreads = 128;                // warpgroup 2: cp.async + dequant
constexpr int kWgThreads = kWgConsumerThreads + kWgProducerThreads;
// setmaxnreg budgets (the launch gives 168 to every thread): the smallest producer budget
// with which ptxas (CUDA 13.0, -Xptxas -v) reports no spills in either role; 192 * 256 +
// 112 * 128 = 63488 of the 65536 registers.
constexpr int kWgConsumerRegs = 192;
constexpr int kWgProducerRegs = 112;
static_assert(kWgConsumerRegs * kWgConsumerThreads + kWgProducerRegs * kWgProducerThreads <= 65536 &&
                  kWgConsumerRegs % 8 == 0 && kWgProducerRegs % 8 == 0, "register file");
constexpr int kWgBlockBytes = kHeadsPerCta * 128;      // 8192: one 64-dim block of a tile
constexpr int kWgStageOff = kKBytes / 2;               // raw values of the next tile: blocks 4..7
constexpr int kWgScaleBytes = kTileKeys * 32;          // 2048: NVFP4 64 x 32 B (FP8: 64 x 16 B)
static_assert(kRawFp8Values <= kKBytes - kWgStageOff && kRawNvfp4Codes <= kKBytes - kWgStageOff,
              "the raw values of a tile fit the upper half of a K buffer");
constexpr int kWgOffQ = 0;                             // 65536
constexpr int kWgOffK0 = kWgOffQ + kQBytes;            // 65536 each
constexpr int kWgOffK1 = kWgOffK0 + kKBytes;
constexpr int kWgOffP = kWgOffK1 + kKBytes;            // bf16 P [64][64]: one 128-byte-swizzled block
constexpr int kWgOffScales0 = kWgOffP + kPBytes;       // [2][kWgScaleBytes]
constexpr int kWgOffStats = kWgOffScales0 + 2 * kWgScaleBytes;
constexpr int kWgOffIdx = kWgOffStats + kStatFloats * 4;
constexpr int kWgOffMisc = kWgOffIdx + kMaxKeys * 4;
constexpr int kWgSmemBytes = kWgOffMisc + kMiscInts * 4 + 1024;  // 228160 with the slack to align the base to 1024
static_assert(kWgSmemBytes <= 232448, "wgmma attention tile does not fit Hopper shared memory");
static_assert(kWgOffK0 % 1024 == 0 && kWgOffK1 % 1024 == 0 && kWgOffP % 1024 == 0, "swizzle atoms 1024-aligned");
static_assert(kWgThreads / 32 <= kMiscInts, "compaction scratch: one int per warp");

// Named barriers of the wgmma kernel (0 is __syncthreads). FULL[b]: the producer's bar.arrive
// + the consumers' bar.sync (all 384 threads) hand a decoded tile in K buffer b over;
// EMPTY[b]: the consumers' bar.arrive after their P V wgmma + the producer's bar.sync hand
// the buffer back. CONSUMERS and PRODUCER sync one side only.
constexpr int kWgBarConsumers = 1;
constexpr int kWgBarFull0 = 2;   // + b
constexpr int kWgBarEmpty0 = 4;  // + b
constexpr int kWgBarProducer = 6;

// ---- Generic kernel (fp32, any H, D % 32 == 0, D <= 1024) ---------------------------------
constexpr int kGenericThreads = 128;  // 4 warps, one (query, head) per warp
constexpr int kGenericMaxDimPerLane = 32;

}  // namespace attn
}  // namespace dsv41
