// Python face of the I/O engine (dsv41._C.io): buffers come in through the buffer protocol
// (numpy arrays, AlignedBuffer) or as torch tensors for the device paths. The GIL is
// released around every blocking call, so several Python threads can have I/O in flight.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // the at::Tensor <-> torch.Tensor caster

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "dsv41/crc32c.h"
#include "dsv41/io.h"

#ifdef DSV41_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

namespace dsv41 {
namespace {

using io::AlignedBuffer;
using io::IoEngine;
using io::IoOp;

// A contiguous byte view of a Python buffer, kept exported while the GIL is released.
struct ByteView {
  py::buffer_info info;
  uint8_t* ptr = nullptr;
  size_t size = 0;
};

ByteView byte_view(const py::buffer& b, bool writable) {
  ByteView v{b.request(writable)};
  if (v.info.ndim > 0) {
    // Accept any C-contiguous buffer: strides must be the packed ones.
    py::ssize_t expect = v.info.itemsize;
    for (py::ssize_t d = v.info.ndim - 1; d >= 0; --d) {
      if (v.info.shape[d] > 1 && v.info.strides[d] != expect)
        throw std::invalid_argument("buffer must be C-contiguous");
      expect *= v.info.shape[d];
    }
  }
  v.ptr = static_cast<uint8_t*>(v.info.ptr);
  v.size = static_cast<size_t>(v.info.size * v.info.itemsize);
  return v;
}

// ops: [(fd, file_offset, length, buffer, buffer_offset[, crc_ranges])]
// -> [(bytes_done, errno)] or, with crc_ranges on reads, [(bytes_done, errno, [crc, ...])]
py::list run_ops(IoEngine& eng, const py::list& ops, bool write) {
  std::vector<ByteView> views;
  std::vector<IoOp> batch;
  views.reserve(ops.size());
  batch.reserve(ops.size());
  for (const auto& item : ops) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 5 && !(t.size() == 6 && !write))
      throw std::invalid_argument("each op is (fd, offset, length, buffer, buffer_offset[, crc_ranges])");
    IoOp op;
    op.fd = t[0].cast<int>();
    op.offset = t[1].cast<uint64_t>();
    op.length = t[2].cast<uint64_t>();
    views.push_back(byte_view(t[3].cast<py::buffer>(), !write));
    const uint64_t boff = t[4].cast<uint64_t>();
    if (boff > views.back().size || op.length > views.back().size - boff)
      throw std::invalid_argument("op of " + std::to_string(op.length) + " bytes at buffer offset " +
                                  std::to_string(boff) + " overruns a buffer of " +
                                  std::to_string(views.back().size) + " bytes");
    op.buf = views.back().ptr + boff;
    if (t.size() == 6) {
      op.crc_ranges = t[5].cast<std::vector<std::pair<uint64_t, uint64_t>>>();
      for (const auto& [off, len] : op.crc_ranges)
        if (off > op.length || len > op.length - off) throw std::invalid_argument("crc range outside its op");
    }
    batch.push_back(std::move(op));
  }
  {
    py::gil_scoped_release nogil;
    eng.run(batch.data(), batch.size(), write);
  }
  py::list out;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto& op = batch[i];
    if (py::len(ops[i].cast<py::tuple>()) == 6) {
      out.append(py::make_tuple(op.done, op.err, py::cast(op.crcs)));
    } else {
      out.append(py::make_tuple(op.done, op.err));
    }
  }
  return out;
}

// The host CRC-32C paths by the names the bindings take.
constexpr std::pair<const char*, CrcPath> kCrcPaths[] = {
    {"sw", CrcPath::kSw}, {"hw", CrcPath::kHw}, {"fold256", CrcPath::kFold256}, {"fold512", CrcPath::kFold512}};

