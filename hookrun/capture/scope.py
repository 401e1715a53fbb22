"""HookScope: a temporary group of torch hooks on a model, removed as one when its `with` block ends (also on an
error), the one place outside HookSet where hookrun registers a hook (as baukit's nethook.Trace and TransformerLens's
hooks() context: nothing can leak).

    with HookScope() as scope:
        scope.forward(module, fn)                     # Module.register_forward_hook(fn, **kwargs)
        scope.pre(model, fn, with_kwargs=True)        # Module.register_forward_pre_hook
        scope.value(module, point, fn)                # fn(value at an anatomy Point) -> the value, or a new one
        out = model(**inputs)                         # every hook above is gone after the block

A scope that outlives one block (the lens's hooks, armed each forward) is removed with `scope.remove()`; it can be
filled again after. Each registration returns the torch handle, so one hook can also go on its own.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn

from hookrun.capture.anatomy import Point

Fn = Callable[[torch.Tensor], Optional[torch.Tensor]]


class HookScope:
    """A group of hooks removed together (see the module's docstring); `len(scope)` is how many it holds."""

    def __init__(self):
        self.handles: List = []

    def __enter__(self) -> "HookScope":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self.handles)

    def remove(self) -> None:
        """Every hook of the scope removed (the last registered first); the scope is empty and usable again."""
        handles, self.handles = self.handles, []
        for h in reversed(handles):
            h.remove()

    def add(self, handle):
        """A handle made elsewhere (hookrun.capture.hooks) joins the group; returned."""
        self.handles.append(handle)
        return handle

    # -- the torch registrations ----------------------------------------------------------------------------------
    def forward(self, module: nn.Module, fn, **kwargs):
        """Module.register_forward_hook(fn, **kwargs) (with_kwargs, prepend, always_call)."""
        return self.add(module.register_forward_hook(fn, **kwargs))

    def pre(self, module: nn.Module, fn, **kwargs):
        """Module.register_forward_pre_hook(fn, **kwargs)."""
        return self.add(module.register_forward_pre_hook(fn, **kwargs))

    def backward(self, module: nn.Module, fn, **kwargs):
        """Module.register_full_backward_hook(fn, **kwargs)."""
        return self.add(module.register_full_backward_hook(fn, **kwargs))

    def backward_pre(self, module: nn.Module, fn, **kwargs):
        """Module.register_full_backward_pre_hook(fn, **kwargs)."""
        return self.add(module.register_full_backward_pre_hook(fn, **kwargs))

    def tensor(self, t: torch.Tensor, fn):
        """Tensor.register_hook(fn): fn(grad) when t's gradient is computed."""
        return self.add(t.register_hook(fn))

    def accumulated(self, param: torch.Tensor, fn):
        """Tensor.register_post_accumulate_grad_hook(fn): fn(param) after param.grad is accumulated."""
        return self.add(param.register_post_accumulate_grad_hook(fn))

    # -- a value at an anatomy Point -------------------------------------------------------------------------------
    def value(self, module: nn.Module, point: Point, fn: Fn, shape: Optional[Callable[[], object]] = None,
              error: Optional[type] = None, name: str = ""):
        """A hook on `module` at `point` (its side: a pre-hook for an input, a forward hook for an output) calling
        fn(value), value = point.get(the tensor point.read finds, shape()); what fn returns replaces the value
        (written back with point.put and point.write) unless it is None or the value itself. `shape`: the batch's
        (B, T) for a point of flattened tokens (None: the tensor as it is); `error`: the exception class raised,
        naming the site `name`, when the module gives no tensor there (None: whatever the read raises)."""
        if shape is None:
            def apply(t):
                value = point.get(t)
                new = fn(value)
                return None if new is None or new is value else point.put(t, new)
        else:
            def apply(t):
                value = point.get(t, shape())
                new = fn(value)
                return None if new is None or new is value else point.put(t, new, shape())

        if point.side == "output":
            def after(mod, args, kwargs, out):
                t = point.read(args, kwargs, out)
                if error is not None and not isinstance(t, torch.Tensor):
                    raise error(f"role output: {name} ({type(mod).__name__}) returns {type(out).__name__}, not a "
                                "tensor or a tuple; name the submodule that returns the tensor to patch")
                new = apply(t)
                return None if new is None else point.write(args, kwargs, out, new)
            return self.forward(module, after, with_kwargs=True)

        def before(mod, args, kwargs):
            try:
                t = point.read(args, kwargs)
            except StopIteration:
                if error is None:
                    raise
                raise error(f"role input: {name} ({type(mod).__name__}) was called without a tensor "
                            "argument") from None
            new = apply(t)
            return None if new is None else point.write(args, kwargs, None, new)
        return self.pre(module, before, with_kwargs=True)
