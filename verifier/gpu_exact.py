"""Exact mode on a GPU in three kernel launches and one 24-byte copy back: B R, C R and A (B R)
are reduced mod p = 2^61 - 1 inside the kernels, straight from the int8/int32 data (no
converted copy, no limb arrays), and the last launch compares A (B R) with C R and counts the
rows that differ on the device.

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

The vectors go to the device as the raw SHAKE128 words of rng.field_vectors; the kernels keep
their low 61 bits. That is field_vectors itself unless a word's low 61 bits are all ones
(rejected there, probability 2^-61 per word): such streams take the host derivation.
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from verifier.rng import P, field_label, field_vectors, stream


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
C_TYPES = {"int8": "signed char", "uint8": "unsigned char", "int16": "short",
           "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
           "int64": "long long"}
REGISTER_TYPES = {"uint32": "unsigned int", "int64": "long long"}  # else int
_WORKSPACE_IN_USE = threading.Lock()  # one check at a time per workspace (host threads)

SOURCE = r"""
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

// out[i, q] = (M_i . V_q) mod p for the rows of M; V entry (j, q) at V[j * vj + q * vq], low
// 61 bits kept. compare: instead of writing out, counts the rows where some q has a residue
// != Z into verdict[0] and the smallest such row into verdict[1]. init: resets verdict.
extern "C" __global__ void residues(const VX_T* __restrict__ M, const u64* __restrict__ V,
                                    long long vj, long long vq, u64* __restrict__ out,
                                    const u64* __restrict__ Z, long long* __restrict__ verdict,
                                    long long rows, long long cols, long long limit, int compare,
                                    int init) {
    __shared__ __align__(16) unsigned int tile[VX_K * VX_L * VX_TILE];
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long long first = warp * VX_RPW;
    if (init && blockIdx.x == 0 && threadIdx.x == 0) {
        verdict[0] = 0;
        verdict[1] = 0x7FFFFFFFFFFFFFFFLL;
    }
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


def _uses_bytes(dtype: str, cols: int, alignment: int) -> bool:
    return dtype == "int8" and cols % 4 == 0 and cols <= MAX_BYTES_COLS and alignment >= 4


def bytes_path(M) -> bool:
    """int8 rows read as 32-bit words of 4 entries, each against 4 limbs by one dp4a."""
    return _uses_bytes(M.dtype.name, M.shape[1], _alignment(M))


def wide_limb_width(bound: int, cols: int) -> int:
    """The widest w <= 31 with cols * bound * (2^w - 1) <= 2^63 - 1 (0 if none)."""
    return min(31, ((2**63 - 1) // (cols * max(bound, 1)) + 1).bit_length() - 1)


def supported(A, B, C, rounds: int, bounds: tuple[int, int, int]) -> bool:
    """Whether the fused kernels take this check: C-contiguous 2-D integer matrices of the
    listed types, up to MAX_ROUNDS rounds, and limbs of at least 8 bits for every pass."""
    if rounds > MAX_ROUNDS:
        return False
    for M, bound in zip((B, C, A), bounds, strict=True):
        if M.ndim != 2 or not M.flags.c_contiguous or M.dtype.name not in WIDE_TYPES:
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


class Config(NamedTuple):
    """One pass's compiled kernel and launch shape."""

    kernel: object
    grid: tuple[int]
    block: tuple[int]


@lru_cache(maxsize=64)
def _config(dtype: str, rows: int, cols: int, alignment: int, rounds: int, bound: int,
            check: bool) -> Config:
    """The kernel and launch of one pass, computed once per shape, type and bound."""
    import cupy

    use_bytes = _uses_bytes(dtype, cols, alignment)
    if use_bytes:
        words, limbs, width = cols // 4, 8, 8
    else:
        words, width = cols, wide_limb_width(bound, cols)
        limbs = -(-61 // width)
    vec = 4 if (words % 4 == 0 and alignment == 16
                and (use_bytes or np.dtype(dtype).itemsize == 4)) else 1
    launch = LAUNCH["bytes" if use_bytes else "wide", vec]
    rpw = rows_per_warp(launch, rounds * limbs * (1 if use_bytes else 2))
    tile = tile_words(launch.tile_bytes, rounds, limbs, 32 * vec * launch.unroll)
    options = (f"-DVX_T={C_TYPES[dtype]}", f"-DVX_R={REGISTER_TYPES.get(dtype, 'int')}",
               f"-DVX_K={rounds}", f"-DVX_L={limbs}", f"-DVX_W={width}", f"-DVX_RPW={rpw}",
               f"-DVX_CHECK={int(check)}", f"-DVX_BYTES={int(use_bytes)}",
               f"-DVX_TILE={tile}", f"-DVX_UNROLL={launch.unroll}", f"-DVX_VEC={vec}")
    kernel = cupy.RawKernel(SOURCE, "residues", options=options)
    return Config(kernel, (-(-rows // (launch.warps * rpw)),), (32 * launch.warps,))


def residues(M, V, vj: int, vq: int, rounds: int, bound: int, limit: int | None, out,
             verdict, compare: bool = False, init: bool = False) -> None:
    """One launch on the current stream: out = (M V) mod p, or with compare the comparison
    of (M V) mod p with out into verdict. limit: entries of M above it in magnitude mark
    their row (bound is then limit)."""
    rows, cols = M.shape
    config = _config(M.dtype.name, rows, cols, _alignment(M), rounds, bound, limit is not None)
    config.kernel(config.grid, config.block,
                  (M, V, np.int64(vj), np.int64(vq), out, out, verdict, np.int64(rows),
                   np.int64(cols), np.int64(limit or 0), np.int32(compare), np.int32(init)))


def device_vectors(seed: bytes, n: int, rounds: int):
    """(rounds, n) uint64 words on the device whose low 61 bits are field_vectors(seed, n,
    rounds).T: the raw stream when no word can be rejected (low 61 bits all ones needs 7
    bytes 0xff in a row, which one bytes search rules out), else the host's derivation."""
    import cupy

    raw = stream(seed, field_label(n, rounds), 8 * n * rounds)
    if b"\xff" * 7 in raw:  # some word might be p: derive exactly as field_vectors does
        return cupy.asarray(field_vectors(seed, n, rounds).T.astype(np.uint64))
    return cupy.asarray(np.frombuffer(raw, np.uint64).reshape(rounds, n))


class Workspace(NamedTuple):
    """Device buffers of one shape and what runs C's pass beside B's, kept between calls."""

    X: object  # (k, rounds) uint64: B R mod p
    Z: object  # (m, rounds) uint64: C R mod p
    verdict: object  # (2,) int64: rows that differ, the first of them
    side: object  # a second stream for C's pass
    ready: object  # event: the vectors are on the device
    done: object  # event: C's pass is over


@lru_cache(maxsize=8)
def _workspace(m: int, k: int, rounds: int, device: int) -> Workspace:
    import cupy

    event = cupy.cuda.Event
    return Workspace(cupy.empty((k, rounds), np.uint64), cupy.empty((m, rounds), np.uint64),
                     cupy.empty(2, np.int64), cupy.cuda.Stream(non_blocking=True),
                     event(disable_timing=True), event(disable_timing=True))


def launch(A, B, C, words, rounds: int, bounds: tuple[int, int, int], product_bound: int):
    """Enqueue the check on the current stream (C's pass on a second stream beside B's);
    returns the device verdict (rows that differ, the first such row)."""
    import cupy

    (m, k), n = A.shape, B.shape[1]
    bound_b, bound_c, bound_a = bounds
    ws = _workspace(m, k, rounds, cupy.cuda.Device().id)
    main = cupy.cuda.get_current_stream()
    ws.ready.record(main)
    ws.side.wait_event(ws.ready)
    limit = product_bound if product_bound < bound_c else None
    with ws.side:
        residues(C, words, 1, n, rounds, min(bound_c, product_bound), limit, ws.Z, ws.verdict)
        ws.done.record(ws.side)
    residues(B, words, 1, n, rounds, bound_b, None, ws.X, ws.verdict, init=True)
    main.wait_event(ws.done)
    residues(A, ws.X, rounds, 1, rounds, bound_a, None, ws.Z, ws.verdict, compare=True)
    return ws.verdict


def check(A, B, C, words, rounds: int, bounds: tuple[int, int, int],
          product_bound: int) -> tuple[int, int]:
    """(rows where A (B R) != C R mod p or C holds an entry above product_bound, the first
    such row) for 2-D device matrices that supported() accepts. words: device_vectors(seed,
    n, rounds). bounds: max|B|, max|C|, max|A| as known from the dtypes or the data."""
    with _WORKSPACE_IN_USE:
        wrong, first = (int(x) for x in launch(A, B, C, words, rounds, bounds,
                                                product_bound).get())
    return wrong, (first if wrong else 0)


assert P == (1 << 61) - 1  # the kernel's PRIME
