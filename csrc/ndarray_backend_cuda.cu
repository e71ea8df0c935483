// needle's CUDA backend: flat float32 device buffers and the primitives NDArray composes.
//
// Same module interface as the numpy and cpu backends. Every CUDA call and kernel launch is
// checked; failures surface as Python exceptions (RuntimeError), bad arguments as ValueError or
// IndexError, before anything touches device memory.
#include <cuda_runtime.h>
#include <mma.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "sgemm.cuh"        // float32 SGEMM kernels (namespace sgemm)
#include "tf32_hopper.cuh"  // TF32 wgmma GEMM for Hopper (namespace tf32_hopper)

namespace py = pybind11;

namespace needle {
namespace cuda {

constexpr int kBlockSize = 256;
constexpr int kMaxDims = 12;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

#define CUDA_CHECK(expr) check((expr), #expr)
#define CHECK_LAUNCH(name) check(cudaGetLastError(), name)

int multiprocessor_count() {
  static int count = 0;
  if (count == 0) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  }
  return count;
}

// Enough blocks of kBlockSize threads for `work` items in a grid-stride loop, capped so that
// each thread handles several items on large inputs.
unsigned grid_for(size_t work) {
  size_t blocks = (work + kBlockSize - 1) / kBlockSize;
  size_t cap = static_cast<size_t>(multiprocessor_count()) * 32;
  return static_cast<unsigned>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// ---------------------------------------------------------------------------------------------
// Device memory. cudaMalloc/cudaFree are slow and cudaFree synchronises the device, so freed
// buffers are kept per (rounded) size and handed out again; all work runs on the default
// stream, so reuse is ordered after every kernel that used the buffer. On an allocation
// failure the cache is released and the allocation retried once.

// Raised to Python as a MemoryError (DeviceMemoryError, its subclass), as the cpu and numpy
// modules raise theirs: a RuntimeError escaped code that catches running out of memory.
struct DeviceMemoryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class DevicePool {
 public:
  static size_t rounded(size_t bytes) { return (bytes + 511) / 512 * 512; }

  float* allocate(size_t bytes) {
    std::vector<float*>& cached = free_[bytes];
    if (!cached.empty()) {
      float* ptr = cached.back();
      cached.pop_back();
      return ptr;
    }
    void* ptr = nullptr;
    cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_cached();
      err = cudaMalloc(&ptr, bytes);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      const std::string message = "cannot allocate " + std::to_string(bytes) +
                                  " bytes on the GPU: " + cudaGetErrorString(err);
      if (err == cudaErrorMemoryAllocation) throw DeviceMemoryError(message);
      throw std::runtime_error(message);
    }
    return static_cast<float*>(ptr);
  }

  void release(float* ptr, size_t bytes) { free_[bytes].push_back(ptr); }

 private:
  void release_cached() {
    for (auto& entry : free_) {
      for (float* ptr : entry.second) cudaFree(ptr);
      entry.second.clear();
    }
  }

  std::unordered_map<size_t, std::vector<float*>> free_;
};

// Never destroyed: freeing at interpreter exit would race the CUDA runtime's own teardown.
DevicePool& pool() {
  static DevicePool* instance = new DevicePool();
  return *instance;
}

int64_t checked_size(int64_t size) {
  if (size < 0) throw py::value_error("Array size must be >= 0, got " + std::to_string(size));
  if (size > (int64_t{1} << 40)) {
    throw py::value_error("Array size " + std::to_string(size) + " exceeds any GPU's memory");
  }
  return size;
}

struct CudaArray {
  explicit CudaArray(int64_t elements)
      : size(static_cast<size_t>(checked_size(elements))),
        bytes(DevicePool::rounded(size * sizeof(float))) {
    ptr = size > 0 ? pool().allocate(bytes) : nullptr;
  }
  ~CudaArray() {
    if (ptr != nullptr) pool().release(ptr, bytes);
  }
  CudaArray(const CudaArray&) = delete;
  CudaArray& operator=(const CudaArray&) = delete;

  size_t ptr_as_int() const { return reinterpret_cast<size_t>(ptr); }

  float* ptr;
  size_t size;
  size_t bytes;
};

// ---------------------------------------------------------------------------------------------
// Strided views.

struct View {
  int ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t offset;
};

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (dim < 0) throw py::value_error("shape entries must be >= 0, got " + std::to_string(dim));
    if (__builtin_mul_overflow(count, dim, &count)) throw py::value_error("shape overflows int64");
  }
  return count;
}

