// cuda_host_shim.h — just enough CUDA C++ for a kernel source to compile as
// plain C++ and run on the CPU, one thread at a time.
//
// Why: with no GPU, the only way to test *the code that would run on a GPU* is to
// compile that same source for the host. The kernels in kernels/*.cu use no
// shared memory and no barriers (each thread is independent), so executing
// every (block, thread) sequentially is a faithful model of their semantics.
// A kernel that reaches for __syncthreads or __shared__ fails to compile here
// on purpose: sequential execution would not be a valid model for it.
#pragma once

#include <cstddef>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// __restrict__ is a GNU/Clang extension with the same meaning as in CUDA.

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

// CUDA's vector types carry their natural alignment; UBSan's alignment check
// (-fsanitize=alignment) then flags any misaligned vector access the host
// selection logic would have allowed on the GPU.
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(8) int2 {
  int x, y;
};

// The built-in index variables. The launcher below sets them before each
// simulated thread runs.
inline uint3 blockIdx;
inline uint3 threadIdx;
inline dim3 blockDim;
inline dim3 gridDim;

// Thread execution order: forward, or reversed to shake out any hidden
// dependence of one thread's result on another's (there must be none).
enum class ShimOrder { kForward, kReverse };

template <typename Kernel, typename... Args>
void shim_launch(dim3 grid, dim3 block, ShimOrder order, Kernel kernel, Args... args) {
  gridDim = grid;
  blockDim = block;
  const std::uint64_t blocks = std::uint64_t(grid.x) * grid.y * grid.z;
  const std::uint64_t threads = std::uint64_t(block.x) * block.y * block.z;
  for (std::uint64_t n = 0; n < blocks * threads; ++n) {
    const std::uint64_t k = order == ShimOrder::kForward ? n : blocks * threads - 1 - n;
    std::uint64_t b = k / threads, t = k % threads;
    blockIdx = {unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / grid.x / grid.y)};
    threadIdx = {unsigned(t % block.x), unsigned(t / block.x % block.y),
                 unsigned(t / block.x / block.y)};
    kernel(args...);
  }
}
