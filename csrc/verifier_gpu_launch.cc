// verifier.gpu_launch: a GPU exact check's host side in one call (verifier/gpu_exact.py).
// In Python the key, the argument writes, the launch and the wait for the verdict cost the
// host more than the matrices' read costs the GPU at n = 4096 (~8 of ~58 us on an H100's
// host); here they are one call that holds the GIL only to read its arguments.
//
// The CUDA driver is opened with dlopen when the first launcher is made (CuPy has it loaded
// by then), so the module builds and imports on machines without CUDA; field_key, the part
// that decides the verdict, is tested there against verifier/rng.py.
//
// Plain CPython API (METH_FASTCALL): a call with seven arguments costs tens of nanoseconds,
// where pybind11's dispatch costs hundreds.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// -- SHAKE128 (FIPS 202) ---------------------------------------------------------------------

constexpr uint64_t ROUND_CONSTANTS[24] = {
    0x0000000000000001ULL, 0x0000000000008082ULL, 0x800000000000808aULL,
    0x8000000080008000ULL, 0x000000000000808bULL, 0x0000000080000001ULL,
    0x8000000080008081ULL, 0x8000000000008009ULL, 0x000000000000008aULL,
    0x0000000000000088ULL, 0x0000000080008009ULL, 0x000000008000000aULL,
    0x000000008000808bULL, 0x800000000000008bULL, 0x8000000000008089ULL,
    0x8000000000008003ULL, 0x8000000000008002ULL, 0x8000000000000080ULL,
    0x000000000000800aULL, 0x800000008000000aULL, 0x8000000080008081ULL,
    0x8000000000008080ULL, 0x0000000080000001ULL, 0x8000000080008008ULL};
constexpr int RHO[25] = {0,  1,  62, 28, 27, 36, 44, 6,  55, 20, 3,  10, 43,
                         25, 39, 41, 45, 15, 21, 8,  18, 2,  61, 56, 14};  // lane x + 5 y
constexpr size_t RATE = 168;

inline uint64_t rotl(uint64_t v, int s) { return s == 0 ? v : (v << s) | (v >> (64 - s)); }

// Lane x + 5 y goes to lane PI[x + 5 y] = y + 5 ((2 x + 3 y) mod 5) in rho and pi.
constexpr int PI[25] = {0,  10, 20, 5,  15, 16, 1,  11, 21, 6,  7,  17, 2,
                        12, 22, 23, 8,  18, 3,  13, 14, 24, 9,  19, 4};

void keccak_f1600(uint64_t a[25]) {
  for (uint64_t constant : ROUND_CONSTANTS) {
    uint64_t c[5], b[25];
#pragma GCC unroll 5
    for (int x = 0; x < 5; ++x) c[x] = a[x] ^ a[x + 5] ^ a[x + 10] ^ a[x + 15] ^ a[x + 20];
#pragma GCC unroll 25
    for (int i = 0; i < 25; ++i)
      b[PI[i]] = rotl(a[i] ^ c[(i + 4) % 5] ^ rotl(c[(i + 1) % 5], 1), RHO[i]);
#pragma GCC unroll 25
    for (int i = 0; i < 25; ++i) {
      const int row = i - i % 5;
      a[i] = b[i] ^ (~b[row + (i + 1) % 5] & b[row + (i + 2) % 5]);
    }
    a[0] ^= constant;
  }
}

// The first 32 bytes of SHAKE128(message) (at most one rate of output, so one squeeze).
void shake128_32(const uint8_t* message, size_t length, uint8_t out[32]) {
  uint64_t state[25] = {};
  uint8_t block[RATE];
  for (;;) {
    const size_t take = length < RATE ? length : RATE;
    std::memset(block, 0, RATE);
    std::memcpy(block, message, take);
    if (take < RATE) {  // the last block: SHAKE's domain bits and the pad10*1 rule
      block[take] ^= 0x1F;
      block[RATE - 1] ^= 0x80;
    }
    for (size_t i = 0; i < RATE / 8; ++i) {
      uint64_t lane = 0;
      for (int byte = 7; byte >= 0; --byte) lane = lane << 8 | block[8 * i + byte];
      state[i] ^= lane;
    }
    keccak_f1600(state);
    if (take < RATE) break;
    message += RATE;
    length -= RATE;
  }
  for (int i = 0; i < 32; ++i) out[i] = uint8_t(state[i / 8] >> (8 * (i % 8)));
}