// Validates a strided view of a buffer of `buffer_size` elements and packs it for a kernel.
View make_view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
               int64_t offset, size_t buffer_size, const char* what) {
  if (shape.size() != strides.size()) {
    throw py::value_error(std::string(what) + ": shape has " + std::to_string(shape.size()) +
                          " dims but strides has " + std::to_string(strides.size()));
  }
  if (shape.size() > static_cast<size_t>(kMaxDims)) {
    throw py::value_error(std::string(what) + ": views have at most " +
                          std::to_string(kMaxDims) + " dims, got " +
                          std::to_string(shape.size()));
  }
  View view{};
  view.ndim = static_cast<int>(shape.size());
  view.offset = offset;
  int64_t lowest = offset, highest = offset;
  bool empty = element_count(shape) == 0;
  for (int d = 0; d < view.ndim; ++d) {
    view.shape[d] = shape[d];
    view.strides[d] = strides[d];
    int64_t reach;
    if (!empty && (__builtin_mul_overflow(shape[d] - 1, strides[d], &reach) ||
                   __builtin_add_overflow(reach > 0 ? highest : lowest, reach,
                                          reach > 0 ? &highest : &lowest))) {
      throw py::index_error(std::string(what) + ": strides overflow int64");
    }
  }
  if (!empty && (lowest < 0 || highest >= static_cast<int64_t>(buffer_size))) {
    throw py::index_error(std::string(what) + ": view reaches elements [" +
                          std::to_string(lowest) + ", " + std::to_string(highest) +
                          "] outside the buffer of " + std::to_string(buffer_size) + " elements");
  }
  return view;
}

void view_size_error(const char* what, int64_t view, const char* other, int64_t size) {
  throw py::value_error(std::string(what) + ": view has " + std::to_string(view) +
                        " elements but " + other + std::to_string(size));
}

// Index is uint32_t when the view has under 2**31 elements: 64-bit division is several times
// slower and dominates these kernels.
template <typename Index>
__device__ __forceinline__ int64_t view_index(Index linear, const View& view) {
  int64_t index = view.offset;
  for (int d = view.ndim - 1; d >= 0; --d) {
    Index dim = static_cast<Index>(view.shape[d]);
    index += static_cast<int64_t>(linear % dim) * view.strides[d];
    linear /= dim;
  }
  return index;
}

template <typename Index>
__global__ void compact_kernel(const float* a, float* out, Index n, View view) {
  for (Index i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = a[view_index(i, view)];
  }
}

template <typename Index>
__global__ void ewise_setitem_kernel(const float* a, float* out, Index n, View view) {
  for (Index i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[view_index(i, view)] = a[i];
  }
}

template <typename Index>
__global__ void scalar_setitem_kernel(float val, float* out, Index n, View view) {
  for (Index i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[view_index(i, view)] = val;
  }
}

bool fits_32_bits(size_t n) { return n < (size_t{1} << 31); }  // i + grid stride cannot wrap

void launch_compact(const float* a, float* out, size_t n, const View& view) {
  if (fits_32_bits(n)) {
    compact_kernel<uint32_t><<<grid_for(n), kBlockSize>>>(a, out, static_cast<uint32_t>(n), view);
  } else {
    compact_kernel<size_t><<<grid_for(n), kBlockSize>>>(a, out, n, view);
  }
  CHECK_LAUNCH("compact");
}

__global__ void fill_kernel(float* out, float val, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = val;
  }
}

void fill(CudaArray& out, float val) {
  if (out.size == 0) return;
  fill_kernel<<<grid_for(out.size), kBlockSize>>>(out.ptr, val, out.size);
  CHECK_LAUNCH("fill");
}

// The data of src, copied first when src is also the buffer about to be written (x[view] = x,
// or a view of x compacted into x): the kernels' threads would otherwise read elements that
// others have already overwritten. The same semantics as the cpu and numpy modules.
struct Source {
  std::unique_ptr<CudaArray> copy;
  const float* data;
};

Source read_before_writing(const CudaArray& src, const CudaArray& dst) {
  if (src.ptr != dst.ptr) return {nullptr, src.ptr};
  auto copy = std::make_unique<CudaArray>(static_cast<int64_t>(src.size));
  CUDA_CHECK(cudaMemcpy(copy->ptr, src.ptr, src.size * sizeof(float), cudaMemcpyDeviceToDevice));
  const float* data = copy->ptr;
  return {std::move(copy), data};
}

void compact(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
             const std::vector<int64_t>& strides, int64_t offset) {
  View view = make_view(shape, strides, offset, a.size, "compact");
  size_t n = static_cast<size_t>(element_count(shape));
  if (n != out.size) {
    view_size_error("compact", static_cast<int64_t>(n), "out has ", static_cast<int64_t>(out.size));
  }
  if (n == 0) return;
  const Source src = read_before_writing(a, out);
  launch_compact(src.data, out.ptr, n, view);
}

void ewise_setitem(const CudaArray& a, CudaArray& out, const std::vector<int64_t>& shape,
                   const std::vector<int64_t>& strides, int64_t offset) {
  View view = make_view(shape, strides, offset, out.size, "ewise_setitem");
  size_t n = static_cast<size_t>(element_count(shape));
  if (n != a.size) {
    view_size_error("ewise_setitem", static_cast<int64_t>(n), "the source has ",
                    static_cast<int64_t>(a.size));
  }
  if (n == 0) return;
  const Source src = read_before_writing(a, out);
  if (fits_32_bits(n)) {
    ewise_setitem_kernel<uint32_t>
        <<<grid_for(n), kBlockSize>>>(src.data, out.ptr, static_cast<uint32_t>(n), view);
  } else {
    ewise_setitem_kernel<size_t><<<grid_for(n), kBlockSize>>>(src.data, out.ptr, n, view);
  }
  CHECK_LAUNCH("ewise_setitem");
}

