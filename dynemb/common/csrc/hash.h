// The 64-bit hashes of dynemb's C++, defined once: the ID transformer's kernel (slot_map.cpp,
// route.cpp) and the PS's id index (id_index.h) include it. The torch-ops versions the tests
// hold them to are idtransformer/slot_map.py's fmix64 and idtransformer/hashing.py's xxh64.

#pragma once

#include <cstdint>

namespace dynemb {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// MurmurHash3's finaliser: a full 64-bit avalanche (the slot map's tags and homes, the coin).
inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// XXH64's primes and its finaliser (avalanche).
constexpr uint64_t kXxhP1 = 0x9E3779B185EBCA87ULL, kXxhP2 = 0xC2B2AE3D27D4EB4FULL, kXxhP3 = 0x165667B19E3779F9ULL,
                   kXxhP4 = 0x85EBCA77C2B2AE63ULL, kXxhP5 = 0x27D4EB2F165667C5ULL;

inline uint64_t xxh64_avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kXxhP2;
  h ^= h >> 29;
  h *= kXxhP3;
  return h ^ (h >> 32);
}

// XXH64 of an ID's 8 little-endian bytes, seed 0: the PS client's shard hash (ps_server/hashing.py).
inline uint64_t xxh64_of_id(int64_t id) {
  uint64_t h = kXxhP5 + 8;
  h ^= rotl64(uint64_t(id) * kXxhP2, 31) * kXxhP1;
  h = rotl64(h, 27) * kXxhP1 + kXxhP4;
  return xxh64_avalanche(h);
}

}  // namespace dynemb
