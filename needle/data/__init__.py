"""Data loading (CMU needle's `needle.data`): datasets, loader, transforms, file readers."""
from .data_basic import ArrayDataset, DataLoader, Dataset, NDArrayDataset
from .datasets.cifar10 import CIFAR10Dataset, load_batch
from .datasets.mnist import MNISTDataset, parse_mnist
from .datasets.ptb import Corpus, Dictionary, batchify, get_batch
from .transforms import Normalize, RandomCrop, RandomFlipHorizontal

__all__ = [
    "ArrayDataset", "CIFAR10Dataset", "Corpus", "DataLoader", "Dataset", "Dictionary",
    "MNISTDataset", "NDArrayDataset", "Normalize", "RandomCrop", "RandomFlipHorizontal",
    "batchify", "get_batch", "load_batch", "parse_mnist",
]
