"""Circuits at three levels on the bundled induction task (docs/circuits.md#levels): induction_circuit's EAP-IG
scores with circuits of edges (its own top-n sizes), of nodes (`circuit.level: node`: the input and the heads) and
of neurons (`level: neuron`: dimensions of their outputs), each against random circuits of the same size; the
faithfulness tables and one figure.

    python -m hookrun.experiments.circuit_levels --out runs/circuit_levels   # three runs, the tables, the figure
    python -m hookrun.experiments.circuit_levels --out runs/circuit_levels --read   # the runs already there
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

import hookrun

LEVELS = {  # the three runs: induction_circuit as it is, but without verify (no exact patches: the curves only)
    "edge": [],
    "node": ["+circuit.level=node", "circuit.select.top_n=[1,2,3,4,5,6,7,8]"],
    "neuron": ["+circuit.level=neuron", "circuit.select.top_n=[16,64,128,256,384,512]"]}


def table(res) -> pd.DataFrame:
    """A row a top-n circuit: level, n (units asked), kept (units), edges kept, faithfulness, random's mean."""
    c = res.circuits
    level = res.attrs.get("level") or "edge"
    rows = []
    for _, row in c[c.kind == "top_n"].iterrows():
        rnd = c[(c.kind == "random") & (c.n == row.n)]
        rows.append({"level": level, "n": int(row.n), "kept": int(row.kept),
                     "edges": int(row.edges) if "edges" in c else int(row.kept),
                     "faithfulness": row.faithfulness, "random": float(rnd.faithfulness.mean())})
    return pd.DataFrame(rows)


def figure(tables: dict, n_edges: int, units: dict):
    """Faithfulness of the three levels' circuits: against the fraction of the edges kept (edge and node
    circuits, with their random baselines) and against the fraction of the level's units asked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"edge": "C0", "node": "C1", "neuron": "C2"}
    for level, t in tables.items():
        ax = axes[0]
        if level != "neuron":
            ax.plot(t.edges / n_edges, t.faithfulness, "o-", color=colors[level], label=f"top-n {level}s")
            ax.plot(t.edges / n_edges, t.random, "x--", color=colors[level], alpha=0.6,
                    label=f"random {level}s")
        axes[1].plot(t.n / units[level], t.faithfulness, "o-", color=colors[level], label=f"{level}s")
        axes[1].plot(t.n / units[level], t.random, "x--", color=colors[level], alpha=0.6)
    axes[0].set(xlabel="fraction of the 81 edges kept", ylabel="faithfulness", title="edge and node circuits")
    axes[1].set(xscale="log", xlabel="fraction of the level's units asked (log)", ylabel="faithfulness",
                title="by level (dashed: random)")
    for ax in axes:
        ax.axhline(1, color="gray", lw=0.5)
        ax.axhline(0, color="gray", lw=0.5)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def report(out: Path) -> dict:
    """Print each level's table and draw out/levels.png; returns the tables."""
    tables, units = {}, {}
    for level in LEVELS:
        res = hookrun.open(out / level).read("circuit")
        tables[level] = table(res)
        units[level] = res.units
        n_edges = len(res.edges)
        print(f"\n{level} circuits ({units[level]} {level}s; faithfulness of the top n and of random circuits, "
              f"mean of {int((res.circuits.kind == 'random').sum() / max(1, len(tables[level])))} each):")
        print(tables[level].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if level == "node":
            print(res.nodes.sort_values("rank")[["name", "score", "rank"]].to_string(
                index=False, float_format=lambda v: f"{v:.3f}"))
            for n in (4,):
                print(f"top_{n}: {res.selected(f'top_{n}')}")
    figure(tables, n_edges, units).savefig(out / "levels.png", dpi=110)
    print(f"\n{out / 'levels.png'}")
    return tables


def main(argv=None):
    """python -m hookrun.experiments.circuit_levels [--out DIR] [--read]: the three runs into DIR/<level>, then the
    tables and DIR/levels.png."""
    parser = argparse.ArgumentParser(prog="python -m hookrun.experiments.circuit_levels", description=main.__doc__)
    parser.add_argument("--out", default="circuit_levels", help="the runs go to OUT/<level>, the figure to OUT")
    parser.add_argument("--read", action="store_true", help="read the runs already in OUT (nothing is run)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if not args.read:
        for level, extra in LEVELS.items():
            subprocess.run([sys.executable, "-m", "hookrun", "+experiment=induction_circuit",
                            f"hydra.run.dir={out / level}", "store.mode=overwrite", "circuit.verify=0", *extra],
                           check=True)
    return report(out)


if __name__ == "__main__":
    main()
