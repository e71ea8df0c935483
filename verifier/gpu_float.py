"""Float checks of device data in one cooperative launch, the verdict written straight to
pinned host memory.

The launch's phases meet at grid-wide barriers (verifier/gpu.py); each block takes the
phases' blocks of rows in turn:
0. the stream's sign bits, which the host wrote into pinned memory, are copied to the device
   (n * rounds bits);
1. rows of B and of C (they share the columns of R, whose +-1 entries are expanded from the
   bits into shared memory): B R and s = |B| 1 with the weights of tau (floating.Terms) and
   each block's part of sum(s); C R and |C| 1;
2. rows of A: A (B R) and |A| weights, then per row the largest |C r - A (B r)| over rounds
   against tau_i, in float64. Each block keeps its worst row; the last block to finish takes
   the worst of theirs (the first of the largest excess, as numpy's argmax does) and writes
   (worst excess, its row, 1 if some excess is not finite) to pinned host memory.

The host's part of a check is the stream's bits (one hashlib call: the sign stream is v2's
sequential squeeze, which a GPU cannot split between warps), a copy of them into pinned
memory, a few assignments into a ctypes argument block kept per shape, one driver call and
one wait.

Rows are read in float32 with 16-byte loads where the rows allow (length divisible by 4, a
16-byte aligned start), several per lane in flight; each warp takes up to `rows` rows so
every value of the tile in shared memory serves that many multiply-adds. tau is evaluated
in float64 with the same operations in the same order as floating.residual_and_bound (no
fused multiply-adds), so the host and the device differ only in the float32 sums' rounding,
which tau charges for any order, and in the order of sum(s) (float64 rounding).
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from verifier.gpu import COOPERATIVE, argument_block, launch_cooperative, pinned, resident_blocks


class Launch(NamedTuple):
    warps: int  # per block; they share the tiles of R or of B R
    unroll: int  # loads per row in flight per lane before they are used
    rows: int  # per warp, at most: fewer when rounds * rows accumulators crowd the registers,
    # or when fewer rows per warp already give every resident warp a share of a phase


# H100, n = 4096, the launch alone back to back (CUDA events), 54 variants (warps 4/8/16,
# unroll 1/2/4, rows 1/2/4; rows per warp by the fill rule or fixed), each verdict checked:
# 1 round 86.8 us (8, 2, 4: 90.9; the worst 116.6), 16 rounds 148.7 us (8, 2, 4: 208.6; the
# worst 496.1): 16 warps with one load in flight on each of 4 rows, the fill rule, for both.
LAUNCH = Launch(16, 1, 4)
TILE_BYTES = 32 * 1024  # shared memory for one tile of R (or of B R and the weights)
ACCUMULATORS = 64  # float32 registers per lane for the row sums
# per thread, the tile entries of B R and the weights (FILL) or runs of 8 signs (FILL_ITEMS)
# whose loads are issued together: one L2 round trip per loop iteration made the tile fills
# after each barrier cost more than the old kernels' whole launch gaps (H100: 107 -> 90 us)
FILL, FILL_ITEMS = 8, 4
_WORKSPACE_IN_USE = threading.Lock()  # one check at a time per workspace (host threads)

SOURCE = r"""
#define ETA_N 0
#define ONE_MINUS_G_N 1
#define W_T 2
#define W_RHO 3
#define ETA_K 4
#define ONE_MINUS_G_K 5
#define G_N 6
#define COEF_S 7
#define CONST0 8
#define SAFETY 9
#define FLOAT_INF __int_as_float(0x7f800000)
#define DOUBLE_MAX 1.7976931348623157e308

template <int VEC>
__device__ __forceinline__ void load_vec(const float* __restrict__ p, float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 t = __ldg(reinterpret_cast<const float4*>(p));
        x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
    } else {
        x[0] = __ldg(p);
    }
}

template <int VEC>
__device__ __forceinline__ void tile_vec(const float* p, float (&x)[VEC]) {
    if constexpr (VEC == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p);
        x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
    } else {
        x[0] = *p;
    }
}

