"""Review of needle.data and needle.remote's offload policy on edge cases: damaged or wrong
MNIST idx / CIFAR-10 batch / PTB text files written here in the real formats, DataLoader and
transform arguments, PTB batching against the CMU course's semantics, and which products the
offload policy hands to its executor. References are numpy and hand-built files."""
import gzip
import pickle
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
from needle import data, remote

ROOT = Path(__file__).resolve().parent.parent


def idx_bytes(images: np.ndarray, labels: np.ndarray) -> tuple[bytes, bytes]:
    n, rows, cols = images.shape
    return (struct.pack(">IIII", 2051, n, rows, cols) + images.astype(np.uint8).tobytes(),
            struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes())


def write(path: Path, blob: bytes) -> str:
    path.write_bytes(blob)
    return str(path)


# ---------------------------------------------------------------- MNIST


def test_mnist_gzip_with_damaged_deflate_stream_is_a_value_error(tmp_path):
    """A bit flip inside the compressed data makes zlib (not gzip) fail; that too must be the
    reader's ValueError naming the file, not a bare zlib.error."""
    images, labels = idx_bytes(np.arange(3 * 8 * 8).reshape(3, 8, 8) % 256, np.arange(3))
    good = gzip.compress(images, mtime=0)
    for pos in range(10, len(good) - 8):  # deflate payload: after the header, before CRC/size
        bad = bytearray(good)
        bad[pos] ^= 0xFF
        try:
            gzip.decompress(bytes(bad))
        except zlib.error:
            break
        except (OSError, EOFError):
            continue
    else:
        pytest.fail("no single-byte flip gave a zlib.error")
    img = write(tmp_path / "damaged-images.gz", bytes(bad))
    lab = write(tmp_path / "labels", labels)
    with pytest.raises(ValueError, match=r"damaged-images\.gz: corrupt or truncated gzip"):
        data.parse_mnist(img, lab)
    with pytest.raises(ValueError, match=r"damaged-images\.gz: corrupt or truncated gzip"):
        data.MNISTDataset(img, lab)


def test_mnist_empty_short_and_wrong_magic_files_are_named(tmp_path):
    images, labels = idx_bytes(np.zeros((2, 3, 3)), np.zeros(2))
    img, lab = write(tmp_path / "img", images), write(tmp_path / "lab", labels)
    empty = write(tmp_path / "empty", b"")
    with pytest.raises(ValueError, match=r"empty: empty file, expected an idx image file"):
        data.parse_mnist(empty, lab)
    with pytest.raises(ValueError, match=r"empty: empty file, expected an idx label file"):
        data.parse_mnist(img, empty)
    gz_empty = write(tmp_path / "empty.gz", gzip.compress(b""))  # valid gzip of nothing
    with pytest.raises(ValueError, match=r"empty\.gz: empty file"):
        data.parse_mnist(gz_empty, lab)
    short = write(tmp_path / "short", images[:10])  # right magic, header cut
    with pytest.raises(ValueError, match=r"short: 10 bytes, too short for the 16-byte"):
        data.parse_mnist(short, lab)
    # labels passed as images: the message says which magic was found
    with pytest.raises(ValueError, match=r"lab: not an idx image file \(magic 2049, "
                                         r"expected 2051\)"):
        data.parse_mnist(lab, lab)
    X, y = data.parse_mnist(img, lab)  # the good pair still reads
    assert X.shape == (2, 9) and X.dtype == np.float32 and y.dtype == np.uint8


# ---------------------------------------------------------------- CIFAR-10


