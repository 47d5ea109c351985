// Compile-time choices of the sparse attention kernels: every tile size and shared-memory
// layout in one place (see docs/kernels.md for the reasoning and the byte/FLOP counts).
#pragma once

namespace dsv41 {
namespace attn {

// ---- Tensor-core kernel (mma.sync m16n8k16 bf16, sm_80+) --------------------------------
// One CTA = one query token x one group of 64 heads x one key split. The 64 heads form the
// M dimension of S = Q K^T (MQA: one KV entry serves every head), keys stream in tiles.
constexpr int kHeadsPerCta = 64;   // M; H must be a multiple
constexpr int kHeadDim = 512;      // D (K = 512 for S, N = 512 for O)
constexpr int kTileKeys = 64;      // keys per tile
constexpr int kThreads = 256;      // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxKeys = 4096;     // W + K per query staged in shared memory (else: generic)

// Warp roles. S phase: warp w computes S[16 heads x 32 keys]: heads 16*(w%4), keys
// 32*(w/4), full K = 512. PV phase: warp w owns O[64 heads x 64 dims], dims 64*w.
constexpr int kSRows = 16;
constexpr int kSKeys = 32;
constexpr int kODims = kHeadDim / kWarps;  // 64

// Shared memory (bytes). Q and K tiles are bf16 [64][512], 1 KiB rows of 64 16-byte chunks,
// chunk c of row r stored at chunk c ^ (r & 7) (conflict-free ldmatrix). Raw tiles are the
// stored bytes of 64 gathered rows (FP8: 512 values + 16 scales; NVFP4: 256 codes + 32
// scales), double-buffered and filled by cp.async two tiles ahead.
constexpr int kQBytes = kHeadsPerCta * kHeadDim * 2;           // 65536
constexpr int kKBytes = kTileKeys * kHeadDim * 2;              // 65536
constexpr int kRawFp8Values = kTileKeys * kHeadDim;            // 32768
constexpr int kRawFp8Bytes = kRawFp8Values + kTileKeys * 16;   // 33792
constexpr int kRawNvfp4Codes = kTileKeys * kHeadDim / 2;       // 16384
constexpr int kRawNvfp4Bytes = kRawNvfp4Codes + kTileKeys * 32; // 18432
constexpr int kRawBytes = kRawFp8Bytes;                        // max of the two
constexpr int kPBytes = kHeadsPerCta * kTileKeys * 2;          // 8192: bf16 P [64][64]
constexpr int kStatFloats = 2 * 64 + 64 + 2 * 64 + 64 + 64;    // red max, alpha, l, scale, lse

constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kQBytes;
constexpr int kOffRaw0 = kOffK + kKBytes;
constexpr int kOffRaw1 = kOffRaw0 + kRawBytes;
constexpr int kOffP = kOffRaw1 + kRawBytes;
constexpr int kOffStats = kOffP + kPBytes;
constexpr int kOffIdx = kOffStats + kStatFloats * 4;
constexpr int kOffMisc = kOffIdx + kMaxKeys * 4;
constexpr int kMiscInts = 16;
constexpr int kSmemBytes = kOffMisc + kMiscInts * 4;  // 225088 (Hopper allows 232448)
static_assert(kSmemBytes <= 232448, "attention tile does not fit Hopper shared memory");
static_assert(kOffRaw0 % 128 == 0 && kOffRaw1 % 128 == 0 && kOffP % 128 == 0, "alignment");

// Splits: at least this many tiles per split (a split re-reads q and writes a 128 KiB
// partial O, which is worth it only over a couple of tiles).
constexpr int kMinTilesPerSplit = 2;
constexpr int kMaxSplits = 32;

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
