"""The induction and recall circuits in the circuit-discovery benchmark's terms (MIB's circuit track, docs/circuits.md):
one sweep a task over the attribution methods, each job's circuits at the benchmark's edge percentages, its CPR
and CMD (hookrun.collect's `circuit.cpr`, `circuit.cmd`), the table and the curves.

    python -m hookrun.experiments.circuit_benchmark --out runs/circuit_benchmark   # runs both sweeps, prints, draws
    python -m hookrun.experiments.circuit_benchmark --out runs/circuit_benchmark --read   # reads them again

Each task's experiment as bundled (induction_circuit, recall_circuit: their data, metric and donor), with the
benchmark's settings: `select: {percent: [0.1 .. 100], random: 5}` (no top_n circuits, no verify; 5 random
circuits a size, the Random row), 5 integration steps (its --ig-steps default) for eap_ig and eap_ig_activations;
the methods EAP, EAP-IG inputs and activations, clean-corrupted, exact and information-flow routes (the latter's
circuits grown greedily from the logits, as the benchmark's evaluation does for it).
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
           {"method": "eap_ig_activations", "steps": 5}, {"method": "clean_corrupted", "steps": None},
           {"method": "exact", "steps": None}, {"method": "information_flow_routes", "steps": None})
# keys the bundled experiments do not set, for one method: its jobs a sweep of their own (out/<task>-<method>).
# The reference's routes: its input node the token embedding, its circuits grown greedily (MIB's run_evaluation.py
# sets apply_greedy for information-flow-routes)
OWN = {"information_flow_routes": ["++circuit.input=token_embedding", "++circuit.select.how=greedy"]}
SETTINGS = ["circuit.verify=0", "circuit.select.top_n=[]", "circuit.select.random=5", "++circuit.select.seed=0",
            f"+circuit.select.percent=[{','.join(f'{p:g}' for p in PERCENT)}]"]


def run(out: Path, tasks=TASKS, methods=METHODS) -> None:
    """Each task's sweep over the methods into out/<task> (a method of OWN: out/<task>-<method>)."""
    for task in tasks:
        plain = [dict(m) for m in methods if m["method"] not in OWN]
        if plain:
            hookrun.sweep(task, {"circuit": plain}, overrides=SETTINGS, sweep_dir=out / task, with_index=False,
                          quiet=True)
        for m in methods:
            if m["method"] in OWN:
                hookrun.sweep(task, {"circuit": [dict(m)]}, overrides=SETTINGS + OWN[m["method"]],
                              sweep_dir=out / f"{task}-{m['method']}", with_index=False, quiet=True)


def jobs(out: Path, task: str):
    """(collect's row, the job's CircuitResult) of each job of a task's sweeps, in METHODS' order."""
    for d in [out / task, *(out / f"{task}-{m}" for m in OWN)]:
        if d.is_dir():
            for _, row in hookrun.collect(d, with_index=False).iterrows():
                yield row, hookrun.open(d / str(row.job)).read("circuit")


def table(out: Path, tasks=TASKS) -> pd.DataFrame:
    """A row a (task, method): CPR, CMD and the faithfulness of the |score| circuits at 1%, 10% (collect's columns
    and each job's reader), and a row `random` a task: the random circuits' (the first job's: the same circuits in
    every job of one select.how, drawn from the graph and the seed)."""
    rows = []
    for task in tasks:
        first = None
        for row, res in jobs(out, task):
            t = res.benchmark.set_index("percent")
            first = (row, t) if first is None else first
            rows.append({"task": task.replace("_circuit", ""), "method": res.attrs["method"],
                         "steps": res.attrs["steps"], "edges": len(res.edges), "CPR": row["circuit.cpr"],
                         "CMD": row["circuit.cmd"], "abs@1%": t.loc[1.0, "abs"], "abs@10%": t.loc[10.0, "abs"]})
        row, t = first  # the first job's random circuits (top selection; the greedy job draws its own)
        rows.append({"task": task.replace("_circuit", ""), "method": "random", "steps": None, "edges": len(res.edges),
                     "CPR": row["circuit.cpr_random"], "CMD": row["circuit.cmd_random"],
                     "abs@1%": t.loc[1.0, "random"], "abs@10%": t.loc[10.0, "random"]})
    return pd.DataFrame(rows)


def draw(out: Path, tasks=TASKS) -> list:
    """curves-<task>.png: each method's two curves (pictures.benchmark_curves)."""
    paths = []
    for task in tasks:
        results = {res.attrs["method"]: res for _, res in jobs(out, task)}
        fig = pictures.benchmark_curves(results, f"{task}: faithfulness at the benchmark's circuit sizes "
                                                 f"({len(next(iter(results.values())).edges)} edges)")
        fig.set_size_inches(11, 4.8)  # six methods: the legend beside the axes, not over the curves
        fig.axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
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
