"""Exact mode on a GPU in three kernel launches and one 24-byte copy back: the vectors; B R and
C R (one launch); A (B R). Products are reduced mod p = 2^61 - 1 inside the kernels, straight
from the int8/int32 data (no converted copy, no limb arrays); the last launch compares
A (B R) with C R and counts the rows that differ on the device.

A row of M times a vector v with entries in [0, p) is summed in integers that cannot
overflow: v is cut into limbs, and each lane sums M_ij * limb_j over its share of the row.
* int8 rows of a length divisible by 4 ("bytes"): 8-bit limbs, four entries of M against four
  limbs in one dp4a instruction, int32 sums (a lane adds at most cols / 128 results of
  magnitude at most 4 * 128 * 255 < 2^17: below 2^31 for rows up to 2^16 entries).
* every other type ("wide"): limbs of w <= 31 bits and int64 sums, w the widest with
  cols * bound * (2^w - 1) <= 2^63 - 1 (bound: the dtype's magnitude, or for C the product's
  bound k max|A| max|B|, checked entry by entry in the kernel: a row holding a larger entry is
  not the product and gets the residue p, which no true residue equals).
Each lane turns its limb sums into one residue (sum_t (S_t mod p) 2^(w t), a shift being a
61-bit rotation mod p) and the warp adds the 32 residues mod p.

The vectors never travel: a first launch derives the words of stream v3 (rng.field_vectors)
from the 32-byte key, one Keccak-f[1600] permutation per warp, and the kernels keep their
low 61 bits. That is field_vectors itself unless a word's low 61 bits are all ones (rejected
there, probability 2^-61 per word): the residue kernels flag such a word in the verdict, and
the check is then re-run with the host's derivation.
"""
from __future__ import annotations

import threading
from functools import cache, lru_cache
from typing import NamedTuple

import numpy as np

from verifier.rng import BLOCK_WORDS, FIELD_BLOCK_DOMAIN, P, field_key, field_vectors


class Launch(NamedTuple):
    """How a kernel of one inner loop runs (tuned on an H100 at n = 4096 and 8192)."""

    warps: int  # per block; they share the tiles of V
    unroll: int  # loads per row in flight per lane before they are used
    rows: int  # per warp, at most (fewer when their accumulators crowd the registers)
    tile_bytes: int  # shared memory for the limbs of one tile of V


# by inner loop and words per load (4: 16-byte loads), each the fastest of a sweep summed
# over n = 4096 and 8192, H100, bench/verify.py's int8/int32 operands: one-word loads of 81
# variants (warps 4/8/16, unroll 2/4/8, rows 1/2/4, tiles of 8/16/32 KiB), 16-byte loads of
# 18 per inner loop (warps 8/16, unroll 1/2/4, rows 1/2/4; the best 4-7% below the median).
# A 32 KiB tile holds a 4096-long vector's 8 byte limbs whole: a block fills it once.
LAUNCH = {("bytes", 1): Launch(16, 4, 2, 32 * 1024), ("wide", 1): Launch(16, 8, 2, 32 * 1024),
          ("bytes", 4): Launch(16, 2, 2, 32 * 1024), ("wide", 4): Launch(16, 2, 2, 32 * 1024)}
MAX_ROUNDS = 4  # more rounds take the generic path (registers)
MAX_BYTES_COLS = 1 << 16  # int32 dp4a sums of a whole row cannot overflow up to this
WIDE_TYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")
WIDE_DTYPES = frozenset(np.dtype(t) for t in WIDE_TYPES)
INT8 = np.dtype(np.int8)
C_TYPES = {"int8": "signed char", "uint8": "unsigned char", "int16": "short",
           "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
           "int64": "long long"}
REGISTER_TYPES = {"uint32": "unsigned int", "int64": "long long"}  # else int
WORDS_THREADS = 128  # Keccak threads per block: 4 warps, one stream block each
VERDICT_RESET = np.array([0, 2**63 - 1, 0], np.int64)
_WORKSPACE_IN_USE = threading.Lock()  # one check at a time per workspace (host threads)

