// Python module `_dynemb_redis_rows`: the Redis store's row path (../backends/redis_store.py)
// between numpy arrays and the Redis protocol (RESP) bytes, with no Python object per row.
// A pull is one call that writes the HMGET pipeline, one that reads its replies into the rows
// (and their stamps); a push or delete one call that writes plain HSETs (each row and its stamp)
// or HDELs, a command per bucket (plain_write_request, integer_replies). On Redis Cluster,
// slot_nodes tells which node serves each id's bucket. A sweep reads a slice's stamps from
// its buckets' HGETALLs (bucket_stamps). The socket I/O stays in Python (it
// serves TCP, unix sockets and TLS alike); `scan` tells it when the replies are complete.
// Every size is checked against the buffer it came in: no reply, however wrong, makes a call
// read or write outside a buffer. The GIL is dropped while the bytes are built or read.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "hash.h"

namespace {

// ps_server/hashing.py's ROW_HASH_SEED and bucket_of: XXH64 of the id's 8 bytes with that
// seed, its top 32 bits scaled to [0, num_buckets).
constexpr uint64_t kRowHashSeed = 0x64796E656D62ULL;

inline uint64_t bucket_of(int64_t id, uint64_t num_buckets) {
  using namespace dynemb;
  uint64_t h = kRowHashSeed + kXxhP5 + 8;
  h ^= rotl64(uint64_t(id) * kXxhP2, 31) * kXxhP1;
  h = rotl64(h, 27) * kXxhP1 + kXxhP4;
  return ((xxh64_avalanche(h) >> 32) * num_buckets) >> 32;
}

// A contiguous buffer held for the length of a call.
struct Buf {
  Py_buffer view{};
  bool held = false;
  ~Buf() {
    if (held) PyBuffer_Release(&view);
  }
  bool get(PyObject* obj, bool writable) {
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return false;
    held = true;
    return true;
  }
  char* data() const { return static_cast<char*>(view.buf); }
  Py_ssize_t len() const { return view.len; }
};

// The ids grouped by bucket: order[starts[g]:starts[g+1]] are the positions of the ids of
// bucket buckets[g], in their order in the batch (so a repeated id's last row wins a write).
struct Groups {
  std::vector<int64_t> order;
  std::vector<uint64_t> buckets;
  std::vector<int64_t> starts;
};

void group(const int64_t* ids, int64_t n, uint64_t num_buckets, Groups& g) {
  g.order.resize(n);
  if (num_buckets <= uint64_t(8 * n)) {  // a counting sort: two passes over the ids, one over the buckets
    std::vector<uint32_t> bucket(n);
    std::vector<int64_t> at(num_buckets + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++at[(bucket[i] = uint32_t(bucket_of(ids[i], num_buckets))) + 1];
    for (uint64_t b = 0; b < num_buckets; ++b) {
      if (at[b + 1]) {
        g.buckets.push_back(b);
        g.starts.push_back(at[b]);
      }
      at[b + 1] += at[b];
    }
    for (int64_t i = 0; i < n; ++i) g.order[at[bucket[i]]++] = i;  // in batch order within a bucket
  } else {
    std::vector<uint64_t> keys(n);  // bucket << 32 | position: sorting them is a stable sort by bucket
    for (int64_t i = 0; i < n; ++i) keys[i] = (bucket_of(ids[i], num_buckets) << 32) | uint64_t(i);
    std::sort(keys.begin(), keys.end());
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t b = keys[i] >> 32;
      g.order[i] = int64_t(keys[i] & 0xFFFFFFFFULL);
      if (i == 0 || b != g.buckets.back()) {
        g.buckets.push_back(b);
        g.starts.push_back(i);
      }
    }
  }
  g.starts.push_back(n);
}

// Where a request is written: counting its bytes (data null), then writing them into a bytes
// object of that exact size, so the request is built in place, with no copy after.
struct Out {
  char* data = nullptr;
  size_t size = 0;
  void append(const char* p, size_t n) {
    if (data) std::memcpy(data + size, p, n);
    size += n;
  }
  Out& operator+=(const char* text) {
    append(text, std::strlen(text));
    return *this;
  }
  Out& operator+=(const std::string& text) {
    append(text.data(), text.size());
    return *this;
  }
};

void put_count(Out& s, char kind, int64_t n) {
  s.append(&kind, 1);
  s += std::to_string(n);
  s += "\r\n";
}

void put_bulk(Out& s, const char* p, size_t n) {
  put_count(s, '$', int64_t(n));
  s.append(p, n);
  s += "\r\n";
}

void put_key(Out& s, const std::string& prefix, uint64_t bucket) {
  const std::string b = std::to_string(bucket);
  put_count(s, '$', int64_t(prefix.size() + b.size() + 1));
  s += prefix;
  s += b;
  s += "}\r\n";
}

// emit(out) twice: to size the request, then to write it into a new bytes object (the GIL
// dropped while it writes). Called with the GIL held.
template <typename Emit>
PyObject* build(Emit emit) {
  Out count;
  Py_BEGIN_ALLOW_THREADS
  emit(count);
  Py_END_ALLOW_THREADS
  PyObject* bytes = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(count.size));
  if (!bytes) return nullptr;
  Out out;
  out.data = PyBytes_AS_STRING(bytes);
  Py_BEGIN_ALLOW_THREADS
  emit(out);
  Py_END_ALLOW_THREADS
  return bytes;
}

