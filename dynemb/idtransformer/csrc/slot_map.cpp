// CPU kernel of the ID transformer (see ../transformer.py and ../slot_map.py): the slot map and
// a batch's two passes (lookup, then admit), for one table or many in one call. The routing of
// a sharded transform's IDs is route.cpp's, the hashes both use hash.h's.
//
// Written by hand because no library does it: TorchRec's MCH keeps sorted arrays (a binary
// search per ID, a re-sort per eviction), HierarchicalKV is CUDA-only and places keys by
// bucket (the slot is its own position, so capacity is not exact and eviction is
// bucket-local), std::unordered_map costs ~40 bytes per entry plus a heap node.
//
// Per slot, one 16-byte record {int64 id; int64 meta}: meta bits 0-31 the last access step
// (int32, -1 = free), 32-39 the log frequency counter, 40-47 the pin count, 48-63 a count
// of this batch's sightings (zero between calls). A hit reads one record line.
//
// The map: open addressing, linear probing, 8-byte entries {uint32 tag; int32 slot} (slot
// -1: empty) at most half full: 16 bytes per slot, and a probe rarely leaves its cache
// line. With h = fmix64(id ^ seed), tag = h >> 32 and home = (tag * size) >> 32, so an
// entry's home follows from its tag: deletion shifts later chain members back (no
// tombstones) without reading their IDs. A tag match is confirmed on the slot's record
// (its id), which a hit reads anyway.
//
// The kernel follows the torch-ops version in slot_map.py/transformer.py step for step
// (same hash, same coin flips, same victim order, same free-slot order), so the two give
// identical results; the tests hold them to it.
//
// It runs on the calling thread: built without OpenMP, and with nothing split over threads
// (bench/RESULTS.md, idtransformer_bench, has the measurement behind that).
//
// What Python and this file share is defined here once and read by Python from the extension:
// the status codes, the policy kinds, the per-table settings and the columns of
// transform_many's info (the op `names`), and each op's named returns (its schema).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <sys/mman.h>

#include "hash.h"
#include "ids.h"

// What an op reports instead of throwing (no C++ exception crosses into Python on these paths:
// that has crashed where the extension's and torch's C++ runtimes differ).
#define DYNEMB_STATUS(X) \
  X(ok)                  \
  X(no_room)           /* not enough slots free or movable: nothing admitted */ \
  X(pins_full)         /* a slot the batch uses has 255 pins: nothing changed */ \
  X(too_many)          /* more distinct IDs than the table has slots: nothing done */ \
  X(not_pinned)        /* a release of a slot with no pin: nothing changed */ \
  X(slot_out_of_range) /* a release of a slot outside the table: nothing changed */

#define DYNEMB_KIND(X) X(lru) X(lfu) X(hybrid)  // policy.py's kinds

// A table's settings, as the ops that transform take them: int64 values in this order, table
// after table, which Python fills by name (names("settings")).
#define DYNEMB_SETTINGS(X) \
  X(step)                  \
  X(resident)     /* IDs resident before the call */ \
  X(kind)         /* a Kind */ \
  X(initial_freq) \
  X(decay_steps)  /* hybrid: idle steps per point of decay */ \
  X(ttl)          /* idle steps before an ID expires; -1: no TTL */ \
  X(evict_min)    /* slots freed at least, when the table is short */ \
  X(map_seed)     \
  X(coin_seed)

// transform_many's info, one row per table (see transform_many).
#define DYNEMB_MANY_INFO(X) \
  X(status) X(hits) X(admitted) X(evicted) X(distinct_slots) X(new_ids) X(movable) X(distinct_ids)

#define DYNEMB_ENUMERATOR(name) name,
#define DYNEMB_NAME(name) #name,
#define DYNEMB_FIELD(name) int64_t name;
#define DYNEMB_PLUS_ONE(name) +1

namespace dynemb {
namespace {

enum class Status : int64_t { DYNEMB_STATUS(DYNEMB_ENUMERATOR) };
enum class Kind : int64_t { DYNEMB_KIND(DYNEMB_ENUMERATOR) };
enum class Info : int64_t { DYNEMB_MANY_INFO(DYNEMB_ENUMERATOR) };
constexpr int64_t kSettings = 0 DYNEMB_SETTINGS(DYNEMB_PLUS_ONE);
constexpr int64_t kInfo = 0 DYNEMB_MANY_INFO(DYNEMB_PLUS_ONE);

struct Settings {
  DYNEMB_SETTINGS(DYNEMB_FIELD)
  Kind policy() const { return Kind(kind); }
};

// Table t's settings from the values of all tables.
Settings settings_of(at::IntArrayRef values, int64_t t) {
  TORCH_CHECK(int64_t(values.size()) >= (t + 1) * kSettings, "expected ", kSettings, " settings per table, got ",
              values.size(), " values for ", t + 1, " tables");
  const int64_t* v = values.data() + t * kSettings;
  Settings s;
  int64_t i = 0;
#define DYNEMB_READ(name) s.name = v[i++];
  DYNEMB_SETTINGS(DYNEMB_READ)
#undef DYNEMB_READ
  TORCH_CHECK(s.kind >= 0 && s.kind <= int64_t(Kind::hybrid), "settings: no policy kind ", s.kind);
  TORCH_CHECK(s.decay_steps >= 1 && s.ttl >= -1 && s.evict_min >= 0 && s.step >= 0 && s.step < (int64_t(1) << 31),
              "settings: decay_steps must be >= 1, ttl >= -1, evict_min >= 0 and step in [0, 2^31)");
  return s;
}

// The names of a list the Python side reads from here: "status", "kind", "settings" (in the
// order the ops take them) or "info" (transform_many's columns).
std::vector<std::string> names(std::string which) {
  if (which == "status") return {DYNEMB_STATUS(DYNEMB_NAME)};
  if (which == "kind") return {DYNEMB_KIND(DYNEMB_NAME)};
  if (which == "settings") return {DYNEMB_SETTINGS(DYNEMB_NAME)};
  if (which == "info") return {DYNEMB_MANY_INFO(DYNEMB_NAME)};
  TORCH_CHECK(false, "names: no list called '", which, "' (status, kind, settings, info)");
}

constexpr int32_t kEmpty = -1;
constexpr int32_t kFree = -1;

struct Entry {
  uint32_t tag;
  int32_t slot;
};
static_assert(sizeof(Entry) == 8, "slot map entries are 8 bytes");

struct Record {
  int64_t id;
  int64_t meta;
};
static_assert(sizeof(Record) == 16, "slot records are 16 bytes");

Record* records_of(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 2 &&
                  t.size(1) == 2,
              "slot records must be a contiguous CPU int64 tensor of shape (capacity, 2)");
  return reinterpret_cast<Record*>(t.data_ptr<int64_t>());
}

struct Map {
  Entry* e;
  uint64_t size;
  uint64_t seed;
  const Record* rec;

