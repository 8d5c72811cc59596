// The embedded store's id -> row-number map (see ../backends/id_index.py, its caller, and
// id_index_module.cpp, the Python functions over it).
//
// Open addressing, linear probing, 16-byte slots {int64 key; int64 value}; value < 0 marks an
// empty slot (row numbers are >= 0, insert refuses others), so every int64 is a valid key.
// At most kMaxLoadNum/kMaxLoadDen of the slots are used; growth doubles. home =
// fmix64(key ^ seed) >> shift, seed random per index (the wrapper's), so ids chosen to
// collide cannot be precomputed. Deletion shifts later chain members back (no tombstones),
// so churn never fills the table and probe chains stay those of the live keys.
// No exceptions, no torch: plain C++ that cannot throw across the module boundary. The
// functions trust their sizes; the module checks them against the buffers it was given.

#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

#include "hash.h"  // dynemb/common/csrc: on the include path of both builds

namespace dynemb_index {

constexpr int64_t kEmpty = -1;
constexpr uint64_t kMinCapacity = 16;
constexpr uint64_t kMaxLoadNum = 1, kMaxLoadDen = 2;  // half full at most: short chains
constexpr size_t kHuge = size_t(2) << 20;
constexpr int64_t kAhead = 12;  // ids hashed and prefetched ahead of the one probed

struct Slot {
  int64_t key;
  int64_t value;
};
static_assert(sizeof(Slot) == 16, "16-byte slots");

using dynemb::fmix64;  // MurmurHash3's finaliser: every input bit moves every output bit

// Slots on 2 MiB-aligned memory advised to use huge pages once big enough: probes land at
// random, and with 4 KiB pages most also miss the TLB (as in idtransformer's kernel).
inline Slot* alloc_slots(uint64_t n) {
  const size_t bytes = size_t(n) * sizeof(Slot);
  void* p;
  if (bytes >= kHuge) {
    p = std::aligned_alloc(kHuge, (bytes + kHuge - 1) & ~(kHuge - 1));
    if (p) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without it the memory works, only slower
  } else {
    p = std::malloc(bytes);
  }
  if (p) std::memset(p, 0xFF, bytes);  // key -1, value -1: empty
  return static_cast<Slot*>(p);
}

struct Index {
  Slot* s;
  uint64_t cap;  // a power of two
  uint64_t mask;
  int shift;  // 64 - log2(cap)
  uint64_t size;
  uint64_t seed;

  inline uint64_t home(int64_t key) const { return fmix64(uint64_t(key) ^ seed) >> shift; }
  inline void prefetch(int64_t key) const { __builtin_prefetch(&s[home(key)]); }

  // The slot holding key, or the empty slot ending its chain (there is one: load < 1).
  inline uint64_t probe(int64_t key) const {
    uint64_t p = home(key);
    while (s[p].value != kEmpty && s[p].key != key) p = (p + 1) & mask;
    return p;
  }

  void set_table(Slot* slots, uint64_t n) {
    s = slots;
    cap = n;
    mask = n - 1;
    shift = 64 - __builtin_ctzll(n);
  }

  // Room for `extra` more keys; false (nothing changed) when memory runs out.
  bool reserve(uint64_t extra) {
    const uint64_t need = size + extra;
    if (need * kMaxLoadDen <= cap * kMaxLoadNum) return true;
    uint64_t n = cap;
    while (need * kMaxLoadDen > n * kMaxLoadNum) {
      if (n > (uint64_t(1) << 40)) return false;  // 16 TiB of slots: a size nothing could use
      n <<= 1;
    }
    Slot* fresh = alloc_slots(n);
    if (!fresh) return false;
    Slot* old = s;
    const uint64_t old_cap = cap;
    set_table(fresh, n);
    for (uint64_t i = 0; i < old_cap; ++i) {
      if (old[i].value == kEmpty) continue;
      uint64_t p = home(old[i].key);
      while (s[p].value != kEmpty) p = (p + 1) & mask;  // keys are distinct: walk to a hole
      s[p] = old[i];
    }
    std::free(old);
    return true;
  }

