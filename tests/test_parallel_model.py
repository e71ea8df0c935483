"""Model parallelism: stages on different needle devices give the unsplit model's gradients."""
import numpy as np
import pytest
from parallel_scripts.common import make_batches, make_stages, reference_gradients

import needle as ndl
from needle import nn
from needle.parallel import ModelParallel, to_device

DEVICE_PAIRS = [
    pytest.param((ndl.cpu(), ndl.cpu_numpy()), id="cpu-numpy"),
    pytest.param((ndl.cpu_numpy(), ndl.cpu()), id="numpy-cpu"),
    pytest.param(
        (ndl.cpu(), ndl.cuda()),
        id="cpu-cuda",
        marks=pytest.mark.skipif(not ndl.cuda().enabled(), reason="no CUDA GPU on this machine"),
    ),
]


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
def test_gradients_match_unsplit_model(devices):
    (x, y), = make_batches(1, batch=6)
    model = ModelParallel(make_stages(seed=3), devices)
    for stage, device in zip(model.stages, devices, strict=True):
        assert all(p.device == device for p in stage.parameters())
    logits = model(ndl.Tensor(x, device=devices[0]))
    assert logits.device == devices[1]
    nn.SoftmaxLoss()(logits, ndl.Tensor(y, device=devices[1])).backward()
    expected = reference_gradients(seed=3, x=x, y=y, device=ndl.cpu())
    got = model.parameters()
    for p, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-5, atol=1e-6)


def test_to_device_moves_value_and_gradient_back():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = ndl.Tensor(a, device=ndl.cpu(), requires_grad=True)
    y = to_device(x, ndl.cpu_numpy())
    assert y.device == ndl.cpu_numpy()
    np.testing.assert_array_equal(y.numpy(), a)
    (y * y).sum().backward()
    assert x.grad.device == ndl.cpu()
    np.testing.assert_allclose(x.grad.numpy(), 2 * a)


def test_one_device_per_stage_is_required():
    with pytest.raises(ValueError, match="one device per stage"):
        ModelParallel(make_stages(seed=0), [ndl.cpu()])