  Map(const at::Tensor& entries, const at::Tensor& records, int64_t seed_) {
    TORCH_CHECK(entries.device().is_cpu() && entries.scalar_type() == at::kInt && entries.is_contiguous() &&
                    entries.numel() % 2 == 0 && entries.numel() > 0,
                "slot map entries must be a contiguous CPU int32 tensor of 2 * size elements");
    e = reinterpret_cast<Entry*>(entries.data_ptr<int32_t>());
    size = uint64_t(entries.numel() / 2);
    TORCH_CHECK(size < (uint64_t(1) << 31), "slot map size must be below 2^31");
    seed = uint64_t(seed_);
    rec = records_of(records);
  }

  inline uint32_t tag(int64_t id) const { return uint32_t(fmix64(uint64_t(id) ^ seed) >> 32); }
  inline uint64_t home_of_tag(uint32_t t) const { return (uint64_t(t) * size) >> 32; }
  inline uint64_t next(uint64_t p) const { return p + 1 == size ? 0 : p + 1; }
  inline void prefetch(int64_t id) const { __builtin_prefetch(&e[home_of_tag(tag(id))]); }

  // First entry from p on whose tag is t, or the empty entry that ends the chain.
  inline uint64_t scan(uint64_t p, uint32_t t) const {
    while (e[p].slot != kEmpty && e[p].tag != t) p = next(p);
    return p;
  }
  // Position of id's entry, or the empty entry that ends its chain.
  inline uint64_t probe(int64_t id) const {
    const uint32_t t = tag(id);
    uint64_t p = scan(home_of_tag(t), t);
    while (e[p].slot != kEmpty && rec[e[p].slot].id != id) p = scan(next(p), t);
    return p;
  }

  void put(int64_t id, int32_t slot) {
    const uint32_t t = tag(id);
    uint64_t p = home_of_tag(t);
    while (e[p].slot != kEmpty) p = next(p);  // the caller knows id is absent
    e[p] = Entry{t, slot};
  }

