"""Float mode: |C r - A (B r)| against a rigorous per-row bound on an honest result's error.

The math (docs/verifier.md derives it): with s = |B| 1, t = |A| s, rho = |A| 1, c = |C| 1,
an honest float32-accumulated C, computed in any order on any IEEE or tensor-core-like
hardware from inputs rounded to the precision class, satisfies for every +-1 vector r

    |(C - A B) r|_i <= H_i = eps t_i + alpha (n rho_i + sum(s)) + n (10 k + 2) TINY,

and the check, evaluated in a floating format with unit u_e, is off by at most
delta_i = g_n c_i + (g_n + g_k (1 + g_n)) t_i + small underflow terms. A row passes when
the computed |C r - A (B r)|_i <= tau_i = SAFETY (H_i + delta_i).
"""
from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from verifier.arrays import products
from verifier.rng import Signs

U_ACC = 2.0**-23  # per operation of the product's accumulation: 2x fp32 round-to-nearest,
U_OUT = 2.0**-23  # so truncating (tensor-core) hardware is covered; C's own final rounding
U_IN = {"fp32": 0.0, "tf32": 2.0**-10, "bf16": 2.0**-7}  # input rounding, truncation included
TINY = 2.0**-126  # flush-to-zero error per input or operation (smallest normal float32)
SAFETY = 1.0 + 2.0**-20  # covers the float64 rounding in evaluating tau itself
MAX_INNER = 1 << 22  # k u_acc < 1/2: beyond this no fp32 accumulation bound is meaningful


def gamma(length: int, unit: float) -> float:
    """gamma_L = L u / (1 - L u), the classical bound for a length-L inner product."""
    return length * unit / (1.0 - length * unit)


class Terms(NamedTuple):
    """The scalars of tau for one shape and class, shared by the host and GPU evaluations:
    s = (s_hat + eta_n) / one_minus_g_n, weights = up(w_t s + w_rho),
    a_term = (a_hat + eta_k) / one_minus_g_k, c = (c_hat + eta_n) / one_minus_g_n,
    tau = safety (a_term + g_n c + (coef_s sum(s) + const0 + eta_n + eta_k))."""

    eta_n: float
    one_minus_g_n: float
    w_t: float
    w_rho: float
    eta_k: float
    one_minus_g_k: float
    g_n: float
    coef_s: float
    const0: float
    safety: float


def bound_terms(n: int, k: int, precision: str, dtype) -> Terms:
    ue, tiny_e = charged_unit(n, k, dtype)
    g_n, g_k, eta_n, eta_k = gamma(n, ue), gamma(k, ue), 4 * n * tiny_e, 4 * k * tiny_e
    f = (1 + U_OUT) * (1 + gamma(k, U_ACC))
    u_in = U_IN[precision]
    # tau_i = sum_l |A_il| (w_t s_l + w_rho) + g_n c_i + constant: H_i + delta_i regrouped
    w_t = f * (1 + u_in) ** 2 - 1 + g_n + g_k * (1 + g_n)
    w_rho = f * (1 + u_in) * TINY * n + (1 + g_k) * eta_n
    return Terms(eta_n, 1 - g_n, w_t, w_rho, eta_k, 1 - g_k, g_n, f * (1 + u_in) * TINY,
                 n * (10 * k + 2) * TINY, SAFETY)


