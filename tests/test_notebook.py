"""A notebook's reruns (hookrun/api.py, the engine's end of a run): a store in memory saved to the same store a disk
run writes, the config composed once per process but never stale, nothing left on the model by any method, the
user's logging level kept, a wrapped model hooked through its module or refused."""
import dataclasses
import logging

import fsspec
import numpy as np
import pytest
import torch
from omegaconf import open_dict

import hookrun
from hookrun import api
from hookrun.config.checks import ConfigError
from hookrun.config.parsing import parse
from hookrun.engine.runner import run as run_engine
from hookrun.experiments.lm import causal_lm
from hookrun.experiments.moods import trained_lm as mood_lm
from hookrun.experiments.recall import trained_lm as recall_lm
from tests.test_api import hooks_left

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4}


@pytest.fixture(scope="module")
def mood():
    return mood_lm(**TINY, steps=5, batch=8, lr=0.003, seed=0).eval()


@pytest.fixture(scope="module")
def recall():
    return recall_lm(**TINY, steps=5, batch=8, lr=0.01, seed=0).eval()


def files_of(location) -> dict:
    """Every key of a store but the root metadata (its attrs hold the run's times) and the writer's lock -> its bytes
    (an array's metadata parsed, without the run id each run makes)."""
    import json

    from tests.helpers import without_run_ids

    return {k: without_run_ids(json.loads(location.get(k))) if k.endswith("zarr.json") else location.get(k)
            for k in location.keys() if k != "zarr.json" and not k.startswith(".hookrun.lock")}


def test_a_store_in_memory_saved_is_the_store_a_disk_run_writes(tmp_path, mood):
    mem = hookrun.run("lens", model=mood, store={"path": "memory"})
    disk = hookrun.run("lens", model=mood, store={"path": str(tmp_path / "disk.zarr")})
    assert str(mem.path).startswith("memory://hookrun/") and mem.status == "complete"
    saved = mem.save(tmp_path / "saved.zarr")
    assert saved.path == tmp_path / "saved.zarr" and saved.verify(decode=True) == []
    for cap in (mem, saved):  # every array, the index and the tables as the disk run's, bit for bit
        assert sorted(cap.index.array.unique()) == sorted(disk.index.array.unique())
        for key in disk.index.array.unique():
            a, b = cap.array(key)[:], disk.array(key)[:]
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        timing = ["write_s", "forward_s", "backward_s"]
        cols = [c for c in disk.index.columns if c not in timing]
        assert cap.index[cols].equals(disk.index[cols]) and cap.samples.equals(disk.samples)
        assert cap.tokens().equals(disk.tokens())
    index_files = {k for k in files_of(disk.location) if k.startswith("_index/")}
    chunks = {k: v for k, v in files_of(disk.location).items() if not k.startswith("_index/")}
    assert {k: v for k, v in files_of(saved.location).items() if not k.startswith("_index/")} == chunks
    assert {k for k in files_of(saved.location) if k.startswith("_index/")} == index_files
    with pytest.raises(FileExistsError, match="exists"):  # never written over
        mem.save(tmp_path / "disk.zarr")
    url = str(mem.path)
    own = url[len("memory://"):].rsplit("/", 1)[0]  # /hookrun/<id>: the dir of its own that holds it
    memory = fsspec.filesystem("memory")
    memory.pipe_file(f"{own}X/not-ours", b"kept")  # a neighbour whose name starts with its own
    del mem
    assert not memory.exists(url[len("memory://"):])  # freed with its Captures
    assert not [k for k in memory.store if k.startswith(own + "/")] and memory.cat_file(f"{own}X/not-ours") == b"kept"
    memory.rm_file(f"{own}X/not-ours")


def test_a_save_that_does_not_read_back_is_removed_and_said(tmp_path, mood, monkeypatch):
    """A store in memory is not checked at its close (no other party can change a byte of it): its copy on disk is,
    every file against its crc32c, and a copy that differs is removed, never left looking like a store."""
    from hookrun.format.files import DamagedError
    from hookrun.storage import Location

    mem = hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)
    put = Location.put

    def truncating(self, key, data):  # a disk that loses the end of every chunk file
        chunk = self.local is not None and key.rsplit("/", 1)[-1].startswith("c.")
        put(self, key, bytes(data)[:-3] if chunk else data)
    monkeypatch.setattr(Location, "put", truncating)
    with pytest.raises(DamagedError, match="does not read back as written.*it was removed"):
        mem.save(tmp_path / "saved.zarr")
    assert not (tmp_path / "saved.zarr").exists()
    monkeypatch.setattr(Location, "put", put)
    assert mem.save(tmp_path / "saved.zarr").verify() == []