void scalar_setitem(int64_t size, float val, CudaArray& out, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, int64_t offset) {
  View view = make_view(shape, strides, offset, out.size, "scalar_setitem");
  int64_t n = element_count(shape);
  if (n != size) view_size_error("scalar_setitem", n, "size is ", size);
  if (n == 0) return;
  if (fits_32_bits(n)) {
    scalar_setitem_kernel<uint32_t>
        <<<grid_for(n), kBlockSize>>>(val, out.ptr, static_cast<uint32_t>(n), view);
  } else {
    scalar_setitem_kernel<size_t><<<grid_for(n), kBlockSize>>>(val, out.ptr, n, view);
  }
  CHECK_LAUNCH("scalar_setitem");
}

// ---------------------------------------------------------------------------------------------
// Host <-> device.

void from_numpy(py::array a, CudaArray& out) {
  // equal, not is: a float32 dtype need not be numpy's cached instance (unpickled arrays)
  if (!a.dtype().equal(py::dtype::of<float>())) {
    throw py::value_error("from_numpy: expected a float32 array, got dtype " +
                          std::string(py::str(a.dtype())));
  }
  auto contiguous = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
  if (static_cast<size_t>(contiguous.size()) != out.size) {
    throw py::value_error("from_numpy: array has " + std::to_string(contiguous.size()) +
                          " elements but out has " + std::to_string(out.size));
  }
  if (out.size == 0) return;
  CUDA_CHECK(cudaMemcpy(out.ptr, contiguous.data(), out.size * sizeof(float),
                        cudaMemcpyHostToDevice));
}

py::array_t<float> to_numpy(const CudaArray& a, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides, int64_t offset) {
  View view = make_view(shape, strides, offset, a.size, "to_numpy");
  size_t n = static_cast<size_t>(element_count(shape));
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  py::array_t<float> result(dims);
  if (n == 0) return result;
  bool contiguous = true;
  int64_t expected = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) contiguous = false;
    expected *= shape[d];
  }
  if (contiguous) {
    CUDA_CHECK(cudaMemcpy(result.mutable_data(), a.ptr + offset, n * sizeof(float),
                          cudaMemcpyDeviceToHost));
  } else {
    CudaArray staging(n);
    launch_compact(a.ptr, staging.ptr, n, view);
    CUDA_CHECK(cudaMemcpy(result.mutable_data(), staging.ptr, n * sizeof(float),
                          cudaMemcpyDeviceToHost));
  }
  return result;
}

// ---------------------------------------------------------------------------------------------
// Elementwise ops: one kernel template per arity, 16-byte loads for the bulk (buffers come from
// cudaMalloc, 256-byte aligned) and a scalar tail.

__device__ __forceinline__ float nan_max(float x, float y) {
  return (x > y || isnan(x)) ? x : y;  // NaN in either operand propagates, as in numpy
}

struct Add { __device__ float operator()(float x, float y) const { return x + y; } };
struct Mul { __device__ float operator()(float x, float y) const { return x * y; } };
struct Div { __device__ float operator()(float x, float y) const { return x / y; } };
struct Pow { __device__ float operator()(float x, float y) const { return powf(x, y); } };
struct Max { __device__ float operator()(float x, float y) const { return nan_max(x, y); } };
struct Eq { __device__ float operator()(float x, float y) const { return x == y ? 1.0f : 0.0f; } };
struct Ge { __device__ float operator()(float x, float y) const { return x >= y ? 1.0f : 0.0f; } };
struct Log { __device__ float operator()(float x) const { return logf(x); } };
struct Exp { __device__ float operator()(float x) const { return expf(x); } };
struct Tanh { __device__ float operator()(float x) const { return tanhf(x); } };
struct Sqrt { __device__ float operator()(float x) const { return sqrtf(x); } };

template <typename Op>
struct WithScalar {
  Op op;
  float val;
  __device__ float operator()(float x) const { return op(x, val); }
};

template <typename Op>
__global__ void binary_kernel(const float* __restrict__ a, const float* __restrict__ b,
                              float* __restrict__ out, size_t n, Op op) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t first = blockIdx.x * blockDim.x + threadIdx.x;
  size_t n4 = n / 4;
  for (size_t i = first; i < n4; i += stride) {
    float4 x = reinterpret_cast<const float4*>(a)[i];
    float4 y = reinterpret_cast<const float4*>(b)[i];
    reinterpret_cast<float4*>(out)[i] =
        make_float4(op(x.x, y.x), op(x.y, y.y), op(x.z, y.z), op(x.w, y.w));
  }
  for (size_t i = n4 * 4 + first; i < n; i += stride) out[i] = op(a[i], b[i]);
}

template <typename Op>
__global__ void unary_kernel(const float* __restrict__ a, float* __restrict__ out, size_t n,
                             Op op) {
  size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t first = blockIdx.x * blockDim.x + threadIdx.x;
  size_t n4 = n / 4;
  for (size_t i = first; i < n4; i += stride) {
    float4 x = reinterpret_cast<const float4*>(a)[i];
    reinterpret_cast<float4*>(out)[i] = make_float4(op(x.x), op(x.y), op(x.z), op(x.w));
  }
  for (size_t i = n4 * 4 + first; i < n; i += stride) out[i] = op(a[i]);
}