// Encodes records into a staging buffer on the engine's threads (record::encode: one
// pass per record, copy then CRC over bytes in cache). specs: [(offset in buf, head (256
// bytes, CRC fields ignored), token ids (uint32 buffer), key (bytes), payload (buffer))].
// Every size is checked against the head's geometry before anything is written.
void encode_records(IoEngine& eng, const py::buffer& buf, const py::list& specs) {
  ByteView out = byte_view(buf, true);
  struct Item {
    uint64_t at;
    std::string head, key;
    ByteView tokens, payload;
  };
  std::vector<Item> items;
  items.reserve(specs.size());
  for (const auto& s : specs) {
    auto t = s.cast<py::tuple>();
    if (t.size() != 5) throw std::invalid_argument("each spec is (offset, head, tokens, key, payload)");
    Item it{t[0].cast<uint64_t>(), t[1].cast<std::string>(), t[3].cast<std::string>(),
            byte_view(t[2].cast<py::buffer>(), false), byte_view(t[4].cast<py::buffer>(), false)};
    if (it.head.size() != record::kHeaderBytes) throw std::invalid_argument("a record head is 256 bytes");
    record::HeaderV1 h;
    std::memcpy(&h, it.head.data(), sizeof(h));
    const uint64_t sp = record::span(h.record_bytes);
    if (it.tokens.size != 4ull * h.token_count || it.key.size() != h.key_bytes ||
        it.payload.size != h.payload_bytes)
      throw std::invalid_argument("token ids, key or payload do not match the record head");
    if (it.at > out.size || sp > out.size - it.at) throw std::invalid_argument("record overruns the buffer");
    items.push_back(std::move(it));
  }
  std::vector<uint64_t> written(items.size());
  {
    py::gil_scoped_release nogil;
    eng.parallel_for(items.size(), [&](size_t i) {
      const Item& it = items[i];
      written[i] = record::encode(out.ptr + it.at, out.size - it.at,
                                  reinterpret_cast<const uint8_t*>(it.head.data()),
                                  reinterpret_cast<const uint32_t*>(it.tokens.ptr),
                                  reinterpret_cast<const uint8_t*>(it.key.data()), it.payload.ptr);
    });
  }
  for (uint64_t w : written)
    if (w == 0) throw std::invalid_argument("record head has an inconsistent geometry");
}

// The part of a record spec that read_records and check_heads share: (offset, span,
// record_id, parent_id, block_index, hash, row, ...) and, at index `parent_at` when the
// spec is that long, the block hash the record's parent_hash must equal (None: the index
// holds no parent, which fails the check; b"": not checked, a chain's first record).
// Fills e with them and with the row's token ids and the key (when given). The hash bytes
// e points to are kept in `keep`, reserved by the caller so that they never move.
// Returns the row.
uint64_t fill_expect(record::Expect& e, const py::tuple& rt, size_t parent_at, std::vector<std::string>& keep,
                     uint32_t payload_bytes, const uint32_t* tok, uint64_t tok_rows, uint64_t T,
                     const std::string* key) {
  e.span = rt[1].cast<uint64_t>();
  e.record_id = rt[2].cast<uint64_t>();
  e.parent_id = rt[3].cast<uint64_t>();
  e.block_index = rt[4].cast<uint32_t>();
  keep.push_back(rt[5].cast<std::string>());
  if (keep.back().size() > 32) throw std::invalid_argument("hash longer than 32 bytes");
  e.hash = reinterpret_cast<const uint8_t*>(keep.back().data());
  e.hash_bytes = static_cast<uint32_t>(keep.back().size());
  e.payload_bytes = payload_bytes;
  const uint64_t row = rt[6].cast<uint64_t>();
  if (rt.size() > parent_at) {
    if (rt[parent_at].is_none()) {
      e.check_parent = true;
    } else {
      keep.push_back(rt[parent_at].cast<std::string>());
      if (!keep.back().empty()) {
        if (keep.back().size() > 32) throw std::invalid_argument("parent hash longer than 32 bytes");
        e.check_parent = true;
        e.parent_hash = reinterpret_cast<const uint8_t*>(keep.back().data());
        e.parent_hash_bytes = static_cast<uint32_t>(keep.back().size());
      }
    }
  }
  if (tok) {
    if (row >= tok_rows) throw std::out_of_range("token row out of range");
    e.tokens = tok + row * T;
    e.token_count = static_cast<uint32_t>(T);
  }
  if (key) {
    e.key = reinterpret_cast<const uint8_t*>(key->data());
    e.key_bytes = static_cast<uint32_t>(key->size());
  }
  return row;
}

