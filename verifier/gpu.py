"""A fused CUDA kernel for the float check of device data: one read of a float32 matrix
gives both M @ W and |M| @ v, accumulated in float64 (any order: the float64 analysis of
docs/verifier.md applies), with no converted copy of M."""
from __future__ import annotations

from functools import cache

ROWS_PER_BLOCK = 8  # one warp per row; the warps of a block share W's columns through L1

SOURCE = r"""
extern "C" __global__ void signed_and_abs(const float* M, const double* WT, const double* v,
                                          double* S, double* a, long long rows, long long cols) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* m_row = M + row * cols;
    double acc[K];
    double acc_abs = 0.0;
    for (int q = 0; q < K; ++q) acc[q] = 0.0;
    for (long long j = lane; j < cols; j += 32) {
        const double m = (double)m_row[j];
        for (int q = 0; q < K; ++q) acc[q] += m * WT[q * cols + j];
        acc_abs += fabs(m) * v[j];
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        for (int q = 0; q < K; ++q) acc[q] += __shfl_down_sync(0xffffffff, acc[q], offset);
        acc_abs += __shfl_down_sync(0xffffffff, acc_abs, offset);
    }
    if (lane == 0) {
        for (int q = 0; q < K; ++q) S[row * K + q] = acc[q];
        a[row] = acc_abs;
    }
}
"""


@cache
def _kernel(columns: int):
    import cupy

    return cupy.RawKernel(SOURCE, "signed_and_abs", options=(f"-DK={columns}",))


def signed_and_abs(M, W, v):
    """(M @ W, |M| @ v) in float64 for float32 M (rows, cols), W (cols, K), v (cols,)."""
    import cupy

    M = cupy.ascontiguousarray(M)
    rows, cols = M.shape
    WT = cupy.ascontiguousarray(W.T, dtype=cupy.float64)
    v = cupy.ascontiguousarray(v, dtype=cupy.float64)
    S = cupy.empty((rows, W.shape[1]), cupy.float64)
    a = cupy.empty(rows, cupy.float64)
    blocks = -(-rows // ROWS_PER_BLOCK)
    _kernel(W.shape[1])((blocks,), (32 * ROWS_PER_BLOCK,),
                        (M, WT, v, S, a, cupy.int64(rows), cupy.int64(cols)))
    return S, a
