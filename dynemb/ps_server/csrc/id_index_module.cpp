// Python module `_dynemb_id_index`: the functions ../backends/id_index.py calls, over the map
// of id_index.h. An index is a capsule (freed with it); arrays arrive through the buffer
// protocol, so a call costs well under a microsecond (ctypes' pointer passing cost ~1 us per
// array) and every size is checked against the buffer it came in: no argument, however
// wrong, makes the map read or write outside a buffer. The GIL is dropped while the map works.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "id_index.h"

namespace {

using dynemb_index::Index;

constexpr const char* kCapsule = "dynemb.IdIndex";

void destroy(PyObject* capsule) { dynemb_index::idx_free(static_cast<Index*>(PyCapsule_GetPointer(capsule, kCapsule))); }

Index* index_of(PyObject* capsule) {  // NULL, with ValueError set, for anything but our capsule
  return static_cast<Index*>(PyCapsule_GetPointer(capsule, kCapsule));
}

// A C-contiguous native int64 buffer held for the length of a call; None gives no buffer.
struct Int64s {
  Py_buffer view{};
  bool held = false;
  int64_t* data = nullptr;
  int64_t n = 0;

  ~Int64s() {
    if (held) PyBuffer_Release(&view);
  }
  bool get(PyObject* obj, bool writable, bool optional, const char* what) {
    if (obj == Py_None && optional) return true;
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view, flags) != 0) return false;
    held = true;
    const char* f = view.format ? view.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') ++f;  // native order (the module is built for this machine)
    if (view.itemsize != 8 || (std::strcmp(f, "l") != 0 && std::strcmp(f, "q") != 0)) {
      PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", what);
      return false;
    }
    data = static_cast<int64_t*>(view.buf);
    n = int64_t(view.len / 8);
    return true;
  }
};

PyObject* too_small(const char* what) {
  PyErr_Format(PyExc_ValueError, "%s is too small for the ids", what);
  return nullptr;
}

PyObject* py_new(PyObject*, PyObject* args) {
  long long capacity;
  unsigned long long seed;
  if (!PyArg_ParseTuple(args, "LK", &capacity, &seed)) return nullptr;
  Index* ix = dynemb_index::idx_new(capacity, seed);
  if (!ix) return PyErr_NoMemory();
  PyObject* capsule = PyCapsule_New(ix, kCapsule, destroy);
  if (!capsule) dynemb_index::idx_free(ix);
  return capsule;
}

PyObject* py_size(PyObject*, PyObject* capsule) {
  Index* ix = index_of(capsule);
  return ix ? PyLong_FromLongLong(dynemb_index::idx_size(ix)) : nullptr;
}

PyObject* py_capacity(PyObject*, PyObject* capsule) {
  Index* ix = index_of(capsule);
  return ix ? PyLong_FromLongLong(dynemb_index::idx_capacity(ix)) : nullptr;
}

PyObject* py_nbytes(PyObject*, PyObject* capsule) {
  Index* ix = index_of(capsule);
  return ix ? PyLong_FromLongLong(dynemb_index::idx_nbytes(ix)) : nullptr;
}

// lookup(index, ids, out, missing or None) -> how many ids are absent (listed in missing)
PyObject* py_lookup(PyObject*, PyObject* args) {
  PyObject *capsule, *ids_o, *out_o, *missing_o;
  if (!PyArg_ParseTuple(args, "OOOO", &capsule, &ids_o, &out_o, &missing_o)) return nullptr;
  Index* ix = index_of(capsule);
  Int64s ids, out, missing;
  if (!ix || !ids.get(ids_o, false, false, "ids") || !out.get(out_o, true, false, "out") ||
      !missing.get(missing_o, true, true, "missing"))
    return nullptr;
  if (out.n < ids.n) return too_small("out");
  if (missing.held && missing.n < ids.n) return too_small("missing");
  int64_t k;
  Py_BEGIN_ALLOW_THREADS
  k = dynemb_index::idx_lookup(ix, ids.data, ids.n, out.data, missing.data);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(k);
}

// insert(index, ids, pos or None, values, out or None) -> 0, -1 (out of memory) or -2 (a
// negative value). With pos, ids[pos[j]] gets values[j]; without, ids[j] does.
PyObject* py_insert(PyObject*, PyObject* args) {
  PyObject *capsule, *ids_o, *pos_o, *values_o, *out_o;
  if (!PyArg_ParseTuple(args, "OOOOO", &capsule, &ids_o, &pos_o, &values_o, &out_o)) return nullptr;
  Index* ix = index_of(capsule);
  Int64s ids, pos, values, out;
  if (!ix || !ids.get(ids_o, false, false, "ids") || !pos.get(pos_o, false, true, "pos") ||
      !values.get(values_o, false, false, "values") || !out.get(out_o, true, true, "out"))
    return nullptr;
  const int64_t k = values.n;
  if ((pos.held ? pos.n : ids.n) != k) {
    PyErr_SetString(PyExc_ValueError, "insert: one value per id (or per position) is needed");
    return nullptr;
  }
  if (out.held && out.n < ids.n) return too_small("out");
  for (int64_t j = 0; j < (pos.held ? k : 0); ++j) {
    if (pos.data[j] < 0 || pos.data[j] >= ids.n) {
      PyErr_Format(PyExc_IndexError, "insert: position %lld is outside the ids", (long long)pos.data[j]);
      return nullptr;
    }
  }
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = dynemb_index::idx_insert(ix, ids.data, pos.data, k, values.data, out.data);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(status);
}

// remove(index, ids, out) -> how many were removed (their values in out[:k])
PyObject* py_remove(PyObject*, PyObject* args) {
  PyObject *capsule, *ids_o, *out_o;
  if (!PyArg_ParseTuple(args, "OOO", &capsule, &ids_o, &out_o)) return nullptr;
  Index* ix = index_of(capsule);
  Int64s ids, out;
  if (!ix || !ids.get(ids_o, false, false, "ids") || !out.get(out_o, true, false, "out")) return nullptr;
  if (out.n < ids.n) return too_small("out");
  int64_t k;
  Py_BEGIN_ALLOW_THREADS
  k = dynemb_index::idx_remove(ix, ids.data, ids.n, out.data);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(k);
}

