"""A user's own networks, given to runs by import path (``tests.user_model:TinyNet``): one that
follows the extractor + head contract of ``client_models.custom``, and some that break it."""

from torch import nn


class TinyNet(nn.Module):
    """One 3x3 convolution, pooled to 4x4, projected to d = 24; a linear head."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        channels = input_shape[0]
        self.extractor = nn.Sequential(nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(),
                                       nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                       nn.Linear(64, 24), nn.ReLU())
        self.head = nn.Linear(24, num_classes)

    def forward(self, x):
        return self.head(self.extractor(x))


class NoHead(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.extractor = nn.Flatten()
        self.classifier = nn.Linear(784, num_classes)


class WrongWidth(TinyNet):
    """Its extractor gives 24 features, its head expects 30."""

    def __init__(self, input_shape, num_classes):
        super().__init__(input_shape, num_classes)
        self.head = nn.Linear(30, num_classes)
