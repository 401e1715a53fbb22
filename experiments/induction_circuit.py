"""The induction circuit found by edge attribution (docs/circuits.md): the induction_circuit experiment run, its
top edges, the K-composition edge, the faithfulness of the top-n circuits against random ones, and the pictures.
The report reads any circuit run (recall_circuit's too).

    python -m hookrun.experiments.induction_circuit --out runs/induction_circuit   # runs it, prints, draws
    python -m hookrun.experiments.induction_circuit RUN_DIR                        # reads a run

The previous-token head is layer 0 head 0 and the top induction head layer 1 head 0 (docs/induction.md): their
K-composition is the edge a0.h0 -> a1.h0<k>, the previous-token head's output read by the induction head's keys.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import hookrun
from hookrun.read.plots import circuit as pictures

K_COMPOSITION = "a0.h0->a1.h0<k>"  # previous-token head -> top induction head, into its key input


def report(cap, out: Path = None, top: int = 8) -> dict:
    """Print the top edges, the K-composition edge's rank, the faithfulness table; draw the pictures into out.
    Returns the numbers the docs quote."""
    res = cap.read("circuit")
    pd.set_option("display.width", 160)
    edges = res.edges.sort_values("rank")
    cols = ["name", "kind", "score", "rank"] + (["exact"] if "exact" in edges else [])
    print(f"{res!r}\n\ntop {top} edges by |mean {res.attrs['method']} score| of {res.attrs['metric']}\n"
          f"(the estimated change of the metric with the edge patched corrupt -> clean; exact: one edge patched into "
          f"the corrupt run, mean where verified):")
    print(edges.head(top)[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    named = res.edges.set_index("name")
    induction = res.attrs["graph"].get("model") == "AttnOnly"  # the induction model (not recall_circuit's GPT-2)
    rank = int(named.loc[K_COMPOSITION, "rank"]) if induction else None
    keys = edges[edges.name.str.match(r"a0\.h\d+->a1\.h\d+<k>$")] if induction else edges.iloc[:0]
    if rank is not None:
        print(f"\nK-composition {K_COMPOSITION}: rank {rank} of {len(edges)}; the first layer 0 -> layer 1 key edge: "
              f"{keys.name.iloc[0]}, rank {int(keys['rank'].iloc[0])}")
    f = res.faithfulness
    print(f"\nfaithfulness of the top-n circuits and of random circuits of the same size (mean of "
          f"{int((res.circuits.kind == 'random').sum() / max(1, len(f)))} each):")
    print(f.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"area under the curve: top n {f.attrs['area']:.3f}, random {f.attrs['area_random']:.3f}")
    first = f[f.faithfulness >= 0.9]
    numbers = {"k_rank": rank, "k_first": (keys.name.iloc[0], int(keys["rank"].iloc[0])) if len(keys) else None,
               "area": f.attrs["area"], "area_random": f.attrs["area_random"],
               "n90": int(first.n.iloc[0]) if len(first) else None,
               "fraction90": float(first.fraction.iloc[0]) if len(first) else None,
               "random90": float(first.random.iloc[0]) if len(first) else None}
    if numbers["n90"]:
        print(f"smallest top-n circuit recovering >= 0.9: n = {numbers['n90']} ({numbers['fraction90']:.0%} of the "
              f"edges): {float(first.faithfulness.iloc[0]):.3f}; random circuits of that size: "
              f"{numbers['random90']:.3f}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        name = f"top_{numbers['n90']}" if numbers["n90"] else f"top_{int(f.n.iloc[-1])}"
        pictures.circuit_graph(res, name).savefig(out / "circuit.png", dpi=110)
        pictures.faithfulness_curve(res).savefig(out / "faithfulness.png", dpi=110)
        print(f"\n{out / 'circuit.png'}\n{out / 'faithfulness.png'}")
    return numbers


def main(argv=None):
    """python -m hookrun.experiments.induction_circuit [--out DIR] runs induction_circuit into DIR/run and
    reports; with RUN_DIR it reads that run."""
    parser = argparse.ArgumentParser(prog="python -m hookrun.experiments.induction_circuit", description=main.__doc__)
    parser.add_argument("run_dir", nargs="?", help="a run of induction_circuit to read (nothing is run)")
    parser.add_argument("--out", default="induction_circuit", help="the run goes to OUT/run, the pictures to OUT")
    args = parser.parse_args(argv)
    if args.run_dir:
        return report(hookrun.open(args.run_dir), Path(args.run_dir))
    out = Path(args.out).resolve()
    subprocess.run([sys.executable, "-m", "hookrun", "+experiment=induction_circuit", f"hydra.run.dir={out / 'run'}",
                    "store.mode=overwrite"], check=True)
    return report(hookrun.open(out / "run"), out)


if __name__ == "__main__":
    np.set_printoptions(precision=4, suppress=True)
    main()
