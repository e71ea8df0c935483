"""Multi-layer perceptron classifier."""
from collections.abc import Iterable

from needle import nn
from needle.nn.nn_basic import check_positive_ints


class MLP(nn.Module):
    """Linear -> ReLU (-> Dropout) per hidden layer, then a Linear to the class logits."""

    def __init__(self, in_features: int, hidden_sizes=(128,), num_classes: int = 10,
                 dropout: float = 0.0, device=None, dtype="float32"):
        super().__init__()
        if not isinstance(hidden_sizes, Iterable):
            raise TypeError(f"MLP: hidden_sizes must be a sequence of widths such as (128,), "
                            f"got {hidden_sizes!r}")
        hidden_sizes = tuple(hidden_sizes)
        check_positive_ints(self, in_features=in_features, num_classes=num_classes,
                      **{f"hidden_sizes[{i}]": size for i, size in enumerate(hidden_sizes)})
        layers, width = [], in_features
        for size in hidden_sizes:
            layers += [nn.Linear(width, size, device=device, dtype=dtype), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, num_classes, device=device, dtype=dtype))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)
