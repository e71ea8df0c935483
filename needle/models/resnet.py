"""Convolutional residual networks on NCHW images."""
from needle import nn
from needle.nn.nn_basic import check_positive_ints


class ConvBN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU (ReLU optional, for the end of a residual branch). The conv
    has no bias by default, as in PyTorch's ResNets (BatchNorm's shift makes it redundant);
    CMU needle's ResNet9 keeps it."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, relu=True,
                 bias=False, device=None, dtype="float32"):
        super().__init__()
        layers = [
            nn.Conv(in_channels, out_channels, kernel_size, stride, bias=bias,
                    device=device, dtype=dtype),
            nn.BatchNorm2d(out_channels, device=device, dtype=dtype),
        ]
        self.net = nn.Sequential(*layers, nn.ReLU()) if relu else nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class ResNet9(nn.Module):
    """CMU needle's ResNet9 for 3 x 32 x 32 images, conv biases included (431,946 parameters
    with 10 classes, the course's count)."""

    def __init__(self, device=None, dtype="float32", num_classes: int = 10):
        super().__init__()
        check_positive_ints(self, num_classes=num_classes)

        def block(a, b, k, s):
            return ConvBN(a, b, k, s, bias=True, device=device, dtype=dtype)

        self.net = nn.Sequential(
            block(3, 16, 7, 4),
            block(16, 32, 3, 2),
            nn.Residual(nn.Sequential(block(32, 32, 3, 1), block(32, 32, 3, 1))),
            block(32, 64, 3, 2),
            block(64, 128, 3, 2),
            nn.Residual(nn.Sequential(block(128, 128, 3, 1), block(128, 128, 3, 1))),
            nn.Flatten(),
            nn.Linear(128, 128, device=device, dtype=dtype),
            nn.ReLU(),
            nn.Linear(128, num_classes, device=device, dtype=dtype),
        )

    def forward(self, x):
        return self.net(x)


class BasicBlock(nn.Module):
    """Two 3x3 ConvBNs plus a shortcut (a strided 1x1 ConvBN when the shape changes)."""

    def __init__(self, in_channels, out_channels, stride=1, device=None, dtype="float32"):
        super().__init__()
        self.branch = nn.Sequential(
            ConvBN(in_channels, out_channels, 3, stride, device=device, dtype=dtype),
            ConvBN(out_channels, out_channels, 3, 1, relu=False, device=device, dtype=dtype),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = ConvBN(in_channels, out_channels, 1, stride, relu=False,
                                   device=device, dtype=dtype)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.branch(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 in its CIFAR form (3x3 stem, no max-pool); `width` scales every stage
    (64 is the standard network) and `pool` is the final average-pooling window."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64,
                 pool: int = 4, device=None, dtype="float32"):
        super().__init__()
        check_positive_ints(self, num_classes=num_classes, in_channels=in_channels, width=width,
                      pool=pool)
        widths = [width, 2 * width, 4 * width, 8 * width]
        blocks, channels = [], width
        for stage, out in enumerate(widths):
            for k in range(2):
                stride = 2 if stage > 0 and k == 0 else 1
                blocks.append(BasicBlock(channels, out, stride, device=device, dtype=dtype))
                channels = out
        self.net = nn.Sequential(
            ConvBN(in_channels, width, 3, 1, device=device, dtype=dtype),
            *blocks,
            nn.AvgPool2d(pool),
            nn.Flatten(),
            nn.Linear(widths[-1], num_classes, device=device, dtype=dtype),
        )

    def forward(self, x):
        return self.net(x)


class SmallResNet(nn.Module):
    """A small residual conv net for tiny images such as the 8 x 8 scikit-learn digits:
    stem, one residual block, 2x2 max-pool, a wider ConvBN, global average pool, linear."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16,
                 image_size: int = 8, device=None, dtype="float32"):
        super().__init__()
        check_positive_ints(self, in_channels=in_channels, num_classes=num_classes,
                      width=width, image_size=image_size)

        def block(a, b):
            return ConvBN(a, b, 3, 1, device=device, dtype=dtype)

        self.net = nn.Sequential(
            block(in_channels, width),
            nn.Residual(nn.Sequential(block(width, width), block(width, width))),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.AvgPool2d(image_size // 2),
            nn.Flatten(),
            nn.Linear(2 * width, num_classes, device=device, dtype=dtype),
        )

    def forward(self, x):
        return self.net(x)
