"""A fused CUDA kernel for arrays.products on device data: one read of a matrix gives both
M @ W and |M| @ v, accumulated in float32 or float64 (float checks' float64 re-evaluations
and exact mode's generic limb products, every partial sum an integer of magnitude at most
2^53) with no converted copy of M. 2-D float32 checks take verifier/gpu_float.py instead.
Below it, what the one-launch checks (gpu_exact.py, gpu_float.py) share: the grid barrier,
launching a cooperative kernel from a ctypes argument block, pinned host memory.

Each warp takes VF_RPW rows, so every value of W it loads from shared memory serves VF_RPW
multiply-adds, and each thread issues VF_UNROLL * VF_RPW reads of M before it uses them, so
enough reads are in flight to stream M at memory speed; the block's warps share tiles of W
(transposed) in shared memory, so W is read from global memory once per block rather than
once per row.
"""
from __future__ import annotations

import ctypes
import time
from functools import cache

import numpy as np

WARPS = 8
UNROLL = 4  # columns of a row each thread loads before using them (memory-level parallelism)
TILE_BYTES = 16 * 1024  # shared memory for one tile of W
ACCUMULATOR_WORDS = 64  # 32-bit registers per thread for the row accumulators
# columns of W per launch: the tile of W is at least 32 columns wide, and float64 tiles of more
# than 192 columns exceed the 48 KiB of static shared memory (exact mode's generic path has
# limbs * rounds columns, up to 512): wider W is taken in slices
MAX_COLUMNS = 128
SPIN_NS = 200_000  # how long wait_for_ticket polls before it synchronises the stream

SOURCE = r"""
extern "C" __global__ void signed_and_abs(const VF_T* __restrict__ M,
                                          const VF_ACC* __restrict__ WT,
                                          const VF_ACC* __restrict__ v, VF_ACC* __restrict__ S,
                                          VF_ACC* __restrict__ a, long long rows, long long cols) {
    __shared__ VF_ACC tile[VF_K * VF_TILE];
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long first = warp * VF_RPW;
    VF_ACC acc[VF_RPW][VF_K];
    VF_ACC acc_abs[VF_RPW];
    #pragma unroll
    for (int r = 0; r < VF_RPW; ++r) {
        acc_abs[r] = 0;
        #pragma unroll
        for (int q = 0; q < VF_K; ++q) acc[r][q] = 0;
    }
    for (long long j0 = 0; j0 < cols; j0 += VF_TILE) {
        const int width = (int)min((long long)VF_TILE, cols - j0);
        __syncthreads();
        for (int t = threadIdx.x; t < VF_K * VF_TILE; t += blockDim.x) {
            const int q = t / VF_TILE, jj = t - q * VF_TILE;
            tile[t] = jj < width ? WT[q * cols + j0 + jj] : (VF_ACC)0;
        }
        __syncthreads();
        for (int j = lane; j < width; j += 32 * VF_UNROLL) {
            VF_ACC m[VF_UNROLL][VF_RPW];  // all loads first: many reads in flight per thread
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * u;
                #pragma unroll
                for (int r = 0; r < VF_RPW; ++r)
                    m[u][r] = jj < width && first + r < rows
                              ? (VF_ACC)M[(first + r) * cols + j0 + jj] : (VF_ACC)0;
            }
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * u;
                if (jj < width) {
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) {
                        const VF_ACC w = tile[q * VF_TILE + jj];
                        #pragma unroll
                        for (int r = 0; r < VF_RPW; ++r) acc[r][q] += m[u][r] * w;
                    }
#if VF_ABS
                    const VF_ACC vj = v[j0 + jj];
                    #pragma unroll
                    for (int r = 0; r < VF_RPW; ++r)
                        acc_abs[r] += (m[u][r] < 0 ? -m[u][r] : m[u][r]) * vj;
#endif
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

C_TYPES = {"float32": "float", "int8": "signed char", "int16": "short", "int32": "int",
           "int64": "long long", "uint8": "unsigned char", "uint16": "unsigned short",
           "uint32": "unsigned int"}
ACCUMULATORS = {"float32": "float", "float64": "double"}


def rows_per_warp(columns: int, accumulator: str) -> int:
    """As many rows as the accumulator registers allow, at most 4 (one for wide W)."""
    words = columns * np.dtype(accumulator).itemsize // 4
    return max(1, min(4, ACCUMULATOR_WORDS // words))


def tile_width(columns: int, accumulator: str) -> int:
    return max(32, (TILE_BYTES // np.dtype(accumulator).itemsize // columns) // 32 * 32)


def options(columns: int, dtype: str, accumulator: str, with_abs: bool) -> tuple[str, ...]:
    """The compile-time constants of one kernel variant (also used to compile it offline)."""
    return (f"-DVF_K={columns}", f"-DVF_TILE={tile_width(columns, accumulator)}",
            f"-DVF_RPW={rows_per_warp(columns, accumulator)}", f"-DVF_T={C_TYPES[dtype]}",
            f"-DVF_ACC={ACCUMULATORS[accumulator]}", f"-DVF_ABS={int(with_abs)}",
            f"-DVF_UNROLL={UNROLL}")


@cache
def _kernel(columns: int, dtype: str, accumulator: str, with_abs: bool):
    import cupy

    return cupy.RawKernel(SOURCE, "signed_and_abs",
                          options=options(columns, dtype, accumulator, with_abs))


def signed_and_abs(M, W, v, accumulator):
    """(M @ W, |M| @ v or None when v is None), both in the accumulator type (float32 or
    float64), for device arrays M (rows, cols) of a type in C_TYPES, W (cols, K), v (cols,)."""
    import cupy

    accumulator = np.dtype(accumulator).name
    M = cupy.ascontiguousarray(M)
    rows, cols = M.shape
    columns = W.shape[1]
    if columns > MAX_COLUMNS:
        parts = [signed_and_abs(M, W[:, i : i + MAX_COLUMNS], v if i == 0 else None,
                                accumulator) for i in range(0, columns, MAX_COLUMNS)]
        return cupy.concatenate([S for S, _ in parts], axis=1), parts[0][1]
    WT = cupy.ascontiguousarray(W.T, dtype=accumulator)
    with_abs = v is not None
    v = cupy.ascontiguousarray(v, dtype=accumulator) if with_abs else WT  # unread if no abs
    S = cupy.empty((rows, columns), accumulator)
    a = cupy.empty(rows, accumulator)
    blocks = -(-rows // (WARPS * rows_per_warp(columns, accumulator)))
    _kernel(columns, M.dtype.name, accumulator, with_abs)(
        (blocks,), (32 * WARPS,), (M, WT, v, S, a, cupy.int64(rows), cupy.int64(cols)))
    return S, (a if with_abs else None)


# Device functions of the cooperative (one-launch) checks.
COOPERATIVE = r"""
// A grid-wide barrier in two halves. barrier[0] counts the blocks' arrivals since the launch
// began, so the launch's i-th barrier (i = 1, 2, ...) is passed once it reaches i * gridDim.x:
// an arrival is one release-add and a wait polls one word, with no generation to read and no
// reset on the way (the last block to arrive made three more round trips to the L2 before
// anyone could go on). barrier[1] counts the blocks done with the grid (grid_done), and the
// last of them sets both back to 0 for the next launch.
// Between its arrival and its wait a block may issue work that needs nothing the other
// blocks write before the barrier (loads of its next rows). Block-wide writes before the
// arrival are visible grid-wide after the wait.
__device__ __forceinline__ void grid_arrive(unsigned int* barrier) {
    __syncthreads();
    if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 700
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(barrier) : "memory");
#else
        __threadfence();
        atomicAdd(barrier, 1u);