def check(xp: ModuleType, A, B, C, signs: Signs, precision: str
          ) -> tuple[float, tuple, str | None]:
    """(worst excess over rows and rounds, (batch..., row) where it occurs, None), or
    (inf, (), reason) for NaN/Inf. A, B, C share their leading batch dimensions.

    Evaluated in float32 (host: one BLAS pass per matrix; device: three fused kernels that
    also evaluate tau and find the worst row, verifier/gpu_float.py), with no float64 copy
    of any matrix; in float64 when k or n is too large for that, for stacks on a device
    (cuBLAS, which a global math mode may switch to tf32) and when the float32 evaluation
    overflows.
    """
    k, n = A.shape[-1], B.shape[-1]
    fast = float32_possible(n, k) and (xp is np or A.ndim == 2)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected, not warned
        if fast and xp is not np:
            from verifier import gpu_float

            found = gpu_float.worst_row(A, B, C, signs.bits, signs.rounds,
                                        bound_terms(n, k, precision, np.float32))
        else:
            row_excess = worst_per_row(xp, A, B, C, signs.matrix, precision,
                                       np.float32 if fast else np.float64)
            found = _worst(row_excess) if np.isfinite(row_excess).all() else None
        if found is None:
            bad = [name for name, M in (("A", A), ("B", B), ("C", C))
                   if not bool(xp.isfinite(M).all())]
            if bad:
                return float("inf"), (), f"NaN or Inf in {' and '.join(bad)}"
            found = _worst(worst_per_row(xp, A, B, C, signs.matrix, precision, np.float64))
    return found[0], found[1], None


def _worst(row_excess: np.ndarray) -> tuple[float, tuple]:
    where = np.unravel_index(int(np.argmax(row_excess)), row_excess.shape)
    return float(row_excess[where]), tuple(int(i) for i in where)


def worst_per_row(xp: ModuleType, A, B, C, R, precision: str, dtype) -> np.ndarray:
    """max over rounds of |C R - A (B R)| - tau per row, on the host (one transfer from a
    device). Not finite wherever some quantity it depends on is not: NaN/Inf in, or
    overflow (IEEE arithmetic carries both through every product and sum)."""
    residual, tau = residual_and_bound(xp, A, B, C, R, precision, dtype)
    row_excess = (residual - tau[..., None]).max(axis=-1)  # max propagates NaN
    return row_excess if xp is np else row_excess.get()


def float32_possible(n: int, k: int) -> bool:
    return max(n, k) * 2.0**-24 < 0.25


def charged_unit(n: int, k: int, dtype) -> tuple[float, float]:
    """(unit, smallest normal) charged for the check's own rounding: float32's whenever a
    float32 evaluation is possible, even when evaluating in float64 (GPU, overflow fallback),
    so that every node computes the same tau whichever path it takes."""
    if float32_possible(n, k):
        return 2.0**-24, 2.0**-126
    return float(np.finfo(dtype).eps) / 2, float(np.finfo(dtype).tiny)


def up(xp: ModuleType, x, dtype):
    """x (float64) rounded upwards into dtype: one step past round-to-nearest."""
    return xp.nextafter(x.astype(dtype), xp.asarray(np.inf, dtype))


def residual_and_bound(xp: ModuleType, A, B, C, R, precision: str, dtype=np.float32):
    """(|C R - A (B R)| as computed, (..., m, rounds); tau, (..., m)), both float64,
    evaluated in dtype. A, B, C are single matrices or share their leading batch
    dimensions. Some entries are not finite when an input holds NaN/Inf or the evaluation
    overflowed."""
    n = B.shape[-1]
    t = bound_terms(n, A.shape[-1], precision, dtype)
    R = xp.asarray(R, dtype=dtype)
    X, s_hat = products(xp, B, R, xp.ones(n, dtype), dtype)
    Z, c_hat = products(xp, C, R, xp.ones(n, dtype), dtype)
    s = (s_hat.astype(np.float64) + t.eta_n) / t.one_minus_g_n  # upper bound on |B| 1
    weights = up(xp, t.w_t * s + t.w_rho, dtype)
    Y, a_hat = products(xp, A, X, weights, dtype)
    a_term = (a_hat.astype(np.float64) + t.eta_k) / t.one_minus_g_k
    c = (c_hat.astype(np.float64) + t.eta_n) / t.one_minus_g_n
    constant = t.coef_s * s.sum(axis=-1, keepdims=True) + t.const0 + t.eta_n + t.eta_k
    tau = t.safety * (a_term + t.g_n * c + constant)
    return xp.abs(Z.astype(np.float64) - Y.astype(np.float64)), tau
