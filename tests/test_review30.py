"""From a review of needle's data and optim: MultiStepLR given its milestones as an iterator
never lowered the rate; a dataset whose examples are lists [x, y] was batched as one stacked
field instead of one per field."""
import numpy as np
import pytest

from needle import nn, optim
from needle.data import DataLoader, Dataset


def _rates(milestones) -> list[float]:
    opt = optim.SGD([nn.Parameter(np.zeros(1, np.float32))], lr=1.0)
    schedule = optim.MultiStepLR(opt, milestones, gamma=0.1)
    rates = []
    for _ in range(5):
        schedule.step()
        rates.append(opt.lr)
    return rates


def test_multistep_milestones_as_an_iterator_give_the_same_schedule():
    expected = [1.0, 0.1, 0.1, 0.01, 0.01]
    assert _rates([2, 4]) == pytest.approx(expected)
    assert _rates(map(int, "4,2".split(","))) == pytest.approx(expected)
    assert _rates(m for m in (2, 4)) == pytest.approx(expected)


class _Lists(Dataset):
    def __init__(self):
        super().__init__()
        self.x = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
        self.y = np.arange(4, dtype=np.uint8)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return [self.x[i], self.y[i]]


def test_examples_given_as_lists_are_batched_field_by_field():
    batches = list(DataLoader(_Lists(), batch_size=3))
    assert [len(b) for b in batches] == [2, 2]
    x, y = batches[0]
    np.testing.assert_array_equal(x.numpy(), np.arange(18, dtype=np.float32).reshape(3, 2, 3))
    np.testing.assert_array_equal(y.numpy(), [0, 1, 2])


def test_an_operand_whose_npy_header_is_cut_off_is_one_error_line(tmp_path):
    """numpy raises tokenize.TokenError (not a ValueError) for a header dict left open."""
    import struct

    from helpers import one_error_line, run_cli

    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4)".ljust(117) + b"\n"
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(64))
    np.save(tmp_path / "a.npy", np.ones((4, 4), np.float32))
    line = one_error_line(run_cli("submit", tmp_path / "a.npy", bad, "-o", tmp_path / "c.npy",
                                  "--rpc-url", "http://127.0.0.1:9"))
    assert line.startswith(f"error: cannot read operand {bad}"), line
