// An ID tensor as the kernel's units (slot_map.cpp, route.cpp) read it.

#pragma once

#include <ATen/ATen.h>

namespace dynemb {

// ids (any shape) as one contiguous CPU int64 row.
inline at::Tensor flat_ids(const at::Tensor& ids) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "ids must be a CPU int64 tensor");
  return ids.contiguous().view({-1});
}

}  // namespace dynemb
