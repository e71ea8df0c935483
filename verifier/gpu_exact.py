"""Exact mode on a GPU in one kernel launch, the verdict written straight to pinned host
memory: the vectors; B R and C R; A (B R) compared with C R, the rows that differ counted on
the device. Products are reduced mod p = 2^61 - 1 inside the kernel, straight from the
int8/int32 data (no converted copy, no limb arrays).

The launch is cooperative (every block resident at once), so its phases meet at grid-wide
barriers instead of kernel boundaries; each block takes the phases' blocks of rows in turn.
The host's part of a check is the 32-byte key, a few assignments into a ctypes argument
block kept per shape, one driver call and one wait, with no copy either way: one compiled
call (verifier.gpu_launch, csrc/verifier_gpu_launch.cc) where it was built, else in Python.

A row of M times a vector v with entries in [0, p) is summed in integers that cannot
overflow: v is cut into limbs, and each lane sums M_ij * limb_j over its share of the row.
* int8 rows of a length divisible by 4 ("bytes"): 8-bit limbs, four entries of M against four
  limbs in one dp4a instruction, int32 sums (a lane adds at most cols / 128 results of
  magnitude at most 4 * 128 * 255 < 2^17: below 2^31 for rows up to 2^16 entries). Rows
  16-byte aligned and at most MMA_MAX_COLS long take the tensor cores instead: an int8 x
  uint8 mma multiplies 16 rows by 32 entries by the 8 limbs into int32 sums, which a row's
  whole sum bounds as above (the warps' sums are added in shared memory).
* every other type ("wide"): limbs of w <= 31 bits and int64 sums, w the widest with
  cols * bound * (2^w - 1) <= 2^63 - 1 (bound: the dtype's magnitude, or for C the product's
  bound k max|A| max|B|, checked entry by entry in the kernel: a row holding a larger entry is
  not the product and gets the residue p, which no true residue equals).
Each lane turns its limb sums into one residue (sum_t (S_t mod p) 2^(w t), a shift being a
61-bit rotation mod p) and the warp adds the 32 residues mod p.

The vectors never travel: the first phase derives the words of stream v3
(rng.field_vectors) from the key, one Keccak-f[1600] permutation per warp, and the passes
keep their low 61 bits. That is field_vectors itself unless a word's low 61 bits are all ones
(rejected there, probability 2^-61 per word): the passes flag such a word in the verdict, and
the check is then re-run with the host's derivation.
"""
from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Iterator
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from verifier.gpu import (
    COOPERATIVE,
    SPIN_NS,
    argument_block,
    launch_cooperative,
    pinned,
    resident_blocks,
    wait_for_ticket,
)
from verifier.rng import (
    BLOCK_WORDS,
    FIELD_BLOCK_DOMAIN,
    FIELD_KEY_DOMAIN,
    P,
    field_key,
    field_label,
    field_vectors,
)

try:  # the host's side of a check in one compiled call (csrc/verifier_gpu_launch.cc)
    from verifier import gpu_launch
except ImportError:  # not built: the same steps in Python, a few microseconds slower
    gpu_launch = None


class Launch(NamedTuple):
    """How a kernel of one inner loop runs (tuned on an H100 at n = 4096 and 8192)."""

    warps: int  # per block; they share the tiles of V
    unroll: int  # loads per row in flight per lane before they are used
    rows: int  # per warp, at most (fewer when their accumulators crowd the registers); on
    # the tensor cores groups of 16 rows
    tile_bytes: int  # shared memory for the limbs of one tile of V


# by inner loop and words per load (4: 16-byte loads), each the fastest of a sweep summed
# over n = 4096 and 8192, H100, bench/verify.py's int8/int32 operands: one-word loads of 81
# variants (warps 4/8/16, unroll 2/4/8, rows 1/2/4, tiles of 8/16/32 KiB), 16-byte loads of
# 18 per inner loop (warps 8/16, unroll 1/2/4, rows 1/2/4; the best 4-7% below the median).
# 16-byte loads re-swept in the one-launch check (both inner loops alike, 18 variants, CUDA
# events): unroll 4, rows 2 took n = 4096 from 79 to 69 us, n = 8192 the same 177 us.
# A 32 KiB tile holds a 4096-long vector's 8 byte limbs whole: a block fills it once. The
# 16-byte wide pass's 48 KiB (the most static shared memory) hold 4096 entries' 3 limbs whole
# (C of int8 operands at n = 4096), so C's row blocks wait for one fill instead of two (H100,
# one launch back to back, alternately in one process: n = 4096 49.7-49.8 against 50.5-50.7
# us with 32 KiB, n = 8192 165.4-165.5 against 167.0-167.1).
LAUNCH = {("bytes", 1): Launch(16, 4, 2, 32 * 1024), ("wide", 1): Launch(16, 8, 2, 32 * 1024),
          ("bytes", 4): Launch(16, 4, 2, 32 * 1024), ("wide", 4): Launch(16, 4, 2, 48 * 1024)}
