// The POSIX side of the I/O engine: aligned buffers, the thread pool, and batched
// pread/pwrite with O_DIRECT where the filesystem accepts it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#include "dsv41/crc32c.h"
#include "dsv41/io.h"

namespace dsv41 {
namespace io {

// ---- AlignedBuffer ----------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(size_t size) : size_(size) {
  // A zero-byte request still gets one page so data() is a valid aligned pointer.
  size_t bytes = align_up(size ? size : 1);
  if (bytes < kHugeBytes) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, bytes) != 0) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    data_ = static_cast<uint8_t*>(p);
    return;
  }
  // Whole huge pages (a 3.75 MiB buffer would otherwise end in 1.75 MiB of 4 KiB pages,
  // where a 1 MiB read goes to the disk as two requests), from a fresh mapping: memory the
  // allocator hands back may already be faulted in as 4 KiB pages, which madvise does not
  // change (seen: one of a 4 MiB read buffer's two huge pages missing in some processes,
  // and their verified reads at half speed).
  bytes = (bytes + kHugeBytes - 1) / kHugeBytes * kHugeBytes;
  const size_t span = bytes + kHugeBytes;  // room to align the start
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t base = reinterpret_cast<uintptr_t>(m);
  const uintptr_t start = (base + kHugeBytes - 1) / kHugeBytes * kHugeBytes;
  if (start > base) munmap(m, start - base);
  const uintptr_t end = start + bytes;
  if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
  data_ = reinterpret_cast<uint8_t*>(start);
  mapped_ = bytes;
  // Before the first touch, so the pages are faulted in as huge pages. A kernel without
  // transparent huge pages says no; the buffer works the same, only scattered.
  (void)madvise(data_, bytes, MADV_HUGEPAGE);
  std::memset(data_, 0, bytes);  // fresh anonymous pages are zero: this only faults them in
}

AlignedBuffer::~AlignedBuffer() {
  if (pinned_) cuda_host_unregister(data_);
  if (mapped_) {
    munmap(data_, mapped_);
  } else {
    std::free(data_);
  }
}

bool AlignedBuffer::pin_host() {
  if (pinned_) return true;
  if (cuda_device_count() <= 0) return false;
  pinned_ = cuda_host_register(data_, align_up(size_ ? size_ : 1)) == 0;
  return pinned_;
}

// ---- ThreadPool -------------------------------------------------------------------------

ThreadPool::ThreadPool(int threads) {
  threads = std::max(1, threads);
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { worker(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1) {
    fn(0);
    return;
  }
  // The caller works too: it takes items from the same counter as the workers, so a
  // batch finishes even when every worker is busy with another caller's batch.
  struct Batch {
    std::atomic<size_t> next{0};
    std::atomic<size_t> left;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto batch = std::make_shared<Batch>();
  batch->left = n;
  auto drain = [batch, n, &fn] {
    for (size_t i; (i = batch->next.fetch_add(1)) < n;) {
      fn(i);
      if (batch->left.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(batch->mu);
        batch->cv.notify_all();
      }
    }
  };
  const size_t helpers = std::min(n - 1, workers_.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < helpers; ++i) queue_.emplace_back(drain);
  }
  cv_.notify_all();
  drain();
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->cv.wait(lock, [&] { return batch->left.load() == 0; });
  // Helpers that start after this point find next >= n and return without touching fn.
}

// ---- IoEngine ---------------------------------------------------------------------------

IoEngine::IoEngine(int threads, uint64_t chunk_bytes, int write_depth)
    : pool_(threads),
      chunk_bytes_(std::max<uint64_t>(align_up(chunk_bytes), kAlign)),
      write_depth_(std::max(1, write_depth)) {}

IoEngine::~IoEngine() {
  {
    std::lock_guard<std::mutex> lock(wmu_);
    wstop_ = true;
  }
  wq_cv_.notify_all();
  for (auto& t : writers_) {
    if (writers_pid_ == getpid()) {
      t.join();  // they finish what was queued first
    } else {
      t.detach();  // a forked child's copy: that thread is not in this process
    }
  }
}

uint64_t IoEngine::submit_write(int fd, uint64_t offset, const uint8_t* buf, uint64_t length) {
  std::lock_guard<std::mutex> lock(wmu_);
  if (writers_pid_ != getpid()) {  // first use, or in a forked child: its own threads
    for (auto& t : writers_) t.detach();
    writers_.clear();
    writers_pid_ = getpid();
    for (int i = 0; i < write_depth_; ++i) writers_.emplace_back([this] { write_worker(); });
  }
  QueuedWrite w;
  w.ticket = next_ticket_++;
  w.op.fd = fd;
  w.op.offset = offset;
  w.op.length = length;
  w.op.buf = const_cast<uint8_t*>(buf);
  const uint64_t ticket = w.ticket;
  wopen_.insert(ticket);
  wpending_.insert(ticket);
  wq_.push_back(std::move(w));
  wq_cv_.notify_one();
  return ticket;
}

void IoEngine::write_worker() {
  for (;;) {
    QueuedWrite w;
    {
      std::unique_lock<std::mutex> lock(wmu_);
      wq_cv_.wait(lock, [this] { return wstop_ || !wq_.empty(); });
      if (wq_.empty()) return;  // stopping, and nothing left to write
      w = std::move(wq_.front());
      wq_.pop_front();
    }
    int err = 0;
    uint64_t done = 0;
    if (w.op.fd < 0) {
      err = EBADF;
    } else {
      Chunk c{&w.op, 0, w.op.length};
      run_chunk(c, true);
      done = c.done;
      err = c.err ? c.err : (c.done < c.length ? EIO : 0);
    }
    write_ops_.fetch_add(1);
    if (err) errors_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(wmu_);
      wdone_[w.ticket] = {done, err};
      wpending_.erase(w.ticket);
      if (err) wfailed_[w.ticket] = err;
    }
    wdone_cv_.notify_all();
  }
}

