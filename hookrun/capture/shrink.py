"""What a hook keeps of a tensor before it is stored: `select` along a dim, `reduce` over dims, cast `dtype`.

Applied to the captured copy only, never to what flows on in the model.

    dtype: float16
    reduce: {op: mean, dims: spatial}          # [N, C, H, W] -> [N, C]
    select: {dim: 1, index: -1}                # column -1 of [N, T, D] -> [N, D] (a pad under right padding)
    select: {positions: last}                  # each sequence's last real token [N, T, D] -> [N, D]
    select: {positions: [0, -1], heads: [0]}   # real positions and attention heads (hookrun.capture.tokens)
    select: {positions: generated}             # a generate run: the rows of those tokens only (hookrun.methods.generation)
"""
from __future__ import annotations

from typing import List, Optional

import torch

from hookrun.config import schema
from hookrun.config.checks import as_list, check_choice, is_int

DTYPES = {name: getattr(torch, name) for name in schema.DTYPES}  # the schema's names -> torch dtypes
REDUCE_OPS = ("mean", "max", "min", "sum", "norm")
DIM_ALIASES = {"channel": [1], "sequence": [1], "hidden": [-1], "spatial": "spatial"}


def check_spec(key: str, hook) -> List[str]:
    """Problems with a hook's dtype / reduce / select settings."""
    problems = []
    if hook.dtype is not None:
        problems += check_choice(f"{key}.dtype", hook.dtype, DTYPES, hint=False)
    reduce = hook.reduce
    if reduce is not None:
        if not isinstance(reduce, dict) or reduce.get("op") not in REDUCE_OPS:
            problems.append(f"{key}.reduce: {reduce!r} needs op in {REDUCE_OPS} and dims, e.g. {{op: mean, dims: spatial}}")
        else:
            for d in as_list(reduce.get("dims")) or [None]:
                if not (isinstance(d, int) and d != 0) and d not in DIM_ALIASES:
                    problems.append(f"{key}.reduce.dims: {d!r} is not a dim; give ints >= 1 (0 is the sample axis) "
                                    f"or one of {', '.join(DIM_ALIASES)}")
    select = hook.select
    if isinstance(select, dict) and ("positions" in select or "heads" in select):
        from hookrun.capture.tokens import check_positions

        if "positions" in select:
            problems += check_positions(f"{key}.select.positions", select["positions"], sets=True)  # sets: generate
        heads = select.get("heads", [0])
        if not all(is_int(h) for h in as_list(heads)) or not as_list(heads):
            problems.append(f"{key}.select.heads: {heads!r} must be a head index or a list of them, e.g. [0, 3]")
        select = {k: v for k, v in select.items() if k not in ("positions", "heads")} or None
    if select is not None:
        if not isinstance(select, dict) or "index" not in select or not is_int(select.get("dim", 1)):
            problems.append(f"{key}.select: {select!r} needs dim and index, e.g. {{dim: 1, index: [0, 2]}}, "
                            "or positions: last | first | [ints] (real tokens of each sequence)")
        elif select.get("dim", 1) == 0:
            problems.append(f"{key}.select.dim: 0 is the sample axis; select along dim >= 1 (use data.max_samples for samples)")
        else:
            problems += _index_problems(f"{key}.select.index", select["index"])
    return problems


def _index_problems(key: str, index) -> List[str]:
    """Problems with a select index: an int, a non-empty list of ints, or {start, stop, step} with step >= 1."""
    if is_int(index) or (isinstance(index, list) and index and all(is_int(i) for i in index)):
        return []
    if isinstance(index, dict) and set(index) <= {"start", "stop", "step"} and \
            all(v is None or is_int(v) for v in index.values()):
        step = index.get("step")
        return [] if step is None or step >= 1 else [f"{key}: step {step} must be >= 1 (a slice keeps the order)"]
    return [f"{key}: {index!r} is not an index; give an int, a non-empty list of ints or {{start, stop, step}}"]


def _dims_text(n: int) -> str:
    """The dims of an n-D capture besides axis 0, for messages: `1 (or -1)`, `1..3 (or -3..-1)`, `none`."""
    if n < 2:
        return "none"
    return "1 (or -1)" if n == 2 else f"1..{n - 1} (or -{n - 1}..-1)"


