"""Where the model runs: device maps (models larger than one device, CPU and disk offload) checked before the model
is built, and the device a dispatched model takes its inputs on.

    problems = device_map_problems(cfg.model)   # model.device_map / model.max_memory naming devices that do not exist
    model = instantiate(with_plain_maps(cfg.model))   # from_pretrained(..., device_map=..., max_memory=...)
    if dispatched(model):                       # accelerate placed it (hf_device_map): it is left where it is
        device = input_device(model)            # the embedding's execution device: the batches go there

A model loaded with `device_map` (transformers' `from_pretrained`, through accelerate) runs each block on its own
device, or streams offloaded blocks from CPU memory or disk onto the execution device; the run never moves it.
Hooks see each layer's tensors on the device the layer runs on; the captures are copied to the host as always.
"""
from __future__ import annotations

from typing import List, Optional

import torch

MAP_KEYS = ("device_map", "max_memory")  # model config keys that name devices
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # device_map strings from_pretrained takes
OFFLOAD = ("cpu", "disk")  # device map values that keep weights off the execution device
FIX = "name devices this machine has: cpu, disk{cuda}{mps}, or use device_map=auto"


def _cuda_names() -> List[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _mps() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _fix() -> str:
    cuda = _cuda_names()
    return FIX.format(cuda=f", {', '.join(cuda)} (or their numbers 0..{len(cuda) - 1})" if cuda else "",
                      mps=", mps" if _mps() else "")


def device_missing(value) -> Optional[str]:
    """Why a device map value (0, "cuda:1", "cpu", "disk", "mps") names no device of this machine, or None."""
    if isinstance(value, bool):
        return f"{value!r} is not a device"
    if isinstance(value, int):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return None if 0 <= value < count else f"{value} (cuda:{value}) but this machine has {count} CUDA device(s)"
    name = str(value)
    if name in OFFLOAD or name == "meta":
        return None
    if name in ("cuda", *_cuda_names()):
        return None if torch.cuda.is_available() else f"{name!r} but CUDA is not available here"
    if name.startswith("cuda:"):
        return f"{name!r} but this machine has {len(_cuda_names())} CUDA device(s)"
    if name == "mps":
        return None if _mps() else "'mps' but MPS is not available here"
    return f"{name!r} is not a device"


def device_map_problems(model_cfg) -> List[str]:
    """Problems with `model.device_map` and `model.max_memory` (a dict naming devices, or a strategy), found before
    the model is built: every key of the map whose device this machine does not have is named."""
    if not isinstance(model_cfg, dict):
        return []
    problems = []
    device_map = model_cfg.get("device_map")
    if isinstance(device_map, str) and device_map not in STRATEGIES and device_missing(device_map):
        problems.append(f"model.device_map: {device_map!r} is neither {', '.join(STRATEGIES)} nor a device this "
                        f"machine has ({device_missing(device_map)}); {_fix()}")
    elif isinstance(device_map, dict):
        for key, value in device_map.items():
            why = device_missing(value)
            if why:
                problems.append(f"model.device_map.{key or '<whole model>'}: {why}; {_fix()}")
    elif device_map is not None and not isinstance(device_map, (str, int)):
        problems.append(f"model.device_map: {device_map!r} must be auto, balanced, sequential, a device, or a dict "
                        "of module name -> device")
    max_memory = model_cfg.get("max_memory")
    if isinstance(max_memory, dict):
        for key in max_memory:
            why = device_missing(int(key) if str(key).isdigit() else key)
            if why:
                problems.append(f"model.max_memory.{key}: {why}; {_fix()}")
    return problems


def with_plain_maps(model_cfg):
    """The model config with Hydra told to pass device maps as plain dicts (transformers checks `isinstance(dict)`;
    Hydra would hand it a DictConfig)."""
    if isinstance(model_cfg, dict) and any(isinstance(model_cfg.get(k), dict) for k in MAP_KEYS) \
            and "_convert_" not in model_cfg:
        return {**model_cfg, "_convert_": "all"}
    return model_cfg


def offload_note(model_cfg, model: torch.nn.Module) -> Optional[str]:
    """The line to log when the model config asks for offload (cpu or disk named in model.device_map or
    model.max_memory, or an offload_folder) but the map placed every module on an execution device: nothing is
    offloaded, so the run is no slower and no smaller than without the map; None otherwise."""
    if not isinstance(model_cfg, dict):
        return None
    named = []
    for key in MAP_KEYS:
        value = model_cfg.get(key)
        values = list(value.values()) + list(value) if isinstance(value, dict) else [value]
        named += [str(v) for v in values if str(v) in OFFLOAD]
    if not named and not model_cfg.get("offload_folder"):
        return None
    placed = dict(getattr(model, "hf_device_map", None) or {})
    accelerator = bool(_cuda_names()) or _mps()  # without one, cpu is where the model runs, not an offload
    if any(str(v) == "disk" or (str(v) == "cpu" and accelerator) for v in placed.values()):
        return None
    where = sorted({str(v) for v in placed.values()}) or ["one device"]
    return (f"model.device_map: offload asked for ({', '.join(sorted(set(named))) or 'offload_folder'}), but every "
            f"module was placed on {', '.join(where)}: nothing is offloaded (the model fits; lower model.max_memory "
            "to offload some of it)")


def dispatched(model: torch.nn.Module) -> bool:
    """Whether accelerate placed the model across devices or offloaded it (it has an `hf_device_map`)."""
    return bool(getattr(model, "hf_device_map", None))


def _execution_device(module: torch.nn.Module) -> Optional[torch.device]:
    """The device accelerate runs `module` on (its AlignDevicesHook's execution device), or None."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return None


def _map_device(value, device_map: dict) -> torch.device:
    """The execution device of a device map value: offloaded ("cpu", "disk") weights run on the map's first other
    device (accelerate's main device), else the CPU."""
    if value in OFFLOAD:
        main = next((v for v in device_map.values() if v not in OFFLOAD), "cpu")
        value = main
    return torch.device(f"cuda:{value}" if isinstance(value, int) else value)


def input_device(model: torch.nn.Module) -> torch.device:
    """The device a dispatched model takes its inputs on: where its input embedding runs (accelerate's hook on it
    or on the nearest module above it; the device map's rule for a model without hooks)."""
    device_map = dict(model.hf_device_map)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    name = next((n for n, m in model.named_modules() if m is embedding), None) if embedding is not None else None
    if name is not None:
        parts = name.split(".") if name else []
        for i in range(len(parts), -1, -1):  # the embedding, then each module above it
            device = _execution_device(model.get_submodule(".".join(parts[:i])))
            if device is not None:
                return device
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len,
                    default=None)
        if owner is not None:
            return _map_device(device_map[owner], device_map)
    return _map_device(next(iter(device_map.values())), device_map)


def offloaded_parameters(model: torch.nn.Module, names) -> List[str]:
    """Those of the parameter `names` that an offloaded model keeps off any device (on "meta" between forwards):
    their gradients are never accumulated."""
    params = dict(model.named_parameters())
    return [n for n in names if n in params and params[n].device.type == "meta"]