std::pair<uint64_t, int> IoEngine::wait_write(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(wmu_);
  if (!wopen_.count(ticket)) return {0, EINVAL};  // never submitted, or waited for already
  wdone_cv_.wait(lock, [&] { return wdone_.count(ticket) > 0; });
  const auto r = wdone_[ticket];
  wdone_.erase(ticket);
  wopen_.erase(ticket);
  return r;
}

bool IoEngine::poll_write(uint64_t ticket, std::pair<uint64_t, int>* result) {
  std::lock_guard<std::mutex> lock(wmu_);
  if (!wopen_.count(ticket)) {
    *result = {0, EINVAL};
    return true;
  }
  const auto it = wdone_.find(ticket);
  if (it == wdone_.end()) return false;
  *result = it->second;
  wdone_.erase(it);
  wopen_.erase(ticket);
  return true;
}

std::tuple<int, int, size_t> IoEngine::seal_files(const std::vector<SealItem>& files, bool durable,
                                                  const std::string& dir) {
  size_t n = 0;  // files whose writes succeeded (then: that are durable)
  int err = 0, step = kSealDone;
  if (faults_.load() & kFaultSlowSeal) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  {
    uint64_t last = 0;
    for (const auto& f : files) last = std::max(last, f.last_ticket);
    std::unique_lock<std::mutex> lock(wmu_);
    wdone_cv_.wait(lock, [&] { return wpending_.empty() || *wpending_.begin() > last; });
    for (; n < files.size(); ++n) {
      const auto failed = wfailed_.lower_bound(files[n].first_ticket);
      if (failed != wfailed_.end() && failed->first <= files[n].last_ticket) {
        err = failed->second;
        step = kSealWrites;
        break;
      }
    }
    wfailed_.erase(wfailed_.begin(), wfailed_.upper_bound(last));
  }
  if (durable) {
    for (size_t i = 0; i < n; ++i) {
      const int r = fsync(files[i].fd);
      if (r < 0) {
        err = -r;
        step = kSealSync;
        n = i;
        break;
      }
    }
  }
  size_t renamed = 0;
  for (; renamed < n; ++renamed) {
    if (::rename(files[renamed].tmp.c_str(), files[renamed].dst.c_str()) != 0) {
      err = errno;
      step = kSealRename;
      break;
    }
  }
  if (durable && renamed) {
    const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int r = d < 0 ? -1 : ::fsync(d);
    const int e = errno;
    if (d >= 0) ::close(d);
    if (r != 0) return {e, kSealDirSync, renamed};
  }
  return {err, step, renamed};
}

std::pair<int, int> IoEngine::seal_file(int fd, uint64_t first_ticket, uint64_t last_ticket, bool durable,
                                        const std::string& tmp, const std::string& dst, const std::string& dir) {
  const auto [err, step, renamed] = seal_files({{fd, first_ticket, last_ticket, tmp, dst}}, durable, dir);
  (void)renamed;
  return {err, step};
}

int IoEngine::open(const std::string& path, int flags, int mode, bool direct, bool* is_direct) {
  *is_direct = false;
  int injected = 0;
  if (take_fault(kFaultOpOpen, &injected)) return -(injected ? injected : EIO);
  if (direct) {
    int fd = -1;
    if (faults_.load() & kFaultRefuseDirectOpen) {
      errno = EINVAL;
    } else {
      fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, mode);
    }
    if (fd >= 0) {
      *is_direct = true;
      return fd;
    }
    if (errno != EINVAL) return -errno;
    // The filesystem refuses O_DIRECT (tmpfs on older kernels, some FUSE and network
    // filesystems): serve this file through the page cache.
    direct_fallbacks_.fetch_add(1);
  }
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  return fd >= 0 ? fd : -errno;
}