  // Remove the entry of the ID held in `slot`.
  void erase_slot(int64_t id, int32_t slot) {
    const uint32_t t = tag(id);
    uint64_t i = home_of_tag(t);
    while (e[i].slot != slot) {
      TORCH_CHECK(e[i].slot != kEmpty, "slot map: id ", id, " (slot ", slot, ") is not in the map");
      i = next(i);
    }
    // Backward-shift deletion: pull later members of the chain into the hole unless that
    // would move one before its home.
    uint64_t j = i;
    while (true) {
      j = next(j);
      if (e[j].slot == kEmpty) break;
      const uint64_t h = home_of_tag(e[j].tag);
      const bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      e[i] = e[j];
      i = j;
    }
    e[i].slot = kEmpty;
  }
};

// meta word accessors
inline int32_t last_of(int64_t m) { return int32_t(uint32_t(uint64_t(m))); }
inline uint32_t freq_of(int64_t m) { return uint32_t(uint64_t(m) >> 32) & 0xFF; }
inline uint32_t pins_of(int64_t m) { return uint32_t(uint64_t(m) >> 40) & 0xFF; }
inline uint32_t hits_of(int64_t m) { return uint32_t(uint64_t(m) >> 48); }
inline int64_t make_meta(int32_t last, uint32_t freq, uint32_t pins, uint32_t hits) {
  return int64_t(uint64_t(uint32_t(last)) | uint64_t(freq) << 32 | uint64_t(pins) << 40 | uint64_t(hits) << 48);
}

// An uninitialised CPU tensor on 2 MiB-aligned memory advised to use 2 MiB pages. The map,
// the records and the batch set are read at random: with 4 KiB pages nearly every access
// also misses the TLB, which costs as much as the cache miss itself. (torch's allocator
// aligns to 64 bytes, so only part of a tensor would get huge pages, a different part each
// run.)
at::Tensor huge_empty(at::IntArrayRef size, at::ScalarType dtype) {
  constexpr size_t kHuge = size_t(2) << 20;
  int64_t numel = 1;
  for (int64_t d : size) numel *= d;
  const size_t nbytes = std::max<size_t>(size_t(numel) * at::elementSize(dtype), 1);
  const size_t rounded = (nbytes + kHuge - 1) & ~(kHuge - 1);
  void* p = std::aligned_alloc(kHuge, rounded);
  TORCH_CHECK(p != nullptr, "out of memory allocating ", rounded, " bytes");
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint: without it the memory works, only slower
  return at::from_blob(p, size, [](void* q) { std::free(q); }, at::TensorOptions().dtype(dtype));
}

// Uniform [0, 1) per (id, step): the log counter's coin, the same as slot_map.coin.
inline double coin(int64_t id, int64_t step, uint64_t seed) {
  uint64_t r = fmix64(uint64_t(id) * kGolden ^ ((uint64_t(step) << 32) ^ seed));
  return double(r >> 11) * 0x1.0p-53;
}

// One pass over a batch. A resident ID gets its slot; on its first sighting in the batch its
// counter is decayed (hybrid: idle steps / decay_steps points) and last access set to step;
// after the pass each resident ID seen is bumped once with probability 1 - (1 - p)^hits,
// p = 1 / ((freq - initial_freq) * log_factor + 1) (policy.bump; LRU keeps no counter). A
// missing ID gets -(k + 2), k its index among the batch's distinct missing IDs in order of
// first sighting.
// With pin (the batch is to be pinned), a resident ID whose slot already has 255 pins stops
// the pass: every record touched so far is put back as it was and the status is pins_full,
// with empty tensors, nothing changed (only the resident can be at 255: the admitted start at
// 0 pins, so this is the whole of the batch's pin check).
// Writes the slots into `slots_out` (n int64, contiguous) and returns the new IDs, their
// counts, the distinct resident slots seen, the number of sightings of resident IDs (the
// result's `hits`) and the status.
struct Looked {
  at::Tensor new_ids, new_counts, seen;
  int64_t hits;
  Status status;
};

Looked lookup_into(const at::Tensor& entries, const at::Tensor& records, const at::Tensor& ids,
                   const at::Tensor& slots_out, const Settings& st, double log_factor, bool pin) {
  Map map(entries, records, st.map_seed);
  Record* rec = records_of(records);
  const bool counter = st.policy() != Kind::lru;
  const int64_t decay_steps = st.policy() == Kind::hybrid ? st.decay_steps : 0;  // 0: no decay
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int32_t now = int32_t(st.step);
  TORCH_CHECK(slots_out.scalar_type() == at::kLong && slots_out.is_contiguous() && slots_out.numel() == n,
              "lookup: slots_out must be contiguous int64, one per id");
  int64_t* out = slots_out.data_ptr<int64_t>();

  // The batch's misses are de-duplicated in a small set of their own (sized by the batch,
  // not the table), so the main map only ever holds resident IDs. Its entries carry the ID,
  // so a probe is one access, prefetched along with the main map's.
  struct Pending {
    int64_t id;
    int32_t k;      // index among the new IDs
    uint32_t call;  // the call that wrote it: entries of earlier calls count as empty
  };
  uint64_t set_size = 16;
  while (set_size < uint64_t(2 * n)) set_size <<= 1;
  const uint64_t set_mask = set_size - 1;
  // kept between calls (a fresh one would page-fault in every call); cleared below
  static thread_local at::Tensor set_storage;
  static thread_local uint32_t call = 0;
  if (!set_storage.defined() || set_storage.numel() < int64_t(set_size * 2) || ++call == 0) {
    set_storage = huge_empty({int64_t(set_size * 2)}, at::kLong);
    std::fill_n(reinterpret_cast<Pending*>(set_storage.data_ptr<int64_t>()), set_size, Pending{0, 0, 0});
    call = 1;
  }
  Pending* set = reinterpret_cast<Pending*>(set_storage.data_ptr<int64_t>());
  auto set_home = [&](int64_t x) { return (fmix64(uint64_t(x) ^ kGolden) >> 7) & set_mask; };
  std::vector<int64_t> new_ids;
  std::vector<int32_t> new_counts;
  std::vector<int32_t> touched;  // resident slots seen in this batch
  std::vector<int64_t> touched_meta;  // with pin: their records' meta before this call
  int64_t hits = 0;
  new_ids.reserve(size_t(n));
  new_counts.reserve(size_t(n));

  // Software pipeline: the map entry of ID i + kFar is prefetched; ID i + kNear is scanned
  // for its tag (the entry is in cache by then) and the candidate slot's record, or its
  // pending-set entry, prefetched; ID i is confirmed on its record and processed. Nothing
  // in the map changes during the pass, so early scans stay valid. The distances were
  // measured on a 10^6-slot table (bench/RESULTS.md): 48/24 looks up ~20% faster than 16/8,
  // ~24 misses in flight rather than ~8.
  constexpr int64_t kFar = 48, kNear = 24, kRing = 64;
  std::array<int32_t, kRing> ring{};
  auto candidate = [&](int64_t j) {
    const uint32_t t = map.tag(id[j]);
    const int32_t c = map.e[map.scan(map.home_of_tag(t), t)].slot;
    ring[j % kRing] = c;
    if (c >= 0) __builtin_prefetch(&rec[c], 1);
    else __builtin_prefetch(&set[set_home(id[j])], 1);
  };
  for (int64_t j = 0; j < std::min(n, kFar); ++j) map.prefetch(id[j]);
  for (int64_t j = 0; j < std::min(n, kNear); ++j) candidate(j);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kFar < n) map.prefetch(id[i + kFar]);
    if (i + kNear < n) candidate(i + kNear);
    const int64_t x = id[i];
    int32_t s = ring[i % kRing];
    if (s >= 0 && rec[s].id != x) s = map.e[map.probe(x)].slot;  // a tag shared by two IDs: rare
    if (s >= 0) {
      out[i] = s;
      ++hits;
      const int64_t m = rec[s].meta;
      if (last_of(m) != now) {  // first sighting in this batch
        if (pin) {
          if (pins_of(m) == 255) {  // refused: undo the touches, nothing else was changed yet
            for (size_t j = 0; j < touched.size(); ++j) rec[touched[j]].meta = touched_meta[j];
            at::Tensor none = at::empty({0}, ids.options());
            return {none, none.to(at::kInt), none, 0, Status::pins_full};
          }
          touched_meta.push_back(m);
        }
        uint32_t f = freq_of(m);
        if (decay_steps > 0) {
          const int64_t idle = int64_t(now) - last_of(m);
          if (idle > 0) f = uint32_t(std::max<int64_t>(int64_t(f) - idle / decay_steps, 0));
        }
        rec[s].meta = make_meta(now, f, pins_of(m), 1);
        touched.push_back(s);
      } else if (hits_of(m) < 0xFFFF) {
        rec[s].meta = m + (int64_t(1) << 48);
      }
      continue;
    }
    uint64_t q = set_home(x);
    while (set[q].call == call && set[q].id != x) q = (q + 1) & set_mask;
    if (set[q].call != call) {
      set[q] = Pending{x, int32_t(new_ids.size()), call};
      new_ids.push_back(x);
      new_counts.push_back(0);
    }
    ++new_counts[size_t(set[q].k)];
    out[i] = -(int64_t(set[q].k) + 2);
  }
  // the counter's bump, once per resident ID seen, and the scratch count cleared; the
  // records are read in the order of first sighting (at random), so fetched ahead
  const size_t n_touched = touched.size();
  for (size_t i = 0; i < std::min<size_t>(n_touched, 16); ++i) __builtin_prefetch(&rec[touched[i]], 1);
  for (size_t i = 0; i < n_touched; ++i) {
    if (i + 16 < n_touched) __builtin_prefetch(&rec[touched[i + 16]], 1);
    const int32_t s = touched[i];
    const int64_t m = rec[s].meta;
    uint32_t f = freq_of(m);
    if (counter && f < 255) {
      // as policy.bump computes it, without pow (slow for a base near 1)
      const double p = 1.0 / (double(std::max<int64_t>(int64_t(f) - st.initial_freq, 0)) * log_factor + 1.0);
      const uint32_t h = hits_of(m);
      const double p_batch = h == 1 ? 1.0 - (1.0 - p) : 1.0 - std::exp(double(h) * std::log1p(-p));
      if (coin(rec[s].id, st.step, uint64_t(st.coin_seed)) < p_batch) ++f;
    }
    rec[s].meta = make_meta(last_of(m), f, pins_of(m), 0);
  }
  at::Tensor new_ids_t = at::empty({int64_t(new_ids.size())}, ids.options());
  std::memcpy(new_ids_t.data_ptr<int64_t>(), new_ids.data(), new_ids.size() * sizeof(int64_t));
  at::Tensor counts_t = at::empty({int64_t(new_counts.size())}, ids.options().dtype(at::kInt));
  std::memcpy(counts_t.data_ptr<int32_t>(), new_counts.data(), new_counts.size() * sizeof(int32_t));
  at::Tensor touched_t = at::empty({int64_t(touched.size())}, ids.options());
  std::copy(touched.begin(), touched.end(), touched_t.data_ptr<int64_t>());
  return {new_ids_t, counts_t, touched_t, hits, Status::ok};
}