MAX_ROUNDS = 4  # more rounds take the generic path (registers)
# B's and C's first rows fetched into the L2 while the vectors are derived (the H100's L2
# holds 50 MiB). H100, one launch back to back, alternately in one process, with the passes'
# loads skipping L1: n = 4096 52.0-52.7 us with 48 MiB, 53.4-54.2 with 32, 55.4-55.9 with 16,
# 58.5-58.9 without; n = 8192 167.9, 168.8, 169.8, 170.5. With the words given (no
# derivation) 51.0-51.1 us at 4096: the derivation's ~2.5 us are now mostly hidden.
PREFETCH_BYTES, PREFETCH_CHUNK = 48 << 20, 64 << 10
MAX_BYTES_COLS = 1 << 16  # int32 dp4a sums of a whole row cannot overflow up to this
# int8 rows read 16 bytes at a time take the tensor cores (mma) up to this length, dp4a
# beyond. H100, back-to-back checks, the same run: n = 4096 58.0 us with mma against 61.4
# with dp4a (A's pass alone 18.6 against 22.3, B's 19.4 against 22.2, both with the launch's
# ~14 us); n = 8192 175.9 against 172.7 (A's pass alone faster, 45.3 against 47.0, but B's
# beside C's slower, 144.8 against 141.2: rows read 64 bytes at a time by 8 rows at once
# contend with C's stream).
MMA_MAX_COLS = 4096
WIDE_TYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")
WIDE_DTYPES = frozenset(np.dtype(t) for t in WIDE_TYPES)
INT8 = np.dtype(np.int8)
C_TYPES = {"int8": "signed char", "uint8": "unsigned char", "int16": "short",
           "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
           "int64": "long long"}
REGISTER_TYPES = {"uint32": "unsigned int", "int64": "long long"}  # else int
_WORKSPACE_IN_USE = threading.Lock()  # one check at a time per workspace (host threads)

KECCAK = r"""
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

// Block b of a field vector (stream v3, verifier/rng.py), words b * BLOCK_WORDS .. below
// count, by one whole warp: SHAKE128(FIELD_BLOCK_DOMAIN || key || b as 8 bytes big-endian),
// one permutation of the padded 64-byte input.
__device__ __forceinline__ void field_block(u64 key0, u64 key1, u64 key2, u64 key3,
                                            long long b, u64* __restrict__ words,
                                            long long count) {
    const int l = threadIdx.x & 31, x = l % 5, y = l / 5;
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
// d += a b for a 16 x 32 int8 block a (rows g, g + 8 by entries 4 t + i, 16 + 4 t + i: a0 a1,
// a2 a3) and a 32 x 8 uint8 block b (entries 4 t + i, 16 + 4 t + i by column g: b0, b1), d
// rows g, g + 8 by columns 2 t, 2 t + 1 in int32; (g, t) = (lane / 4, lane % 4).
__device__ __forceinline__ void mma_s8_u8(int* d, int a0, int a1, int a2, int a3,
                                          unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// A 16-byte load of matrix data, which every pass reads once: not kept in L1, and the L2 asked
// to fetch the whole 256-byte block around it (H100, back-to-back checks at n = 4096: 53.6
// against 58.1-58.5 us with __ldg; n = 8192 170.1 against 173.8-174.1). The L1 hint is the
// part that counts: without it (256-byte fetches alone) 58.1 us, as with __ldg.
__device__ __forceinline__ int4 load_once(const int4* p) {
#if __CUDA_ARCH__ >= 800
    int4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return __ldg(p);
#endif
}
// |x| without overflow (|INT_MIN| is 2^31): a row's entries are bounded by their largest
// magnitude, one unsigned max per entry. As two signed 64-bit comparisons per entry the
// bound check cost 1.5 us of a 42.7 us check, this way 0.2 (H100, n = 4096, back to back).
__device__ __forceinline__ unsigned int magnitude(int x) {
    return x < 0 ? 0u - (unsigned int)x : (unsigned int)x;
}
__device__ __forceinline__ unsigned int magnitude(unsigned int x) { return x; }
__device__ __forceinline__ u64 magnitude(long long x) {
    return x < 0 ? 0ULL - (u64)x : (u64)x;
}
__device__ __forceinline__ u64 rotate(u64 y, int s) {  // y 2^s mod p, y in [0, p), s in [0, 61)
    return s == 0 ? y : (((y << s) & PRIME) | (y >> (61 - s)));
}
"""