// ops: [(fd, offset, length, buffer, buffer_offset,
//        [(offset_in_op, span, record_id, parent_id, block_index, hash, row[, parent_hash]), ...])]
// parent_hash (optional): the block hash of the record the index holds under parent_id,
// which the record's parent_hash must equal; None when the index holds none (status
// "chain"); b"" or absent: not checked (a chain's first record).
// tokens: uint32 [rows, T] or None; key: bytes or None; dst: uint8 [rows, payload] or None.
// Returns [(bytes_read, errno, [record status, ...])].
py::list read_records(IoEngine& eng, const py::list& ops, const py::object& tokens, const py::object& key,
                      const py::object& dst, uint32_t payload_bytes) {
  if (payload_bytes == 0) throw std::invalid_argument("payload_bytes must be positive");
  std::vector<ByteView> views;
  std::vector<IoOp> batch;
  views.reserve(ops.size() + 3);
  batch.reserve(ops.size());
  const uint32_t* tok = nullptr;
  uint64_t tok_rows = 0, T = 0;
  if (!tokens.is_none()) {
    ByteView v = byte_view(tokens.cast<py::buffer>(), false);
    if (v.info.itemsize != 4 || v.info.ndim != 2) throw std::invalid_argument("tokens must be uint32 [rows, T]");
    tok = reinterpret_cast<const uint32_t*>(v.ptr);
    tok_rows = static_cast<uint64_t>(v.info.shape[0]);
    T = static_cast<uint64_t>(v.info.shape[1]);
    views.push_back(std::move(v));
  }
  std::string key_str;
  const bool has_key = !key.is_none();
  if (has_key) key_str = key.cast<std::string>();
  uint8_t* out = nullptr;
  uint64_t out_rows = 0;
  if (!dst.is_none()) {
    ByteView v = byte_view(dst.cast<py::buffer>(), true);
    out = v.ptr;
    out_rows = v.size / payload_bytes;
    views.push_back(std::move(v));
  }
  std::vector<std::string> hashes;  // keep the hash bytes alive while the GIL is released
  size_t n_records = 0;
  for (const auto& item : ops) n_records += item.cast<py::tuple>()[5].cast<py::list>().size();
  hashes.reserve(2 * n_records);
  for (const auto& item : ops) {
    auto t = item.cast<py::tuple>();
    if (t.size() != 6) throw std::invalid_argument("each op is (fd, offset, length, buffer, buffer_offset, records)");
    IoOp op;
    op.fd = t[0].cast<int>();
    op.offset = t[1].cast<uint64_t>();
    op.length = t[2].cast<uint64_t>();
    views.push_back(byte_view(t[3].cast<py::buffer>(), true));
    const uint64_t boff = t[4].cast<uint64_t>();
    if (boff > views.back().size || op.length > views.back().size - boff)
      throw std::invalid_argument("read op overruns its buffer");
    op.buf = views.back().ptr + boff;
    for (const auto& r : t[5].cast<py::list>()) {
      auto rt = r.cast<py::tuple>();
      record::Expect e;
      const uint64_t off = rt[0].cast<uint64_t>();
      const uint64_t row = fill_expect(e, rt, 7, hashes, payload_bytes, tok, tok_rows, T, has_key ? &key_str : nullptr);
      if (off > op.length || e.span > op.length - off) throw std::invalid_argument("record outside its op");
      if (out) {
        if (row >= out_rows) throw std::out_of_range("dst row out of range");
        e.dst = out + row * payload_bytes;
      }
      op.records.emplace_back(off, e);
    }
    batch.push_back(std::move(op));
  }
  {
    py::gil_scoped_release nogil;
    eng.run(batch.data(), batch.size(), false);
  }
  py::list result;
  for (const auto& op : batch) result.append(py::make_tuple(op.done, op.err, py::cast(op.record_status)));
  return result;
}