// lookup_into for one table's batch: returns (slots with placeholders, new_ids, new_counts,
// seen, hits as a 0-dim tensor, status: ok or pins_full, when nothing changed).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> lookup(
    const at::Tensor& entries, const at::Tensor& records, const at::Tensor& ids_in, at::IntArrayRef settings,
    double log_factor, bool pin) {
  at::Tensor ids = flat_ids(ids_in);
  at::Tensor slots = at::empty({ids.numel()}, ids.options());
  const Looked l = lookup_into(entries, records, ids, slots, settings_of(settings, 0), log_factor, pin);
  const bool done = l.status == Status::ok;
  return {done ? slots : l.new_ids, l.new_ids, l.new_counts, l.seen,
          at::scalar_tensor(l.hits, ids.options()), int64_t(l.status)};
}

// ---- Victims ---------------------------------------------------------------------------------
// When the table is short of free slots, max(need - free, evict_min) movable slots are freed,
// lowest keys first, and handed out in slot order, ties to the lowest slot. The ways to pick them:
// - victims_under_sampled_bound is the fastest where it applies (a large table, a few percent of
//   it to free): one pass over the records that computes no key but those under a sampled bound.
// - lowest_exact stays because the bound cannot always decide (much to free, a skewed sample) and
//   costs more than a whole selection on a small table (8,192 sampled keys, 256 bisections): it
//   computes every key and finds the cut by nth_element.
// - transformer._lowest (torch ops) is the reference the tests hold both to, and the CUDA path's.
// Removed: three counting passes that split a large table's exact selection over threads, no
// faster than lowest_exact on one thread (a 10^6-slot table freeing 30%: ~21 ms a batch either
// way); and the small tables' key-and-slot words (lowest_by_sort), replaced by lowest_exact's
// count of the ties at the cut.

// Eviction key of a slot: (primary << 32) | last access, lowest first; kNotMovable for a
// free slot, one this batch uses (touched at this step) or a pinned one. primary is 0 for
// an ID past the TTL (those go first, the most idle first), else 1 for LRU and 1 + counter
// for LFU (the hybrid's counter decayed by idle time): policy.scores' order.
constexpr uint64_t kNotMovable = ~uint64_t(0);

struct Scorer {
  int32_t now;
  Kind kind;
  int64_t ttl;  // -1: none
  int64_t decay_steps;
  double inv_decay;

  explicit Scorer(const Settings& st)
      : now(int32_t(st.step)), kind(st.policy()), ttl(st.ttl), decay_steps(st.decay_steps),
        inv_decay(1.0 / double(st.decay_steps)) {}

  // idle / decay_steps without an integer division (tens of cycles, a million times):
  // the reciprocal's estimate corrected by one step either way.
  inline int64_t decay_points(int64_t idle) const {
    int64_t q = int64_t(double(idle) * inv_decay);
    if ((q + 1) * decay_steps <= idle) ++q;
    else if (q * decay_steps > idle) --q;
    return q;
  }

  inline uint64_t key(int64_t m) const {
    const int32_t last = last_of(m);
    if (last == kFree || last == now || pins_of(m) != 0) return kNotMovable;
    const int64_t idle = int64_t(now) - last;
    uint64_t primary;
    if (ttl >= 0 && idle > ttl) {
      primary = 0;
    } else if (kind == Kind::lru) {
      primary = 1;
    } else {
      int64_t f = freq_of(m);
      if (kind == Kind::hybrid) f = std::max<int64_t>(f - decay_points(idle), 0);
      primary = uint64_t(1 + f);
    }
    return primary << 32 | uint32_t(last);
  }
};

// Of keys offered in slot order, which are among the n lowest (ties to the lowest slots): those
// below the n-th lowest, `key`, and the first `ties` equal to it.
struct Cut {
  uint64_t key;
  int64_t ties;

  // n of m (1 <= n <= m) keys, reordered to find it.
  static Cut nth(uint64_t* keys, int64_t m, int64_t n) {
    std::nth_element(keys, keys + (n - 1), keys + m);
    const uint64_t k = keys[n - 1];
    return {k, 1 + int64_t(std::count(keys, keys + (n - 1), k))};
  }

  inline bool take(uint64_t k) {  // written without a branch: called once per slot
    const bool at = k == key;
    const bool taken = (k < key) | (at & (ties > 0));
    ties -= int64_t(at & taken);
    return taken;
  }

  // The n slots taken of `count` offered in slot order, slot_of(i) with key_of(i): ascending.
  template <typename SlotOf, typename KeyOf>
  at::Tensor slots(int64_t n, int64_t count, SlotOf slot_of, KeyOf key_of) {
    at::Tensor out = at::empty({n + 1}, at::kLong);  // + 1: the branch-free loop writes one past the last
    int64_t* o = out.data_ptr<int64_t>();
    int64_t w = 0;
    for (int64_t i = 0; i < count; ++i) {
      o[w] = slot_of(i);
      w += take(key_of(i));
    }
    return out.narrow(0, 0, n);
  }
};

// A bound on the n-th lowest of m keys from `sample` (size of them, evenly spaced, reordered):
// its quantile at the expected rank plus `sigmas` standard deviations and `slack`.
uint64_t sampled_bound(uint64_t* sample, int64_t size, int64_t n, int64_t m, double sigmas, double slack) {
  const double expect = double(n) * double(size) / double(m);
  const int64_t k = std::min<int64_t>(size - 1, int64_t(expect + sigmas * std::sqrt(expect) + slack));
  std::nth_element(sample, sample + k, sample + size);
  return sample[k];
}