# One pass over the rows of a matrix, configured by the VX_ constants; pass_source renames
# them, so that B's and C's passes, configured differently, share one launch.
BODY = r"""
// The limbs of V's entries (j0 + jj, q), jj < width (zero beyond), into the tile: VX_TILE
// words per limb and round. Each thread issues all its loads of V before it uses any: the
// block waits here with none of M's loads in flight, so the fill is one L2 round trip, not
// one per entry (H100, one launch back to back at n = 4096: 50.5-50.7 against 51.9-52.3 us).
__device__ __forceinline__ void VX_FILL(const u64* __restrict__ V, long long vj, long long vq,
                                        long long j0, int width, unsigned int* tile,
                                        long long* __restrict__ verdict) {
    constexpr int STEPS = (VX_K * VX_TILE + VX_THREADS - 1) / VX_THREADS;
    constexpr int PER = VX_BYTES ? 4 : 1;  // entries of V per tile word
    u64 v[STEPS][PER];
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const int t = threadIdx.x + i * VX_THREADS, q = t / VX_TILE, jj = t - q * VX_TILE;
        #pragma unroll
        for (int e = 0; e < PER; ++e)
            v[i][e] = t < VX_K * VX_TILE && jj < width
                      ? V[(PER * (j0 + jj) + e) * vj + q * vq] & PRIME : 0;
    }
    #pragma unroll
    for (int i = 0; i < STEPS; ++i) {
        const int t = threadIdx.x + i * VX_THREADS, q = t / VX_TILE, jj = t - q * VX_TILE;
        if (t >= VX_K * VX_TILE) break;
        #pragma unroll
        for (int e = 0; e < PER; ++e)
            if (v[i][e] == PRIME) verdict[2] = 1;
#if VX_BYTES  // limb l of entries 4 jj .. 4 jj + 3, one byte each: a 4 x 8 byte transpose
        #pragma unroll
        for (int h = 0; h < 2; ++h) {  // the low, then the high 32 bits of the 4 entries
            const unsigned int x0 = (unsigned int)(v[i][0] >> (32 * h));
            const unsigned int x1 = (unsigned int)(v[i][1] >> (32 * h));
            const unsigned int x2 = (unsigned int)(v[i][2] >> (32 * h));
            const unsigned int x3 = (unsigned int)(v[i][3] >> (32 * h));
            const unsigned int b01 = __byte_perm(x0, x1, 0x5140);  // bytes 0, 1 of
            const unsigned int b23 = __byte_perm(x0, x1, 0x7362);  // entries 0 and 1
            const unsigned int c01 = __byte_perm(x2, x3, 0x5140);
            const unsigned int c23 = __byte_perm(x2, x3, 0x7362);
            unsigned int *row = tile + (q * VX_L + 4 * h) * VX_TILE + jj;
            row[0] = __byte_perm(b01, c01, 0x5410);
            row[VX_TILE] = __byte_perm(b01, c01, 0x7632);
            row[2 * VX_TILE] = __byte_perm(b23, c23, 0x5410);
            row[3 * VX_TILE] = __byte_perm(b23, c23, 0x7632);
        }
#else  // limb l of entry jj, VX_W bits
        #pragma unroll
        for (int l = 0; l < VX_L; ++l)
            tile[(q * VX_L + l) * VX_TILE + jj] =
                (unsigned int)((v[i][0] >> (VX_W * l)) & ((1ULL << VX_W) - 1));
#endif
    }
}

// out[i, q] = (M_i . V_q) mod p for the rows of M; V entry (j, q) at V[j * vj + q * vq], low
// 61 bits kept (a word whose low 61 bits are p, which stream v3 rejects, sets verdict[2]).
// compare: instead of writing out, counts the rows where some q has a residue != Z into
// verdict[0] and the smallest such row into verdict[1].
#if !VX_MMA
__device__ __forceinline__ void VX_PASS(
        const VX_T* __restrict__ M, const u64* __restrict__ V, long long vj, long long vq,
        u64* __restrict__ out, const u64* __restrict__ Z, long long* __restrict__ verdict,
        long long rows, long long cols, long long limit, int compare, unsigned int* tile,
        long long block, unsigned int* wait, unsigned int barrier_index) {
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
    decltype(magnitude((VX_R)0)) largest[VX_RPW];  // of the row's entries this lane read
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r) largest[r] = 0;
#endif
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r)
        #pragma unroll
        for (int q = 0; q < VX_K; ++q)
            #pragma unroll
            for (int l = 0; l < VX_L; ++l) acc[r][q][l] = 0;

    for (long long j0 = 0; j0 < words; j0 += VX_TILE) {
        const int width = (int)min((long long)VX_TILE, words - j0);
#if VX_BYTES
        int m[VX_UNROLL][VX_RPW][VX_VEC];
#else
        VX_R m[VX_UNROLL][VX_RPW][VX_VEC];  // 32 bits where they hold M: 32 x 32 -> 64 bits
#endif
        auto load = [&](const int j) {  // VX_UNROLL loads per row in flight before any is used
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int jj = j + 32 * VX_VEC * u;
                #pragma unroll
                for (int r = 0; r < VX_RPW; ++r) {
                    const bool inside = jj < width && first + r < rows;
#if VX_VEC == 4  // 16-byte loads of 4 words (4-byte entries, or 4 int8 entries each)
                    const int4* row4 = reinterpret_cast<const int4*>(M) + (first + r) * (words / 4);
                    const int4 t = inside ? load_once(row4 + (j0 + jj) / 4) : make_int4(0, 0, 0, 0);
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
        };
        load(VX_VEC * lane);  // the tile's first loads need no vector: issued before the wait
        if (wait != nullptr && j0 == 0) grid_wait(wait, barrier_index);
        else __syncthreads();
        VX_FILL(V, vj, vq, j0, width, tile, verdict);
        __syncthreads();
        for (int j = VX_VEC * lane; j < width; j += 32 * VX_VEC * VX_UNROLL) {
            if (j != VX_VEC * lane) load(j);
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int jj = j + 32 * VX_VEC * u;
                if (jj < width) {
#if !VX_BYTES && VX_CHECK
                    #pragma unroll
                    for (int e = 0; e < VX_VEC; ++e)
                        #pragma unroll
                        for (int r = 0; r < VX_RPW; ++r)
                            largest[r] = max(largest[r], magnitude(m[u][r][e]));
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
        const bool row_bad = __any_sync(0xffffffffu, (u64)largest[r] > (u64)limit);  // limit >= 0
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
#else
// The same pass for int8 rows read 16 bytes at a time, the products on the tensor cores: a
// warp takes VX_RPW groups of 16 rows against the 8 byte limbs of each vector (one m16n8k32
// integer mma: 16 rows x 32 entries x 8 limbs), the warps of a block splitting each row's
// words between them; their int32 sums meet in shared memory. Lane (g, t) = (lane / 4,
// lane % 4) loads rows g and g + 8 of a group, 16 bytes at word 4 t of a span of 16 words;
// the span's 64 entries go to two mma in an order that its limbs (one 16-byte shared load of
// limb g) follow, the sum being the same in any order.
__device__ __forceinline__ void VX_PASS(
        const VX_T* __restrict__ M, const u64* __restrict__ V, long long vj, long long vq,
        u64* __restrict__ out, const u64* __restrict__ Z, long long* __restrict__ verdict,
        long long rows, long long cols, long long limit, int compare, unsigned int* tile,
        long long block, unsigned int* wait, unsigned int barrier_index) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long first = block * VX_BLOCK_ROWS, words = cols >> 2;
    const int4* M4 = reinterpret_cast<const int4*>(M);
    static_assert(VX_TILE >= VX_BLOCK_ROWS, "the tile holds the block's sums at the end");
    int acc[VX_RPW][VX_K][4];  // [group][round]: rows g, g + 8 by limbs 2 t, 2 t + 1
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r)
        #pragma unroll
        for (int q = 0; q < VX_K; ++q)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][q][i] = 0;

    for (long long j0 = 0; j0 < words; j0 += VX_TILE) {
        const int width = (int)min((long long)VX_TILE, words - j0);
        int4 m[VX_UNROLL][VX_RPW][2];
        auto load = [&](const int s) {
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int at = s + 16 * warps * u + 4 * t;
                #pragma unroll
                for (int r = 0; r < VX_RPW; ++r)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const long long row = first + 16 * r + 8 * h + g;
                        m[u][r][h] = at < width && row < rows
                            ? load_once(M4 + row * (words >> 2) + ((j0 + at) >> 2))
                            : make_int4(0, 0, 0, 0);
                    }
            }
        };
        load(16 * warp);  // the tile's first loads need no vector: issued before the wait
        if (wait != nullptr && j0 == 0) grid_wait(wait, barrier_index);
        else __syncthreads();
        VX_FILL(V, vj, vq, j0, width, tile, verdict);
        __syncthreads();
        for (int s = 16 * warp; s < width; s += 16 * warps * VX_UNROLL) {
            if (s != 16 * warp) load(s);
            #pragma unroll
            for (int u = 0; u < VX_UNROLL; ++u) {
                const int span = s + 16 * warps * u;
                if (span < width) {
                    #pragma unroll
                    for (int q = 0; q < VX_K; ++q) {
                        const uint4 b = *reinterpret_cast<const uint4*>(
                            tile + (q * VX_L + g) * VX_TILE + span + 4 * t);
                        #pragma unroll
                        for (int r = 0; r < VX_RPW; ++r) {
                            const int4 lo = m[u][r][0], hi = m[u][r][1];
                            mma_s8_u8(acc[r][q], lo.x, hi.x, lo.y, hi.y, b.x, b.y);
                            mma_s8_u8(acc[r][q], lo.z, hi.z, lo.w, hi.w, b.z, b.w);
                        }
                    }
                }
            }
        }
    }
    __syncthreads();  // the tile is free: it takes the block's sums [row][round][limb]
    int* sums = reinterpret_cast<int*>(tile);
    for (int i = threadIdx.x; i < VX_BLOCK_ROWS * VX_K * VX_L; i += blockDim.x) sums[i] = 0;
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < VX_RPW; ++r)
        #pragma unroll
        for (int q = 0; q < VX_K; ++q)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                int* at = sums + ((16 * r + 8 * h + g) * VX_K + q) * VX_L + 2 * t;
                atomicAdd(at, acc[r][q][2 * h]);
                atomicAdd(at + 1, acc[r][q][2 * h + 1]);
            }
    __syncthreads();
    for (int i = threadIdx.x; i < VX_BLOCK_ROWS; i += blockDim.x) {
        const long long row = first + i;
        if (row >= rows) break;
        bool differs = false;
        #pragma unroll
        for (int q = 0; q < VX_K; ++q) {
            u64 residue = 0;
            #pragma unroll
            for (int l = 0; l < VX_L; ++l)
                residue = add_mod(residue, rotate(mod_p(sums[(i * VX_K + q) * VX_L + l]), 8 * l));
            if (compare) differs |= residue != Z[row * VX_K + q];
            else out[row * VX_K + q] = residue;
        }
        if (differs) {
            atomicAdd((unsigned long long*)&verdict[0], 1ULL);
            atomicMin(&verdict[1], row);
        }
    }
}
#endif
"""

