// Tile configurations of csrc/sgemm.cuh (float32) and csrc/tf32_hopper.cuh (TF32, sm_90a) behind
// a C ABI, for bench/sgemm_sweep.py to time against cuBLAS. Build:
// nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -o sweep.so
//      bench/sgemm_sweep.cu
#include <cstdio>
#include <exception>

#include "../csrc/sgemm.cuh"
#include "../csrc/tf32_hopper.cuh"

using namespace sgemm;

// BM, BN, BK, WM, WN, TM, TN, blocks/SM, block-row panel (sgemm::Wide and sgemm::Small first)
#define SGEMM_VARIANTS(X)                           \
  X(Config<128, 128, 8, 64, 64, 8, 16, 2, 8>)       \
  X(Config<64, 64, 8, 32, 64, 8, 8, 4, 8>)          \
  X(Config<128, 128, 8, 64, 64, 8, 16, 2>)          \
  X(Config<128, 128, 16, 64, 64, 8, 16, 2, 8>)      \
  X(Config<128, 128, 8, 64, 32, 8, 8, 2, 8>)        \
  X(Config<128, 128, 8, 32, 64, 8, 8, 2, 8>)        \
  X(Config<128, 64, 8, 64, 32, 8, 8, 4, 8>)

#define NAME(...) #__VA_ARGS__,
static const char* kNames[] = {SGEMM_VARIANTS(NAME)};

#define VEC_LAUNCHER(...) launch<__VA_ARGS__, true>,
#define ANY_LAUNCHER(...) launch<__VA_ARGS__, false>,
using Launcher = void (*)(const float*, const float*, float*, int, int, int);
static Launcher kVecLaunchers[] = {SGEMM_VARIANTS(VEC_LAUNCHER)};
static Launcher kAnyLaunchers[] = {SGEMM_VARIANTS(ANY_LAUNCHER)};

extern "C" int sweep_count() { return sizeof(kNames) / sizeof(kNames[0]); }
extern "C" const char* sweep_name(int v) { return kNames[v]; }
// Runs variant v on device pointers, with 16-byte copies where K and N allow them, as `matmul`
// does; returns the launch's CUDA error code.
extern "C" int sweep_run(int v, const float* A, const float* B, float* C, int M, int N, int K) {
  (K % 4 == 0 && N % 4 == 0 ? kVecLaunchers : kAnyLaunchers)[v](A, B, C, M, N, K);
  return static_cast<int>(cudaGetLastError());
}

// TF32 (tf32_hopper): BN, stages, persistent (the module's Large and Small first)
#define TF32_VARIANTS(X)                   \
  X(tf32_hopper::Config<256, 4, true>)     \
  X(tf32_hopper::Config<128, 6, true>)     \
  X(tf32_hopper::Config<256, 4, false>)    \
  X(tf32_hopper::Config<256, 3, true>)     \
  X(tf32_hopper::Config<128, 4, true>)

static const char* kTf32Names[] = {TF32_VARIANTS(NAME)};
#define TF32_LAUNCHER(...) tf32_hopper::gemm<__VA_ARGS__>,
using Tf32Launcher = cudaError_t (*)(const float*, int64_t, const float*, int64_t, float*, int, int,
                                     int, int);
static Tf32Launcher kTf32Launchers[] = {TF32_VARIANTS(TF32_LAUNCHER)};

extern "C" int tf32_count() { return sizeof(kTf32Names) / sizeof(kTf32Names[0]); }
extern "C" const char* tf32_name(int v) { return kTf32Names[v]; }
// C = A B by TF32 variant v. `bt` (N x padded_rows(K) floats) receives B^T and, with `pad_a`,
// `padded` (M x padded_rows(K)) a copy of A that the product then reads, unless `prepared`
// says they hold them already (to time the product alone). Returns a CUDA error code, or -1
// after printing a host-side failure.
extern "C" int tf32_run(int v, const float* A, const float* B, float* C, float* bt, float* padded,
                        int M, int N, int K, int pad_a, int prepared) {
  try {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    const int64_t ld = tf32_hopper::padded_rows(K);
    cudaError_t err = cudaSuccess;
    if (!prepared) err = tf32_hopper::transpose(B, bt, K, N, ld);
    if (!prepared && pad_a && err == cudaSuccess) err = tf32_hopper::pad_rows(A, padded, M, K, ld);
    if (err == cudaSuccess) {
      err = kTf32Launchers[v](pad_a ? padded : A, pad_a ? ld : K, bt, ld, C, M, N, K, sms);
    }
    return static_cast<int>(err);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tf32 variant %d: %s\n", v, e.what());
    return -1;
  }
}
