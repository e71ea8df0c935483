// needle's CPU backend: a flat float32 buffer type plus the small set of primitives
// (compact/setitem on strided views, elementwise ops, reductions, matmul) that NDArray
// composes everything else from. Every entry point validates sizes and ranges and raises
// a Python exception instead of touching memory it does not own.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace needle {
namespace cpu {

using scalar_t = float;
constexpr size_t kAlignment = 64;
// Elementwise ops and reductions are memory-bound: threads pay off only on large arrays, and
// every parallel region stalls when a shared core deschedules one of its threads.
constexpr int64_t kParallelElements = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Memory

struct AlignedFree {
  void operator()(void* ptr) const { std::free(ptr); }
};

// An uninitialised cache-line aligned float buffer (like np.empty); aligned_alloc needs whole lines.
std::unique_ptr<scalar_t[], AlignedFree> aligned_buffer(size_t elements) {
  if (elements > (SIZE_MAX - kAlignment) / sizeof(scalar_t)) throw std::bad_alloc();
  size_t bytes = std::max<size_t>(elements * sizeof(scalar_t), kAlignment);
  bytes = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* ptr = std::aligned_alloc(kAlignment, bytes);
  if (ptr == nullptr) throw std::bad_alloc();
  return std::unique_ptr<scalar_t[], AlignedFree>(static_cast<scalar_t*>(ptr));
}

struct AlignedArray {
  explicit AlignedArray(int64_t size) : size(size) {
    if (size < 0) throw py::value_error("Array size must be >= 0, got " + std::to_string(size));
    data = aligned_buffer(static_cast<size_t>(size));
  }
  std::unique_ptr<scalar_t[], AlignedFree> data;
  int64_t size;
  scalar_t* ptr() const { return data.get(); }
};

// ---------------------------------------------------------------------------------------------
// Validation

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) throw py::value_error("shape entries must be >= 0, got " + std::to_string(dim));
    if (__builtin_mul_overflow(numel, dim, &numel)) throw py::value_error("shape overflows int64");
  }
  return numel;
}

// Checks that the strided view (shape, strides, offset) stays inside a buffer of `size`
// elements; returns the number of elements in the view.
int64_t check_view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                   int64_t offset, int64_t size, const char* what) {
  if (shape.size() != strides.size()) {
    throw py::value_error(std::string(what) + ": shape has " + std::to_string(shape.size()) +
                          " dims but strides has " + std::to_string(strides.size()));
  }
  int64_t numel = checked_numel(shape);
  if (numel == 0) return 0;
  int64_t lowest = offset, highest = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t reach;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &reach) ||
        __builtin_add_overflow(reach > 0 ? highest : lowest, reach,
                               reach > 0 ? &highest : &lowest)) {
      throw py::index_error(std::string(what) + ": strides overflow int64");
    }
  }
  if (lowest < 0 || highest >= size) {
    throw py::index_error(std::string(what) + ": view reaches elements [" + std::to_string(lowest) +
                          ", " + std::to_string(highest) + "] outside the buffer of " +
                          std::to_string(size) + " elements");
  }
  return numel;
}

void check_same_size(const AlignedArray& a, const AlignedArray& out, const char* what) {
  if (a.size != out.size) {
    throw py::value_error(std::string(what) + ": input has " + std::to_string(a.size) +
                          " elements but out has " + std::to_string(out.size));
  }
}

// ---------------------------------------------------------------------------------------------
// Threads

// libgomp's thread pool does not survive fork(): a child that enters a parallel region after its
// parent had started the pool waits forever for threads that no longer exist. Such a child
// (a multiprocessing worker, say) runs everything on one thread instead.
std::atomic<bool> pool_started{false};
std::atomic<bool> pool_lost_in_fork{false};

void after_fork_in_child() { pool_lost_in_fork = pool_started.load(); }

// How many threads to use for a job that is worth parallelising when `large` is true.
int team_size(bool large) {
#ifdef _OPENMP
  if (!large || pool_lost_in_fork) return 1;
  const int threads = omp_get_max_threads();
  if (threads > 1) pool_started = true;
  return threads;
#else
  (void)large;
  return 1;
#endif
}

int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// Strided views

