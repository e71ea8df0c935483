"""needle.optim, needle.init and checkpoint resume against straightforward numpy references of
the CMU course's update rules (per-parameter Adam step counts, as in Kingma & Ba), and
initialiser formulas checked statistically with fixed seeds."""
import math

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint, init, nn, optim

CPU = ndl.cpu()
# parameter 0 gets a gradient every step, parameter 1 only in these steps (a branch taken
# sometimes, a layer unfrozen later): None in the others
SOMETIMES = {3, 4, 6, 9}
STEPS = 10


def gradients(step: int, params: list[np.ndarray]) -> list[np.ndarray | None]:
    """Fixed pseudo-random gradients that also depend on the parameters (so that an update
    applied to the wrong thing shows up), None for parameter 1 outside SOMETIMES."""
    rng = np.random.default_rng(step)
    grads = [rng.standard_normal(p.shape) + 0.5 * p for p in params]
    if step not in SOMETIMES:
        grads[1] = None
    return grads


def start() -> list[np.ndarray]:
    rng = np.random.default_rng(100)
    return [rng.standard_normal((3, 2)).astype(np.float32),
            rng.standard_normal(4).astype(np.float32)]


def run_needle(opt_factory, steps=range(1, STEPS + 1), params=None, opt=None):
    params = params or [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()]
    opt = opt or opt_factory(params)
    for step in steps:
        opt.reset_grad()
        for p, g in zip(params, gradients(step, [p.numpy() for p in params]), strict=True):
            if g is not None:
                p.grad = ndl.Tensor(g.astype(np.float32), device=CPU)
        opt.step()
    return params, opt


def adam_reference(lr, b1, b2, eps, wd):
    """Kingma & Ba's Adam (CMU's update rule) with L2 weight decay; t counts the updates each
    parameter's moments have had, and a parameter without a gradient is left alone."""
    params = [a.astype(np.float64) for a in start()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    t = [0, 0]
    for step in range(1, STEPS + 1):
        for i, g in enumerate(gradients(step, params)):
            if g is None:
                continue
            g = g + wd * params[i]
            t[i] += 1
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1 ** t[i]), v[i] / (1 - b2 ** t[i])
            params[i] = params[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return params


def sgd_reference(lr, momentum, wd):
    """CMU's SGD: u = momentum u + (1 - momentum) (g + wd p), p -= lr u; skipped without g."""
    params = [a.astype(np.float64) for a in start()]
    u = [np.zeros_like(p) for p in params]
    for step in range(1, STEPS + 1):
        for i, g in enumerate(gradients(step, params)):
            if g is None:
                continue
            u[i] = momentum * u[i] + (1 - momentum) * (g + wd * params[i])
            params[i] = params[i] - lr * u[i]
    return params


# ---------------------------------------------------------------- update rules


@pytest.mark.parametrize("b1, b2, wd", [(0.9, 0.999, 0.0), (0.5, 0.9, 0.1)])
def test_adam_bias_correction_counts_each_parameters_own_steps(b1, b2, wd):
    got, opt = run_needle(lambda p: optim.Adam(p, lr=0.01, beta1=b1, beta2=b2, weight_decay=wd))
    expected = adam_reference(0.01, b1, b2, 1e-8, wd)
    np.testing.assert_allclose(got[0].numpy(), expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), expected[1], rtol=1e-5, atol=1e-6)
    assert opt.t == STEPS  # CMU's counter of step() calls is unchanged


def test_adam_first_update_of_a_late_parameter_is_about_lr():
    """Bias-corrected Adam moves a parameter by about lr on its first update, whenever that is."""
    late = nn.Parameter(ndl.Tensor(np.zeros(5, np.float32), device=CPU))
    always = nn.Parameter(ndl.Tensor(np.zeros(5, np.float32), device=CPU))
    opt = optim.Adam([always, late], lr=0.01)
    for step in range(50):
        always.grad = ndl.Tensor(np.ones(5, np.float32), device=CPU)
        late.grad = ndl.Tensor(np.ones(5, np.float32), device=CPU) if step == 49 else None
        opt.step()
    np.testing.assert_allclose(late.numpy(), np.full(5, -0.01), rtol=1e-4)


