"""Multi-layer perceptron classifier."""
from needle import nn


class MLP(nn.Module):
    """Linear -> ReLU (-> Dropout) per hidden layer, then a Linear to the class logits."""

    def __init__(self, in_features: int, hidden_sizes=(128,), num_classes: int = 10,
                 dropout: float = 0.0, device=None, dtype="float32"):
        super().__init__()
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
