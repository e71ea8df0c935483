"""Float checks of device data in three kernel launches and one 24-byte copy back.

1. sign_pass: B R and |B| 1, C R and |C| 1 in one launch (B's rows and C's rows share the
   columns of R: the first blocks take B, the rest C). R's +-1 entries are expanded from the
   stream's bits into shared memory; B's rows also get s and the weights of tau
   (floating.Terms) in their epilogue.
2. a_pass: A (B R) and |A| weights, then per row max over rounds of |C R - A (B R)| and the
   row's part of tau, in float64.
3. verdict: one block sums s, adds the constant of tau, and finds the worst row (the first
   of the largest excess, as numpy's argmax does) and whether any excess is not finite.

Rows are read in float32 with 16-byte loads where the rows allow (length divisible by 4, a
16-byte aligned start), several per lane in flight; each warp takes up to `rows` rows so
every value of the tile in shared memory serves that many multiply-adds. tau is evaluated
in float64 with the same operations in the same order as floating.residual_and_bound (no
fused multiply-adds), so the host and the device differ only in the float32 sums' rounding,
which tau charges for any order.
"""
from __future__ import annotations

import threading
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np


class Launch(NamedTuple):
    warps: int  # per block; they share the tiles of R or of B R
    unroll: int  # loads per row in flight per lane before they are used
    rows: int  # per warp, at most (fewer when rounds * rows accumulators crowd the registers)


LAUNCH = Launch(8, 2, 4)
TILE_BYTES = 32 * 1024  # shared memory for one tile of R (or of B R and the weights)
ACCUMULATORS = 64  # float32 registers per lane for the row sums
VERDICT_THREADS = 1024
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

__device__ __forceinline__ void load_vec(const float* __restrict__ p, float (&x)[VF_VEC]) {
#if VF_VEC == 4
    const float4 t = __ldg(reinterpret_cast<const float4*>(p));
    x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
#else
    x[0] = __ldg(p);
#endif
}

__device__ __forceinline__ void tile_vec(const float* p, float (&x)[VF_VEC]) {
#if VF_VEC == 4
    const float4 t = *reinterpret_cast<const float4*>(p);
    x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
#else
    x[0] = *p;
#endif
}

// The rows first .. first + VF_RPW - 1 of M (rows x cols) times W (cols x VF_K): the +-1
// matrix R from the stream's bits (SIGNS), or B R given transposed (XT, VF_K x cols); and
// |M| times ones (SIGNS) or weights. Sums per row, complete in every lane.
template <bool SIGNS>
__device__ __forceinline__ void row_products(
        const float* __restrict__ M, long long rows, long long cols, long long first,
        const unsigned char* __restrict__ bits, const float* __restrict__ XT,
        const float* __restrict__ weights, float* tile,
        float (&acc)[VF_RPW][VF_K], float (&acc_abs)[VF_RPW]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < VF_RPW; ++r) {
        acc_abs[r] = 0.0f;
        #pragma unroll
        for (int q = 0; q < VF_K; ++q) acc[r][q] = 0.0f;
    }
    for (long long j0 = 0; j0 < cols; j0 += VF_TILE) {
        const int width = (int)min((long long)VF_TILE, cols - j0);
        __syncthreads();
        for (int t = threadIdx.x; t < (VF_K + (SIGNS ? 0 : 1)) * VF_TILE; t += blockDim.x) {
            const int q = t / VF_TILE, jj = t - q * VF_TILE;
            float w = 0.0f;
            if (jj < width) {
                const long long j = j0 + jj;
                if (SIGNS) {  // bit q cols + j of the stream, most significant bit first
                    const long long b = (long long)q * cols + j;
                    w = (bits[b >> 3] >> (7 - (int)(b & 7))) & 1 ? -1.0f : 1.0f;
                } else {
                    w = q < VF_K ? XT[(long long)q * cols + j] : weights[j];
                }
            }
            tile[t] = w;
        }
        __syncthreads();
        for (int j = VF_VEC * lane; j < width; j += 32 * VF_VEC * VF_UNROLL) {
            float x[VF_UNROLL][VF_RPW][VF_VEC];  // all loads first: many reads in flight
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * VF_VEC * u;
                #pragma unroll
                for (int r = 0; r < VF_RPW; ++r) {
                    if (jj < width && first + r < rows) {
                        load_vec(M + (first + r) * cols + j0 + jj, x[u][r]);
                    } else {
                        #pragma unroll
                        for (int e = 0; e < VF_VEC; ++e) x[u][r][e] = 0.0f;
                    }
                }
            }
            #pragma unroll
            for (int u = 0; u < VF_UNROLL; ++u) {
                const int jj = j + 32 * VF_VEC * u;
                if (jj < width) {
                    #pragma unroll
                    for (int q = 0; q < VF_K; ++q) {
                        float w[VF_VEC];
                        tile_vec(tile + q * VF_TILE + jj, w);
                        #pragma unroll
                        for (int e = 0; e < VF_VEC; ++e)
                            #pragma unroll
                            for (int r = 0; r < VF_RPW; ++r)
                                acc[r][q] = fmaf(x[u][r][e], w[e], acc[r][q]);
                    }
                    float v[VF_VEC];
                    if (SIGNS) {
                        #pragma unroll
                        for (int e = 0; e < VF_VEC; ++e) v[e] = 1.0f;
                    } else {
                        tile_vec(tile + VF_K * VF_TILE + jj, v);
                    }
                    #pragma unroll
                    for (int e = 0; e < VF_VEC; ++e)
                        #pragma unroll
                        for (int r = 0; r < VF_RPW; ++r)
                            acc_abs[r] = fmaf(fabsf(x[u][r][e]), v[e], acc_abs[r]);
                }
            }
        }
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        #pragma unroll
        for (int r = 0; r < VF_RPW; ++r) {
            #pragma unroll
            for (int q = 0; q < VF_K; ++q)
                acc[r][q] += __shfl_xor_sync(0xffffffffu, acc[r][q], offset);
            acc_abs[r] += __shfl_xor_sync(0xffffffffu, acc_abs[r], offset);
        }
    }
}

