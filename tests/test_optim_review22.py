"""Optimiser state that keeps its hyperparameters and parameter count, lr checked on every
assignment, and initialisers that refuse NaN or out-of-range arguments; updates are checked
against numpy re-implementations of the SGD and Adam rules."""
import math

import numpy as np
import pytest

import needle as ndl
from needle import checkpoint, init, nn, optim

CPU = ndl.cpu()
SHAPES = [(3, 2), (4,)]
SAVED = {  # the run that is saved, then another optimiser's settings it is loaded into
    "sgd": (optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05},
            {"lr": 0.3, "momentum": 0.2, "weight_decay": 0.0}),
    "adam": (optim.Adam, {"lr": 0.01, "beta1": 0.5, "beta2": 0.9, "eps": 1e-3, "weight_decay": 0.1},
             {"lr": 0.2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}),
}
# the keys state_dict gained here: a state without them is what the code before wrote
NEW_KEYS = {"momentum", "beta1", "beta2", "eps", "weight_decay", "num_params"}


def start() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def gradient(step: int, params: list[np.ndarray]) -> list[np.ndarray]:
    """Fixed per step and dependent on the parameters, so an update applied wrongly shows."""
    rng = np.random.default_rng(step)
    return [rng.standard_normal(p.shape) + 0.5 * p for p in params]


def run_needle(opt, params, steps):
    for step in steps:
        for p, g in zip(params, gradient(step, [p.numpy() for p in params]), strict=True):
            p.grad = ndl.Tensor(g.astype(np.float32), device=CPU)
        opt.step()


def reference(kind, settings, steps, state=None):
    """numpy SGD (CMU's dampened momentum) or Adam (bias-corrected), L2 weight decay; state
    (params, buffers, t) carries a run on, as a loaded optimiser state does."""
    params, buffers, t = state or ([a.astype(np.float64) for a in start()], None, 0)
    params = [p.copy() for p in params]
    buffers = buffers or [[np.zeros(s), np.zeros(s)] for s in SHAPES]
    lr, wd = settings["lr"], settings["weight_decay"]
    for step in steps:
        t += 1
        for i, g in enumerate(gradient(step, params)):
            g = g + wd * params[i]
            if kind == "sgd":
                mom = settings["momentum"]
                buffers[i][0] = mom * buffers[i][0] + (1 - mom) * g
                params[i] = params[i] - lr * buffers[i][0]
                continue
            b1, b2 = settings["beta1"], settings["beta2"]
            buffers[i] = [b1 * buffers[i][0] + (1 - b1) * g, b2 * buffers[i][1] + (1 - b2) * g * g]
            m_hat, v_hat = buffers[i][0] / (1 - b1**t), buffers[i][1] / (1 - b2**t)
            params[i] = params[i] - lr * m_hat / (np.sqrt(v_hat) + settings["eps"])
    return params, buffers, t


def saved_run(kind):
    """Three steps with the saved settings: (parameters, optimiser)."""
    make, settings, _ = SAVED[kind]
    params = [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()]
    opt = make(params, **settings)
    run_needle(opt, params, range(1, 4))
    return params, opt


def resume(kind, state, params):
    """An optimiser built with the other settings over copies of params, state loaded, run on
    three steps: its parameters."""
    make, _, other = SAVED[kind]
    copies = [nn.Parameter(ndl.Tensor(p.numpy(), device=CPU)) for p in params]
    opt = make(copies, **other)
    opt.load_state_dict(state)
    run_needle(opt, copies, range(4, 7))
    return copies, opt