// A view's axes with size-1 axes dropped and neighbours that step through memory as one merged:
// the same elements in the same order, in as few (and as long) axes as possible.
struct Axes {
  std::vector<int64_t> dims, steps;
};

Axes simplify(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  Axes axes;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!axes.dims.empty() && axes.steps.back() == strides[d] * shape[d]) {
      axes.dims.back() *= shape[d];
      axes.steps.back() = strides[d];
    } else {
      axes.dims.push_back(shape[d]);
      axes.steps.push_back(strides[d]);
    }
  }
  if (axes.dims.empty()) axes = {{1}, {1}};  // a single element
  return axes;
}

// Calls visit(i, j) for every index of the leading axes (all but the last `inner`), where i is
// the row-major position of that block's first element and j its buffer index.
template <typename Visit>
void for_each_block(const Axes& axes, int64_t offset, size_t inner, Visit visit) {
  const int64_t outer = static_cast<int64_t>(axes.dims.size() - inner);
  int64_t block = 1;
  for (size_t d = outer; d < axes.dims.size(); ++d) block *= axes.dims[d];
  std::vector<int64_t> index(outer, 0);
  int64_t base = offset;
  for (int64_t i = 0, numel = checked_numel(axes.dims); i < numel; i += block) {
    visit(i, base);
    for (int64_t d = outer - 1; d >= 0; --d) {  // odometer over the leading axes
      base += axes.steps[d];
      if (++index[d] < axes.dims[d]) break;
      base -= axes.steps[d] * axes.dims[d];
      index[d] = 0;
    }
  }
}

// Calls visit(i, j, length, stride) for each run of `length` elements of the view that are
// consecutive in row-major order (the i-th onwards) and `stride` apart in the buffer (from j).
template <typename Visit>
void for_each_run(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                  int64_t offset, Visit visit) {
  if (checked_numel(shape) == 0) return;
  const Axes axes = simplify(shape, strides);
  const int64_t length = axes.dims.back(), stride = axes.steps.back();
  for_each_block(axes, offset, 1, [&](int64_t i, int64_t j) { visit(i, j, length, stride); });
}