// Blocks below blocks_b take rows of B (k x n): XT = (B R)^T, s_hat = |B| 1 and the weights
// up(w_t s + w_rho); the others rows of C (m x n): Z = C R (m x VF_K) and c_hat = |C| 1.
extern "C" __global__ void sign_pass(
        const float* __restrict__ B, long long k, const float* __restrict__ C, long long m,
        long long n, long long blocks_b, const unsigned char* __restrict__ bits,
        const double* __restrict__ terms, float* __restrict__ XT, float* __restrict__ weights,
        float* __restrict__ s_hat, float* __restrict__ Z, float* __restrict__ c_hat) {
    __shared__ __align__(16) float tile[VF_K * VF_TILE];
    const bool is_b = blockIdx.x < blocks_b;
    const float* M = is_b ? B : C;
    const long long rows = is_b ? k : m;
    const long long block = is_b ? (long long)blockIdx.x : (long long)blockIdx.x - blocks_b;
    const long long first = (block * (blockDim.x >> 5) + (threadIdx.x >> 5)) * VF_RPW;
    float acc[VF_RPW][VF_K], acc_abs[VF_RPW];
    row_products<true>(M, rows, n, first, bits, nullptr, nullptr, tile, acc, acc_abs);
    if ((threadIdx.x & 31) != 0) return;
    #pragma unroll
    for (int r = 0; r < VF_RPW; ++r) {
        const long long i = first + r;
        if (i < rows) {
            if (is_b) {
                #pragma unroll
                for (int q = 0; q < VF_K; ++q) XT[(long long)q * k + i] = acc[r][q];
                s_hat[i] = acc_abs[r];
                const double s = __ddiv_rn(__dadd_rn((double)acc_abs[r], terms[ETA_N]),
                                           terms[ONE_MINUS_G_N]);
                const double w = __dadd_rn(__dmul_rn(terms[W_T], s), terms[W_RHO]);
                weights[i] = nextafterf(__double2float_rn(w), FLOAT_INF);
            } else {
                #pragma unroll
                for (int q = 0; q < VF_K; ++q) Z[i * VF_K + q] = acc[r][q];
                c_hat[i] = acc_abs[r];
            }
        }
    }
}

