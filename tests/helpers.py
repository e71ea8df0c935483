"""Test helpers shared by the framework tests: float32 tensors and finite differences."""
import numpy as np

import needle as ndl


def tensor(a, device, requires_grad=True) -> ndl.Tensor:
    return ndl.Tensor(np.asarray(a, dtype=np.float32), device=device, requires_grad=requires_grad)


def numeric_grad(f, arrays, i, eps=1e-6) -> np.ndarray:
    """Central differences of the float64 numpy function f(*arrays) w.r.t. arrays[i]."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    grad = np.zeros_like(arrays[i])
    for idx in np.ndindex(*arrays[i].shape):
        old = arrays[i][idx]
        arrays[i][idx] = old + eps
        up = f(*arrays)
        arrays[i][idx] = old - eps
        down = f(*arrays)
        arrays[i][idx] = old
        grad[idx] = (up - down) / (2 * eps)
    return grad
