"""Shared fixtures: the devices every framework test runs on, and a chain node process per
test module (a module that needs other node options defines its own `node`)."""

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


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A chain node that seals only when transactions are pending (no empty blocks)."""
    from chain.launch import NodeProcess

    with NodeProcess(tmp_path_factory.mktemp("chain") / "data", block_time=0) as proc:
        yield proc


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A backend module still missing a primitive skips the test that needs it, naming it."""
    try:
        return (yield)
    except MissingPrimitive as missing:
        pytest.skip(str(missing))