def py2_batch(pixels: np.ndarray, labels: list[int], dtype_state: bytes | None = None) -> bytes:
    """A batch as the original cifar-10-batches-py files hold it: a Python 2 cPickle
    (protocol 2, byte-string keys) of a numpy 1 array, written opcode by opcode."""
    def sbs(b: bytes) -> bytes:  # SHORT_BINSTRING
        return b"U" + bytes([len(b)]) + b

    def int1(v: int) -> bytes:
        return b"K" + bytes([v])

    n = len(pixels)
    if dtype_state is None:  # (3, '|', None, None, None, -1, -1, 0), as numpy writes for u1
        dtype_state = int1(3) + sbs(b"|") + b"NNN" + b"J" + struct.pack("<i", -1) \
            + b"J" + struct.pack("<i", -1) + int1(0)
    out = b"\x80\x02}(" + sbs(b"batch_label") + sbs(b"testing batch 1 of 1")
    out += sbs(b"data") + b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
    out += int1(0) + b"\x85" + sbs(b"b") + b"\x87R"
    out += b"(" + int1(1) + int1(n) + b"M" + struct.pack("<H", 3072) + b"\x86"
    out += b"cnumpy\ndtype\n" + sbs(b"u1") + int1(0) + int1(1) + b"\x87R"
    out += b"(" + dtype_state + b"tb"
    raw = pixels.astype(np.uint8).tobytes()
    out += b"\x89T" + struct.pack("<i", len(raw)) + raw
    out += b"tb"
    out += sbs(b"labels") + b"](" + b"".join(int1(v) for v in labels) + b"e"
    return out + b"u."  # SETITEMS, STOP


def test_cifar10_reads_a_python2_batch_as_the_original_files_are(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    write(tmp_path / "test_batch", py2_batch(pixels, [7, 0, 9]))
    X, y = data.load_batch(str(tmp_path / "test_batch"))
    np.testing.assert_array_equal(X, pixels.reshape(3, 3, 32, 32) / np.float32(255))
    assert type(X) is np.ndarray and type(y) is np.ndarray  # not the unpickling stand-in
    assert X.dtype == np.float32 and y.dtype == np.uint8 and list(y) == [7, 0, 9]
    ds = data.CIFAR10Dataset(str(tmp_path), train=False)
    assert len(ds) == 3 and ds[2][1] == 9


def test_cifar10_damaged_dtype_state_is_a_value_error_not_a_crash(tmp_path):
    """numpy's dtype.__setstate__ trusts its input: a state tuple short by two fields (one
    damaged byte can do it) crashes the interpreter inside pickle.load. Run in a child process
    so that a crash shows as a failure here."""
    short_state = b"K\x03U\x01|NJ" + struct.pack("<i", -1) + b"J" + struct.pack("<i", -1) + b"K\x00"
    path = write(tmp_path / "test_batch", py2_batch(np.zeros((1, 3072)), [1], short_state))
    script = textwrap.dedent(f"""
        from needle import data
        try:
            data.load_batch({path!r})
        except ValueError as err:
            print("ValueError:", err)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"child died with {run.returncode}: {run.stderr[-500:]}"
    assert f"ValueError: {path}: not a CIFAR-10 python batch" in run.stdout


def test_cifar10_every_truncation_and_damaged_header_byte_is_a_value_error(tmp_path):
    """Cut a batch at every length, and overwrite each of its first 200 bytes with a few
    values: the reader either loads it or raises ValueError naming the file, never anything
    else (run in a child process: a crash must fail the test, not end the run)."""
    pixels = np.arange(2 * 3072, dtype=np.int64).reshape(2, 3072) % 256
    blobs = {"py2": py2_batch(pixels, [1, 2]),
             "py3": pickle.dumps({b"data": pixels.astype(np.uint8), b"labels": [1, 2]})}
    for name, blob in blobs.items():
        write(tmp_path / f"{name}.pkl", blob)
    script = textwrap.dedent(f"""
        import collections, os
        from needle import data
        folder, seen = {str(tmp_path)!r}, collections.Counter()
        for name in ("py2", "py3"):
            blob = open(os.path.join(folder, name + ".pkl"), "rb").read()
            variants = [blob[:cut] for cut in range(len(blob))]
            variants += [blob[:i] + bytes([v]) + blob[i + 1:] for i in range(min(200, len(blob)))
                         for v in (0, 1, 0x4e, 0x80, 0xff) if blob[i] != v]
            target = os.path.join(folder, "test_batch")
            for blob_ in variants:
                with open(target, "wb") as f:
                    f.write(blob_)
                try:
                    data.load_batch(target)
                    seen["loaded"] += 1
                except ValueError as err:
                    assert str(err).startswith(target + ": "), err
                    seen["ValueError"] += 1
                except Exception as err:
                    seen[type(err).__name__ + ": " + str(err)[:60]] += 1
        print(dict(seen))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"child died with {run.returncode}: {run.stderr[-500:]}"
    seen = eval(run.stdout)  # a dict literal the child printed
    assert set(seen) <= {"loaded", "ValueError"}, seen
    assert seen["ValueError"] > 1000


def test_cifar10_refuses_pixels_and_labels_of_the_wrong_type(tmp_path):
    """Float pixels would be divided by 255 a second time and float labels truncated: both
    are refused, as are text labels and labels of the wrong shape."""
    path = tmp_path / "test_batch"
    cases = [
        ({b"data": np.full((2, 3072), 0.5, np.float32), b"labels": [0, 1]},
         r"pixels must be bytes \(uint8 0\.\.255\), got float32"),
        ({b"data": np.full((2, 3072), 300, np.int64), b"labels": [0, 1]},
         r"pixels must be bytes"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1.7]},
         r"labels must be integers 0\.\.9, got float64"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": ["a", "b"]},
         r"labels must be integers 0\.\.9"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [[0], [1]]},
         r"expected data \(N, 3072\) and N labels"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]},
         r"labels must be integers 0\.\.9"),
    ]
    for batch, message in cases:
        with open(path, "wb") as f:
            pickle.dump(batch, f)
        with pytest.raises(ValueError, match=rf"test_batch: {message}"):
            data.load_batch(str(path))
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"test_batch: empty file"):
        data.load_batch(str(path))


