"""The induction and recall circuits in the circuit-discovery benchmark's terms (MIB's circuit track, docs/circuits.md):
one sweep a task over the attribution methods, each job's circuits at the benchmark's edge percentages, its CPR
and CMD (hookrun.collect's `circuit.cpr`, `circuit.cmd`), the table and the curves.

    python -m hookrun.experiments.circuit_benchmark --out runs/circuit_benchmark   # runs both sweeps, prints, draws
    python -m hookrun.experiments.circuit_benchmark --out runs/circuit_benchmark --read   # reads them again

Each task's experiment as bundled (induction_circuit, recall_circuit: their data, metric and donor), with the
benchmark's settings: `select: {percent: [0.1 .. 100], random: 5}` (no top_n circuits, no verify; 5 random
circuits a size, the Random row), 5 integration steps (its --ig-steps default) for eap_ig and eap_ig_activations.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

import hookrun
from hookrun.read.plots import circuit as pictures
from hookrun.read.results.benchmark import PERCENT

TASKS = ("induction_circuit", "recall_circuit")
METHODS = ({"method": "eap", "steps": None}, {"method": "eap_ig", "steps": 5},
           {"method": "eap_ig_activations", "steps": 5})
SETTINGS = ["circuit.verify=0", "circuit.select.top_n=[]", "circuit.select.random=5", "++circuit.select.seed=0",
            f"+circuit.select.percent=[{','.join(f'{p:g}' for p in PERCENT)}]"]


def run(out: Path, tasks=TASKS, methods=METHODS) -> None:
    """Each task's sweep over the methods into out/<task>."""
    for task in tasks:
        hookrun.sweep(task, {"circuit": [dict(m) for m in methods]}, overrides=SETTINGS, sweep_dir=out / task,
                      with_index=False, quiet=True)


def table(out: Path, tasks=TASKS) -> pd.DataFrame:
    """A row a (task, method): CPR, CMD and the faithfulness of the |score| circuits at 1%, 10% (collect's columns
    and each job's reader), and a row `random` a task: the random circuits' (the last job's: the same circuits in
    every job, drawn from the graph and the seed)."""
    rows = []
    for task in tasks:
        df = hookrun.collect(out / task, with_index=False)
        for _, row in df.iterrows():
            res = hookrun.open(out / task / str(row.job)).read("circuit")
            t = res.benchmark.set_index("percent")
            rows.append({"task": task.replace("_circuit", ""), "method": res.attrs["method"],
                         "steps": res.attrs["steps"], "edges": len(res.edges), "CPR": row["circuit.cpr"],
                         "CMD": row["circuit.cmd"], "abs@1%": t.loc[1.0, "abs"], "abs@10%": t.loc[10.0, "abs"]})
        rows.append({"task": task.replace("_circuit", ""), "method": "random", "steps": None, "edges": len(res.edges),
                     "CPR": row["circuit.cpr_random"], "CMD": row["circuit.cmd_random"],
                     "abs@1%": t.loc[1.0, "random"], "abs@10%": t.loc[10.0, "random"]})
    return pd.DataFrame(rows)


def draw(out: Path, tasks=TASKS) -> list:
    """curves-<task>.png: each method's two curves (pictures.benchmark_curves)."""
    paths = []
    for task in tasks:
        df = hookrun.collect(out / task, with_index=False)
        results = {}
        for _, row in df.iterrows():
            res = hookrun.open(out / task / str(row.job)).read("circuit")
            results[res.attrs["method"]] = res
        fig = pictures.benchmark_curves(results, f"{task}: faithfulness at the benchmark's circuit sizes "
                                                 f"({len(next(iter(results.values())).edges)} edges)")
        path = out / f"curves-{task}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/circuit_benchmark"))
    ap.add_argument("--read", action="store_true", help="read the sweeps already in --out")
    args = ap.parse_args(argv)
    if not args.read:
        run(args.out)
    pd.set_option("display.width", 160)
    print(table(args.out).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for path in draw(args.out):
        print(path)


if __name__ == "__main__":
    main()
