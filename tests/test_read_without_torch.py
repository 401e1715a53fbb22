"""Reading needs no torch: stores written here by every method (patching, attribution, circuit, lens, dictionaries,
generate) and the previous release's fixtures (tests/data) are opened, indexed, loaded and read through each
method's reader (cap.read, cap.grid, cap.generations) in a process where `import torch` fails, and give there
exactly what they give here; a circuit's senders, receivers and edge names are stored with the run and read back as
they are, and a store written before they were (the graph's shape only) reads the same graph rebuilt."""
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import hookrun
from hookrun.engine.runner import run
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.helpers import make_cfg, paired_data, write_pairs

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "data" / "format_v1"
BASE = ["+experiment=lm_tokens", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "device=cpu"]
LD = "+metrics.ld={metric:logit_diff,a:' model',b:' store'}"
SITES = "{layers:[transformer.h.0,transformer.h.1],positions:all}"
CIRCUIT = "{source:clean,target:corrupt,metric:ld,method:eap,verify:3,select:{top_n:[4,12],random:1}}"
BLOCKED = "import sys; sys.modules['torch'] = None; {first}from tests.read_all import main; main()"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def write(path: Path, overrides) -> str:
    run(make_cfg([*BASE, *overrides, f"store.path={path}"]))
    return str(path)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """{name: store path}: a store written by each method, and the fixtures of the previous release."""
    tmp = tmp_path_factory.mktemp("stores")
    pairs = write_pairs(tmp / "pairs.jsonl")
    paired = [*paired_data(pairs), "hooks.resid=null", LD]
    torch.manual_seed(3)
    sae = SparseAutoencoder(32, 24, hook_name="transformer.h.0")
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
    sae_dir = save_saelens(sae, tmp / "sae", hook_name="transformer.h.0")
    out = {
        "paired": write(tmp / "paired.zarr", [
            *paired, f"+patching={{source:clean,target:corrupt,sites:{SITES},metric:ld}}",
            f"+attribution={{source:clean,target:corrupt,sites:{SITES},metric:ld,verify:3}}", f"+circuit={CIRCUIT}"]),
        "lens": write(tmp / "lens.zarr", [
            "hooks.resid=null", "data.max_samples=4", "data.batch_size=2", "data.text.max_length=10",
            "lens.sites.layers=blocks", "lens.sites.positions=all", "lens.top_k=3", "lens.tokens=[' the']",
            "lens.dla.tokens=[' model',' the']"]),
        "dictionaries": write(tmp / "dictionaries.zarr", [
            "~hooks.resid", "data.max_samples=4", "data.batch_size=2", f"+dictionaries={{sae1: {{path: {sae_dir}}}}}",
            "+hooks.feats={kind: forward, layers: [transformer.h.0], dictionary: sae1, top_k: 8, evaluate: true}"]),
        "generate": write(tmp / "generate.zarr", [
            "data.max_samples=4", "data.batch_size=2", "layers=[transformer.h.0]", "generate.max_new_tokens=3"]),
    }
    return {**out, **{p.stem: str(p) for p in sorted(FIXTURES.glob("*.zarr"))}}


def same(a, b, where: str) -> None:
    """a == b for the values readings() gives: frames and arrays exactly (NaN where NaN), lists and scalars."""
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
        assert a.attrs == b.attrs, where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, where


def read_without_torch(stores: dict, tmp_path: Path, first: str = "") -> dict:
    """tests.read_all's readings of `stores` in a process where `import torch` raises ImportError (after the
    statements `first`)."""
    listing = tmp_path / "stores.json"
    listing.write_text(json.dumps(stores))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", BLOCKED.format(first=first), str(listing), str(tmp_path / "read.pkl")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    child = pickle.loads((tmp_path / "read.pkl").read_bytes())
    assert child["torch"] == []  # nothing of torch was imported there
    return child