// items(index, keys, values) -> how many entries were copied (at most the room in both)
PyObject* py_items(PyObject*, PyObject* args) {
  PyObject *capsule, *keys_o, *values_o;
  if (!PyArg_ParseTuple(args, "OOO", &capsule, &keys_o, &values_o)) return nullptr;
  Index* ix = index_of(capsule);
  Int64s keys, values;
  if (!ix || !keys.get(keys_o, true, false, "keys") || !values.get(values_o, true, false, "values")) return nullptr;
  int64_t k;
  Py_BEGIN_ALLOW_THREADS
  k = dynemb_index::idx_items(ix, keys.data, values.data, keys.n < values.n ? keys.n : values.n);
  Py_END_ALLOW_THREADS
  return PyLong_FromLongLong(k);
}

PyObject* py_clear(PyObject*, PyObject* capsule) {
  Index* ix = index_of(capsule);
  if (!ix) return nullptr;
  dynemb_index::idx_clear(ix);
  Py_RETURN_NONE;
}

// scatter(table, row_bytes, where, rows, take) -> None: table's row where[i] = rows' row
// take[i], for i in order: of two writes to one row the later stays (a push's repeated id:
// its last row wins). numpy would gather rows[take] into a temporary, then scatter it.
PyObject* py_scatter(PyObject*, PyObject* args) {
  PyObject *table_o, *where_o, *rows_o, *take_o;
  Py_ssize_t row_bytes;
  if (!PyArg_ParseTuple(args, "OnOOO", &table_o, &row_bytes, &where_o, &rows_o, &take_o)) return nullptr;
  if (row_bytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "scatter: row_bytes must be positive");
    return nullptr;
  }
  Int64s where, take;
  if (!where.get(where_o, false, false, "where") || !take.get(take_o, false, false, "take")) return nullptr;
  if (where.n != take.n) {
    PyErr_SetString(PyExc_ValueError, "scatter: where and take differ in length");
    return nullptr;
  }
  Py_buffer dst{}, src{};
  if (PyObject_GetBuffer(table_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return nullptr;
  if (PyObject_GetBuffer(rows_o, &src, PyBUF_C_CONTIGUOUS) != 0) {
    PyBuffer_Release(&dst);
    return nullptr;
  }
  const int64_t n_dst = int64_t(dst.len / row_bytes), n_src = int64_t(src.len / row_bytes);
  PyObject* result = Py_None;
  for (int64_t i = 0; result && i < where.n; ++i) {
    if (where.data[i] < 0 || where.data[i] >= n_dst || take.data[i] < 0 || take.data[i] >= n_src) {
      PyErr_Format(PyExc_IndexError, "scatter: row %lld of %lld (from row %lld of %lld) is out of range",
                   (long long)where.data[i], (long long)n_dst, (long long)take.data[i], (long long)n_src);
      result = nullptr;
    }
  }
  if (result) {
    char* to = static_cast<char*>(dst.buf);
    const char* from = static_cast<const char*>(src.buf);
    const int64_t *w = where.data, *t = take.data;
    const int64_t n = where.n;
    Py_BEGIN_ALLOW_THREADS
    constexpr int64_t kAhead = 8;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        char* next = to + w[i + kAhead] * row_bytes;
        for (Py_ssize_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 1);
      }
      std::memcpy(to + w[i] * row_bytes, from + t[i] * row_bytes, size_t(row_bytes));
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(result);
  }
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return result;
}

// filled_bytes(capacity, fill) -> bytes: a new bytes object written in place by fill(view),
// which gets a writable memoryview of `capacity` bytes and returns how many it used. A
// reply's rows are gathered straight into the message gRPC sends, where building them
// apart and joining them with the message's other fields would copy every row once more.
// Python cannot write into a bytes object; C may while nothing else has seen it. The view
// is released before the bytes are returned, so it cannot write into them afterwards. What
// fill made from it (numpy arrays, other memoryviews) is not tracked by release(): fill must
// keep none of it (the resize below may also move the memory).
PyObject* py_filled_bytes(PyObject*, PyObject* args) {
  Py_ssize_t capacity;
  PyObject* fill;
  if (!PyArg_ParseTuple(args, "nO", &capacity, &fill)) return nullptr;
  if (capacity < 0) {
    PyErr_SetString(PyExc_ValueError, "filled_bytes: capacity must not be negative");
    return nullptr;
  }
  PyObject* bytes = PyBytes_FromStringAndSize(nullptr, capacity);
  if (!bytes) return nullptr;
  PyObject* view = PyMemoryView_FromMemory(PyBytes_AS_STRING(bytes), capacity, PyBUF_WRITE);
  if (!view) {
    Py_DECREF(bytes);
    return nullptr;
  }
  PyObject* used_o = PyObject_CallOneArg(fill, view);
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // fill's error, if any, set aside while releasing
  // fill's error holds its frames, and they the view: drop them first, or release() fails
  Py_CLEAR(traceback);
  PyObject* released = PyObject_CallMethod(view, "release", nullptr);
  Py_DECREF(view);
  if (!released) {
    // something still holds a buffer of the view: the memory must outlive it, so the
    // bytes object is left alive on purpose (a leak, never a dangling pointer)
    Py_XDECREF(used_o);
    Py_XDECREF(type);
    Py_XDECREF(value);
    PyErr_Clear();
    PyErr_SetString(PyExc_RuntimeError, "filled_bytes: fill kept a buffer of its view after returning");
    return nullptr;
  }
  Py_DECREF(released);
  if (!used_o) {
    PyErr_Restore(type, value, traceback);
    Py_DECREF(bytes);
    return nullptr;
  }
  const Py_ssize_t used = PyLong_AsSsize_t(used_o);
  Py_DECREF(used_o);
  if (used == -1 && PyErr_Occurred()) {
    Py_DECREF(bytes);
    return nullptr;
  }
  if (used < 0 || used > capacity) {
    Py_DECREF(bytes);
    PyErr_Format(PyExc_ValueError, "filled_bytes: fill used %zd of %zd bytes", used, capacity);
    return nullptr;
  }
  if (used < capacity && _PyBytes_Resize(&bytes, used) != 0) return nullptr;  // frees bytes on failure
  return bytes;
}