void check_same_size(const CudaArray& a, const CudaArray& out, const char* what) {
  if (a.size != out.size) {
    throw py::value_error(std::string(what) + ": input has " + std::to_string(a.size) +
                          " elements but out has " + std::to_string(out.size));
  }
}

template <typename Op>
void ewise(const CudaArray& a, const CudaArray& b, CudaArray& out) {
  check_same_size(a, out, "elementwise op");
  check_same_size(b, out, "elementwise op");
  if (out.size == 0) return;
  binary_kernel<<<grid_for(out.size / 4 + 1), kBlockSize>>>(a.ptr, b.ptr, out.ptr, out.size,
                                                            Op());
  CHECK_LAUNCH("elementwise op");
}

template <typename Op>
void unary(const CudaArray& a, CudaArray& out, Op op) {
  check_same_size(a, out, "elementwise op");
  if (out.size == 0) return;
  unary_kernel<<<grid_for(out.size / 4 + 1), kBlockSize>>>(a.ptr, out.ptr, out.size, op);
  CHECK_LAUNCH("elementwise op");
}

template <typename Op>
void scalar(const CudaArray& a, float val, CudaArray& out) {
  unary(a, out, WithScalar<Op>{Op(), val});
}

template <typename Op>
void unary_op(const CudaArray& a, CudaArray& out) {
  unary(a, out, Op());
}

// ---------------------------------------------------------------------------------------------
// Reductions over groups of `reduce_size` consecutive elements. Short groups: a thread per
// group; medium: a warp per group; long: a block per group.

// Sums accumulate in double (cheap here: reductions are bound by memory), like the cpu module.
struct SumReducer {
  using Acc = double;
  static __device__ Acc identity() { return 0.0; }
  __device__ Acc operator()(Acc x, Acc y) const { return x + y; }
};
struct MaxReducer {
  using Acc = float;
  static __device__ Acc identity() { return -INFINITY; }
  __device__ Acc operator()(Acc x, Acc y) const { return nan_max(x, y); }
};

template <typename R>
__global__ void reduce_thread_kernel(const float* a, float* out, size_t groups, size_t size) {
  R r;
  for (size_t g = blockIdx.x * blockDim.x + threadIdx.x; g < groups;
       g += gridDim.x * blockDim.x) {
    typename R::Acc acc = R::identity();
    const float* group = a + g * size;
    for (size_t k = 0; k < size; ++k) acc = r(acc, group[k]);
    out[g] = static_cast<float>(acc);
  }
}

template <typename R>
__device__ typename R::Acc warp_reduce(typename R::Acc acc) {
  R r;
  for (int shift = 16; shift > 0; shift /= 2) {
    acc = r(acc, __shfl_xor_sync(0xffffffffu, acc, shift));
  }
  return acc;
}

template <typename R>
__global__ void reduce_warp_kernel(const float* a, float* out, size_t groups, size_t size) {
  R r;
  const int lane = threadIdx.x % 32;
  const size_t warps = static_cast<size_t>(gridDim.x) * blockDim.x / 32;
  for (size_t g = (blockIdx.x * blockDim.x + threadIdx.x) / 32; g < groups; g += warps) {
    typename R::Acc acc = R::identity();
    const float* group = a + g * size;
    for (size_t k = lane; k < size; k += 32) acc = r(acc, group[k]);
    acc = warp_reduce<R>(acc);
    if (lane == 0) out[g] = static_cast<float>(acc);
  }
}

template <typename R>
__global__ void reduce_block_kernel(const float* a, float* out, size_t size) {
  R r;
  __shared__ typename R::Acc partial[kBlockSize / 32];
  const float* group = a + blockIdx.x * size;
  typename R::Acc acc = R::identity();
  for (size_t k = threadIdx.x; k < size; k += blockDim.x) acc = r(acc, group[k]);
  acc = warp_reduce<R>(acc);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < kBlockSize / 32 ? partial[threadIdx.x] : R::identity();
    acc = warp_reduce<R>(acc);
    if (threadIdx.x == 0) out[blockIdx.x] = static_cast<float>(acc);
  }
}

template <typename R>
void reduce(const CudaArray& a, CudaArray& out, int64_t reduce_size_arg, const char* name) {
  if (reduce_size_arg < 1) {
    throw py::value_error(std::string(name) + ": reduce_size must be >= 1, got " +
                          std::to_string(reduce_size_arg));
  }
  size_t reduce_size = static_cast<size_t>(reduce_size_arg), expected;
  if (__builtin_mul_overflow(out.size, reduce_size, &expected) || expected != a.size) {
    throw py::value_error(std::string(name) + ": input has " + std::to_string(a.size) +
                          " elements, expected out.size * reduce_size = " +
                          std::to_string(out.size) + " * " + std::to_string(reduce_size));
  }
  if (out.size == 0) return;
  if (reduce_size <= 16) {
    reduce_thread_kernel<R><<<grid_for(out.size), kBlockSize>>>(a.ptr, out.ptr, out.size,
                                                                reduce_size);
  } else if (reduce_size <= 4096 || out.size > (1u << 30)) {
    reduce_warp_kernel<R><<<grid_for(out.size * 32), kBlockSize>>>(a.ptr, out.ptr, out.size,
                                                                   reduce_size);
  } else {
    reduce_block_kernel<R><<<static_cast<unsigned>(out.size), kBlockSize>>>(a.ptr, out.ptr,
                                                                            reduce_size);
  }
  CHECK_LAUNCH(name);
}

