// Python face of the remote values (dsv41._C.remote; include/dsv41/remote_value.h): chain
// ids, and the batch encoder and checker the remote tier runs on every put and lookup.
// Arguments are unpacked with the GIL held; the per-value work runs without it.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "dsv41/remote_value.h"
#include "dsv41/sha256.h"

namespace py = pybind11;

namespace dsv41 {
namespace {

// A C-contiguous buffer of `ndim` dimensions and `itemsize`-byte items, held while in use.
struct Array {
  py::buffer_info info;
  uint8_t* ptr = nullptr;
  uint64_t rows = 0, cols = 0;   // cols: items per row

  Array(const py::object& obj, int ndim, ssize_t itemsize, bool writable, const char* name)
      : info(obj.cast<py::buffer>().request(writable)) {
    if (info.ndim != ndim || info.itemsize != itemsize)
      throw std::invalid_argument(std::string(name) + ": wrong shape or item size");
    ssize_t expect = itemsize;
    for (ssize_t d = ndim - 1; d >= 0; --d) {
      if (info.shape[d] > 1 && info.strides[d] != expect)
        throw std::invalid_argument(std::string(name) + " must be C-contiguous");
      expect *= info.shape[d];
    }
    ptr = static_cast<uint8_t*>(info.ptr);
    rows = static_cast<uint64_t>(info.shape[0]);
    cols = ndim > 1 ? static_cast<uint64_t>(info.shape[1]) : 1;
  }
};

// A value handed in by a backend, as a simple contiguous buffer.
struct Held {
  Py_buffer view{};
  bool ok = false;
  explicit Held(PyObject* o) {
    ok = PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) == 0;
    if (!ok) PyErr_Clear();   // not a contiguous buffer: a value that fails the check
  }
  Held(Held&& o) noexcept : view(o.view), ok(o.ok) { o.ok = false; }
  Held(const Held&) = delete;
  ~Held() {
    if (ok) PyBuffer_Release(&view);
  }
};

std::string as_hash(const py::handle& h, const char* name) {
  std::string s = h.cast<std::string>();
  if (s.size() > 32) throw std::invalid_argument(std::string(name) + " longer than 32 bytes");
  return s;
}

const uint32_t* token_rows(const Array& tok, uint64_t n) {
  if (tok.rows < n) throw std::invalid_argument("fewer token rows than values");
  return reinterpret_cast<const uint32_t*>(tok.ptr);
}

// [chain id of each row of tokens uint32 [n, T]], the first one's parent being `parent`.
std::vector<uint64_t> chain_ids(const py::object& tokens, const std::string& key, uint64_t parent) {
  Array tok(tokens, 2, 4, false, "tokens");
  std::vector<uint64_t> out(tok.rows);
  {
    py::gil_scoped_release nogil;
    remote::Chain chain(reinterpret_cast<const uint8_t*>(key.data()), key.size(), tok.cols);
    const uint32_t* t = reinterpret_cast<const uint32_t*>(tok.ptr);
    for (uint64_t i = 0; i < tok.rows; ++i) out[i] = parent = chain.next(parent, t + i * tok.cols);
  }
  return out;
}

// Fields every value of a batch shares.
remote::Value common(const std::string& key, uint64_t T, uint64_t P, uint32_t payload_offset, uint32_t record_bytes) {
  if (uint64_t(payload_offset) < record::kHeaderBytes + 4 * T + key.size() ||
      uint64_t(record_bytes) != payload_offset + P)
    throw std::invalid_argument("payload_offset / record_bytes do not fit the tokens, key and payload");
  remote::Value v;
  v.key = reinterpret_cast<const uint8_t*>(key.data());
  v.key_bytes = static_cast<uint32_t>(key.size());
  v.token_count = static_cast<uint32_t>(T);
  v.payload_bytes = static_cast<uint32_t>(P);
  v.payload_offset = payload_offset;
  v.record_bytes = record_bytes;
  return v;
}

// Encodes n values into out (uint8 [n, row]): row == record_bytes writes whole values,
// row == payload_offset only their heads (the payload is then sent from where it is).
void encode_values(const py::object& out, const py::object& tokens, const std::string& key, const py::object& payloads,
                   const std::vector<uint32_t>& block_indices, const py::list& hashes, const py::list& parent_hashes,
                   const std::vector<uint64_t>& chain, const std::vector<uint64_t>& parent_chains, uint64_t created_ns,
                   uint32_t payload_offset, uint32_t record_bytes) {
  Array dst(out, 2, 1, true, "out"), pay(payloads, 2, 1, false, "payloads"), tok(tokens, 2, 4, false, "tokens");
  const uint64_t n = dst.rows;
  if (pay.rows != n || tok.rows != n || block_indices.size() != n || py::len(hashes) != n ||
      py::len(parent_hashes) != n || chain.size() != n || parent_chains.size() != n)
    throw std::invalid_argument("encode_values: every argument needs one entry per value");
  const bool whole = dst.cols == record_bytes;
  if (!whole && dst.cols != payload_offset) throw std::invalid_argument("out rows are neither values nor heads");
  const remote::Value base = common(key, tok.cols, pay.cols, payload_offset, record_bytes);
  std::vector<std::string> hs, ps;
  for (uint64_t i = 0; i < n; ++i) {
    hs.push_back(as_hash(hashes[i], "a block hash"));
    ps.push_back(as_hash(parent_hashes[i], "a parent hash"));
  }
  py::gil_scoped_release nogil;
  for (uint64_t i = 0; i < n; ++i) {
    remote::Value v = base;
    v.chain_id = chain[i];
    v.parent_chain = parent_chains[i];
    v.created_ns = created_ns;
    v.block_index = block_indices[i];
    v.hash = reinterpret_cast<const uint8_t*>(hs[i].data());
    v.hash_bytes = static_cast<uint32_t>(hs[i].size());
    v.parent_hash = reinterpret_cast<const uint8_t*>(ps[i].data());
    v.parent_hash_bytes = static_cast<uint32_t>(ps[i].size());
    v.tokens = reinterpret_cast<const uint32_t*>(tok.ptr) + i * tok.cols;
    remote::encode(dst.ptr + i * dst.cols, whole, v, pay.ptr + i * pay.cols);
  }
}

// Checks values[j] as block start + j of one chain (hashes[j], chain[j], tokens row j),
// copying each good payload to row j of out (uint8 [>= n, payload_bytes]; None: no copy),
// up to the first value that is missing (None) or fails. Returns (good, failed): the
// run's length, and whether a value that was there ended it.
std::pair<uint64_t, bool> verify_values(const py::list& values, const py::object& out, const py::object& tokens,
                                        const std::string& key, uint32_t start, const py::list& hashes,
                                        const std::string& parent_hash, const std::vector<uint64_t>& chain,
                                        uint64_t parent_chain, uint32_t payload_bytes, uint32_t payload_offset,
                                        uint32_t record_bytes) {
  Array tok(tokens, 2, 4, false, "tokens");
  std::unique_ptr<Array> dst;
  const uint64_t n = values.size();
  if (!out.is_none()) {
    dst = std::make_unique<Array>(out, 2, 1, true, "out");
    if (dst->rows < n || dst->cols != payload_bytes) throw std::invalid_argument("out is not uint8 [n, payload_bytes]");
  }
  if (py::len(hashes) < n || chain.size() < n) throw std::invalid_argument("verify_values: too few hashes or chain ids");
  const uint32_t* t = token_rows(tok, n);
  remote::Value base = common(key, tok.cols, payload_bytes, payload_offset, record_bytes);
  if (parent_hash.size() > 32) throw std::invalid_argument("parent hash longer than 32 bytes");
  std::vector<Held> held;
  std::vector<std::string> hs;
  held.reserve(n);
  for (uint64_t j = 0; j < n; ++j) {
    PyObject* v = values[j].ptr();
    if (v == Py_None) break;
    held.emplace_back(v);
    hs.push_back(as_hash(hashes[j], "a block hash"));
    if (!held.back().ok) break;
  }
  py::gil_scoped_release nogil;
  uint64_t good = 0;
  for (; good < held.size() && held[good].ok; ++good) {
    remote::Value v = base;
    const uint64_t j = good;
    v.block_index = start + static_cast<uint32_t>(j);
    v.chain_id = chain[j];
    v.parent_chain = j ? chain[j - 1] : parent_chain;
    v.hash = reinterpret_cast<const uint8_t*>(hs[j].data());
    v.hash_bytes = static_cast<uint32_t>(hs[j].size());
    const std::string& ph = j ? hs[j - 1] : parent_hash;
    v.parent_hash = reinterpret_cast<const uint8_t*>(ph.data());
    v.parent_hash_bytes = static_cast<uint32_t>(ph.size());
    v.tokens = t + j * tok.cols;
    const Py_buffer& b = held[j].view;
    if (!remote::check(static_cast<const uint8_t*>(b.buf), static_cast<uint64_t>(b.len), v,
                       dst ? dst->ptr + j * payload_bytes : nullptr))
      break;
  }
  return {good, good < held.size()};
}

}  // namespace

