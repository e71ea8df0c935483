// The inner loop of the verifier's exact mode on the host: an integer matrix times a few
// float64 columns of signed digits, each entry widened to float64 in registers (numpy has to
// write a float64 copy of each row block and then read it once per digit column).
// verifier/exact.py picks the digits so that every partial sum is an integer of magnitude at
// most 2^53, so these float64 sums are exact in any order and equal numpy's.
//
// Compiled once per instruction set, into namespace exact_host::EXACT_HOST_ISA (CMake:
// avx2 with -mavx2 -mfma, avx512 with -mavx512f as well); verifier_exact_host.cc picks one
// at run time, so a build for any x86-64 CPU still runs the widest loop the CPU has.
#include <immintrin.h>

#include <cstdint>

namespace exact_host {
namespace EXACT_HOST_ISA {

// LANES float64 lanes: one AVX-512 or AVX2 register. Entries of at most 32 bits are widened
// with one sign or zero extension to int32 and one conversion (GCC's generic vector
// conversion extracts int8 lanes one by one); uint32 and int64 convert lane by lane.
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
#else  // AVX2
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

// ROWS rows of M against COLS digit columns, each loaded once per LANES entries and used by
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

#define INSTANTIATE(T)                                                                     \
  template void digit_sums<T>(const T*, int64_t, int64_t, const double*, int64_t, int64_t, \
                              double*, double*);
INSTANTIATE(int8_t)
INSTANTIATE(uint8_t)
INSTANTIATE(int16_t)
INSTANTIATE(uint16_t)
INSTANTIATE(int32_t)
INSTANTIATE(uint32_t)
INSTANTIATE(int64_t)

}  // namespace EXACT_HOST_ISA
}  // namespace exact_host
