// TF32 tensor-core GEMM for Hopper (sm_90a): C (M x N) = A (M x K) @ B (K x N), all row-major
// float32, operands in TF32, float32 accumulation. Included by the CUDA module (its explicit
// `matmul_tf32` on an H100/H200) and by bench/sgemm_sweep.cu, which times configurations
// against cuBLAS.
//
// TF32 wgmma reads both shared-memory operands K-major. A is; B is N-major, so B is first
// transposed into a scratch buffer (B^T, N x K, elements rounded to TF32 on the way: cvt.rna;
// rows padded to whole 128-byte lines, as TMA reads misaligned rows much more slowly), and both
// operands then come from shared memory (no per-k register traffic, wgmmas stay in flight
// across K slices). Each block computes 128 x BN tiles of C with three warpgroups:
//  - a producer warp issues TMA bulk tensor copies (`cp.async.bulk.tensor.2d`, 128-byte
//    swizzle, zero fill past the matrix) of 32-float K slices of A and B^T into a STAGES-deep
//    ring; each stage has a `full` mbarrier (the copies' bytes landed) and an `empty` one (every
//    consumer warp is done with it);
//  - two consumer warpgroups, 64 rows of the tile each, issue 4 `wgmma m64nBNk8` per slice and
//    keep one slice's group in flight (`wgmma.wait_group 1`), releasing a stage once the
//    wgmmas that read it have completed; the epilogue stores straight from the accumulators.
// `setmaxnreg` moves registers from the producer to the consumers. Tiles are walked in panels of
// 8 block rows so that neighbouring blocks share A and B^T in L2; PERSISTENT blocks (one per
// multiprocessor) loop over tiles, so the producer fills the next tile's stages while the
// consumers store the last one. The tensor cores truncate A's float32 bits to TF32 (2^-10
// relative at most, the bound the verifier's tf32 class assumes); B^T is rounded (2^-11).
//
// Tensor maps are made on the host by cuTensorMapEncodeTiled, reached through the runtime's
// cudaGetDriverEntryPointByVersion: the module links no libcuda and imports without a driver.
// TMA needs row strides of whole 16 bytes: where K is not a multiple of 4, A is first copied
// into padded rows too (`pad_rows`, also rounding to TF32); any M, N, K > 0 then run.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tf32_hopper {

template <int BN_, int STAGES_, bool PERSISTENT_>
struct Config {
  static constexpr int BM = 128, BN = BN_, BK = 32, STAGES = STAGES_;
  static constexpr bool kPersistent = PERSISTENT_;
  static constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
  static constexpr int kAStage = BM * BK, kBStage = BN * BK;  // floats per stage
  static constexpr uint32_t kStageBytes = sizeof(float) * (kAStage + kBStage);
  // + 1024: the swizzled tiles must start on a 1024-byte boundary; then the mbarriers
  static constexpr size_t kSharedBytes = 1024 + STAGES * kStageBytes + 2 * STAGES * 8;
  static_assert(BN == 128 || BN == 256, "wgmma m64n128k8 or m64n256k8");
  static_assert(kSharedBytes <= 227 * 1024, "more shared memory than a multiprocessor has");
};

__device__ __forceinline__ float round_to_tf32(float x) {
  uint32_t rounded;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(rounded) : "f"(x));
  return __uint_as_float(rounded);
}

// B^T (N x K, rows of `ld` floats) = B (K x N) transposed, elements rounded to TF32, through
// 32 x 32 shared tiles.
__global__ void __launch_bounds__(256) transpose_kernel(const float* __restrict__ B,
                                                        float* __restrict__ Bt, int K, int N,
                                                        int64_t ld) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // only the sm_90a path launches it
#else
  __shared__ float tile[32][33];
  const int n0 = blockIdx.x * 32, tiles_k = (K + 31) / 32;
  for (int tk = blockIdx.y; tk < tiles_k; tk += gridDim.y) {
    const int k0 = tk * 32;
#pragma unroll
    for (int i = threadIdx.y; i < 32; i += 8) {
      const int k = k0 + i, n = n0 + threadIdx.x;
      if (k < K && n < N) tile[i][threadIdx.x] = B[static_cast<size_t>(k) * N + n];
    }
    __syncthreads();
#pragma unroll
    for (int i = threadIdx.y; i < 32; i += 8) {
      const int n = n0 + i, k = k0 + threadIdx.x;
      if (n < N && k < K) {
        Bt[n * ld + k] = round_to_tf32(tile[threadIdx.x][i]);
      }
    }
    __syncthreads();
  }
#endif
}