// Tile entry t (round t / VF_TILE, column j0 + t % VF_TILE; 0 past width) of R: bit
// q cols + j of the stream, most significant bit of each byte first, 0 -> +1, 1 -> -1.
// FILL_ITEMS runs of 8 entries per thread at a time, their loads issued together.
__device__ __forceinline__ void fill_signs(const unsigned int* bits, long long cols,
                                           long long j0, int width, float* tile) {
    const int runs = VF_K * VF_TILE / 8;
    for (int first = threadIdx.x; first < runs; first += FILL_ITEMS * blockDim.x) {
        unsigned int word[FILL_ITEMS][2];
        #pragma unroll
        for (int u = 0; u < FILL_ITEMS; ++u) {
            const int run = first + u * blockDim.x;
            const int q = 8 * run / VF_TILE, jj = 8 * run - q * VF_TILE;
            const long long b = (long long)q * cols + j0 + jj;
            // past width (a tile's tail) b can run up to a tile beyond the bits: not read
            word[u][0] = run < runs && jj < width ? __ldcg(bits + (b >> 5)) : 0u;
            word[u][1] = run < runs && jj < width ? __ldcg(bits + (b >> 5) + 1) : 0u;
        }
        #pragma unroll
        for (int u = 0; u < FILL_ITEMS; ++u) {
            const int run = first + u * blockDim.x;
            if (run < runs) {
                const int q = 8 * run / VF_TILE, jj = 8 * run - q * VF_TILE;
                const long long b = (long long)q * cols + j0 + jj;
                float w[8];
                #pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const long long at = b + e;
                    const unsigned int x = (at >> 5) == (b >> 5) ? word[u][0] : word[u][1];
                    const int shift = 8 * (int)((at >> 3) & 3) + 7 - (int)(at & 7);
                    w[e] = jj + e < width ? ((x >> shift) & 1 ? -1.0f : 1.0f) : 0.0f;
                }
                float4* out = reinterpret_cast<float4*>(tile + 8 * run);
                out[0] = make_float4(w[0], w[1], w[2], w[3]);
                out[1] = make_float4(w[4], w[5], w[6], w[7]);
            }
        }
    }
}

// Tile entry t of (B R)^T (rounds t / VF_TILE < VF_K) or of the weights (the last row), FILL
// entries per thread at a time, their loads issued together.
__device__ __forceinline__ void fill_weights(const float* XT, const float* weights,
                                             long long cols, long long j0, int width,
                                             float* tile) {
    const int entries = (VF_K + 1) * VF_TILE;
    for (int first = threadIdx.x; first < entries; first += FILL * blockDim.x) {
        float w[FILL];
        #pragma unroll
        for (int u = 0; u < FILL; ++u) {
            const int t = first + u * blockDim.x, q = t / VF_TILE, jj = t - q * VF_TILE;
            const long long j = j0 + jj;
            w[u] = t >= entries || jj >= width ? 0.0f
                 : q < VF_K ? __ldcg(XT + (long long)q * cols + j) : __ldcg(weights + j);
        }
        #pragma unroll
        for (int u = 0; u < FILL; ++u)
            if (first + u * blockDim.x < entries) tile[first + u * blockDim.x] = w[u];
    }
}

// The rows first .. first + RPW - 1 of M (rows x cols) times W (cols x VF_K): the +-1
// matrix R from the stream's bits (SIGNS), or B R given transposed (XT, VF_K x cols); and
// |M| times ones (SIGNS) or weights. Sums per row, complete in every lane. XT, weights and
// bits were written earlier in this launch: read through the L2 (__ldcg), never a stale L1.
template <bool SIGNS, int RPW, int VEC>
__device__ __forceinline__ void row_products(
        const float* __restrict__ M, long long rows, long long cols, long long first,
        const unsigned int* bits, const float* XT, const float* weights, float* tile,
        float (&acc)[RPW][VF_K], float (&acc_abs)[RPW]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < RPW; ++r) {
        acc_abs[r] = 0.0f;
        #pragma unroll
        for (int q = 0; q < VF_K; ++q) acc[r][q] = 0.0f;
    }
    for (long long j0 = 0; j0 < cols; j0 += VF_TILE) {
        const int width = (int)min((long long)VF_TILE, cols - j0);
        __syncthreads();
        if (SIGNS) fill_signs(bits, cols, j0, width, tile);
        else fill_weights(XT, weights, cols, j0, width, tile);
        __syncthreads();
        for (int j = VEC * lane; j < width; j += 32 * VEC * VF_UNROLL) {
            float x[VF_UNROLL][RPW][VEC];  // all loads first: many reads in flight
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * VEC * u;
                #pragma unroll
                for (int r = 0; r < RPW; ++r) {
                    if (jj < width && first + r < rows) {
                        load_vec<VEC>(M + (first + r) * cols + j0 + jj, x[u][r]);
                    } else {
                        #pragma unroll
                        for (int e = 0; e < VEC; ++e) x[u][r][e] = 0.0f;
                    }
                }
            }
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * VEC * u;
                if (jj < width) {
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) {
                        float w[VEC];
                        tile_vec<VEC>(tile + q * VF_TILE + jj, w);
                        #pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            #pragma unroll
                            for (int r = 0; r < RPW; ++r)
                                acc[r][q] = fmaf(x[u][r][e], w[e], acc[r][q]);
                    }
                    float v[VEC];
                    if (SIGNS) {
                        #pragma unroll
                        for (int e = 0; e < VEC; ++e) v[e] = 1.0f;
                    } else {
                        tile_vec<VEC>(tile + VF_K * VF_TILE + jj, v);
                    }
                    #pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        #pragma unroll
                        for (int r = 0; r < RPW; ++r)
                            acc_abs[r] = fmaf(fabsf(x[u][r][e]), v[e], acc_abs[r]);
                }
            }
        }
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        #pragma unroll
        for (int r = 0; r < RPW; ++r) {
            #pragma unroll
            for (int q = 0; q < VF_K; ++q)
                acc[r][q] += __shfl_xor_sync(0xffffffffu, acc[r][q], offset);
            acc_abs[r] += __shfl_xor_sync(0xffffffffu, acc_abs[r], offset);
        }
    }
}