void reduce_sum(const CudaArray& a, CudaArray& out, int64_t reduce_size) {
  reduce<SumReducer>(a, out, reduce_size, "reduce_sum");
}

void reduce_max(const CudaArray& a, CudaArray& out, int64_t reduce_size) {
  reduce<MaxReducer>(a, out, reduce_size, "reduce_max");
}

// cp.async (sm_80+): global -> shared copies that bypass registers; invalid ones zero-fill.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem, bool valid) {
  unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async4(float* smem, const float* gmem, bool valid) {
  unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif  // sm_80+

// ---------------------------------------------------------------------------------------------
// TF32 tensor-core GEMM (float32 in and out, operands rounded to TF32, float32 accumulation),
// only on explicit request. On an H100/H200 with a build for sm_90a (CMake's default
// architectures include 90a) the TMA/wgmma kernel of tf32_hopper.cuh runs, for any shape of
// more than one row (one row: row_vector_matmul); elsewhere this portable one (sm_80+). K
// slices of BK are brought into shared memory by cp.async in a STAGES-deep pipeline
// (out-of-range elements zero-filled); each warp holds a WM x WN tile of WMMA m16n16k8
// accumulators; the block's C tile is staged through shared memory so that the global stores
// are coalesced and bounds-checked.

namespace tf32 {

namespace wmma = nvcuda::wmma;

template <int BM_, int BN_, int BK_, int STAGES_, int WM_, int WN_>
struct Config {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_, WM = WM_, WN = WN_;
  static constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  static constexpr int kALd = BK + 4, kBLd = BN + 4, kCLd = BN + 4;  // padded rows
  static constexpr int kAStage = BM * kALd, kBStage = BK * kBLd;
  static constexpr int kPipelineFloats = STAGES * (kAStage + kBStage);
  static constexpr int kEpilogueFloats = BM * kCLd;
  static constexpr size_t kSharedBytes =
      sizeof(float) * (kPipelineFloats > kEpilogueFloats ? kPipelineFloats : kEpilogueFloats);
};
using Tile = Config<128, 128, 32, 3, 64, 64>;  // the best of five tiles measured on an H100

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// Copies a ROWS x COLS tile at (row0, col0) of a row-major matrix into shared memory, zero
// filling what lies outside the matrix.
template <int ROWS, int COLS, int THREADS, bool VEC>
__device__ __forceinline__ void load_tile(float* smem, int ld_smem, const float* m, int rows,
                                          int cols, int ld, int row0, int col0) {
  if constexpr (VEC) {
    static_assert(ROWS * COLS / 4 % THREADS == 0, "tile must split evenly over threads");
#pragma unroll
    for (int i = 0; i < ROWS * COLS / 4 / THREADS; ++i) {
      int idx = threadIdx.x + i * THREADS;
      int r = idx / (COLS / 4), c = (idx % (COLS / 4)) * 4;
      bool valid = row0 + r < rows && col0 + c < cols;
      const float* src = valid ? m + static_cast<size_t>(row0 + r) * ld + col0 + c : m;
      cp_async16(smem + r * ld_smem + c, src, valid);
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
      int r = idx / COLS, c = idx % COLS;
      bool valid = row0 + r < rows && col0 + c < cols;
      const float* src = valid ? m + static_cast<size_t>(row0 + r) * ld + col0 + c : m;
      cp_async4(smem + r * ld_smem + c, src, valid);
    }
  }
}

#endif  // sm_80+

template <typename T, bool VEC>
__global__ void __launch_bounds__(T::kThreads)
    tf32_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // TF32 tensor cores and cp.async need sm_80; launch() refuses older devices
#else
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = T::STAGES, WM = T::WM, WN = T::WN;
  extern __shared__ __align__(128) float smem[];
  float* As = smem;
  float* Bs = smem + STAGES * T::kAStage;

  const int block_m = blockIdx.y * BM, block_n = blockIdx.x * BN;
  const int warp = threadIdx.x / 32;
  const int warp_m = (warp / (BN / WN)) * WM, warp_n = (warp % (BN / WN)) * WN;

  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[WM / 16][WN / 16];
#pragma unroll
  for (int i = 0; i < WM / 16; ++i)
#pragma unroll
    for (int j = 0; j < WN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const int tiles = (K + BK - 1) / BK;
  auto issue = [&](int t) {
    if (t < tiles) {
      int s = t % STAGES;
      load_tile<BM, BK, T::kThreads, VEC>(As + s * T::kAStage, T::kALd, A, M, K, K, block_m,
                                          t * BK);
      load_tile<BK, BN, T::kThreads, VEC>(Bs + s * T::kBStage, T::kBLd, B, K, N, N, t * BK,
                                          block_n);
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  };

  for (int t = 0; t < STAGES - 1; ++t) issue(t);
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // slice t has landed for every thread; slice t-1's stage is free again
    issue(t + STAGES - 1);
    const float* a_tile = As + (t % STAGES) * T::kAStage;
    const float* b_tile = Bs + (t % STAGES) * T::kBStage;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>
          a[WM / 16];
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>
          b[WN / 16];
#pragma unroll
      for (int i = 0; i < WM / 16; ++i) {
        wmma::load_matrix_sync(a[i], a_tile + (warp_m + i * 16) * T::kALd + kk, T::kALd);
#pragma unroll
        for (int e = 0; e < a[i].num_elements; ++e) a[i].x[e] = wmma::__float_to_tf32(a[i].x[e]);
      }
#pragma unroll
      for (int j = 0; j < WN / 16; ++j) {
        wmma::load_matrix_sync(b[j], b_tile + kk * T::kBLd + warp_n + j * 16, T::kBLd);
#pragma unroll
        for (int e = 0; e < b[j].num_elements; ++e) b[j].x[e] = wmma::__float_to_tf32(b[j].x[e]);
      }
#pragma unroll
      for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 16; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory becomes the C staging tile

  float* Cs = smem;
#pragma unroll
  for (int i = 0; i < WM / 16; ++i)
#pragma unroll
    for (int j = 0; j < WN / 16; ++j)
      wmma::store_matrix_sync(Cs + (warp_m + i * 16) * T::kCLd + warp_n + j * 16, acc[i][j],
                              T::kCLd, wmma::mem_row_major);
  __syncthreads();
  for (int idx = threadIdx.x; idx < BM * BN / 4; idx += T::kThreads) {
    int r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
    int row = block_m + r, col = block_n + c;
    if (row >= M) continue;
    const float* v = Cs + r * T::kCLd + c;
    float* dst = C + static_cast<size_t>(row) * N + col;
    if constexpr (VEC) {
      if (col < N) *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(v);
    } else {
      for (int j = 0; j < 4; ++j)
        if (col + j < N) dst[j] = v[j];
    }
  }
#endif
}

template <bool VEC>
void launch_variant(const float* A, const float* B, float* C, int M, int N, int K) {
  static bool configured = false;
  if (!configured) {
    CUDA_CHECK(cudaFuncSetAttribute(tf32_kernel<Tile, VEC>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(Tile::kSharedBytes)));
    configured = true;
  }
  dim3 grid((N + Tile::BN - 1) / Tile::BN, (M + Tile::BM - 1) / Tile::BM);
  tf32_kernel<Tile, VEC><<<grid, Tile::kThreads, Tile::kSharedBytes>>>(A, B, C, M, N, K);
  CHECK_LAUNCH("matmul_tf32");
}

// Hopper (sm_90a) path: csrc/tf32_hopper.cuh (B transposed once into a scratch buffer, then a
// warp-specialised TMA + wgmma kernel with both operands in shared memory).
namespace hopper {

__global__ void probe_kernel(int* has_sm90a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has_sm90a = 1;
#else
  *has_sm90a = 0;
#endif
}

// Whether this build holds sm_90a code that runs on the current device (compute capability 9.0
// and a build for the `90a` architecture).
bool available(int major, int minor) {
  static int cached = -1;
  if (cached < 0) {
    cached = 0;
    if (major == 9 && minor == 0) {
      int* flag = nullptr;
      CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
      probe_kernel<<<1, 1>>>(flag);
      cudaError_t err = cudaGetLastError();
      if (err == cudaSuccess) err = cudaMemcpy(&cached, flag, sizeof(int), cudaMemcpyDeviceToHost);
      cudaFree(flag);
      CUDA_CHECK(err);
    }
  }
  return cached == 1;
}

using Large = tf32_hopper::Config<256, 4, true>;
using Small = tf32_hopper::Config<128, 6, true>;

int64_t waves(int64_t tiles, int multiprocessors) {
  return (tiles + multiprocessors - 1) / multiprocessors;
}

// Any M, N, K > 0. B^T goes to scratch; so does A where its rows are not whole 16 bytes (TMA).
// The 128 x 256 tiles unless the 128 x 128 ones need under 5/3 as many waves (per flop they ran
// at 0.75-0.94 of the large tiles' rate on an H100, bench/RESULTS.md): 1024^3 takes the small
// tiles (1 wave against 1), 2048^3 the large (1 against 2).
void launch(const float* A, const float* B, float* C, int M, int N, int K) {
  const int64_t ld = tf32_hopper::padded_rows(K);
  CudaArray bt(N * ld);  // from the pool: freed buffers come back
  check(tf32_hopper::transpose(B, bt.ptr, K, N, ld), "matmul_tf32 (transpose)");
  CudaArray padded(K % 4 == 0 ? 0 : M * ld);
  if (K % 4 != 0) check(tf32_hopper::pad_rows(A, padded.ptr, M, K, ld), "matmul_tf32 (pad)");
  const float* a = K % 4 == 0 ? A : padded.ptr;
  const int64_t lda = K % 4 == 0 ? K : ld;
  const int sms = multiprocessor_count();
  const auto tiles = [&](int bn) {
    return (int64_t{M} + Large::BM - 1) / Large::BM * ((int64_t{N} + bn - 1) / bn);
  };
  const bool large = 3 * waves(tiles(Small::BN), sms) >= 5 * waves(tiles(Large::BN), sms);
  check(large ? tf32_hopper::gemm<Large>(a, lda, bt.ptr, ld, C, M, N, K, sms)
              : tf32_hopper::gemm<Small>(a, lda, bt.ptr, ld, C, M, N, K, sms),
        "matmul_tf32 (wgmma)");
}

}  // namespace hopper

void launch(const float* A, const float* B, float* C, int M, int N, int K) {
  static int major = 0, minor = 0;
  if (major == 0) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  }
  if (major < 8) throw std::runtime_error("matmul_tf32 needs a GPU of compute capability 8.0+");
  if (hopper::available(major, minor)) {
    hopper::launch(A, B, C, M, N, K);
  } else if (K % 4 == 0 && N % 4 == 0) {
    launch_variant<true>(A, B, C, M, N, K);
  } else {
    launch_variant<false>(A, B, C, M, N, K);
  }
}

}  // namespace tf32

// ---------------------------------------------------------------------------------------------
// Row vector times matrix, C (1 x N) = A (1 x K) @ B (K x N): every product with M = 1, float32
// and TF32 alike (NDArray sums over leading axes as ones(1, R) @ x(R, C): a bias gradient over
// a batch). The tiled GEMMs would run such a product on N / 64 blocks, each element one float32
// chain of K additions: slow for a long K, and wrong once the sum outgrows 2^24 times its terms
// (2^25 ones summed to 2^24). Here blocks of 32 columns by a slice of K rows add the products up in
// double, and a second kernel adds the slices' sums in a fixed order (as reduce_sum, in double).

constexpr int kRowVectorCols = 32, kRowVectorRows = 8;  // a block's columns x interleaved rows
constexpr int64_t kMaxSlices = 1024, kMinSliceRows = 256;

__global__ void row_vector_slices_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                         double* __restrict__ sums, int N, int K,
                                         int slice_rows) {
  __shared__ double partial[kRowVectorRows][kRowVectorCols];
  const int col = blockIdx.x * kRowVectorCols + threadIdx.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * slice_rows;
  const int64_t last = min(first + slice_rows, static_cast<int64_t>(K));
  double acc = 0.0;
  if (col < N) {
    for (int64_t k = first + threadIdx.y; k < last; k += kRowVectorRows) {
      acc += static_cast<double>(A[k]) * B[k * N + col];
    }
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    for (int r = 1; r < kRowVectorRows; ++r) acc += partial[r][threadIdx.x];
    sums[static_cast<int64_t>(blockIdx.y) * N + col] = acc;
  }
}

