// kv_copy.cu — gather blocks out of an engine's paged KV cache into kvstore's
// canonical staging layout, and scatter them back, for all layers in one launch.
//
// Canonical block (one staging slot, contiguous):
//     [num_layers, num_kv, block_tokens, num_heads, row_bytes]
// where a "row" is one head's head_dim elements of one token (K or V), which
// every supported engine layout stores contiguously. Everything else about an
// engine layout is described by byte strides (see kernels/layouts.py):
//     address(plane, page, token_in_page, head)
//         = planes[plane] + page * page_stride + token_in_page * token_stride
//           + head * head_stride
// with plane = layer * num_kv + kv. So one kernel serves vLLM NHD and HND,
// FlashInfer, vLLM's packed CPU cache, MLA latents and transformers tensors.
//
// Grid: blockIdx.x walks the (kvstore block, plane) units, each unit's staging
// region contiguous: one unit per CTA, or, with fewer CTAs than units (a copy
// capped to leave SMs to a forward running beside it), a grid-stride loop in x.
// blockIdx.y splits a unit's rows so that small requests still fill the GPU;
// threads stride over the unit's vectors (grid-stride loop in y).
// Staging may be device memory or mapped pinned host memory: the kernel only
// sees addresses. No shared memory and no __syncthreads: every thread is
// independent, which is what lets the host shim run it one thread at a time.
//
// This file must compile with NVRTC (no #include available), nvcc, and g++
// under tests/kernels/host_shim/cuda_host_shim.h.

typedef long long kv_i64;
typedef unsigned long long kv_u64;

// Vectors in flight per thread before the first store: more bytes outstanding
// per thread is what lets a copy kernel approach DRAM/PCIe bandwidth.
#define KV_UNROLL 4

template <typename V, bool kGather>
__device__ __forceinline__ void kv_copy_impl(
    const kv_u64* __restrict__ planes,    // [num_planes] engine base address per (layer, kv)
    const kv_i64* __restrict__ page_ids,  // [num_blocks * pages_per_block] engine pages
    const kv_i64* __restrict__ slot_ids,  // [num_blocks] staging slot of each block
    unsigned char* __restrict__ staging,  // staging base (device or mapped host address)
    int num_planes, int block_tokens, int page_size, int num_heads, int row_bytes,
    kv_i64 page_stride, kv_i64 token_stride, kv_i64 head_stride, kv_i64 slot_stride,
    int num_units) {
  // 64-bit: a capped grid's last step past num_units must not wrap around.
  for (kv_i64 unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const int block = (int)(unit / num_planes);
    const int plane = (int)(unit - (kv_i64)block * num_planes);
    const int vecs_per_row = row_bytes / (int)sizeof(V);
    const int vecs_per_token = vecs_per_row * num_heads;
    const int total = vecs_per_token * block_tokens;
    const int pages_per_block = block_tokens / page_size;

    unsigned char* engine = (unsigned char*)planes[plane];
    const kv_i64* pages = page_ids + (kv_i64)block * pages_per_block;
    // Staging order inside a plane is [token][head][vec]: vector i of the unit
    // lives at byte i * sizeof(V), so staging accesses are fully coalesced.
    unsigned char* stage = staging + slot_ids[block] * slot_stride +
                           (kv_i64)plane * block_tokens * num_heads * row_bytes;

    const int step = (int)(gridDim.y * blockDim.x) * KV_UNROLL;
    for (int base = (int)(blockIdx.y * blockDim.x) * KV_UNROLL + (int)threadIdx.x; base < total;
         base += step) {
      V buf[KV_UNROLL];
      kv_i64 engine_off[KV_UNROLL];
#pragma unroll
      for (int u = 0; u < KV_UNROLL; ++u) {
        const int i = base + u * (int)blockDim.x;
        if (i < total) {
          const int token = i / vecs_per_token;
          const int rest = i - token * vecs_per_token;
          const int head = rest / vecs_per_row;
          const int vec = rest - head * vecs_per_row;
          const int page = token / page_size;
          const int in_page = token - page * page_size;
          engine_off[u] = pages[page] * page_stride + (kv_i64)in_page * token_stride +
                          (kv_i64)head * head_stride + (kv_i64)vec * (kv_i64)sizeof(V);
          if (kGather) {
            buf[u] = *reinterpret_cast<const V*>(engine + engine_off[u]);
          } else {
            buf[u] = *reinterpret_cast<const V*>(stage + (kv_i64)i * (kv_i64)sizeof(V));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < KV_UNROLL; ++u) {
        const int i = base + u * (int)blockDim.x;
        if (i < total) {
          if (kGather) {
            *reinterpret_cast<V*>(stage + (kv_i64)i * (kv_i64)sizeof(V)) = buf[u];
          } else {
            *reinterpret_cast<V*>(engine + engine_off[u]) = buf[u];
          }
        }
      }
    }
  }
}

// One exported symbol per (direction, vector width): extern "C" keeps the names
// unmangled for cupy's RawModule.get_function and for the host-shim driver.
#define KV_COPY_ARGS                                                                       \
  const kv_u64 *__restrict__ planes, const kv_i64 *__restrict__ page_ids,                 \
      const kv_i64 *__restrict__ slot_ids, unsigned char *__restrict__ staging,            \
      int num_planes, int block_tokens, int page_size, int num_heads, int row_bytes,       \
      kv_i64 page_stride, kv_i64 token_stride, kv_i64 head_stride, kv_i64 slot_stride,     \
      int num_units
#define KV_COPY_PASS                                                                       \
  planes, page_ids, slot_ids, staging, num_planes, block_tokens, page_size, num_heads,     \
      row_bytes, page_stride, token_stride, head_stride, slot_stride, num_units
#define KV_COPY_KERNEL(name, vec_type, gather)                                             \
  extern "C" __global__ void name(KV_COPY_ARGS) {                                          \
    kv_copy_impl<vec_type, gather>(KV_COPY_PASS);                                          \
  }

KV_COPY_KERNEL(kv_gather_v16, uint4, true)
KV_COPY_KERNEL(kv_gather_v8, uint2, true)
KV_COPY_KERNEL(kv_gather_v4, unsigned int, true)
KV_COPY_KERNEL(kv_gather_v2, unsigned short, true)
KV_COPY_KERNEL(kv_gather_v1, unsigned char, true)
KV_COPY_KERNEL(kv_scatter_v16, uint4, false)
KV_COPY_KERNEL(kv_scatter_v8, uint2, false)
KV_COPY_KERNEL(kv_scatter_v4, unsigned int, false)
KV_COPY_KERNEL(kv_scatter_v2, unsigned short, false)
KV_COPY_KERNEL(kv_scatter_v1, unsigned char, false)
