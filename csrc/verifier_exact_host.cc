// The host's inner loop of the verifier's exact mode: an integer matrix times a few float64
// columns of signed digits, converted entry by entry in registers (numpy has to write a
// float64 copy of each row block and then read it once per digit column). verifier/exact.py
// picks the digits so that every partial sum is an integer of magnitude at most 2^53, so
// these float64 sums are exact in any order, and the result equals numpy's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace py = pybind11;

namespace {

// LANES float64 lanes: one AVX-512 or AVX2 register. Entries of at most 32 bits are widened
// with one sign or zero extension to int32 and one conversion (GCC's generic vector
// conversion extracts int8 lanes one by one); other types and machines convert lane by lane.
#if defined(__AVX512F__)
constexpr int LANES = 8, REGISTERS = 32;
#else
constexpr int LANES = 4, REGISTERS = 16;
#endif
typedef double vd __attribute__((vector_size(8 * LANES)));

template <typename T>
inline vd load(const T* p) {
  vd x;
  for (int q = 0; q < LANES; q++) x[q] = double(p[q]);
  return x;
}

#if defined(__AVX512F__)
inline vd widen(__m256i x) { return (vd)_mm512_cvtepi32_pd(x); }
template <> inline vd load(const int8_t* p) {
  return widen(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
template <> inline vd load(const uint8_t* p) {
  return widen(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
template <> inline vd load(const int16_t* p) {
  return widen(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)p)));
}
template <> inline vd load(const uint16_t* p) {
  return widen(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)));
}
template <> inline vd load(const int32_t* p) {
  return widen(_mm256_loadu_si256((const __m256i*)p));
}
#elif defined(__AVX2__)
inline vd widen(__m128i x) { return (vd)_mm256_cvtepi32_pd(x); }
inline __m128i four_bytes(const void* p) {
  int32_t x;
  __builtin_memcpy(&x, p, 4);
  return _mm_cvtsi32_si128(x);
}
template <> inline vd load(const int8_t* p) { return widen(_mm_cvtepi8_epi32(four_bytes(p))); }
template <> inline vd load(const uint8_t* p) { return widen(_mm_cvtepu8_epi32(four_bytes(p))); }
template <> inline vd load(const int16_t* p) {
  return widen(_mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
template <> inline vd load(const uint16_t* p) {
  return widen(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
template <> inline vd load(const int32_t* p) {
  return widen(_mm_loadu_si128((const __m128i*)p));
}
#endif

inline vd loadw(const double* p) {
  vd w;
  __builtin_memcpy(&w, p, sizeof w);
  return w;
}

inline double lanes(vd v) {
  double total = 0;
  for (int q = 0; q < LANES; q++) total += v[q];
  return total;
}

// ROWS rows of M against COLS digit columns, each loaded once per four entries and used by
// every row (the columns, not M, are most of the bytes read). With CHECK, each row's largest
// entry magnitude is tracked too.
template <typename T, int ROWS, int COLS, bool CHECK>
void rows_times_columns(const T* M, int64_t ld, const double* W, int64_t inner, double* sums,
                        int64_t rows_total, double* magnitude) {
  vd acc[ROWS][COLS] = {};
  vd top[ROWS] = {};
  int64_t j = 0;
  for (; j + LANES <= inner; j += LANES) {
    vd w[COLS];
    for (int c = 0; c < COLS; c++) w[c] = loadw(W + c * inner + j);
    for (int r = 0; r < ROWS; r++) {
      vd x = load(M + r * ld + j);
      for (int c = 0; c < COLS; c++) acc[r][c] += x * w[c];
      if (CHECK) {
        vd a = x < 0 ? -x : x;
        top[r] = a > top[r] ? a : top[r];
      }
    }
  }
  for (int r = 0; r < ROWS; r++) {
    double tail[COLS] = {};
    double most = 0;
    for (int64_t q = j; q < inner; q++) {
      double x = double(M[r * ld + q]);
      for (int c = 0; c < COLS; c++) tail[c] += x * W[c * inner + q];
      double a = x < 0 ? -x : x;
      most = a > most ? a : most;
    }
    for (int c = 0; c < COLS; c++) sums[c * rows_total + r] = lanes(acc[r][c]) + tail[c];
    if (CHECK) {
      for (int q = 0; q < LANES; q++) most = top[r][q] > most ? top[r][q] : most;
      magnitude[r] = most;
    }
  }
}

template <typename T, int COLS, bool CHECK>
void all_rows(const T* M, int64_t rows, int64_t ld, const double* W, int64_t inner,
              double* sums, int64_t rows_total, double* magnitude) {
  // rows at a time: their accumulators, the columns and a row's entries fill the registers
  constexpr int ROWS = COLS <= 2 ? REGISTERS / 4 : REGISTERS / 8;
  int64_t i = 0;
  for (; i + ROWS <= rows; i += ROWS)
    rows_times_columns<T, ROWS, COLS, CHECK>(M + i * ld, ld, W, inner, sums + i, rows_total,
                                             magnitude + i);
  for (; i < rows; i++)
    rows_times_columns<T, 1, COLS, CHECK>(M + i * ld, ld, W, inner, sums + i, rows_total,
                                          magnitude + i);
}

template <typename T, int COLS>
void group(const T* M, int64_t rows, int64_t ld, const double* W, int64_t inner, double* sums,
           int64_t rows_total, double* magnitude) {
  if (magnitude)
    all_rows<T, COLS, true>(M, rows, ld, W, inner, sums, rows_total, magnitude);
  else
    all_rows<T, COLS, false>(M, rows, ld, W, inner, sums, rows_total, nullptr);
}

// Row blocks small enough to stay in cache while each group of up to 4 columns passes over
// them; the first group also finds the rows' magnitudes when asked.
template <typename T>
void digit_sums(const T* M, int64_t rows, int64_t ld, const double* W, int64_t cols,
                int64_t inner, double* sums, double* magnitude) {
  constexpr int64_t kBlockRows = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlockRows) {
    const int64_t n = rows - i0 < kBlockRows ? rows - i0 : kBlockRows;
    for (int64_t c0 = 0; c0 < cols; c0 += 4) {
      const T* Mi = M + i0 * ld;
      const double* Wc = W + c0 * inner;
      double* out = sums + c0 * rows + i0;
      double* mag = magnitude && c0 == 0 ? magnitude + i0 : nullptr;
      switch (cols - c0 < 4 ? cols - c0 : 4) {
        case 1: group<T, 1>(Mi, n, ld, Wc, inner, out, rows, mag); break;
        case 2: group<T, 2>(Mi, n, ld, Wc, inner, out, rows, mag); break;
        case 3: group<T, 3>(Mi, n, ld, Wc, inner, out, rows, mag); break;
        default: group<T, 4>(Mi, n, ld, Wc, inner, out, rows, mag); break;
      }
    }
  }
}

template <typename T>
py::tuple typed(const py::array& M, const py::array_t<double, py::array::c_style>& W,
                bool check) {
  const int64_t rows = M.shape(0), inner = M.shape(1), cols = W.shape(0);
  const int64_t ld = M.strides(0) / int64_t(sizeof(T));
  py::array_t<double> sums({cols, rows});
  py::array_t<double> magnitude(check ? rows : 0);
  const T* data = static_cast<const T*>(M.data());
  const double* w = W.data();
  double* s = sums.mutable_data();
  double* mag = check ? magnitude.mutable_data() : nullptr;
  {
    py::gil_scoped_release unlocked;
    digit_sums<T>(data, rows, ld, w, cols, inner, s, mag);
  }
  return py::make_tuple(sums, check ? py::object(magnitude) : py::object(py::none()));
}

py::tuple digit_sums_entry(const py::array& M, const py::array_t<double, py::array::c_style>& W,
                           bool check) {
  if (M.ndim() != 2 || W.ndim() != 2)
    throw py::value_error("digit_sums takes a 2-D matrix and a 2-D (columns, inner) array");
  if (M.shape(1) != W.shape(1))
    throw py::value_error("the matrix's rows and the digit columns differ in length: " +
                          std::to_string(M.shape(1)) + " and " + std::to_string(W.shape(1)));
  const py::dtype dt = M.dtype();
  const int64_t size = dt.itemsize();
  if (dt.kind() != 'i' && dt.kind() != 'u')
    throw py::type_error("digit_sums takes an integer matrix, not " + std::string(py::str(dt)));
  if ((M.shape(1) > 1 && M.strides(1) != size) || M.strides(0) % size != 0)
    throw py::value_error("digit_sums needs each row's entries stored contiguously");
  if (!dt.attr("isnative").cast<bool>())
    throw py::value_error("digit_sums needs the native byte order");
  switch (dt.kind() == 'i' ? size : -size) {
    case 1: return typed<int8_t>(M, W, check);
    case 2: return typed<int16_t>(M, W, check);
    case 4: return typed<int32_t>(M, W, check);
    case 8: return typed<int64_t>(M, W, check);
    case -1: return typed<uint8_t>(M, W, check);
    case -2: return typed<uint16_t>(M, W, check);
    case -4: return typed<uint32_t>(M, W, check);
    default: throw py::type_error("digit_sums does not take " + std::string(py::str(dt)));
  }
}

}  // namespace

PYBIND11_MODULE(exact_host, m) {
  m.doc() = "The verifier's exact-mode host loop: integer matrix times float64 digit columns";
  m.def("digit_sums", &digit_sums_entry, py::arg("M"), py::arg("W"), py::arg("check"),
        "(sums, magnitudes): sums (cols, rows) float64 with sums[c, i] = sum_j M[i, j] W[c, j], "
        "exact when every partial sum is an integer within 2^53; with check, each row's "
        "largest |M[i, j]| as float64 (else None).");
}