__global__ void add_slices_kernel(const double* __restrict__ sums, float* __restrict__ C, int N,
                                  int slices) {
  for (int64_t col = blockIdx.x * blockDim.x + threadIdx.x; col < N;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double total = 0.0;
    for (int s = 0; s < slices; ++s) total += sums[static_cast<int64_t>(s) * N + col];
    C[col] = static_cast<float>(total);
  }
}

void row_vector_matmul(const float* A, const float* B, float* C, int /* M = 1 */, int N, int K) {
  const int64_t slices = std::min(kMaxSlices, (int64_t{K} + kMinSliceRows - 1) / kMinSliceRows);
  const int slice_rows = static_cast<int>((K + slices - 1) / slices);
  CudaArray sums(2 * slices * N);  // doubles; cudaMalloc's alignment suits them
  double* slice_sums = reinterpret_cast<double*>(sums.ptr);
  const dim3 grid((N + kRowVectorCols - 1) / kRowVectorCols, static_cast<unsigned>(slices));
  row_vector_slices_kernel<<<grid, dim3(kRowVectorCols, kRowVectorRows)>>>(A, B, slice_sums, N,
                                                                           K, slice_rows);
  CHECK_LAUNCH("matmul (row vector)");
  add_slices_kernel<<<grid_for(N), kBlockSize>>>(slice_sums, C, N, static_cast<int>(slices));
  CHECK_LAUNCH("matmul (row vector sums)");
}

