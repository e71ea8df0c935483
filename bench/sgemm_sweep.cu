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

#define LAUNCHER(...) launch<__VA_ARGS__, true>,
static void (*kLaunchers[])(const float*, const float*, float*, int, int, int) = {
    SGEMM_VARIANTS(LAUNCHER)};

extern "C" int sweep_count() { return sizeof(kNames) / sizeof(kNames[0]); }
extern "C" const char* sweep_name(int v) { return kNames[v]; }
// Runs variant v on device pointers (K, N multiples of 4); returns the launch's CUDA error code.
extern "C" int sweep_run(int v, const float* A, const float* B, float* C, int M, int N, int K) {
  kLaunchers[v](A, B, C, M, N, K);
  return static_cast<int>(cudaGetLastError());
}
