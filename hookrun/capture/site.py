"""Site: where a hook met a tensor, the identity of every capture (and where an edit applies).

    site = Site(hook="acts", layer="fc1", role="output", call=0, batch=2, sample_start=8, sample_stop=12)
    where(site, t)  # 'fc1 output (shape [4, 8] float32) in batch 2 (samples 8..12)', for messages

A capture is stored in the array of its (hook, layer, role); its index row adds the call, the batch
and the sample range, and the native module and role a standard site name (blocks.3.attn) resolved to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class Site:
    """Where a tensor is met: the hook, layer, role, call and the batch's sample range."""

    hook: str
    layer: str
    role: str
    call: int
    batch: int
    sample_start: int
    sample_stop: int
    tokens: object = field(default=None, compare=False, repr=False)  # text batches: a tokens.TokenInfo
    fields: object = field(default=None, compare=False, repr=False)  # the batch's fields by name (a patch's source)
    module: Optional[str] = None  # a standard site's native module and role (None: the layer and role themselves)
    module_role: Optional[str] = None


def where(site: Site, t: torch.Tensor) -> str:
    """`fc1 output (shape [4, 8] float32) in batch 2 (samples 8..12)`: a tensor met at a site, for messages."""
    call = f" call {site.call}" if site.call else ""
    return (f"{site.layer} {site.role}{call} (shape {list(t.shape)} {str(t.dtype).replace('torch.', '')}) in batch "
            f"{site.batch} (samples {site.sample_start}..{site.sample_stop})")
