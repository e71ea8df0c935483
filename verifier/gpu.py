"""A fused CUDA kernel for checks of device data: one read of a matrix gives both M @ W and
|M| @ v, accumulated in float64 with no converted copy of M. Float checks rely on the
float64 rounding analysis of docs/verifier.md (any order); exact checks keep every partial
sum an integer below 2^53, so the kernel is exact for them.

Each warp takes VF_RPW rows; the block's warps share tiles of W (transposed) in shared memory,
so W is read from global memory once per block rather than once per row.
"""
from __future__ import annotations

from functools import cache

WARPS = 8
TILE_BYTES = 16 * 1024  # shared memory for one tile of W

SOURCE = r"""
extern "C" __global__ void signed_and_abs(const VF_T* M, const double* WT, const double* v,
                                          double* S, double* a, long long rows, long long cols) {
    __shared__ double tile[VF_K * VF_TILE];
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long first = warp * VF_RPW;
    double acc[VF_RPW][VF_K];
    double acc_abs[VF_RPW];
    #pragma unroll
    for (int r = 0; r < VF_RPW; ++r) {
        acc_abs[r] = 0.0;
        #pragma unroll
        for (int q = 0; q < VF_K; ++q) acc[r][q] = 0.0;
    }
    for (long long j0 = 0; j0 < cols; j0 += VF_TILE) {
        const int width = (int)min((long long)VF_TILE, cols - j0);
        __syncthreads();
        for (int t = threadIdx.x; t < VF_K * VF_TILE; t += blockDim.x) {
            const int q = t / VF_TILE, jj = t - q * VF_TILE;
            tile[t] = jj < width ? WT[q * cols + j0 + jj] : 0.0;
        }
        __syncthreads();
        for (int jj = lane; jj < width; jj += 32) {
            const double vj = v[j0 + jj];
            #pragma unroll
            for (int r = 0; r < VF_RPW; ++r) {
                if (first + r < rows) {
                    const double m = (double)M[(first + r) * cols + j0 + jj];
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) acc[r][q] += m * tile[q * VF_TILE + jj];
                    acc_abs[r] += fabs(m) * vj;
                }
            }
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        #pragma unroll
        for (int r = 0; r < VF_RPW; ++r) {
            #pragma unroll
            for (int q = 0; q < VF_K; ++q)
                acc[r][q] += __shfl_down_sync(0xffffffff, acc[r][q], offset);
            acc_abs[r] += __shfl_down_sync(0xffffffff, acc_abs[r], offset);
        }
    }
    if (lane == 0) {
        for (int r = 0; r < VF_RPW && first + r < rows; ++r) {
            for (int q = 0; q < VF_K; ++q) S[(first + r) * VF_K + q] = acc[r][q];
            a[first + r] = acc_abs[r];
        }
    }
}
"""


def _rows_per_warp(columns: int) -> int:
    return 1 if columns > 2 else 4


C_TYPES = {"float32": "float", "int8": "signed char", "int16": "short", "int32": "int",
           "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short",
           "uint32": "unsigned int"}


@cache
def _kernel(columns: int, dtype: str):
    import cupy

    tile = max(32, (TILE_BYTES // 8 // columns) // 32 * 32)
    options = (f"-DVF_K={columns}", f"-DVF_TILE={tile}", f"-DVF_RPW={_rows_per_warp(columns)}",
               f"-DVF_T={C_TYPES[dtype]}")
    return cupy.RawKernel(SOURCE, "signed_and_abs", options=options)


def signed_and_abs(M, W, v):
    """(M @ W, |M| @ v) in float64 for M (rows, cols) of a type in C_TYPES, W (cols, K),
    v (cols,)."""
    import cupy

    M = cupy.ascontiguousarray(M)
    rows, cols = M.shape
    columns = W.shape[1]
    WT = cupy.ascontiguousarray(W.T, dtype=cupy.float64)
    v = cupy.ascontiguousarray(v, dtype=cupy.float64)
    S = cupy.empty((rows, columns), cupy.float64)
    a = cupy.empty(rows, cupy.float64)
    blocks = -(-rows // (WARPS * _rows_per_warp(columns)))
    _kernel(columns, M.dtype.name)((blocks,), (32 * WARPS,),
                     (M, WT, v, S, a, cupy.int64(rows), cupy.int64(cols)))
    return S, a