SINGLE = r"""
extern "C" __global__ void __launch_bounds__(VX_THREADS)
residues(const VX_T* __restrict__ M, const u64* __restrict__ V, long long vj, long long vq,
         u64* __restrict__ out, const u64* __restrict__ Z, long long* __restrict__ verdict,
         long long rows, long long cols, long long limit, int compare) {
    __shared__ __align__(16) unsigned int tile[VX_K * VX_L * VX_TILE];
    VX_PASS(M, V, vj, vq, out, Z, verdict, rows, cols, limit, compare, tile, blockIdx.x,
            nullptr, 0);
}
"""

# The whole check in one launch of resident blocks (a cooperative launch, so all of them are
# resident and may wait for each other): the vectors; a grid-wide barrier; B's pass; a
# barrier, at which a block arrives, takes its rows of C (they need only the vectors), then
# waits; A's pass over the same rows, compared with them; the last block to finish copies the
# verdict to host memory. A block's first pass after a barrier issues its first loads (inputs
# no block writes) before it waits. H100, n = 4096, 50 launches back to back, in the same
# calls: 48.3-48.6 us with C's pass before the second barrier, a barrier with a generation
# word and the vectors' blocks on 16 SMs; 42.8-43.1 us with this order, the one-word barrier
# and the blocks spread (45.8-46.4 without the spread); n = 8192 158.9 against 154.2-155.1.
# Every argument is 8 bytes (check's ctypes argument block). The grid barrier is
# verifier/gpu.py's (COOPERATIVE).
FUSED = r"""
// A hint to the L2 to fetch bytes from start (both multiples of 16); returns at once.
__device__ __forceinline__ void prefetch_l2(const char* start, long long bytes) {
#if __CUDA_ARCH__ >= 900
    for (long long at = 0; at < bytes; at += PREFETCH_CHUNK) {
        const unsigned int size = (unsigned int)min(bytes - at, (long long)PREFETCH_CHUNK);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                     :: "l"(start + at), "r"(size) : "memory");
    }
#endif
}

// The rows a block of check takes C's and A's passes over: C's and A's row blocks nest in
// spans of SPAN_ROWS (both are powers of two).
#define SPAN_ROWS (VA_BLOCK_ROWS > VC_BLOCK_ROWS ? VA_BLOCK_ROWS : VC_BLOCK_ROWS)
static_assert(SPAN_ROWS % VA_BLOCK_ROWS == 0 && SPAN_ROWS % VC_BLOCK_ROWS == 0, "row blocks nest");

// Up to budget bytes of rows first .. first + count - 1 (of rows) of a matrix fetched into the
// L2; returns the bytes asked for.
__device__ __forceinline__ long long prefetch_rows(const char* M, long long first, long long count,
                                                   long long rows, long long row_bytes,
                                                   long long budget) {
    const long long bytes = min(budget, (min(first + count, rows) - first) * row_bytes) & ~15LL;
    prefetch_l2(M + first * row_bytes, bytes);
    return bytes;
}

// The rows of B and C this block reads first, in the order check takes them, up to its share
// of PREFETCH_BYTES, fetched into the L2 while the vectors are derived (passes with 16-byte
// loads only: their rows start at multiples of 16 bytes).
__device__ __forceinline__ void prefetch_first_rows(
        const VB_T* B, const VC_T* C, long long m, long long k, long long n,
        long long blocks_b, long long blocks_c) {
    long long budget = PREFETCH_BYTES / gridDim.x;
    for (long long v = blockIdx.x; VB_VEC == 4 && v < blocks_b && budget > 0; v += gridDim.x)
        budget -= prefetch_rows((const char*)B, v * VB_BLOCK_ROWS, VB_BLOCK_ROWS, k,
                                n * (long long)sizeof(VB_T), budget);
    for (long long v = blockIdx.x * (SPAN_ROWS / VC_BLOCK_ROWS); VC_VEC == 4 && v < blocks_c
         && budget > 0; v += gridDim.x * (SPAN_ROWS / VC_BLOCK_ROWS))
        budget -= prefetch_rows((const char*)C, v * VC_BLOCK_ROWS, SPAN_ROWS, m,
                                n * (long long)sizeof(VC_T), budget);
}

// derive: words = the first n * rounds words of stream v3 from the key (else words holds
// them already). X (k, rounds) = B R mod p, Z (m, rounds) = C R mod p; verdict (device) and
// host_verdict (pinned host memory): rows where A X != Z, the first such row, whether a word
// was p; then host_verdict[3] = ticket, which the host polls for.
extern "C" __global__ void __launch_bounds__(CHECK_THREADS)
check(const VA_T* __restrict__ A, const VB_T* __restrict__ B, const VC_T* __restrict__ C,
      u64 key0, u64 key1, u64 key2, u64 key3, long long derive, u64* words, u64* X, u64* Z,
      long long* verdict, unsigned int* barrier, long long* host_verdict, long long m,
      long long k, long long n, long long rounds, long long limit, long long blocks_b,
      long long blocks_c, long long blocks_a, long long ticket) {
    __shared__ __align__(16) unsigned int tile[CHECK_TILE];
    if (threadIdx.x == 0) prefetch_first_rows(B, C, m, k, n, blocks_b, blocks_c);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        verdict[0] = 0;
        verdict[1] = 0x7FFFFFFFFFFFFFFFLL;
        verdict[2] = 0;
    }
    if (derive) {  // one stream block per warp, spread over the SMs first (an SM's shuffles
        // serve its warps in turn: sixteen permutations on one SM took ~11 us, one ~3.5; H100,
        // globaltimer marks); the loop is the same in all lanes
        const long long count = n * rounds, warps = (long long)gridDim.x * (blockDim.x >> 5);
        for (long long b = (long long)(threadIdx.x >> 5) * gridDim.x + blockIdx.x;
             b * BLOCK_WORDS < count; b += warps)
            field_block(key0, key1, key2, key3, b, words, count);
    }
    // A block's first pass after a barrier issues its first loads of M, then waits there (a
    // block with no such rows waits after its loop). The block takes its rows of C, which need
    // only the vectors, between its arrival at the second barrier and its wait, so no block
    // idles there; it then compares the same rows of A, so no row of Z crosses blocks.
    unsigned int* wait = barrier;
    grid_arrive(barrier);
    for (long long v = blockIdx.x; v < blocks_b; v += gridDim.x, wait = nullptr)
        VB_PASS(B, words, 1, n, X, X, verdict, k, n, 0, 0, tile, v, wait, 1);
    if (wait != nullptr) grid_wait(wait, 1);
    grid_arrive(barrier);
    const long long spans = (m + SPAN_ROWS - 1) / SPAN_ROWS;
    for (long long s = blockIdx.x; s < spans; s += gridDim.x)
        for (long long v = s * (SPAN_ROWS / VC_BLOCK_ROWS);
             v < min((s + 1) * (SPAN_ROWS / VC_BLOCK_ROWS), blocks_c); ++v)
            VC_PASS(C, words, 1, n, Z, Z, verdict, m, n, limit, 0, tile, v, nullptr, 0);
    wait = barrier;
    for (long long s = blockIdx.x; s < spans; s += gridDim.x)
        for (long long v = s * (SPAN_ROWS / VA_BLOCK_ROWS);
             v < min((s + 1) * (SPAN_ROWS / VA_BLOCK_ROWS), blocks_a); ++v, wait = nullptr)
            VA_PASS(A, X, rounds, 1, Z, Z, verdict, m, k, 0, 1, tile, v, wait, 2);
    __syncthreads();
    if (threadIdx.x == 0) {
        if (grid_done(barrier)) {  // the last block: every row counted
            const volatile long long* result = verdict;
            host_verdict[0] = result[0];
            host_verdict[1] = result[1];
            host_verdict[2] = result[2];
            __threadfence_system();
            *(volatile long long*)(host_verdict + 3) = ticket;  // the verdict is complete
        }
    }
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


def _arch() -> int:
    """The current device's compute capability as 10 major + minor (90 for an H100)."""
    import cupy

    return int(cupy.cuda.Device().compute_capability)


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
          check: bool, arch: int) -> Pass:
    """The constants and launch of one pass, computed once per shape, type and bound."""
    use_bytes = _uses_bytes(dtype, cols, alignment)
    if use_bytes:
        words, limbs, width = cols // 4, 8, 8
    else:
        words, width = cols, wide_limb_width(bound, cols)
        limbs = -(-61 // width)
    vec = 4 if words % 4 == 0 and alignment == 16 and (use_bytes or dtype.itemsize == 4) else 1
    launch = LAUNCH["bytes" if use_bytes else "wide", vec]
    mma = use_bytes and vec == 4 and cols <= MMA_MAX_COLS and arch >= 80  # mma.sync s8: sm_80+
    if mma:  # groups of 16 rows, 4 sums per group and round
        rpw = rows_per_warp(launch, 4 * rounds)
        block_rows, unit = 16 * rpw, 16 * launch.warps * launch.unroll
    else:
        rpw = rows_per_warp(launch, rounds * limbs * (1 if use_bytes else 2))
        block_rows, unit = launch.warps * rpw, 32 * vec * launch.unroll
    tile = tile_words(launch.tile_bytes, rounds, limbs, unit)
    options = (f"-DVX_T={C_TYPES[dtype.name]}", f"-DVX_R={REGISTER_TYPES.get(dtype.name, 'int')}",
               f"-DVX_K={rounds}", f"-DVX_L={limbs}", f"-DVX_W={width}", f"-DVX_RPW={rpw}",
               f"-DVX_CHECK={int(check)}", f"-DVX_BYTES={int(use_bytes)}",
               f"-DVX_TILE={tile}", f"-DVX_UNROLL={launch.unroll}", f"-DVX_VEC={vec}",
               f"-DVX_THREADS={32 * launch.warps}", f"-DVX_MMA={int(mma)}",
               f"-DVX_BLOCK_ROWS={block_rows}")
    return Pass(options, -(-rows // block_rows), 32 * launch.warps, rounds * limbs * tile)


@lru_cache(maxsize=64)
def _single_kernel(one: Pass):
    import cupy

    return cupy.RawKernel(COMMON + COOPERATIVE + BODY + SINGLE, "residues", options=one.options)


def _prefetch_bytes(device: int) -> int:
    """PREFETCH_BYTES, at most the device's L2 (the H100's holds 50 MiB): on a GPU with a
    smaller L2 more would evict the first rows fetched before their pass reads them."""
    import cupy

    l2 = cupy.cuda.Device(device).attributes["L2CacheSize"]
    return min(PREFETCH_BYTES, l2) & ~(PREFETCH_CHUNK - 1)


@lru_cache(maxsize=64)
def _fused_kernel(a: Pass, b: Pass, c: Pass, prefetch_bytes: int):
    """The check's one kernel: each pass's constants renamed VA_, VB_ and VC_."""
    import cupy

    domain = [int.from_bytes(FIELD_BLOCK_DOMAIN[i : i + 8], "little") for i in (0, 8, 16)]
    source = (COMMON + KECCAK + COOPERATIVE + "".join(BODY.replace("VX_", f"V{x}_") for x in "ABC")
              + FUSED)
    options = (*(o.replace("-DVX_", f"-DV{x}_") for x, one in zip("ABC", (a, b, c), strict=True)
                 for o in one.options),
               f"-DCHECK_TILE={max(a.tile, b.tile, c.tile)}", f"-DCHECK_THREADS={a.threads}",
               f"-DPREFETCH_BYTES={prefetch_bytes}LL", f"-DPREFETCH_CHUNK={PREFETCH_CHUNK}",
               *(f"-DDOMAIN{i}={lane:#x}ULL" for i, lane in enumerate(domain)),
               f"-DBLOCK_WORDS={BLOCK_WORDS}")
    return cupy.RawKernel(source, "check", options=options)


def residues(M, V, vj: int, vq: int, rounds: int, bound: int, limit: int | None, out,
             verdict, compare: bool = False) -> None:
    """One launch on the current stream: out = (M V) mod p, or with compare the comparison
    of (M V) mod p with out into verdict. limit: entries of M above it in magnitude mark
    their row (bound is then limit)."""
    rows, cols = M.shape
    one = _pass(M.dtype, rows, cols, _alignment(M), rounds, bound, limit is not None, _arch())
    _single_kernel(one)((one.blocks,), (one.threads,),
                        (M, V, np.int64(vj), np.int64(vq), out, out, verdict, np.int64(rows),
                         np.int64(cols), np.int64(limit or 0), np.int32(compare)))


class Workspace(NamedTuple):
    """Device buffers of one shape, kept between calls, and the verdict's host memory."""

    words: object  # (rounds, n) uint64: the vectors' stream words
    X: object  # (k, rounds) uint64: B R mod p
    Z: object  # (m, rounds) uint64: C R mod p
    verdict: object  # (3,) int64: rows that differ, the first of them, a word was rejected
    barrier: object  # (2,) uint32, zero between launches: the grid barrier's arrivals and the
    # blocks that finished
    pinned: object  # 32 bytes of pinned host memory the kernel writes the verdict to
    host_verdict: np.ndarray  # (3,) int64 view of pinned
    host_words: memoryview  # all 4 words of pinned: the verdict and the launch's ticket
    tickets: Iterator[int]  # one per launch on this workspace, whichever plan launches it


@lru_cache(maxsize=8)
def _workspace(m: int, k: int, n: int, rounds: int, device: int) -> Workspace:
    import cupy

    memory, words = pinned(4, np.int64)
    words[:] = 0  # no ticket yet (pinned memory may be reused, holding an old workspace's)
    return Workspace(cupy.empty((rounds, n), np.uint64), cupy.empty((k, rounds), np.uint64),
                     cupy.empty((m, rounds), np.uint64), cupy.empty(3, np.int64),
                     cupy.zeros(2, np.uint32), memory, words[:3], memoryview(words),
                     itertools.count(1))


ARGUMENTS = 23  # the kernel's, 8 bytes each
KEY_ARGUMENT, DERIVE_ARGUMENT, WORDS_ARGUMENT, TICKET_ARGUMENT = 3, 7, 8, 22


class Plan(NamedTuple):
    """Everything of a check that depends only on shapes, types, alignments and bounds: the
    kernel, its grid, its arguments (all but A, B, C, the key and the words filled in) and
    the workspace. Launched through the driver with these arguments, a check costs the host
    a few assignments and one call."""

    ws: Workspace
    n: int
    rounds: int
    function: int  # the CUfunction
    grid: int  # blocks, all resident at once
    threads: int
    arguments: object  # ctypes array of ARGUMENTS uint64
    parameters: object  # ctypes array of pointers to them (cuLaunchCooperativeKernel's)
    key: memoryview  # the 32 bytes of arguments that hold the key (a slice assignment is a
    # plain copy, where ctypes.memmove costs the host most of a microsecond)
    launcher: object  # gpu_launch's capsule for this plan, None without the module


@lru_cache(maxsize=16)
def prepare(shapes: tuple, dtypes: tuple, alignments: tuple, rounds: int,
            bounds: tuple[int, int, int], product_bound: int, device: int) -> Plan:
    """The plan of a check of A (m, k) @ B (k, n) against C: shapes (A's, B's), dtypes and
    alignments (_alignment) of A, B, C, bounds max|B|, max|C|, max|A|."""
    (m, k), (_, n) = shapes
    (dtype_a, dtype_b, dtype_c), (align_a, align_b, align_c) = dtypes, alignments
    bound_b, bound_c, bound_a = bounds
    check_c = product_bound < bound_c
    arch = _arch()
    b = _pass(dtype_b, k, n, align_b, rounds, bound_b, False, arch)
    c = _pass(dtype_c, m, n, align_c, rounds, min(bound_c, product_bound), check_c, arch)
    a = _pass(dtype_a, m, k, align_a, rounds, bound_a, False, arch)
    assert a.threads == b.threads == c.threads  # LAUNCH: one block size for every pass
    kernel = _fused_kernel(a, b, c, _prefetch_bytes(device))
    keccak_blocks = -(-32 * -(-n * rounds // BLOCK_WORDS) // a.threads)
    grid = min(resident_blocks(kernel, a.threads, device),
               max(b.blocks + c.blocks, a.blocks, keccak_blocks))
    ws = _workspace(m, k, n, rounds, device)
    arguments, parameters = argument_block(
        (0,) * WORDS_ARGUMENT
        + (ws.words.data.ptr, ws.X.data.ptr, ws.Z.data.ptr, ws.verdict.data.ptr,
           ws.barrier.data.ptr, ws.pinned.ptr, m, k, n, rounds,
           product_bound if check_c else 0, b.blocks, c.blocks, a.blocks, 0))
    assert len(arguments) == ARGUMENTS
    key = memoryview(arguments).cast("B")[8 * KEY_ARGUMENT : 8 * KEY_ARGUMENT + 32]
    return Plan(ws, n, rounds, kernel.kernel.ptr, grid, a.threads, arguments, parameters, key,
                _launcher(kernel.kernel.ptr, grid, a.threads, parameters, arguments, ws))


def _launcher(function: int, grid: int, threads: int, parameters, arguments, ws: Workspace):
    """gpu_launch's capsule for a plan, or None: without the module, or where it cannot open
    the driver as libcuda.so.1 (CuPy found it some other way), the same steps run in Python."""
    if gpu_launch is None:
        return None
    rounds, n = ws.words.shape
    try:
        return gpu_launch.launcher(
            function, grid, threads, ctypes.addressof(parameters), ctypes.addressof(arguments),
            KEY_ARGUMENT, DERIVE_ARGUMENT, WORDS_ARGUMENT, ws.words.data.ptr, TICKET_ARGUMENT,
            ws.pinned.ptr, FIELD_KEY_DOMAIN, field_label(n, rounds), SPIN_NS)
    except RuntimeError:
        return None


def plan_for(A, B, C, rounds: int, bounds: tuple[int, int, int], product_bound: int) -> Plan:
    """prepare() for these matrices on the current device."""
    import cupy

    return prepare((A.shape, B.shape), (A.dtype, B.dtype, C.dtype),
                   (_alignment(A), _alignment(B), _alignment(C)), rounds, bounds,
                   product_bound, cupy.cuda.runtime.getDevice())


def launch(plan: Plan, A, B, C, key: bytes | None = None, words=None, stream=None) -> np.ndarray:
    """Enqueue the check on the stream (default: the current one): vectors derived from key
    (field_key's 32 bytes), or the (rounds, n) C-contiguous device words given. Returns
    plan's host verdict (rows that differ, the first such row, whether a word was rejected),
    written by the kernel: read it once the kernel has written the launch's ticket
    (plan.arguments[TICKET_ARGUMENT]) to plan.ws.host_words[3], or the stream has
    synchronised."""
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    arguments = plan.arguments
    arguments[0], arguments[1], arguments[2] = A.data.ptr, B.data.ptr, C.data.ptr
    if key is None:
        arguments[DERIVE_ARGUMENT], arguments[WORDS_ARGUMENT] = 0, words.data.ptr
    else:
        plan.key[:] = key
        arguments[DERIVE_ARGUMENT] = 1
        arguments[WORDS_ARGUMENT] = plan.ws.words.data.ptr
    arguments[TICKET_ARGUMENT] = next(plan.ws.tickets)
    launch_cooperative(plan.function, plan.grid, plan.threads, plan.parameters, stream.ptr)
    return plan.ws.host_verdict


def _verdict(plan: Plan, stream) -> tuple[int, int, int]:
    """The launch's verdict once the kernel has written it."""
    host_words = plan.ws.host_words
    wait_for_ticket(host_words, 3, plan.arguments[TICKET_ARGUMENT], stream)
    return host_words[0], host_words[1], host_words[2]


def check(plan: Plan, A, B, C, seed: bytes) -> tuple[int, int]:
    """(rows where A (B R) != C R mod p or C holds an entry above the plan's product bound,
    the first such row) for 2-D device matrices that supported() accepts, R =
    field_vectors(seed, n, rounds)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    with _WORKSPACE_IN_USE:
        if plan.launcher is not None:
            wrong, first, rejected = gpu_launch.check(plan.launcher, A.data.ptr, B.data.ptr,
                                                      C.data.ptr, seed, stream.ptr,
                                                      next(plan.ws.tickets))
        else:
            launch(plan, A, B, C, field_key(seed, plan.n, plan.rounds), stream=stream)
            wrong, first, rejected = _verdict(plan, stream)
        if rejected:  # a word is p (2^-61 each): the host's derivation skips it
            R = field_vectors(seed, plan.n, plan.rounds)
            words = cupy.asarray(np.ascontiguousarray(R.T, dtype=np.uint64))
            launch(plan, A, B, C, words=words, stream=stream)
            wrong, first, _ = _verdict(plan, stream)
    return wrong, (first if wrong else 0)


assert P == (1 << 61) - 1  # the kernel's PRIME
assert len(FIELD_BLOCK_DOMAIN) == 24  # the kernel's lanes 0-2; key 3-6, counter 7