// The host half of a device read: heads (header, token ids, key) of records whose data CRC
// was computed on the device. specs: [(offset_in_heads, span, record_id, parent_id,
// block_index, hash, row, data_crc, bytes_read[, parent_hash])] -> [record status]
// (parent_hash as in read_records).
std::vector<int> check_heads(const py::buffer& heads, const py::list& specs, const py::object& tokens,
                             const py::object& key, uint32_t payload_bytes, uint64_t head_bytes) {
  ByteView hv = byte_view(heads, false);
  ByteView tv;
  const uint32_t* tok = nullptr;
  uint64_t tok_rows = 0, T = 0;
  if (!tokens.is_none()) {
    tv = byte_view(tokens.cast<py::buffer>(), false);
    if (tv.info.itemsize != 4 || tv.info.ndim != 2) throw std::invalid_argument("tokens must be uint32 [rows, T]");
    tok = reinterpret_cast<const uint32_t*>(tv.ptr);
    tok_rows = static_cast<uint64_t>(tv.info.shape[0]);
    T = static_cast<uint64_t>(tv.info.shape[1]);
  }
  std::string key_str = key.is_none() ? std::string() : key.cast<std::string>();
  std::vector<int> out;
  std::vector<std::string> keep;
  for (const auto& r : specs) {
    auto rt = r.cast<py::tuple>();
    const uint64_t off = rt[0].cast<uint64_t>();
    if (off > hv.size || head_bytes > hv.size - off) throw std::invalid_argument("head outside the buffer");
    record::Expect e;
    keep.clear();  // this record's hashes, alive until its check below
    keep.reserve(2);
    fill_expect(e, rt, 9, keep, payload_bytes, tok, tok_rows, T, key.is_none() ? nullptr : &key_str);
    e.data_crc_known = true;
    e.data_crc = rt[7].cast<uint32_t>();
    const uint64_t got = rt[8].cast<uint64_t>();
    // The head must hold the token ids and key the check compares: a record whose head is
    // longer than what was brought back is reported as a header problem, never read past.
    const uint8_t* rec = hv.ptr + off;
    record::HeaderV1 hdr;
    std::memcpy(&hdr, rec, sizeof(hdr));
    if (record::kHeaderBytes + 4ull * hdr.token_count + hdr.key_bytes > head_bytes) {
      out.push_back(got < e.span ? record::kTruncated : record::kHeader);
      continue;
    }
    out.push_back(record::check(rec, got, e));
  }
  return out;
}

void check_blocks(const at::Tensor& t, const char* name) {
  if (t.scalar_type() != at::kByte || t.dim() != 2 || !t.is_contiguous())
    throw std::invalid_argument(std::string(name) + " must be a contiguous uint8 tensor [blocks, block_bytes]");
}

std::vector<int64_t> checked_indices(const std::vector<int64_t>& idx, int64_t rows, const char* name) {
  for (int64_t i : idx)
    if (i < 0 || i >= rows)
      throw std::out_of_range(std::string(name) + " index " + std::to_string(i) + " outside [0, " +
                              std::to_string(rows) + ")");
  return idx;
}

// dst[dst_idx[i]] = src[src_idx[i]] for uint8 [blocks, block_bytes] tensors; CUDA copies
// (any mix of host and device) are enqueued on the current stream of the device involved.
void copy_blocks(IoEngine& eng, at::Tensor dst, const std::vector<int64_t>& dst_idx,
                 const at::Tensor& src, const std::vector<int64_t>& src_idx) {
  check_blocks(dst, "dst");
  check_blocks(src, "src");
  if (dst.size(1) != src.size(1))
    throw std::invalid_argument("dst and src block sizes differ: " + std::to_string(dst.size(1)) +
                                " vs " + std::to_string(src.size(1)));
  if (dst_idx.size() != src_idx.size()) throw std::invalid_argument("dst_idx and src_idx differ in length");
  auto d = checked_indices(dst_idx, dst.size(0), "dst");
  auto s = checked_indices(src_idx, src.size(0), "src");
  const uint64_t bb = static_cast<uint64_t>(dst.size(1));
  auto* dp = static_cast<uint8_t*>(dst.data_ptr());
  const auto* sp = static_cast<const uint8_t*>(src.data_ptr());
  if (dst.is_cuda() || src.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    const auto& dev_t = dst.is_cuda() ? dst : src;
    c10::cuda::CUDAGuard guard(dev_t.device());
    void* stream = c10::cuda::getCurrentCUDAStream(dev_t.device().index()).stream();
    int err;
    {
      py::gil_scoped_release nogil;
      err = io::cuda_copy_blocks(dp, d.data(), sp, s.data(), d.size(), bb, stream);
    }
    if (err) throw std::runtime_error("cuda_copy_blocks failed with CUDA error " + std::to_string(err));
    return;
#else
    throw std::runtime_error("dsv41 was built without CUDA");
#endif
  }
  py::gil_scoped_release nogil;
  eng.copy_blocks(dp, d.data(), sp, s.data(), d.size(), bb);
}

py::dict counters_dict(const io::IoCounters& c) {
  py::dict d;
  d["bytes_read"] = c.bytes_read;
  d["bytes_written"] = c.bytes_written;
  d["read_ops"] = c.read_ops;
  d["write_ops"] = c.write_ops;
  d["direct_ops"] = c.direct_ops;
  d["buffered_ops"] = c.buffered_ops;
  d["direct_fallbacks"] = c.direct_fallbacks;
  d["errors"] = c.errors;
  return d;
}