def test_the_previous_releases_stores_and_the_readers_need_no_torch(tmp_path):
    """The fixtures (tests/data) open, index and load there as here; every reader module imports there."""
    from tests.read_all import readings

    fixtures = {p.stem: str(p) for p in sorted(FIXTURES.glob("*.zarr"))}
    modules = ["hookrun.read.results." + p.stem for p in sorted((ROOT / "hookrun/read/results").glob("*.py"))]
    first = (f"import importlib; [importlib.import_module(m) for m in {modules!r}]; import hookrun.read.plots; "
             "from hookrun.read.results import reader; "
             "[reader(k) for k in ('patching', 'attribution', 'lens', 'circuit', 'dictionaries', 'generate')]; ")
    child = read_without_torch(fixtures, tmp_path, first)
    here = readings(fixtures)
    for name, values in here.items():
        assert set(child["readings"][name]) == set(values) and len(values) > 2, name
        for what, value in values.items():
            same(child["readings"][name][what], value, f"{name}: {what}")


@pytest.mark.slow
def test_every_methods_results_read_the_same_where_torch_cannot_be_imported(stores, tmp_path):
    from tests.read_all import readings

    child = read_without_torch(stores, tmp_path)
    here = readings(stores)
    assert set(child["readings"]) == set(here) == set(stores)
    for name, values in here.items():
        there = child["readings"][name]
        assert set(there) == set(values), name
        for what, value in values.items():
            same(there[what], value, f"{name}: {what}")
    # every method's reader was asked (the readings hold each one's result)
    kinds = {w for values in here.values() for w in values}
    assert {"grid", "attribution", "edges", "lens", "dla", "evaluations", "dense", "generations"} <= kinds
    assert len(here["v1_lm_tokens"]) > 2 and len(here["v1_conv_fmaps"]) > 2


def test_a_circuits_graph_is_stored_with_the_run_and_read_back_as_it_is(tmp_path, monkeypatch):
    from hookrun.experiments.lm import causal_lm
    from hookrun.methods.circuits.graph import circuit_graph
    from hookrun.read.results.graph import STORED, CircuitGraph

    pairs = write_pairs(tmp_path / "pairs.jsonl")
    circuit = [*paired_data(pairs), "hooks.resid=null", LD, f"+circuit={CIRCUIT}"]
    cap = hookrun.open(write(tmp_path / "new.zarr", circuit))
    shape = cap.attrs["circuit"]["graph"]
    graph = circuit_graph(causal_lm(n_layer=2, n_embd=32, n_head=4))
    assert shape["edge_names"] == graph.names and len(graph.names) == shape["edges"]
    assert shape["senders"]["name"] == [s.name for s in graph.senders]
    assert shape["receivers"]["name"] == [r.name for r in graph.receivers]
    assert shape["receivers"]["heads"] == [list(r.heads) for r in graph.receivers]
    assert cap.verify() == []  # the names are under the root's checksum like every other attr
    res = cap.read("circuit")
    pd.testing.assert_frame_equal(res.edges[graph.edges.columns], graph.edges)
    with pytest.raises(ValueError, match="not among its nodes"):
        CircuitGraph.from_attrs(dict(shape, edge_names=["a9.h0->logits", *shape["edge_names"][1:]]))
    # a store written before the graph was stored (the previous release: its shape only) reads the same graph
    monkeypatch.setattr(CircuitGraph, "stored", lambda self: {})
    old = hookrun.open(write(tmp_path / "old.zarr", circuit))
    assert not set(STORED) & set(old.attrs["circuit"]["graph"]) and old.verify() == []
    was = old.read("circuit")
    pd.testing.assert_frame_equal(was.edges, res.edges)  # the same run, the graph rebuilt: the same table
    assert sorted(was.graph().edges(keys=True, data=True)) == sorted(res.graph().edges(keys=True, data=True))
    assert dict(was.graph().nodes(data=True)) == dict(res.graph().nodes(data=True))