// pull_rows(index, table, row_bytes, ids, out, missing) -> k: a pull from the embedded
// store in one call. Each id's row of `table` goes to its place in `out`; the positions of
// the ids absent go to missing[:k] (their rows in out are left as they were). In Python
// this was a lookup, a where, a gather and three passes over a mask, ~30 us a call of
// which a trainer's PullMany makes 26.
PyObject* py_pull_rows(PyObject*, PyObject* args) {
  PyObject *capsule, *table_o, *ids_o, *out_o, *missing_o;
  Py_ssize_t row_bytes;
  if (!PyArg_ParseTuple(args, "OOnOOO", &capsule, &table_o, &row_bytes, &ids_o, &out_o, &missing_o)) return nullptr;
  Index* ix = index_of(capsule);
  if (!ix) return nullptr;
  if (row_bytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "pull_rows: row_bytes must be positive");
    return nullptr;
  }
  Int64s ids, missing;
  if (!ids.get(ids_o, false, false, "ids") || !missing.get(missing_o, true, false, "missing")) return nullptr;
  if (missing.n < ids.n) return too_small("missing");
  Py_buffer src{}, dst{};
  if (PyObject_GetBuffer(table_o, &src, PyBUF_C_CONTIGUOUS) != 0) return nullptr;
  if (PyObject_GetBuffer(out_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
    PyBuffer_Release(&src);
    return nullptr;
  }
  PyObject* result = nullptr;
  if (dst.len < ids.n * row_bytes) {
    PyErr_SetString(PyExc_ValueError, "pull_rows: out is too small for the rows");
  } else {
    const int64_t n = ids.n, n_rows = int64_t(src.len / row_bytes);
    const char* from = static_cast<const char*>(src.buf);
    char* to = static_cast<char*>(dst.buf);
    int64_t* where = static_cast<int64_t*>(std::malloc(size_t(n > 0 ? n : 1) * sizeof(int64_t)));
    int64_t k = 0, bad = -1;
    if (!where) {
      PyErr_NoMemory();
    } else {
      Py_BEGIN_ALLOW_THREADS
      k = dynemb_index::idx_lookup(ix, ids.data, n, where, missing.data);
      constexpr int64_t kAhead = 8;  // rows further down fetched while earlier ones are copied
      for (int64_t i = 0; i < n; ++i) {
        if (i + kAhead < n && where[i + kAhead] >= 0 && where[i + kAhead] < n_rows) {
          const char* next = from + where[i + kAhead] * row_bytes;
          for (Py_ssize_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        }
        const int64_t w = where[i];
        if (w < 0) continue;
        if (w >= n_rows) {  // the index and the rows disagree: a bug, never a read out of bounds
          bad = w;
          break;
        }
        std::memcpy(to + i * row_bytes, from + w * row_bytes, size_t(row_bytes));
      }
      Py_END_ALLOW_THREADS
      std::free(where);
      if (bad >= 0)
        PyErr_Format(PyExc_IndexError, "pull_rows: row %lld is outside the %lld rows", (long long)bad,
                     (long long)n_rows);
      else
        result = PyLong_FromLongLong(k);
    }
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&dst);
  return result;
}

// push_rows(index, table, row_bytes, ids, rows, next_value) -> k: a push to the embedded
// store in one call, for a table whose rows from next_value on are free (no deleted rows to
// reuse): each absent id gets the next of them (k in all), then row i of `rows` is copied to
// ids[i]'s row of `table`, in order (a repeated id's last row stays). `table` must have room
// for next_value + len(ids) rows. In Python this was a lookup, an allocation, an insert, a
// check for repeats and a scatter, ~25 us a call; a trainer step makes one per table.
PyObject* py_push_rows(PyObject*, PyObject* args) {
  PyObject *capsule, *table_o, *ids_o, *rows_o;
  Py_ssize_t row_bytes;
  long long next_value;
  if (!PyArg_ParseTuple(args, "OOnOOL", &capsule, &table_o, &row_bytes, &ids_o, &rows_o, &next_value)) return nullptr;
  Index* ix = index_of(capsule);
  if (!ix) return nullptr;
  if (row_bytes <= 0 || next_value < 0) {
    PyErr_SetString(PyExc_ValueError, "push_rows: row_bytes must be positive and next_value >= 0");
    return nullptr;
  }
  Int64s ids;
  if (!ids.get(ids_o, false, false, "ids")) return nullptr;
  Py_buffer dst{}, src{};
  if (PyObject_GetBuffer(table_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return nullptr;
  if (PyObject_GetBuffer(rows_o, &src, PyBUF_C_CONTIGUOUS) != 0) {
    PyBuffer_Release(&dst);
    return nullptr;
  }
  PyObject* result = nullptr;
  const int64_t n = ids.n, n_rows = int64_t(dst.len / row_bytes);
  if (src.len < n * row_bytes) {
    PyErr_SetString(PyExc_ValueError, "push_rows: rows has fewer rows than there are ids");
  } else if (next_value + n > n_rows) {
    PyErr_Format(PyExc_ValueError, "push_rows: the table has %lld rows, not room for %lld from row %lld",
                 (long long)n_rows, (long long)n, next_value);
  } else {
    int64_t* where = static_cast<int64_t*>(std::malloc(size_t(n > 0 ? n : 1) * sizeof(int64_t)));
    int64_t k = 0, bad = 0;
    bool broken = false;
    if (!where) {
      PyErr_NoMemory();
    } else {
      char* to = static_cast<char*>(dst.buf);
      const char* from = static_cast<const char*>(src.buf);
      Py_BEGIN_ALLOW_THREADS
      k = dynemb_index::idx_upsert(ix, ids.data, n, next_value, where);
      constexpr int64_t kAhead = 8;  // rows further down fetched while earlier ones are written
      for (int64_t i = 0; k >= 0 && i < n; ++i) {
        if (i + kAhead < n && where[i + kAhead] >= 0 && where[i + kAhead] < n_rows) {
          char* next = to + where[i + kAhead] * row_bytes;
          for (Py_ssize_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 1);
        }
        if (where[i] < 0 || where[i] >= n_rows) {  // the index and the rows disagree: a bug, never a write out of bounds
          bad = where[i];
          broken = true;
          break;
        }
        std::memcpy(to + where[i] * row_bytes, from + i * row_bytes, size_t(row_bytes));
      }
      Py_END_ALLOW_THREADS
      std::free(where);
      if (k == -1)
        PyErr_NoMemory();
      else if (broken)
        PyErr_Format(PyExc_IndexError, "push_rows: row %lld is outside the %lld rows", (long long)bad,
                     (long long)n_rows);
      else
        result = PyLong_FromLongLong(k);
    }
  }
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  return result;
}

// SplitMix64's finaliser, the generator of ../initializer.py: values must match its numpy
// version bit for bit (a row never pushed looks the same from every PS and every pull).
inline uint64_t splitmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// init_rows(out, width, positions, ids, kind, key, a, scale, dim, state_init): for each k,
// row positions[k] of the float32 (rows, width) buffer out becomes id ids[k]'s initial row:
// kind 0 zeros, 1 the constant a, 2 a + scale * U[0,1) keyed by (key, id, column); then
// state_init in the optimizer-state columns. In numpy this is ~20 whole-array passes and
// temporaries per call, ~0.2 ms for a pull of 300 new ids; a trainer's PS makes 26 a step.
// Computed in double and rounded once to float, as numpy does (no FMA: the build targets
// baseline x86-64 and sets -ffp-contract=off).
PyObject* py_init_rows(PyObject*, PyObject* args) {
  PyObject *out_o, *pos_o, *ids_o;
  Py_ssize_t width, dim;
  int kind;
  unsigned long long key;
  double a, scale, state_init;
  if (!PyArg_ParseTuple(args, "OnOOiKddnd", &out_o, &width, &pos_o, &ids_o, &kind, &key, &a, &scale, &dim,
                        &state_init))
    return nullptr;
  if (width <= 0 || dim < 0 || dim > width || kind < 0 || kind > 2) {
    PyErr_SetString(PyExc_ValueError, "init_rows: need 0 <= dim <= width, width > 0, kind 0..2");
    return nullptr;
  }
  Int64s pos, ids;
  if (!pos.get(pos_o, false, false, "positions") || !ids.get(ids_o, false, false, "ids")) return nullptr;
  if (pos.n != ids.n) {
    PyErr_SetString(PyExc_ValueError, "init_rows: positions and ids differ in length");
    return nullptr;
  }
  Py_buffer dst{};
  if (PyObject_GetBuffer(out_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return nullptr;
  const int64_t n_rows = int64_t(dst.len / (width * Py_ssize_t(sizeof(float))));
  PyObject* result = Py_None;
  for (int64_t k = 0; k < pos.n; ++k) {
    if (pos.data[k] < 0 || pos.data[k] >= n_rows) {
      PyErr_Format(PyExc_IndexError, "init_rows: row %lld is outside the %lld rows", (long long)pos.data[k],
                   (long long)n_rows);
      result = nullptr;
      break;
    }
  }
  if (result) {
    // rows inside a message may start at any byte: floats are stored with memcpy
    char* out = static_cast<char*>(dst.buf);
    const uint64_t golden = 0x9E3779B97F4A7C15ull;
    const float constant = kind == 1 ? float(a) : 0.0f, state = float(state_init);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t k = 0; k < pos.n; ++k) {
      char* row = out + pos.data[k] * width * Py_ssize_t(sizeof(float));
      if (kind == 2) {
        const uint64_t base = splitmix(uint64_t(ids.data[k]) ^ key);
        for (Py_ssize_t c = 0; c < dim; ++c) {
          const uint64_t z = splitmix(base + uint64_t(c + 1) * golden);
          const float v = float(a + scale * (double(z >> 11) * (1.0 / 9007199254740992.0)));
          std::memcpy(row + c * sizeof(float), &v, sizeof(float));
        }
      } else {
        for (Py_ssize_t c = 0; c < dim; ++c) std::memcpy(row + c * sizeof(float), &constant, sizeof(float));
      }
      for (Py_ssize_t c = dim; c < width; ++c) std::memcpy(row + c * sizeof(float), &state, sizeof(float));
    }
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&dst);
  if (result) Py_INCREF(result);
  return result;
}

// -- batch requests (PullMany, PushMany) read in one pass: ../wire.py parse_row_entries ------------------

// A protobuf reader over [pos, end): false, with ValueError set, on bytes that are no message.
struct Reader {
  const uint8_t* p;
  const uint8_t* end;

  bool varint(uint64_t* out) {
    if (p < end && *p < 0x80) {  // one byte: a batch's every tag and most lengths
      *out = *p++;
      return true;
    }
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) break;
      const uint8_t b = *p++;
      v |= uint64_t(b & 0x7F) << shift;
      if (b < 0x80) {
        *out = v;
        return true;
      }
    }
    PyErr_SetString(PyExc_ValueError, "a varint runs past the end of its message or is over 10 bytes");
    return false;
  }
  // one field: its number and wire type; a length-delimited one's bytes in [*at, *at + *len)
  bool field(uint32_t* number, uint32_t* wire, const uint8_t** at, uint64_t* len) {
    uint64_t key;
    if (!varint(&key)) return false;
    *number = uint32_t(key >> 3);
    *wire = uint32_t(key & 7);
    if (*number == 0) {
      PyErr_SetString(PyExc_ValueError, "a field numbered 0");
      return false;
    }
    uint64_t skip = 0;
    switch (*wire) {
      case 0:
        return varint(len);
      case 1:
        skip = 8;
        break;
      case 5:
        skip = 4;
        break;
      case 2:
        if (!varint(&skip)) return false;
        *at = p;
        *len = skip;
        break;
      default:
        PyErr_Format(PyExc_ValueError, "field %u has wire type %u, which these messages never use", *number, *wire);
        return false;
    }
    if (skip > uint64_t(end - p)) {
      PyErr_Format(PyExc_ValueError, "field %u claims %llu bytes, %lld are left", *number, (unsigned long long)skip,
                   (long long)(end - p));
      return false;
    }
    p += skip;
    return true;
  }
};

// What parse_row_entries reads of an entry.
enum Col { kName, kIdsAt, kIdsLen, kRowsAt, kRowsLen, kHasRef, kSegment, kOffset, kSize, kCols };

bool expect(uint32_t number, uint32_t wire, uint32_t want) {
  if (wire == want) return true;
  PyErr_Format(PyExc_ValueError, "field %u has wire type %u, expected %u", number, wire, want);
  return false;
}

// One PullRequest or PushRequest at [at, at + len) of base into row.
bool read_entry(const uint8_t* base, const uint8_t* at, uint64_t len, uint32_t ref_field, uint32_t rows_field,
                int64_t* row, std::string_view* name) {
  Reader r{at, at + len};
  while (r.p < r.end) {
    uint32_t number, wire;
    const uint8_t* v = nullptr;
    uint64_t n = 0;
    if (!r.field(&number, &wire, &v, &n)) return false;
    if (number == 1 || number == 2 || number == rows_field || number == ref_field) {
      if (!expect(number, wire, 2)) return false;
    } else {
      continue;  // unknown fields are skipped, as protobuf does
    }
    if (number == 1) {
      *name = std::string_view(reinterpret_cast<const char*>(v), n);
    } else if (number == 2) {
      row[kIdsAt] = v - base, row[kIdsLen] = int64_t(n);
    } else if (number == rows_field) {
      row[kRowsAt] = v - base, row[kRowsLen] = int64_t(n);
    } else {
      row[kHasRef] = 1;
      Reader ref{v, v + n};
      while (ref.p < ref.end) {
        uint32_t k, w;
        const uint8_t* unused = nullptr;
        uint64_t value = 0;
        if (!ref.field(&k, &w, &unused, &value)) return false;
        if (k >= 1 && k <= 3) {
          if (!expect(k, w, 0)) return false;
          row[kSegment + k - 1] = int64_t(value);
        }
      }
    }
  }
  return true;
}

// read_entry for an entry as protobuf writes one (name, ids, then a push's rows: each tag and
// length one byte, nothing else): false for any other, which read_entry then reads
inline bool read_plain_entry(const uint8_t* base, const uint8_t* at, uint64_t len, uint32_t rows_field,
                             int64_t* row, std::string_view* name) {
  const uint8_t* end = at + len;
  if (len < 4 || at[0] != 0x0A || at[1] >= 0x80 || uint64_t(at[1]) + 4 > len) return false;
  const uint8_t* p = at + 2 + at[1];
  if (p[0] != 0x12 || p[1] >= 0x80 || p[1] > end - p - 2) return false;
  *name = std::string_view(reinterpret_cast<const char*>(at + 2), at[1]);
  row[kIdsAt] = p + 2 - base, row[kIdsLen] = p[1];
  p += 2 + p[1];
  if (rows_field && p < end) {
    if (end - p < 2 || p[0] != uint8_t(rows_field << 3 | 2) || p[1] >= 0x80 || p[1] != end - p - 2) return false;
    row[kRowsAt] = p + 2 - base, row[kRowsLen] = p[1];
    p = end;
  }
  return p == end;
}

// a == b inline: names are short, and a call of memcmp per entry cost a tenth of the pass
inline bool same_name(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// memcpy for the short ranges of a batch's many entries (an id, a row): 8 bytes at a time
// inline, where a call of libc's memcpy per 8- or 16-byte range cost more than the copy
inline void copy_short(char* to, const char* from, size_t n) {
  if (n > 64) {
    std::memcpy(to, from, n);
    return;
  }
  for (; n >= 8; n -= 8, to += 8, from += 8) std::memcpy(to, from, 8);
  for (; n; --n) *to++ = *from++;
}

// parse_row_entries(data, ref_field, rows_field, max_entries) -> (count, columns | None, names,
// refs, ids, rows): the entries (field 1) of a PullManyRequest (ref_field 3, rows_field 0) or
// PushManyRequest (4, 3), none made a Python object. A first pass counts them (over
// max_entries: only counted, columns None); the second reads each into `columns`: int64
// columns of `count` values one after the other (column-major, each contiguous for numpy):
// its name's index in names, its ids' bytes and, with a rows_field, its rows' bytes in the
// message. names holds the distinct table names, as bytes, in order of first use; refs the few
// entries that name a segment, 4 int64 each: entry, segment, offset, size; ids every entry's
// ids bytes joined in entry order, rows every push's rows in the message joined likewise
// (b"" for a pull): copied while the pass has them in cache, not by a pass of their own. Only
// what the service reads is written: at 200,000 one-id entries the fresh pages of nine
// columns and of separate gathers cost more than reading the entries.
PyObject* py_parse_row_entries(PyObject*, PyObject* args) {
  Py_buffer data{};
  unsigned int ref_field, rows_field;
  Py_ssize_t max_entries;
  if (!PyArg_ParseTuple(args, "y*IIn", &data, &ref_field, &rows_field, &max_entries)) return nullptr;
  const uint8_t* base = static_cast<const uint8_t*>(data.buf);
  Py_ssize_t count = 0;
  bool ok = true;
  for (Reader r{base, base + data.len}; ok && r.p < r.end;) {
    uint32_t number, wire;
    const uint8_t* at = nullptr;
    uint64_t len = 0;
    if ((ok = r.field(&number, &wire, &at, &len)) && number == 1 && (ok = expect(number, wire, 2))) ++count;
  }
  const int columns_out = rows_field ? 3 : 2;
  PyObject *cols = nullptr, *ids = nullptr, *rows = nullptr;
  std::vector<std::string_view> names;
  std::vector<int64_t> refs;
  if (ok && count > max_entries) {  // counted only, to name the count in the refusal
    cols = Py_None;
    Py_INCREF(cols);
  } else if (ok) {
    // ids and rows take at most the message's bytes: room for that, cut to what they took
    // (pages never written are never touched)
    cols = PyBytes_FromStringAndSize(nullptr, count * columns_out * Py_ssize_t(sizeof(int64_t)));
    ids = PyBytes_FromStringAndSize(nullptr, data.len);
    rows = PyBytes_FromStringAndSize(nullptr, rows_field ? data.len : 0);
    ok = cols && ids && rows;
  }
  Py_ssize_t ids_used = 0, rows_used = 0;
  if (ok && cols != Py_None) {
    int64_t* columns = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(cols));
    char* ids_out = PyBytes_AS_STRING(ids);
    char* rows_out = PyBytes_AS_STRING(rows);
    std::unordered_map<std::string_view, int64_t> index;
    std::string_view last;  // the previous entry's name: most batches name one table throughout
    int64_t last_index = -1;
    Py_ssize_t e = 0;
    for (Reader r{base, base + data.len}; ok && r.p < r.end;) {
      uint32_t number, wire;
      const uint8_t* at = nullptr;
      uint64_t len = 0;
      if (!(ok = r.field(&number, &wire, &at, &len))) break;
      if (number != 1) continue;
      int64_t row[kCols] = {0};
      std::string_view name;
      if (!read_plain_entry(base, at, len, rows_field, row, &name)) {
        for (int64_t& c : row) c = 0;  // what the fast path may have set
        if (!(ok = read_entry(base, at, len, ref_field, rows_field, row, &name))) break;
      }
      if (last_index < 0 || !same_name(name, last)) {
        auto found = index.emplace(name, int64_t(names.size()));
        if (found.second) names.push_back(name);
        last = name, last_index = found.first->second;
      }
      columns[e] = last_index;
      columns[count + e] = row[kIdsLen];
      copy_short(ids_out + ids_used, reinterpret_cast<const char*>(base) + row[kIdsAt], size_t(row[kIdsLen]));
      ids_used += row[kIdsLen];
      if (rows_field) {
        columns[2 * count + e] = row[kRowsLen];
        copy_short(rows_out + rows_used, reinterpret_cast<const char*>(base) + row[kRowsAt], size_t(row[kRowsLen]));
        rows_used += row[kRowsLen];
      }
      if (row[kHasRef]) refs.insert(refs.end(), {int64_t(e), row[kSegment], row[kOffset], row[kSize]});
      ++e;
    }
  }
  if (ok && cols != Py_None) ok = _PyBytes_Resize(&ids, ids_used) == 0 && _PyBytes_Resize(&rows, rows_used) == 0;
  PyObject* result = nullptr;
  if (ok) {
    PyObject* list = PyList_New(Py_ssize_t(names.size()));
    for (size_t i = 0; list && i < names.size(); ++i) {
      PyObject* b = PyBytes_FromStringAndSize(names[i].data(), Py_ssize_t(names[i].size()));
      if (!b) Py_CLEAR(list);
      else PyList_SET_ITEM(list, Py_ssize_t(i), b);
    }
    PyObject* ref_bytes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(refs.data()),
                                                    Py_ssize_t(refs.size() * sizeof(int64_t)));
    if (list && ref_bytes)
      result = Py_BuildValue("nOOOOO", count, cols, list, ref_bytes, ids ? ids : Py_None, rows ? rows : Py_None);
    Py_XDECREF(list);
    Py_XDECREF(ref_bytes);
  }
  Py_XDECREF(cols);
  Py_XDECREF(ids);
  Py_XDECREF(rows);
  PyBuffer_Release(&data);
  return result;
}

// copy_ranges(dest, dest_at, src, src_at, lengths): dest[dest_at[i]:+lengths[i]] =
// src[src_at[i]:+lengths[i]] for each i, every range checked against its buffer first.
PyObject* py_copy_ranges(PyObject*, PyObject* args) {
  PyObject *dest_o, *dest_at_o, *src_o, *src_at_o, *len_o;
  if (!PyArg_ParseTuple(args, "OOOOO", &dest_o, &dest_at_o, &src_o, &src_at_o, &len_o)) return nullptr;
  Int64s dest_at, src_at, lens;
  if (!dest_at.get(dest_at_o, false, false, "dest_at") || !src_at.get(src_at_o, false, false, "src_at") ||
      !lens.get(len_o, false, false, "lengths"))
    return nullptr;
  if (dest_at.n != lens.n || src_at.n != lens.n) {
    PyErr_SetString(PyExc_ValueError, "copy_ranges: dest_at, src_at and lengths differ in length");
    return nullptr;
  }
  Py_buffer dst{}, src{};
  if (PyObject_GetBuffer(dest_o, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) return nullptr;
  if (PyObject_GetBuffer(src_o, &src, PyBUF_C_CONTIGUOUS) != 0) {
    PyBuffer_Release(&dst);
    return nullptr;
  }
  bool ok = true;
  for (int64_t i = 0; ok && i < lens.n; ++i) {
    const int64_t n = lens.data[i], d = dest_at.data[i], s = src_at.data[i];
    if (n < 0 || d < 0 || s < 0 || d > dst.len - n || s > src.len - n) {
      PyErr_Format(PyExc_IndexError, "copy_ranges: range %lld (%lld bytes from %lld to %lld) is out of its buffers",
                   (long long)i, (long long)n, (long long)s, (long long)d);
      ok = false;
    }
  }
  if (ok) {
    char* to = static_cast<char*>(dst.buf);
    const char* from = static_cast<const char*>(src.buf);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < lens.n; ++i) copy_short(to + dest_at.data[i], from + src_at.data[i], size_t(lens.data[i]));
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&dst);
  PyBuffer_Release(&src);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// -- batch replies (PullMany, PushMany) written in one pass: ../entries.py ---------------------

inline int64_t varint_size(uint64_t v) {
  int64_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

inline uint8_t* put_varint(uint8_t* p, uint64_t v) {
  for (; v >= 0x80; v >>= 7) *p++ = uint8_t(v | 0x80);
  *p++ = uint8_t(v);
  return p;
}

// A C-contiguous buffer read for the length of a call (any item size: its bytes).
struct Held {
  Py_buffer view{};
  bool held = false;

  Held() = default;
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (held) PyBuffer_Release(&view);
  }
  bool get(PyObject* obj) { return held = PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) == 0; }
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(view.buf); }
};