WORDS_SOURCE = r"""
typedef unsigned long long u64;
#define FULL 0xffffffffu

// Keccak-f[1600] (FIPS 202) by one warp: lane l < 25 holds state lane l = x + 5 y. Rho and
// pi are one pull: lane l takes lane KECCAK_SOURCE[l] rotated left by KECCAK_SHIFT[l] (lanes
// 25-31 take themselves and never feed lanes below 25).
__constant__ unsigned char KECCAK_SOURCE[32] = {
    0, 6, 12, 18, 24, 3, 9, 10, 16, 22, 1, 7, 13, 19, 20, 4, 5, 11, 17, 23, 2, 8, 14, 15, 21,
    25, 26, 27, 28, 29, 30, 31};
__constant__ unsigned char KECCAK_SHIFT[32] = {
    0, 44, 43, 21, 14, 28, 20, 3, 45, 61, 1, 6, 25, 8, 18, 27, 36, 10, 15, 56, 62, 55, 39, 41,
    2, 0, 0, 0, 0, 0, 0, 0};
__constant__ u64 KECCAK_ROUND[24] = {
    0x0000000000000001ULL, 0x0000000000008082ULL, 0x800000000000808aULL,
    0x8000000080008000ULL, 0x000000000000808bULL, 0x0000000080000001ULL,
    0x8000000080008081ULL, 0x8000000000008009ULL, 0x000000000000008aULL,
    0x0000000000000088ULL, 0x0000000080008009ULL, 0x000000008000000aULL,
    0x000000008000808bULL, 0x800000000000008bULL, 0x8000000000008089ULL,
    0x8000000000008003ULL, 0x8000000000008002ULL, 0x8000000000000080ULL,
    0x000000000000800aULL, 0x800000008000000aULL, 0x8000000080008081ULL,
    0x8000000000008080ULL, 0x0000000080000001ULL, 0x8000000080008008ULL};

__device__ __forceinline__ u64 rotl64(u64 v, int s) {  // s in [0, 64)
    return (v << s) | (v >> ((64 - s) & 63));
}
__device__ __forceinline__ u64 big_endian(u64 v) {  // the lane whose bytes are v's, high first
    return ((u64)__byte_perm((unsigned int)v, 0, 0x0123) << 32)
           | __byte_perm((unsigned int)(v >> 32), 0, 0x0123);
}

// Words 0 .. count - 1 of a field vector (stream v3, verifier/rng.py), one warp per block of
// BLOCK_WORDS words: block b = SHAKE128(FIELD_BLOCK_DOMAIN || key || b as 8 bytes
// big-endian), one permutation of the padded 64-byte input. Thread 0 also resets the verdict.
extern "C" __global__ void field_words(u64 key0, u64 key1, u64 key2, u64 key3,
                                       u64* __restrict__ words, long long count,
                                       long long* __restrict__ verdict) {
    const int l = threadIdx.x & 31, x = l % 5, y = l / 5;
    const long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (b == 0 && l == 0) {
        verdict[0] = 0;
        verdict[1] = 0x7FFFFFFFFFFFFFFFLL;
        verdict[2] = 0;
    }
    if (b * BLOCK_WORDS >= count) return;  // whole warps: b is the same in all 32 lanes
    // the padded input: domain (lanes 0-2), key (3-6), b (7), SHAKE's 0x1F .. 0x80 (8, 20)
    u64 a = l == 0 ? DOMAIN0 : l == 1 ? DOMAIN1 : l == 2 ? DOMAIN2 : l == 3 ? key0
          : l == 4 ? key1 : l == 5 ? key2 : l == 6 ? key3 : l == 7 ? big_endian((u64)b)
          : l == 8 ? 0x1FULL : l == BLOCK_WORDS - 1 ? 0x8000000000000000ULL : 0ULL;
    const int source = KECCAK_SOURCE[l], shift = KECCAK_SHIFT[l];
    for (int round = 0; round < 24; ++round) {
        u64 c = 0;  // theta: column parities, then each lane's column gets d
        #pragma unroll
        for (int t = 0; t < 5; ++t) c ^= __shfl_sync(FULL, a, x + 5 * t);
        const u64 d = __shfl_sync(FULL, c, (x + 4) % 5)
                      ^ rotl64(__shfl_sync(FULL, c, (x + 1) % 5), 1);
        a = rotl64(__shfl_sync(FULL, a ^ d, source), shift);  // rho and pi
        const u64 next = __shfl_sync(FULL, a, (x + 1) % 5 + 5 * y);  // chi along the row
        const u64 after = __shfl_sync(FULL, a, (x + 2) % 5 + 5 * y);
        a ^= ~next & after;
        if (l == 0) a ^= KECCAK_ROUND[round];  // iota
    }
    if (l < BLOCK_WORDS && b * BLOCK_WORDS + l < count) words[b * BLOCK_WORDS + l] = a;
}
"""