#ifdef DSV41_WITH_CUDA
// CRC-32C of byte ranges of a CUDA uint8 tensor, computed on the device.
at::Tensor crc32c_device(const at::Tensor& data, const at::Tensor& offsets, const at::Tensor& lengths) {
  if (!data.is_cuda() || data.scalar_type() != at::kByte || !data.is_contiguous())
    throw std::invalid_argument("data must be a contiguous CUDA uint8 tensor");
  if (offsets.scalar_type() != at::kLong || lengths.scalar_type() != at::kLong ||
      offsets.numel() != lengths.numel() || offsets.device() != data.device() ||
      lengths.device() != data.device() || !offsets.is_contiguous() || !lengths.is_contiguous())
    throw std::invalid_argument("offsets and lengths must be contiguous int64 tensors of one length on data's device");
  c10::cuda::CUDAGuard guard(data.device());
  auto crcs = at::empty({offsets.numel()}, data.options().dtype(at::kInt));
  const int err = io::cuda_crc32c_ranges(
      static_cast<const uint8_t*>(data.data_ptr()), reinterpret_cast<const uint64_t*>(offsets.data_ptr()),
      reinterpret_cast<const uint64_t*>(lengths.data_ptr()), reinterpret_cast<uint32_t*>(crcs.data_ptr()),
      static_cast<size_t>(offsets.numel()), c10::cuda::getCurrentCUDAStream(data.device().index()).stream());
  if (err) throw std::runtime_error("crc32c kernel launch failed with CUDA error " + std::to_string(err));
  return crcs;
}
#endif

}  // namespace