// A PullResponse's bytes after its own tag and length: rows field of rows_bytes, and where
// some are missing, the bitmap of its count ids and how many.
inline int64_t pull_reply_size(int64_t rows_bytes, int64_t count, int64_t num_missing) {
  int64_t size = rows_bytes ? 1 + varint_size(rows_bytes) + rows_bytes : 0;
  if (num_missing) {
    const int64_t mask = (count + 7) / 8;
    size += 1 + varint_size(mask) + mask + 1 + varint_size(num_missing);
  }
  return size;
}

inline int64_t count_set(const uint8_t* flags, int64_t n) {
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) k += flags[i] != 0;
  return k;
}

// pull_many_reply(counts, table, in_message, missing, row_bytes, rows) -> bytes: a
// PullManyResponse, per entry PullResponse{rows=1, missing=2, num_missing=3}, empty fields left
// out as protobuf does. counts[e]: entry e's ids; table[e]: its table, an index into row_bytes
// (each table's row bytes) and the list rows (each table's rows pulled: its entries' rows joined,
// in entry order); in_message[e] (bool): whether the entry's rows go in the reply (not into a
// segment); missing (a bool per id of all entries, in entry order): the ids never pushed, sent
// as a bitmap (bit i, little bit order: the entry's id i) and a count. Every entry is checked
// against its buffers before a byte is written.
PyObject* py_pull_many_reply(PyObject*, PyObject* args) {
  PyObject *counts_o, *table_o, *in_o, *missing_o, *row_bytes_o, *rows_o;
  if (!PyArg_ParseTuple(args, "OOOOOO!", &counts_o, &table_o, &in_o, &missing_o, &row_bytes_o, &PyList_Type, &rows_o))
    return nullptr;
  Int64s counts, table, row_bytes;
  Held in_message, missing;
  if (!counts.get(counts_o, false, false, "counts") || !table.get(table_o, false, false, "table") ||
      !row_bytes.get(row_bytes_o, false, false, "row_bytes") || !in_message.get(in_o) || !missing.get(missing_o))
    return nullptr;
  const int64_t entries = counts.n, tables = row_bytes.n;
  if (table.n != entries || in_message.view.len != entries || PyList_GET_SIZE(rows_o) != tables) {
    PyErr_SetString(PyExc_ValueError, "pull_many_reply: one table and in_message per entry, one rows per table");
    return nullptr;
  }
  std::vector<Held> rows(static_cast<size_t>(tables));
  for (int64_t t = 0; t < tables; ++t)
    if (!rows[size_t(t)].get(PyList_GET_ITEM(rows_o, t))) return nullptr;
  std::vector<int64_t> at(static_cast<size_t>(tables), 0);  // each table's next entry's rows in its buffer
  const uint8_t* in = in_message.bytes();
  const uint8_t* miss = missing.bytes();
  const int64_t ids = missing.view.len;
  const bool some_missing = count_set(miss, ids) > 0;  // else no entry's need be counted
  int64_t first = 0, total = 0;
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t n = counts.data[e], t = table.data[e];
    if (n < 0 || n > ids - first || t < 0 || t >= tables || row_bytes.data[t] < 0) {
      PyErr_Format(PyExc_ValueError, "pull_many_reply: entry %lld (%lld ids of table %lld) is out of its buffers",
                   (long long)e, (long long)n, (long long)t);
      return nullptr;
    }
    const int64_t bytes = n * row_bytes.data[t], rb = in[e] ? bytes : 0;
    if (rb && rb > rows[size_t(t)].view.len - at[size_t(t)]) {
      PyErr_Format(PyExc_ValueError, "pull_many_reply: entry %lld's rows are past the end of its table's",
                   (long long)e);
      return nullptr;
    }
    at[size_t(t)] += bytes;
    const int64_t sub = pull_reply_size(rb, n, some_missing ? count_set(miss + first, n) : 0);
    total += 1 + varint_size(uint64_t(sub)) + sub;
    first += n;
  }
  if (first != ids) {
    PyErr_SetString(PyExc_ValueError, "pull_many_reply: missing has another length than the entries' ids");
    return nullptr;
  }
  PyObject* out = PyBytes_FromStringAndSize(nullptr, total);
  if (!out) return nullptr;
  uint8_t* p = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
  Py_BEGIN_ALLOW_THREADS
  std::fill(at.begin(), at.end(), 0);
  first = 0;
  for (int64_t e = 0; e < entries; ++e) {
    const int64_t n = counts.data[e], t = table.data[e];
    const int64_t bytes = n * row_bytes.data[t], rb = in[e] ? bytes : 0;
    const int64_t num_missing = some_missing ? count_set(miss + first, n) : 0;
    *p++ = 0x0A;  // pulls=1, a message
    p = put_varint(p, uint64_t(pull_reply_size(rb, n, num_missing)));
    if (rb) {
      *p++ = 0x0A;  // rows=1
      p = put_varint(p, uint64_t(rb));
      copy_short(reinterpret_cast<char*>(p), reinterpret_cast<const char*>(rows[size_t(t)].bytes()) + at[size_t(t)],
                 size_t(rb));
      p += rb;
    }
    at[size_t(t)] += bytes;
    if (num_missing) {
      const int64_t mask = (n + 7) / 8;
      *p++ = 0x12;  // missing=2
      p = put_varint(p, uint64_t(mask));
      std::memset(p, 0, size_t(mask));
      for (int64_t i = 0; i < n; ++i)
        if (miss[first + i]) p[i >> 3] |= uint8_t(1 << (i & 7));
      p += mask;
      *p++ = 0x18;  // num_missing=3, a varint
      p = put_varint(p, uint64_t(num_missing));
    }
    first += n;
  }
  Py_END_ALLOW_THREADS
  return out;
}