// verifier.rng.field_key: SHAKE128(prefix || len(seed) as 8 bytes big-endian || seed || label).
void field_key(const std::string& prefix, const uint8_t* seed, size_t seed_length,
               const std::string& label, uint8_t key[32]) {
  const size_t length = prefix.size() + 8 + seed_length + label.size();
  uint8_t small[2 * RATE];
  std::vector<uint8_t> large(length > sizeof small ? length : 0);
  uint8_t* message = large.empty() ? small : large.data();
  std::memcpy(message, prefix.data(), prefix.size());
  for (int byte = 0; byte < 8; ++byte)
    message[prefix.size() + byte] = uint8_t(uint64_t(seed_length) >> (8 * (7 - byte)));
  std::memcpy(message + prefix.size() + 8, seed, seed_length);
  std::memcpy(message + prefix.size() + 8 + seed_length, label.data(), label.size());
  shake128_32(message, length, key);
}

// -- the CUDA driver, opened at run time -------------------------------------------------------

using LaunchCooperative = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void*, void**);
using StreamSynchronize = int (*)(void*);
using ErrorString = int (*)(int, const char**);

struct Driver {
  LaunchCooperative launch = nullptr;
  StreamSynchronize synchronize = nullptr;
  ErrorString error_string = nullptr;
};
Driver driver;

bool open_driver() {
  if (driver.launch != nullptr) return true;
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "cannot open the CUDA driver (libcuda.so.1): %s", dlerror());
    return false;
  }
  driver.launch = reinterpret_cast<LaunchCooperative>(dlsym(cuda, "cuLaunchCooperativeKernel"));
  driver.synchronize = reinterpret_cast<StreamSynchronize>(dlsym(cuda, "cuStreamSynchronize"));
  driver.error_string = reinterpret_cast<ErrorString>(dlsym(cuda, "cuGetErrorString"));
  if (!driver.launch || !driver.synchronize || !driver.error_string) {
    driver = Driver{};
    PyErr_SetString(PyExc_RuntimeError, "the CUDA driver lacks cuLaunchCooperativeKernel");
    return false;
  }
  return true;
}

std::string cuda_error(const char* what, int code) {
  const char* text = nullptr;
  driver.error_string(code, &text);
  return std::string(what) + " failed: " + (text ? text : "CUDA error " + std::to_string(code));
}

// -- the launcher ----------------------------------------------------------------------------

// Everything of one plan's check but A, B, C, the seed, the stream and the ticket; the memory
// it points to (argument block, pinned verdict) is owned by the Python plan holding it.
struct Launcher {
  void* function;
  unsigned grid, threads;
  void** parameters;
  uint64_t* arguments;
  int key_index, derive_index, words_index, ticket_index;
  uint64_t words;
  volatile int64_t* verdict;  // rows that differ, the first, a word rejected, the ticket
  std::string prefix, label;
  int64_t spin_ns;
};

constexpr const char* CAPSULE = "verifier.gpu_launch.Launcher";

void free_launcher(PyObject* capsule) {
  delete static_cast<Launcher*>(PyCapsule_GetPointer(capsule, CAPSULE));
}

bool as_u64(PyObject* value, uint64_t* out) {
  *out = PyLong_AsUnsignedLongLong(value);
  return !(*out == uint64_t(-1) && PyErr_Occurred());
}

bool as_string(PyObject* value, std::string* out) {
  if (!PyBytes_Check(value)) {
    PyErr_SetString(PyExc_TypeError, "prefix and label must be bytes");
    return false;
  }
  out->assign(PyBytes_AS_STRING(value), size_t(PyBytes_GET_SIZE(value)));
  return true;
}

// launcher(function, grid, threads, parameters, arguments, key_index, derive_index,
//          words_index, words, ticket_index, verdict, prefix, label, spin_ns) -> capsule
PyObject* make_launcher(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 14) {
    PyErr_SetString(PyExc_TypeError, "launcher takes 14 arguments");
    return nullptr;
  }
  uint64_t v[14];
  for (int i : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13})
    if (!as_u64(args[i], &v[i])) return nullptr;
  if (!open_driver()) return nullptr;
  auto* launcher = new Launcher{reinterpret_cast<void*>(v[0]), unsigned(v[1]), unsigned(v[2]),
                                reinterpret_cast<void**>(v[3]), reinterpret_cast<uint64_t*>(v[4]),
                                int(v[5]), int(v[6]), int(v[7]), int(v[9]), v[8],
                                reinterpret_cast<volatile int64_t*>(v[10]), {}, {}, int64_t(v[13])};
  if (!as_string(args[11], &launcher->prefix) || !as_string(args[12], &launcher->label)) {
    delete launcher;
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(launcher, CAPSULE, free_launcher);
  if (capsule == nullptr) delete launcher;
  return capsule;
}

