// The routing of a sharded transform's IDs (../route.py, ../sharded.py): which rank owns each
// ID, and the blocks of the all_to_all laid out by counting sort, in place of torch's hash ops,
// stable sorts and bincounts (~0.9 ms of torch ops a step for 26 tables x 512 IDs). Registered
// in the ID transformer's op library (slot_map.cpp) by a fragment of its own.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hash.h"
#include "ids.h"

namespace dynemb {
namespace {

// The send layout of a sharded transform. ids holds the tables' IDs end to end (table t's are
// the sizes[t] after those of tables 0..t-1); an ID's destination is xxh64(id) % world. Returns
// (send, position, counts): send holds the IDs grouped by (destination, table) bucket, buckets in
// that order and each in the IDs' own order (what a stable sort by destination * T + table
// gives), ids[i] at send[position[i]] (so the answers come back by a gather); counts (world * T)
// the bucket sizes. Two passes: hash and count, then place.
std::tuple<at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& ids_in, at::IntArrayRef sizes,
                                                      int64_t world) {
  const at::Tensor ids = flat_ids(ids_in);
  const int64_t T = int64_t(sizes.size()), n = ids.numel();
  TORCH_CHECK(world >= 1, "route: world size must be at least 1, got ", world);
  TORCH_CHECK(world * std::max<int64_t>(T, 1) < (int64_t(1) << 31), "route: too many (rank, table) buckets");
  check_blocks(sizes, n, "route", "ids");
  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor counts = at::zeros({world * T}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int32_t> bucket(static_cast<size_t>(n));  // destination * T + table of each id
  const bool pow2 = (world & (world - 1)) == 0;  // the usual world sizes: a mask, not a division
  const uint64_t W = uint64_t(world);
  for (int64_t t = 0, i = 0; t < T; ++t) {
    for (const int64_t end = i + sizes[t]; i < end; ++i) {
      const uint64_t h = xxh64_of_id(id[i]);
      const int64_t b = int64_t(pow2 ? h & (W - 1) : h % W) * T + t;
      bucket[size_t(i)] = int32_t(b);
      ++count[b];
    }
  }
  std::vector<int64_t> fill(size_t(world * T));  // where each bucket's next id goes
  for (int64_t b = 0, pos = 0; b < world * T; ++b) {
    fill[size_t(b)] = pos;
    pos += count[b];
  }
  at::Tensor send = at::empty({n}, ids.options()), position = at::empty({n}, ids.options());
  int64_t* s = send.data_ptr<int64_t>();
  int64_t* pos = position.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = fill[size_t(bucket[size_t(i)])]++;
    s[p] = id[i];
    pos[i] = p;
  }
  return {send, position, counts};
}

// x laid out in blocks (r, c), row after row, of counts[r][c] elements (counts: 2-D int64, any
// strides), laid out again column after column: blocks (0, 0), (1, 0), ... (0, 1), (1, 1), ...
// The receive side's (source, table) blocks become (table, source) ones; with counts.t() the
// same op puts them back.
at::Tensor transpose_blocks(const at::Tensor& x_in, const at::Tensor& counts) {
  TORCH_CHECK(x_in.device().is_cpu(), "transpose_blocks: x must be a CPU tensor");
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.dim() == 2,
              "transpose_blocks: counts must be a 2-D CPU int64 tensor");
  const at::Tensor x = x_in.contiguous().view({-1});
  const int64_t R = counts.size(0), C = counts.size(1);
  const auto cnt = counts.accessor<int64_t, 2>();
  std::vector<int64_t> start(size_t(R * C));  // of block (r, c) in x
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      TORCH_CHECK(cnt[r][c] >= 0, "transpose_blocks: a count is negative");
      start[size_t(r * C + c)] = total;
      total += cnt[r][c];
    }
  }
  TORCH_CHECK(total == x.numel(), "transpose_blocks: the counts add up to ", total, ", not to the ", x.numel(),
              " elements");
  at::Tensor out = at::empty({total}, x.options());
  const size_t width = x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t r = 0; r < R; ++r) {
      const size_t bytes = size_t(cnt[r][c]) * width;
      if (bytes == 0) continue;  // (an empty tensor's data may be null)
      std::memcpy(dst, src + size_t(start[size_t(r * C + c)]) * width, bytes);
      dst += bytes;
    }
  }
  return out;
}

}  // namespace
}  // namespace dynemb

TORCH_LIBRARY_FRAGMENT(dynemb_idt, m) {
  m.def("route(Tensor ids, int[] sizes, int world) -> (Tensor send, Tensor position, Tensor counts)");
  m.def("transpose_blocks(Tensor x, Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(dynemb_idt, CPU, m) {
  m.impl("route", dynemb::route);
  m.impl("transpose_blocks", dynemb::transpose_blocks);
}