#if defined(__AVX2__)
// dst[i][j] = src[j][i] for an 8 x 8 block (row strides ld_dst and ld_src), in registers.
inline void transpose_8x8(scalar_t* dst, int64_t ld_dst, const scalar_t* src, int64_t ld_src) {
  __m256 row[8], pair[8];
  for (int i = 0; i < 8; ++i) row[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) {  // interleave neighbouring rows
    pair[i] = _mm256_unpacklo_ps(row[i], row[i + 1]);
    pair[i + 1] = _mm256_unpackhi_ps(row[i], row[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // gather 4-element columns within each 128-bit lane
    row[i] = _mm256_shuffle_ps(pair[i], pair[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    row[i + 1] = _mm256_shuffle_ps(pair[i], pair[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    row[i + 2] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    row[i + 3] = _mm256_shuffle_ps(pair[i + 1], pair[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // join the lanes of rows 0-3 and 4-7
    _mm256_storeu_ps(dst + i * ld_dst, _mm256_permute2f128_ps(row[i], row[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld_dst, _mm256_permute2f128_ps(row[i], row[i + 4], 0x31));
  }
}
#endif

// dst (rows x cols, compact) = the matrix whose (r, c) element is src[r + c * stride]: a
// transpose, copied in square tiles so that both sides stay in cache.
void transpose(scalar_t* dst, const scalar_t* src, int64_t rows, int64_t cols, int64_t stride) {
  constexpr int64_t kTile = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
#if defined(__AVX2__)
      if (r1 - r0 == kTile && c1 - c0 == kTile) {
        for (int64_t r = r0; r < r1; r += 8) {
          for (int64_t c = c0; c < c1; c += 8) {
            transpose_8x8(dst + r * cols + c, cols, src + r + c * stride, stride);
          }
        }
        continue;
      }
#endif
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) dst[r * cols + c] = src[r + c * stride];
      }
    }
  }
}

// dst (compact) = the strided view (shape, strides, offset) of src, which the caller validated.
void gather(const scalar_t* src, const std::vector<int64_t>& shape,
            const std::vector<int64_t>& strides, int64_t offset, scalar_t* dst) {
  if (checked_numel(shape) == 0) return;
  const Axes axes = simplify(shape, strides);
  const size_t last = axes.dims.size() - 1;
  if (last >= 1 && axes.steps[last - 1] == 1 && axes.steps[last] != 0) {  // transposed last axes
    const int64_t rows = axes.dims[last - 1], cols = axes.dims[last], stride = axes.steps[last];
    for_each_block(axes, offset, 2, [&](int64_t i, int64_t j) {
      transpose(dst + i, src + j, rows, cols, stride);
    });
    return;
  }
  for_each_run(shape, strides, offset, [&](int64_t i, int64_t j, int64_t length, int64_t stride) {
    if (stride == 1) {
      std::memcpy(dst + i, src + j, length * sizeof(scalar_t));
    } else {
      for (int64_t k = 0; k < length; ++k) dst[i + k] = src[j + k * stride];
    }
  });
}

// The data of src, copied first when src is also the buffer about to be written (x[view] = x,
// or a view of x compacted into x), so that every read sees the values from before the writes.
struct Source {
  std::unique_ptr<scalar_t[], AlignedFree> copy;
  const scalar_t* data;
};

Source read_before_writing(const AlignedArray& src, const AlignedArray& dst) {
  if (src.ptr() != dst.ptr()) return {nullptr, src.ptr()};
  auto copy = aligned_buffer(static_cast<size_t>(src.size));
  std::copy(src.ptr(), src.ptr() + src.size, copy.get());
  const scalar_t* data = copy.get();
  return {std::move(copy), data};
}

void compact(const AlignedArray& a, AlignedArray& out, std::vector<int64_t> shape,
             std::vector<int64_t> strides, int64_t offset) {
  int64_t numel = check_view(shape, strides, offset, a.size, "compact");
  if (numel != out.size) {
    throw py::value_error("compact: view has " + std::to_string(numel) +
                          " elements but out has " + std::to_string(out.size));
  }
  const Source src = read_before_writing(a, out);
  gather(src.data, shape, strides, offset, out.ptr());
}

void ewise_setitem(const AlignedArray& a, AlignedArray& out, std::vector<int64_t> shape,
                   std::vector<int64_t> strides, int64_t offset) {
  int64_t numel = check_view(shape, strides, offset, out.size, "ewise_setitem");
  if (numel != a.size) {
    throw py::value_error("ewise_setitem: view has " + std::to_string(numel) +
                          " elements but the source has " + std::to_string(a.size));
  }
  const Source source = read_before_writing(a, out);
  const scalar_t* src = source.data;
  scalar_t* dst = out.ptr();
  for_each_run(shape, strides, offset, [&](int64_t i, int64_t j, int64_t length, int64_t stride) {
    if (stride == 1) {
      std::memcpy(dst + j, src + i, length * sizeof(scalar_t));
    } else {
      for (int64_t k = 0; k < length; ++k) dst[j + k * stride] = src[i + k];
    }
  });
}

void scalar_setitem(int64_t size, scalar_t val, AlignedArray& out, std::vector<int64_t> shape,
                    std::vector<int64_t> strides, int64_t offset) {
  int64_t numel = check_view(shape, strides, offset, out.size, "scalar_setitem");
  if (numel != size) {
    throw py::value_error("scalar_setitem: view has " + std::to_string(numel) +
                          " elements but size is " + std::to_string(size));
  }
  scalar_t* dst = out.ptr();
  for_each_run(shape, strides, offset, [&](int64_t, int64_t j, int64_t length, int64_t stride) {
    if (stride == 1) {
      std::fill(dst + j, dst + j + length, val);
    } else {
      for (int64_t k = 0; k < length; ++k) dst[j + k * stride] = val;
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Conversions

void fill(AlignedArray& out, scalar_t val) { std::fill(out.ptr(), out.ptr() + out.size, val); }

void from_numpy(py::array a, AlignedArray& out) {
  if (!py::isinstance<py::array_t<scalar_t>>(a)) {  // equivalent dtype, not the same object
    throw py::value_error("from_numpy: expected a float32 array, got dtype " +
                          std::string(py::str(a.dtype())));
  }
  auto contiguous = py::array_t<scalar_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (contiguous.size() != out.size) {
    throw py::value_error("from_numpy: array has " + std::to_string(contiguous.size()) +
                          " elements but out has " + std::to_string(out.size));
  }
  std::copy(contiguous.data(), contiguous.data() + out.size, out.ptr());
}

py::array_t<scalar_t> to_numpy(const AlignedArray& a, std::vector<int64_t> shape,
                               std::vector<int64_t> strides, int64_t offset) {
  check_view(shape, strides, offset, a.size, "to_numpy");
  py::array_t<scalar_t> result(std::vector<py::ssize_t>(shape.begin(), shape.end()));
  gather(a.ptr(), shape, strides, offset, result.mutable_data());
  return result;
}

// ---------------------------------------------------------------------------------------------
// Elementwise

template <typename Op>
void apply_unary(const AlignedArray& a, AlignedArray& out, Op op, const char* what) {
  check_same_size(a, out, what);
  const scalar_t* x = a.ptr();
  scalar_t* y = out.ptr();
  const int64_t n = out.size;
  [[maybe_unused]] const int threads = team_size(n >= kParallelElements);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) y[i] = op(x[i]);
}

template <typename Op>
void apply_binary(const AlignedArray& a, const AlignedArray& b, AlignedArray& out, Op op,
                  const char* what) {
  check_same_size(a, out, what);
  check_same_size(b, out, what);
  const scalar_t* x = a.ptr();
  const scalar_t* z = b.ptr();
  scalar_t* y = out.ptr();
  const int64_t n = out.size;
  [[maybe_unused]] const int threads = team_size(n >= kParallelElements);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) y[i] = op(x[i], z[i]);
}

// NaN-propagating like numpy.maximum.
inline scalar_t maximum(scalar_t x, scalar_t y) { return (x > y || x != x) ? x : y; }

const auto add_op = [](scalar_t x, scalar_t y) { return x + y; };
const auto mul_op = [](scalar_t x, scalar_t y) { return x * y; };
const auto div_op = [](scalar_t x, scalar_t y) { return x / y; };
const auto pow_op = [](scalar_t x, scalar_t y) { return std::pow(x, y); };
const auto max_op = [](scalar_t x, scalar_t y) { return maximum(x, y); };
const auto eq_op = [](scalar_t x, scalar_t y) { return scalar_t(x == y); };
const auto ge_op = [](scalar_t x, scalar_t y) { return scalar_t(x >= y); };

template <typename Op>
void register_binary(py::module_& m, const char* ewise_name, const char* scalar_name, Op op) {
  m.def(ewise_name, [op, ewise_name](const AlignedArray& a, const AlignedArray& b,
                                     AlignedArray& out) { apply_binary(a, b, out, op, ewise_name); });
  m.def(scalar_name, [op, scalar_name](const AlignedArray& a, scalar_t val, AlignedArray& out) {
    apply_unary(a, out, [op, val](scalar_t x) { return op(x, val); }, scalar_name);
  });
}

// ---------------------------------------------------------------------------------------------
// Reductions over groups of `reduce_size` consecutive elements

void check_reduce(const AlignedArray& a, const AlignedArray& out, int64_t reduce_size,
                  const char* what) {
  if (reduce_size < 1) {
    throw py::value_error(std::string(what) + ": reduce_size must be >= 1, got " +
                          std::to_string(reduce_size));
  }
  int64_t expected;
  if (__builtin_mul_overflow(out.size, reduce_size, &expected) || expected != a.size) {
    throw py::value_error(std::string(what) + ": input has " + std::to_string(a.size) +
                          " elements, expected out.size * reduce_size = " +
                          std::to_string(out.size) + " * " + std::to_string(reduce_size));
  }
}

void reduce_sum(const AlignedArray& a, AlignedArray& out, int64_t reduce_size) {
  check_reduce(a, out, reduce_size, "reduce_sum");
  const scalar_t* x = a.ptr();
  scalar_t* y = out.ptr();
  const int64_t groups = out.size;
  [[maybe_unused]] const int threads = team_size(a.size >= kParallelElements && groups > 1);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const scalar_t* group = x + g * reduce_size;
    double total = 0.0;  // double keeps long sums close to numpy's pairwise float32 sum
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < reduce_size; ++k) total += group[k];
    y[g] = static_cast<scalar_t>(total);
  }
}

void reduce_max(const AlignedArray& a, AlignedArray& out, int64_t reduce_size) {
  check_reduce(a, out, reduce_size, "reduce_max");
  const scalar_t* x = a.ptr();
  scalar_t* y = out.ptr();
  const int64_t groups = out.size;
  [[maybe_unused]] const int threads = team_size(a.size >= kParallelElements && groups > 1);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const scalar_t* group = x + g * reduce_size;
    scalar_t best = group[0];
    for (int64_t k = 1; k < reduce_size; ++k) best = maximum(group[k], best);
    y[g] = best;
  }
}

// ---------------------------------------------------------------------------------------------
// Matmul: a packed, cache-blocked GEMM (the Goto/BLIS scheme) around an MR x NR register-tiled
// micro-kernel. A panel of B (all of K by up to kPanelElements / n columns, or NR columns by
// kPanelElements / NR rows of a K longer than that) is packed once into NR-column slivers; C's
// part of it is then cut into tiles of MC rows x a group of slivers that threads take
// dynamically. A tile walks the panel's K in KC steps: it packs its MC x KC block of A (L2) and
// streams KC x NR slivers of B (L1) through the micro-kernel. Tiles never wait on each other, so
// the only barriers are one after packing each panel and one at its end: a thread descheduled
// by another process on a shared core holds the other back for one tile at most.

constexpr int64_t MR = 6, NR = 16;     // 12 AVX2 accumulators + 2 B vectors + 1 A broadcast
constexpr int64_t KC = 256;            // B sliver KC x NR = 16 KiB stays in L1
constexpr int64_t MC = 120;            // A block MC x KC = 120 KiB stays in L2
constexpr int64_t kPanelElements = 1 << 21;  // packed B panel: 8 MiB, a quarter of L3
constexpr int64_t kTilesPerThread = 8;       // enough tiles for dynamic balancing
constexpr int64_t kParallelFlops = 1 << 23;  // below ~8 MFLOP (~0.1 ms) one thread is enough

// C[0:MR, 0:NR] (row stride ldc) = (accumulate ? C : 0) + A_sliver @ B_sliver, over kc steps.
inline void micro_kernel(int64_t kc, const scalar_t* __restrict__ ap,
                         const scalar_t* __restrict__ bp, scalar_t* __restrict__ c, int64_t ldc,
                         bool accumulate) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[MR][2];  // fully unrolled below, so these stay in registers
#pragma GCC unroll 6
  for (int64_t i = 0; i < MR; ++i) {
    acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k, ap += MR, bp += NR) {
    const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
    for (int64_t i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(ap + i);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int64_t i = 0; i < MR; ++i) {
    scalar_t* row = c + i * ldc;
    if (accumulate) {
      acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_loadu_ps(row));
      acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_loadu_ps(row + 8));
    }
    _mm256_storeu_ps(row, acc[i][0]);
    _mm256_storeu_ps(row + 8, acc[i][1]);
  }
#else
  scalar_t acc[MR][NR] = {};
  for (int64_t k = 0; k < kc; ++k, ap += MR, bp += NR) {
    for (int64_t i = 0; i < MR; ++i) {
      for (int64_t j = 0; j < NR; ++j) acc[i][j] += ap[i] * bp[j];
    }
  }
  for (int64_t i = 0; i < MR; ++i) {
    for (int64_t j = 0; j < NR; ++j) c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0) + acc[i][j];
  }
#endif
}

// Packs columns [jc, jc + nc) of the n rows of B at b into NR-column slivers, sliver s at
// bp + s * n * NR, row-major inside a sliver and zero-padded past column p, so the micro-kernel
// needs no edge case.
void pack_b_sliver(const scalar_t* b, int64_t n, int64_t p, int64_t jc, int64_t nc, int64_t s,
                   scalar_t* bp) {
  const int64_t j0 = s * NR, width = std::min(NR, nc - j0);
  scalar_t* dst = bp + s * n * NR;
  const scalar_t* src = b + jc + j0;
  for (int64_t k = 0; k < n; ++k, src += p, dst += NR) {
    if (width == NR) {
      std::memcpy(dst, src, NR * sizeof(scalar_t));
    } else {
      for (int64_t j = 0; j < NR; ++j) dst[j] = j < width ? src[j] : 0;
    }
  }
}

// Packs A[ic:ic+mc, pc:pc+kc] into MR-row slivers, column-major within a sliver, zero-padded.
void pack_a_block(const scalar_t* a, int64_t n, int64_t ic, int64_t mc, int64_t pc, int64_t kc,
                  scalar_t* ap) {
  for (int64_t i0 = 0; i0 < mc; i0 += MR, ap += MR * kc) {
    const int64_t height = std::min(MR, mc - i0);
    const scalar_t* rows[MR];
    for (int64_t i = 0; i < MR; ++i) rows[i] = a + (ic + i0 + std::min(i, height - 1)) * n + pc;
    for (int64_t k = 0; k < kc; ++k) {
      for (int64_t i = 0; i < MR; ++i) ap[k * MR + i] = i < height ? rows[i][k] : 0;
    }
  }
}

// C[ic:ic+mc, jc + NR*s] for slivers s in [first, last) of a packed B panel holding rows
// [k0, k1) of K, added to what earlier panels left in C. c points at C[ic, jc]; ap is this
// thread's MC x KC packing buffer.
void compute_tile(const scalar_t* a, const scalar_t* bp, scalar_t* c, scalar_t* ap, int64_t n,
                  int64_t p, int64_t k0, int64_t k1, int64_t ic, int64_t mc, int64_t nc,
                  int64_t first, int64_t last) {
  alignas(kAlignment) scalar_t edge[MR * NR];
  for (int64_t pc = k0; pc < k1; pc += KC) {
    const int64_t kc = std::min(KC, k1 - pc);
    const bool accumulate = pc > 0;  // a plain test of pc lets the compiler peel the first step
    pack_a_block(a, n, ic, mc, pc, kc, ap);
    for (int64_t s = first; s < last; ++s) {
      const int64_t j0 = s * NR, width = std::min(NR, nc - j0);
      const scalar_t* b_sliver = bp + (s * (k1 - k0) + pc - k0) * NR;
      for (int64_t i0 = 0; i0 < mc; i0 += MR) {
        const int64_t height = std::min(MR, mc - i0);
        const scalar_t* a_sliver = ap + i0 * kc;
        scalar_t* c_tile = c + i0 * p + j0;
        if (height == MR && width == NR) {
          micro_kernel(kc, a_sliver, b_sliver, c_tile, p, accumulate);
          continue;
        }
        micro_kernel(kc, a_sliver, b_sliver, edge, NR, false);
        for (int64_t i = 0; i < height; ++i) {
          for (int64_t j = 0; j < width; ++j) {
            c_tile[i * p + j] = (accumulate ? c_tile[i * p + j] : 0) + edge[i * NR + j];
          }
        }
      }
    }
  }
}

// c (m x p) = a (m x n) @ b (n x p), all compact row-major; n > 0.
void gemm(const scalar_t* a, const scalar_t* b, scalar_t* c, int64_t m, int64_t n, int64_t p) {
  // Rows and columns of B packed at once, at most kPanelElements even for a narrow B with a very
  // long K (whole KC steps, so each element of C adds up K in the same steps either way).
  const int64_t panel_depth = std::min(n, kPanelElements / NR / KC * KC);
  const int64_t panel_width = std::min(p, std::max(NR, kPanelElements / panel_depth / NR * NR));
  const int64_t panel_slivers = (panel_width + NR - 1) / NR;
  const int64_t row_blocks = (m + MC - 1) / MC;
  const int threads = team_size(2 * m * n * p >= kParallelFlops);

  auto b_packed = aligned_buffer(static_cast<size_t>(panel_depth * panel_slivers * NR));
  const int64_t a_block = (std::min(MC, m) + MR - 1) / MR * MR * std::min(KC, n);
  std::vector<std::unique_ptr<scalar_t[], AlignedFree>> a_packed;
  for (int t = 0; t < threads; ++t) a_packed.push_back(aligned_buffer(static_cast<size_t>(a_block)));

  // One parallel region per panel of K, outside the column loop: nesting that loop (one pass
  // for all K but a very long one) inside the region measured 15-20% slower on 2 threads.
  for (int64_t k0 = 0; k0 < n; k0 += panel_depth) {
    const int64_t k1 = std::min(n, k0 + panel_depth);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      scalar_t* ap = a_packed[thread_id()].get();
      for (int64_t jc = 0; jc < p; jc += panel_width) {
        const int64_t nc = std::min(panel_width, p - jc), slivers = (nc + NR - 1) / NR;
        const int64_t col_groups =
            threads == 1 ? 1
                         : std::clamp((kTilesPerThread * threads + row_blocks - 1) / row_blocks,
                                      int64_t{1}, slivers);
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < slivers; ++s) {
          pack_b_sliver(b + k0 * p, k1 - k0, p, jc, nc, s, b_packed.get());
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < row_blocks * col_groups; ++t) {
          const int64_t block = t / col_groups, group = t % col_groups;
          const int64_t ic = block * MC;
          compute_tile(a, b_packed.get(), c + ic * p + jc, ap, n, p, k0, k1, ic,
                       std::min(MC, m - ic), nc, slivers * group / col_groups,
                       slivers * (group + 1) / col_groups);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Row vector times matrix, c (1 x p) = a (1 x n) @ b (n x p): every product with m = 1. NDArray
// sums over leading axes as ones(1, R) @ x(R, C) (a bias gradient over a batch); the GEMM adds
// each element's n / KC block sums in one float32 chain, which drifts on long sums (4M rows of
// 0.1 summed 1.5e-4 off, numpy's pairwise sum 1.5e-7). Here slices of rows by blocks of columns
// add their products in double, and the slices' sums are added in a fixed order, as the CUDA
// module's one-row path and reduce_sum do: the same result for any number of threads.

constexpr int64_t kRowColumns = 256;        // a task's double sums: 2 KiB, in L1
constexpr int64_t kRowSliceRows = 4096;     // rows per slice, or more where p is wide
constexpr int64_t kRowSliceSums = 1 << 20;  // slices * p doubles: 8 MiB at most

// acc[0:width] = a[k0:k1] @ b[k0:k1, j0:j0+width], added up in double.
void add_row_slice(const scalar_t* a, const scalar_t* b, int64_t p, int64_t k0, int64_t k1,
                   int64_t j0, int64_t width, double* acc) {
  std::fill(acc, acc + width, 0.0);
  for (int64_t k = k0; k < k1; ++k) {
    const double x = a[k];
    const scalar_t* row = b + k * p + j0;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) acc[j] += x * row[j];
  }
}

void row_vector_matmul(const scalar_t* a, const scalar_t* b, scalar_t* c, int64_t n, int64_t p) {
  const int64_t slices =
      std::clamp<int64_t>(std::min((n + kRowSliceRows - 1) / kRowSliceRows, kRowSliceSums / p),
                          1, n);
  const int64_t slice_rows = (n + slices - 1) / slices;
  const int64_t blocks = (p + kRowColumns - 1) / kRowColumns, tasks = slices * blocks;
  std::vector<double> sums(static_cast<size_t>(slices > 1 ? slices * p : 0));
  const int threads = team_size(2 * n * p >= kParallelFlops && tasks > 1);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t slice = task / blocks, j0 = task % blocks * kRowColumns;
    const int64_t width = std::min(kRowColumns, p - j0);
    double acc[kRowColumns];
    add_row_slice(a, b, p, slice * slice_rows, std::min(n, (slice + 1) * slice_rows), j0, width,
                  acc);
    if (slices == 1) {
      std::copy(acc, acc + width, c + j0);  // rounds to float32
    } else {
      std::copy(acc, acc + width, sums.data() + slice * p + j0);
    }
  }
  if (slices == 1) return;
  for (int64_t j = 0; j < p; ++j) {
    double total = 0.0;
    for (int64_t slice = 0; slice < slices; ++slice) total += sums[slice * p + j];
    c[j] = static_cast<scalar_t>(total);
  }
}

// c (m x p) = a (m x n) @ b (n x p) on the path for its shape; n > 0.
void matmul_into(const scalar_t* a, const scalar_t* b, scalar_t* c, int64_t m, int64_t n,
                 int64_t p) {
  if (m == 1) {
    row_vector_matmul(a, b, c, n, p);
  } else {
    gemm(a, b, c, m, n, p);
  }
}

void matmul(const AlignedArray& a, const AlignedArray& b, AlignedArray& out, int64_t m, int64_t n,
            int64_t p) {
  if (m < 0 || n < 0 || p < 0) {
    throw py::value_error("matmul: dims must be >= 0, got m=" + std::to_string(m) +
                          " n=" + std::to_string(n) + " p=" + std::to_string(p));
  }
  const auto expect = [](const AlignedArray& x, int64_t rows, int64_t cols, const char* name) {
    int64_t numel;
    if (__builtin_mul_overflow(rows, cols, &numel) || numel != x.size) {
      throw py::value_error(std::string("matmul: ") + name + " has " + std::to_string(x.size) +
                            " elements, expected " + std::to_string(rows) + " x " +
                            std::to_string(cols));
    }
  };
  expect(a, m, n, "a");
  expect(b, n, p, "b");
  expect(out, m, p, "out");
  if (n == 0) {
    fill(out, 0);
    return;
  }
  if (m == 0 || p == 0) return;
  const bool aliased = out.ptr() == a.ptr() || out.ptr() == b.ptr();
  py::gil_scoped_release release;
  if (aliased) {  // both paths write C while they still read A and B
    auto result = aligned_buffer(static_cast<size_t>(out.size));
    matmul_into(a.ptr(), b.ptr(), result.get(), m, n, p);
    std::copy(result.get(), result.get() + out.size, out.ptr());
  } else {
    matmul_into(a.ptr(), b.ptr(), out.ptr(), m, n, p);
  }
}

}  // namespace cpu
}  // namespace needle

PYBIND11_MODULE(ndarray_backend_cpu, m) {
  namespace py = pybind11;
  using namespace needle::cpu;
  m.doc() = "needle CPU backend: float32 buffers and the primitives NDArray builds on";
  m.attr("__device_name__") = "cpu";
  m.attr("__tile_size__") = NR;
  pthread_atfork(nullptr, nullptr, after_fork_in_child);

  py::class_<AlignedArray>(m, "Array")
      .def(py::init<int64_t>(), py::arg("size"))
      .def("ptr", [](const AlignedArray& a) { return reinterpret_cast<uintptr_t>(a.ptr()); })
      .def_readonly("size", &AlignedArray::size);

  m.def("fill", fill);
  m.def("from_numpy", from_numpy);
  m.def("to_numpy", to_numpy);
  m.def("compact", compact);
  m.def("ewise_setitem", ewise_setitem);
  m.def("scalar_setitem", scalar_setitem);

  register_binary(m, "ewise_add", "scalar_add", add_op);
  register_binary(m, "ewise_mul", "scalar_mul", mul_op);
  register_binary(m, "ewise_div", "scalar_div", div_op);
  register_binary(m, "ewise_pow", "scalar_power", pow_op);
  register_binary(m, "ewise_maximum", "scalar_maximum", max_op);
  register_binary(m, "ewise_eq", "scalar_eq", eq_op);
  register_binary(m, "ewise_ge", "scalar_ge", ge_op);
  m.def("ewise_log", [](const AlignedArray& a, AlignedArray& out) {
    apply_unary(a, out, [](scalar_t x) { return std::log(x); }, "ewise_log");
  });
  m.def("ewise_exp", [](const AlignedArray& a, AlignedArray& out) {
    apply_unary(a, out, [](scalar_t x) { return std::exp(x); }, "ewise_exp");
  });
  m.def("ewise_tanh", [](const AlignedArray& a, AlignedArray& out) {
    apply_unary(a, out, [](scalar_t x) { return std::tanh(x); }, "ewise_tanh");
  });
  m.def("ewise_sqrt", [](const AlignedArray& a, AlignedArray& out) {
    apply_unary(a, out, [](scalar_t x) { return std::sqrt(x); }, "ewise_sqrt");
  });

  m.def("reduce_sum", reduce_sum);
  m.def("reduce_max", reduce_max);
  m.def("matmul", matmul);
}
