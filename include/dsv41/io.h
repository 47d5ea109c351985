// The persistent cache's I/O engine, framework-free (no torch, no Python): aligned host
// buffers, a small thread pool, batched pread/pwrite with O_DIRECT and a clean fallback,
// and the optional device paths (pinned staging, batched device<->host block copies,
// GPUDirect Storage through a cuFile library loaded at run time).
//
// Alignment: O_DIRECT needs the buffer address, the file offset and the length to be
// multiples of the device's logical block size; dsv41 uses kAlign = 4096 everywhere, which
// satisfies 512-byte and 4 KiB devices alike. An op that is not aligned, or a file whose
// filesystem refuses O_DIRECT (open or I/O returns EINVAL), is served through the page
// cache instead; both are counted, never an error.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "dsv41/record.h"

namespace dsv41 {
namespace io {

constexpr size_t kAlign = 4096;

inline bool is_aligned(uint64_t v) { return v % kAlign == 0; }
inline uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Buffers of kHugeBytes or more are a fresh mapping of whole kHugeBytes pages (their
// size rounded up), advised for transparent huge pages (madvise, where the kernel offers
// them) before the first touch. An O_DIRECT request carries at most the queue's
// max_segments runs of physically contiguous memory (254 on the development VM's virtio
// disk): 1 MiB from scattered 4 KiB pages is 256 runs and goes out as two requests, from
// a huge page as one, and 4 MiB as one request too. On that disk a request's time barely
// depends on its size (measured in docs/cache.md).
constexpr size_t kHugeBytes = size_t(2) << 20;

// A 4 KiB-aligned (huge-page backed from kHugeBytes on) host allocation; page-locked for the GPU
// when pin_host() succeeds.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t size);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool pinned() const { return pinned_; }
  // Registers the pages with the CUDA driver (cudaHostRegister) when dsv41 was built with
  // CUDA and a device is present; returns false (and stays pageable) otherwise.
  bool pin_host();

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // bytes of its own mapping (huge-page buffers), else 0 (malloc'ed)
  bool pinned_ = false;
};

// Fixed worker threads; parallel_for runs fn(0..n-1) on them and waits. Safe to call from
// several threads at once (each call waits only for its own items).
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }
  void parallel_for(size_t n, const std::function<void(size_t)>& fn);

 private:
  void worker();
  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

// One read or write of `length` bytes at `offset` of `fd` from/into `buf`.
struct IoOp {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint8_t* buf = nullptr;
  // Results: bytes transferred (a read stops short at end of file) and the errno of the
  // first failure (0 when none).
  uint64_t done = 0;
  int err = 0;
  // Optional, reads only: CRC-32C of these [offset, offset + length) ranges of the op's
  // buffer, computed by the worker right after its read while the bytes are in its cache
  // (ranges the read did not fill get crc 0).
  std::vector<std::pair<uint64_t, uint64_t>> crc_ranges;
  std::vector<uint32_t> crcs;
  // Optional, reads only: persistent-cache records inside the op (offset within the op's
  // buffer, what they must be), checked and copied out by the worker after its read;
  // record_status gets one record::Status each.
  std::vector<std::pair<uint64_t, record::Expect>> records;
  std::vector<int> record_status;
};

// Test-only faults, so the fallback and error paths run on any filesystem.
enum Fault : uint32_t {
  kFaultNone = 0,
  kFaultRefuseDirectOpen = 1u << 0,  // open(O_DIRECT) fails with EINVAL
  kFaultRefuseDirectIo = 1u << 1,    // the first I/O on an O_DIRECT fd fails with EINVAL
  kFaultNoSpace = 1u << 2,           // writes fail with ENOSPC once `nospace_after` bytes
                                     // have been written (counted over the engine's life)
  kFaultSlowSeal = 1u << 3,          // seal_files sleeps 300 ms before its first step (a
                                     // slow fsync: a process can exit while one runs)
};

// Test-only injected failures of single operations (IoEngine::inject_fault).
enum FaultOp : int { kFaultOpOpen = 0, kFaultOpRead = 1 };

struct IoCounters {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t read_ops = 0;
  uint64_t write_ops = 0;
  uint64_t direct_ops = 0;         // ops served with O_DIRECT
  uint64_t buffered_ops = 0;       // ops served through the page cache
  uint64_t direct_fallbacks = 0;   // O_DIRECT refused at open or at I/O time
  uint64_t errors = 0;
};

class IoEngine {
 public:
  // `threads` workers; ops larger than `chunk_bytes` are split so one big op still uses
  // every worker. `write_depth` more threads serve submit_write (started on first use).
  explicit IoEngine(int threads, uint64_t chunk_bytes = 4u << 20, int write_depth = 2);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  int threads() const { return pool_.size(); }