// The victims, found by computing every key: the n = min(movable, max(short_by, evict_min))
// lowest keys' slots, ascending. Too few movable slots: returns an undefined tensor and sets
// *short_of_room to how many there are.
at::Tensor lowest_exact(const Record* rec, int64_t C, const Scorer& sc, int64_t short_by, int64_t evict_min,
                        int64_t* short_of_room) {
  static thread_local std::vector<uint64_t> keys_storage, movable_storage;  // kept: fresh ones page-fault
  keys_storage.resize(size_t(C));
  movable_storage.resize(size_t(C));
  uint64_t* keys = keys_storage.data();
  uint64_t* movable = movable_storage.data();
  for (int64_t s = 0; s < C; ++s) keys[s] = sc.key(rec[s].meta);
  auto gather = [&]() {  // the movable keys, in slot order; how many
    int64_t m = 0;
    for (int64_t s = 0; s < C; ++s) {  // written without a branch: most slots are movable
      movable[m] = keys[s];
      m += keys[s] != kNotMovable;
    }
    return m;
  };
  int64_t m = gather();
  if (m < short_by) {
    *short_of_room = m;
    return at::Tensor();
  }
  const int64_t n = std::min(m, std::max(short_by, evict_min));
  Cut cut{kNotMovable, 0};  // all movable: n == m
  if (n < m) {
    if (2 * n <= m && m >= 1024) {
      // n is at most half of m (usually a small share: a step's admissions against a table's
      // slots): a quantile of an evenly spaced sample bounds the n-th lowest key from above,
      // and the selection runs on the keys at or below it only. Exact either way: every key up
      // to the n-th lowest is kept; a bound that keeps fewer than n keys falls back to all.
      constexpr int64_t kSample = 128;
      uint64_t sample[kSample];
      for (int64_t i = 0; i < kSample; ++i) sample[i] = movable[i * m / kSample];
      const uint64_t bound = sampled_bound(sample, kSample, n, m, 3.0, 2.0);
      int64_t kept = 0;
      for (int64_t i = 0; i < m; ++i) {  // in place, without a branch: kept <= i
        movable[kept] = movable[i];
        kept += movable[i] <= bound;
      }
      m = kept >= n ? kept : gather();  // too few kept: the compaction overwrote keys, gather them again
    }
    cut = Cut::nth(movable, m, n);
  }
  return cut.slots(n, C, [](int64_t s) { return s; }, [keys](int64_t s) { return keys[s]; });
}

// A large table's victims in one pass over its records, where a sample allows: a quantile of
// the keys of an evenly spaced sample of slots bounds the n-th lowest key from above (n the
// victims the caller most likely needs, max(short_by, evict_min)), and one pass over the
// records counts the movable slots and keeps the (key, slot) pairs at or below the bound: a
// few percent of the table. Exact: the n lowest keys are all kept whenever at least n are, and
// the answer is theirs. Not done (done = false) when the bound keeps too few (or too many: more
// than kKeptPerVictim per victim), the sample finds too few movable slots, or the table needs
// all its movable slots: lowest_exact then decides.
struct Sampled {
  bool done;
  at::Tensor victims;  // undefined with done: too few movable slots (*short_of_room set)
};

Sampled victims_under_sampled_bound(const Record* rec, int64_t C, const Scorer& sc, int64_t short_by,
                                    int64_t evict_min, int64_t* short_of_room) {
  constexpr int64_t kSample = 8192, kKeptPerVictim = 4;
  const int64_t want = std::max(short_by, evict_min);
  if (want <= 0 || want * 4 > C) return {false, at::Tensor()};
  static thread_local std::vector<uint64_t> sample;
  sample.resize(size_t(kSample));
  for (int64_t i = 0; i < kSample; ++i) sample[size_t(i)] = sc.key(rec[i * C / kSample].meta);
  const uint64_t bound = sampled_bound(sample.data(), kSample, want, C, 4.0, 8.0);
  if (bound == kNotMovable) return {false, at::Tensor()};  // the sample is mostly unmovable

  // For a given counter, a slot's key rises with its last access (the primary never falls as
  // the idle time shrinks, and the last access is the key's low half), so key <= bound is
  // last <= below[counter]: found once per counter by bisection, the pass then reads no
  // key but the kept ones' (computing every key was most of its time).
  std::array<int64_t, 256> below;
  for (uint32_t f = 0; f < 256; ++f) {
    int64_t lo = -1, hi = int64_t(sc.now) - 1;  // below[f]: the largest last <= hi with key <= bound, or -1
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (sc.key(make_meta(int32_t(mid), f, 0, 0)) <= bound) lo = mid;
      else hi = mid - 1;
    }
    below[f] = lo;
  }
  const int32_t now = sc.now;
  static thread_local std::vector<uint64_t> kept_keys, scratch;
  static thread_local std::vector<int64_t> kept_slots;
  kept_keys.clear();
  kept_slots.clear();
  int64_t n_movable = 0;
  for (int64_t s = 0; s < C; ++s) {
    const int64_t meta = rec[s].meta;
    const int32_t last = last_of(meta);
    const bool can_move = (last != kFree) & (last != now) & (pins_of(meta) == 0);  // as Scorer::key
    n_movable += can_move;
    if (can_move & (last <= below[freq_of(meta)])) {  // rare: a well-predicted branch
      kept_keys.push_back(sc.key(meta));
      kept_slots.push_back(s);
    }
  }
  if (n_movable < short_by) {
    *short_of_room = n_movable;
    return {true, at::Tensor()};
  }
  const int64_t n = std::min(n_movable, want);
  const int64_t n_kept = int64_t(kept_keys.size());
  if (n == n_movable || n_kept < n || n_kept > kKeptPerVictim * n + kSample) return {false, at::Tensor()};
  scratch.assign(kept_keys.begin(), kept_keys.end());  // the kept stay in slot order for the pass below
  Cut cut = Cut::nth(scratch.data(), n_kept, n);
  const int64_t* slot = kept_slots.data();
  const uint64_t* key = kept_keys.data();
  return {true, cut.slots(n, n_kept, [slot](int64_t i) { return slot[i]; }, [key](int64_t i) { return key[i]; })};
}