def assert_close(got, expected):
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- hyperparameters in state


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_state_dict_holds_the_hyperparameters_and_loading_restores_them(kind):
    params, opt = saved_run(kind)
    settings = SAVED[kind][1]
    _, buffers, t = reference(kind, settings, range(1, 4))
    expected = {**settings, "num_params": 2}
    for i in range(2):
        if kind == "sgd":
            expected[f"u.{i}"] = buffers[i][0]
        else:
            expected.update({f"m.{i}": buffers[i][0], f"v.{i}": buffers[i][1], "t": t})
    state = opt.state_dict()
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(state[key], value, rtol=1e-5, atol=1e-6, err_msg=key)

    resumed, resumed_opt = resume(kind, state, params)
    assert {name: getattr(resumed_opt, name) for name in settings} == settings
    assert_close(resumed, reference(kind, settings, range(1, 7))[0])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_state_saved_without_hyperparameters_keeps_the_constructors(kind, tmp_path):
    """Regression guard (passes before the change too): what the code before wrote, lr, t and
    the buffers, still loads, directly and from a checkpoint file; the settings it lacks stay
    the constructor's."""
    params, opt = saved_run(kind)
    old = {k: v for k, v in opt.state_dict().items() if k not in NEW_KEYS}
    assert sorted(old) == (["lr", "u.0", "u.1"] if kind == "sgd"
                           else ["lr", "m.0", "m.1", "t", "v.0", "v.1"])
    _, saved, other = SAVED[kind]
    params64, buffers, t = reference(kind, saved, range(1, 4))
    expected = reference(kind, {**other, "lr": saved["lr"]}, range(4, 7), (params64, buffers, t))[0]

    resumed, resumed_opt = resume(kind, old, params)
    assert {n: getattr(resumed_opt, n) for n in other} == {**other, "lr": saved["lr"]}
    assert_close(resumed, expected)

    class Two(nn.Module):
        def __init__(self, arrays):
            super().__init__()
            self.a, self.b = (nn.Parameter(ndl.Tensor(x, device=CPU)) for x in arrays)

    path = tmp_path / "old.npz"
    np.savez(path, **{f"model/{k}": v for k, v in Two([p.numpy() for p in params])
                      .state_dict().items()}, **{f"optimizer/{k}": v for k, v in old.items()})
    model = Two(start())
    loaded_opt = SAVED[kind][0](model.parameters(), **other)
    checkpoint.load(str(path), model, loaded_opt)
    run_needle(loaded_opt, model.parameters(), range(4, 7))
    assert_close(model.parameters(), expected)


def test_another_optimisers_state_is_refused_naming_the_key():
    """A plain SGD's state (no buffers) used to load into Adam as if it were Adam's."""
    params = [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()]
    adam = optim.Adam(params, lr=0.5)
    with pytest.raises(KeyError, match=r"Adam has no setting 'momentum' \(it has lr, beta1"):
        adam.load_state_dict(optim.SGD(params, lr=0.1).state_dict())
    assert adam.lr == 0.5 and adam.t == 0


@pytest.mark.parametrize("kind, key, value, message", [
    ("sgd", "momentum", 1.5, r"momentum must lie in \[0.0, 1.0\), got 1.5"),
    ("sgd", "lr", -0.1, r"lr must lie in \[0.0, inf\), got -0.1"),
    ("adam", "beta1", 1.0, r"beta1 must lie in \[0.0, 1.0\), got 1.0"),
    ("adam", "beta2", float("nan"), "beta2 must lie in .*got nan"),
    ("adam", "eps", 0.0, r"eps must lie in \(0.0, inf\), got 0.0"),
    ("adam", "weight_decay", float("inf"), "weight_decay must lie in .*got inf"),
])
def test_invalid_loaded_hyperparameters_are_refused_and_change_nothing(kind, key, value, message):
    """Regression guard (the loader before checked the few settings a state could hold)."""
    _, opt = saved_run(kind)
    state = {**opt.state_dict(), key: np.array(value)}
    target = SAVED[kind][0]([nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()],
                            **SAVED[kind][2])
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert {n: getattr(target, n) for n in SAVED[kind][2]} == SAVED[kind][2]
    assert not [key for key in target.state_dict() if "." in key]  # no buffers loaded


# ---------------------------------------------------------------- parameter count


@pytest.mark.parametrize("extra_in_state", [False, True], ids=["state-shorter", "state-longer"])
def test_state_for_another_parameter_list_length_is_refused(extra_in_state):
    """Entries are keyed by index: a state of 2 parameters loaded into 3 (or of 3, the last
    without a gradient, into 2) went to whichever parameters had the index and shape."""
    arrays = start() + [np.zeros(5, np.float32)]
    source = [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in arrays[:3 if extra_in_state else 2]]
    opt = optim.Adam(source, lr=0.01)
    run_needle(opt, source[:2], range(1, 3))  # the third, if any, never has a gradient
    target = optim.Adam([nn.Parameter(ndl.Tensor(a, device=CPU))
                         for a in arrays[:2 if extra_in_state else 3]], lr=0.5)
    counts = (3, 2) if extra_in_state else (2, 3)
    with pytest.raises(ValueError, match=rf"state is for {counts[0]} parameters, this Adam has "
                                         rf"{counts[1]}"):
        target.load_state_dict(opt.state_dict())
    assert target.lr == 0.5 and target.m == {} and target.t == 0


# ---------------------------------------------------------------- lr on assignment


