"""Shared fixtures: the devices every framework test runs on."""

import pytest

import needle as ndl
from needle.backend_ndarray import MissingPrimitive

DEVICES = [
    pytest.param(ndl.cpu_numpy(), id="numpy"),
    pytest.param(ndl.cpu(), id="cpu"),
    pytest.param(
        ndl.cuda(),
        id="cuda",
        marks=pytest.mark.skipif(not ndl.cuda().enabled(), reason="no CUDA GPU on this machine"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A backend module still missing a primitive skips the test that needs it, naming it."""
    try:
        return (yield)
    except MissingPrimitive as missing:
        pytest.skip(str(missing))