using GemmLauncher = void (*)(const float* A, const float* B, float* C, int M, int N, int K);

// Validates the operands (exact sizes, as in the cpu module) and runs `gemm` (row_vector_matmul
// for a single row); an output that aliases an input is computed into a scratch buffer first,
// since the kernels read A and B while C is being written.
void run_matmul(const CudaArray& a, const CudaArray& b, CudaArray& out, int64_t m, int64_t n,
                int64_t p, GemmLauncher gemm) {
  if (m < 0 || n < 0 || p < 0) {
    throw py::value_error("matmul: dims must be >= 0, got m=" + std::to_string(m) +
                          " n=" + std::to_string(n) + " p=" + std::to_string(p));
  }
  const auto expect = [](const CudaArray& x, int64_t rows, int64_t cols, const char* name) {
    int64_t numel;
    if (__builtin_mul_overflow(rows, cols, &numel) || static_cast<size_t>(numel) != x.size) {
      throw py::value_error(std::string("matmul: ") + name + " has " + std::to_string(x.size) +
                            " elements, expected " + std::to_string(rows) + " x " +
                            std::to_string(cols));
    }
  };
  expect(a, m, n, "a");
  expect(b, n, p, "b");
  expect(out, m, p, "out");
  // The kernels round dims up to tiles (dim + 255 at most) in int arithmetic.
  constexpr int64_t kMaxDim = (int64_t{1} << 31) - 256;
  if (m > kMaxDim || n > kMaxDim || p > kMaxDim) {
    throw py::value_error("matmul: dims too large for the CUDA kernels");
  }
  if (n == 0) {
    if (out.size > 0) CUDA_CHECK(cudaMemset(out.ptr, 0, out.size * sizeof(float)));
    return;
  }
  if (m == 0 || p == 0) return;
  const GemmLauncher launch = m == 1 ? row_vector_matmul : gemm;
  int K = static_cast<int>(n), N = static_cast<int>(p);
  // grid.y holds at most 65535 tiles of 64 rows: taller products run in bands of rows (a
  // multiple of 64, so every band of A and C starts 16-byte aligned).
  constexpr int64_t kBandRows = int64_t{65535} * 64;
  const auto run = [&](float* c) {
    for (int64_t row = 0; row < m; row += kBandRows) {
      const int rows = static_cast<int>(m - row < kBandRows ? m - row : kBandRows);
      launch(a.ptr + row * n, b.ptr, c + row * p, rows, N, K);
    }
  };
  if (out.ptr == a.ptr || out.ptr == b.ptr) {
    CudaArray scratch(static_cast<int64_t>(out.size));
    run(scratch.ptr);
    CUDA_CHECK(cudaMemcpy(out.ptr, scratch.ptr, out.size * sizeof(float),
                          cudaMemcpyDeviceToDevice));
  } else {
    run(out.ptr);
  }
}