def test_the_config_is_composed_once_and_never_stale(tmp_path, mood):
    (tmp_path / "experiment").mkdir()
    mine = tmp_path / "experiment" / "mine.yaml"
    mine.write_text("# @package _global_\ndefaults:\n  - lens\n  - _self_\nlens:\n  top_k: 3\n")
    first = hookrun.compose("mine", config_dir=tmp_path)
    assert hookrun.compose("mine", config_dir=tmp_path) == first and first.lens.top_k == 3
    mine.write_text("# @package _global_\ndefaults:\n  - lens\n  - _self_\nlens:\n  top_k: 4\n")  # edited: read anew
    assert hookrun.compose("mine", config_dir=tmp_path).lens.top_k == 4
    a = hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)
    b = hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)
    assert a.path != b.path and a.attrs["config_hash"] == b.attrs["config_hash"]
    assert a.attrs["started"] <= b.attrs["started"]


METHODS = {  # method -> (experiment, overrides, model fixture)
    "hooks": ("lm_tokens", ["data.max_samples=8"], "plain"),
    "lens+dla": ("lens", [], "mood"),
    "patching+metrics": ("patching_grid", ["data.max_samples=4", "data.batch_size=4"], "recall"),
    "attribution": ("attribution", ["data.max_samples=4", "data.batch_size=4", "patching=null"], "recall"),
    "dictionaries": ("sae_features", ["data.max_samples=4"], "mood"),
    "generate": ("lm_tokens", ["data.max_samples=4", "generate.max_new_tokens=3"], "plain"),
}


@pytest.mark.parametrize("method", METHODS)
def test_no_method_leaves_anything_on_the_model(tmp_path, request, method, mood, recall):
    experiment, more, which = METHODS[method]
    model = {"mood": mood, "recall": recall, "plain": None}[which] or causal_lm(**TINY).eval()
    names = api._overrides(experiment, more, {"store": {"path": "memory"}}, None, model)
    parsed, context = api._parsed(names, model)
    run_engine(parsed, None, context, model=model)  # the engine's own end of the run, not hookrun.run's guard
    assert hooks_left(model) == []


def test_the_users_logging_level_is_kept_and_quiet_quiets(mood, capsys, request):
    logger = logging.getLogger("hookrun")
    logger.propagate = False  # as in a notebook: no handler on the way up (pytest puts its own on the root logger)
    request.addfinalizer(lambda: setattr(logger, "propagate", True))
    assert not logger.hasHandlers()
    hookrun.run("lens", model=mood, store={"path": "memory"})
    assert "samples" in capsys.readouterr().out and logger.level == logging.NOTSET  # the summary, INFO by default
    logger.setLevel(logging.WARNING)
    try:
        hookrun.run("lens", model=mood, store={"path": "memory"})
        assert capsys.readouterr().out == "" and logger.level == logging.WARNING
    finally:
        logger.setLevel(logging.NOTSET)
    hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)
    assert capsys.readouterr().out == "" and logger.level == logging.NOTSET


def test_an_nnsight_model_is_hooked_through_its_module_and_other_wrappers_refused(mood):
    nnsight = pytest.importorskip("nnsight", reason="nnsight is in the [bench] extra")
    wrapped = nnsight.NNsight(mood)
    cap = hookrun.run("lens", model=wrapped, store={"path": "memory"}, quiet=True)
    plain = hookrun.run("lens", model=mood, store={"path": "memory"}, quiet=True)
    assert np.array_equal(cap.array("_lens/tokens/logprob")[:], plain.array("_lens/tokens/logprob")[:])
    assert hooks_left(mood) == []

    class Holder:
        def __init__(self, module):
            self.model = module
    with pytest.raises(ConfigError, match=r"is not a torch.nn.Module; pass model=<your Holder>.model"):
        hookrun.run("lens", model=Holder(mood), store={"path": "memory"})
    with pytest.raises(ConfigError, match="pass the torch.nn.Module itself"):
        hookrun.run("lens", model=object(), store={"path": "memory"})
    assert torch.is_grad_enabled()


