"""Optimisers, learning-rate schedules and gradient clipping (CMU needle's `needle.optim`).

Updates run on the parameters' NDArrays directly: no autograd graph, no Tensor objects
per step, which keeps the per-parameter cost to a few backend calls.
"""
import math
from collections.abc import Iterable

import numpy as np

from needle.autograd import Tensor
from needle.backend_ndarray import NDArray
from needle.init.init_basic import check_number

PARAM_COUNT = "num_params"  # state_dict's entry for the length of the parameter list


def _array(t: Tensor) -> NDArray:
    return t.realize_cached_data()


def _scalar(key: str, value: np.ndarray) -> float:
    """A saved setting or count as a Python number (int stays int: t, counts)."""
    value = np.asarray(value)
    if value.ndim != 0 or value.dtype.kind not in "iuf":
        raise ValueError(f"optimizer setting {key!r} is not a number: {value!r}")
    return value.item()


def _check_lr(lr: float) -> None:
    """One rule for lr, given to the constructor, set by a schedule or loaded."""
    check_number("lr", lr, 0.0)


def _check_steps(name: str, steps: int) -> None:
    """A schedule's period: a whole number (NaN or 2.5 would only fail, or skew, at step())."""
    if isinstance(steps, bool) or not float(steps).is_integer() or steps < 1:
        raise ValueError(f"{name} must be at least 1 (a whole number of steps), got {steps!r}")