// The victims (see above), or, with too few movable slots, an undefined tensor and
// *short_of_room set to how many there are (the caller reports no room).
at::Tensor select_victims(const Record* rec, int64_t C, const Scorer& sc, int64_t short_by, int64_t evict_min,
                          int64_t* short_of_room) {
  constexpr int64_t kSmallTable = 16384;  // and below: lowest_exact straight away
  if (C > kSmallTable) {
    Sampled quick = victims_under_sampled_bound(rec, C, sc, short_by, evict_min, short_of_room);
    if (quick.done) return quick.victims;
  }
  return lowest_exact(rec, C, sc, short_by, evict_min, short_of_room);
}

// ---- Admission -------------------------------------------------------------------------------

// Second half of a batch, after lookup and admission: make room for the admitted new IDs
// (evicting, when the table is short, max(short, evict_min) movable slots, lowest keys
// first), give them the lowest free slots in order, and write their slots over the
// -(k + 2) placeholders in `slots`. admit: one flag per new ID, or none: all admitted. With
// pin, every slot the batch uses (`seen`, from lookup, and the admitted) gets one more pin;
// if one of the seen already has 255 (lookup with pin refuses such a batch first, so this is
// a guard), the call changes nothing and returns pins_full.
// status: ok; pins_full or no_room (movable: how many slots could have been evicted), when
// nothing changed and the tensors are empty.
struct Admitted {
  at::Tensor admitted_ids, admitted_slots, evicted_ids, evicted_slots, distinct_slots;  // distinct: seen, then admitted
  Status status;
  int64_t movable;

  static Admitted refused(const at::TensorOptions& opt, Status status, int64_t movable) {
    at::Tensor none = at::empty({0}, opt);
    return {none, none, none, none, none, status, movable};
  }
};

Admitted admit_into(const at::Tensor& entries, const at::Tensor& records, const at::Tensor& slots_t,
                    const at::Tensor& new_ids_t, const std::optional<at::Tensor>& admit_t, const at::Tensor& seen_t,
                    bool pin, const Settings& st) {
  Map map(entries, records, st.map_seed);
  Record* rec = records_of(records);
  TORCH_CHECK(slots_t.scalar_type() == at::kLong && slots_t.is_contiguous(), "slots must be contiguous int64");
  TORCH_CHECK(!admit_t || (admit_t->scalar_type() == at::kBool && admit_t->numel() == new_ids_t.numel()),
              "admit must be a bool tensor, one per new id");
  TORCH_CHECK(seen_t.scalar_type() == at::kLong && seen_t.is_contiguous() && seen_t.dim() == 1,
              "seen must be a 1-d contiguous int64 tensor");
  at::Tensor new_ids = flat_ids(new_ids_t);
  const int64_t C = records.size(0);
  const int64_t* nid = new_ids.data_ptr<int64_t>();
  const int64_t n_new = new_ids.numel();
  const at::Tensor admit_c = admit_t ? admit_t->contiguous() : at::Tensor();
  const bool* flags = admit_t ? admit_c.data_ptr<bool>() : nullptr;
  auto ok = [flags](int64_t k) { return flags == nullptr || flags[k]; };  // no flags: all admitted
  const int32_t now = int32_t(st.step);
  const auto opt = slots_t.options();
  int64_t need = 0;
  for (int64_t k = 0; k < n_new; ++k) need += ok(k);
  const int64_t free = C - st.resident;
  const int64_t* seen = seen_t.data_ptr<int64_t>();
  const int64_t n_seen = seen_t.numel();
  // Pins: only the seen can be at 255 (the admitted start at 0), and they are touched at
  // this step, so eviction never takes them: checked before anything changes, applied at
  // the end.
  if (pin)
    for (int64_t i = 0; i < n_seen; ++i)
      if (pins_of(rec[seen[i]].meta) == 255) return Admitted::refused(opt, Status::pins_full, 0);
  const uint32_t new_pins = pin ? 1 : 0;

  // The admitted take the lowest free slots: the slots free before this call (all `free` of
  // them, or the lowest `need`) merged with the victims. Found before the victims are freed,
  // and not at all when the table is full (the steady state under eviction).
  std::vector<int64_t> old_free;
  old_free.reserve(size_t(std::min(free, need)));
  for (int64_t s = 0; s < C && int64_t(old_free.size()) < std::min(free, need); ++s)
    if (last_of(rec[s].meta) == kFree) old_free.push_back(s);

  at::Tensor victims = at::empty({0}, opt), victim_ids = at::empty({0}, opt);
  if (need > free) {
    int64_t movable = -1;
    victims = select_victims(rec, C, Scorer(st), need - free, st.evict_min, &movable);
    if (movable >= 0) return Admitted::refused(opt, Status::no_room, movable);
    const int64_t nv = victims.numel();
    const int64_t* v = victims.data_ptr<int64_t>();
    victim_ids = at::empty({nv}, opt);
    int64_t* vid = victim_ids.data_ptr<int64_t>();
    // pipelined: a victim's record is fetched 32 ahead, its map entry 16 ahead
    constexpr int64_t kRecAhead = 32, kMapAhead = 16;
    for (int64_t i = 0; i < std::min(nv, kRecAhead); ++i) __builtin_prefetch(&rec[v[i]], 1);
    for (int64_t i = 0; i < std::min(nv, kMapAhead); ++i) map.prefetch(rec[v[i]].id);
    for (int64_t i = 0; i < nv; ++i) {
      if (i + kRecAhead < nv) __builtin_prefetch(&rec[v[i + kRecAhead]], 1);
      if (i + kMapAhead < nv) map.prefetch(rec[v[i + kMapAhead]].id);
      vid[i] = rec[v[i]].id;
      map.erase_slot(vid[i], int32_t(v[i]));
      rec[v[i]].meta = int64_t(uint64_t(rec[v[i]].meta) | 0xFFFFFFFFULL);  // last access -1: free
    }
  }

  at::Tensor admitted = at::empty({need}, opt), admitted_slots = at::empty({need}, opt);
  int64_t* a_id = admitted.data_ptr<int64_t>();
  int64_t* a_slot = admitted_slots.data_ptr<int64_t>();
  {
    const int64_t* v = victims.data_ptr<int64_t>();
    const int64_t nv = victims.numel(), nf = int64_t(old_free.size());
    int64_t i = 0, j = 0, a = 0;
    for (int64_t k = 0; k < n_new; ++k) {
      if (!ok(k)) continue;
      // need <= free + victims, so one of the two has a slot left
      a_slot[a] = (j == nv || (i < nf && old_free[size_t(i)] < v[j])) ? old_free[size_t(i++)] : v[j++];
      a_id[a++] = nid[k];
    }
  }
  // placeholder k -> the slot of new ID k (-1: not admitted)
  std::vector<int64_t> new_slot(size_t(n_new), -1);
  {
    int64_t a = 0;
    for (int64_t k = 0; k < n_new; ++k)
      if (ok(k)) new_slot[size_t(k)] = a_slot[a++];
  }
  constexpr int64_t kAhead = 16;
  for (int64_t a = 0; a < std::min(need, kAhead); ++a) map.prefetch(a_id[a]);
  for (int64_t a = 0; a < need; ++a) {
    if (a + kAhead < need) {
      map.prefetch(a_id[a + kAhead]);
      __builtin_prefetch(&rec[a_slot[a + kAhead]], 1);
    }
    rec[a_slot[a]].id = a_id[a];
    rec[a_slot[a]].meta = make_meta(now, uint32_t(st.initial_freq), new_pins, 0);
    map.put(a_id[a], int32_t(a_slot[a]));
  }
  int64_t* out = slots_t.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots_t.numel(); ++i)
    if (out[i] < 0) out[i] = new_slot[size_t(-(out[i] + 2))];
  if (new_pins)
    for (int64_t i = 0; i < n_seen; ++i) rec[seen[i]].meta += int64_t(1) << 40;
  at::Tensor distinct = at::empty({n_seen + need}, opt);
  std::memcpy(distinct.data_ptr<int64_t>(), seen, size_t(n_seen) * sizeof(int64_t));
  std::memcpy(distinct.data_ptr<int64_t>() + n_seen, a_slot, size_t(need) * sizeof(int64_t));
  return {admitted, admitted_slots, victim_ids, victims, distinct, Status::ok, 0};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t> admit(
    const at::Tensor& entries, const at::Tensor& records, const at::Tensor& slots, const at::Tensor& new_ids,
    const std::optional<at::Tensor>& admit, const at::Tensor& seen, at::IntArrayRef settings, bool pin) {
  Admitted a = admit_into(entries, records, slots, new_ids, admit, seen, pin, settings_of(settings, 0));
  return {a.admitted_ids, a.admitted_slots, a.evicted_ids, a.evicted_slots, a.distinct_slots, int64_t(a.status),
          a.movable};
}