def test_the_extras_table_of_the_install_page_is_pyprojects():
    import re
    import tomllib

    from tests.helpers import REPO

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (REPO / "docs" / "install.md").read_text(), re.M)
    assert [name for name, _ in table] and {name for name, _ in table} == set(extras)
    for name, adds in table:
        listed = {a.strip().strip("`") for a in adds.split(",")}
        wanted = set()
        for req in extras[name]:
            inner = re.fullmatch(r"hookrun\[([\w,]+)\]", req)
            wanted |= set(inner[1].split(",")) if inner else {re.split(r"[<>=\[;]", req)[0].replace("-", "_")}
        assert {x.replace("-", "_") for x in listed} == wanted, name
    assert not any(r.startswith(("sae-lens", "transformer")) for r in extras["test"])  # beside TransformerLens 4.x


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_the_root_a_close_writes_is_the_root_zarr_consolidates(tmp_path, mood, where):
    """A complete store's root zarr.json is made in one put (hookrun.store.writer.consolidated_root): the bytes that
    zarr.consolidate_metadata writes for the same attrs, listing every array and group, with a root_crc32c that
    checks."""
    import json
    import warnings

    import zarr

    from hookrun.format.files import root_problem
    from hookrun.store.place import write_root

    cap = hookrun.run("lens", model=mood, store={"path": str(tmp_path / "s.zarr") if where == "disk" else "memory"},
                      quiet=True)
    ours = cap.location.get("zarr.json")
    meta = json.loads(ours)
    assert meta["attributes"]["status"] == "complete" and root_problem(meta) is None
    listed = meta["consolidated_metadata"]["metadata"]
    arrays = {k for k, v in listed.items() if v["node_type"] == "array"}
    assert set(cap.index.array) <= arrays and {"_lens/top/ids", "_dla/answer/heads"} <= arrays
    assert listed["_index"]["node_type"] == "group"
    write_root(cap.location, meta["attributes"])  # a plain root with the same attrs, consolidated by zarr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zarr.errors.ZarrUserWarning)
        zarr.consolidate_metadata(cap.location.zarr_store)
    assert cap.location.get("zarr.json") == ours


def test_a_rerun_in_one_process_is_not_checked_again(tmp_path):
    """The first-batch check (hookrun.engine.preflight) runs the first samples before the store exists; a rerun of
    the same config on the same inputs and model object, with the same parameters, skips it and writes the same
    store, its per-batch arrays (Llama's rotary cos/sin, [1, T, D]) still one row a batch. Other weights, another
    requires_grad, another config or model: checked again."""
    from tests.test_safety_configs import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama().eval()
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    np.save(tmp_path / "ids.npy", torch.randint(0, 64, (9, 5), generator=torch.Generator().manual_seed(3)).numpy())
    data = {"batch_size": 4, "keyword": True, "inputs": {"input_ids": {"file": str(tmp_path / "ids.npy")}}}
    keys = dict(model=model, quiet=True, data=data, store={"path": "memory"},
                hooks={"rot": {"kind": "forward", "layers": ["model.rotary_emb"]},
                       "mlp": {"kind": "forward", "layers": ["model.layers.0.mlp"]}})

    def forwards(**more):
        calls.clear()
        cap = hookrun.run(**{**keys, **more})
        return len(calls), cap

    try:
        first, cap = forwards()
        again, rerun = forwards()
        assert first == 3 + 2 and again == 3  # the check's one-sample and two-sample trials, then none
        for c in (cap, rerun):
            rows = c.index[c.index.role == "output.0"]  # the rotary cos: one row a batch, the last one's too
            assert rows.per_sample.tolist() == [False] * 3 and rows.row_start.tolist() == [0, 1, 2]
        for key in cap.index.array.unique():
            np.testing.assert_array_equal(rerun.array(key)[:], cap.array(key)[:])
        assert forwards(data={**data, "batch_size": 3})[0] == 3 + 2  # another config
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
        assert forwards()[0] == 3 + 2  # other weights
        assert forwards()[0] == 3
        model.model.embed_tokens.weight.requires_grad_(False)
        assert forwards()[0] == 3 + 2  # another requires_grad
    finally:
        handle.remove()


def test_two_runs_without_a_store_path_get_two_run_dirs(tmp_path, monkeypatch, mood):
    """The composed config is kept per process, and Hydra's ${now:...} caches its value in it: each run still gets a
    fresh outputs/<date>/<time> (hydra.run.dir), never the first run's store."""
    monkeypatch.chdir(tmp_path)
    a = hookrun.run("lens", model=mood, quiet=True)
    b = hookrun.run("lens", model=mood, quiet=True)
    assert a.path != b.path and a.path.parent.parent == b.path.parent.parent == tmp_path / "outputs" / a.path.parts[-3]
    assert a.status == b.status == "complete"