// Ids from a buffer of int64 (8-byte items, native order: the module is built for this machine).
bool ids_of(PyObject* obj, Buf& b, int64_t& n) {
  if (!b.get(obj, false)) return false;
  if (b.len() % 8) {
    PyErr_SetString(PyExc_ValueError, "ids must be a contiguous int64 array");
    return false;
  }
  n = b.len() / 8;
  if (n >= (int64_t(1) << 32)) {
    PyErr_SetString(PyExc_ValueError, "at most 2**32 - 1 ids per call");
    return false;
  }
  return true;
}


// pull_request(ids, num_buckets, prefix, order) -> (request, commands): one HMGET per touched
// bucket of the ids' 8-byte fields; order (int64, one per id) gets the position of each field
// in the replies' order.
PyObject* py_pull_request(PyObject*, PyObject* args) {
  PyObject *ids_o, *order_o;
  unsigned long long num_buckets;
  const char* prefix_p;
  Py_ssize_t prefix_n;
  if (!PyArg_ParseTuple(args, "OKy#O", &ids_o, &num_buckets, &prefix_p, &prefix_n, &order_o)) return nullptr;
  Buf ids_b, order_b;
  int64_t n;
  if (!ids_of(ids_o, ids_b, n) || !order_b.get(order_o, true)) return nullptr;
  if (order_b.len() != n * 8 || num_buckets < 1) {
    PyErr_SetString(PyExc_ValueError, "pull_request: order must hold one int64 per id, num_buckets >= 1");
    return nullptr;
  }
  const std::string prefix(prefix_p, size_t(prefix_n));
  Groups g;
  const int64_t* ids = reinterpret_cast<const int64_t*>(ids_b.data());
  Py_BEGIN_ALLOW_THREADS
  group(ids, n, num_buckets, g);
  std::memcpy(order_b.data(), g.order.data(), size_t(n) * 8);
  Py_END_ALLOW_THREADS
  PyObject* r = build([&](Out& req) {
    for (size_t k = 0; k + 1 < g.starts.size(); ++k) {
      put_count(req, '*', 2 + g.starts[k + 1] - g.starts[k]);
      req += "$5\r\nHMGET\r\n";
      put_key(req, prefix, g.buckets[k]);
      for (int64_t i = g.starts[k]; i < g.starts[k + 1]; ++i) {
        req += "$8\r\n";
        req.append(reinterpret_cast<const char*>(ids + g.order[i]), 8);
        req += "\r\n";
      }
    }
  });
  return r ? Py_BuildValue("(Nn)", r, Py_ssize_t(g.buckets.size())) : nullptr;
}

// A write's ids and rows (or None), checked and grouped by bucket, for plain_write_request.
struct WriteInput {
  Buf ids_b, rows_b, rows_at_b;
  int64_t n = 0;
  const int64_t* ids = nullptr;
  const char* rows = nullptr;        // nullptr: a delete (HDEL), fields only
  const int64_t* rows_at = nullptr;  // id i's row is rows[rows_at[i]]; nullptr: rows[i]
  int64_t per_id = 1;                // values a bucket command takes per id: field-row pairs or fields
  Groups g;
  const char* row(int64_t i, Py_ssize_t row_bytes) const { return rows + (rows_at ? rows_at[i] : i) * row_bytes; }
};

