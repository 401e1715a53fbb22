"""Bad inputs on the command line, in data, text, tokenizer, model building, launcher, device, seed and rank
variables: each is refused before any work (exit 2, a ConfigError), its message names the key, and no store
is created. The table runs in process (the same steps as the CLI: the override check, Hydra's composition, a
sweep's launcher check, the run's checks); a handful also run through the real CLI."""
import pickle
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.config.commandline import launcher_problems, override_problems
from hookrun.engine.ranks import SLURM, TORCHRUN, Ranks
from hookrun.engine.runner import run
from tests.helpers import REPO, run_cli

MLP = ["+model._target_=tests.models.MLP", "+hooks.acts={kind:forward,layers:[fc1]}", "data.batch_size=2"]
IN = [*MLP, "+data.inputs.x={random:normal,shape:[4,6]}"]
LM = ["+experiment=lm_tokens", "model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.n_positions=64",
      "data.text.files=[{tmp}/docs.txt]", "data.batch_size=2"]
TEXT = ["++data.text.files=[{tmp}/docs.txt]", "+data.text.tokenizer._target_=hookrun.experiments.lm.tokenizer",
        "data.text.max_length=16"]
PAIRED = [*LM, "data.text.files=[{tmp}/pairs.jsonl]", "data.text.fields={clean:clean,corrupt:corrupt}",
          "hooks.resid=null", "+metrics.ld={metric:logit_diff,a:' the',b:' a'}"]
DOCS = ["Hookrun stores every capture one row per real token.", "Pads never reach the store.", "A short one"]
RANK_VARS = (*TORCHRUN, *SLURM, "MASTER_ADDR", "MASTER_PORT")


class BrokenDataset(torch.utils.data.Dataset):
    """A dataset whose constructor fails, as one pointed at a missing directory does."""

    def __init__(self, root="/data/imagenet"):
        raise FileNotFoundError(f"no such directory: {root}")


def broken_tokenizer(**kwargs):
    raise OSError("no tokenizer files in /models/missing")


