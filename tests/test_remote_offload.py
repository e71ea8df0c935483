"""The offload policy: which MatMul ops (forward and backward) go to the executor, and that
results and gradients equal local computation. The executor here is in-process; the same
policy against real network jobs is exercised in test_remote_training.py."""

import numpy as np
import pytest

import needle as ndl
from needle import remote


class RecordingExecutor:
    """Computes in float64 numpy (a reference independent of needle) and records shapes."""

    def __init__(self):
        self.shapes = []

    def matmul(self, a, b):
        self.shapes.append((a.shape, b.shape))
        return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


def _forward_backward(x_np, w_np, device):
    x = ndl.Tensor(x_np, device=device, requires_grad=True)
    w = ndl.Tensor(w_np, device=device, requires_grad=True)
    y = ndl.ops.matmul(x, w)
    loss = ndl.ops.summation(y * y)
    loss.backward()
    return y.numpy(), x.grad.numpy(), w.grad.numpy()


def test_forward_and_backward_matmuls_are_offloaded(device):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((6, 5)).astype(np.float32)
    w_np = rng.standard_normal((5, 4)).astype(np.float32)
    executor = RecordingExecutor()
    with remote.offload(executor) as policy:
        y, gx, gw = _forward_backward(x_np, w_np, device)
    assert remote.active_offload() is None
    # forward x@w, backward dy@w^T and x^T@dy
    assert sorted(executor.shapes) == sorted([((6, 5), (5, 4)), ((6, 4), (4, 5)),
                                              ((5, 6), (6, 4))])
    assert policy.offloaded == 3 and policy.offloaded_flops == 3 * 2 * 6 * 5 * 4
    y_ref = x_np.astype(np.float64) @ w_np
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, 2 * y_ref @ w_np.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw, x_np.T.astype(np.float64) @ (2 * y_ref), rtol=1e-4, atol=1e-4)


def test_threshold_keeps_small_matmuls_local(device):
    rng = np.random.default_rng(1)
    executor = RecordingExecutor()
    big = (rng.standard_normal((8, 8)).astype(np.float32),) * 2
    small = (rng.standard_normal((2, 2)).astype(np.float32),) * 2
    with remote.offload(executor, min_flops=2 * 8 * 8 * 8) as policy:
        ndl.ops.matmul(ndl.Tensor(small[0], device=device), ndl.Tensor(small[1], device=device))
        out = ndl.ops.matmul(ndl.Tensor(big[0], device=device), ndl.Tensor(big[1], device=device))
    assert executor.shapes == [((8, 8), (8, 8))]
    assert (policy.offloaded, policy.local) == (1, 1)
    np.testing.assert_allclose(out.numpy(), big[0] @ big[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_shape,b_shape,job_shapes", [
    ((2, 3, 4, 5), (5, 6), [((24, 5), (5, 6))]),           # shared weight: rows folded
    ((2, 3, 4, 5), (3, 5, 6), [((3, 8, 5), (3, 5, 6))]),    # B shared along dim 0: rows
    ((4, 5), (2, 3, 5, 6), [((4, 5), (5, 36))]),            # shared A: B's columns side by side
    ((2, 1, 4, 5), (1, 3, 5, 6), [((8, 5), (5, 18))]),      # an outer product of batches
    ((3, 4, 5), (3, 5, 6), [((3, 4, 5), (3, 5, 6))]),       # a plain batch
])
def test_batched_matmul_becomes_one_job(device, a_shape, b_shape, job_shapes):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    executor = RecordingExecutor()
    with remote.offload(executor):
        out = ndl.ops.matmul(ndl.Tensor(a, device=device), ndl.Tensor(b, device=device))
    assert executor.shapes == job_shapes
    np.testing.assert_allclose(out.numpy(), np.matmul(a, b), rtol=1e-5, atol=1e-5)


def test_a_broadcast_product_uploads_each_operand_once():
    """Random broadcasts of leading dims against numpy: one job whose operands hold exactly
    the elements of a and b (a matrix repeated by broadcasting is not sent twice)."""
    rng = np.random.default_rng(3)
    for _ in range(300):
        lead = [int(d) for d in rng.integers(1, 4, size=rng.integers(0, 4))]
        a_lead = [d if rng.random() < 0.6 else 1 for d in lead][rng.integers(0, len(lead) + 1):]
        b_lead = [d if rng.random() < 0.6 else 1 for d in lead][rng.integers(0, len(lead) + 1):]
        m, k, n = (int(x) for x in rng.integers(1, 5, size=3))
        a = rng.standard_normal((*a_lead, m, k)).astype(np.float32)
        b = rng.standard_normal((*b_lead, k, n)).astype(np.float32)
        executor = RecordingExecutor()
        out = remote.Offload(executor).product(a, b)
        np.testing.assert_allclose(out, np.matmul(a.astype(np.float64), b), rtol=1e-5,
                                   atol=1e-5)
        assert out.shape == np.matmul(a, b).shape and out.flags.c_contiguous
        ((a_job, b_job),) = executor.shapes
        assert np.prod(a_job) + np.prod(b_job) == a.size + b.size, (a.shape, b.shape)


def test_nested_contexts_and_no_leak_after_error():
    outer, inner = RecordingExecutor(), RecordingExecutor()
    a = ndl.Tensor(np.ones((2, 2), np.float32))
    with remote.offload(outer):
        with remote.offload(inner):
            ndl.ops.matmul(a, a)
        ndl.ops.matmul(a, a)
        with pytest.raises(RuntimeError), remote.offload(inner):
            raise RuntimeError("boom")
        assert remote.active_offload().executor is outer
    assert remote.active_offload() is None
    assert len(outer.shapes) == 1 and len(inner.shapes) == 1


def test_convolutions_are_offloaded_forward_and_backward(device):
    """A CNN under offload(...) sent only its linear layers: conv multiplied with NDArray's @
    directly. Now the forward product, the input gradient (itself a conv) and the kernel
    gradient go to the executor, and equal the local computation."""
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((2, 6, 6, 3)).astype(np.float32)
    k_np = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)

    def run():
        x = ndl.Tensor(x_np, device=device, requires_grad=True)
        k = ndl.Tensor(k_np, device=device, requires_grad=True)
        y = ndl.ops.conv(x, k, stride=1, padding=1)
        ndl.ops.summation(y * y).backward()
        return y.numpy(), x.grad.numpy(), k.grad.numpy()

    local = run()
    executor = RecordingExecutor()
    with remote.offload(executor) as policy:
        offloaded = run()
    # forward: (2*6*6, 27) @ (27, 4); input gradient: a conv with the flipped kernel,
    # (72, 36) @ (36, 3); kernel gradient: (4, 72) @ (72, 27)
    assert sorted(executor.shapes) == sorted([((72, 27), (27, 4)), ((72, 36), (36, 3)),
                                              ((4, 72), (72, 27))])
    assert policy.offloaded == 3
    for got, want in zip(offloaded, local, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
