// float32 SGEMM, C (M x N) = A (M x K) @ B (K x N), all row-major; included by the CUDA module
// and by bench/sgemm_sweep.cu, which times tile configurations against cuBLAS.
//
// Each block computes a BM x BN tile of C, stepping through K in slices of BK that are staged in
// shared memory, double-buffered: the next slice is fetched from global memory while the current
// one is multiplied, then stored to the other buffer, so one barrier per slice suffices. With
// 16-byte rows (VEC: K and N multiples of 4) the fetch is cp.async, B's straight into its buffer
// and A's into a per-thread staging area that the same thread then transposes; otherwise the
// fetch goes through registers. A is stored transposed (k-major, rows padded by 4 floats
// against bank conflicts) so both operands are read as float4. Each warp owns a WM x WN
// sub-tile; each thread a TM x TN tile made of 4 x 4 quarters spread evenly over the warp tile,
// so that a warp's shared-memory reads are broadcasts of at most 128 contiguous bytes; the
// operand fragments are double-buffered in registers across k steps.
//
// Edges: rows of A and columns of B past the matrix are clamped to the last one (their products
// land only in C elements that are never stored), so only the last, partial K slice needs
// checks, where out-of-range k reads zeros. GROUP > 0 walks the blocks in panels of GROUP block
// rows, for L2 reuse.
//
// The main loop has no branch around the next slice's fetch, stash and barrier (the last
// iteration fetches its own slice again into the idle buffer): with one, ptxas sank the global
// loads to just before the shared-memory stores and their latency showed (removing it took
// 0.81x to 0.86-0.88x of cuBLAS at 4096 on an H100; bench/RESULTS.md has the sweep).
#pragma once

#include <cuda_runtime.h>

namespace sgemm {

// 16 bytes global -> shared without passing through registers (sm_80+); zeros when !valid.
__device__ __forceinline__ void copy16_async(float* smem, const float* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
#else
  *reinterpret_cast<float4*>(smem) =
      valid ? __ldg(reinterpret_cast<const float4*>(gmem)) : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
}

__device__ __forceinline__ void wait_async_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::);
#endif
}

template <int BM_, int BN_, int BK_, int WM_, int WN_, int TM_, int TN_, int MIN_BLOCKS,
          int GROUP = 0>
struct Config {
  static constexpr int kWarps = (BM_ / WM_) * (BN_ / WN_);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = MIN_BLOCKS;
  static constexpr int kGroup = GROUP;
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, TM = TM_, TN = TN_;
  static constexpr int kThreadRows = WM / TM;  // threads of a warp along M
  static constexpr int kThreadCols = WN / TN;  // threads of a warp along N
  static constexpr int kALoads = BM * BK / 4 / kThreads;  // float4 per thread per slice
  static constexpr int kBLoads = BK * BN / 4 / kThreads;
  static_assert(kThreadRows * kThreadCols == 32, "a warp tile must hold 32 thread tiles");
  static_assert(TM % 4 == 0 && TN % 4 == 0, "thread tiles are made of 4 x 4 quarters");
  static_assert(kALoads * kThreads * 4 == BM * BK, "A slice must split evenly over threads");
  static_assert(kBLoads * kThreads * 4 == BK * BN, "B slice must split evenly over threads");
};