bool write_input(const char* what, PyObject* ids_o, PyObject* rows_o, Py_ssize_t row_bytes,
                 unsigned long long num_buckets, WriteInput& in, PyObject* rows_at_o = nullptr) {
  if (!ids_of(ids_o, in.ids_b, in.n)) return false;
  const bool with_rows = rows_o != Py_None;
  if (with_rows && !in.rows_b.get(rows_o, false)) return false;
  const bool at = rows_at_o && rows_at_o != Py_None;
  if (at && (!with_rows || !in.rows_at_b.get(rows_at_o, false))) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: rows_at is for rows, not a delete", what);
    return false;
  }
  if (num_buckets < 1 || row_bytes < 0 || (with_rows && !at && in.rows_b.len() != in.n * row_bytes) ||
      (at && (row_bytes < 1 || in.rows_b.len() % row_bytes || in.rows_at_b.len() != in.n * 8))) {
    PyErr_Format(PyExc_ValueError,
                 "%s: rows must be row_bytes per id (with rows_at: whole rows, and one int64 of rows_at per id), "
                 "num_buckets >= 1",
                 what);
    return false;
  }
  in.per_id = with_rows ? 2 : 1;
  in.ids = reinterpret_cast<const int64_t*>(in.ids_b.data());
  in.rows = with_rows ? in.rows_b.data() : nullptr;
  if (at) {
    in.rows_at = reinterpret_cast<const int64_t*>(in.rows_at_b.data());
    const int64_t stored = in.rows_b.len() / row_bytes;
    for (int64_t i = 0; i < in.n; ++i) {
      if (in.rows_at[i] < 0 || in.rows_at[i] >= stored) {
        PyErr_Format(PyExc_ValueError, "%s: rows_at[%lld] = %lld is not a row of the %lld given", what, (long long)i,
                     (long long)in.rows_at[i], (long long)stored);
        return false;
      }
    }
  }
  Py_BEGIN_ALLOW_THREADS
  group(in.ids, in.n, num_buckets, in.g);
  Py_END_ALLOW_THREADS
  return true;
}

// The Cluster hash slot of bucket key tag `tag_prefix` + the bucket's decimal number (what Redis
// hashes of a key with a `{...}` hash tag): CRC16-CCITT (XMODEM: polynomial 0x1021, initial 0)
// of the tag, mod 16384.
struct Crc16 {
  uint16_t table[256];
  Crc16() {
    for (int i = 0; i < 256; ++i) {
      uint16_t c = uint16_t(i << 8);
      for (int k = 0; k < 8; ++k) c = uint16_t((c & 0x8000) ? (c << 1) ^ 0x1021 : c << 1);
      table[i] = c;
    }
  }
  uint16_t update(uint16_t crc, const char* p, size_t n) const {
    for (size_t i = 0; i < n; ++i) crc = uint16_t((crc << 8) ^ table[((crc >> 8) ^ uint8_t(p[i])) & 0xFF]);
    return crc;
  }
};
const Crc16 kCrc16;
constexpr int64_t kClusterSlots = 16384;

