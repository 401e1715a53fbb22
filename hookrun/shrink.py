"""What a hook keeps of a tensor before it is stored: `select` along a dim, `reduce` over dims, cast `dtype`.

Applied to the captured copy only, never to what flows on in the model.

    dtype: float16
    reduce: {op: mean, dims: spatial}          # [N, C, H, W] -> [N, C]
    select: {dim: 1, index: -1}                # column -1 of [N, T, D] -> [N, D] (a pad under right padding)
    select: {positions: last}                  # each sequence's last real token [N, T, D] -> [N, D]
    select: {positions: [0, -1], heads: [0]}   # real positions and attention heads (hookrun.tokens)
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
    if isinstance(select, dict) and ("positions" in select or "heads" in select):
        from hookrun.tokens import check_positions

        if "positions" in select:
            problems += check_positions(f"{key}.select.positions", select["positions"])
        heads = select.get("heads", [0])
        if not all(isinstance(h, int) and not isinstance(h, bool) for h in as_list(heads)) or not as_list(heads):
            problems.append(f"{key}.select.heads: {heads!r} must be a head index or a list of them, e.g. [0, 3]")
        select = {k: v for k, v in select.items() if k not in ("positions", "heads")} or None
    if select is not None:
        if not isinstance(select, dict) or "index" not in select or not isinstance(select.get("dim", 1), int):
            problems.append(f"{key}.select: {select!r} needs dim and index, e.g. {{dim: 1, index: [0, 2]}}, "
                            "or positions: last | first | [ints] (real tokens of each sequence)")
        elif select.get("dim", 1) == 0:
            problems.append(f"{key}.select.dim: 0 is the sample axis; select along dim >= 1 (use data.max_samples for samples)")
    return problems


class Shrink:
    """Callable turning a detached capture into what is stored; identity when nothing is set."""

    def __init__(self, dtype: Optional[str] = None, reduce=None, select=None):
        self.dtype = DTYPES[dtype] if dtype else None
        self.reduce = to_plain(reduce)
        select = dict(to_plain(select) or {})
        self.positions = select.pop("positions", None)  # applied by the hook (hookrun.tokens): needs the batch
        self.heads = select.pop("heads", None)
        self.select = select or None

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
