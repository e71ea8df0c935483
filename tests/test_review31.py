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
