"""Tensor.register_grad_ready_hook: called once per backward, as soon as a leaf's .grad is final."""
import numpy as np
import pytest
from helpers import numeric_grad, tensor

import needle as ndl

CPU = ndl.cpu()
RNG = np.random.default_rng(0)
X, W1, W2 = (RNG.standard_normal(s) for s in [(4, 3), (3, 5), (5, 2)])


def loss_np(x, w1, w2):
    """x feeds two branches (so its gradient has two contributions), w2 sits at the top."""
    h = np.tanh(x @ w1)
    return float((h @ w2).sum() + (x**2).sum())


def test_hook_sees_the_final_gradient_before_backward_reaches_earlier_leaves():
    x, w1, w2 = (tensor(a, CPU) for a in (X, W1, W2))
    seen = []

    def record(name):
        def hook(t):
            # .grad is already final here, and the leaves further down have none yet
            seen.append((name, t.grad.numpy().copy(), {n: v.grad is None for n, v in leaves}))
        return hook

    leaves = [("x", x), ("w1", w1), ("w2", w2)]
    for name, leaf in leaves:
        leaf.register_grad_ready_hook(record(name))
    loss = (ndl.ops.tanh(x @ w1) @ w2).sum() + (x * x).sum()
    loss.backward()

    assert [s[0] for s in seen] == ["w2", "w1", "x"]  # once each, top of the graph first
    assert seen[0][2] == {"x": True, "w1": True, "w2": False}
    assert seen[1][2] == {"x": True, "w1": False, "w2": False}
    for i, (name, grad, _) in enumerate(sorted(seen, key=lambda s: ["x", "w1", "w2"].index(s[0]))):
        expected = numeric_grad(loss_np, [X, W1, W2], i)
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-4, err_msg=name)
        np.testing.assert_array_equal(grad, leaves[i][1].grad.numpy())  # unchanged afterwards


def test_hooks_run_in_registration_order_on_every_backward():
    w = tensor(W1, CPU)
    calls = []
    w.register_grad_ready_hook(lambda t: calls.append("first"))
    w.register_grad_ready_hook(lambda t: calls.append("second"))
    for _ in range(2):
        (w * 2.0).sum().backward()
    assert calls == ["first", "second"] * 2


def test_no_call_for_a_leaf_that_gets_no_gradient():
    used, unused = tensor(W1, CPU), tensor(W1, CPU)
    frozen = tensor(W1, CPU, requires_grad=False)
    calls = []
    for t in (used, unused, frozen):
        t.register_grad_ready_hook(calls.append)
    (used * frozen).sum().backward()
    assert calls == [used]
    assert unused.grad is None and frozen.grad is None


def test_only_leaves_take_hooks():
    inner = tensor(W1, CPU) * 2.0
    with pytest.raises(ValueError, match="leaf tensors only"):
        inner.register_grad_ready_hook(print)
