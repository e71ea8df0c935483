// verifier.exact_host: the Python face of exact mode's host loop
// (verifier_exact_host_kernel.cc, compiled for AVX-512 and for AVX2). The widest loop the CPU
// runs is chosen once at import; a CPU without AVX2 and FMA fails the import, and
// verifier/exact.py then keeps numpy's loop.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace py = pybind11;

#define DECLARE(ISA)                                                                   \
  namespace exact_host::ISA {                                                          \
  template <typename T>                                                                \
  void digit_sums(const T* M, int64_t rows, int64_t ld, const double* W, int64_t cols, \
                  int64_t inner, double* sums, double* magnitude);                     \
  }
DECLARE(avx2)
DECLARE(avx512)
#undef DECLARE

namespace {

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512() { return has_avx2() && __builtin_cpu_supports("avx512f"); }

template <typename T>
py::tuple typed(const py::array& M, const py::array_t<double, py::array::c_style>& W,
                bool check, bool wide) {
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
    if (wide)
      exact_host::avx512::digit_sums<T>(data, rows, ld, w, cols, inner, s, mag);
    else
      exact_host::avx2::digit_sums<T>(data, rows, ld, w, cols, inner, s, mag);
  }
  return py::make_tuple(sums, check ? py::object(magnitude) : py::object(py::none()));
}

py::tuple digit_sums(const py::array& M, const py::array_t<double, py::array::c_style>& W,
                     bool check, const std::string& isa) {
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
  if (isa != "avx512" && isa != "avx2")
    throw py::value_error("isa must be 'avx512' or 'avx2', not '" + isa + "'");
  if (isa == "avx512" && !has_avx512())
    throw py::value_error("this CPU has no AVX-512");
  const bool wide = isa == "avx512";
  switch (dt.kind() == 'i' ? size : -size) {
    case 1: return typed<int8_t>(M, W, check, wide);
    case 2: return typed<int16_t>(M, W, check, wide);
    case 4: return typed<int32_t>(M, W, check, wide);
    case 8: return typed<int64_t>(M, W, check, wide);
    case -1: return typed<uint8_t>(M, W, check, wide);
    case -2: return typed<uint16_t>(M, W, check, wide);
    case -4: return typed<uint32_t>(M, W, check, wide);
    default: throw py::type_error("digit_sums does not take " + std::string(py::str(dt)));
  }
}

}  // namespace

PYBIND11_MODULE(exact_host, m) {
  if (!has_avx2())
    throw py::import_error("verifier.exact_host needs a CPU with AVX2 and FMA");
  const char* best = has_avx512() ? "avx512" : "avx2";
  m.doc() = "The verifier's exact-mode host loop: integer matrix times float64 digit columns";
  m.attr("ISA") = best;
  m.def("digit_sums", &digit_sums, py::arg("M"), py::arg("W"), py::arg("check"),
        py::arg("isa") = best,
        "(sums, magnitudes): sums (cols, rows) float64 with sums[c, i] = sum_j M[i, j] W[c, j], "
        "exact when every partial sum is an integer within 2^53; with check, each row's "
        "largest |M[i, j]| as float64 (else None). isa: the loop to run, ISA (the widest "
        "this CPU has) by default.");
}