// ---- Many tables -----------------------------------------------------------------------------

int64_t count_distinct(const at::Tensor& ids) {
  std::vector<int64_t> v(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  std::sort(v.begin(), v.end());
  return int64_t(std::unique(v.begin(), v.end()) - v.begin());
}

// Many tables' batches in one call (a trainer rank's tables at a step: one call instead of
// two ops and their Python per table). Table t's IDs are the sizes[t] of `ids` after those of
// tables 0..t-1; its state is entries[t], records[t], its settings the t-th kSettings of
// `settings` and its counter's log factor log_factors[t]. Each table is transformed exactly as
// lookup then admit (no admission flags: all admitted) would, the tables one after the other;
// a table that fails changes nothing in the others.
// Returns the slots of all blocks, then for all tables in order the admitted ids and slots, the
// evicted ids and slots, the distinct slots, and info: one row per table (DYNEMB_MANY_INFO):
// the status (admit's; too_many: the block has more distinct IDs, distinct_ids of them, than
// the table has slots, and nothing was done, the step not taken), hits, how many admitted,
// evicted and distinct slots it has in the flat tensors, and with no_room the block's new IDs
// and the movable slots. The slots handed out (the blocks' and the admitted and evicted ones)
// are the table's local slot + bases[t] (the row its block starts at); the distinct slots stay
// local (what release takes). A failed table's block of slots is undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> transform_many(
    at::TensorList entries, at::TensorList records, const at::Tensor& ids_in, at::IntArrayRef sizes,
    at::IntArrayRef bases, at::IntArrayRef settings, at::ArrayRef<double> log_factors, bool pin) {
  const int64_t T = int64_t(entries.size());
  TORCH_CHECK(int64_t(records.size()) == T && int64_t(sizes.size()) == T && int64_t(bases.size()) == T &&
                  int64_t(log_factors.size()) == T && int64_t(settings.size()) == T * kSettings,
              "transform_many: one entries, records, size, base, log_factor and ", kSettings, " settings per table");
  at::Tensor ids = flat_ids(ids_in);
  check_blocks(sizes, ids.numel(), "transform_many", "ids");
  at::Tensor slots = at::empty({ids.numel()}, ids.options());
  at::Tensor info = at::zeros({T, kInfo}, ids.options());
  std::vector<at::Tensor> admitted, admitted_slots, evicted, evicted_slots, distinct;
  int64_t off = 0;
  for (int64_t t = 0; t < T; ++t) {
    const Settings st = settings_of(settings, t);
    int64_t* row = info.data_ptr<int64_t>() + t * kInfo;
    auto set = [row](Info column, int64_t value) { row[int64_t(column)] = value; };
    const int64_t n = sizes[t], C = records[t].size(0), base = bases[t];
    const at::Tensor block = ids.narrow(0, off, n), out = slots.narrow(0, off, n);
    off += n;
    if (n > C) {  // only then can it hold too many distinct IDs
      const int64_t d = count_distinct(block);
      if (d > C) {
        set(Info::status, int64_t(Status::too_many));
        set(Info::distinct_ids, d);
        continue;
      }
    }
    const Looked l = lookup_into(entries[t], records[t], block, out, st, log_factors[t], pin);
    if (l.status != Status::ok) {  // refused before anything changed in this table
      set(Info::status, int64_t(l.status));
      continue;
    }
    Admitted a = admit_into(entries[t], records[t], out, l.new_ids, std::nullopt, l.seen, pin, st);
    set(Info::status, int64_t(a.status));
    set(Info::hits, l.hits);
    if (a.status != Status::ok) {  // no room: nothing admitted
      set(Info::new_ids, l.new_ids.numel());
      set(Info::movable, a.movable);
      continue;
    }
    if (base != 0) {
      int64_t* o = out.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) o[i] += o[i] >= 0 ? base : 0;
      a.admitted_slots.add_(base);
      a.evicted_slots.add_(base);
    }
    set(Info::admitted, a.admitted_ids.numel());
    set(Info::evicted, a.evicted_ids.numel());
    set(Info::distinct_slots, a.distinct_slots.numel());
    admitted.push_back(a.admitted_ids);
    admitted_slots.push_back(a.admitted_slots);
    evicted.push_back(a.evicted_ids);
    evicted_slots.push_back(a.evicted_slots);
    distinct.push_back(a.distinct_slots);
  }
  auto cat = [&](const std::vector<at::Tensor>& parts) {
    return parts.empty() ? at::empty({0}, ids.options()) : at::cat(parts);
  };
  return {slots, cat(admitted), cat(admitted_slots), cat(evicted), cat(evicted_slots), cat(distinct), info};
}

