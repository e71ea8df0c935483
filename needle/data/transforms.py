"""Per-example image transforms on H x W x C (or H x W) arrays (randomness from numpy's global
generator, so np.random.seed makes them reproducible)."""
import numpy as np


class RandomFlipHorizontal:
    """Mirror the image left-right with probability p."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: np.ndarray) -> np.ndarray:
        return img[:, ::-1] if np.random.rand() < self.p else img  # H x W as well as H x W x C


class RandomCrop:
    """Shift the image by up to `padding` pixels each way, filling with zeros
    (a random crop of the zero-padded image, same size as the input)."""

    def __init__(self, padding: int = 3):
        # else an obscure error from numpy at the first image
        if isinstance(padding, bool) or not isinstance(padding, int | np.integer):
            raise ValueError(f"RandomCrop padding must be an integer, got {padding!r}")
        if padding < 0:
            raise ValueError(f"RandomCrop padding must be >= 0, got {padding}")
        self.padding = padding

    def __call__(self, img: np.ndarray) -> np.ndarray:
        p = self.padding
        shift_x, shift_y = np.random.randint(low=-p, high=p + 1, size=2)
        h, w = img.shape[:2]
        padded = np.pad(img, ((p, p), (p, p)) + ((0, 0),) * (img.ndim - 2))
        return padded[p + shift_x : p + shift_x + h, p + shift_y : p + shift_y + w]


class Normalize:
    """(img - mean) / std per channel (the last axis)."""

    def __init__(self, mean, std):
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)
        if not np.all(self.std > 0):  # also refuses NaN
            raise ValueError(f"Normalize std must be positive, got {std}")

    def __call__(self, img: np.ndarray) -> np.ndarray:
        shape = np.shape(img)
        try:  # 3 values would silently make a 1-channel image 3, 2 fail obscurely on 3
            fits = np.broadcast_shapes(shape, self.mean.shape, self.std.shape) == shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"Normalize: {max(self.mean.size, self.std.size)} channel values "
                             f"for an image of shape {shape} (channels last)")
        return (img - self.mean) / self.std