// pull_many_reply_size(counts, table, in_message, row_bytes) -> the largest PullManyResponse
// pull_many_reply could write for these entries (every one with a bitmap): what the service
// checks against its message limit before any row is read.
PyObject* py_pull_many_reply_size(PyObject*, PyObject* args) {
  PyObject *counts_o, *table_o, *in_o, *row_bytes_o;
  if (!PyArg_ParseTuple(args, "OOOO", &counts_o, &table_o, &in_o, &row_bytes_o)) return nullptr;
  Int64s counts, table, row_bytes;
  Held in_message;
  if (!counts.get(counts_o, false, false, "counts") || !table.get(table_o, false, false, "table") ||
      !row_bytes.get(row_bytes_o, false, false, "row_bytes") || !in_message.get(in_o))
    return nullptr;
  if (table.n != counts.n || in_message.view.len != counts.n) {
    PyErr_SetString(PyExc_ValueError, "pull_many_reply_size: one table and in_message per entry");
    return nullptr;
  }
  const uint8_t* in = in_message.bytes();
  int64_t total = 0;
  for (int64_t e = 0; e < counts.n; ++e) {
    const int64_t n = counts.data[e], t = table.data[e];
    if (n < 0 || t < 0 || t >= row_bytes.n) {
      PyErr_Format(PyExc_ValueError, "pull_many_reply_size: entry %lld (%lld ids of table %lld) is out of range",
                   (long long)e, (long long)n, (long long)t);
      return nullptr;
    }
    const int64_t sub = pull_reply_size(in[e] ? n * row_bytes.data[t] : 0, n, n);
    total += 1 + varint_size(uint64_t(sub)) + sub;
  }
  return PyLong_FromLongLong(total);
}