class Optimizer:
    settings: tuple[str, ...] = ("lr",)  # saved by state_dict and restored by load_state_dict

    def __init__(self, params, lr: float):
        if isinstance(params, Tensor):  # iterating a Tensor yields row copies, not parameters
            raise TypeError("params must be an iterable of Tensors, not a single Tensor")
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"params[{i}] is a {type(p).__name__}, not a Tensor")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("params holds a parameter more than once; it would be updated twice")
        self.lr = lr

    @property
    def lr(self) -> float:
        """Checked on every assignment (a schedule's, one by hand): NaN would reach every weight."""
        return self._lr

    @lr.setter
    def lr(self, lr: float) -> None:
        _check_lr(lr)
        self._lr = lr

    def _setting_values(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.settings}

    def _check_settings(self, values: dict[str, float]) -> None:
        """Raise ValueError for hyper-parameters the update rule cannot use (also for loaded
        state, checked before it is applied)."""
        _check_lr(values["lr"])

    def step(self) -> None:
        raise NotImplementedError

    def reset_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """Hyper-parameters (all of them, as PyTorch's param_groups: a resumed run must not go on
        with other betas), the parameter count and per-parameter state keyed
        `<slot>.<parameter index>`."""
        state = {name: np.array(value) for name, value in self._setting_values().items()}
        state[PARAM_COUNT] = np.array(len(self.params))
        for slot, arrays in self._slots().items():
            for i, value in arrays.items():
                state[f"{slot}.{i}"] = value.numpy()
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Restores what state_dict saved; a setting the state lacks (saved before settings were)
        keeps this optimiser's value. Checks every entry before changing anything, so a bad
        state leaves this intact."""
        if PARAM_COUNT in state:  # states saved before it was can only be checked by index
            count = _scalar(PARAM_COUNT, state[PARAM_COUNT])
            if count != len(self.params):
                raise ValueError(
                    f"optimizer state is for {count} parameters, this {type(self).__name__} "
                    f"has {len(self.params)}: its per-parameter state would go to the wrong ones"
                )
        slots = self._slots()
        arrays = []
        for key, value in state.items():  # before settings: another optimiser's slot names it
            slot, _, index = key.partition(".")
            if not index:
                continue
            if slot not in slots or not index.isdigit() or int(index) >= len(self.params):
                raise KeyError(f"{type(self).__name__} state has no entry {key!r}")
            param = self.params[int(index)]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                    f"parameter {index} has shape {tuple(param.shape)}"
                )
            arrays.append((slots[slot], int(index), NDArray(value, device=param.device)))
        loaded = {}
        for key, value in state.items():
            if "." in key or key == PARAM_COUNT:
                continue
            if key not in self.settings:
                raise KeyError(f"{type(self).__name__} has no setting {key!r} (it has "
                               f"{', '.join(self.settings)}: another optimiser's state?)")
            loaded[key] = _scalar(key, value)
        self._check_settings({**self._setting_values(), **loaded})
        for name, value in loaded.items():
            setattr(self, name, value)
        for slot in slots.values():  # replaced, not merged: stale entries would skew the update
            slot.clear()
        for slot, index, value in arrays:
            slot[index] = value

    def _slots(self) -> dict[str, dict[int, NDArray]]:
        """Per-parameter state arrays by slot name."""
        return {}

    def _grad(self, i: int, p: Tensor, weight_decay: float) -> NDArray | None:
        if p.grad is None:
            return None
        grad = _array(p.grad)
        if tuple(grad.shape) != tuple(p.shape):
            raise ValueError(
                f"gradient of parameter {i} has shape {grad.shape}, parameter has {p.shape}"
            )
        return grad + _array(p) * weight_decay if weight_decay else grad


class SGD(Optimizer):
    """SGD with CMU needle's momentum, u = momentum u + (1 - momentum) g, and L2 weight decay
    added to the gradient."""

    settings = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr)
        self.momentum = momentum
        self.weight_decay = weight_decay
        self._check_settings(self._setting_values())
        self.u: dict[int, NDArray] = {}

    def _check_settings(self, values: dict[str, float]) -> None:
        super()._check_settings(values)
        check_number("momentum", values["momentum"], 0.0, 1.0)  # at 1 the buffer stays 0
        check_number("weight_decay", values["weight_decay"], 0.0)

    def _slots(self):
        return {"u": self.u}

    def step(self) -> None:
        for i, p in enumerate(self.params):
            grad = self._grad(i, p, self.weight_decay)
            if grad is None:
                continue
            if self.momentum:
                u = self.u.get(i)
                grad = grad * (1 - self.momentum) if u is None else (
                    u * self.momentum + grad * (1 - self.momentum)
                )
                self.u[i] = grad
            p.cached_data = _array(p) + grad * -self.lr


class Adam(Optimizer):
    """Adam with bias correction; weight decay is added to the gradient (L2).

    Bias correction uses each parameter's own step count (the updates its moments have had,
    Kingma & Ba's t): a parameter without a gradient in some steps (a branch not taken, a
    layer unfrozen later) is otherwise corrected for steps its moments never saw, and its
    updates come out the wrong size. `t` counts step() calls, as in CMU needle; where every
    parameter gets a gradient every step, the two agree.
    """

    settings = ("lr", "beta1", "beta2", "eps", "weight_decay", "t")

    def __init__(self, params, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr)
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.weight_decay = weight_decay
        self.t = 0
        self._check_settings(self._setting_values())
        self.m: dict[int, NDArray] = {}
        self.v: dict[int, NDArray] = {}
        self.steps: dict[int, int] = {}  # per parameter index: updates of its m and v

    def _check_settings(self, values: dict[str, float]) -> None:
        super()._check_settings(values)
        check_number("beta1", values["beta1"], 0.0, 1.0)  # at 1 bias correction divides by 0
        check_number("beta2", values["beta2"], 0.0, 1.0)
        check_number("eps", values["eps"], 0.0, low_open=True)  # 0: a zero gradient gives 0/0
        check_number("weight_decay", values["weight_decay"], 0.0)
        check_number("t", values["t"], 0)
        if not float(values["t"]).is_integer():  # a step count: 2.5 would skew bias correction
            raise ValueError(f"t must be a whole number of steps, got {values['t']}")

    def _slots(self):
        return {"m": self.m, "v": self.v}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Adds, for a parameter whose moments had fewer updates than t, `t.<index>` (so a run
        where every parameter always has a gradient saves no such entries)."""
        counts = {f"t.{i}": np.array(n) for i, n in self.steps.items() if n != self.t}
        return {**super().state_dict(), **counts}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """A parameter's moments without its `t.<index>` count `t` steps (all of them, as in
        states saved before per-parameter counts). Moments without a step count, m without v,
        or a count outside [1, t] are refused before anything changes."""
        state = dict(state)
        counts = {key[2:]: np.asarray(state.pop(key)) for key in list(state)
                  if key.startswith("t.")}
        has_m = {key[2:] for key in state if key.startswith("m.")}
        has_v = {key[2:] for key in state if key.startswith("v.")}
        if has_m != has_v:
            raise ValueError(
                f"Adam state has moments m and v for different parameters: m for "
                f"{sorted(has_m)}, v for {sorted(has_v)}"
            )
        if has_m and "t" not in state:  # bias correction would restart from step 1
            raise ValueError("Adam state has moments but no step count 't'")
        t = _scalar("t", state.get("t", self.t))
        orphans = sorted(set(counts) - has_m)
        if orphans:
            raise KeyError(f"Adam state has a step count 't.{orphans[0]}' but no moments for it")
        steps = {}
        for index in has_m:
            if not index.isdigit():
                continue  # the base class refuses the moment's entry, naming it
            n = counts.get(index, np.asarray(t))
            key = f"t.{index}" if index in counts else "t"
            if n.ndim != 0 or n.dtype.kind not in "iuf" or not float(n).is_integer() \
                    or not 1 <= n.item() <= t:
                raise ValueError(f"Adam state {key!r} must be a whole number of steps for "
                                 f"parameter {index}, in [1, t = {t}], got {n.tolist()!r}")
            steps[int(index)] = int(n.item())
        super().load_state_dict(state)
        self.steps = steps

    def step(self) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        for i, p in enumerate(self.params):
            grad = self._grad(i, p, self.weight_decay)
            if grad is None:
                continue
            t = self.steps[i] = self.steps.get(i, 0) + 1
            m, v = self.m.get(i), self.v.get(i)
            m = grad * (1 - b1) if m is None else m * b1 + grad * (1 - b1)
            v = grad * grad * (1 - b2) if v is None else v * b2 + grad * grad * (1 - b2)
            self.m[i], self.v[i] = m, v
            denom = (v * (1 / (1 - b2**t))) ** 0.5 + self.eps
            p.cached_data = _array(p) + m * (-self.lr / (1 - b1**t)) / denom