// A (M x K) copied into rows of `ld` floats, elements rounded to TF32.
__global__ void __launch_bounds__(256) pad_rows_kernel(const float* __restrict__ A,
                                                       float* __restrict__ padded, int M, int K,
                                                       int64_t ld) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // only the sm_90a path launches it
#else
  for (int row = blockIdx.y; row < M; row += gridDim.y) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < K; k += gridDim.x * blockDim.x) {
      padded[row * ld + k] =
          round_to_tf32(A[static_cast<size_t>(row) * K + k]);
    }
  }
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)),
               "r"(arrivals));
}

// Arrives and announces `bytes` of copies that will complete on the barrier.
__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   smem_address(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// TMA: the box at (x = k, y = row) of `map` into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load(float* dst, const CUtensorMap* map, int x, int y,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_address(bar))
      : "memory");
}

// Shared-memory matrix descriptor of a K-major tile in 128-byte swizzle: start address, leading
// byte offset 16 (unused with swizzling), stride byte offset 1024 (8 rows of 128 bytes).
__device__ __forceinline__ uint64_t descriptor(const float* tile) {
  const uint64_t address = smem_address(tile);
  return ((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma(float (&d)[128], uint64_t a_desc, uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
      "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
        "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
        "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
        "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
        "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
        "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
        "+f"(d[126]), "+f"(d[127])
      : "l"(a_desc), "l"(b_desc), "r"(1));
}

__device__ __forceinline__ void wgmma(float (&d)[64], uint64_t a_desc, uint64_t b_desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a_desc), "l"(b_desc), "r"(1));
}

// Pins an accumulator's value to this point: wgmma writes it asynchronously, after the
// instruction that issued it, until a wait_group.
__device__ __forceinline__ void keep(float& r) { asm volatile("" : "+f"(r)::"memory"); }

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Origin of tile `tile` when tiles are walked in panels of 8 block rows.
__device__ __forceinline__ void tile_origin(int tile, int grid_m, int grid_n, int bm, int bn,
                                            int& m0, int& n0) {
  constexpr int kPanel = 8;
  const int panel = tile / (kPanel * grid_n), in_panel = tile % (kPanel * grid_n);
  const int rows = min(grid_m - panel * kPanel, kPanel);
  m0 = (panel * kPanel + in_panel % rows) * bm;
  n0 = (in_panel / rows) * bn;
}
#endif  // sm_90a

template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap a_map,
                const __grid_constant__ CUtensorMap bt_map, float* __restrict__ C, int M, int N,
                int K) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // the module launches it only where its probe found sm_90a code
#else
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = T::STAGES;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw);
  float* As = reinterpret_cast<float*>(smem_raw + ((1024 - (raw & 1023)) & 1023));
  float* Bs = As + STAGES * T::kAStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(Bs + STAGES * T::kBStage);
  uint64_t* empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + s, 1);   // the producer's arrive (plus the copies' bytes)
      barrier_init(empty + s, 8);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int grid_m = (M + BM - 1) / BM, grid_n = (N + BN - 1) / BN;
  const int tiles = grid_m * grid_n, k_slices = (K + BK - 1) / BK;
  const int step = T::kPersistent ? gridDim.x : tiles;
  const int warpgroup = threadIdx.x / 128;
  int stage = 0;
  uint32_t phase = 0;  // parity of the ring's current pass
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      bool first_pass = true;
      for (int tile = blockIdx.x; tile < tiles; tile += step) {
        int m0, n0;
        tile_origin(tile, grid_m, grid_n, BM, BN, m0, n0);
        for (int k = 0; k < k_slices; ++k) {
          if (!first_pass) barrier_wait(empty + stage, phase ^ 1);
          barrier_expect_bytes(full + stage, T::kStageBytes);
          tma_load(As + stage * T::kAStage, &a_map, k * BK, m0, full + stage);
          tma_load(Bs + stage * T::kBStage, &bt_map, k * BK, n0, full + stage);
          if (++stage == STAGES) stage = 0, phase ^= 1, first_pass = false;
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int row0 = (warpgroup - 1) * 64;  // this warpgroup's rows of the tile
    const bool leader = threadIdx.x % 32 == 0;  // each warp signals its own wgmmas' completion
    float acc[BN / 2];
    for (int tile = blockIdx.x; tile < tiles; tile += step) {
      int m0, n0;
      tile_origin(tile, grid_m, grid_n, BM, BN, m0, n0);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      int previous = 0;
      for (int k = 0; k < k_slices; ++k) {
        barrier_wait(full + stage, phase);
        const uint64_t a_desc = descriptor(As + stage * T::kAStage + row0 * BK);
        const uint64_t b_desc = descriptor(Bs + stage * T::kBStage);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < BK / 8; ++s) wgmma(acc, a_desc + 2 * s, b_desc + 2 * s);  // +32 B
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        wgmma_wait<1>();  // the previous slice's wgmmas are done: its stage is free
        if (k > 0 && leader) barrier_arrive(empty + previous);
        previous = stage;
        if (++stage == STAGES) stage = 0, phase ^= 1;
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) keep(acc[i]);
      if (leader) barrier_arrive(empty + previous);

      // acc[4j + 2h + e]: row 16 warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + e of this
      // warpgroup's 64 x BN part. Pairs are stored as float2 where N is even (8-byte aligned).
      const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
      const int row = m0 + row0 + 16 * warp + lane / 4, col = n0 + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row + 8 * h, c = col + 8 * j;
          if (r >= M || c >= N) continue;
          float* dst = C + static_cast<size_t>(r) * N + c;
          if (N % 2 == 0) {
            *reinterpret_cast<float2*>(dst) =
                make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          } else {
            dst[0] = acc[4 * j + 2 * h];
            if (c + 1 < N) dst[1] = acc[4 * j + 2 * h + 1];
          }
        }
      }
    }
  }