class ShrinkError(ValueError):
    """A dtype / reduce / select setting that does not fit the capture it meets; `setting` names the key
    under the hook (select.dim, reduce.dims, dtype, ...)."""

    def __init__(self, setting: str, message: str):
        self.setting = setting
        super().__init__(message)


class Shrink:
    """Callable turning a detached capture into what is stored; identity when nothing is set."""

    def __init__(self, dtype: Optional[str] = None, reduce=None, select=None):
        self.dtype = DTYPES[dtype] if dtype else None
        self.reduce = reduce
        select = dict(select or {})
        self.positions = select.pop("positions", None)  # applied by the hook (hookrun.capture.tokens): needs the batch
        self.heads = select.pop("heads", None)
        self.select = select or None

    def _dims(self, t: torch.Tensor) -> List[int]:
        """The reduce dims of `t`, each checked: inside its shape and never axis 0 (the samples)."""
        n, dims = t.dim(), []
        valid = _dims_text(n)
        for d in as_list(self.reduce.get("dims")):
            if d == "spatial" and n < 3:
                raise ShrinkError("reduce.dims", f"spatial means dims 2.. of an [N, C, H, W]-like capture, and a "
                                  f"{n}-D capture of shape {list(t.shape)} has none; give its dims: {valid}")
            for i in (range(2, n) if d == "spatial" else DIM_ALIASES.get(d, [d])):
                if not -n <= i < n or i % n == 0:
                    name = f"{d} (dim {i})" if isinstance(d, str) else str(d)
                    raise ShrinkError("reduce.dims", f"{name} is not a dim of a {n}-D capture of shape "
                                      f"{list(t.shape)} besides axis 0 (the samples); its dims are {valid}")
                dims.append(i % n)
        return sorted(set(dims))

    def _select(self, t: torch.Tensor) -> torch.Tensor:
        index, d = self.select["index"], self.select.get("dim", 1)
        n = t.dim()
        if not -n <= d < n or d % n == 0:
            raise ShrinkError("select.dim", f"{d} is not a dim of a {n}-D capture of shape {list(t.shape)} besides "
                              f"axis 0 (the samples); its dims are {_dims_text(n)}")
        size = t.shape[d]
        if isinstance(index, dict):
            idx = [slice(None)] * n
            idx[d] = slice(index.get("start"), index.get("stop"), index.get("step"))
            kept = t[tuple(idx)]
            if kept.shape[d] == 0:
                raise ShrinkError("select.index", f"{index} keeps nothing of dim {d} (size {size}) of a capture of "
                                  f"shape {list(t.shape)}; give start/stop inside 0..{size}")
            return kept
        wanted = index if isinstance(index, list) else [index]
        outside = [i for i in wanted if not -size <= i < size]
        if outside:
            raise ShrinkError("select.index", f"{outside if isinstance(index, list) else index} is outside dim {d} "
                              f"(size {size}) of a capture of shape {list(t.shape)}; use indices in 0..{size - 1} "
                              f"(or -{size}..-1)")
        if isinstance(index, list):
            return t.index_select(d, torch.as_tensor(index, dtype=torch.long, device=t.device))
        return t.select(d, index)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.select:
            t = self._select(t)
        if self.reduce:
            if t.dim() < 2:
                raise ShrinkError("reduce", f"a capture of shape {list(t.shape)} has no dim besides axis 0 (the "
                                  "samples) to reduce; drop reduce for it (a separate hook for these layers)")
            op, dims = self.reduce["op"], self._dims(t)
            if op == "mean":
                t = t.float().mean(dims) if not (t.is_floating_point() or t.is_complex()) else t.mean(dims)
            elif op == "sum":
                t = t.sum(dims)
            elif op == "norm":
                t = torch.linalg.vector_norm(t if t.is_floating_point() or t.is_complex() else t.float(), dim=dims)
            elif t.is_complex():
                raise ShrinkError("reduce.op", f"{op} of a complex capture has no order; use mean, sum or norm")
            else:
                t = t.amax(dims) if op == "max" else t.amin(dims)
        if self.dtype is not None and t.is_complex():
            raise ShrinkError("dtype", f"{str(self.dtype).replace('torch.', '')} of a complex capture "
                              f"({str(t.dtype).replace('torch.', '')}) would keep its real part only; drop dtype "
                              "(complex captures are stored as they are)")
        if self.dtype is not None:
            t = t.to(self.dtype)
        return t
