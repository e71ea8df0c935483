"""Tensor initialisers (CMU needle's `needle.init`)."""
from .init_basic import (
    constant,
    normal,
    one_hot,
    ones,
    ones_like,
    rand,
    randb,
    randn,
    uniform,
    zeros,
    zeros_like,
)
from .init_initializers import (
    kaiming_normal,
    kaiming_uniform,
    xavier_normal,
    xavier_uniform,
)

__all__ = [
    "constant", "one_hot", "ones", "ones_like", "rand", "randb", "randn", "zeros", "zeros_like",
    "kaiming_normal", "kaiming_uniform", "normal", "uniform", "xavier_normal", "xavier_uniform",
]