def test_runs_that_differ_only_in_their_store_path_share_one_composition(tmp_path, monkeypatch, mood):
    """store.path=P and hookrun.run's store={"path": P} are set on the composed config, not composed: a new path
    costs no composition, and the run records what Hydra would have (config, hash, overrides); a path Hydra reads
    otherwise (an interpolation) and a store dict's other keys are still Hydra's."""
    composed = []
    compose = api._compose
    monkeypatch.setattr(api, "_CACHE", {})
    monkeypatch.setattr(api, "_compose", lambda names: composed.append(list(names)) or compose(names))
    caps = [hookrun.run("lens", ["data.max_samples=4"], model=mood, store={"path": str(tmp_path / f"{i}.zarr")},
                        quiet=True) for i in range(3)]
    caps.append(hookrun.run("lens", ["data.max_samples=4", f"store.path={tmp_path / '3.zarr'}"], model=mood,
                            quiet=True))
    assert composed == [["+experiment=lens", "data.max_samples=4"]]  # once, without a path
    assert [c.path for c in caps] == [tmp_path / f"{i}.zarr" for i in range(4)]
    assert all(c.status == "complete" for c in caps)
    np.testing.assert_array_equal(caps[0].array("_lens/tokens/logprob")[:], caps[3].array("_lens/tokens/logprob")[:])
    # what Hydra composes with the path itself: the same config, hash and overrides recorded
    hydras = compose(api._overrides("lens", ["data.max_samples=4"], {"store": {"path": str(tmp_path / "1.zarr")}},
                                     None))
    assert caps[1].attrs["overrides"] == list(hydras.hydra.overrides.task)
    assert caps[1].config["store"] == {**caps[0].config["store"], "path": str(tmp_path / "1.zarr")}
    assert caps[0].attrs["config_hash"] == caps[1].attrs["config_hash"]
    with open_dict(hydras):
        del hydras["hydra"]
    typed = hookrun.compose("lens", ["data.max_samples=4"], store={"path": str(tmp_path / "1.zarr")})
    assert typed == parse(hydras).config and typed.store.path == str(tmp_path / "1.zarr")
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.store.path = "elsewhere.zarr"  # frozen as every parse
    # the path with another store key: the key composed, the path set; an interpolation: composed whole
    again = hookrun.run("lens", ["data.max_samples=4"], model=mood,
                        store={"path": str(tmp_path / "0.zarr"), "mode": "overwrite"}, quiet=True)
    assert again.path == tmp_path / "0.zarr" and again.config["store"]["mode"] == "overwrite"
    assert composed[-1] == ["+experiment=lens", "data.max_samples=4", "++store={mode:overwrite}"]
    monkeypatch.chdir(tmp_path)
    inside = hookrun.run("lens", ["data.max_samples=4", "store.path=${hydra:runtime.output_dir}/x.zarr"],
                         model=mood, quiet=True)
    assert composed[-1][-1] == "store.path=${hydra:runtime.output_dir}/x.zarr" and inside.path.name == "x.zarr"
    assert inside.path.parent.parent.parent == tmp_path / "outputs" and len(composed) == 3
    # which overrides lose their path: the last path wins, as in Hydra; one Hydra must read leaves every path to it
    given = ("store.path=a.zarr", "++store={mode:resume}", "++store={path:b.zarr,mode:create}", "hydra.job.num=1")
    assert api._store_path_late(given) == (("++store={mode:resume}", "++store={mode:create}", "hydra.job.num=1"),
                                           "b.zarr", given[:3])  # Hydra's own node is not the task's
    assert api._store_path_late(("store.path=a.zarr", "++store={path:null}")) == \
        (("store.path=a.zarr", "++store={path:null}"), None, None)


def test_a_store_is_fresh_only_where_no_key_holds_an_array(tmp_path, mood, monkeypatch):
    """Store.fresh (its arrays made without listing) for a store made where there was none, in memory or on disk,
    and for an overwrite that left nothing of the old run; not for one that left a file hookrun did not write (a
    resume never reaches it). The stores read back complete either way."""
    from hookrun.store.writer import Store
    made = []
    open_ = Store._open_as_owner
    monkeypatch.setattr(Store, "_open_as_owner", lambda self, attrs: open_(self, attrs) or made.append(self.fresh))
    disk = tmp_path / "lens.zarr"
    caps = []
    for path, mode in (("memory", "create"), (str(disk), "create"), (str(disk), "overwrite"), (str(disk), "overwrite")):
        caps.append(hookrun.run("lens", model=mood, store={"path": path, "mode": mode}, quiet=True))
        if mode == "overwrite":  # a file of the user's in the store: the next overwrite leaves it
            (disk / "notes.txt").write_text("mine")
    assert made == [True, True, True, False] and (disk / "notes.txt").read_text() == "mine"
    assert all(cap.status == "complete" for cap in caps)
    np.testing.assert_array_equal(caps[0].read("lens").top_ids, caps[3].read("lens").top_ids)