  // Opens `path` with `flags` (O_DIRECT added when `direct`); when the filesystem refuses
  // O_DIRECT the file is opened without it. Returns the fd or -errno; *is_direct says
  // which way it was opened.
  int open(const std::string& path, int flags, int mode, bool direct, bool* is_direct);

  // Runs every op and waits for all of them. Reads fill op.done (short at end of file);
  // failures set op.err. Never throws.
  void run(IoOp* ops, size_t n, bool write);

  // CRC-32C of many ranges in parallel (crcs[i] for [ptrs[i], ptrs[i] + lens[i])).
  void crc32c_many(const uint8_t* const* ptrs, const uint64_t* lens, uint32_t* crcs, size_t n);

  // Plain host copies of equal-size blocks: dst[dst_idx[i]] = src[src_idx[i]].
  void copy_blocks(uint8_t* dst, const int64_t* dst_idx, const uint8_t* src,
                   const int64_t* src_idx, size_t n, uint64_t block_bytes);

  // Equal-length range copies: dst + dst_off[i] <- src + src_off[i], `length` bytes each.
  void copy_ranges(uint8_t* dst, const uint64_t* dst_off, const uint8_t* src,
                   const uint64_t* src_off, size_t n, uint64_t length);

  int fsync(int fd);  // fdatasync where the platform has it, else fsync; 0 or -errno
  // Background writes: submit_write queues one write and returns a ticket at once;
  // `write_depth` dedicated threads issue the queued writes in order, up to that many at
  // a time; wait_write(ticket) blocks until that write is done and returns (bytes
  // written, errno) (errno EIO for a short write). A caller that streams chunks keeps the
  // disk busy without coming back between writes (from Python: without the GIL). The
  // buffer must stay alive and unchanged until the ticket is waited for.
  uint64_t submit_write(int fd, uint64_t offset, const uint8_t* buf, uint64_t length);
  std::pair<uint64_t, int> wait_write(uint64_t ticket);
  // wait_write without blocking: false if the write is still queued or in progress.
  bool poll_write(uint64_t ticket, std::pair<uint64_t, int>* result);
  // Makes files written through submit_write durable and visible, in one call so a
  // caller holding a lock (Python's GIL) gives it up once, not once per step. Waits until
  // every write submitted up to the files' last tickets is done; then, for the files in
  // order up to the first one that fails: its writes (first_ticket..last_ticket) must all
  // have succeeded; fdatasync (when `durable`); rename(tmp, dst); and, when at least one
  // file was renamed, one fsync of directory `dir` (when `durable`). The flushes come after
  // every file's writes: on a device whose cache flush stalls the writes queued behind it
  // (the development VM's virtio disk: a 4 MiB write waited ~150 ms for a 128 MiB flush),
  // a segment flushed while the next was being written held that one back, and the first
  // flush carries the later files' data with it. Returns (errno, the step of the first
  // failure: SealStep, how many leading files were renamed); (0, kSealDone, n) when every
  // step succeeded. Failures of tickets up to the last are forgotten (reported here, or
  // waited for).
  enum SealStep { kSealWrites = 0, kSealSync = 1, kSealRename = 2, kSealDirSync = 3, kSealDone = 4 };
  struct SealItem {
    int fd;
    uint64_t first_ticket, last_ticket;
    std::string tmp, dst;
  };
  std::tuple<int, int, size_t> seal_files(const std::vector<SealItem>& files, bool durable, const std::string& dir);
  // seal_files of one file -> (errno, step).
  std::pair<int, int> seal_file(int fd, uint64_t first_ticket, uint64_t last_ticket, bool durable,
                                const std::string& tmp, const std::string& dst, const std::string& dir);

  // Runs fn(0..n-1) on the engine's threads (the caller helps) and waits.
  void parallel_for(size_t n, const std::function<void(size_t)>& fn) { pool_.parallel_for(n, fn); }

  void set_faults(uint32_t faults, uint64_t nospace_after);
  // Test hook: after `skip` more operations of kind `op` (FaultOp: open(), or one read
  // chunk of run()), the next `count` fail: with errno `err`, or, a read with err 0,
  // short (half the chunk, rounded down to 4 KiB, no errno: as at the end of the file).
  // count 0 disarms. A store must treat either as a miss, never as a damaged record.
  void inject_fault(int op, uint64_t skip, uint64_t count, int err);
  IoCounters counters() const;

 private:
  struct Chunk {
    IoOp* op;
    uint64_t start;   // offset within the op
    uint64_t length;
    uint64_t done = 0;
    int err = 0;
  };
  void run_chunk(Chunk& c, bool write);
  void write_worker();
  int do_io(int fd, uint8_t* buf, uint64_t length, uint64_t offset, bool write, uint64_t* done);
  bool drop_direct(int fd);
  bool take_fault(int op, int* err);  // whether this operation is an injected failure