COMMON = r"""
typedef unsigned long long u64;
#define PRIME 0x1FFFFFFFFFFFFFFFULL

__device__ __forceinline__ u64 mod_p(long long x) {  // any int64 -> [0, p)
    long long y = (x & (long long)PRIME) + (x >> 61);  // 2^61 = 1 mod p; y in [-4, p + 3]
    if (y < 0) y += (long long)PRIME;
    if (y >= (long long)PRIME) y -= (long long)PRIME;
    return (u64)y;
}
__device__ __forceinline__ u64 add_mod(u64 a, u64 b) {
    const u64 t = a + b;
    return t >= PRIME ? t - PRIME : t;
}
__device__ __forceinline__ u64 rotate(u64 y, int s) {  // y 2^s mod p, y in [0, p), s in [0, 61)
    return s == 0 ? y : (((y << s) & PRIME) | (y >> (61 - s)));
}

// Keccak-f[1600] (FIPS 202): 24 rounds of theta, rho, pi, chi, iota on 25 64-bit lanes
// (lane x + 5 y); the tables walk rho and pi along the lane cycle that starts at lane 1.
"""

# One pass over the rows of a matrix, configured by the VX_ constants; pass_source renames
# them, so that B's and C's passes, configured differently, share one launch.
BODY = r"""
// out[i, q] = (M_i . V_q) mod p for the rows of M; V entry (j, q) at V[j * vj + q * vq], low
// 61 bits kept (a word whose low 61 bits are p, which stream v3 rejects, sets verdict[2]).
// compare: instead of writing out, counts the rows where some q has a residue != Z into
// verdict[0] and the smallest such row into verdict[1].
__device__ __forceinline__ void VX_PASS(
        const VX_T* __restrict__ M, const u64* __restrict__ V, long long vj, long long vq,
        u64* __restrict__ out, const u64* __restrict__ Z, long long* __restrict__ verdict,
        long long rows, long long cols, long long limit, int compare, unsigned int* tile,
        long long block) {
    const int lane = threadIdx.x & 31;
    const long long warp = block * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long first = warp * VX_RPW;
#if VX_BYTES
    int acc[VX_RPW][VX_K][VX_L];
    const long long words = cols >> 2;  // 4 entries of M per 32-bit word
    const int* Mw = (const int*)M;
#else
    long long acc[VX_RPW][VX_K][VX_L];
    const long long words = cols;
#endif
#if !VX_BYTES && VX_CHECK
    bool bad[VX_RPW];
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r) bad[r] = false;
#endif
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r)
        #pragma unroll
        for (int q = 0; q < VX_K; ++q)
            #pragma unroll
            for (int l = 0; l < VX_L; ++l) acc[r][q][l] = 0;

    for (long long j0 = 0; j0 < words; j0 += VX_TILE) {
        const int width = (int)min((long long)VX_TILE, words - j0);
        __syncthreads();
        for (int t = threadIdx.x; t < VX_K * VX_TILE; t += blockDim.x) {
            const int q = t / VX_TILE, jj = t - q * VX_TILE;
#if VX_BYTES  // limb l of entries 4 jj .. 4 jj + 3, one byte each: a 4 x 8 byte transpose
            unsigned int half[2][4];  // [low or high 32 bits][entry]
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u64 v = jj < width ? V[(4 * (j0 + jj) + e) * vj + q * vq] & PRIME : 0;
                if (v == PRIME) verdict[2] = 1;
                half[0][e] = (unsigned int)v;
                half[1][e] = (unsigned int)(v >> 32);
            }
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int *x = half[h];
                const unsigned int b01 = __byte_perm(x[0], x[1], 0x5140);  // bytes 0, 1 of
                const unsigned int b23 = __byte_perm(x[0], x[1], 0x7362);  // entries 0 and 1
                const unsigned int c01 = __byte_perm(x[2], x[3], 0x5140);
                const unsigned int c23 = __byte_perm(x[2], x[3], 0x7362);
                unsigned int *row = tile + (q * VX_L + 4 * h) * VX_TILE + jj;
                row[0] = __byte_perm(b01, c01, 0x5410);
                row[VX_TILE] = __byte_perm(b01, c01, 0x7632);
                row[2 * VX_TILE] = __byte_perm(b23, c23, 0x5410);
                row[3 * VX_TILE] = __byte_perm(b23, c23, 0x7632);
            }
#else  // limb l of entry jj, VX_W bits
            const u64 v = jj < width ? V[(j0 + jj) * vj + q * vq] & PRIME : 0;
            if (v == PRIME) verdict[2] = 1;
            #pragma unroll
            for (int l = 0; l < VX_L; ++l)
                tile[(q * VX_L + l) * VX_TILE + jj] =
                    (unsigned int)((v >> (VX_W * l)) & ((1ULL << VX_W) - 1));
#endif
        }
        __syncthreads();
        for (int j = VX_VEC * lane; j < width; j += 32 * VX_VEC * VX_UNROLL) {
#if VX_BYTES
            int m[VX_UNROLL][VX_RPW][VX_VEC];
#else
            VX_R m[VX_UNROLL][VX_RPW][VX_VEC];  // 32 bits where they hold M: 32 x 32 -> 64 bits
#endif
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int jj = j + 32 * VX_VEC * u;
                #pragma unroll
                for (int r = 0; r < VX_RPW; ++r) {
                    const bool inside = jj < width && first + r < rows;
#if VX_VEC == 4  // 16-byte loads of 4 words (4-byte entries, or 4 int8 entries each)
                    const int4* row4 = reinterpret_cast<const int4*>(M) + (first + r) * (words / 4);
                    const int4 t = inside ? __ldg(row4 + (j0 + jj) / 4) : make_int4(0, 0, 0, 0);
                    m[u][r][0] = t.x;
                    m[u][r][1] = t.y;
                    m[u][r][2] = t.z;
                    m[u][r][3] = t.w;
#elif VX_BYTES
                    m[u][r][0] = inside ? Mw[(first + r) * words + j0 + jj] : 0;
#else
                    m[u][r][0] = inside ? (VX_R)M[(first + r) * words + j0 + jj] : 0;
#endif
                }
            }
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int jj = j + 32 * VX_VEC * u;
                if (jj < width) {
#if !VX_BYTES && VX_CHECK
                    #pragma unroll
                    for (int e = 0; e < VX_VEC; ++e)
                        #pragma unroll
                        for (int r = 0; r < VX_RPW; ++r)
                            bad[r] |= m[u][r][e] > limit || m[u][r][e] < -limit;
#endif
                    #pragma unroll
                    for (int q = 0; q < VX_K; ++q) {
                        #pragma unroll
                        for (int l = 0; l < VX_L; ++l) {
                            const unsigned int* at = tile + (q * VX_L + l) * VX_TILE + jj;
#if VX_VEC == 4  // one conflict-free 16-byte shared load
                            const uint4 w4 = *reinterpret_cast<const uint4*>(at);
                            const unsigned int w[4] = {w4.x, w4.y, w4.z, w4.w};
#else
                            const unsigned int w[1] = {at[0]};
#endif
                            #pragma unroll
                            for (int e = 0; e < VX_VEC; ++e) {
                                #pragma unroll
                                for (int r = 0; r < VX_RPW; ++r) {
#if VX_BYTES
                                    asm("dp4a.s32.u32 %0, %1, %2, %0;"
                                        : "+r"(acc[r][q][l]) : "r"(m[u][r][e]), "r"(w[e]));
#else
                                    acc[r][q][l] += (long long)m[u][r][e] * (long long)(VX_R)w[e];
#endif
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r) {
#if !VX_BYTES && VX_CHECK
        const bool row_bad = __any_sync(0xffffffffu, bad[r]);
#else
        const bool row_bad = false;
#endif
        bool differs = false;
        #pragma unroll
        for (int q = 0; q < VX_K; ++q) {
            u64 residue = 0;
            #pragma unroll
            for (int l = 0; l < VX_L; ++l)
                residue = add_mod(residue, rotate(mod_p((long long)acc[r][q][l]), VX_W * l));
            #pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                residue = add_mod(residue, __shfl_xor_sync(0xffffffffu, residue, offset));
            if (row_bad) residue = PRIME;  // no residue in [0, p) equals it
            if (first + r < rows) {
                if (compare) differs |= residue != Z[(first + r) * VX_K + q];
                else if (lane == 0) out[(first + r) * VX_K + q] = residue;
            }
        }
        if (differs && lane == 0) {
            atomicAdd((unsigned long long*)&verdict[0], 1ULL);
            atomicMin(&verdict[1], first + r);
        }
    }
}
"""