template <typename Cfg, bool VEC>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    sgemm_kernel(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                 int M, int N, int K) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, WM = Cfg::WM, WN = Cfg::WN;
  constexpr int TM = Cfg::TM, TN = Cfg::TN;
  constexpr int kAPad = BM + 4;
  constexpr int kRowGroups = TM / 4, kColGroups = TN / 4;  // 4 x 4 quarters of a thread tile
  constexpr int kRowSpacing = WM / kRowGroups, kColSpacing = WN / kColGroups;
  __shared__ __align__(16) float As[2][BK][kAPad];
  __shared__ __align__(16) float Bs[2][BK][BN];

  int block_row = blockIdx.y, block_col = blockIdx.x;
  if constexpr (Cfg::kGroup > 0) {
    const int id = blockIdx.y * gridDim.x + blockIdx.x;
    const int panel = id / (Cfg::kGroup * gridDim.x);
    const int first = panel * Cfg::kGroup;
    const int rows = min(static_cast<int>(gridDim.y) - first, Cfg::kGroup);
    const int within = id - panel * Cfg::kGroup * gridDim.x;
    block_row = first + within % rows;
    block_col = within / rows;
  }
  const int tid = threadIdx.x;
  const int block_m = block_row * BM;
  const int block_n = block_col * BN;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = (warp / (BN / WN)) * WM;
  const int warp_n = (warp % (BN / WN)) * WN;
  const int thread_m = warp_m + (lane / Cfg::kThreadCols) * 4;
  const int thread_n = warp_n + (lane % Cfg::kThreadCols) * 4;

  // Fixed per-thread load positions: A rows and B columns clamped into the matrix.
  const float* a_src[Cfg::kALoads];
  int a_col[Cfg::kALoads];
#pragma unroll
  for (int i = 0; i < Cfg::kALoads; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    a_col[i] = (idx % (BK / 4)) * 4;
    const int row = min(block_m + idx / (BK / 4), M - 1);
    a_src[i] = A + static_cast<size_t>(row) * K + a_col[i];
  }
  const float* b_src[Cfg::kBLoads];
  int b_row[Cfg::kBLoads];
  int b_cols[Cfg::kBLoads][VEC ? 1 : 4];  // clamped columns (VEC: of one float4)
