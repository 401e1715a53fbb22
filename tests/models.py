"""Tiny models for the tests, built in code. `tracked(...)` keeps each built model in BUILT for inspection."""
import os
import signal
from dataclasses import dataclass

import torch
from torch import nn

BUILT = {}  # name -> the last model a run built through tracked()


def tracked(name: str, cls: str, **kwargs):
    """Build tests.models.<cls>(**kwargs) and remember it as BUILT[name]."""
    model = globals()[cls](**kwargs)
    BUILT[name] = model
    return model


class MLP(nn.Module):
    """fc1 -> tanh -> fc2 -> tanh -> head."""

    def __init__(self, d_in=6, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act1 = nn.Tanh()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.act2 = nn.Tanh()
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


class BatchStandardized(MLP):
    """An MLP whose first layer's output is standardized across the batch: one sample alone is an error."""

    def forward(self, x):
        if x.shape[0] < 2:
            raise RuntimeError("BatchStandardized needs at least two samples a batch")
        h = self.fc1(x)
        return self.head(self.act1((h - h.mean(0)) / h.std(0)))


class CNN(nn.Module):
    """conv1 -> relu -> conv2 -> relu -> pool -> fc; `inplace` makes the ReLUs in place."""

    def __init__(self, inplace=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu1 = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=inplace)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(24, 5)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.conv1(x))))
        return self.fc(self.pool(x).flatten(1))


class Pair(nn.Module):
    """Returns a tuple: (x @ W, tanh(x @ W))."""

    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.tanh(h)


class Reuse(nn.Module):
    """`shared` is called twice per forward; `pair` returns a tuple; the model returns a dict."""

    def __init__(self, d=4):
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.pair = Pair(d)

    def forward(self, x, scale=1.0):
        a = self.shared(x)
        b = self.shared(torch.relu(a)) * scale
        h, t = self.pair(b)
        return {"h": h, "t": t}


@dataclass
class Out:
    """A ModelOutput-like dataclass output."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(x)
        return Out(logits=h * 2, hidden=h)


class Broken(nn.Module):
    """Raises in forward after its first layer ran (hooks must still be removed)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc(x)
        raise RuntimeError("model exploded")


class NotTensor(nn.Module):
    """`meta` returns a string, not a tensor."""

    def __init__(self):
        super().__init__()
        self.meta = Meta()

    def forward(self, x):
        self.meta(x)
        return x


class Meta(nn.Module):
    def forward(self, x):
        return "a string"


def boom_loss(output, batch):
    """A loss whose backward fails: a hook-free way to break the backward pass."""
    return BoomGrad.apply(output.sum())


class BoomGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward exploded")


def double(t, factor=2.0):
    """A user edit: fn(tensor, **args) -> tensor."""
    return t * factor


class Slashed(nn.Module):
    """A child whose name holds '/', which cannot be a store key."""

    def __init__(self):
        super().__init__()
        self.add_module("a/b", nn.Linear(4, 4))

    def forward(self, x):
        return getattr(self, "a/b")(x)


class Ragged(torch.utils.data.Dataset):
    """Items whose length changes: 3 values, then 4."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.ones(3 + i)


class Slow(nn.Module):
    """A CNN that sleeps in every forward, so a run can be killed part-way."""

    def __init__(self, seconds=0.03):
        super().__init__()
        self.seconds = seconds
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        import time

        time.sleep(self.seconds)
        h = torch.tanh(self.conv(x))
        return self.fc(h.flatten(1))


def no_reduce(output, batch):
    """A loss that forgets to reduce."""
    return output * 2


def explode(t):
    """A user edit that raises."""
    raise ValueError("edit exploded")


def first_logit_sum(output, batch):
    """A user loss: fn(output, batch) -> scalar."""
    return output[:, 0].sum() * 3


class RandomItems(torch.utils.data.Dataset):
    """Items of `dim` values drawn from torch's global RNG in __getitem__ (a random augmentation).
    With HOOKRUN_TEST_STOP_AT=i in the environment, loading item i sends SIGTERM to this process once."""

    def __init__(self, n=24, dim=6):
        self.n, self.dim = n, dim

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import os
        import signal

        if os.environ.get("HOOKRUN_TEST_STOP_AT") == str(i):
            del os.environ["HOOKRUN_TEST_STOP_AT"]
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.randn(self.dim) + i


class TupleItems(torch.utils.data.Dataset):
    """(x, label) pairs, as image datasets yield them."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.ones(6) * i, i % 3


class NoneItems(torch.utils.data.Dataset):
    """A dataset whose items are None (a broken loader)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return None


class EmptyItems(torch.utils.data.Dataset):
    """A dataset with no items."""

    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


class RandomStream(torch.utils.data.IterableDataset):
    """RandomItems without len(): the same items, read in order."""

    def __init__(self, n=24, dim=6):
        self.items = RandomItems(n, dim)

    def __iter__(self):
        return (self.items[i] for i in range(len(self.items)))


class KilledOnRank(MLP):
    """The MLP, whose process kills itself (SIGKILL) at its forward number HOOKRUN_TEST_KILL_AT when its torchrun
    RANK is HOOKRUN_TEST_KILL_RANK: one rank of a data-parallel run dies mid-run, as on a lost node."""

    calls = 0

    def forward(self, x):
        KilledOnRank.calls += 1
        if os.environ.get("RANK") == os.environ.get("HOOKRUN_TEST_KILL_RANK", "-") and \
                KilledOnRank.calls == int(os.environ.get("HOOKRUN_TEST_KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