void bind_remote(py::module_& parent) {
  py::module_ m = parent.def_submodule("remote", "the remote tier's values (csrc/io/remote_value.cpp)");
  m.def("sha256",
        [](const py::buffer& data, bool portable) {
          py::buffer_info b = data.request();
          uint8_t d[32];
          (portable ? sha256_portable : sha256)(b.ptr, static_cast<size_t>(b.size * b.itemsize), d);
          return py::bytes(reinterpret_cast<const char*>(d), 32);
        },
        py::arg("data"), py::arg("portable") = false);
  m.def("sha256_hw_available", &sha256_hw_available);
  m.def("chain_ids", &chain_ids, py::arg("tokens"), py::arg("key"), py::arg("parent"));
  m.def("encode_values", &encode_values, py::arg("out"), py::arg("tokens"), py::arg("key"), py::arg("payloads"),
        py::arg("block_indices"), py::arg("hashes"), py::arg("parent_hashes"), py::arg("chain"),
        py::arg("parent_chains"), py::arg("created_ns"), py::arg("payload_offset"), py::arg("record_bytes"));
  m.def("verify_values", &verify_values, py::arg("values"), py::arg("out"), py::arg("tokens"), py::arg("key"),
        py::arg("start"), py::arg("hashes"), py::arg("parent_hash"), py::arg("chain"), py::arg("parent_chain"),
        py::arg("payload_bytes"), py::arg("payload_offset"), py::arg("record_bytes"));
}

}  // namespace dsv41