// (value, row) takes (other, there) if that is the larger excess, or as large at an earlier
// row (numpy's argmax: the first of the largest); row -1 is no row yet.
__device__ __forceinline__ void keep_worst(double& value, long long& row, double other,
                                           long long there) {
    if (there >= 0 && (row < 0 || other > value || (other == value && there < row))) {
        value = other;
        row = there;
    }
}

// The check of A (m x k) B (k x n) against C (m x n). host_bits: the stream's bits in pinned
// memory, `chunks` 16-byte words; host_out (pinned): worst excess, its row, 1 if some excess
// is not finite. barrier: arrivals and finished blocks, zero between launches.
extern "C" __global__ void __launch_bounds__(VF_THREADS) check(
        const float* __restrict__ A, const float* __restrict__ B, const float* __restrict__ C,
        const uint4* host_bits, uint4* bits, const double* __restrict__ terms, float* XT,
        float* weights, float* Z, float* c_hat, double* s_part, double* block_worst,
        long long* block_row, int* block_bad, unsigned int* barrier, double* host_out,
        long long m, long long k, long long n, long long blocks_b, long long blocks_c,
        long long blocks_a, long long chunks) {
    __shared__ __align__(16) float tile[(VF_K + 1) * VF_TILE];
    __shared__ double value[VF_THREADS];
    __shared__ long long where[VF_THREADS];
    __shared__ int nonfinite, last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = threadIdx.x;

    // phase 0: the bits to the device
    for (long long i = (long long)blockIdx.x * blockDim.x + t; i < chunks;
         i += (long long)gridDim.x * blockDim.x)
        bits[i] = host_bits[i];
    grid_barrier(barrier, 1);

    // phase 1: rows of B, then of C
    for (long long v = blockIdx.x; v < blocks_b + blocks_c; v += gridDim.x) {
        const bool is_b = v < blocks_b;
        const long long rows = is_b ? k : m;
        const long long first = ((is_b ? v : v - blocks_b) * VF_WARPS + warp) * VF_RPW_BC;
        float acc[VF_RPW_BC][VF_K], acc_abs[VF_RPW_BC];
        row_products<true, VF_RPW_BC, VF_VEC_BC>(is_b ? B : C, rows, n, first,
                                                 (const unsigned int*)bits, nullptr, nullptr,
                                                 tile, acc, acc_abs);
        double s_sum = 0.0;  // this warp's rows' s
        if (lane == 0) {
            #pragma unroll
            for (int r = 0; r < VF_RPW_BC; ++r) {
                const long long i = first + r;
                if (i < rows && is_b) {
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) XT[(long long)q * k + i] = acc[r][q];
                    const double s = __ddiv_rn(__dadd_rn((double)acc_abs[r], terms[ETA_N]),
                                               terms[ONE_MINUS_G_N]);
                    const double w = __dadd_rn(__dmul_rn(terms[W_T], s), terms[W_RHO]);
                    weights[i] = nextafterf(__double2float_rn(w), FLOAT_INF);
                    s_sum = __dadd_rn(s_sum, s);
                } else if (i < rows) {
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) Z[i * VF_K + q] = acc[r][q];
                    c_hat[i] = acc_abs[r];
                }
            }
            value[warp] = s_sum;
        }
        __syncthreads();
        if (is_b && t == 0) {  // the block's part of sum(s), its warps in order
            double total = 0.0;
            for (int w = 0; w < VF_WARPS; ++w) total = __dadd_rn(total, value[w]);
            s_part[v] = total;
        }
    }
    grid_barrier(barrier, 2);

    // phase 2: tau's constant coef_s sum(s) + const0 + eta_n + eta_k, then rows of A
    double sum = 0.0;
    for (long long l = t; l < blocks_b; l += blockDim.x) sum = __dadd_rn(sum, __ldcg(s_part + l));
    value[t] = sum;
    __syncthreads();
    for (int half = VF_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) value[t] = __dadd_rn(value[t], value[t + half]);
        __syncthreads();
    }
    const double constant = __dadd_rn(__dadd_rn(__dadd_rn(
        __dmul_rn(terms[COEF_S], value[0]), terms[CONST0]), terms[ETA_N]), terms[ETA_K]);
    double worst = -DOUBLE_MAX;  // lane 0: its rows' largest finite excess, at row `at`
    long long at = -1;
    int bad = 0;
    for (long long v = blockIdx.x; v < blocks_a; v += gridDim.x) {
        const long long first = (v * VF_WARPS + warp) * VF_RPW_A;
        float acc[VF_RPW_A][VF_K], acc_abs[VF_RPW_A];
        row_products<false, VF_RPW_A, VF_VEC_A>(A, m, k, first, nullptr, XT, weights, tile,
                                                acc, acc_abs);
        if (lane != 0) continue;
        #pragma unroll
        for (int r = 0; r < VF_RPW_A; ++r) {
            const long long i = first + r;
            if (i >= m) continue;
            double residual = 0.0;
            #pragma unroll
            for (int q = 0; q < VF_K; ++q) {
                const double d = fabs(__dsub_rn((double)__ldcg(Z + i * VF_K + q),
                                                (double)acc[r][q]));
                residual = (q == 0 || d > residual || d != d) ? d : residual;  // NaN sticks
            }
            const double a_term = __ddiv_rn(__dadd_rn((double)acc_abs[r], terms[ETA_K]),
                                            terms[ONE_MINUS_G_K]);
            const double c = __ddiv_rn(__dadd_rn((double)__ldcg(c_hat + i), terms[ETA_N]),
                                       terms[ONE_MINUS_G_N]);
            const double tau = __dmul_rn(terms[SAFETY], __dadd_rn(
                __dadd_rn(a_term, __dmul_rn(terms[G_N], c)), constant));
            const double e = __dsub_rn(residual, tau);
            if (!(fabs(e) <= DOUBLE_MAX)) bad = 1;  // NaN or Inf
            else keep_worst(worst, at, e, i);
        }
    }

    // the block's worst row; the last block to get here takes the worst of all blocks'
    __syncthreads();  // everyone has read value[0]
    if (lane == 0) {
        value[warp] = worst;
        where[warp] = at;
        where[VF_WARPS + warp] = bad;
    }
    __syncthreads();
    if (t == 0) {
        for (int w = 1; w < VF_WARPS; ++w) {
            keep_worst(value[0], where[0], value[w], where[w]);
            where[VF_WARPS] |= where[VF_WARPS + w];
        }
        block_worst[blockIdx.x] = value[0];
        block_row[blockIdx.x] = where[0];
        block_bad[blockIdx.x] = (int)where[VF_WARPS];
        last = grid_done(barrier);
        nonfinite = 0;
    }
    __syncthreads();
    if (!last) return;
    worst = -DOUBLE_MAX;
    at = -1;
    bad = 0;
    for (long long b = t; b < gridDim.x; b += blockDim.x) {
        keep_worst(worst, at, __ldcg(block_worst + b), __ldcg(block_row + b));
        bad |= __ldcg(block_bad + b);
    }
    value[t] = worst;
    where[t] = at;
    if (bad) nonfinite = 1;
    __syncthreads();
    for (int half = VF_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) keep_worst(value[t], where[t], value[t + half], where[t + half]);
        __syncthreads();
    }
    if (t == 0) {
        host_out[0] = value[0];
        host_out[1] = (double)where[0];
        host_out[2] = nonfinite;
        __threadfence_system();
    }
}
"""


def rows_per_warp(rounds: int, launch: Launch) -> int:
    """launch.rows, or fewer where rounds * rows accumulators crowd the registers."""
    return max(1, min(launch.rows, ACCUMULATORS // rounds))


def tile_columns(rounds: int, launch: Launch) -> int:
    """Columns of a tile: a multiple of one warp-wide 16-byte load (of all unrolled loads if
    they fit), at most TILE_BYTES for the rounds' rows and the weights'."""
    budget = TILE_BYTES // 4 // (rounds + 1)
    unit = 128 * launch.unroll if budget >= 128 * launch.unroll else 128
    return max(unit, budget // unit * unit)


def options(rounds: int, vec_bc: int, vec_a: int, launch: Launch, rpw_bc: int,
            rpw_a: int) -> tuple[str, ...]:
    """The compile-time constants of one kernel (also used to compile it offline)."""
    return ("-std=c++17", f"-DVF_K={rounds}",
            f"-DVF_WARPS={launch.warps}", f"-DVF_THREADS={32 * launch.warps}",
            f"-DVF_UNROLL={launch.unroll}", f"-DVF_TILE={tile_columns(rounds, launch)}",
            f"-DVF_VEC_BC={vec_bc}", f"-DVF_VEC_A={vec_a}", f"-DVF_RPW_BC={rpw_bc}",
            f"-DVF_RPW_A={rpw_a}", f"-DFILL={FILL}", f"-DFILL_ITEMS={FILL_ITEMS}")


@lru_cache(maxsize=64)
def _kernel(options: tuple[str, ...]):
    import cupy

    return cupy.RawKernel(COOPERATIVE + SOURCE, "check", options=options)


def _vec(*matrices) -> int:
    """4 (16-byte loads) when every row of every matrix starts 16-byte aligned, else 1."""
    return 4 if all(M.shape[1] % 4 == 0 and M.data.ptr % 16 == 0 for M in matrices) else 1


class Workspace(NamedTuple):
    """Device buffers of one plan, and its pinned host memory."""

    host_bits: object  # pinned: the stream's bits, written by the host before each launch
    bits: object  # their copy on the device (and 16 bytes the fill may read past them)
    terms: object  # floating.Terms as float64
    XT: object  # (rounds, k) float32: (B R)^T
    weights: object  # (k,) float32
    Z: object  # (m, rounds) float32: C R
    c_hat: object  # (m,) float32: |C| 1
    s_part: object  # (blocks of B's rows,) float64: their parts of sum(s)
    block_worst: object  # (grid,) float64, and below its row and whether any was not finite
    block_row: object
    block_bad: object
    barrier: object  # (2,) uint32, zero between launches: arrivals, finished blocks
    pinned_out: object  # 24 bytes of pinned memory the kernel writes the verdict to
    out: np.ndarray  # (3,) float64 view of it: worst excess, its row, 1 if some not finite


ARGUMENTS = 23  # the kernel's, 8 bytes each; A, B and C first


class Plan(NamedTuple):
    """Everything of a check that depends only on shapes, alignments, rounds and tau's
    terms: the kernel, its grid and arguments (all but A, B, C) and the workspace."""

    ws: Workspace
    host_bits: memoryview  # the pinned bits, as bytes (a slice assignment is a plain copy)
    kernel: object  # the cupy.RawKernel, kept alive while the plan is
    function: int  # its CUfunction
    grid: int  # blocks, all resident at once
    threads: int
    row_blocks: tuple[int, int, int]  # of B, C and A: the blocks take them in turn
    arguments: object  # ctypes array of ARGUMENTS uint64
    parameters: object  # pointers to them (cuLaunchCooperativeKernel's)


@lru_cache(maxsize=16)
def prepare(m: int, k: int, n: int, rounds: int, terms: tuple, vec_bc: int, vec_a: int,
            launch: Launch, device: int) -> Plan:
    """The plan of a check of A (m, k) @ B (k, n) against C with these rounds and terms:
    each phase with as many rows per warp as fill every resident warp once, at most
    rows_per_warp()."""
    most = rows_per_warp(rounds, launch)
    first = _kernel(options(rounds, vec_bc, vec_a, launch, most, most))
    warps = resident_blocks(first, 32 * launch.warps, device) * launch.warps
    rpw_bc, rpw_a = (min(most, -(-rows // warps)) for rows in (k + m, m))
    return plan_rows(m, k, n, rounds, terms, vec_bc, vec_a, launch, rpw_bc, rpw_a, device)


@lru_cache(maxsize=16)
def plan_rows(m: int, k: int, n: int, rounds: int, terms: tuple, vec_bc: int, vec_a: int,
              launch: Launch, rpw_bc: int, rpw_a: int, device: int) -> Plan:
    """The plan with rpw_bc rows per warp in phase 1, rpw_a in phase 2 (prepare()'s choice,
    or a sweep's)."""
    import cupy

    kernel = _kernel(options(rounds, vec_bc, vec_a, launch, rpw_bc, rpw_a))
    threads = 32 * launch.warps
    block_bc, block_a = launch.warps * rpw_bc, launch.warps * rpw_a
    blocks_b, blocks_c, blocks_a = -(-k // block_bc), -(-m // block_bc), -(-m // block_a)
    grid = min(resident_blocks(kernel, threads, device), max(blocks_b + blocks_c, blocks_a))
    chunks = -(-n * rounds // 128)  # 16-byte words of bits
    f32, f64 = np.float32, np.float64
    pinned_bits, host_bits = pinned(16 * chunks, np.uint8)
    ws = Workspace(pinned_bits, cupy.empty(16 * chunks + 16, np.uint8),
                   cupy.asarray(terms, f64), cupy.empty((rounds, k), f32), cupy.empty(k, f32),
                   cupy.empty((m, rounds), f32), cupy.empty(m, f32), cupy.empty(blocks_b, f64),
                   cupy.empty(grid, f64), cupy.empty(grid, np.int64), cupy.empty(grid, np.int32),
                   cupy.zeros(2, np.uint32), *pinned(3, f64))
    arguments, parameters = argument_block(
        (0, 0, 0, ws.host_bits.ptr, ws.bits.data.ptr, ws.terms.data.ptr, ws.XT.data.ptr,
         ws.weights.data.ptr, ws.Z.data.ptr, ws.c_hat.data.ptr, ws.s_part.data.ptr,
         ws.block_worst.data.ptr, ws.block_row.data.ptr, ws.block_bad.data.ptr,
         ws.barrier.data.ptr, ws.pinned_out.ptr, m, k, n, blocks_b, blocks_c, blocks_a,
         chunks))
    assert len(arguments) == ARGUMENTS
    return Plan(ws, memoryview(host_bits), kernel, kernel.kernel.ptr, grid, threads,
                (blocks_b, blocks_c, blocks_a), arguments, parameters)


def supported(A, B, C) -> bool:
    """Whether a plan takes these matrices as they are: 2-D and C-contiguous (the caller has
    checked float32 and floating.float32_possible)."""
    return all(M.ndim == 2 and M.flags.c_contiguous for M in (A, B, C))


def plan_for(A, B, C, rounds: int, terms: tuple, launch: Launch = LAUNCH) -> Plan:
    """prepare() for these supported() matrices on the current device."""
    import cupy

    (m, k), n = A.shape, B.shape[1]
    return prepare(m, k, n, rounds, tuple(terms), _vec(B, C), _vec(A), launch,
                   cupy.cuda.runtime.getDevice())


def launch(plan: Plan, A, B, C, bits: bytes, stream=None) -> np.ndarray:
    """Enqueue the check on the stream (default: the current one) with the stream's bits
    (n * rounds of them, rng.Signs.bits). Returns plan's host verdict (worst excess, its row,
    1.0 if some excess is not finite), written by the kernel: read it once the stream has
    synchronised."""
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    plan.host_bits[: len(bits)] = bits
    arguments = plan.arguments
    arguments[0], arguments[1], arguments[2] = A.data.ptr, B.data.ptr, C.data.ptr
    launch_cooperative(plan.function, plan.grid, plan.threads, plan.parameters, stream.ptr)
    return plan.ws.out


def check(plan: Plan, A, B, C, bits: bytes) -> tuple[float, int] | None:
    """(largest |C r - A (B r)|_i - tau_i over rows and rounds, its first row) for
    supported() float32 device matrices, or None when some excess is not finite (NaN/Inf in,
    or float32 overflow: the caller decides which)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    with _WORKSPACE_IN_USE:
        out = launch(plan, A, B, C, bits, stream)
        stream.synchronize()
        worst, row, nonfinite = out.tolist()
    return None if nonfinite else (worst, int(row))


def worst_row(A, B, C, bits: bytes, rounds: int, terms: tuple) -> tuple[float, tuple] | None:
    """check() for any 2-D float32 device matrices (strided ones copied first), the row as
    a 1-tuple."""
    import cupy

    A, B, C = (M if M.flags.c_contiguous else cupy.ascontiguousarray(M) for M in (A, B, C))
    found = check(plan_for(A, B, C, rounds, terms), A, B, C, bits)
    return None if found is None else (found[0], (found[1],))
