// Stand-ins for the c10/cuda pieces the CUDA binding uses, for its emulated CPU build.
#pragma once
#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
namespace c10::cuda {
struct CUDAGuard { explicit CUDAGuard(c10::Device) {} };
struct EmuStream { cudaStream_t stream() const { return nullptr; } };
inline EmuStream getCurrentCUDAStream() { return {}; }
}  // namespace c10::cuda
#define C10_CUDA_CHECK(EXPR) TORCH_CHECK((EXPR) == cudaSuccess, "emulated CUDA error")