// ---- Pins and the map ------------------------------------------------------------------------

// Take one pin off each of `slots` (distinct), all or none: returns ok, not_pinned if one has
// none (nothing changed), or slot_out_of_range for a slot outside the table (nothing changed).
// (A batch's pins are taken by admit.)
int64_t release(const at::Tensor& records, const at::Tensor& slots_t) {
  Record* rec = records_of(records);
  TORCH_CHECK(slots_t.device().is_cpu() && slots_t.scalar_type() == at::kLong, "release: slots must be CPU int64");
  at::Tensor slots = slots_t.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n = slots.numel(), C = records.size(0);
  for (int64_t i = 0; i < n; ++i) {
    if (sl[i] < 0 || sl[i] >= C) return int64_t(Status::slot_out_of_range);
    if (pins_of(rec[sl[i]].meta) == 0) return int64_t(Status::not_pinned);
  }
  for (int64_t i = 0; i < n; ++i) rec[sl[i]].meta -= int64_t(1) << 40;  // the count is bits 40-47; checked above
  return int64_t(Status::ok);
}

// release for many tables in one call: table t's slots are the counts[t] of `slots` after those
// of the tables before it; each table all or none, as release. Returns its status per table.
at::Tensor release_many(at::TensorList records, const at::Tensor& slots_in, at::IntArrayRef counts) {
  TORCH_CHECK(records.size() == counts.size(), "release_many: one count per table");
  TORCH_CHECK(slots_in.device().is_cpu() && slots_in.scalar_type() == at::kLong,
              "release_many: slots must be CPU int64");
  const at::Tensor slots = slots_in.contiguous().view({-1});
  check_blocks(counts, slots.numel(), "release_many", "slots");
  at::Tensor status = at::empty({int64_t(counts.size())}, at::kLong);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    status.data_ptr<int64_t>()[t] = release(records[t], slots.narrow(0, off, counts[t]));
    off += counts[t];
  }
  return status;
}

// The slot of each id, -1 where it is not in the map.
at::Tensor find(const at::Tensor& entries, const at::Tensor& records, const at::Tensor& ids_in, int64_t map_seed) {
  Map map(entries, records, map_seed);
  at::Tensor ids = flat_ids(ids_in);
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor slots = at::empty({ids.numel()}, ids.options());
  int64_t* out = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) out[i] = map.e[map.probe(id[i])].slot;
  return slots;
}

// Each slot of `slots_in` (checked against the table), with the ID its record holds.
template <typename F>
void for_each_held(const Map& map, const at::Tensor& records, const at::Tensor& slots_in, const char* what, F f) {
  at::Tensor slots = slots_in.to(at::kLong).contiguous().view({-1});
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < records.size(0), what, ": slot ", sl[i], " out of range");
    f(map.rec[sl[i]].id, int32_t(sl[i]));
  }
}

// Enter the IDs held in `slots` (per their records) into the map; none may be there yet.
void insert(const at::Tensor& entries, const at::Tensor& records, const at::Tensor& slots, int64_t map_seed) {
  Map map(entries, records, map_seed);
  for_each_held(map, records, slots, "insert", [&](int64_t id, int32_t slot) { map.put(id, slot); });
}

// Remove the IDs held in `slots` (per their records) from the map.
void erase(const at::Tensor& entries, const at::Tensor& records, const at::Tensor& slots, int64_t map_seed) {
  Map map(entries, records, map_seed);
  for_each_held(map, records, slots, "erase", [&](int64_t id, int32_t slot) { map.erase_slot(id, slot); });
}

}  // namespace
}  // namespace dynemb

// The ops, their returns named: Python's kernel.ops() gives an op's returns as a named tuple of
// these names, so neither side copies the other's order.
TORCH_LIBRARY(dynemb_idt, m) {
  m.def("names(str which) -> str[]", dynemb::names);
  m.def(
      "lookup(Tensor entries, Tensor(a!) records, Tensor ids, int[] settings, float log_factor, bool pin) -> "
      "(Tensor slots, Tensor new_ids, Tensor new_counts, Tensor seen, Tensor hits, int status)");
  m.def(
      "admit(Tensor(a!) entries, Tensor(b!) records, Tensor(c!) slots, Tensor new_ids, Tensor? admit, Tensor seen, "
      "int[] settings, bool pin) -> (Tensor admitted_ids, Tensor admitted_slots, Tensor evicted_ids, "
      "Tensor evicted_slots, Tensor distinct_slots, int status, int movable)");
  m.def(
      "transform_many(Tensor(a!)[] entries, Tensor(b!)[] records, Tensor ids, int[] sizes, int[] bases, "
      "int[] settings, float[] log_factors, bool pin) -> (Tensor slots, Tensor admitted_ids, Tensor admitted_slots, "
      "Tensor evicted_ids, Tensor evicted_slots, Tensor distinct_slots, Tensor info)");
  m.def("release(Tensor(a!) records, Tensor slots) -> int");
  m.def("release_many(Tensor(a!)[] records, Tensor slots, int[] counts) -> Tensor");
  m.def("huge_empty(int[] size, ScalarType dtype) -> Tensor", dynemb::huge_empty);
  m.def("find(Tensor entries, Tensor records, Tensor ids, int map_seed) -> Tensor");
  m.def("insert(Tensor(a!) entries, Tensor records, Tensor slots, int map_seed) -> ()");
  m.def("erase(Tensor(a!) entries, Tensor records, Tensor slots, int map_seed) -> ()");
}

TORCH_LIBRARY_IMPL(dynemb_idt, CPU, m) {
  m.impl("lookup", dynemb::lookup);
  m.impl("admit", dynemb::admit);
  m.impl("transform_many", dynemb::transform_many);
  m.impl("release", dynemb::release);
  m.impl("release_many", dynemb::release_many);
  m.impl("find", dynemb::find);
  m.impl("insert", dynemb::insert);
  m.impl("erase", dynemb::erase);
}