def test_cifar10_reads_protocol_5_and_python3_string_keys(tmp_path):
    """Python 3.14 pickles at protocol 5 by default, where numpy rebuilds arrays with
    _frombuffer; a batch re-pickled from a latin1 load (as torchvision reads it) has str keys."""
    pixels = np.random.default_rng(1).integers(0, 256, (2, 3072), dtype=np.uint8)
    path = tmp_path / "test_batch"
    for batch, protocol in (({b"data": pixels, b"labels": [3, 4]}, 5),
                            ({"data": pixels, "labels": np.array([3, 4])}, 4),
                            ({b"data": pixels, b"labels": [np.int64(3), np.int64(4)]}, 2)):
        with open(path, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        X, y = data.load_batch(str(path))
        np.testing.assert_array_equal(X, pixels.reshape(2, 3, 32, 32) / np.float32(255))
        assert list(y) == [3, 4]


def test_cifar10_dataset_takes_the_course_positional_arguments(tmp_path):
    """The course's signature is CIFAR10Dataset(base_folder, train, p=0.5, transforms=None)."""
    pixels = np.arange(3072, dtype=np.int64).reshape(1, 3072) % 256
    write(tmp_path / "test_batch", py2_batch(pixels, [5]))
    flipped = data.CIFAR10Dataset(str(tmp_path), False, 0.5, [data.RandomFlipHorizontal(1.0)])
    plain = data.CIFAR10Dataset(str(tmp_path), train=False, p=0.5)
    image = pixels.reshape(3, 32, 32).astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(plain[0][0], image)
    np.testing.assert_array_equal(flipped[0][0], image[:, :, ::-1])


# ---------------------------------------------------------------- transforms


def test_flip_horizontal_mirrors_columns_of_2d_and_3d_images():
    """As the course's np.flip(img, axis=1): columns reversed, for H x W images too."""
    for img in (np.arange(12).reshape(3, 4), np.arange(24).reshape(3, 4, 2)):
        np.testing.assert_array_equal(data.RandomFlipHorizontal(1.0)(img), np.flip(img, axis=1))
        np.testing.assert_array_equal(data.RandomFlipHorizontal(0.0)(img), img)


def reference_crop(img: np.ndarray, p: int, dx: int, dy: int) -> np.ndarray:
    """out[i, j] = img[i + dx, j + dy] where that is inside the image, else 0."""
    out = np.zeros_like(img)
    h, w = img.shape[:2]
    for i in range(h):
        for j in range(w):
            if 0 <= i + dx < h and 0 <= j + dy < w:
                out[i, j] = img[i + dx, j + dy]
    return out


@pytest.mark.parametrize("shape, padding", [((5, 6, 2), 2), ((4, 3), 1), ((3, 3, 1), 5),
                                            ((4, 4, 3), 0)])
def test_random_crop_matches_a_pixel_by_pixel_reference(shape, padding):
    img = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape)
    np.random.seed(11)
    for _ in range(30):
        state = np.random.get_state()
        dx, dy = np.random.randint(low=-padding, high=padding + 1, size=2)  # the course's draw
        np.random.set_state(state)
        out = data.RandomCrop(padding)(img)
        np.testing.assert_array_equal(out, reference_crop(img, padding, dx, dy))