// Rows of A (m x k) against XT and the weights: residual = max over rounds of
// |Z - A (B R)| (NaN if any is), part = a_term + g_n c, both float64.
extern "C" __global__ void a_pass(
        const float* __restrict__ A, long long m, long long k, const float* __restrict__ XT,
        const float* __restrict__ weights, const float* __restrict__ Z,
        const float* __restrict__ c_hat, const double* __restrict__ terms,
        double* __restrict__ residual, double* __restrict__ part) {
    __shared__ __align__(16) float tile[(VF_K + 1) * VF_TILE];
    const long long first =
        ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * VF_RPW;
    float acc[VF_RPW][VF_K], acc_abs[VF_RPW];
    row_products<false>(A, m, k, first, nullptr, XT, weights, tile, acc, acc_abs);
    if ((threadIdx.x & 31) != 0) return;
    #pragma unroll
    for (int r = 0; r < VF_RPW; ++r) {
        const long long i = first + r;
        if (i < m) {
            double worst = 0.0;
            #pragma unroll
            for (int q = 0; q < VF_K; ++q) {
                const double d = fabs(__dsub_rn((double)Z[i * VF_K + q], (double)acc[r][q]));
                worst = (q == 0 || d > worst || d != d) ? d : worst;  // NaN sticks
            }
            const double a_term = __ddiv_rn(__dadd_rn((double)acc_abs[r], terms[ETA_K]),
                                            terms[ONE_MINUS_G_K]);
            const double c = __ddiv_rn(__dadd_rn((double)c_hat[i], terms[ETA_N]),
                                       terms[ONE_MINUS_G_N]);
            residual[i] = worst;
            part[i] = __dadd_rn(a_term, __dmul_rn(terms[G_N], c));
        }
    }
}

