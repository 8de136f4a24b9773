// driver.cpp — run one kernel launch from kernels/kv_copy.cu on the CPU.
//
// Built by tests/kernels/shim.py (build_shim) as
//     g++ -std=c++17 -fsanitize=address,undefined -include cuda_host_shim.h
//         -DKV_KERNEL_SOURCE='"<repo>/kernels/kv_copy.cu"' driver.cpp
// so the translation unit contains the very kernel source that NVRTC compiles.
//
// Usage: kvcopy_host JOB_FILE. The job file (written by tests/kernels/shim.py)
// names the kernel, the launch shape, the scalar arguments, and the raw byte
// files of every buffer. Each buffer is placed at the same address modulo 256
// as the tensor it came from, so alignment-dependent code paths behave as they
// would on the device; the bytes before it are poisoned for ASan. After the
// launch every buffer is written back to "<file>.out".
#include <sanitizer/asan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include KV_KERNEL_SOURCE

namespace {

using KvCopyFn = void (*)(const kv_u64*, const kv_i64*, const kv_i64*, unsigned char*, int, int,
                          int, int, int, kv_i64, kv_i64, kv_i64, kv_i64, int);

// Every kernel the .cu exports; tests check this list against the Python side.
const std::map<std::string, KvCopyFn> kKernels = {
    {"kv_gather_v16", kv_gather_v16},   {"kv_gather_v8", kv_gather_v8},
    {"kv_gather_v4", kv_gather_v4},     {"kv_gather_v2", kv_gather_v2},
    {"kv_gather_v1", kv_gather_v1},     {"kv_scatter_v16", kv_scatter_v16},
    {"kv_scatter_v8", kv_scatter_v8},   {"kv_scatter_v4", kv_scatter_v4},
    {"kv_scatter_v2", kv_scatter_v2},   {"kv_scatter_v1", kv_scatter_v1},
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "kvcopy_host: %s\n", msg.c_str());
  std::exit(2);
}

struct Buffer {
  std::string path;
  void* alloc = nullptr;
  unsigned char* data = nullptr;
  size_t size = 0;
};

std::vector<unsigned char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) die("cannot open " + path);
  return std::vector<unsigned char>((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const unsigned char* data, size_t size) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) die("cannot write " + path);
}

Buffer load_buffer(const std::string& path, size_t align_offset) {
  Buffer b;
  b.path = path;
  std::vector<unsigned char> bytes = read_file(path);
  b.size = bytes.size();
  // Exactly align_offset + size bytes, so ASan's redzone starts right after
  // the last byte of the tensor's storage.
  if (posix_memalign(&b.alloc, 256, align_offset + b.size + (b.size == 0 ? 1 : 0)) != 0)
    die("out of memory");
  b.data = static_cast<unsigned char*>(b.alloc) + align_offset;
  std::memcpy(b.data, bytes.data(), b.size);
  ASAN_POISON_MEMORY_REGION(b.alloc, align_offset);
  return b;
}

template <typename T>
T* exact_copy(const std::vector<T>& v) {
  // A heap array of exactly v.size() elements: reading past it is an ASan error.
  T* p = static_cast<T*>(std::malloc(sizeof(T) * (v.empty() ? 1 : v.size())));
  if (!p) die("out of memory");
  std::memcpy(p, v.data(), sizeof(T) * v.size());
  return p;
}

void expect(std::istream& in, const char* word) {
  std::string got;
  if (!(in >> got) || got != word) die(std::string("job file: expected '") + word + "'");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) die("usage: kvcopy_host JOB_FILE");
  std::ifstream job(argv[1]);
  if (!job) die(std::string("cannot open ") + argv[1]);

  std::string kernel_name, order_word;
  dim3 grid, block;
  int num_planes, block_tokens, page_size, num_heads, row_bytes, num_units;
  kv_i64 page_stride, token_stride, head_stride, slot_stride;
  expect(job, "kernel");
  job >> kernel_name;
  expect(job, "grid");
  job >> grid.x >> grid.y >> grid.z;
  expect(job, "block");
  job >> block.x >> block.y >> block.z;
  expect(job, "order");
  job >> order_word;
  expect(job, "scalars");
  job >> num_planes >> block_tokens >> page_size >> num_heads >> row_bytes >> page_stride >>
      token_stride >> head_stride >> slot_stride >> num_units;

  size_t n_buffers;
  expect(job, "buffers");
  job >> n_buffers;
  std::vector<Buffer> buffers;
  for (size_t i = 0; i < n_buffers; ++i) {
    std::string path;
    size_t align_offset;
    job >> path >> align_offset;
    buffers.push_back(load_buffer(path, align_offset));
  }

  size_t n_planes;
  expect(job, "planes");
  job >> n_planes;
  std::vector<kv_u64> planes;
  for (size_t i = 0; i < n_planes; ++i) {
    size_t buf, offset;
    job >> buf >> offset;
    if (buf >= buffers.size() || offset > buffers[buf].size) die("plane outside its buffer");
    planes.push_back(reinterpret_cast<kv_u64>(buffers[buf].data + offset));
  }

  size_t n_pages, n_slots;
  std::string ids_path;
  expect(job, "ids");
  job >> ids_path >> n_pages >> n_slots;
  std::vector<unsigned char> id_bytes = read_file(ids_path);
  if (id_bytes.size() != sizeof(kv_i64) * (n_pages + n_slots)) die("ids file has wrong size");
  std::vector<kv_i64> page_ids(n_pages), slot_ids(n_slots);
  std::memcpy(page_ids.data(), id_bytes.data(), sizeof(kv_i64) * n_pages);
  std::memcpy(slot_ids.data(), id_bytes.data() + sizeof(kv_i64) * n_pages,
              sizeof(kv_i64) * n_slots);

  size_t staging_buf, staging_offset;
  expect(job, "staging");
  job >> staging_buf >> staging_offset;
  if (!job) die("job file truncated");
  if (staging_buf >= buffers.size()) die("staging buffer index out of range");

  auto it = kKernels.find(kernel_name);
  if (it == kKernels.end()) die("unknown kernel " + kernel_name);
  ShimOrder order = order_word == "reverse" ? ShimOrder::kReverse : ShimOrder::kForward;

  kv_u64* d_planes = exact_copy(planes);
  kv_i64* d_pages = exact_copy(page_ids);
  kv_i64* d_slots = exact_copy(slot_ids);
  shim_launch(grid, block, order, it->second, d_planes, d_pages, d_slots,
              buffers[staging_buf].data + staging_offset, num_planes, block_tokens, page_size,
              num_heads, row_bytes, page_stride, token_stride, head_stride, slot_stride,
              num_units);

  for (const Buffer& b : buffers) write_file(b.path + ".out", b.data, b.size);
  std::free(d_planes);
  std::free(d_pages);
  std::free(d_slots);
  for (Buffer& b : buffers) {
    ASAN_UNPOISON_MEMORY_REGION(b.alloc, static_cast<size_t>(b.data - static_cast<unsigned char*>(b.alloc)));
    std::free(b.alloc);
  }
  return 0;
}