void bind_io(py::module_& parent) {
  py::module_ m = parent.def_submodule("io", "dsv41's I/O engine (csrc/io)");
  m.attr("ALIGN") = io::kAlign;
  m.attr("RECORD_ALIGN") = record::kRecordAlign;
  m.attr("HUGE_BYTES") = io::kHugeBytes;
  m.attr("FAULT_REFUSE_DIRECT_OPEN") = static_cast<uint32_t>(io::kFaultRefuseDirectOpen);
  m.attr("FAULT_REFUSE_DIRECT_IO") = static_cast<uint32_t>(io::kFaultRefuseDirectIo);
  m.attr("FAULT_NO_SPACE") = static_cast<uint32_t>(io::kFaultNoSpace);
  m.attr("FAULT_SLOW_SEAL") = static_cast<uint32_t>(io::kFaultSlowSeal);
  m.attr("FAULT_OP_OPEN") = static_cast<int>(io::kFaultOpOpen);
  m.attr("FAULT_OP_READ") = static_cast<int>(io::kFaultOpRead);
  m.attr("RECORD_STATUS") = py::make_tuple("ok", "truncated", "header", "checksum", "collision", "chain");
  m.attr("SEAL_WRITES") = static_cast<int>(IoEngine::kSealWrites);
  m.attr("SEAL_SYNC") = static_cast<int>(IoEngine::kSealSync);
  m.attr("SEAL_RENAME") = static_cast<int>(IoEngine::kSealRename);
  m.attr("SEAL_DIR_SYNC") = static_cast<int>(IoEngine::kSealDirSync);
  m.attr("SEAL_DONE") = static_cast<int>(IoEngine::kSealDone);

  py::class_<AlignedBuffer, std::shared_ptr<AlignedBuffer>>(m, "AlignedBuffer", py::buffer_protocol(),
                                                            "A zeroed 4 KiB-aligned host buffer.")
      .def(py::init([](size_t size, bool pin) {
             auto b = std::make_shared<AlignedBuffer>(size);
             if (pin) b->pin_host();
             return b;
           }),
           py::arg("size"), py::arg("pin") = false)
      .def_property_readonly("size", &AlignedBuffer::size)
      .def_property_readonly("pinned", &AlignedBuffer::pinned)
      .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def("__len__", &AlignedBuffer::size)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {static_cast<py::ssize_t>(1)});
      });

  py::class_<IoEngine, std::shared_ptr<IoEngine>>(m, "IoEngine")
      .def(py::init<int, uint64_t, int>(), py::arg("threads"), py::arg("chunk_bytes") = uint64_t(4) << 20,
           py::arg("write_depth") = 2)
      .def_property_readonly("threads", &IoEngine::threads)
      .def("open",
           [](IoEngine& e, const std::string& path, int flags, int mode, bool direct) {
             bool is_direct = false;
             int fd;
             {
               py::gil_scoped_release nogil;
               fd = e.open(path, flags, mode, direct, &is_direct);
             }
             return std::make_tuple(fd, is_direct);
           },
           py::arg("path"), py::arg("flags"), py::arg("mode") = 0644, py::arg("direct") = true,
           "(fd, is_direct); fd is -errno on failure")
      .def("pread", [](IoEngine& e, const py::list& ops) { return run_ops(e, ops, false); },
           "ops: [(fd, offset, length, buffer, buffer_offset[, crc_ranges])] -> [(bytes_read, errno[, crcs])]")
      .def("pwrite", [](IoEngine& e, const py::list& ops) { return run_ops(e, ops, true); },
           "ops: [(fd, offset, length, buffer, buffer_offset)] -> [(bytes_written, errno)]")
      .def("submit_write",
           [](IoEngine& e, int fd, uint64_t offset, const py::buffer& buf, uint64_t buf_offset,
              uint64_t length) {
             ByteView v = byte_view(buf, false);
             if (buf_offset > v.size || length > v.size - buf_offset)
               throw std::invalid_argument("write of " + std::to_string(length) + " bytes at buffer offset " +
                                           std::to_string(buf_offset) + " overruns a buffer of " +
                                           std::to_string(v.size) + " bytes");
             return e.submit_write(fd, offset, v.ptr + buf_offset, length);
           },
           py::arg("fd"), py::arg("offset"), py::arg("buf"), py::arg("buf_offset"), py::arg("length"),
           "queues one write for the engine's writer threads -> ticket (keep buf alive until wait_write)")
      .def("wait_write",
           [](IoEngine& e, uint64_t ticket) {
             // A write that is done already is taken without giving up the GIL: getting
             // it back can take a switch interval (5 ms) while another thread runs Python.
             std::pair<uint64_t, int> r;
             if (e.poll_write(ticket, &r)) return r;
             py::gil_scoped_release nogil;
             return e.wait_write(ticket);
           },
           py::arg("ticket"), "waits for a submit_write -> (bytes_written, errno)")
      .def("seal_file",
           [](IoEngine& e, int fd, uint64_t first_ticket, uint64_t last_ticket, bool durable,
              const std::string& tmp, const std::string& dst, const std::string& dir) {
             py::gil_scoped_release nogil;
             return e.seal_file(fd, first_ticket, last_ticket, durable, tmp, dst, dir);
           },
           py::arg("fd"), py::arg("first_ticket"), py::arg("last_ticket"), py::arg("durable"), py::arg("tmp"),
           py::arg("dst"), py::arg("dir"),
           "waits for the writes up to last_ticket; unless one of first..last failed: fdatasync (durable), "
           "rename(tmp, dst), fsync(dir) (durable) -> (errno, step reached: 0 writes, 1 fsync, 2 rename, "
           "3 dir fsync, 4 done)")
      .def("seal_files",
           [](IoEngine& e, const std::vector<std::tuple<int, uint64_t, uint64_t, std::string, std::string>>& files,
              bool durable, const std::string& dir) {
             std::vector<IoEngine::SealItem> items;
             for (const auto& [fd, first, last, tmp, dst] : files) items.push_back({fd, first, last, tmp, dst});
             py::gil_scoped_release nogil;
             return e.seal_files(items, durable, dir);
           },
           py::arg("files"), py::arg("durable"), py::arg("dir"),
           "seal_file of several files [(fd, first_ticket, last_ticket, tmp, dst)] as one group: every write "
           "waited for, then in order fdatasync (durable) and rename up to the first failure, one fsync(dir) "
           "-> (errno, step of the failure or 4, files renamed)")
      .def("read_records", &read_records, py::arg("ops"), py::arg("tokens"), py::arg("key"), py::arg("dst"),
           py::arg("payload_bytes"),
           "verified record reads: each worker checks (and copies out) the records of the op it read")
      .def("encode_records", &encode_records, py::arg("buf"), py::arg("specs"),
           "encodes records (head, token ids, key, payload, padding, CRCs) into buf in parallel")
      .def("crc32c_many",
           [](IoEngine& e, const py::buffer& b, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
             ByteView v = byte_view(b, false);
             std::vector<const uint8_t*> ptrs;
             std::vector<uint64_t> lens;
             for (const auto& [off, len] : ranges) {
               if (off > v.size || len > v.size - off) throw std::invalid_argument("crc range overruns the buffer");
               ptrs.push_back(v.ptr + off);
               lens.push_back(len);
             }
             std::vector<uint32_t> crcs(ranges.size());
             {
               py::gil_scoped_release nogil;
               e.crc32c_many(ptrs.data(), lens.data(), crcs.data(), crcs.size());
             }
             return crcs;
           })
      .def("copy_ranges",
           [](IoEngine& e, const py::buffer& dst, const std::vector<uint64_t>& dst_off, const py::buffer& src,
              const std::vector<uint64_t>& src_off, uint64_t length) {
             if (dst_off.size() != src_off.size()) throw std::invalid_argument("dst_off and src_off differ in length");
             ByteView d = byte_view(dst, true);
             ByteView s = byte_view(src, false);
             for (size_t i = 0; i < dst_off.size(); ++i) {
               if (dst_off[i] > d.size || length > d.size - dst_off[i] || src_off[i] > s.size ||
                   length > s.size - src_off[i])
                 throw std::invalid_argument("copy range " + std::to_string(i) + " overruns a buffer");
             }
             py::gil_scoped_release nogil;
             e.copy_ranges(d.ptr, dst_off.data(), s.ptr, src_off.data(), dst_off.size(), length);
           },
           py::arg("dst"), py::arg("dst_off"), py::arg("src"), py::arg("src_off"), py::arg("length"),
           "dst[dst_off[i]:+length] = src[src_off[i]:+length], in parallel")
      .def("copy_blocks", &copy_blocks, py::arg("dst"), py::arg("dst_idx"), py::arg("src"), py::arg("src_idx"))
      .def("fsync",
           [](IoEngine& e, int fd) {
             py::gil_scoped_release nogil;
             return e.fsync(fd);
           })
      .def("set_faults", &IoEngine::set_faults, py::arg("faults"), py::arg("nospace_after") = 0)
      .def("inject_fault", &IoEngine::inject_fault, py::arg("op"), py::arg("skip"), py::arg("count"),
           py::arg("err"))
      .def("counters", [](const IoEngine& e) { return counters_dict(e.counters()); });

  m.def("crc32c",
        [](const py::buffer& b, uint32_t crc) {
          ByteView v = byte_view(b, false);
          py::gil_scoped_release nogil;
          return dsv41::crc32c(crc, v.ptr, v.size);
        },
        py::arg("data"), py::arg("crc") = 0);
  m.def("crc32c_sw",
        [](const py::buffer& b, uint32_t crc) {
          ByteView v = byte_view(b, false);
          return dsv41::crc32c_sw(crc, v.ptr, v.size);
        },
        py::arg("data"), py::arg("crc") = 0);
  // Each host path by name, with or without the copy a verified read (copy) and a record
  // encode (stream: non-temporal stores) make in the same pass; the tests compare them.
  m.def("crc32c_path",
        [](const std::string& path, const py::buffer& src, uint32_t crc, const py::object& dst, bool stream) {
          const CrcPath* p = nullptr;
          for (const auto& [name, v] : kCrcPaths)
            if (path == name) p = &v;
          if (!p) throw std::invalid_argument("path is sw, hw, fold256 or fold512");
          if (!crc32c_path_available(*p))
            throw std::runtime_error(std::string("this CPU has no ") + crc32c_path_name(*p) + " CRC-32C path");
          ByteView v = byte_view(src, false);
          ByteView d{};
          if (!dst.is_none()) {
            d = byte_view(dst.cast<py::buffer>(), true);
            if (d.size < v.size) throw std::invalid_argument("dst is shorter than src");
          }
          py::gil_scoped_release nogil;
          return dsv41::crc32c_path(*p, crc, d.ptr, v.ptr, v.size, stream);
        },
        py::arg("path"), py::arg("src"), py::arg("crc") = 0, py::arg("dst") = py::none(), py::arg("stream") = false);
  m.def("crc32c_paths", []() {
    py::list out;
    for (const auto& [name, p] : kCrcPaths)
      if (crc32c_path_available(p)) out.append(name);
    return out;
  }, "the names crc32c_path takes on this CPU");
  m.def("crc32c_chunked",
        [](const py::buffer& b, int chunks) {
          ByteView v = byte_view(b, false);
          return dsv41::crc32c_chunked(v.ptr, v.size, chunks);
        },
        py::arg("data"), py::arg("chunks"));
  // Rows that lead with the CRC-32C of their remaining bytes (journal entries): one call
  // for a batch of them instead of a Python call per row.
  m.def("crc32c_lead_rows",
        [](const py::buffer& b, uint64_t row_bytes) {
          ByteView v = byte_view(b, true);
          if (row_bytes <= 4 || v.size % row_bytes)
            throw std::invalid_argument("buffer is not whole rows of more than 4 bytes");
          for (uint8_t* row = v.ptr; row < v.ptr + v.size; row += row_bytes) {
            const uint32_t c = dsv41::crc32c(0, row + 4, row_bytes - 4);
            for (int i = 0; i < 4; ++i) row[i] = uint8_t(c >> (8 * i));
          }
        },
        py::arg("rows"), py::arg("row_bytes"),
        "rows[r][0:4] = crc32c(rows[r][4:]), little-endian, for each row in place");
  m.def("crc32c_combine", [](uint32_t a, uint32_t b, uint64_t len_b) { return crc::combine(a, b, len_b); });
  m.def("crc32c_backend", &crc32c_backend);
  m.def("check_heads", &check_heads, py::arg("heads"), py::arg("specs"), py::arg("tokens"), py::arg("key"),
        py::arg("payload_bytes"), py::arg("head_bytes"),
        "record checks for records read into device memory (data CRC computed there)");
  m.def("cuda_device_count", &io::cuda_device_count);
  m.def("gds_status", []() {
    const io::GdsStatus s = io::gds_status();
    return std::make_tuple(s.available, s.reason);
  });
  m.def("cufile_compiled", []() {
#if defined(DSV41_WITH_CUDA) && defined(DSV41_WITH_CUFILE)
    return true;
#else
    return false;
#endif
  });

  m.def("gds_error_string", &io::gds_error_string, py::arg("code"),
        "what a GdsFile result or cuFile error code means (errno text, or the CUfileOpError)");
  // The device buffer may be memory torch's caching allocator handed back with work still
  // queued on it, and cuFile neither knows nor waits for CUDA streams: the read waits for
  // the current stream first (as kvikio's sync_default_stream does). The guard makes the
  // tensor's device, and so its primary context, current on this thread: cuFile calls
  // with GPU buffers need a valid context.
  py::class_<io::GdsFile, std::shared_ptr<io::GdsFile>>(m, "GdsFile")
      .def(py::init<const std::string&, bool>(), py::arg("path"), py::arg("write") = false)
      .def_property_readonly("direct", &io::GdsFile::direct)
      .def("read",
           [](io::GdsFile& f, const at::Tensor& dst, uint64_t size, uint64_t file_offset, uint64_t dev_offset) {
             if (!dst.is_cuda() || !dst.is_contiguous()) throw std::invalid_argument("dst must be a contiguous CUDA tensor");
             if (dev_offset + size > static_cast<uint64_t>(dst.nbytes())) throw std::invalid_argument("read overruns dst");
#ifdef DSV41_WITH_CUDA
             c10::cuda::CUDAGuard guard(dst.device());
             py::gil_scoped_release nogil;
             c10::cuda::getCurrentCUDAStream(dst.device().index()).synchronize();
#else
             py::gil_scoped_release nogil;
#endif
             return f.read(dst.data_ptr(), size, file_offset, dev_offset);
           })
      .def("write", [](io::GdsFile& f, const at::Tensor& src, uint64_t size, uint64_t file_offset, uint64_t dev_offset) {
        if (!src.is_cuda() || !src.is_contiguous()) throw std::invalid_argument("src must be a contiguous CUDA tensor");
        if (dev_offset + size > static_cast<uint64_t>(src.nbytes())) throw std::invalid_argument("write overruns src");
#ifdef DSV41_WITH_CUDA
        c10::cuda::CUDAGuard guard(src.device());
        py::gil_scoped_release nogil;
        c10::cuda::getCurrentCUDAStream(src.device().index()).synchronize();
#else
        py::gil_scoped_release nogil;
#endif
        return f.write(src.data_ptr(), size, file_offset, dev_offset);
      });

#ifdef DSV41_WITH_CUDA
  m.def("crc32c_device", &crc32c_device, py::arg("data"), py::arg("offsets"), py::arg("lengths"));
#endif
}

}  // namespace dsv41