// check(launcher, A, B, C, seed, stream, ticket) -> (rows that differ, first, word rejected):
// the key, the argument block, the launch and the wait for the kernel's ticket, all with the
// GIL released; past spin_ns of polling the stream is synchronised instead.
PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "check takes 7 arguments");
    return nullptr;
  }
  auto* launcher = static_cast<Launcher*>(PyCapsule_GetPointer(args[0], CAPSULE));
  if (launcher == nullptr) return nullptr;
  uint64_t a, b, c, stream, ticket;
  if (!as_u64(args[1], &a) || !as_u64(args[2], &b) || !as_u64(args[3], &c) ||
      !as_u64(args[5], &stream) || !as_u64(args[6], &ticket))
    return nullptr;
  if (!PyBytes_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "seed must be bytes");
    return nullptr;
  }
  const auto* seed = reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(args[4]));
  const size_t seed_length = size_t(PyBytes_GET_SIZE(args[4]));
  std::string error;
  int64_t wrong = 0, first = 0, rejected = 0;
  Py_BEGIN_ALLOW_THREADS  // the caller's reference keeps seed alive
  uint8_t key[32];
  field_key(launcher->prefix, seed, seed_length, launcher->label, key);
  uint64_t* arguments = launcher->arguments;
  arguments[0] = a;
  arguments[1] = b;
  arguments[2] = c;
  std::memcpy(arguments + launcher->key_index, key, 32);
  arguments[launcher->derive_index] = 1;
  arguments[launcher->words_index] = launcher->words;
  arguments[launcher->ticket_index] = ticket;
  const int launched = driver.launch(launcher->function, launcher->grid, 1, 1, launcher->threads,
                                     1, 1, 0, reinterpret_cast<void*>(stream),
                                     launcher->parameters);
  if (launched != 0) {
    error = cuda_error("cuLaunchCooperativeKernel", launched);
  } else {
    volatile int64_t* verdict = launcher->verdict;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(launcher->spin_ns);
    while (uint64_t(verdict[3]) != ticket) {
      if (std::chrono::steady_clock::now() > deadline) {  // a long check or a busy stream
        const int synced = driver.synchronize(reinterpret_cast<void*>(stream));
        if (synced != 0) error = cuda_error("cuStreamSynchronize", synced);
        else if (uint64_t(verdict[3]) != ticket) error = "the check's kernel ended without writing its verdict";
        break;
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);  // the verdict was written before the ticket
    wrong = verdict[0];
    first = verdict[1];
    rejected = verdict[2];
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  return Py_BuildValue("(LLL)", (long long)wrong, (long long)first, (long long)rejected);
}

// field_key(prefix, seed, label) -> the 32-byte key check derives (tested against rng.py)
PyObject* key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  std::string prefix, seed, label;
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "field_key takes 3 arguments");
    return nullptr;
  }
  if (!as_string(args[0], &prefix) || !as_string(args[1], &seed) || !as_string(args[2], &label))
    return nullptr;
  uint8_t out[32];
  field_key(prefix, reinterpret_cast<const uint8_t*>(seed.data()), seed.size(), label, out);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out), 32);
}

PyMethodDef METHODS[] = {
    {"launcher", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(make_launcher)),
     METH_FASTCALL, "A plan's launcher (a capsule) for check."},
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(check)), METH_FASTCALL,
     "Launch the check and wait for its verdict: (rows that differ, first, word rejected)."},
    {"field_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(key)), METH_FASTCALL,
     "SHAKE128(prefix || len(seed) || seed || label)[:32], as check derives it."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "gpu_launch",
                      "A GPU exact check's host side in one call.", -1, METHODS};

}  // namespace

PyMODINIT_FUNC PyInit_gpu_launch() { return PyModule_Create(&MODULE); }
