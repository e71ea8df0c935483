"""A fused CUDA kernel for the float check of device data: one read of a float32 matrix
gives both M @ W and |M| @ v, accumulated in float64 (any order: the float64 analysis of
docs/verifier.md applies), with no converted copy of M.

Each warp takes RPW rows; the block's warps share tiles of W (transposed) in shared memory,
so W is read from global memory once per block rather than once per row.
"""
from __future__ import annotations

from functools import cache

WARPS = 8
TILE_BYTES = 16 * 1024  # shared memory for one tile of W

SOURCE = r"""
extern "C" __global__ void signed_and_abs(const float* M, const double* WT, const double* v,
                                          double* S, double* a, long long rows, long long cols) {
    __shared__ double tile[K * TILE];
    const int lane = threadIdx.x & 31;
    const long long first = ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * RPW;
    double acc[RPW][K];
    double acc_abs[RPW];
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        acc_abs[r] = 0.0;
        #pragma unroll
        for (int q = 0; q < K; ++q) acc[r][q] = 0.0;
    }
    for (long long j0 = 0; j0 < cols; j0 += TILE) {
        const int width = (int)min((long long)TILE, cols - j0);
        __syncthreads();
        for (int t = threadIdx.x; t < K * TILE; t += blockDim.x) {
            const int q = t / TILE, jj = t - q * TILE;
            tile[t] = jj < width ? WT[q * cols + j0 + jj] : 0.0;
        }
        __syncthreads();
        for (int jj = lane; jj < width; jj += 32) {
            const double vj = v[j0 + jj];
            #pragma unroll
            for (int r = 0; r < RPW; ++r) {
                if (first + r < rows) {
                    const double m = (double)M[(first + r) * cols + j0 + jj];
                    #pragma unroll
                    for (int q = 0; q < K; ++q) acc[r][q] += m * tile[q * TILE + jj];
                    acc_abs[r] += fabs(m) * vj;
                }
            }
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            #pragma unroll
            for (int q = 0; q < K; ++q)
                acc[r][q] += __shfl_down_sync(0xffffffff, acc[r][q], offset);
            acc_abs[r] += __shfl_down_sync(0xffffffff, acc_abs[r], offset);
        }
    }
    if (lane == 0) {
        for (int r = 0; r < RPW && first + r < rows; ++r) {
            for (int q = 0; q < K; ++q) S[(first + r) * K + q] = acc[r][q];
            a[first + r] = acc_abs[r];
        }
    }
}
"""


def _rows_per_warp(columns: int) -> int:
    return 1 if columns > 2 else 4


@cache
def _kernel(columns: int):
    import cupy

    tile = max(32, (TILE_BYTES // 8 // columns) // 32 * 32)
    options = (f"-DK={columns}", f"-DTILE={tile}", f"-DRPW={_rows_per_warp(columns)}")
    return cupy.RawKernel(SOURCE, "signed_and_abs", options=options)


def signed_and_abs(M, W, v):
    """(M @ W, |M| @ v) in float64 for float32 M (rows, cols), W (cols, K), v (cols,)."""
    import cupy

    M = cupy.ascontiguousarray(M)
    rows, cols = M.shape
    columns = W.shape[1]
    WT = cupy.ascontiguousarray(W.T, dtype=cupy.float64)
    v = cupy.ascontiguousarray(v, dtype=cupy.float64)
    S = cupy.empty((rows, columns), cupy.float64)
    a = cupy.empty(rows, cupy.float64)
    blocks = -(-rows // (WARPS * _rows_per_warp(columns)))
    _kernel(columns)((blocks,), (32 * WARPS,),
                     (M, WT, v, S, a, cupy.int64(rows), cupy.int64(cols)))
    return S, a