// push_many_reply(counts) -> bytes: a PushManyResponse, per entry PushResponse{rows_written=1}
// of its count (an empty one for 0).
PyObject* py_push_many_reply(PyObject*, PyObject* counts_o) {
  Int64s counts;
  if (!counts.get(counts_o, false, false, "counts")) return nullptr;
  int64_t total = 0;
  for (int64_t e = 0; e < counts.n; ++e) {
    if (counts.data[e] < 0) {
      PyErr_SetString(PyExc_ValueError, "push_many_reply: a negative count");
      return nullptr;
    }
    total += 2 + (counts.data[e] ? 1 + varint_size(uint64_t(counts.data[e])) : 0);
  }
  PyObject* out = PyBytes_FromStringAndSize(nullptr, total);
  if (!out) return nullptr;
  uint8_t* p = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
  for (int64_t e = 0; e < counts.n; ++e) {
    const uint64_t n = uint64_t(counts.data[e]);
    *p++ = 0x0A;  // pushes=1, a message
    *p++ = uint8_t(n ? 1 + varint_size(n) : 0);  // at most 11: one byte
    if (n) {
      *p++ = 0x08;  // rows_written=1, a varint
      p = put_varint(p, n);
    }
  }
  return out;
}

PyMethodDef kMethods[] = {
    {"new", py_new, METH_VARARGS, "new(capacity, seed) -> index"},
    {"size", py_size, METH_O, "size(index) -> live entries"},
    {"capacity", py_capacity, METH_O, "capacity(index) -> slots"},
    {"nbytes", py_nbytes, METH_O, "nbytes(index) -> bytes of slots"},
    {"lookup", py_lookup, METH_VARARGS, "lookup(index, ids, out, missing|None) -> absent count"},
    {"insert", py_insert, METH_VARARGS, "insert(index, ids, pos|None, values, out|None) -> status"},
    {"remove", py_remove, METH_VARARGS, "remove(index, ids, out) -> removed count"},
    {"items", py_items, METH_VARARGS, "items(index, keys, values) -> copied count"},
    {"clear", py_clear, METH_O, "clear(index)"},
    {"scatter", py_scatter, METH_VARARGS, "scatter(table, row_bytes, where, rows, take): table[where[i]] = rows[take[i]]"},
    {"pull_rows", py_pull_rows, METH_VARARGS,
     "pull_rows(index, table, row_bytes, ids, out, missing) -> absent count: rows of ids into out"},
    {"push_rows", py_push_rows, METH_VARARGS,
     "push_rows(index, table, row_bytes, ids, rows, next_value) -> inserted count: rows of ids into table"},
    {"init_rows", py_init_rows, METH_VARARGS,
     "init_rows(out, width, positions, ids, kind, key, a, scale, dim, state_init): initial float32 rows"},
    {"parse_row_entries", py_parse_row_entries, METH_VARARGS,
     "parse_row_entries(data, ref_field, rows_field, max_entries) -> (count, columns|None, names, refs, ids, rows)"},
    {"copy_ranges", py_copy_ranges, METH_VARARGS, "copy_ranges(dest, dest_at, src, src_at, lengths)"},
    {"pull_many_reply", py_pull_many_reply, METH_VARARGS,
     "pull_many_reply(counts, table, in_message, missing, row_bytes, rows) -> PullManyResponse bytes"},
    {"pull_many_reply_size", py_pull_many_reply_size, METH_VARARGS,
     "pull_many_reply_size(counts, table, in_message, row_bytes) -> the largest reply's bytes"},
    {"push_many_reply", py_push_many_reply, METH_O, "push_many_reply(counts) -> PushManyResponse bytes"},
    {"filled_bytes", py_filled_bytes, METH_VARARGS, "filled_bytes(capacity, fill) -> bytes written in place by fill(view) -> used"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_dynemb_id_index", "the embedded PS store's id index", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__dynemb_id_index() { return PyModule_Create(&kModule); }
