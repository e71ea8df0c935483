// Tile configurations of csrc/sgemm.cuh behind a C ABI, for bench/sgemm_sweep.py to time against
// cuBLAS. Build: nvcc -O3 -arch=sm_90 -shared -Xcompiler -fPIC bench/sgemm_sweep.cu -o sweep.so
#include "../csrc/sgemm.cuh"

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
