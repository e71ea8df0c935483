"""Variance-scaling initialisers. `shape` overrides (fan_in, fan_out) as the tensor's shape,
e.g. (k, k, c_in, c_out) for convolution kernels, whose fans the caller passes in."""
import math

from .init_basic import check_number, rand, randn

_GAINS = {"linear": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3.0, "relu": math.sqrt(2.0)}


def _checked(gain, fan_in, fan_out):
    """gain, once it and the fans are known usable: a fan of 0 divides by zero, a negative one
    fails in sqrt or, beside a larger other fan in Xavier's sum, passes with the wrong scale,
    and a NaN gain fills the tensor with NaN."""
    check_number("fan_in", fan_in, 0.0, low_open=True)
    check_number("fan_out", fan_out, 0.0, low_open=True)
    check_number("gain", gain, 0.0)
    return gain


def xavier_uniform(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    bound = _checked(gain, fan_in, fan_out) * math.sqrt(6.0 / (fan_in + fan_out))
    return rand(*(shape or (fan_in, fan_out)), low=-bound, high=bound, **kwargs)


def xavier_normal(fan_in, fan_out, gain=1.0, shape=None, **kwargs):
    std = _checked(gain, fan_in, fan_out) * math.sqrt(2.0 / (fan_in + fan_out))
    return randn(*(shape or (fan_in, fan_out)), std=std, **kwargs)


def _gain(nonlinearity):
    if nonlinearity not in _GAINS:
        raise ValueError(f"unknown nonlinearity {nonlinearity!r}; expected one of {list(_GAINS)}")
    return _GAINS[nonlinearity]


def kaiming_uniform(fan_in, fan_out, nonlinearity="relu", shape=None, **kwargs):
    bound = _checked(_gain(nonlinearity), fan_in, fan_out) * math.sqrt(3.0 / fan_in)
    return rand(*(shape or (fan_in, fan_out)), low=-bound, high=bound, **kwargs)


def kaiming_normal(fan_in, fan_out, nonlinearity="relu", shape=None, **kwargs):
    std = _checked(_gain(nonlinearity), fan_in, fan_out) / math.sqrt(fan_in)
    return randn(*(shape or (fan_in, fan_out)), std=std, **kwargs)
