"""What a hook keeps of a tensor before it is stored: `select` along a dim, `reduce` over dims, cast `dtype`.

Applied to the captured copy only, never to what flows on in the model.

    dtype: float16
    reduce: {op: mean, dims: spatial}          # [N, C, H, W] -> [N, C]
    select: {dim: 1, index: -1}                # last token of [N, T, D] -> [N, D]
"""
from __future__ import annotations

from typing import List, Optional

import torch

from hookrun.config import as_list, to_plain

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
}
REDUCE_OPS = ("mean", "max", "min", "sum", "norm")
DIM_ALIASES = {"channel": [1], "sequence": [1], "hidden": [-1], "spatial": "spatial"}


def check_spec(key: str, hook) -> List[str]:
    """Problems with a hook's dtype / reduce / select settings."""
    problems = []
    if hook.dtype is not None and hook.dtype not in DTYPES:
        problems.append(f"{key}.dtype: {hook.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    reduce = to_plain(hook.reduce)
    if reduce is not None:
        if not isinstance(reduce, dict) or reduce.get("op") not in REDUCE_OPS:
            problems.append(f"{key}.reduce: {reduce!r} needs op in {REDUCE_OPS} and dims, e.g. {{op: mean, dims: spatial}}")
        else:
            for d in as_list(reduce.get("dims")) or [None]:
                if not (isinstance(d, int) and d != 0) and d not in DIM_ALIASES:
                    problems.append(f"{key}.reduce.dims: {d!r} is not a dim; give ints >= 1 (0 is the sample axis) "
                                    f"or one of {', '.join(DIM_ALIASES)}")
    select = to_plain(hook.select)
    if select is not None:
        if not isinstance(select, dict) or "index" not in select or not isinstance(select.get("dim", 1), int):
            problems.append(f"{key}.select: {select!r} needs dim and index, e.g. {{dim: 1, index: [0, 2]}}")
        elif select.get("dim", 1) == 0:
            problems.append(f"{key}.select.dim: 0 is the sample axis; select along dim >= 1 (use data.max_samples for samples)")
    return problems


class Shrink:
    """Callable turning a detached capture into what is stored; identity when nothing is set."""

    def __init__(self, dtype: Optional[str] = None, reduce=None, select=None):
        self.dtype = DTYPES[dtype] if dtype else None
        self.reduce = to_plain(reduce)
        self.select = to_plain(select)

    def _dims(self, t: torch.Tensor) -> List[int]:
        dims: List[int] = []
        for d in as_list(self.reduce.get("dims")):
            alias = DIM_ALIASES.get(d, [d]) if isinstance(d, str) else [d]
            dims += list(range(2, t.dim())) if alias == "spatial" else alias
        return sorted({d % t.dim() for d in dims})

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.select:
            index = self.select["index"]
            dim = self.select.get("dim", 1)
            if isinstance(index, dict):
                idx = [slice(None)] * t.dim()
                idx[dim] = slice(index.get("start"), index.get("stop"), index.get("step"))
                t = t[tuple(idx)]
            elif isinstance(index, list):
                t = t.index_select(dim, torch.as_tensor(index, device=t.device))
            else:
                t = t.select(dim, index)
        if self.reduce and t.dim() > 1:
            op, dims = self.reduce["op"], self._dims(t)
            if op == "mean":
                t = t.float().mean(dims) if not t.is_floating_point() else t.mean(dims)
            elif op == "sum":
                t = t.sum(dims)
            elif op == "norm":
                t = torch.linalg.vector_norm(t.float(), dim=dims)
            else:
                t = t.amax(dims) if op == "max" else t.amin(dims)
        if self.dtype is not None:
            t = t.to(self.dtype)
        return t