// The wide tiles unless their last wave of blocks would be less than half full (and short of 8
// waves), where the 64 x 64 tiles leave a smaller tail; see sgemm.cuh.
void sgemm_launch(const float* A, const float* B, float* C, int M, int N, int K) {
  using sgemm::Small, sgemm::Wide;
  const bool vec = K % 4 == 0 && N % 4 == 0;
  const int64_t blocks = (static_cast<int64_t>(M) + Wide::BM - 1) / Wide::BM *
                         ((static_cast<int64_t>(N) + Wide::BN - 1) / Wide::BN);
  const int64_t slots = static_cast<int64_t>(Wide::kMinBlocks) * multiprocessor_count();
  const int64_t tail = blocks % slots;
  if (blocks >= 8 * slots || tail == 0 || 2 * tail >= slots) {
    vec ? sgemm::launch<Wide, true>(A, B, C, M, N, K)
        : sgemm::launch<Wide, false>(A, B, C, M, N, K);
  } else {
    vec ? sgemm::launch<Small, true>(A, B, C, M, N, K)
        : sgemm::launch<Small, false>(A, B, C, M, N, K);
  }
  CHECK_LAUNCH("matmul");
}

void matmul(const CudaArray& a, const CudaArray& b, CudaArray& out, int64_t m, int64_t n,
            int64_t p) {
  run_matmul(a, b, out, m, n, p, sgemm_launch);
}

void matmul_tf32(const CudaArray& a, const CudaArray& b, CudaArray& out, int64_t m, int64_t n,
                 int64_t p) {
  run_matmul(a, b, out, m, n, p, tf32::launch);
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: report none, leave no sticky error behind
    return 0;
  }
  return count;
}

}  // namespace cuda
}  // namespace needle

PYBIND11_MODULE(ndarray_backend_cuda, m) {
  using namespace needle::cuda;
  m.doc() = "needle's CUDA backend: float32 device buffers and the NDArray primitives";
  m.attr("__device_name__") = "cuda";
  m.attr("__tile_size__") = 4;
  py::register_exception<DeviceMemoryError>(m, "DeviceMemoryError", PyExc_MemoryError);

  py::class_<CudaArray>(m, "Array")
      .def(py::init<int64_t>(), py::arg("size"))
      .def_readonly("size", &CudaArray::size)
      .def("ptr", &CudaArray::ptr_as_int);

  m.def("device_count", device_count);
  m.def("fill", fill);
  m.def("from_numpy", from_numpy);
  m.def("to_numpy", to_numpy);
  m.def("compact", compact);
  m.def("ewise_setitem", ewise_setitem);
  m.def("scalar_setitem", scalar_setitem);

  m.def("ewise_add", ewise<Add>);
  m.def("scalar_add", scalar<Add>);
  m.def("ewise_mul", ewise<Mul>);
  m.def("scalar_mul", scalar<Mul>);
  m.def("ewise_div", ewise<Div>);
  m.def("scalar_div", scalar<Div>);
  m.def("ewise_pow", ewise<Pow>);
  m.def("scalar_power", scalar<Pow>);
  m.def("ewise_maximum", ewise<Max>);
  m.def("scalar_maximum", scalar<Max>);
  m.def("ewise_eq", ewise<Eq>);
  m.def("scalar_eq", scalar<Eq>);
  m.def("ewise_ge", ewise<Ge>);
  m.def("scalar_ge", scalar<Ge>);

  m.def("ewise_log", unary_op<Log>);
  m.def("ewise_exp", unary_op<Exp>);
  m.def("ewise_tanh", unary_op<Tanh>);
  m.def("ewise_sqrt", unary_op<Sqrt>);

  m.def("reduce_sum", reduce_sum);
  m.def("reduce_max", reduce_max);
  m.def("matmul", matmul);
  m.def("matmul_tf32", matmul_tf32);
}