#pragma unroll
  for (int i = 0; i < Cfg::kBLoads; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    b_row[i] = idx / (BN / 4);
    const int col = block_n + (idx % (BN / 4)) * 4;
    b_src[i] = B + static_cast<size_t>(b_row[i]) * N;
    if constexpr (VEC) {
      b_cols[i][0] = min(col, N - 4);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) b_cols[i][j] = min(col + j, N - 1);
    }
  }

  // Starts bringing in slice k0: with VEC by cp.async, A's into the thread's own slots of
  // Astage (transposed by `stash`), B's straight into buffer `dst`; otherwise into registers by
  // 4-byte loads (4-byte cp.async measured slower there). `edge` (the last slice when BK does
  // not divide K) reads zeros for k >= K; such copies read nothing and point at the matrix's
  // start all the same.
  float4 a_stage[VEC ? 1 : Cfg::kALoads], b_stage[VEC ? 1 : Cfg::kBLoads];
  __shared__ __align__(16) float4 Astage[VEC ? Cfg::kALoads : 1][VEC ? Cfg::kThreads : 1];
  auto fetch = [&](int k0, bool edge, int dst) {
#pragma unroll
    for (int i = 0; i < Cfg::kALoads; ++i) {
      const float* p = a_src[i] + k0;
      if constexpr (VEC) {
        const bool inside = !edge || k0 + a_col[i] < K;
        copy16_async(&Astage[i][tid].x, inside ? p : A, inside);
      } else {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = (!edge || k0 + a_col[i] + j < K) ? __ldg(p + j) : 0.f;
        a_stage[i] = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < Cfg::kBLoads; ++i) {
      const bool inside = !edge || k0 + b_row[i] < K;
      const float* p = b_src[i] + static_cast<size_t>(k0) * N;
      if constexpr (VEC) {
        float* to = &Bs[dst][b_row[i]][((tid + i * Cfg::kThreads) % (BN / 4)) * 4];
        copy16_async(to, inside ? p + b_cols[i][0] : B, inside);
      } else {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = inside ? __ldg(p + b_cols[i][j]) : 0.f;
        b_stage[i] = make_float4(v[0], v[1], v[2], v[3]);
      }
    }
  };
  // Stores the staged slice into buffer `buf` (after the thread's async copies have landed):
  // A's transposed, and B's where it came through registers.
  auto stash = [&](int buf) {
#pragma unroll
    for (int i = 0; i < Cfg::kALoads; ++i) {
      float4 v;
      if constexpr (VEC) {
        v = Astage[i][tid];
      } else {
        v = a_stage[i];
      }
      const int idx = tid + i * Cfg::kThreads;
      const int row = idx / (BK / 4), col = (idx % (BK / 4)) * 4;
      As[buf][col + 0][row] = v.x;
      As[buf][col + 1][row] = v.y;
      As[buf][col + 2][row] = v.z;
      As[buf][col + 3][row] = v.w;
    }
    if constexpr (!VEC) {
#pragma unroll
      for (int i = 0; i < Cfg::kBLoads; ++i) {
        const int idx = tid + i * Cfg::kThreads;
        const int row = idx / (BN / 4), col = (idx % (BN / 4)) * 4;
        *reinterpret_cast<float4*>(&Bs[buf][row][col]) = b_stage[i];
      }
    }
  };

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

  const int tiles = (K + BK - 1) / BK;
  fetch(0, BK > K, 0);
  wait_async_copies();
  stash(0);
  __syncthreads();

  float a[2][TM], b[2][TN];
  auto read_fragments = [&](int buf, int k, int slot) {
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g)
      *reinterpret_cast<float4*>(&a[slot][g * 4]) =
          *reinterpret_cast<const float4*>(&As[buf][k][thread_m + g * kRowSpacing]);
#pragma unroll
    for (int g = 0; g < kColGroups; ++g)
      *reinterpret_cast<float4*>(&b[slot][g * 4]) =
          *reinterpret_cast<const float4*>(&Bs[buf][k][thread_n + g * kColSpacing]);
  };
  auto multiply = [&](int slot) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[slot][i], b[slot][j], acc[i][j]);
  };

  // No branch around the next slice's fetch, stash and barrier (see the top of this file).
  read_fragments(0, 0, 0);
  for (int t = 0; t < tiles; ++t) {
    const int buf = t & 1;
    const int next = min(t + 1, tiles - 1) * BK;
    const bool edge = next + BK > K;
    fetch(next, edge, buf ^ 1);
    // Step k's multiply-adds run while step k + 1's shared-memory reads are in flight.
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      if (k + 1 < BK) {
        read_fragments(buf, k + 1, (k + 1) % 2);
      } else {
        wait_async_copies();
        stash(buf ^ 1);
        __syncthreads();
        read_fragments(buf ^ 1, 0, (k + 1) % 2);
      }
      multiply(k % 2);
    }
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int row = block_m + thread_m + (i / 4) * kRowSpacing + i % 4;
    if (row >= M) continue;
#pragma unroll
    for (int g = 0; g < kColGroups; ++g) {
      const int col = block_n + thread_n + g * kColSpacing;
      float* dst = C + static_cast<size_t>(row) * N + col;
      const float* v = &acc[i][g * 4];
      if constexpr (VEC) {
        if (col < N) *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (col + j < N) dst[j] = v[j];
      }
    }
  }
}

template <typename Cfg, bool VEC>
void launch(const float* A, const float* B, float* C, int M, int N, int K) {
  dim3 grid((N + Cfg::BN - 1) / Cfg::BN, (M + Cfg::BM - 1) / Cfg::BM);
  sgemm_kernel<Cfg, VEC><<<grid, Cfg::kThreads>>>(A, B, C, M, N, K);
}

// Measured on an H100 (bench/RESULTS.md): 4-warp blocks of 8 x 16 thread tiles are the fastest
// per multiprocessor, but a lone one runs slowly, so a nearly empty last wave costs almost a full
// one; 64 x 64 tiles make four times the blocks and waves with small tails.
using Wide = Config<128, 128, 8, 64, 64, 8, 16, 2, 8>;
using Small = Config<64, 64, 8, 32, 64, 8, 8, 4, 8>;

}  // namespace sgemm