// slot_nodes(ids, num_buckets, tag_prefix, slot_node, out): out[i] (int32) = slot_node[slot of
// the bucket of ids[i]] (int32 per slot, 16384 of them: the node that serves the slot, or -1).
PyObject* py_slot_nodes(PyObject*, PyObject* args) {
  PyObject *ids_o, *slot_node_o, *out_o;
  unsigned long long num_buckets;
  const char* tag_p;
  Py_ssize_t tag_n;
  if (!PyArg_ParseTuple(args, "OKy#OO", &ids_o, &num_buckets, &tag_p, &tag_n, &slot_node_o, &out_o)) return nullptr;
  Buf ids_b, slot_node_b, out_b;
  int64_t n;
  if (!ids_of(ids_o, ids_b, n) || !slot_node_b.get(slot_node_o, false) || !out_b.get(out_o, true)) return nullptr;
  if (num_buckets < 1 || num_buckets >= (1ULL << 32) || slot_node_b.len() != kClusterSlots * 4 ||
      out_b.len() != n * 4) {
    PyErr_SetString(PyExc_ValueError,
                    "slot_nodes: num_buckets in [1, 2**32), slot_node 16384 int32, out one int32 per id");
    return nullptr;
  }
  const int64_t* ids = reinterpret_cast<const int64_t*>(ids_b.data());
  const int32_t* slot_node = reinterpret_cast<const int32_t*>(slot_node_b.data());
  int32_t* out = reinterpret_cast<int32_t*>(out_b.data());
  Py_BEGIN_ALLOW_THREADS
  const uint16_t head = kCrc16.update(0, tag_p, size_t(tag_n));
  char digits[24];
  for (int64_t i = 0; i < n; ++i) {
    uint64_t b = bucket_of(ids[i], num_buckets);
    int d = int(sizeof digits);
    do {
      digits[--d] = char('0' + b % 10);
      b /= 10;
    } while (b);
    const uint16_t crc = kCrc16.update(head, digits + d, sizeof digits - size_t(d));
    out[i] = slot_node[crc % kClusterSlots];
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// plain_write_request(ids, rows or None, row_bytes, num_buckets, prefix[, suffix[, rows_at]]) ->
// (request, commands): one plain HSET (rows given: field-row pairs, each row followed by suffix,
// its stamp) or HDEL (fields) per touched bucket, buckets in ascending order, each bucket's ids
// in their order in the batch (a repeated id's last row wins). Each reply is the fields added or
// removed. rows_at (int64, one per id): id i's row is rows[rows_at[i]] (a part of a bigger write
// made without copying its rows out first).
PyObject* py_plain_write_request(PyObject*, PyObject* args) {
  PyObject *ids_o, *rows_o, *rows_at_o = nullptr;
  Py_ssize_t row_bytes;
  unsigned long long num_buckets;
  const char* prefix_p;
  Py_ssize_t prefix_n;
  const char* suffix_p = "";
  Py_ssize_t suffix_n = 0;
  if (!PyArg_ParseTuple(args, "OOnKy#|y#O", &ids_o, &rows_o, &row_bytes, &num_buckets, &prefix_p, &prefix_n,
                        &suffix_p, &suffix_n, &rows_at_o))
    return nullptr;
  WriteInput in;
  if (!write_input("plain_write_request", ids_o, rows_o, row_bytes, num_buckets, in, rows_at_o)) return nullptr;
  const std::string prefix(prefix_p, size_t(prefix_n));
  const std::string suffix(suffix_p, size_t(suffix_n));  // appended to every row (its stamp)
  const Groups& g = in.g;
  const int64_t per_id = in.per_id;
  const int64_t* ids = in.ids;
  const bool rows = in.rows != nullptr;
  PyObject* r = build([&](Out& req) {
    for (size_t k = 0; k + 1 < g.starts.size(); ++k) {
      put_count(req, '*', 2 + per_id * (g.starts[k + 1] - g.starts[k]));
      req += rows ? "$4\r\nHSET\r\n" : "$4\r\nHDEL\r\n";
      put_key(req, prefix, g.buckets[k]);
      for (int64_t i = g.starts[k]; i < g.starts[k + 1]; ++i) {
        const int64_t at = g.order[i];
        req += "$8\r\n";
        req.append(reinterpret_cast<const char*>(ids + at), 8);
        req += "\r\n";
        if (rows) {
          put_count(req, '$', int64_t(row_bytes) + int64_t(suffix.size()));
          req.append(in.row(at, row_bytes), size_t(row_bytes));
          req += suffix;
          req += "\r\n";
        }
      }
    }
  });
  return r ? Py_BuildValue("(Nn)", r, Py_ssize_t(g.buckets.size())) : nullptr;
}

// -- reading replies ---------------------------------------------------------------------

constexpr int kMaxDepth = 16;

// The number at p (up to its \r\n) and where the next line starts, or false if the line is
// not complete within [p, end). bad is set for a line that is no number.
bool read_line_int(const char* p, const char* end, int64_t& v, const char*& next, bool& bad) {
  const char* e = static_cast<const char*>(std::memchr(p, '\r', size_t(end - p)));
  if (!e || e + 1 >= end) return false;
  if (e[1] != '\n') {
    bad = true;
    return false;
  }
  const char* q = p;
  bool neg = false;
  if (q < e && *q == '-') {
    neg = true;
    ++q;
  }
  if (q == e || e - q > 18) {
    bad = true;
    return false;
  }
  v = 0;
  for (; q < e; ++q) {
    if (*q < '0' || *q > '9') {
      bad = true;
      return false;
    }
    v = v * 10 + (*q - '0');
  }
  if (neg) v = -v;
  next = e + 2;
  return true;
}

// Skip one whole reply at p: its end, or nullptr if it is not complete yet (bad: malformed).
const char* skip_reply(const char* p, const char* end, int depth, bool& bad) {
  if (p >= end) return nullptr;
  if (depth > kMaxDepth) {
    bad = true;
    return nullptr;
  }
  const char t = *p++;
  switch (t) {
    case '+':
    case '-':
    case ':':
    case '_':
    case ',':
    case '#':
    case '(': {
      const char* e = static_cast<const char*>(std::memchr(p, '\n', size_t(end - p)));
      return e ? e + 1 : nullptr;
    }
    case '$':
    case '!':
    case '=': {
      int64_t len;
      const char* body;
      if (!read_line_int(p, end, len, body, bad)) return nullptr;
      if (len < 0) return body;
      if (end - body < len + 2) return nullptr;
      return body + len + 2;
    }
    case '*':
    case '~':
    case '>':
    case '%':
    case '|': {
      int64_t count;
      const char* q;
      if (!read_line_int(p, end, count, q, bad)) return nullptr;
      if (count < 0) return q;
      if (t == '%' || t == '|') count *= 2;
      for (int64_t i = 0; i < count; ++i) {
        q = skip_reply(q, end, depth + 1, bad);
        if (!q) return nullptr;
      }
      return q;
    }
    default:
      bad = true;
      return nullptr;
  }
}

// scan(buf, start, end, wanted) -> (offset, complete): how many whole replies (at most wanted)
// lie in buf[start:end], and where the first one not counted starts.
PyObject* py_scan(PyObject*, PyObject* args) {
  PyObject* buf_o;
  Py_ssize_t start, stop, wanted;
  if (!PyArg_ParseTuple(args, "Onnn", &buf_o, &start, &stop, &wanted)) return nullptr;
  Buf b;
  if (!b.get(buf_o, false)) return nullptr;
  if (start < 0 || stop < start || stop > b.len()) {
    PyErr_SetString(PyExc_ValueError, "scan: start and end must lie within the buffer");
    return nullptr;
  }
  const char* p = b.data() + start;
  const char* end = b.data() + stop;
  Py_ssize_t done = 0;
  bool bad = false;
  while (done < wanted) {
    const char* q = skip_reply(p, end, 0, bad);
    if (!q) break;
    p = q;
    ++done;
  }
  if (bad) {
    PyErr_SetString(PyExc_ValueError, "Redis sent a reply that is not the Redis protocol");
    return nullptr;
  }
  return Py_BuildValue("(nn)", Py_ssize_t(p - b.data()), done);
}

PyObject* error_text(const char* p, const char* end) {  // an error reply's text, without the '-'
  const char* e = static_cast<const char*>(std::memchr(p, '\r', size_t(end - p)));
  return PyUnicode_DecodeUTF8(p + 1, (e ? e : end) - (p + 1), "replace");
}

// pull_replies(buf, start, end, commands, order, j, out, row_bytes, missing, k[, stamps]) -> (k, j) or the
// text of the first error reply (str). buf[start:end] holds `commands` whole replies (scan said
// so) to pull_request's HMGETs, from the one that asks for field j on: arrays of bulk strings
// or nulls. Field j's row goes to out row order[j] (out: at least one row per field; on Cluster
// the whole batch's rows, order mapped to positions in it); an absent one's position to
// missing[k]. Returns the new k and j, so the replies can be read a run at a time as they
// arrive. After an error reply the later fields' positions are not to be trusted: the caller
// raises, or reads that part again. With stamps (a writable buffer of a uint32 per out row), each
// value is the row and then its 4-byte stamp, which goes to stamps[order[j]].
PyObject* py_pull_replies(PyObject*, PyObject* args) {
  PyObject *buf_o, *order_o, *out_o, *missing_o, *stamps_o = Py_None;
  Py_ssize_t start, stop, commands, j0, row_bytes, k0;
  if (!PyArg_ParseTuple(args, "OnnnOnOnOn|O", &buf_o, &start, &stop, &commands, &order_o, &j0, &out_o, &row_bytes,
                        &missing_o, &k0, &stamps_o))
    return nullptr;
  Buf b, order_b, out_b, missing_b, stamps_b;
  if (!b.get(buf_o, false) || !order_b.get(order_o, false) || !out_b.get(out_o, true) ||
      !missing_b.get(missing_o, true) || (stamps_o != Py_None && !stamps_b.get(stamps_o, true)))
    return nullptr;
  // With stamps, each stored value is the row and its 4-byte stamp, which goes to stamps[at].
  const bool stamped = stamps_o != Py_None;
  const int64_t value_bytes = row_bytes + (stamped ? 4 : 0);
  char* stamps = stamped ? stamps_b.data() : nullptr;
  const int64_t n = order_b.len() / 8;
  const int64_t out_rows = row_bytes > 0 ? out_b.len() / row_bytes : 0;
  if (start < 0 || stop < start || stop > b.len() || row_bytes < 1 || out_b.len() != out_rows * row_bytes ||
      out_rows < n || missing_b.len() < n * 8 || j0 < 0 || j0 > n || k0 < 0 || k0 > j0 ||
      (stamped && stamps_b.len() < out_rows * 4)) {
    PyErr_SetString(PyExc_ValueError, "pull_replies: buffers of the wrong size");
    return nullptr;
  }
  const int64_t* order = reinterpret_cast<const int64_t*>(order_b.data());
  int64_t* missing = reinterpret_cast<int64_t*>(missing_b.data());
  char* out = out_b.data();
  const char* p = b.data() + start;
  const char* end = b.data() + stop;
  int64_t j = j0, k = k0;
  const char* problem = nullptr;  // a reply that is not what the pipeline asks for
  const char* error = nullptr;    // the first error reply
  Py_BEGIN_ALLOW_THREADS
  bool bad = false;
  for (Py_ssize_t c = 0; c < commands && !problem; ++c) {
    if (p >= end) {
      problem = "fewer replies than commands";
      break;
    }
    if (*p == '-') {  // this command failed: its fields count as absent, the error is raised
      if (!error) error = p;
      p = skip_reply(p, end, 0, bad);
      if (!p) problem = "a cut-off error reply";
      continue;
    }
    int64_t count;
    const char* q;
    if (*p != '*' || !read_line_int(p + 1, end, count, q, bad) || count < 0 || count > n - j) {
      problem = "a reply that is not an array of the fields asked for";
      break;
    }
    p = q;
    for (int64_t i = 0; i < count; ++i, ++j) {
      const int64_t at = order[j];
      if (at < 0 || at >= out_rows) {
        problem = "an order outside the rows";
        break;
      }
      if (p < end && *p == '_') {  // RESP3 null
        missing[k++] = at;
        p = skip_reply(p, end, 0, bad);
      } else if (p < end && *p == '$') {
        int64_t len;
        const char* body;
        if (!read_line_int(p + 1, end, len, body, bad)) {
          problem = "a cut-off row";
          break;
        }
        if (len < 0) {
          missing[k++] = at;
          p = body;
        } else if (len != value_bytes) {
          problem = "wrong size";
          break;
        } else if (end - body < len + 2) {
          problem = "a cut-off row";
          break;
        } else {
          std::memcpy(out + at * row_bytes, body, size_t(row_bytes));
          if (stamped) std::memcpy(stamps + at * 4, body + row_bytes, 4);
          p = body + len + 2;
        }
      } else {
        problem = "a field's reply that is neither a row nor nil";
        break;
      }
      if (!p) {
        problem = "a cut-off reply";
        break;
      }
    }
  }
  Py_END_ALLOW_THREADS
  if (problem) {
    if (std::strcmp(problem, "wrong size") == 0) {
      PyErr_SetString(PyExc_OverflowError, "a row of the wrong size");  // the store names table and schema
    } else {
      PyErr_Format(PyExc_ValueError, "Redis replied to HMGET with %s", problem);
    }
    return nullptr;
  }
  if (error) return error_text(error, end);
  return Py_BuildValue("(LL)", (long long)k, (long long)j);
}

// integer_reply(buf, end) -> the integer of the one reply in buf, or the error reply's text (str).
PyObject* py_integer_reply(PyObject*, PyObject* args) {
  PyObject* buf_o;
  Py_ssize_t stop;
  if (!PyArg_ParseTuple(args, "On", &buf_o, &stop)) return nullptr;
  Buf b;
  if (!b.get(buf_o, false)) return nullptr;
  if (stop < 1 || stop > b.len()) {
    PyErr_SetString(PyExc_ValueError, "integer_reply: no reply");
    return nullptr;
  }
  const char* p = b.data();
  const char* end = p + stop;
  if (*p == '-') return error_text(p, end);
  int64_t v;
  const char* q;
  bool bad = false;
  if (*p != ':' || !read_line_int(p + 1, end, v, q, bad)) {
    PyErr_SetString(PyExc_ValueError, "Redis replied to the write script with something other than an integer");
    return nullptr;
  }
  return PyLong_FromLongLong(v);
}

// integer_replies(buf, end, commands) -> (total, errors): buf[:end] holds `commands` whole
// replies (scan said so), integers (plain_write_request's HSETs or HDELs) or error replies; total
// is the integers' sum, errors a list of (command index, error text), empty when none failed.
PyObject* py_integer_replies(PyObject*, PyObject* args) {
  PyObject* buf_o;
  Py_ssize_t stop, commands;
  if (!PyArg_ParseTuple(args, "Onn", &buf_o, &stop, &commands)) return nullptr;
  Buf b;
  if (!b.get(buf_o, false)) return nullptr;
  if (stop < 0 || stop > b.len() || commands < 0) {
    PyErr_SetString(PyExc_ValueError, "integer_replies: end must lie within the buffer");
    return nullptr;
  }
  PyObject* errors = PyList_New(0);
  if (!errors) return nullptr;
  const char* p = b.data();
  const char* end = p + stop;
  int64_t total = 0;
  for (Py_ssize_t c = 0; c < commands; ++c) {
    bool bad = false;
    const char* q = p < end ? skip_reply(p, end, 0, bad) : nullptr;
    int64_t v;
    const char* after;
    if (q && *p == '-') {
      PyObject* item = Py_BuildValue("(nN)", c, error_text(p, q));
      if (!item || PyList_Append(errors, item) != 0) {
        Py_XDECREF(item);
        Py_DECREF(errors);
        return nullptr;
      }
      Py_DECREF(item);
    } else if (q && *p == ':' && read_line_int(p + 1, end, v, after, bad)) {
      total += v;
    } else {
      Py_DECREF(errors);
      PyErr_SetString(PyExc_ValueError, "Redis replied to HSET or HDEL with something other than an integer");
      return nullptr;
    }
    p = q;
  }
  return Py_BuildValue("(LN)", (long long)total, errors);
}

// bucket_stamps(buf, end, commands, value_bytes, ids, stamps, buckets) -> n or the text of the
// first error reply (str). buf[:end] holds `commands` whole replies (scan said so) to HGETALLs of
// buckets: arrays (RESP2) or maps (RESP3) of field/value pairs. Each pair's 8-byte field goes to
// ids[n], the last 4 bytes of its value (the row's stamp) to stamps[n], the command's number to
// buckets[n]; no row is copied. For the sweeper (redis_rows.py), which reads a slice's stamps
// without building Python objects per row. ValueError for a reply that is not such pairs (a
// field not 8 bytes, a value not value_bytes), or outputs too small.
PyObject* py_bucket_stamps(PyObject*, PyObject* args) {
  PyObject *buf_o, *ids_o, *stamps_o, *buckets_o;
  Py_ssize_t stop, commands, value_bytes;
  if (!PyArg_ParseTuple(args, "OnnnOOO", &buf_o, &stop, &commands, &value_bytes, &ids_o, &stamps_o, &buckets_o))
    return nullptr;
  Buf b, ids_b, stamps_b, buckets_b;
  if (!b.get(buf_o, false) || !ids_b.get(ids_o, true) || !stamps_b.get(stamps_o, true) ||
      !buckets_b.get(buckets_o, true))
    return nullptr;
  const int64_t room = std::min({ids_b.len() / 8, stamps_b.len() / 4, buckets_b.len() / 8});
  if (stop < 0 || stop > b.len() || value_bytes < 4 || commands < 0) {
    PyErr_SetString(PyExc_ValueError, "bucket_stamps: arguments out of range");
    return nullptr;
  }
  int64_t* ids = reinterpret_cast<int64_t*>(ids_b.data());
  char* stamps = stamps_b.data();
  int64_t* buckets = reinterpret_cast<int64_t*>(buckets_b.data());
  const char* p = b.data();
  const char* end = p + stop;
  const char* problem = nullptr;
  const char* error = nullptr;
  int64_t n = 0;
  Py_BEGIN_ALLOW_THREADS
  bool bad = false;
  for (Py_ssize_t c = 0; c < commands && !problem; ++c) {
    if (p >= end) {
      problem = "fewer replies than commands";
      break;
    }
    if (*p == '-') {
      if (!error) error = p;
      p = skip_reply(p, end, 0, bad);
      if (!p) problem = "a cut-off error reply";
      continue;
    }
    int64_t count;
    const char* q;
    if ((*p != '*' && *p != '%') || !read_line_int(p + 1, end, count, q, bad) || count < 0) {
      problem = "a reply that is not an array of fields and values";
      break;
    }
    const int64_t pairs = *p == '%' ? count : count / 2;
    if (*p == '*' && count % 2) {
      problem = "an array of an odd length";
      break;
    }
    p = q;
    for (int64_t i = 0; i < pairs; ++i) {
      int64_t flen, vlen;
      const char *fbody, *vbody;
      if (p >= end || *p != '$' || !read_line_int(p + 1, end, flen, fbody, bad) || flen != 8 || end - fbody < 10) {
        problem = "a field that is not 8 bytes";
        break;
      }
      p = fbody + 10;
      if (p >= end || *p != '$' || !read_line_int(p + 1, end, vlen, vbody, bad) || vlen != value_bytes ||
          end - vbody < vlen + 2) {
        problem = "a value of the wrong size";
        break;
      }
      if (n >= room) {
        problem = "more fields than the outputs hold";
        break;
      }
      std::memcpy(ids + n, fbody, 8);
      std::memcpy(stamps + 4 * n, vbody + vlen - 4, 4);
      buckets[n] = c;
      ++n;
      p = vbody + vlen + 2;
    }
  }
  Py_END_ALLOW_THREADS
  if (problem) {
    PyErr_Format(PyExc_ValueError, "Redis replied to HGETALL with %s", problem);
    return nullptr;
  }
  if (error) return error_text(error, end);
  return PyLong_FromLongLong(n);
}

PyMethodDef kMethods[] = {
    {"pull_request", py_pull_request, METH_VARARGS,
     "pull_request(ids, num_buckets, prefix, order) -> (request, commands): HMGETs of the ids' buckets"},
    {"scan", py_scan, METH_VARARGS, "scan(buf, start, end, wanted) -> (offset, complete replies)"},
    {"pull_replies", py_pull_replies, METH_VARARGS,
     "pull_replies(buf, start, end, commands, order, j, out, row_bytes, missing, k[, stamps]) -> (k, j) | error text"},
    {"integer_reply", py_integer_reply, METH_VARARGS, "integer_reply(buf, end) -> int | error text"},
    {"slot_nodes", py_slot_nodes, METH_VARARGS,
     "slot_nodes(ids, num_buckets, tag_prefix, slot_node, out): out[i] = slot_node[Cluster slot of ids[i]'s bucket]"},
    {"plain_write_request", py_plain_write_request, METH_VARARGS,
     "plain_write_request(ids, rows|None, row_bytes, num_buckets, prefix[, suffix]) -> (request, commands): HSETs or HDELs"},
    {"bucket_stamps", py_bucket_stamps, METH_VARARGS,
     "bucket_stamps(buf, end, commands, value_bytes, ids, stamps, buckets) -> n | error text"},
    {"integer_replies", py_integer_replies, METH_VARARGS,
     "integer_replies(buf, end, commands) -> (sum, [(command, error text)...])"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_dynemb_redis_rows", "the Redis store's row path", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__dynemb_redis_rows() { return PyModule_Create(&kModule); }
