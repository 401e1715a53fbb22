"""The bundled trained models' weights, shipped as files with their sha256 so every CPU reads the same numbers.

Training in float32 is not the same on every CPU (the matmul kernels differ between AVX2, AVX-512 and plain
builds, and 80-1000 Adam steps amplify the last bit), so the docs' numbers would depend on the reader's machine.
The weights of each bundled model at its default settings are in experiments/weights/NAME.safetensors, their
sha256 in experiments/weights/SHA256SUMS (`sha256sum -c SHA256SUMS` checks them too). Other settings train.

    state = weights.shipped("recall-...", train)   # the file's weights (checked), else train()
    python -m hookrun.experiments.weights          # retrain every bundled model here and rewrite the files
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Optional

DIR = Path(__file__).parent / "weights"
SUMS = DIR / "SHA256SUMS"


class WeightsError(RuntimeError):
    """A shipped weights file that does not match its checksum or the tokenizer it was trained with."""


def sums() -> dict:
    """{file name: sha256} from SHA256SUMS (empty when there is none)."""
    if not SUMS.exists():
        return {}
    return {name.lstrip("*"): digest for digest, name in (line.split() for line in SUMS.read_text().splitlines()
                                                          if line.strip())}


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load(name: str, vocab: Optional[str] = None) -> Optional[dict]:
    """The state dict of DIR/name.safetensors, its sha256 checked against SHA256SUMS and, given `vocab` (the
    tokenizer's vocab_digest), the tokenizer it was trained with; None when no such file is shipped."""
    from safetensors import safe_open
    from safetensors.torch import load as load_bytes

    path = DIR / f"{name}.safetensors"
    if not path.exists():
        return None
    data = path.read_bytes()
    expected = sums().get(path.name)
    if expected != digest(data):
        raise WeightsError(f"{path}: sha256 {digest(data)[:16]}... is not the {expected and expected[:16]}... of "
                           f"{SUMS.name}; the file is damaged: reinstall hookrun, or retrain with "
                           "`python -m hookrun.experiments.weights`")
    if vocab is not None:
        with safe_open(str(path), "pt") as f:
            trained_with = (f.metadata() or {}).get("vocab")
        if trained_with != vocab:
            raise WeightsError(f"{path}: trained with a tokenizer of vocab {trained_with}, but the bundled tokenizer "
                               f"trains to {vocab} with this `tokenizers` version; the token ids would not match the "
                               "weights: retrain with `python -m hookrun.experiments.weights`")
    return load_bytes(data)


def save(name: str, state: dict, vocab: Optional[str] = None) -> Path:
    """Write DIR/name.safetensors and its line of SHA256SUMS."""
    from safetensors.torch import save

    DIR.mkdir(exist_ok=True)
    path = DIR / f"{name}.safetensors"
    data = save({k: v.contiguous() for k, v in state.items()}, metadata={"vocab": vocab} if vocab else None)
    path.write_bytes(data)
    known = {**sums(), path.name: digest(data)}
    SUMS.write_text("".join(f"{known[n]}  {n}\n" for n in sorted(known)))
    return path


def vocab_digest(tok) -> str:
    """The first 16 hex digits of the sha256 of a tokenizer's vocabulary (token -> id): the ids weights depend on."""
    return digest(repr(sorted(tok.get_vocab().items())).encode())[:16]


def defaults(function) -> tuple:
    """The default values of a function's parameters, in order (a trained model's default settings)."""
    import inspect

    return tuple(p.default for p in inspect.signature(function).parameters.values())


def shipped(name: str, train: Callable[[], dict], vocab: Optional[str] = None) -> dict:
    """The shipped weights `name` when the package holds them, else train()."""
    state = load(name, vocab)
    return train() if state is None else state


def main():
    """Retrain the bundled models at their default settings and rewrite their files (after changing a task)."""
    from hookrun.experiments import induction, moods, recall, sae_features

    for write in (recall.write_weights, moods.write_weights, induction.write_weights, sae_features.write_weights):
        print(write())   # the SAE last: it is trained on the mood model's captures, with the mood weights just written


if __name__ == "__main__":
    main()