SINGLE = r"""
extern "C" __global__ void __launch_bounds__(VX_THREADS)
residues(const VX_T* __restrict__ M, const u64* __restrict__ V, long long vj, long long vq,
         u64* __restrict__ out, const u64* __restrict__ Z, long long* __restrict__ verdict,
         long long rows, long long cols, long long limit, int compare) {
    __shared__ __align__(16) unsigned int tile[VX_K * VX_L * VX_TILE];
    VX_PASS(M, V, vj, vq, out, Z, verdict, rows, cols, limit, compare, tile, blockIdx.x);
}
"""

# B R mod p in the first blocks_b blocks, C R mod p (C checked against limit) in the rest.
PAIR = r"""
extern "C" __global__ void __launch_bounds__(VB_THREADS)
residue_pair(const VB_T* __restrict__ B, u64* __restrict__ X, long long rows_b,
             const VC_T* __restrict__ C, u64* __restrict__ Z, long long rows_c,
             const u64* __restrict__ V, long long vq, long long cols, long long limit,
             long long* __restrict__ verdict, long long blocks_b) {
    __shared__ __align__(16) unsigned int tile[PAIR_TILE];
    if (blockIdx.x < blocks_b)
        VB_PASS(B, V, 1, vq, X, X, verdict, rows_b, cols, 0, 0, tile, blockIdx.x);
    else
        VC_PASS(C, V, 1, vq, Z, Z, verdict, rows_c, cols, limit, 0, tile, blockIdx.x - blocks_b);
}
"""


