"""Variance-scaling initialisers. `shape` overrides (fan_in, fan_out) as the tensor's shape,
e.g. (k, k, c_in, c_out) for convolution kernels, whose fans the caller passes in."""
import math

from .init_basic import rand, randn

_GAINS = {"linear": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3.0, "relu": math.sqrt(2.0)}


def xavier_uniform(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return rand(*(shape or (fan_in, fan_out)), low=-bound, high=bound, **kwargs)


def xavier_normal(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return randn(*(shape or (fan_in, fan_out)), std=std, **kwargs)


def _gain(nonlinearity):
    if nonlinearity not in _GAINS:
        raise ValueError(f"unknown nonlinearity {nonlinearity!r}; expected one of {list(_GAINS)}")
    return _GAINS[nonlinearity]


def kaiming_uniform(fan_in, fan_out, nonlinearity="relu", shape=None, **kwargs):
    bound = _gain(nonlinearity) * math.sqrt(3.0 / fan_in)
    return rand(*(shape or (fan_in, fan_out)), low=-bound, high=bound, **kwargs)


def kaiming_normal(fan_in, fan_out, nonlinearity="relu", shape=None, **kwargs):
    std = _gain(nonlinearity) / math.sqrt(fan_in)
    return randn(*(shape or (fan_in, fan_out)), std=std, **kwargs)
