#include <pybind11/pybind11.h>
namespace py = pybind11;
PYBIND11_MODULE(ndarray_backend_cuda, m) { m.attr("__device_name__") = "cuda"; }
