"""The models of the bundled experiments: the seeds' networks, built exactly as the articles build them."""
import torch
from torch import nn


class ConvFmapsNet(nn.Module):
    """Seed 003: Conv2d(1, 2, 3) with kernel 0 all ones, kernel 1 all twos, bias 0, then MaxPool2d(2, 2)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3)
        self.pool1 = nn.MaxPool2d(2, 2)
        with torch.no_grad():
            self.conv1.weight[0].fill_(1)
            self.conv1.weight[1].fill_(2)
            self.conv1.bias.zero_()

    def forward(self, x):
        return self.pool1(self.conv1(x))


class PoolNet(nn.Module):
    """Seed 001: Conv2d(3, 8, 2) -> ReLU -> AdaptiveAvgPool2d((4, 4)) -> Linear(128, 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 2)
        self.pool = nn.AdaptiveAvgPool2d((4, 4))
        self.fc = nn.Linear(8 * 4 * 4, 1)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        x = self.pool(x)
        return self.fc(x.view(x.shape[0], -1))


class AddOne(nn.Module):
    """Seed 002: a module returning x + 1."""

    def forward(self, x):
        return x + 1


class AddConst(nn.Module):
    """y = x + value, as a module so hooks can name it."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x + self.value


class Pow(nn.Module):
    """y = x ** exponent, as a module so hooks can name it."""

    def __init__(self, exponent: float):
        super().__init__()
        self.exponent = exponent

    def forward(self, x):
        return torch.pow(x, self.exponent)


class ShiftSquareMean(nn.Module):
    """Seeds 000 and 004: y = x + 2 (module `shift`), z = mean(y ** 2)."""

    def __init__(self):
        super().__init__()
        self.shift = AddConst(2.0)

    def forward(self, x):
        y = self.shift(x)
        return torch.mean(torch.pow(y, 2))


class SquareMean(nn.Module):
    """Seed 003: y = x ** 2 (module `square`), z = mean(y)."""

    def __init__(self):
        super().__init__()
        self.square = Pow(2.0)

    def forward(self, x):
        return torch.mean(self.square(x))


class Multiply(nn.Module):
    """Seed 001: c = a * b."""

    def forward(self, a, b):
        return a * b


def constant_linear(in_features: int, out_features: int, value: float, bias: bool = False) -> nn.Linear:
    """Seed 000: nn.Linear with every parameter set to `value` (torch.nn.init.constant_)."""
    model = nn.Linear(in_features, out_features, bias=bias)
    for param in model.parameters():
        nn.init.constant_(param, value)
    return model