def rows_per_warp(launch: Launch, accumulator_words: int) -> int:
    """launch.rows, or fewer where a row's accumulators (32-bit words) crowd the registers."""
    rpw = launch.rows
    while rpw > 1 and rpw * accumulator_words > 64:
        rpw //= 2
    return rpw


def _alignment(M) -> int:
    """16, 4 or 1: the largest of these dividing the address of M's first entry."""
    ptr = M.data.ptr
    return 16 if ptr % 16 == 0 else 4 if ptr % 4 == 0 else 1


def _uses_bytes(dtype: np.dtype, cols: int, alignment: int) -> bool:
    return dtype == INT8 and cols % 4 == 0 and cols <= MAX_BYTES_COLS and alignment >= 4


def bytes_path(M) -> bool:
    """int8 rows read as 32-bit words of 4 entries, each against 4 limbs by one dp4a."""
    return _uses_bytes(M.dtype, M.shape[1], _alignment(M))


def wide_limb_width(bound: int, cols: int) -> int:
    """The widest w <= 31 with cols * bound * (2^w - 1) <= 2^63 - 1 (0 if none)."""
    return min(31, ((2**63 - 1) // (cols * max(bound, 1)) + 1).bit_length() - 1)


def supported(A, B, C, rounds: int, bounds: tuple[int, int, int]) -> bool:
    """Whether the fused kernels take this check: C-contiguous 2-D integer matrices of the
    listed types, up to MAX_ROUNDS rounds, and limbs of at least 8 bits for every pass."""
    if rounds > MAX_ROUNDS:
        return False
    for M, bound in zip((B, C, A), bounds, strict=True):
        if M.ndim != 2 or not M.flags.c_contiguous or M.dtype not in WIDE_DTYPES:
            return False
        if not bytes_path(M) and wide_limb_width(bound, M.shape[1]) < 8:
            return False
    return True


def tile_words(tile_bytes: int, rounds: int, limbs: int, unit: int) -> int:
    """Words of a tile: a multiple of unit (one pass of a warp's unrolled loads) where the
    budget allows, else of 32."""
    budget = tile_bytes // 4 // (rounds * limbs)
    step = unit if budget >= unit else 32
    return max(32, budget // step * step)


class Pass(NamedTuple):
    """One pass's compile-time constants (-DVX_...) and launch shape."""

    options: tuple[str, ...]
    blocks: int
    threads: int
    tile: int  # 32-bit words of shared memory for its tile of limbs


@lru_cache(maxsize=64)
def _pass(dtype: np.dtype, rows: int, cols: int, alignment: int, rounds: int, bound: int,
          check: bool) -> Pass:
    """The constants and launch of one pass, computed once per shape, type and bound."""
    use_bytes = _uses_bytes(dtype, cols, alignment)
    if use_bytes:
        words, limbs, width = cols // 4, 8, 8
    else:
        words, width = cols, wide_limb_width(bound, cols)
        limbs = -(-61 // width)
    vec = 4 if words % 4 == 0 and alignment == 16 and (use_bytes or dtype.itemsize == 4) else 1
    launch = LAUNCH["bytes" if use_bytes else "wide", vec]
    rpw = rows_per_warp(launch, rounds * limbs * (1 if use_bytes else 2))
    tile = tile_words(launch.tile_bytes, rounds, limbs, 32 * vec * launch.unroll)
    options = (f"-DVX_T={C_TYPES[dtype.name]}", f"-DVX_R={REGISTER_TYPES.get(dtype.name, 'int')}",
               f"-DVX_K={rounds}", f"-DVX_L={limbs}", f"-DVX_W={width}", f"-DVX_RPW={rpw}",
               f"-DVX_CHECK={int(check)}", f"-DVX_BYTES={int(use_bytes)}",
               f"-DVX_TILE={tile}", f"-DVX_UNROLL={launch.unroll}", f"-DVX_VEC={vec}",
               f"-DVX_THREADS={32 * launch.warps}")
    return Pass(options, -(-rows // (launch.warps * rpw)), 32 * launch.warps,
                rounds * limbs * tile)


@lru_cache(maxsize=64)
def _single_kernel(one: Pass):
    import cupy

    return cupy.RawKernel(COMMON + BODY + SINGLE, "residues", options=one.options)


@lru_cache(maxsize=64)
def _pair_kernel(b: Pass, c: Pass):
    """B's and C's passes in one kernel: each pass's constants renamed VB_ and VC_."""
    import cupy

    source = COMMON + BODY.replace("VX_", "VB_") + BODY.replace("VX_", "VC_") + PAIR
    options = (*(o.replace("-DVX_", "-DVB_") for o in b.options),
               *(o.replace("-DVX_", "-DVC_") for o in c.options),
               f"-DPAIR_TILE={max(b.tile, c.tile)}")
    return cupy.RawKernel(source, "residue_pair", options=options)


def residues(M, V, vj: int, vq: int, rounds: int, bound: int, limit: int | None, out,
             verdict, compare: bool = False) -> None:
    """One launch on the current stream: out = (M V) mod p, or with compare the comparison
    of (M V) mod p with out into verdict. limit: entries of M above it in magnitude mark
    their row (bound is then limit)."""
    rows, cols = M.shape
    one = _pass(M.dtype, rows, cols, _alignment(M), rounds, bound, limit is not None)
    _single_kernel(one)((one.blocks,), (one.threads,),
                        (M, V, np.int64(vj), np.int64(vq), out, out, verdict, np.int64(rows),
                         np.int64(cols), np.int64(limit or 0), np.int32(compare)))


class Vectors(NamedTuple):
    """What the device derives a check's field vectors from: field_key's 32 bytes as four
    little-endian 64-bit lanes (kernel arguments), and seed, n, rounds for the host."""

    seed: bytes
    n: int
    rounds: int
    key: tuple


def device_vectors(seed: bytes, n: int, rounds: int) -> Vectors:
    """The vectors of field_vectors(seed, n, rounds), to be derived on the device by the
    check itself (one hashlib call here: the key)."""
    return Vectors(seed, n, rounds, tuple(np.frombuffer(field_key(seed, n, rounds), "<u8")))


@cache
def _words_kernel():
    import cupy

    domain = [int.from_bytes(FIELD_BLOCK_DOMAIN[i : i + 8], "little") for i in (0, 8, 16)]
    options = (*(f"-DDOMAIN{i}={lane:#x}ULL" for i, lane in enumerate(domain)),
               f"-DBLOCK_WORDS={BLOCK_WORDS}")
    return cupy.RawKernel(WORDS_SOURCE, "field_words", options=options)


def derive_words(vectors: Vectors, words, verdict) -> None:
    """One launch on the current stream: words (rounds, n) uint64 = the first n * rounds words
    of stream v3 (their low 61 bits are field_vectors(...).T unless one is p, which the
    residue kernels report in verdict[2]); verdict reset. One warp per stream block."""
    count = vectors.n * vectors.rounds
    threads = 32 * -(-count // BLOCK_WORDS)
    _words_kernel()((-(-threads // WORDS_THREADS),), (WORDS_THREADS,),
                    (*vectors.key, words, np.int64(count), verdict))


class Workspace(NamedTuple):
    """Device buffers of one shape, kept between calls."""

    words: object  # (rounds, n) uint64: the vectors' stream words
    X: object  # (k, rounds) uint64: B R mod p
    Z: object  # (m, rounds) uint64: C R mod p
    verdict: object  # (3,) int64: rows that differ, the first of them, a word was rejected


@lru_cache(maxsize=8)
def _workspace(m: int, k: int, n: int, rounds: int, device: int) -> Workspace:
    import cupy

    return Workspace(cupy.empty((rounds, n), np.uint64), cupy.empty((k, rounds), np.uint64),
                     cupy.empty((m, rounds), np.uint64), cupy.empty(3, np.int64))


class Plan(NamedTuple):
    """Everything of a check that depends only on shapes, types, alignments and bounds:
    the kernels, their launch shapes and their scalar arguments, and the workspace."""

    ws: Workspace
    pair: object
    pair_grid: tuple[int]
    pair_block: tuple[int]
    pair_scalars: tuple  # rows_b, rows_c, vq, cols, limit, blocks_b
    a: object
    a_grid: tuple[int]
    a_block: tuple[int]
    a_scalars: tuple  # vj, vq, rows, cols, limit, compare


@lru_cache(maxsize=16)
def _plan(shapes: tuple, dtypes: tuple, alignments: tuple, rounds: int,
          bounds: tuple[int, int, int], product_bound: int, device: int) -> Plan:
    (m, k), (_, n) = shapes[0], shapes[1]
    (dtype_a, dtype_b, dtype_c), (align_a, align_b, align_c) = dtypes, alignments
    bound_b, bound_c, bound_a = bounds
    check_c = product_bound < bound_c
    b = _pass(dtype_b, k, n, align_b, rounds, bound_b, False)
    c = _pass(dtype_c, m, n, align_c, rounds, min(bound_c, product_bound), check_c)
    a = _pass(dtype_a, m, k, align_a, rounds, bound_a, False)
    assert b.threads == c.threads  # LAUNCH: one block size for both passes
    i64 = np.int64
    return Plan(_workspace(m, k, n, rounds, device),
                _pair_kernel(b, c), (b.blocks + c.blocks,), (b.threads,),
                (i64(k), i64(m), i64(n), i64(n), i64(product_bound if check_c else 0),
                 i64(b.blocks)),
                _single_kernel(a), (a.blocks,), (a.threads,),
                (i64(rounds), i64(1), i64(m), i64(k), i64(0), np.int32(1)))


def launch(A, B, C, vectors, rounds: int, bounds: tuple[int, int, int], product_bound: int):
    """Enqueue the check on the current stream: the vectors, B's and C's passes in one launch,
    then A's with the comparison; returns the device verdict (rows that differ, the first
    such row, whether a word was rejected). vectors: a Vectors, derived by the first launch,
    or (rounds, n) C-contiguous words already on the device."""
    import cupy

    plan = _plan((A.shape, B.shape), (A.dtype, B.dtype, C.dtype),
                 (_alignment(A), _alignment(B), _alignment(C)), rounds, bounds, product_bound,
                 cupy.cuda.runtime.getDevice())
    ws = plan.ws
    if isinstance(vectors, Vectors):
        derive_words(vectors, ws.words, ws.verdict)
        words = ws.words
    else:
        ws.verdict.set(VERDICT_RESET)
        words = vectors
    rows_b, rows_c, vq, cols, limit, blocks_b = plan.pair_scalars
    plan.pair(plan.pair_grid, plan.pair_block,
              (B, ws.X, rows_b, C, ws.Z, rows_c, words, vq, cols, limit, ws.verdict, blocks_b))
    plan.a(plan.a_grid, plan.a_block, (A, ws.X, *plan.a_scalars[:2], ws.Z, ws.Z, ws.verdict,
                                       *plan.a_scalars[2:]))
    return ws.verdict


def check(A, B, C, vectors: Vectors, rounds: int, bounds: tuple[int, int, int],
          product_bound: int) -> tuple[int, int]:
    """(rows where A (B R) != C R mod p or C holds an entry above product_bound, the first
    such row) for 2-D device matrices that supported() accepts. vectors: device_vectors(seed,
    n, rounds). bounds: max|B|, max|C|, max|A| as known from the dtypes or the data."""
    import cupy

    with _WORKSPACE_IN_USE:
        wrong, first, rejected = launch(A, B, C, vectors, rounds, bounds, product_bound).get()
        if rejected:  # a word is p (2^-61 each): the host's derivation skips it
            R = field_vectors(vectors.seed, vectors.n, vectors.rounds)
            words = cupy.asarray(np.ascontiguousarray(R.T, dtype=np.uint64))
            wrong, first, _ = launch(A, B, C, words, rounds, bounds, product_bound).get()
    return int(wrong), (int(first) if wrong else 0)


assert P == (1 << 61) - 1  # the kernel's PRIME
assert len(FIELD_BLOCK_DOMAIN) == 24  # the kernel's lanes 0-2; key 3-6, counter 7
