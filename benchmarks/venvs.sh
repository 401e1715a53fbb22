#!/usr/bin/env bash
# The benchmarks' two venvs, where the peers' pins clash: sae-lens needs transformer-lens < 4.
#   .venv-bench    hookrun[lm,xarray,bench]: nnsight, torchlens and TransformerLens 4.x (benchmarks/*.py)
#   .venv-saelens  hookrun[lm,saelens]: SAELens and the TransformerLens it pins (benchmarks/dictionaries.py)
#   .venv-autocircuit  auto-circuit alone (no hookrun): it needs HookedTransformer, removed in TransformerLens 4,
#                  so TransformerLens 2.x, which pins numpy < 2 (then pyarrow < 18, datasets < 3, transformers < 5)
#                  (benchmarks/circuits_peers.py runs it in a subprocess; TransformerLens 4.x from .venv-bench)
#   .venv-sparsify  EleutherAI's sparsify alone (eai-sparsify; benchmarks/train_sparsify.py runs it in a subprocess)
# Usage, from the repository root: benchmarks/venvs.sh [python3] ; then .venv-bench/bin/python benchmarks/lens.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
TORCH="${TORCH:-torch==2.13.0}"   # the torch build first, so pip keeps it (docs/install.md)
make_venv() {  # make_venv DIR EXTRAS
    "$PY" -m venv "$1"
    "$1/bin/python" -m pip install -q "$TORCH"
    "$1/bin/python" -m pip install -q -e ".[$2]"
}
make_venv .venv-bench "lm,xarray,bench"
"./.venv-bench/bin/python" -m pip install -q "transformer_lens>=4,<5"   # the newest TransformerLens the peers' pins allow
make_venv .venv-saelens "lm,saelens"
"$PY" -m venv .venv-autocircuit
./.venv-autocircuit/bin/python -m pip install -q "$TORCH"
./.venv-autocircuit/bin/python -m pip install -q auto-circuit "transformer-lens>=2,<3" "transformers>=4.40,<5" \
    "datasets>=2.16,<3" "pyarrow>=15,<18"
"$PY" -m venv .venv-sparsify
./.venv-sparsify/bin/python -m pip install -q "$TORCH"
./.venv-sparsify/bin/python -m pip install -q "eai-sparsify>=1.3,<2"
for venv in .venv-bench .venv-saelens; do
    echo "$venv: $("$venv/bin/python" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "transformer_lens") + (("sae_lens",) if __import__("importlib").util.find_spec("sae_lens") else ())))')"
done
