"""Everything the read side gives of a set of stores, as plain numpy and pandas values: what
tests/test_read_without_torch.py reads in a process where torch cannot be imported and again in its own.

    python -c "import sys; sys.modules['torch'] = None; from tests.read_all import main; main()" STORES.json OUT.pkl
"""
import json
import pickle
import sys

import numpy as np


def _arrays(cap) -> dict:
    """The index and every array of a store, whole (cap.load of each hook, layer, role and call)."""
    out = {"index": cap.index, "samples": cap.samples}
    keys = cap.index[["hook", "layer", "role", "call"]].drop_duplicates()
    for hook, layer, role, call in keys.itertuples(index=False):
        out[f"{hook}/{layer}/{role}/{call}"] = cap.load(hook=hook, layer=layer, role=role, call=int(call))
    return out


def readings(stores: dict) -> dict:
    """{store name: {what: value}} for every store given ({name: path}), read through hookrun.open and each
    method's reader."""
    import hookrun

    out = {}
    for name, path in stores.items():
        cap = hookrun.open(path)
        got = _arrays(cap)
        if "patching" in cap.attrs:
            grid = cap.grid()
            got.update(grid=grid.to_frame(), grid_scores=grid.scores, grid_top=grid.top(5))
        if "attribution" in cap.attrs:
            est = cap.read("attribution")
            got.update(attribution=est.to_frame(), verified=est.verified(), exact=est.exact)
        if "lens" in cap.attrs:
            lens = cap.read("lens")  # token texts from the run's tokenizer, built again (transformers, no torch)
            got.update(lens=lens.to_frame(), lens_top=lens.top(0, k=2), lens_ids=lens.top_ids,
                       lens_probs=lens.top_probs, logprob=lens.logprob, rank=lens.rank, kl=lens.kl,
                       dla=lens.dla.frame(), dla_tidy=lens.dla.to_frame(), dla_blocks=lens.dla.blocks(),
                       dla_top=lens.dla.top(5))
        if "circuit" in cap.attrs:
            c = cap.read("circuit")
            net = c.graph()
            got.update(edges=c.edges, circuits=c.circuits, faithfulness=c.faithfulness, scores=c.scores,
                       top=c.circuit(c.circuits["name"].iloc[-1]),
                       net=sorted((u, v, k, d["name"], d["score"]) for u, v, k, d in net.edges(keys=True, data=True)),
                       nodes=sorted(net.nodes(data="layer")))
            if c.features is not None:
                got["features"] = c.features
        if cap.attrs.get("dictionaries"):
            got.update(evaluations=cap.read("dictionaries"),
                       dense=cap.read("dictionaries", "features", features=[0, 3, 7]),
                       top_feature=cap.top(feature=3, k=4))
        if ((cap.config or {}).get("generate") or {}).get("max_new_tokens"):
            got["generations"] = cap.generations()
        out[name] = got
    return out


def main() -> None:
    stores, target = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    got = readings(stores)
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    with open(target, "wb") as f:
        pickle.dump({"readings": got, "torch": [m for m in loaded if sys.modules[m] is not None],
                     "numpy": np.__version__}, f)


if __name__ == "__main__":
    main()