bool IoEngine::drop_direct(int fd) {
  const int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || !(fl & O_DIRECT)) return false;
  if (fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0) return false;
  direct_fallbacks_.fetch_add(1);
  return true;
}

int IoEngine::do_io(int fd, uint8_t* buf, uint64_t length, uint64_t offset, bool write,
                    uint64_t* done) {
  *done = 0;
  while (*done < length) {
    uint64_t want = length - *done;
    ssize_t r;
    if (write && (faults_.load() & kFaultNoSpace)) {
      // A disk that fills up after `nospace_after` more bytes: the write that crosses the
      // limit is cut short (at a 4 KiB boundary, as O_DIRECT needs), the next one fails.
      const uint64_t before = bytes_written_.load();
      const uint64_t limit = nospace_after_.load();
      const uint64_t room = before < limit ? (limit - before) / kAlign * kAlign : 0;
      if (room == 0) return ENOSPC;
      want = std::min(want, room);
    }
    if (write) {
      r = ::pwrite(fd, buf + *done, want, static_cast<off_t>(offset + *done));
    } else {
      r = ::pread(fd, buf + *done, want, static_cast<off_t>(offset + *done));
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) {
      if (write) return EIO;  // a zero-byte pwrite with bytes left: give up rather than spin
      break;                  // end of file
    }
    *done += static_cast<uint64_t>(r);
    (write ? bytes_written_ : bytes_read_).fetch_add(static_cast<uint64_t>(r));
  }
  return 0;
}

void IoEngine::run_chunk(Chunk& c, bool write) {
  IoOp& op = *c.op;
  uint8_t* buf = op.buf + c.start;
  const uint64_t offset = op.offset + c.start;
  int injected = 0;
  if (!write && take_fault(kFaultOpRead, &injected)) {
    if (injected) {
      c.err = injected;
      return;
    }
    // A short read: the first half of the chunk (whole pages, so an O_DIRECT fd takes it).
    const uint64_t half = c.length / 2 / kAlign * kAlign;
    c.err = half ? do_io(op.fd, buf, half, offset, false, &c.done) : 0;
    return;
  }
  const int fl = fcntl(op.fd, F_GETFL);
  if (fl < 0) {
    c.err = errno;
    return;
  }
  const bool direct_fd = (fl & O_DIRECT) != 0;
  const bool aligned = is_aligned(reinterpret_cast<uintptr_t>(buf)) && is_aligned(offset) &&
                       is_aligned(c.length);
  if (direct_fd && !aligned) {
    if (write) {
      c.err = EINVAL;  // callers always write whole aligned records; refuse loudly
      return;
    }
    // Unaligned read on an O_DIRECT fd: read the covering aligned range into a bounce
    // buffer and copy out the part that was asked for.
    const uint64_t lo = offset / kAlign * kAlign;
    const uint64_t hi = align_up(offset + c.length);
    AlignedBuffer bounce(hi - lo);
    uint64_t got = 0;
    c.err = do_io(op.fd, bounce.data(), hi - lo, lo, false, &got);
    if (c.err == EINVAL && drop_direct(op.fd)) {
      c.err = do_io(op.fd, buf, c.length, offset, false, &c.done);
      buffered_ops_.fetch_add(1);
      return;
    }
    const uint64_t head = offset - lo;
    c.done = got > head ? std::min(c.length, got - head) : 0;
    if (c.done) std::memcpy(buf, bounce.data() + head, c.done);
    direct_ops_.fetch_add(1);
    return;
  }
  if (direct_fd && (faults_.load() & kFaultRefuseDirectIo) &&
      !direct_io_refused_once_.exchange(true)) {
    c.err = EINVAL;  // simulated refusal, handled exactly like a real one below
  } else {
    c.err = do_io(op.fd, buf, c.length, offset, write, &c.done);
  }
  if (c.err == EINVAL && direct_fd && c.done == 0 && drop_direct(op.fd)) {
    c.err = do_io(op.fd, buf, c.length, offset, write, &c.done);
    buffered_ops_.fetch_add(1);
    return;
  }
  (direct_fd ? direct_ops_ : buffered_ops_).fetch_add(1);
}

