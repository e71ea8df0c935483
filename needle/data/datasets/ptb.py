"""A Penn-Treebank-style word corpus (train.txt / test.txt, one sentence a line)."""
import os

import numpy as np

from needle.autograd import Tensor

from ..data_basic import is_positive_int

_FLOAT32_EXACT = 2**24  # every integer up to this is exact in float32, not every one above


class Dictionary:
    """Word <-> id, ids given in order of first appearance."""

    def __init__(self):
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    """Token ids of train.txt and test.txt; every line ends with an '<eos>' token."""

    def __init__(self, base_dir: str, max_lines: int | None = None):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(base_dir, "train.txt"), max_lines)
        self.test = self.tokenize(os.path.join(base_dir, "test.txt"), max_lines)

    def tokenize(self, path: str, max_lines: int | None = None) -> list[int]:
        """Ids of the words of the first max_lines lines (all when None), each line followed
        by '<eos>'. An empty file, or one that is not UTF-8 text, raises ValueError naming it."""
        if max_lines is not None and max_lines < 0:
            raise ValueError(f"max_lines must be None or >= 0, got {max_lines}")
        ids, lines = [], 0
        # utf-8-sig: a byte-order mark (Windows editors) would else join the first word
        with open(path, encoding="utf-8-sig") as f:
            try:
                for line in f:
                    if max_lines is not None and lines >= max_lines:
                        break
                    lines += 1
                    ids.extend(self.dictionary.add_word(word)
                               for word in line.split() + ["<eos>"])
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}: not UTF-8 text ({err})") from None
        if lines == 0 and max_lines != 0:
            raise ValueError(f"{path}: empty file, expected one sentence a line")
        return ids


def batchify(data, batch_size: int, device=None, dtype: str = "float32") -> np.ndarray:
    """Cut the token stream into batch_size columns: (len(data) // batch_size, batch_size),
    ids kept as they are (ints, as in the course: float32 would round ids above 2**24, and
    float ids cannot index idx2word). device and dtype are accepted for the course's
    signature; get_batch makes the Tensors."""
    if not is_positive_int(batch_size):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    rows = len(data) // batch_size
    if rows == 0:
        raise ValueError(f"{len(data)} tokens are too few for batch_size {batch_size}")
    return np.array(data[: rows * batch_size]).reshape(batch_size, rows).T


def get_batch(batches: np.ndarray, i: int, bptt: int, device=None, dtype="float32"):
    """Inputs rows i..i+L-1 (L, batch) and their next tokens flattened (L * batch,),
    L = min(bptt, rows - 1 - i). The Tensors are float32, so integer ids above 2**24 are
    refused rather than rounded."""
    if bptt < 1:
        raise ValueError(f"bptt must be positive, got {bptt}")
    if i < 0:  # a negative start would slice from the end: inputs and targets misaligned
        raise IndexError(f"batch start {i} is negative")
    length = min(bptt, len(batches) - 1 - i)
    if length <= 0:
        raise IndexError(f"batch start {i} leaves no targets in {len(batches)} rows")
    window = batches[i : i + 1 + length]
    if np.issubdtype(window.dtype, np.integer) and np.abs(window).max() > _FLOAT32_EXACT:
        raise ValueError(  # the Tensors are float32: such an id would silently become another
            f"token id {np.abs(window).max()} is above 2**24 = {_FLOAT32_EXACT}, beyond which "
            f"float32 (the Tensors' dtype) cannot hold every integer")
    data = batches[i : i + length]
    target = batches[i + 1 : i + 1 + length].reshape(-1)
    return (Tensor(data, device=device, dtype=dtype, requires_grad=False),
            Tensor(target, device=device, dtype=dtype, requires_grad=False))