  // Backward-shift deletion: pull later chain members into the hole unless that would put
  // one before its home.
  void erase_at(uint64_t i) {
    uint64_t j = i;
    while (true) {
      j = (j + 1) & mask;
      if (s[j].value == kEmpty) break;
      const uint64_t h = home(s[j].key);
      if (((j - h) & mask) >= ((j - i) & mask)) {  // the hole lies on j's way from its home
        s[i] = s[j];
        i = j;
      }
    }
    s[i].key = kEmpty;
    s[i].value = kEmpty;
    --size;
  }
};


// A new index (free it with idx_free) with room for `capacity` keys; NULL when out of memory.
inline Index* idx_new(int64_t capacity, uint64_t seed) {
  uint64_t n = kMinCapacity;
  const uint64_t want = capacity > 0 ? uint64_t(capacity) : 0;
  while (want * kMaxLoadDen > n * kMaxLoadNum && n <= (uint64_t(1) << 40)) n <<= 1;
  Index* ix = static_cast<Index*>(std::malloc(sizeof(Index)));
  Slot* slots = ix ? alloc_slots(n) : nullptr;
  if (!slots) {
    std::free(ix);
    return nullptr;
  }
  ix->set_table(slots, n);
  ix->size = 0;
  ix->seed = seed;
  return ix;
}

inline void idx_free(Index* ix) {
  if (!ix) return;
  std::free(ix->s);
  std::free(ix);
}

inline int64_t idx_size(const Index* ix) { return int64_t(ix->size); }
inline int64_t idx_capacity(const Index* ix) { return int64_t(ix->cap); }
inline int64_t idx_nbytes(const Index* ix) { return int64_t(ix->cap * sizeof(Slot)); }

// out[i] = the value of ids[i], or -1. With `missing` (room for n), also the positions of
// the absent ids, in order; returns how many are absent.
inline int64_t idx_lookup(const Index* ix, const int64_t* ids, int64_t n, int64_t* out, int64_t* missing) {
  int64_t k = 0;
  // Software pipeline: the home slot of id i + kAhead is fetched while id i is probed, so a
  // big batch waits on several cache misses at once rather than one after another.
  for (int64_t i = 0; i < n && i < kAhead; ++i) ix->prefetch(ids[i]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) ix->prefetch(ids[i + kAhead]);
    const int64_t v = ix->s[ix->probe(ids[i])].value;  // kEmpty where absent
    out[i] = v;
    if (v == kEmpty && missing) missing[k++] = i;
  }
  return k;
}

// Insert ids[pos[j]] -> values[j] for j < k (pos NULL: ids[j]); where out is given, also
// out[pos[j]] = the id's value. An id already present keeps its value (and out gets it): the
// caller's contract is absent, distinct ids; breaking it wastes the value, never the map.
// Returns 0; -1 out of memory, -2 a negative value (nothing changed in either case).
inline int idx_insert(Index* ix, const int64_t* ids, const int64_t* pos, int64_t k, const int64_t* values,
                      int64_t* out) {
  if (k <= 0) return 0;
  for (int64_t j = 0; j < k; ++j)
    if (values[j] < 0) return -2;
  if (!ix->reserve(uint64_t(k))) return -1;
  for (int64_t j = 0; j < k; ++j) {
    if (j + kAhead < k) ix->prefetch(ids[pos ? pos[j + kAhead] : j + kAhead]);
    const int64_t i = pos ? pos[j] : j;
    const uint64_t p = ix->probe(ids[i]);
    if (ix->s[p].value == kEmpty) {
      ix->s[p] = Slot{ids[i], values[j]};
      ++ix->size;
    }
    if (out) out[i] = ix->s[p].value;
  }
  return 0;
}

// A push's index work: where[i] = ids[i]'s value, the absent ids inserted with the values
// next_value, next_value + 1, ... in order of first sighting (a repeat finds its first
// occurrence's entry). Returns how many were inserted; -1 out of memory, -2 a negative
// next_value (nothing changed in either case).
inline int64_t idx_upsert(Index* ix, const int64_t* ids, int64_t n, int64_t next_value, int64_t* where) {
  if (n <= 0) return 0;
  if (next_value < 0) return -2;
  if (!ix->reserve(uint64_t(n))) return -1;
  int64_t k = 0;
  for (int64_t i = 0; i < n && i < kAhead; ++i) ix->prefetch(ids[i]);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) ix->prefetch(ids[i + kAhead]);
    const uint64_t p = ix->probe(ids[i]);
    if (ix->s[p].value == kEmpty) {
      ix->s[p] = Slot{ids[i], next_value + k++};
      ++ix->size;
    }
    where[i] = ix->s[p].value;
  }
  return k;
}

// Remove ids; the values of those present go to out (room for n), each once (a repeat finds
// it gone). Returns how many were removed.
inline int64_t idx_remove(Index* ix, const int64_t* ids, int64_t n, int64_t* out) {
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) ix->prefetch(ids[i + kAhead]);
    const uint64_t p = ix->probe(ids[i]);
    if (ix->s[p].value == kEmpty) continue;
    out[k++] = ix->s[p].value;
    ix->erase_at(p);
  }
  return k;
}

// Copy the live entries to keys/values (room for `room` each); returns how many were copied.
inline int64_t idx_items(const Index* ix, int64_t* keys, int64_t* values, int64_t room) {
  int64_t k = 0;
  for (uint64_t i = 0; i < ix->cap && k < room; ++i) {
    if (ix->s[i].value == kEmpty) continue;
    keys[k] = ix->s[i].key;
    values[k++] = ix->s[i].value;
  }
  return k;
}

// Empty the index and give its memory back (down to the smallest table).
inline void idx_clear(Index* ix) {
  Slot* small = alloc_slots(kMinCapacity);
  if (small) {
    std::free(ix->s);
    ix->set_table(small, kMinCapacity);
  } else {  // no memory for a small table: empty the big one instead
    std::memset(ix->s, 0xFF, ix->cap * sizeof(Slot));
  }
  ix->size = 0;
}

}  // namespace dynemb_index