void IoEngine::run(IoOp* ops, size_t n, bool write) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < n; ++i) {
    ops[i].done = 0;
    ops[i].err = 0;
    ops[i].crcs.clear();
    ops[i].record_status.clear();
    if (ops[i].fd < 0) {
      ops[i].err = EBADF;
      continue;
    }
    if (ops[i].length == 0) {
      chunks.push_back({&ops[i], 0, 0});
      continue;
    }
    for (uint64_t s = 0; s < ops[i].length; s += chunk_bytes_) {
      chunks.push_back({&ops[i], s, std::min(chunk_bytes_, ops[i].length - s)});
    }
  }
  // An op that is one chunk gets its CRCs from the worker that read it.
  auto checksum = [](IoOp& op, uint64_t done) {
    op.crcs.assign(op.crc_ranges.size(), 0);
    for (size_t r = 0; r < op.crc_ranges.size(); ++r) {
      const auto [off, len] = op.crc_ranges[r];
      if (off + len <= done) op.crcs[r] = dsv41::crc32c(0, op.buf + off, len);
    }
  };
  auto check_records = [](IoOp& op, uint64_t done) {
    op.record_status.assign(op.records.size(), record::kTruncated);
    for (size_t r = 0; r < op.records.size(); ++r) {
      const auto& [off, expect] = op.records[r];
      op.record_status[r] = record::check(op.buf + off, done > off ? done - off : 0, expect);
    }
  };
  pool_.parallel_for(chunks.size(), [&](size_t k) {
    Chunk& c = chunks[k];
    run_chunk(c, write);
    if (!write && c.start == 0 && c.length == c.op->length) {
      if (!c.op->crc_ranges.empty()) checksum(*c.op, c.done);
      if (!c.op->records.empty()) check_records(*c.op, c.done);
    }
  });
  // An op's result is its contiguous prefix: a short or failed chunk ends it.
  for (size_t k = 0; k < chunks.size();) {
    IoOp& op = *chunks[k].op;
    bool open_run = true;
    for (; k < chunks.size() && chunks[k].op == &op; ++k) {
      const Chunk& c = chunks[k];
      if (!open_run) continue;
      if (c.err && !op.err) op.err = c.err;
      op.done += c.done;
      if (c.err || c.done < c.length) open_run = false;
    }
    (write ? write_ops_ : read_ops_).fetch_add(1);
    if (op.err) errors_.fetch_add(1);
    if (!write && op.crcs.size() != op.crc_ranges.size()) checksum(op, op.done);  // split op
    if (!write && op.record_status.size() != op.records.size()) check_records(op, op.done);
  }
}

void IoEngine::crc32c_many(const uint8_t* const* ptrs, const uint64_t* lens, uint32_t* crcs,
                           size_t n) {
  pool_.parallel_for(n, [&](size_t i) { crcs[i] = dsv41::crc32c(0, ptrs[i], lens[i]); });
}

void IoEngine::copy_blocks(uint8_t* dst, const int64_t* dst_idx, const uint8_t* src,
                           const int64_t* src_idx, size_t n, uint64_t block_bytes) {
  pool_.parallel_for(n, [&](size_t i) {
    std::memcpy(dst + dst_idx[i] * block_bytes, src + src_idx[i] * block_bytes, block_bytes);
  });
}

void IoEngine::copy_ranges(uint8_t* dst, const uint64_t* dst_off, const uint8_t* src,
                           const uint64_t* src_off, size_t n, uint64_t length) {
  pool_.parallel_for(n, [&](size_t i) { std::memcpy(dst + dst_off[i], src + src_off[i], length); });
}

int IoEngine::fsync(int fd) {
#if defined(__linux__)
  const int r = ::fdatasync(fd);
#else
  const int r = ::fsync(fd);
#endif
  return r == 0 ? 0 : -errno;
}

bool IoEngine::take_fault(int op, int* err) {
  if (!injected_armed_.load(std::memory_order_relaxed)) return false;
  std::lock_guard<std::mutex> lock(fmu_);
  Injected& f = injected_[op];
  if (f.count == 0) return false;
  if (f.skip > 0) {
    --f.skip;
    return false;
  }
  --f.count;
  *err = f.err;
  injected_armed_.store(injected_[0].count > 0 || injected_[1].count > 0);
  return true;
}

void IoEngine::inject_fault(int op, uint64_t skip, uint64_t count, int err) {
  if (op != kFaultOpOpen && op != kFaultOpRead) throw std::invalid_argument("fault op is open (0) or read (1)");
  std::lock_guard<std::mutex> lock(fmu_);
  injected_[op] = {skip, count, err};
  injected_armed_.store(injected_[0].count > 0 || injected_[1].count > 0);
}

void IoEngine::set_faults(uint32_t faults, uint64_t nospace_after) {
  nospace_after_.store(bytes_written_.load() + nospace_after);
  direct_io_refused_once_.store(false);
  faults_.store(faults);
}

IoCounters IoEngine::counters() const {
  IoCounters c;
  c.bytes_read = bytes_read_.load();
  c.bytes_written = bytes_written_.load();
  c.read_ops = read_ops_.load();
  c.write_ops = write_ops_.load();
  c.direct_ops = direct_ops_.load();
  c.buffered_ops = buffered_ops_.load();
  c.direct_fallbacks = direct_fallbacks_.load();
  c.errors = errors_.load();
  return c;
}

}  // namespace io
}  // namespace dsv41
