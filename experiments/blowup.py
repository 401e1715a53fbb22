"""Finding where gradients explode: a deep linear network initialised with too large a gain, fed batches whose scale
grows; the analysis prints each layer's gradient norm per batch and names the first NaN/inf (cap.first_nonfinite()).

    python -m hookrun +experiment=blowup
    python -m hookrun.experiments.blowup outputs/DATE/TIME

Every layer multiplies a vector's norm by exactly `gain` (an orthogonal matrix times the gain), so the forward
activations grow `gain`-fold per layer and the gradients of the energy 0.5 |output|^2 another `gain`-fold per layer
going back: the gradient at fc_k's output has norm |x| gain^(2 depth - k). Batch b is the data scaled by
`growth`^b (unnormalised inputs). The forward pass stays finite; the gradients overflow float32 first in batch 3, at
fc2's output gradient (the first layer, going back, where they pass 3.4e38), and are NaN from there back.
"""
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from hookrun.experiments._cli import open_run


class DeepLinear(nn.Sequential):
    """`depth` bias-free Linear layers fc1..fc<depth> of `width`, each an orthogonal matrix times `gain` (seeded)."""

    def __init__(self, depth: int = 8, width: int = 16, gain: float = 30.0, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        layers = OrderedDict()
        for k in range(1, depth + 1):
            layer = nn.Linear(width, width, bias=False)
            q, _ = torch.linalg.qr(torch.randn(width, width, generator=gen))
            with torch.no_grad():
                layer.weight.copy_(q * gain)
            layers[f"fc{k}"] = layer
        super().__init__(layers)


class Unnormalised(torch.utils.data.Dataset):
    """`n` vectors of `width` standard normal values (seeded); sample i is scaled by growth ** (i // per_batch), so
    each batch is `growth` times larger than the one before."""

    def __init__(self, n: int = 16, width: int = 16, per_batch: int = 4, growth: float = 1e7, seed: int = 0):
        x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed))
        self.items = x * growth ** (torch.arange(n) // per_batch).double().unsqueeze(1).float()

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def energy(output, batch):
    """0.5 |output|^2 summed over the batch, in float64 (the loss itself never overflows; its gradient is the
    float32 output)."""
    return 0.5 * output.double().pow(2).sum()


def main(argv=None):
    cap = open_run(argv)
    index = cap.index
    grads = index[index.hook == "grads"]
    table = grads.pivot_table(index="layer", columns="batch", values="norm", sort=False)
    table = table.loc[sorted(table.index, key=lambda name: int(name[2:]))]
    print("gradient norm at each layer's output (rows) per batch (columns); NaN: the gradient holds no finite "
          "value\n" + table.to_string(float_format=lambda v: f"{v:.3g}"))
    bad = index[(index.nan_count > 0) | (index.inf_count > 0)]
    print(f"\n{len(bad)} of {len(index)} captures hold NaN or inf, in batches {sorted(set(bad.batch))}")
    hit = cap.first_nonfinite()
    print(f"first: {hit}")
    if hit is not None and hit.sample is not None:
        record = cap.load(hook=hit.hook, layer=hit.layer, role=hit.role)[cap.samples.set_index("sample").loc[
            hit.sample, "row"]]
        print(f"sample {hit.sample}'s {hit.layer} {hit.role}: {np.isinf(record).sum()} inf, {np.isnan(record).sum()} "
              f"NaN of {record.size} values")


if __name__ == "__main__":
    main()