  ThreadPool pool_;
  uint64_t chunk_bytes_;
  // submit_write's queue, its threads and the results not yet waited for.
  struct QueuedWrite {
    uint64_t ticket;
    IoOp op;
  };
  int write_depth_;
  std::mutex wmu_;
  std::condition_variable wq_cv_, wdone_cv_;
  std::deque<QueuedWrite> wq_;
  std::unordered_set<uint64_t> wopen_;  // tickets not yet waited for
  std::unordered_map<uint64_t, std::pair<uint64_t, int>> wdone_;  // ticket -> (done, errno)
  std::set<uint64_t> wpending_;  // tickets queued or being written
  std::map<uint64_t, int> wfailed_;  // ticket -> errno of failed writes, until seal_file
  uint64_t next_ticket_ = 1;
  bool wstop_ = false;
  std::vector<std::thread> writers_;
  int writers_pid_ = 0;  // a forked child inherits writers_ but not the threads
  std::atomic<uint32_t> faults_{0};
  std::atomic<uint64_t> nospace_after_{0};
  std::atomic<bool> direct_io_refused_once_{false};
  struct Injected {
    uint64_t skip = 0, count = 0;
    int err = 0;
  };
  std::mutex fmu_;
  Injected injected_[2];                    // by FaultOp
  std::atomic<bool> injected_armed_{false};  // any count > 0: only then take fmu_
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, read_ops_{0}, write_ops_{0},
      direct_ops_{0}, buffered_ops_{0}, direct_fallbacks_{0}, errors_{0};
};

// ---- device paths (implemented only when built with CUDA; see csrc/cuda/io_cuda.cu) ----

// Whether this build can talk to a GPU at all, and how many devices the driver reports
// (0 when CUDA is not compiled in or there is no driver/device).
int cuda_device_count();
// cudaHostRegister / cudaHostUnregister; 0 on success, a CUDA error code otherwise.
int cuda_host_register(void* ptr, size_t bytes);
int cuda_host_unregister(void* ptr);
// Batched block copies between any two of host/device: for i in [0, n):
//   dst + dst_idx[i] * block_bytes  <-  src + src_idx[i] * block_bytes
// Runs of consecutive indices on both sides become one cudaMemcpyAsync. Enqueued on
// `stream` (a cudaStream_t); returns a cudaError_t value.
int cuda_copy_blocks(uint8_t* dst, const int64_t* dst_idx, const uint8_t* src,
                     const int64_t* src_idx, size_t n, uint64_t block_bytes, void* stream);
// CRC-32C of n ranges of device memory, one thread block per range: crcs[i] (device
// memory) = crc32c(base + offsets[i], lengths[i]). offsets/lengths are device arrays.
int cuda_crc32c_ranges(const uint8_t* base, const uint64_t* offsets, const uint64_t* lengths,
                       uint32_t* crcs, size_t n, void* stream);

// ---- GPUDirect Storage through libcufile, loaded with dlopen at run time ----
//
// Nothing links against libcufile: gds_open() tries to load it (DSV41_CUFILE_LIB, then
// libcufile.so.0, libcufile.so) and to open the driver, only when CUDA is compiled in and
// a device is present. Without it every call reports unavailable and the POSIX path runs.
struct GdsStatus {
  bool available = false;
  std::string reason;   // why not, or the library that was loaded
};
GdsStatus gds_status();          // loads and opens the driver on first use
// What a GdsFile::read/write result or a cuFile error code (>= 5000, either sign) means:
// the CUfileOpError's name and text from cufile.h, or strerror for an errno.
std::string gds_error_string(int64_t code);
class GdsFile {
 public:
  // Opens `path` with O_DIRECT (without it where the filesystem refuses O_DIRECT: cuFile
  // then decides, and in compatibility mode reads through its POSIX path) and registers
  // it with cuFile. Throws std::runtime_error naming the step that failed and why.
  GdsFile(const std::string& path, bool write);
  ~GdsFile();
  GdsFile(const GdsFile&) = delete;
  GdsFile& operator=(const GdsFile&) = delete;
  // cuFileRead/cuFileWrite into/from device memory: bytes, or -errno for a system error
  // (cuFile's -1 with errno set), or -(a CUfileOpError, >= 5000) for cuFile's own.
  int64_t read(void* dev_ptr, uint64_t size, uint64_t file_offset, uint64_t dev_offset);
  int64_t write(const void* dev_ptr, uint64_t size, uint64_t file_offset, uint64_t dev_offset);

 private:
  int fd_ = -1;
  void* handle_ = nullptr;
  bool direct_ = false;

 public:
  bool direct() const { return direct_; }  // whether the fd has O_DIRECT
};

}  // namespace io
}  // namespace dsv41