class Payload:
    """Unpickling this touches `marker`: code in a .pt file that torch.load(weights_only=False) would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


@pytest.fixture
def bad_files(tmp_path):
    """The corpora and input files the table points at, under tmp_path."""
    (tmp_path / "docs.txt").write_text("\n".join(DOCS) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": broken}\n')
    (tmp_path / "num.jsonl").write_text('{"text": "ok"}\n5\n')
    (tmp_path / "null.jsonl").write_text('{"text": "ok"}\n{"text": null}\n')
    (tmp_path / "latin.txt").write_bytes("fine\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "folder.txt").mkdir()
    (tmp_path / "folder.npy").mkdir()
    (tmp_path / "corrupt.parquet").write_bytes(b"not a parquet file")
    (tmp_path / "text.npy").write_text("hello")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "arrays.npz", a=np.ones(3))
    torch.save({"x": torch.ones(4, 6)}, tmp_path / "dict.pt")
    torch.save(Payload(tmp_path / "code_ran"), tmp_path / "code.pt")
    (tmp_path / "pairs.jsonl").write_text('{"clean": "the hooks run", "corrupt": "the store run"}\n' * 2)
    from hookrun.methods.saes import SparseAutoencoder, save_saelens

    sae = SparseAutoencoder(32, 16, hook_name="transformer.h.0")
    with torch.no_grad():
        sae.W_enc[1, 2] = float("nan")
    save_saelens(sae, tmp_path / "sae_nan", hook_name="transformer.h.0")
    return tmp_path


def case(id, overrides, *expected, env=None):
    return pytest.param(overrides, env or {}, expected, id=id)


# id, overrides ({tmp}: the bad_files dir), what the message must hold (the key first), rank variables
BAD = [
    # command-line overrides
    case("text-key-without-plus", ["+experiment=conv_fmaps", "data.text.max_len=64"],
         "data.text.max_len: unknown key (did you mean: max_length"),
    case("store-key-without-plus", [*IN, "store.compresion=zstd"], "store.compresion: unknown key; store takes"),
    case("data-key-without-plus", [*IN, "data.batchsize=4"], "data.batchsize: unknown key (did you mean: batch_size"),
    case("top-key-without-plus", [*IN, "sed=3"], "sed: unknown key (did you mean: seed"),
    case("text-key-on-an-inputs-experiment", ["+experiment=conv_fmaps", "data.text.max_length=32"],
         "data.text: no documents"),
    case("text-and-inputs", ["+experiment=conv_fmaps", *TEXT], "data: inputs and text are set",
         "~data.inputs.fake_img or data.text=null"),
    # launcher
    case("joblib-n-jobs-0", [*IN, "hydra/launcher=joblib", "hydra.launcher.n_jobs=0"], "hydra.launcher.n_jobs: 0"),
    case("joblib-prefer", [*IN, "hydra/launcher=joblib", "hydra.launcher.prefer=gpu"], "hydra.launcher.prefer: 'gpu'"),
    case("joblib-batch-size-0", [*IN, "hydra/launcher=joblib", "hydra.launcher.batch_size=0"],
         "hydra.launcher.batch_size: '0'"),
    case("joblib-pre-dispatch", [*IN, "hydra/launcher=joblib", "hydra.launcher.pre_dispatch=twice"],
         "hydra.launcher.pre_dispatch: 'twice'"),
    # seed, device
    case("seed-beyond-64-bits", [*IN, "seed=99999999999999999999999"], "seed: 99999999999999999999999 is too large"),
    case("seed-negative", [*IN, "seed=-1"], "seed: -1 is too small"),
    case("device-unknown", [*IN, "device=tpu"], "device: 'tpu' is not a device"),
    # data.inputs specs
    case("shape-negative", [*MLP, "+data.inputs.x={random:normal,shape:[-1,6]}"], "data.inputs.x.shape: [-1, 6]"),
    case("shape-not-numbers", [*MLP, "+data.inputs.x={random:normal,shape:[4,a]}"], "data.inputs.x.shape: [4, 'a']"),
    case("shape-not-a-list", [*MLP, "+data.inputs.x={fill:1,shape:4}"], "data.inputs.x.shape: 4 is not a list"),
    case("fill-not-a-number", [*MLP, "+data.inputs.x={fill:abc,shape:[4,6]}"], "data.inputs.x.fill: 'abc'"),
    case("randint-empty-range", [*MLP, "+data.inputs.x={random:randint,high:0,shape:[4,6]}"],
         "data.inputs.x: low 0 >= high 0"),
    case("uniform-reversed", [*MLP, "+data.inputs.x={random:uniform,low:1,high:0,shape:[4,6]}"],
         "data.inputs.x: low 1 >= high 0"),
    case("normal-integer-dtype", [*MLP, "+data.inputs.x={random:normal,shape:[4,6],dtype:int64}"],
         "data.inputs.x.dtype: random: normal draws real numbers"),
    case("spec-seed-not-a-number", [*MLP, "+data.inputs.x={random:normal,shape:[4,6],seed:abc}"],
         "data.inputs.x.seed: 'abc'"),
    case("literal-ragged", [*MLP, "+data.inputs.x=[[1,2,3,4,5,6],[1]]"],
         "data.inputs.x: [[1, 2, 3, 4, 5, 6], [1]] is ragged"),
    case("literal-beyond-64-bits", [*MLP, "+data.inputs.x=[[99999999999999999999999,1,2,3,4,5]]"],
         "data.inputs.x: [[99999999999999999999999", "cannot be made"),
    case("spec-key-typo", [*MLP, "+data.inputs.x={value:[[1,2,3,4,5,6]],dtyp:float64}"],
         "data.inputs.x.dtyp: unknown key for a value input (did you mean: dtype?)"),
    case("spec-two-sources", [*MLP, "+data.inputs.x={value:[[1,2,3,4,5,6]],fill:1,shape:[2,6]}"],
         "data.inputs.x: has value and fill"),
    case("file-not-npy", [*MLP, "+data.inputs.x={file:{tmp}/text.npy}"], "data.inputs.x.file: ",
         "text.npy' does not load"),
    case("file-of-objects", [*MLP, "+data.inputs.x={file:{tmp}/objects.npy}"], "data.inputs.x.file: ",
         "objects.npy' does not load"),
    case("file-npz", [*MLP, "+data.inputs.x={file:{tmp}/arrays.npz}"], "data.inputs.x.file: ", "is not .npy or .pt"),
    case("file-dict-pt", [*MLP, "+data.inputs.x={file:{tmp}/dict.pt}"], "data.inputs.x.file: ",
         "holds a dict, not one array or tensor"),
    case("file-code-pt", [*MLP, "+data.inputs.x={file:{tmp}/code.pt}"], "data.inputs.x.file: ",
         "weights_only=True, so no code in them runs"),
    case("file-directory", [*MLP, "+data.inputs.x={file:{tmp}/folder.npy}"], "data.inputs.x.file: ",
         "folder.npy' is a directory"),
    # datasets
    case("dataset-build-fails", [*MLP, "+data.dataset._target_=tests.test_safety_cli.BrokenDataset"],
         "data.dataset: building tests.test_safety_cli.BrokenDataset failed (FileNotFoundError"),
    case("fields-on-one-tensor", [*MLP, "+data.dataset._target_=tests.models.RandomItems", "data.fields=[a,b,c]"],
         "data.fields: ['a', 'b', 'c'] names 3 items but the dataset yields one tensor"),
    # text corpora and tokenizers
    case("jsonl-bad-line", [*LM, "data.text.files=[{tmp}/bad.jsonl]"], "data.text.files: ",
         "bad.jsonl line 4 is not JSON"),
    case("jsonl-not-an-object", [*LM, "data.text.files=[{tmp}/num.jsonl]"], "data.text.files: ",
         "num.jsonl line 2 is 5 (int)"),
    case("jsonl-null-document", [*LM, "data.text.files=[{tmp}/null.jsonl]"], "data.text.field: 'text' of ",
         "null.jsonl line 2 is None"),
    case("txt-not-utf8", [*LM, "data.text.files=[{tmp}/latin.txt]"], "data.text.files: ",
         "latin.txt line 2 is not UTF-8"),
    case("txt-directory", [*LM, "data.text.files=[{tmp}/folder.txt]"], "data.text.files: ",
         "folder.txt' is a directory"),
    case("parquet-corrupt", [*LM, "data.text.files=[{tmp}/corrupt.parquet]"], "data.text.files: ",
         "corrupt.parquet' cannot be read (ArrowInvalid"),
    case("tokenizer-not-a-tokenizer", [*LM, "data.text.tokenizer={_target_:builtins.dict}"],
         "data.text.tokenizer: dict does not tokenize the documents"),
    case("tokenizer-build-fails", [*LM, "++data.text.tokenizer={_target_:tests.test_safety_cli.broken_tokenizer}"],
         "data.text.tokenizer: building tests.test_safety_cli.broken_tokenizer failed (OSError: no tokenizer files"),
    case("text-dataset-of-ints",
         [*LM, "data.text.files=null", "++data.text.dataset={_target_:builtins.range,_args_:[5]}"],
         "data.text.dataset: item 0 is 0 (int)"),
    # the model against the text
    case("vocabulary-too-small", [*LM, "model.vocab_size=100"], "data.text.tokenizer: a token id of the corpus is",
         "input embedding has 100 rows (model.vocab_size)"),
    case("positions-too-few", [*LM, "model.n_positions=8"], "data.text.max_length: sequences of up to",
         "the model has 8 positions (model.n_positions)"),
    # rank variables
    case("stale-rank-0-of-2", IN, "RANK=0 WORLD_SIZE=2: several ranks but MASTER_ADDR and MASTER_PORT are not set",
         "unset RANK, WORLD_SIZE, LOCAL_RANK", env={"RANK": "0", "WORLD_SIZE": "2"}),
    case("rank-3-of-2", IN, "RANK=3 WORLD_SIZE=2: RANK must be 0..1", env={"RANK": "3", "WORLD_SIZE": "2"}),
    case("rank-not-a-number", IN, "RANK='first': not an integer", env={"RANK": "first", "WORLD_SIZE": "2"}),
    case("world-of-0", IN, "RANK=0 WORLD_SIZE=0: WORLD_SIZE must be at least 1", env={"RANK": "0", "WORLD_SIZE": "0"}),
    case("world-without-rank", IN, "WORLD_SIZE=2: WORLD_SIZE=2 but RANK is not set",
         env={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
    case("slurm-task-out-of-range", IN, "SLURM_PROCID=4 SLURM_NTASKS=2: SLURM_PROCID must be 0..1",
         env={"SLURM_PROCID": "4", "SLURM_NTASKS": "2"}),
    # attribution, the lens, dictionaries
    case("attribution-source-is-target", [*PAIRED, "+attribution={source:clean,target:clean,sites:{layers:"
                                          "[transformer.h.0],positions:all},metric:ld}"],
         "attribution.target: 'clean' is also attribution.source"),
    case("attribution-heads-on-a-block", [*PAIRED, "+attribution={source:clean,target:corrupt,sites:{layers:"
                                          "[transformer.h.0],heads:all},metric:ld}"],
         "attribution.sites.heads: transformer.h.0 output is not split into heads"),
    case("attribution-steps-without-ig", [*PAIRED, "+attribution={source:clean,target:corrupt,sites:{layers:"
                                          "[transformer.h.0]},metric:ld,steps:4}"],
         "attribution.steps: 4 but method is gradient"),
    case("lens-token-twice", [*LM, "+lens={dla:{tokens:[' the',' the']}}"],
         "lens.dla.tokens: ' the' is given twice"),
    case("lens-top-k-past-vocabulary", [*LM, "+lens={sites:{layers:[transformer.h.0]},top_k:600}"],
         "lens.top_k: 600 is more than the 512 tokens in the model's vocabulary"),
    case("dictionary-nan-weight", [*LM, "+dictionaries={sae1:{path:{tmp}/sae_nan}}",
                                   "+hooks.f={kind:forward,layers:[transformer.h.0],dictionary:sae1}"],
         "dictionaries.sae1.path: dictionary {tmp}/sae_nan/sae_weights.safetensors: tensor W_enc holds 1 NaN"),
    case("dictionary-missing-folder", [*LM, "+dictionaries={sae1:{path:{tmp}/no_sae}}",
                                       "+hooks.f={kind:forward,layers:[transformer.h.0],dictionary:sae1}"],
         "dictionaries.sae1.path: dictionary {tmp}/no_sae: does not exist"),
    case("dictionary-feature-edit-nan", [*LM, "+dictionaries={sae1:{path:{tmp}/sae_nan}}",
                                         "+hooks.f={kind:forward,layers:[transformer.h.0],capture:[],edit:[{op:feature,"
                                         "dictionary:sae1,feature:0,add:nan}]}"],
         "hooks.f.edit[0].add: nan is not a finite number"),
]
CLI = {"text-key-without-plus", "joblib-n-jobs-0", "stale-rank-0-of-2", "jsonl-bad-line", "file-code-pt",
       "attribution-heads-on-a-block", "lens-top-k-past-vocabulary", "dictionary-nan-weight"}


def refusal(overrides, tmp_path) -> str:
    """The ConfigError message the CLI gives for `overrides`, found in process by the CLI's own steps: the
    override check, Hydra's composition, a sweep's launcher check, then run()."""
    problems = override_problems(overrides)
    if problems:
        return str(ConfigError(problems))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"store.path={tmp_path}/s.zarr"],
                      return_hydra_config=True)
    problems = launcher_problems(cfg.hydra.launcher)
    if problems:
        return str(ConfigError(problems))
    with open_dict(cfg):
        del cfg["hydra"]
    with pytest.raises(ConfigError) as err:
        run(cfg)
    return str(err.value)


def rank_env(monkeypatch, env):
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.slow
@pytest.mark.parametrize("overrides,env,expected", BAD)
def test_bad_input_is_refused_before_work_naming_the_key(bad_files, monkeypatch, overrides, env, expected):
    rank_env(monkeypatch, env)
    message = refusal([o.replace("{tmp}", str(bad_files)) for o in overrides], bad_files)
    for part in expected:
        assert part.replace("{tmp}", str(bad_files)) in message, message
    assert not (bad_files / "s.zarr").exists() and not list(bad_files.rglob("*.zarr"))
    assert not (bad_files / "code_ran").exists()  # nothing in a .pt file ran


@pytest.mark.slow
@pytest.mark.parametrize("overrides,env,expected", [p for p in BAD if p.id in CLI])
def test_bad_input_through_the_cli_exits_2_without_a_traceback(bad_files, overrides, env, expected):
    args = [o.replace("{tmp}", str(bad_files)) for o in overrides]
    sweep = ["-m", "seed=0,1"] if any(a.startswith("hydra/launcher") for a in args) else []
    clean = {name: "" for name in RANK_VARS}  # the test runner's own rank variables, if any, are not this run's
    t0 = time.monotonic()
    proc = run_cli(*sweep, *args, f"store.path={bad_files}/s.zarr", cwd=bad_files, check=False, env={**clean, **env})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and all(p.replace("{tmp}", str(bad_files)) in out for p in expected), out
    assert not list(bad_files.rglob("*.zarr")) and not (bad_files / "code_ran").exists()
    assert time.monotonic() - t0 < 60  # refused at once: a stale RANK used to wait for ranks that never came


# -- data.text from the command line, as every other key ----------------------------------------------------
@pytest.mark.parametrize("text", [
    TEXT,
    ["data.text={files: [{tmp}/docs.txt], tokenizer: {_target_: hookrun.experiments.lm.tokenizer}, max_length: 16}"],
], ids=["++data.text.files", "data.text={...}"])
def test_text_can_be_added_on_the_command_line_to_a_run_without_text(bad_files, text):
    model = ["+model._target_=hookrun.experiments.lm.causal_lm", "+model.n_layer=1", "+model.n_embd=32", "+model.n_head=4",
             "+hooks.resid={kind:forward,layers:[transformer.h.0]}", "data.batch_size=2"]
    path = bad_files / "text.zarr"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*model, *(t.replace("{tmp}", str(bad_files)) for t in text),
                                                       f"store.path={path}"])
    run(cfg)
    cap = hookrun.open(path)
    assert cap.status == "complete" and cap.config["data"]["text"]["files"] == [f"{bad_files}/docs.txt"]
    assert sorted(cap.tokens()["sample"].unique()) == [0, 1, 2]  # the three documents, a row per token


def test_a_run_without_text_stores_no_text_block(run_cfg):
    cap = run_cfg(IN)
    assert cap.config["data"]["text"] is None  # as before data.text could be given on the command line


def test_override_check_leaves_good_overrides_to_hydra():
    good = ["experiment=conv_fmaps", "model=pool_net", "data=random_images", "hydra.run.dir=x", "seed=3",
            "data.text.max_length=8", "data.batch_size=2,4", "+data.foo=1", "~data.stride", "layers=[a,b]",
            "model.n_layr=2", "hooks.x.kind=forward", "data.batch_size=[1,2"]
    assert override_problems(good) == []  # free-form nodes (model, hooks), groups and bad syntax: Hydra answers


# -- ranks ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_joining_ranks_that_never_come_times_out_with_a_message(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        Ranks.from_env().start("cpu", timeout_s=2)
    assert time.monotonic() - t0 < 30
    assert f"RANK=0 WORLD_SIZE=2: the ranks did not all meet at 127.0.0.1:{port} within 2 s" in str(err.value)
    assert not torch.distributed.is_initialized()


# -- torch.load --------------------------------------------------------------------------------------------
def test_pt_inputs_are_loaded_with_weights_only(bad_files, monkeypatch, run_cfg):
    seen = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k) or real(*a, **k))
    torch.save(torch.arange(24.0).reshape(4, 6), bad_files / "x.pt")
    cap = run_cfg([*MLP, f"+data.inputs.x={{file:{bad_files}/x.pt}}"])
    assert seen and all(k.get("weights_only") is True for k in seen)  # not torch >= 2.6's default: explicit
    assert cap.load("fc1", "output").shape == (4, 8)
    with pytest.raises(pickle.UnpicklingError):
        real(bad_files / "code.pt", weights_only=True)
    assert not (bad_files / "code_ran").exists()