def test_transforms_refuse_bad_parameters():
    with pytest.raises(ValueError, match="padding must be >= 0, got -1"):
        data.RandomCrop(-1)
    with pytest.raises(ValueError, match="std must be positive"):
        data.Normalize([0.0, 0.0], [1.0, float("nan")])


# ---------------------------------------------------------------- DataLoader


def test_loader_refuses_a_non_integer_batch_size_on_construction():
    ds = data.ArrayDataset(np.arange(5, dtype=np.float32)[:, None], np.arange(5))
    for bad in (2.0, 2.5, "2", True, None):
        with pytest.raises(ValueError, match="batch_size must be positive and an integer"):
            data.DataLoader(ds, batch_size=bad)
    loader = data.DataLoader(ds, batch_size=np.int64(2))  # numpy integers are integers
    assert [b[1].numpy().tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_loader_edge_sizes_match_torch_semantics():
    """Batch larger than the dataset: one short batch (none with drop_last); empty dataset:
    no batches; every example exactly once per epoch, shuffled or not."""
    X = np.arange(7, dtype=np.float32)[:, None]
    ds = data.ArrayDataset(X, np.arange(7))
    big = data.DataLoader(ds, batch_size=10)
    assert len(big) == 1 and [b[0].shape for b in big] == [(7, 1)]
    assert len(data.DataLoader(ds, batch_size=10, drop_last=True)) == 0
    assert list(data.DataLoader(ds, batch_size=10, drop_last=True)) == []
    empty = data.DataLoader(data.ArrayDataset(np.zeros((0, 1), np.float32)), batch_size=3,
                            shuffle=True)
    assert len(empty) == 0 and list(empty) == []
    for shuffle in (False, True):
        loader = data.DataLoader(ds, batch_size=3, shuffle=shuffle, seed=1)
        sizes = [b[1].shape[0] for b in loader]
        labels = np.concatenate([b[1].numpy() for b in loader])
        assert sizes == [3, 3, 1] and sorted(labels.tolist()) == list(range(7))


# ---------------------------------------------------------------- PTB


def cmu_get_batch(batches: np.ndarray, i: int, bptt: int) -> tuple[np.ndarray, np.ndarray]:
    """The course's get_batch, in numpy."""
    seq_len = min(bptt, len(batches) - 1 - i)
    return batches[i:i + seq_len], batches[i + 1:i + 1 + seq_len].flatten()


def test_batchify_and_get_batch_match_the_course_for_every_start():
    tokens = list(range(3, 3 + 29))
    batches = data.batchify(tokens, 4)
    expected = np.array(tokens[:28]).reshape(4, 7).T  # the course's batchify
    np.testing.assert_array_equal(batches, expected)
    for bptt in (1, 3, 10):
        for i in range(len(batches) - 1):
            X, y = data.get_batch(batches, i, bptt)
            X_ref, y_ref = cmu_get_batch(expected, i, bptt)
            np.testing.assert_array_equal(X.numpy(), X_ref)
            np.testing.assert_array_equal(y.numpy(), y_ref)


def test_batchify_and_get_batch_refuse_bad_arguments():
    batches = data.batchify(list(range(12)), 3)
    with pytest.raises(IndexError, match="batch start -1 is negative"):
        data.get_batch(batches, -1, 2)  # would pair rows with the wrong targets
    with pytest.raises(ValueError, match="bptt must be positive, got 0"):
        data.get_batch(batches, 0, 0)
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            data.batchify(list(range(12)), bad)


def test_corpus_names_an_empty_or_non_text_file(tmp_path):
    (tmp_path / "train.txt").write_text("a b\n")
    (tmp_path / "test.txt").write_text("")
    with pytest.raises(ValueError, match=r"test\.txt: empty file"):
        data.Corpus(str(tmp_path))
    (tmp_path / "test.txt").write_bytes(b"a \xff\xfe b\n")
    with pytest.raises(ValueError, match=r"test\.txt: not UTF-8 text"):
        data.Corpus(str(tmp_path))
    (tmp_path / "test.txt").write_text("\n")  # a blank line is a sentence: just '<eos>'
    corpus = data.Corpus(str(tmp_path))
    assert corpus.test == [corpus.dictionary.word2idx["<eos>"]]
    assert data.Corpus(str(tmp_path), max_lines=0).train == []
    with pytest.raises(ValueError, match="max_lines must be None or >= 0"):
        data.Corpus(str(tmp_path), max_lines=-1)


# ---------------------------------------------------------------- remote offload


class Recorder:
    """An executor computing in float64 numpy and recording the shapes it was given."""

    def __init__(self) -> None:
        self.shapes: list = []

    def matmul(self, a, b):
        self.shapes.append((a.shape, b.shape))
        return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("a_shape, b_shape", [((0, 3), (3, 4)), ((2, 0), (0, 5)),
                                              ((2, 0, 3, 4), (4, 2)), ((0, 3, 4), (0, 4, 2))])
def test_empty_products_stay_local_whatever_min_flops(a_shape, b_shape):
    """No job can hold an empty operand (the network refuses them), and there is nothing to
    offload: with the default min_flops=0 they must still be computed locally."""
    executor = Recorder()
    a = np.ones(a_shape, np.float32)
    b = np.ones(b_shape, np.float32)
    with remote.offload(executor) as policy:
        out = ndl.ops.matmul(ndl.Tensor(a, device=ndl.cpu()), ndl.Tensor(b, device=ndl.cpu()))
    assert executor.shapes == [] and (policy.offloaded, policy.local) == (0, 1)
    np.testing.assert_array_equal(out.numpy(), np.matmul(a, b))


def test_invalid_products_raise_the_local_error_under_offload():
    """Offload must not change what a wrong product does: mismatched shapes raise needle's
    own error before any job, and operands on two devices are refused, not silently run."""
    cpu, other = ndl.cpu(), ndl.cpu_numpy()
    cases = [
        (np.ones((2, 3)), np.ones((5, 4)), cpu, cpu, "inner dimensions differ"),
        (np.ones((2, 2, 3)), np.ones((3, 3, 4)), cpu, cpu, "do not broadcast"),
        (np.ones((2, 3)), np.ones((3, 4)), cpu, other, r"arrays on cpu\(\) and cpu_numpy\(\)"),
    ]
    for a, b, dev_a, dev_b, message in cases:
        x = ndl.Tensor(a.astype(np.float32), device=dev_a)
        y = ndl.Tensor(b.astype(np.float32), device=dev_b)
        with pytest.raises(ValueError, match=message):
            ndl.ops.matmul(x, y)  # the local behaviour, for reference
        executor = Recorder()
        with remote.offload(executor) as policy, pytest.raises(ValueError, match=message):
            ndl.ops.matmul(x, y)
        assert executor.shapes == [] and (policy.offloaded, policy.local) == (0, 0)


def test_policy_declines_one_dimensional_operands():
    """NDArray refuses 1-D matmul operands with a ValueError; the policy must decline them
    rather than fail first with an IndexError of its own."""
    from needle.backend_ndarray import NDArray

    a = NDArray(np.ones(3, np.float32), device=ndl.cpu())
    b = NDArray(np.ones((3, 2), np.float32), device=ndl.cpu())
    with remote.offload(Recorder()) as policy:
        assert policy.matmul(a, b) is None
        assert policy.matmul(b.permute((1, 0)), a) is None
    with pytest.raises(ValueError, match="matmul needs >= 2-D operands"):
        a @ b