@pytest.mark.parametrize("bad, error, message", [
    (float("nan"), ValueError, r"lr must lie in \[0.0, inf\), got nan"),
    (-0.1, ValueError, r"lr must lie in \[0.0, inf\), got -0.1"),
    (math.inf, ValueError, r"lr must lie in \[0.0, inf\), got inf"),
    (True, TypeError, "lr must be a real number, not bool: True"),
    ("0.1", TypeError, "lr must be a real number, not str"),
])
def test_lr_is_checked_when_assigned_as_in_the_constructor(bad, error, message):
    params = [nn.Parameter(ndl.Tensor(a, device=CPU)) for a in start()]
    for make in (optim.SGD, optim.Adam):
        opt = make(params, lr=0.1)
        with pytest.raises(error, match=message):
            opt.lr = bad
        assert opt.lr == 0.1
        with pytest.raises(error, match=message):
            make(params, lr=bad)


@pytest.mark.parametrize("make", [
    lambda o, n: optim.StepLR(o, step_size=n), lambda o, n: optim.CosineLR(o, total_steps=n),
], ids=["step", "cosine"])
@pytest.mark.parametrize("steps", [float("nan"), 2.5, True])
def test_schedules_refuse_a_period_that_is_not_a_whole_number(make, steps):
    """NaN passed `steps < 1` and only failed at the first step() (or, as 2.5 and True, went
    on with a period nobody asked for)."""
    opt = optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match=r"(step_size|total_steps) must be at least 1 \(a whole"):
        make(opt, steps)
    assert opt.lr == 0.1


# ---------------------------------------------------------------- init


@pytest.mark.parametrize("make, message", [
    (lambda: init.rand(3, low=float("nan")), r"low must lie in \(-inf, inf\), got nan"),
    (lambda: init.rand(3, high=float("nan")), r"high must lie in \[0.0, inf\), got nan"),
    (lambda: init.rand(3, high=math.inf), r"high must lie in \[0.0, inf\), got inf"),
    (lambda: init.rand(3, low=1.0, high=0.0), r"high must lie in \[1.0, inf\), got 0.0"),
    (lambda: init.randn(3, std=float("nan")), r"std must lie in \[0.0, inf\), got nan"),
    (lambda: init.randn(3, std=-1.0), r"std must lie in \[0.0, inf\), got -1.0"),
    (lambda: init.randn(3, mean=float("nan")), r"mean must lie in \(-inf, inf\), got nan"),
    (lambda: init.randb(3, p=float("nan")), r"p must lie in \[0.0, 1.0\], got nan"),
    (lambda: init.randb(3, p=1.5), r"p must lie in \[0.0, 1.0\], got 1.5"),
    (lambda: init.xavier_uniform(4, 4, gain=float("nan")), "gain must lie in .*got nan"),
    (lambda: init.xavier_normal(4, 4, gain=float("nan")), "gain must lie in .*got nan"),
    (lambda: init.xavier_uniform(-5, 10, shape=(3, 3)), r"fan_in must lie in \(0.0, inf\)"),
    (lambda: init.xavier_normal(4, 0, shape=(2, 2)), r"fan_out must lie in \(0.0, inf\), got 0"),
    (lambda: init.kaiming_uniform(0, 3, shape=(2, 2)), r"fan_in must lie in \(0.0, inf\), got 0"),
    (lambda: init.kaiming_normal(-4, 3, shape=(2, 2)), r"fan_in must lie in .*got -4"),
], ids=["rand-nan-low", "rand-nan-high", "rand-inf-high", "rand-low-above-high", "randn-nan-std",
        "randn-neg-std", "randn-nan-mean", "randb-nan-p", "randb-p-1.5", "xavier-u-nan-gain",
        "xavier-n-nan-gain", "xavier-neg-fan", "xavier-zero-fan", "kaiming-zero-fan",
        "kaiming-neg-fan"])
def test_initialisers_refuse_nan_and_out_of_range_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_initialisers_refuse_a_bool_and_keep_their_edge_cases():
    """Bounds that meet, a zero std and p of 0 or 1 are still allowed."""
    np.testing.assert_array_equal(init.rand(4, low=2.0, high=2.0).numpy(), np.full(4, 2.0))
    np.testing.assert_array_equal(init.randn(4, mean=1.5, std=0.0).numpy(), np.full(4, 1.5))
    np.testing.assert_array_equal(init.randb(4, p=0.0).numpy(), np.zeros(4))
    np.testing.assert_array_equal(init.randb(4, p=1.0).numpy(), np.ones(4))
    with pytest.raises(TypeError, match="low must be a real number, not bool"):
        init.rand(4, low=True)
