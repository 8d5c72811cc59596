// ID tensors as the kernel's units (slot_map.cpp, route.cpp) read them.

#pragma once

#include <ATen/ATen.h>

namespace dynemb {

// ids (any shape) as one contiguous CPU int64 row.
inline at::Tensor flat_ids(const at::Tensor& ids) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "ids must be a CPU int64 tensor");
  return ids.contiguous().view({-1});
}

// Checks that `sizes` cut n elements (`unit` names them in the error) into blocks: each size
// >= 0, adding up to n. `op` names the caller.
inline void check_blocks(at::IntArrayRef sizes, int64_t n, const char* op, const char* unit) {
  int64_t total = 0;
  for (const int64_t s : sizes) {
    TORCH_CHECK(s >= 0, op, ": a block's size is negative");
    total += s;
  }
  TORCH_CHECK(total == n, op, ": the blocks' sizes add up to ", total, ", not to the ", n, " ", unit);
}

}  // namespace dynemb
