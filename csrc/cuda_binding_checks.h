// The device check every CUDA binding (csrc/*_cuda.cpp) makes before it launches: its kernels
// take raw pointers, so a tensor on the host or on another GPU would be an illegal access there,
// and each tensor of a call must be on the GPU of the call's anchor (the table, the filter, the
// storage). ATen only (no c10/cuda), so the bindings' emulated CPU build includes it as is.
#pragma once
#include <ATen/ATen.h>

#include <initializer_list>
#include <utility>

namespace torchrec_ext {

// Each (name, tensor) must be on `anchor`'s device (a null tensor: an optional argument not
// given); `like` names the anchor in the message.
inline void check_on_anchor_device(
    const char* op, const at::Tensor& anchor, const char* like,
    std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor == nullptr || tensor->device() == anchor.device(), op, ": ", name,
                " must be on ", anchor.device(), " like ", like, ", got ", tensor->device());
  }
}

}  // namespace torchrec_ext