// One block: out = (largest excess residual - tau, its first row, 1 if any excess is not
// finite else 0), tau = safety (part + (coef_s sum(s) + const0 + eta_n + eta_k)).
extern "C" __global__ void verdict(
        const double* __restrict__ residual, const double* __restrict__ part, long long m,
        const float* __restrict__ s_hat, long long k, const double* __restrict__ terms,
        double* __restrict__ out) {
    __shared__ double value[VF_VERDICT];
    __shared__ long long where[VF_VERDICT];
    __shared__ int nonfinite;
    const int t = threadIdx.x;
    if (t == 0) nonfinite = 0;
    double sum = 0.0;
    for (long long l = t; l < k; l += VF_VERDICT)
        sum = __dadd_rn(sum, __ddiv_rn(__dadd_rn((double)s_hat[l], terms[ETA_N]),
                                       terms[ONE_MINUS_G_N]));
    value[t] = sum;
    __syncthreads();
    for (int half = VF_VERDICT / 2; half > 0; half >>= 1) {
        if (t < half) value[t] = __dadd_rn(value[t], value[t + half]);
        __syncthreads();
    }
    const double constant = __dadd_rn(__dadd_rn(__dadd_rn(
        __dmul_rn(terms[COEF_S], value[0]), terms[CONST0]), terms[ETA_N]), terms[ETA_K]);
    __syncthreads();  // everyone has read value[0]
    double best = -DOUBLE_MAX;
    long long at = -1;
    bool bad = false;
    for (long long i = t; i < m; i += VF_VERDICT) {
        const double tau = __dmul_rn(terms[SAFETY], __dadd_rn(part[i], constant));
        const double e = __dsub_rn(residual[i], tau);
        if (!(fabs(e) <= DOUBLE_MAX)) bad = true;  // NaN or Inf
        else if (at < 0 || e > best) { best = e; at = i; }
    }
    if (bad) nonfinite = 1;
    value[t] = best;
    where[t] = at;
    __syncthreads();
    for (int half = VF_VERDICT / 2; half > 0; half >>= 1) {
        if (t < half) {
            const double other = value[t + half];
            const long long there = where[t + half];
            if (there >= 0 && (where[t] < 0 || other > value[t]
                               || (other == value[t] && there < where[t]))) {
                value[t] = other;
                where[t] = there;
            }
        }
        __syncthreads();
    }
    if (t == 0) {
        out[0] = value[0];
        out[1] = (double)where[0];
        out[2] = nonfinite;
    }
}
"""


def rows_per_warp(rounds: int, launch: Launch) -> int:
    """launch.rows, or fewer where rounds * rows accumulators crowd the registers."""
    return max(1, min(launch.rows, ACCUMULATORS // rounds))


def tile_columns(rounds: int, vec: int, launch: Launch) -> int:
    """Columns of a tile: a multiple of one warp-wide load (of all unrolled loads if they
    fit), at most TILE_BYTES for the rounds' rows and the weights'."""
    budget = TILE_BYTES // 4 // (rounds + 1)
    unit = 32 * vec * launch.unroll if budget >= 32 * vec * launch.unroll else 32 * vec
    return max(unit, budget // unit * unit)


def options(rounds: int, vec: int, launch: Launch) -> tuple[str, ...]:
    """The compile-time constants of one module (also used to compile it offline)."""
    return (f"-DVF_K={rounds}", f"-DVF_RPW={rows_per_warp(rounds, launch)}",
            f"-DVF_UNROLL={launch.unroll}", f"-DVF_VEC={vec}",
            f"-DVF_TILE={tile_columns(rounds, vec, launch)}", f"-DVF_VERDICT={VERDICT_THREADS}")


@cache
def _module(rounds: int, vec: int, launch: Launch):
    import cupy

    return cupy.RawModule(code=SOURCE, options=options(rounds, vec, launch))


@cache
def _function(rounds: int, vec: int, launch: Launch, name: str):
    return _module(rounds, vec, launch).get_function(name)


def _vec(*matrices) -> int:
    """4 (16-byte loads) when every row of every matrix starts 16-byte aligned, else 1."""
    return 4 if all(M.shape[1] % 4 == 0 and M.data.ptr % 16 == 0 for M in matrices) else 1


class Workspace(NamedTuple):
    """Device buffers of one shape, kept between calls."""

    bits: object  # the stream's bytes
    terms: object  # floating.Terms as float64
    XT: object  # (rounds, k) float32: (B R)^T
    weights: object  # (k,) float32
    s_hat: object  # (k,) float32
    Z: object  # (m, rounds) float32: C R
    c_hat: object  # (m,) float32
    residual: object  # (m,) float64
    part: object  # (m,) float64
    out: object  # (3,) float64


@lru_cache(maxsize=8)
def _workspace(m: int, k: int, n: int, rounds: int, terms: tuple, device: int) -> Workspace:
    import cupy

    f32, f64 = np.float32, np.float64
    return Workspace(cupy.empty(-(-n * rounds // 8), np.uint8), cupy.asarray(terms, f64),
                     cupy.empty((rounds, k), f32), cupy.empty(k, f32), cupy.empty(k, f32),
                     cupy.empty((m, rounds), f32), cupy.empty(m, f32), cupy.empty(m, f64),
                     cupy.empty(m, f64), cupy.empty(3, f64))


def launch(A, B, C, bits: bytes, rounds: int, terms: tuple):
    """Enqueue the three kernels on the current stream; returns the device array (worst
    excess, its row, 1.0 if some excess is not finite)."""
    import cupy

    A, B, C = (M if M.flags.c_contiguous else cupy.ascontiguousarray(M) for M in (A, B, C))
    (m, k), n = A.shape, B.shape[1]
    ws = _workspace(m, k, n, rounds, tuple(terms), cupy.cuda.Device().id)
    ws.bits.set(np.frombuffer(bits, np.uint8))
    config = LAUNCH
    rows_per_block = config.warps * rows_per_warp(rounds, config)
    blocks_b, blocks_c = -(-k // rows_per_block), -(-m // rows_per_block)
    threads = (32 * config.warps,)
    m64, k64, n64 = np.int64(m), np.int64(k), np.int64(n)
    _function(rounds, _vec(B, C), config, "sign_pass")(
        (blocks_b + blocks_c,), threads,
        (B, k64, C, m64, n64, np.int64(blocks_b), ws.bits, ws.terms, ws.XT, ws.weights,
         ws.s_hat, ws.Z, ws.c_hat))
    vec_a = _vec(A)
    _function(rounds, vec_a, config, "a_pass")(
        (-(-m // rows_per_block),), threads,
        (A, m64, k64, ws.XT, ws.weights, ws.Z, ws.c_hat, ws.terms, ws.residual, ws.part))
    _function(rounds, vec_a, config, "verdict")(
        (1,), (VERDICT_THREADS,), (ws.residual, ws.part, m64, ws.s_hat, k64, ws.terms, ws.out))
    return ws.out


def worst_row(A, B, C, bits: bytes, rounds: int, terms: tuple) -> tuple[float, tuple] | None:
    """(largest |C r - A (B r)|_i - tau_i over rows and rounds, (its first row,)) for 2-D
    float32 device matrices and the sign stream's bits, or None when some excess is not
    finite (NaN/Inf in, or float32 overflow: the caller decides which)."""
    with _WORKSPACE_IN_USE:
        worst, row, nonfinite = launch(A, B, C, bits, rounds, terms).get()
    return None if nonfinite else (float(worst), (int(row),))
