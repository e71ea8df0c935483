"""needle's modes are per thread: `no_grad()` and `allow_tf32()` in one thread were process-wide
flags, so an evaluation thread stripped the graph from a training thread's ops, and a training
loop's TF32 reached an in-process worker's fp32 jobs (results that fail the fp32 bound)."""

import threading

import numpy as np
import pytest
from helpers import tensor

import needle as ndl
from needle import autograd
from node import compute

TIMEOUT = 30


def hold_in_thread(mode) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """A thread that enters `mode` and stays inside it until released."""
    entered, release = threading.Event(), threading.Event()

    def run():
        with mode:
            entered.set()
            release.wait(TIMEOUT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert entered.wait(TIMEOUT)
    return thread, entered, release


def test_no_grad_in_another_thread_leaves_this_threads_graph(device):
    x = tensor([1.0, 2.0, 3.0], device)
    thread, _, release = hold_in_thread(ndl.no_grad())
    try:
        assert autograd.is_grad_enabled()
        loss = (x * x).sum()  # the old flag: recorded without a graph, so backward gave no grad
        assert loss.requires_grad
        loss.backward()
        np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0, 6.0])
    finally:
        release.set()
        thread.join(TIMEOUT)
    with ndl.no_grad():  # and still works on its own thread
        assert not (x * x).requires_grad
    assert autograd.is_grad_enabled()


def test_no_grad_inside_a_thread_applies_there():
    seen = []

    def run():
        with ndl.no_grad():
            seen.append(autograd.is_grad_enabled())
        seen.append(autograd.is_grad_enabled())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(TIMEOUT)
    assert seen == [False, True]


@pytest.mark.skipif(not ndl.cuda().enabled(), reason="no CUDA GPU on this machine")
def test_allow_tf32_in_another_thread_does_not_reach_a_workers_fp32_product():
    rng = np.random.default_rng(23)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 128)).astype(np.float32)
    cuda = ndl.cuda()
    fp32 = compute.matmul(a, b, cuda)
    with ndl.backend_ndarray.allow_tf32():
        tf32 = compute.matmul(a, b, cuda)
    assert not np.array_equal(fp32, tf32)  # the two paths differ on this data
    thread, _, release = hold_in_thread(ndl.backend_ndarray.allow_tf32())
    try:
        np.testing.assert_array_equal(compute.matmul(a, b, cuda), fp32)
    finally:
        release.set()
        thread.join(TIMEOUT)