class StepLR:
    """lr = base_lr * gamma ** (steps // step_size); call step() once per epoch (or batch)."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1):
        _check_steps("step_size", step_size)
        check_number("gamma", gamma, 0.0)  # a negative one flips lr: gradient ascent
        self.optimizer = optimizer
        self.step_size = step_size
        self.gamma = gamma
        self.base_lr = optimizer.lr
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        self.optimizer.lr = self.base_lr * self.gamma ** (self.steps // self.step_size)


class MultiStepLR:
    """lr = base_lr * gamma ** (milestones reached), a milestone being a count of step()
    calls: the same schedule whether or not the steps divide evenly."""

    def __init__(self, optimizer: Optimizer, milestones: Iterable[int], gamma: float = 0.1):
        milestones = list(milestones)  # an iterator would be spent by the checks below
        for milestone in milestones:
            _check_steps("a milestone", milestone)
        check_number("gamma", gamma, 0.0)
        self.optimizer = optimizer
        self.milestones = sorted(milestones)
        self.gamma = gamma
        self.base_lr = optimizer.lr
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        reached = sum(self.steps >= milestone for milestone in self.milestones)
        self.optimizer.lr = self.base_lr * self.gamma ** reached


class CosineLR:
    """Cosine decay from base_lr to min_lr over total_steps calls of step(), then flat."""

    def __init__(self, optimizer: Optimizer, total_steps: int, min_lr: float = 0.0):
        _check_steps("total_steps", total_steps)
        check_number("min_lr", min_lr, 0.0)  # the lr the optimiser would refuse
        self.optimizer = optimizer
        self.total_steps = total_steps
        self.min_lr = min_lr
        self.base_lr = optimizer.lr
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        progress = min(self.steps, self.total_steps) / self.total_steps
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        self.optimizer.lr = self.min_lr + (self.base_lr - self.min_lr) * cosine


def _grad_norm(grads: list[NDArray]) -> float:
    """The joint L2 norm, summed on the device; taken again in float64 on the host where that
    sum overflows: float32 squares of entries above ~1.8e19 are inf, yet such an exploding
    but finite gradient is what clipping is for."""
    total = math.sqrt(sum(float((grad ** 2.0).sum().numpy()) for grad in grads))
    if math.isfinite(total):
        return total
    return math.sqrt(sum(float(np.square(grad.numpy().astype(np.float64)).sum())
                         for grad in grads))


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale all gradients so that their joint L2 norm is at most max_norm; returns the norm
    before clipping."""
    if not max_norm > 0:  # a negative bound would flip every gradient's sign
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    if isinstance(params, Tensor):  # iterating one would visit row copies without grads: 0
        params = [params]
    grads = [p for p in params if p.grad is not None]
    total = _grad_norm([_array(p.grad) for p in grads])
    if not math.isfinite(total):
        raise FloatingPointError(f"gradient norm is {total}; refusing to clip non-finite gradients")
    if total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in grads:
            p.grad = Tensor(_array(p.grad) * scale, device=p.grad.device, requires_grad=False)
    return total