@pytest.mark.parametrize("momentum, wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.05), (0.0, 0.2)])
def test_sgd_matches_the_course_rule_with_skipped_parameters(momentum, wd):
    got, _ = run_needle(lambda p: optim.SGD(p, lr=0.1, momentum=momentum, weight_decay=wd))
    expected = sgd_reference(0.1, momentum, wd)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- state and resume


@pytest.mark.parametrize("make_opt", [
    lambda p: optim.Adam(p, lr=0.01, beta1=0.5, beta2=0.9, weight_decay=0.1),
    lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.05),
], ids=["adam", "sgd-momentum"])
@pytest.mark.parametrize("stop", [2, 3, 5])  # before, at and after parameter 1's first grad
def test_resuming_from_a_checkpoint_continues_the_uninterrupted_run(tmp_path, make_opt, stop):
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = (nn.Parameter(ndl.Tensor(x, device=CPU)) for x in start())

    full = Two()
    run_needle(make_opt, params=full.parameters())
    first = Two()
    _, opt = run_needle(make_opt, range(1, stop + 1), params=first.parameters())
    path = str(tmp_path / "ckpt.npz")
    checkpoint.save(path, first, opt)
    resumed = Two()
    resumed_opt = make_opt(resumed.parameters())
    checkpoint.load(path, resumed, resumed_opt)
    run_needle(make_opt, range(stop + 1, STEPS + 1), resumed.parameters(), resumed_opt)
    for key, value in full.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[key], value, err_msg=key)
    assert sorted(resumed_opt.state_dict()) == sorted(run_needle(make_opt)[1].state_dict())


def test_adam_state_of_parameters_stepping_every_time_keeps_its_keys():
    """The course's case (a gradient for every parameter each step) saves the same entries
    as before per-parameter step counts, and such a saved state still loads."""
    params = [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()]
    opt = optim.Adam(params, lr=0.01)
    for _ in range(3):
        for p in params:
            p.grad = ndl.Tensor(np.ones(p.shape, np.float32), device=CPU)
        opt.step()
    state = opt.state_dict()
    assert sorted(state) == ["beta1", "beta2", "eps", "lr", "m.0", "m.1", "num_params", "t",
                             "v.0", "v.1", "weight_decay"]
    fresh = optim.Adam(params, lr=0.01)
    fresh.load_state_dict(state)
    assert fresh.state_dict().keys() == state.keys()


def test_incomplete_adam_state_is_refused_and_changes_nothing():
    _, opt = run_needle(lambda p: optim.Adam(p, lr=0.01))
    state = opt.state_dict()
    assert int(state["t.1"]) == len(SOMETIMES)  # parameter 1 missed steps: its own count
    target = optim.Adam([nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()], lr=0.5)
    broken = [
        ({k: v for k, v in state.items() if k != "v.0"}, ValueError, "moments m and v"),
        ({k: v for k, v in state.items() if k != "t"}, ValueError, "no step count 't'"),
        ({**state, "t.1": np.array(0)}, ValueError, r"'t.1' must be a whole number .* got 0$"),
        ({**state, "t.1": np.array(11)}, ValueError, r"'t.1' must be .* in \[1, t = 10\], got 11"),
        ({**state, "t.1": np.array(2.5)}, ValueError, "'t.1' must be a whole number"),
        ({k: v for k, v in state.items() if k[0] not in "mv"}, KeyError, "no moments"),
    ]
    for bad, error, message in broken:
        with pytest.raises(error, match=message):
            target.load_state_dict(bad)
        assert target.lr == 0.5 and target.t == 0 and target.m == {} and target.v == {}


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("make, message", [
    (lambda o: optim.StepLR(o, 1, gamma=-0.1), r"gamma must lie in \[0.0, inf\), got -0.1"),
    (lambda o: optim.StepLR(o, 1, gamma=float("nan")), "gamma must lie in .*got nan"),
    (lambda o: optim.CosineLR(o, 4, min_lr=-0.01), r"min_lr must lie in \[0.0, inf\)"),
    (lambda o: optim.CosineLR(o, 4, min_lr=float("nan")), "min_lr must lie in .*got nan"),
], ids=["neg-gamma", "nan-gamma", "neg-min-lr", "nan-min-lr"])
def test_schedules_refuse_settings_that_make_the_learning_rate_invalid(make, message):
    opt = optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match=message):
        make(opt)
    assert opt.lr == 0.1


