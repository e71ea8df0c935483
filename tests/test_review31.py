"""Review of session 31: a checkpoint whose array header numpy cannot tokenize, and a chain
node URL without its scheme, each end in one clear error instead of a traceback or a retry."""
import struct
import zipfile

import httpx
import numpy as np
import pytest
from helpers import one_error_line, run_cli

from needle import checkpoint, nn
from node.market import is_transient


def _npy_with_open_header() -> bytes:
    """numpy raises tokenize.TokenError (not a ValueError) for a header dict left open."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2)".ljust(117) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(16)


def test_a_checkpoint_with_a_cut_off_array_header_is_refused_and_changes_nothing(tmp_path):
    model = nn.Linear(2, 2)
    before = {k: v.copy() for k, v in model.state_dict().items()}
    path = tmp_path / "bad.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/weight.npy", _npy_with_open_header())
    with pytest.raises(ValueError, match="not a readable needle checkpoint"):
        checkpoint.load(str(path), model)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_a_url_without_its_scheme_is_not_worth_retrying():
    with pytest.raises(httpx.UnsupportedProtocol) as raised:
        httpx.get("127.0.0.1:9")
    assert not is_transient(raised.value)
    with pytest.raises(httpx.ConnectError) as refused:  # still retried: nothing listens there
        httpx.get("http://127.0.0.1:9")
    assert is_transient(refused.value)


def test_worker_up_with_a_url_without_its_scheme_says_so_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("NEEDLE_NET_PASSWORD", "pw")
    line = one_error_line(run_cli("worker", "up", "--data-dir", tmp_path / "w",
                                  "--rpc-url", "127.0.0.1:9"))
    assert line.startswith("error: not a chain node URL: 127.0.0.1:9") and "http://" in line, line


@pytest.mark.parametrize("a_shape,b_shape", [
    ((4, 3, 5), (5, 6)), ((4, 3, 5), (4, 5, 6)),  # small elements: one stacked check
    ((4, 300, 500), (500, 200)),  # B shared: the elements' rows checked as one product
    ((4, 300, 500), (4, 500, 200)),  # element by element
])
@pytest.mark.parametrize("where", ["A", "C"])
def test_a_nan_in_a_batch_names_its_element_on_every_path(a_shape, b_shape, where):
    from verifier import verify

    rng = np.random.default_rng(0)
    A = rng.standard_normal(a_shape).astype(np.float32)
    B = rng.standard_normal(b_shape).astype(np.float32)
    C = A @ B
    (A if where == "A" else C)[2, 1, 1] = np.inf if where == "A" else np.nan
    if where == "A":
        with np.errstate(invalid="ignore"):
            C = A @ B
    result = verify(A, B, C, seed=b"R" * 32)
    assert not result.passed
    assert result.reason.startswith("NaN or Inf in") and result.reason.endswith(
        "(batch element (2,))"), result.reason


@pytest.fixture(params=["cpu", "cpu_numpy"])
def device(request):
    import needle as ndl

    return getattr(ndl, request.param)()


def test_an_ndarray_or_list_exponent_has_a_gradient(device):
    import needle as ndl
    from needle.backend_ndarray import NDArray

    for exponent in (NDArray(np.array([2.0, 3.0, 0.5], np.float32), device=device),
                     [2.0, 3.0, 0.5]):
        x = ndl.Tensor([1.5, 2.0, 3.0], device=device)
        ndl.ops.summation(x ** exponent).backward()
        e = np.array([2.0, 3.0, 0.5])
        np.testing.assert_allclose(x.grad.numpy(), e * np.array([1.5, 2.0, 3.0]) ** (e - 1),
                                   rtol=1e-6)


@pytest.mark.parametrize("shape", [(0, 3), (0, 3, 4, 4)])
def test_batch_norm_in_eval_mode_takes_an_empty_batch(device, shape):
    import needle as ndl

    layer = (ndl.nn.BatchNorm1d if len(shape) == 2 else ndl.nn.BatchNorm2d)(3, device=device)
    layer.eval()
    assert layer(ndl.Tensor(np.zeros(shape, np.float32), device=device)).shape == shape


def test_less_than_takes_a_list_as_the_other_comparisons_do(device):
    from needle.backend_ndarray import NDArray

    a = NDArray([1.0, 2.0, 3.0], device=device)
    other = [2.0, 2.0, np.nan]
    ref = np.array([1.0, 2.0, 3.0])
    with np.errstate(invalid="ignore"):
        for got, want in ((a < other, ref < other), (a <= other, ref <= other),
                          (a > other, ref > other), (a >= other, ref >= other)):
            np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))


@pytest.mark.parametrize("bad", ["3", b"3"])
def test_a_string_is_not_a_number(device, bad):
    from needle.backend_ndarray import NDArray

    a = NDArray([1.0, 2.0, 3.0], device=device)
    for operation in (lambda: a + bad, lambda: a * bad, lambda: a >= bad):
        with pytest.raises(TypeError, match="expected a number"):
            operation()
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0, 3.0])


def test_copies_keep_the_sign_of_zero(device):
    from needle.backend_ndarray import NDArray

    z = NDArray(np.array([-0.0, 0.0], np.float32), device=device)
    np.testing.assert_array_equal(np.signbit(NDArray(z).numpy()), [True, False])
    c = NDArray([1.0, -0.0], device=device)
    c[::-1] = c  # the source overlaps the target: read through a copy
    np.testing.assert_array_equal(np.signbit(c.numpy()), np.signbit([-0.0, 1.0]))


def test_uniform_samples_stay_below_high():
    """float64 draws within 2^-25 of 1 round to 1.0 in float32: this seed has one."""
    import needle as ndl

    np.random.seed(30)
    r = ndl.init.rand(1_000_000, low=-2.0, high=2.0, device=ndl.cpu()).numpy()
    assert r.max() < 2.0 and r.min() >= -2.0
    np.random.seed(30)
    ref = (np.random.rand(1_000_000).astype(np.float32) * 4.0 - 2.0)
    assert (ref == 2.0).sum() == 1  # the case is really there
    np.testing.assert_array_equal(r[ref < 2.0], ref[ref < 2.0])
    assert ndl.init.rand(3, low=1.0, high=1.0).numpy().tolist() == [1.0, 1.0, 1.0]


def test_ctrl_c_while_submit_reads_its_operands_says_so(tmp_path):
    """A FIFO holds the read (as a large file does for seconds) until Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    import time

    np.save(tmp_path / "b.npy", np.ones((4, 4), np.float32))
    os.mkfifo(tmp_path / "a.npy")
    proc = subprocess.Popen([sys.executable, "-m", "node", "submit", str(tmp_path / "a.npy"),
                             str(tmp_path / "b.npy"), "-o", str(tmp_path / "c.npy"),
                             "--rpc-url", "http://127.0.0.1:9"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    writer = None
    try:
        end = time.monotonic() + 60
        while writer is None and time.monotonic() < end:  # until submit opened it to read
            try:
                writer = os.open(tmp_path / "a.npy", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                time.sleep(0.05)
        assert writer is not None and proc.poll() is None
        proc.send_signal(signal.SIGINT)  # submit waits in the read: no byte comes
        output, _ = proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "error: interrupted while reading the operands; no job was sent" in output, output