#endif
}

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

inline EncodeTiled tensor_map_encoder() {
  static EncodeTiled encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw std::runtime_error("matmul_tf32: the CUDA driver has no cuTensorMapEncodeTiled");
    }
    encode = reinterpret_cast<EncodeTiled>(fn);
  }
  return encode;
}

// Tensor map of a rows x K matrix in rows of `ld` floats, copied in boxes of box_rows x 32
// floats (one 128-byte swizzle row each) with zeros past its edges.
inline CUtensorMap k_major_map(const float* m, int rows, int K, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * sizeof(float)};
  const cuuint32_t box[2] = {32, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(m), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error("matmul_tf32: cuTensorMapEncodeTiled failed (CUresult " +
                             std::to_string(static_cast<int>(result)) + ")");
  }
  return map;
}

// Row length of the scratch operands: whole 128-byte lines.
inline int64_t padded_rows(int K) { return (int64_t{K} + 31) / 32 * 32; }

// Writes B^T (N x K, rounded to TF32) into `bt`, N rows of `ld` floats; returns the launch's
// error.
inline cudaError_t transpose(const float* B, float* bt, int K, int N, int64_t ld) {
  const dim3 grid((N + 31) / 32, static_cast<unsigned>(std::min((K + 31) / 32, 65535)));
  transpose_kernel<<<grid, dim3(32, 8)>>>(B, bt, K, N, ld);
  return cudaGetLastError();
}

// Copies A (M x K, rounded to TF32) into `padded`, M rows of `ld` floats; returns the launch's
// error.
inline cudaError_t pad_rows(const float* A, float* padded, int M, int K, int64_t ld) {
  const dim3 grid((K + 255) / 256, static_cast<unsigned>(std::min(M, 65535)));
  pad_rows_kernel<<<grid, 256>>>(A, padded, M, K, ld);
  return cudaGetLastError();
}

// C = A B from A (rows of `lda` floats) and `bt` = B^T as `transpose` leaves it (rows of `ldb`);
// returns the launch's error. M, N, K > 0; lda and ldb multiples of 4 and A, `bt` 16-byte
// aligned (TMA's requirements); C 8-byte aligned.
template <typename T>
cudaError_t gemm(const float* A, int64_t lda, const float* bt, int64_t ldb, float* C, int M, int N,
                 int K, int multiprocessors) {
  static bool configured = false;
  if (!configured) {
    const cudaError_t err = cudaFuncSetAttribute(
        gemm_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSharedBytes);
    if (err != cudaSuccess) return err;
    configured = true;
  }
  const CUtensorMap a_map = k_major_map(A, M, K, lda, T::BM);
  const CUtensorMap bt_map = k_major_map(bt, N, K, ldb, T::BN);
  const int64_t tiles =
      static_cast<int64_t>((M + T::BM - 1) / T::BM) * ((N + T::BN - 1) / T::BN);
  if (tiles > INT32_MAX) throw std::invalid_argument("matmul_tf32: too many tiles for one launch");
  const int64_t blocks = T::kPersistent && tiles > multiprocessors ? multiprocessors : tiles;
  gemm_kernel<T><<<static_cast<unsigned>(blocks), T::kThreads, T::kSharedBytes>>>(a_map, bt_map,
                                                                                  C, M, N, K);
  return cudaGetLastError();
}

}  // namespace tf32_hopper