#endif
    }
}
__device__ __forceinline__ void grid_wait(unsigned int* barrier, unsigned int i) {
    if (threadIdx.x == 0) {
        const unsigned int target = i * gridDim.x;
#if __CUDA_ARCH__ >= 700
        unsigned int arrived;
        while (true) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(arrived) : "l"(barrier)
                         : "memory");
            if (arrived >= target) break;
            __nanosleep(32);
        }
#else
        while (*(volatile unsigned int*)barrier < target) {}
        __threadfence();
#endif
    }
    __syncthreads();
}
// Every block of the grid waits here until all have arrived at the launch's i-th barrier.
__device__ __forceinline__ void grid_barrier(unsigned int* barrier, unsigned int i) {
    grid_arrive(barrier);
    grid_wait(barrier, i);
}
// Thread 0, once its block waits at no more barriers and its writes are done: whether this
// is the launch's last block to get here. The last one sees every block's writes before this
// call, and every block is then past its waits: the counters are set back for the next launch.
__device__ __forceinline__ bool grid_done(unsigned int* barrier) {
    __threadfence();
    if (atomicAdd(barrier + 1, 1u) != gridDim.x - 1) return false;
    barrier[0] = 0;
    barrier[1] = 0;
    return true;
}
"""


def resident_blocks(kernel, threads: int, device: int) -> int:
    """Blocks of kernel (a cupy.RawKernel) that fit on the device at once, all SMs."""
    import cupy

    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr,
                                                                        threads, 0)
    sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    return per_sm * sms


def argument_block(values) -> tuple[object, object]:
    """(arguments, parameters): a ctypes array of 8-byte kernel arguments holding values,
    and the array of pointers to them that the driver's launch takes. A launch then costs
    the host assignments into arguments and one driver call."""
    values = list(values)
    arguments = (ctypes.c_uint64 * len(values))(*values)
    start = ctypes.addressof(arguments)
    parameters = (ctypes.c_void_p * len(values))(*(start + 8 * i for i in range(len(values))))
    return arguments, parameters


def launch_cooperative(function: int, grid: int, threads: int, parameters, stream: int) -> None:
    """Enqueue a cooperative launch (every block resident, so they may wait for each other)
    of the CUfunction on the stream (a CUstream pointer)."""
    import cupy

    cupy.cuda.driver.launchCooperativeKernel(function, grid, 1, 1, threads, 1, 1, 0, stream,
                                             ctypes.addressof(parameters))


def wait_for_ticket(words: memoryview, index: int, ticket: int, stream) -> None:
    """Return once a kernel has written ticket to words[index] (pinned host memory) after its
    verdict: polling the word sees it as soon as it lands, where a stream synchronisation
    also waits for the kernel's blocks to exit and the driver to notice. Past SPIN_NS (the
    stream is busy with earlier work, or the check is long) the wait synchronises the stream
    instead (releasing the GIL; a failed launch raises there)."""
    deadline = time.perf_counter_ns() + SPIN_NS
    while words[index] != ticket:
        if time.perf_counter_ns() > deadline:
            stream.synchronize()
            if words[index] != ticket:
                raise RuntimeError("the check's kernel ended without writing its verdict")
            return


def pinned(count: int, dtype) -> tuple[object, np.ndarray]:
    """(pinned host memory, a numpy view of count dtype entries): a kernel reads or writes it
    directly (unified addressing), so no copy is ever enqueued."""
    import cupy

    memory = cupy.cuda.alloc_pinned_memory(count * np.dtype(dtype).itemsize)
    return memory, np.frombuffer(memory, dtype, count)