# ---------------------------------------------------------------- init


def test_variance_scaling_for_convolution_kernel_shapes():
    """CMU passes a conv kernel's shape as (k, k, c_in, c_out) with fan_in = k k c_in."""
    np.random.seed(0)
    k, c_in, c_out = 3, 64, 96
    fan_in, fan_out = k * k * c_in, k * k * c_out
    shape = (k, k, c_in, c_out)
    ku = init.kaiming_uniform(fan_in, fan_out, shape=shape).numpy()
    assert ku.shape == shape and np.abs(ku).max() <= math.sqrt(6 / fan_in) * (1 + 1e-6)
    assert ku.std() == pytest.approx(math.sqrt(2 / fan_in), rel=0.01)
    kn = init.kaiming_normal(fan_in, fan_out, nonlinearity="tanh", shape=shape).numpy()
    assert kn.std() == pytest.approx(5 / 3 / math.sqrt(fan_in), rel=0.01)
    xu = init.xavier_uniform(fan_in, fan_out, gain=2.0, shape=shape).numpy()
    assert xu.std() == pytest.approx(2 * math.sqrt(2 / (fan_in + fan_out)), rel=0.01)
    xn = init.xavier_normal(fan_in, fan_out, shape=shape).numpy()
    assert abs(xn.mean()) < 1e-3 and xn.std() == pytest.approx(
        math.sqrt(2 / (fan_in + fan_out)), rel=0.01)
    for t in (ku, kn, xu, xn):
        assert t.dtype == np.float32
    made = init.kaiming_uniform(4, 5, device=ndl.cpu_numpy(), requires_grad=True)
    assert made.device == ndl.cpu_numpy() and made.requires_grad


def test_one_hot_refuses_fractional_labels_and_takes_a_list():
    np.testing.assert_array_equal(init.one_hot(3, [2, 0]).numpy(), np.eye(3)[[2, 0]])
    np.testing.assert_array_equal(init.one_hot(3, ndl.Tensor([1.0, 2.0])).numpy(),
                                  np.eye(3)[[1, 2]])
    for labels in (np.array([0.5, 2.0]), ndl.Tensor([1.7]), np.array([np.nan])):
        with pytest.raises(ValueError, match="one_hot: labels must be integers"):
            init.one_hot(3, labels)


def test_constant_initialisers_take_a_shape_tuple_like_rand():
    for make in (init.zeros, init.ones, lambda *s: init.constant(*s, c=2.0)):
        assert make((2, 3)).shape == (2, 3) and make(2, 3).shape == (2, 3)
    assert init.rand((2, 3)).shape == (2, 3)


def test_clip_grad_norm_takes_a_single_parameter():
    # a lone Tensor was iterated row by row (copies without grads): norm 0, nothing clipped
    w = ndl.Tensor(np.zeros((2, 3), np.float32), requires_grad=True)
    g = np.array([[3.0, 0.0, 4.0], [0.0, 12.0, 0.0]], np.float32)  # norm 13
    (w * ndl.Tensor(g, requires_grad=False)).sum().backward()
    assert optim.clip_grad_norm(w, 6.5) == pytest.approx(13.0)
    np.testing.assert_allclose(w.grad.numpy(), g * 6.5 / (13.0 + 1e-6), rtol=1e-6)
