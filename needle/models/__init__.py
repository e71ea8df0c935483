"""Ready-made models: MLP, ResNet9, ResNet-18, a small digits ResNet, language models."""
from .language_model import LanguageModel
from .mlp import MLP
from .resnet import BasicBlock, ConvBN, ResNet9, ResNet18, SmallResNet

__all__ = ["MLP", "BasicBlock", "ConvBN", "LanguageModel", "ResNet9", "ResNet18", "SmallResNet"]
