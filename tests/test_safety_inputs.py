"""A store knows what it was made from: a run stopped mid-way and resumed with other inputs (the model's weights in
a checkpoint file or in memory, a dictionary's folder, a data file, the tokenizer) is refused before anything is
written, naming what changed and how to start over; resumed with the same inputs it completes as one run would."""
import os
import signal

import pytest
import torch

import hookrun
from hookrun.config.checks import ConfigError
from hookrun.engine.runner import Interrupted
from hookrun.store.lock import LOCK_NAME
from hookrun.engine.fingerprint import SAMPLE, file_digest, model_digests, tensor_digest
from hookrun.experiments.lm import causal_lm, tokenizer
from hookrun.methods.saes import SparseAutoencoder, save_saelens
from tests.helpers import RANDOM, make_cfg, run_cli, run_in, same_store

D, D_SAE, LAYER = 32, 48, "transformer.h.0"
PROMPTS = ["the hooks run on a model", "a store", "every layer writes an array of captures", "tokens", "x",
           "generation is a loop", "one more line", "and the last"]
_calls = {"n": 0}


def stop_at(tensor):
    """An edit that leaves the tensor as it is, and sends SIGTERM to this process at its Nth call (N from
    HOOKRUN_TEST_STOP_CALL, once): a run killed mid-way, in process or on the command line."""
    stop = os.environ.get("HOOKRUN_TEST_STOP_CALL")
    if stop is not None:
        _calls["n"] += 1
        if _calls["n"] == int(stop):
            del os.environ["HOOKRUN_TEST_STOP_CALL"]
            _calls["n"] = 0
            os.kill(os.getpid(), getattr(signal, os.environ.pop("HOOKRUN_TEST_STOP_SIGNAL", "SIGTERM")))
    return tensor


STOP = ["+hooks.stop={kind:forward,layers:[transformer.h.1],capture:[],edit:[{_target_:tests.test_safety_inputs.stop_at}]}"]


def gpt2_lm():
    return causal_lm(n_layer=2, n_embd=D, n_head=4, vocab_size=512, n_positions=64)


def mlp_from(path):
    """tests.models.MLP with the weights of a checkpoint file (a model config naming its checkpoint)."""
    from tests.models import MLP

    model = MLP()
    model.load_state_dict(torch.load(path))
    return model


def save_sae(path, seed):
    torch.manual_seed(seed)
    sae = SparseAutoencoder(D, D_SAE, hook_name=LAYER)
    with torch.no_grad():
        sae.b_enc.normal_(std=0.5)
    return save_saelens(sae, path, hook_name=LAYER)


def text_overrides(corpus, *extra):
    return ["+experiment=lm_tokens", "model._target_=tests.test_safety_inputs.gpt2_lm", "~model.n_layer",
            "~model.n_embd", "~model.n_head", "~model.vocab_size", "~model.n_positions", f"data.text.files=[{corpus}]",
            "data.batch_size=2", "store.commit_s=0", "store.chunk_rows=4", *STOP, *extra]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def files_of(path):
    """Every file of a store with its bytes: what a refused resume must leave as it was."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != LOCK_NAME}


def refused(path, run, *expected):
    """`run()` refused with a ConfigError holding each of `expected`, the store's files untouched."""
    before = files_of(path)
    with pytest.raises(ConfigError) as err:
        run()
    msg = str(err.value)
    for text in expected:
        assert text in msg, msg
    assert files_of(path) == before
    return msg


# -- the fingerprint rule ----------------------------------------------------------------------------------
def test_a_parameter_digest_sees_a_change_at_a_sampled_element_its_shape_and_its_dtype():
    t = torch.arange(3 * SAMPLE, dtype=torch.float32)
    base = tensor_digest(t)
    assert tensor_digest(t.clone()) == base
    changed = t.clone()
    changed[-1] += 1  # the last element is always sampled
    assert tensor_digest(changed) != base
    assert tensor_digest(t.reshape(3, SAMPLE)) != base and tensor_digest(t.double()) != base
    skipped = t.clone()
    skipped[1] += 1  # between two sampled elements: the rule's documented blind spot
    assert tensor_digest(skipped) == base
    small = torch.randn(10, dtype=torch.bfloat16)  # every element of a small tensor, any dtype
    other = small.clone()
    other[5] += 1
    assert tensor_digest(small) != tensor_digest(other)
    assert tensor_digest(torch.empty(4, 4, device="meta")) == tensor_digest(torch.empty(4, 4, device="meta"))


def test_a_file_digest_reads_every_byte_of_a_small_file(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"\0" * 100_000)
    base = file_digest(f)
    f.write_bytes(b"\0" * 50_000 + b"\1" + b"\0" * 49_999)
    assert file_digest(f) != base


def test_a_store_records_its_inputs(tmp_path, corpus):
    sae = save_sae(tmp_path / "sae", 3)
    run_in(tmp_path / "s.zarr", text_overrides(corpus, f"+dictionaries={{sae1:{{path:{sae}}}}}"))
    inputs = hookrun.open(tmp_path / "s.zarr").attrs["inputs"]
    torch.manual_seed(0)
    assert inputs["model"] == {f"parameter {k}": v for k, v in model_digests(gpt2_lm()).items()}
    assert inputs["dictionaries.sae1"] == {f"file {sae}/{n}": file_digest(sae / n)
                                           for n in ("cfg.json", "sae_weights.safetensors")}
    assert inputs["data"] == {f"file {corpus}": file_digest(corpus)}
    assert set(inputs["tokenizer"]) == {"definition"}


# -- each input, changed between the kill and the resume ------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_file_rewritten_between_kill_and_resume_is_refused_from_the_cli(tmp_path):
    from tests.models import MLP

    ckpt = tmp_path / "ckpt.pt"
    torch.manual_seed(1)
    torch.save(MLP().state_dict(), ckpt)
    path = tmp_path / "s.zarr"
    args = [*RANDOM, "~model._target_", f"+model={{_target_:tests.test_safety_inputs.mlp_from,path:{ckpt}}}",
            f"store.path={path}"]
    proc = run_cli(*args, check=False, env={"HOOKRUN_TEST_STOP_AT": "13"})
    assert proc.returncode != 0 and hookrun.open(path).status == "interrupted"
    torch.manual_seed(2)
    torch.save(MLP().state_dict(), ckpt)  # other weights, same path
    before = files_of(path)
    proc = run_cli(*args, "store.mode=resume", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"resume refused, {path} was made from other inputs: the model's weights (" in out
    assert f"file {ckpt}" in out and "parameter fc1.weight" in out and "store.mode=overwrite" in out
    assert "Traceback" not in out and files_of(path) == before


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_an_sae_folder_rewritten_between_kill_and_resume_is_refused_from_the_cli(tmp_path, corpus):
    sae = save_sae(tmp_path / "sae", 3)
    path = tmp_path / "s.zarr"
    args = [*text_overrides(corpus, f"+dictionaries={{sae1:{{path:{sae}}}}}",
                            "+hooks.feats={kind:forward,layers:[transformer.h.0],dictionary:sae1,top_k:8}"),
            f"store.path={path}"]
    proc = run_cli(*args, check=False, env={"HOOKRUN_TEST_STOP_CALL": "4"})
    assert proc.returncode != 0 and hookrun.open(path).status == "interrupted", proc.stderr
    save_sae(sae, 4)  # the folder rewritten with other weights, the same path and cfg.json
    before = files_of(path)
    proc = run_cli(*args, "store.mode=resume", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"was made from other inputs: dictionaries.sae1 (1 changed: file {sae}/sae_weights.safetensors)" in out
    assert "Traceback" not in out and files_of(path) == before
    save_sae(sae, 3)  # the original weights back: the resume goes on, and equals one whole run
    run_cli(*args, "store.mode=resume")
    run_in(tmp_path / "whole.zarr", text_overrides(corpus, f"+dictionaries={{sae1:{{path:{sae}}}}}",
                                                   "+hooks.feats={kind:forward,layers:[transformer.h.0],"
                                                   "dictionary:sae1,top_k:8}"))
    same_store(hookrun.open(tmp_path / "whole.zarr"), hookrun.open(path))


def test_a_data_file_edited_between_kill_and_resume_is_refused(tmp_path, corpus):
    path = tmp_path / "s.zarr"
    os.environ["HOOKRUN_TEST_STOP_CALL"] = "4"
    with pytest.raises(BaseException, match="SIGTERM"):
        run_in(path, text_overrides(corpus))
    corpus.write_text(corpus.read_text().replace("a store", "a stare"))
    refused(path, lambda: run_in(path, [*text_overrides(corpus), "store.mode=resume"]),
            f"was made from other inputs: the data files (1 changed: file {corpus})", "store.mode=overwrite")


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_a_data_file_or_the_tokenizer_changed_between_kill_and_resume_is_refused_from_the_cli(tmp_path, corpus):
    """One run killed (SIGTERM at batch 2) from the CLI, its tokenizer a folder (AutoTokenizer.from_pretrained):
    the data file edited, then the tokenizer folder saved again with a token added (the prompts tokenize as
    before): each resume from the CLI is refused with exit 2 naming only what changed, the store untouched; with
    both restored the resume completes."""
    from transformers import AutoTokenizer

    tok = tmp_path / "tok"
    tokenizer().save_pretrained(tok)
    path = tmp_path / "s.zarr"
    args = [*text_overrides(corpus), "~data.text.tokenizer.vocab_size",
            "data.text.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
            f"+data.text.tokenizer.pretrained_model_name_or_path={tok}", f"store.path={path}"]
    proc = run_cli(*args, check=False, env={"HOOKRUN_TEST_STOP_CALL": "4"})
    assert proc.returncode != 0 and hookrun.open(path).status == "interrupted", proc.stderr
    assert set(hookrun.open(path).attrs["inputs"]) == {"model", "data", "tokenizer"}
    before, text = files_of(path), corpus.read_text()

    def refused_from_the_cli(*expected):
        proc = run_cli(*args, "store.mode=resume", check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        for part in (f"resume refused, {path} was made from other inputs: ", *expected, "store.mode=overwrite"):
            assert part in out, out
        assert "Traceback" not in out and files_of(path) == before
        return out

    corpus.write_text(text.replace("a store", "a stare"))
    out = refused_from_the_cli(f"the data files (1 changed: file {corpus})")
    assert "tokenizer" not in out.split("resume refused")[1].split("\n")[0]
    corpus.write_text(text)
    other = AutoTokenizer.from_pretrained(tok)
    other.add_tokens(["hookrunzz"])
    other.save_pretrained(tok)
    out = refused_from_the_cli("the tokenizer (1 changed: definition)")
    assert "data files" not in out
    tokenizer().save_pretrained(tok)
    run_in(path, [*args[:-1], "store.mode=resume"])
    assert hookrun.open(path).status == "complete"


def interrupted_run(path, model, tok=None, call=4):
    os.environ["HOOKRUN_TEST_STOP_CALL"] = str(call)
    try:
        with pytest.raises(Interrupted):
            hookrun.run("lm_tokens", ["data.max_samples=8", "data.batch_size=2", "store.commit_s=0", *STOP],
                        model=model, tokenizer=tok or tokenizer(), data={"text": {"tokenizer": None}},
                        store={"path": str(path)})
    finally:
        os.environ.pop("HOOKRUN_TEST_STOP_CALL", None)
    assert hookrun.open(path).status == "interrupted"


def resume(path, model, tok=None):
    return hookrun.run("lm_tokens", ["data.max_samples=8", "data.batch_size=2", "store.commit_s=0", *STOP],
                       model=model, tokenizer=tok or tokenizer(), data={"text": {"tokenizer": None}},
                       store={"path": str(path), "mode": "resume"})


def test_a_run_on_model_a_resumed_with_model_b_is_refused_from_python(tmp_path):
    torch.manual_seed(3)
    a = causal_lm(n_layer=2, n_embd=64, n_head=4).eval()
    torch.manual_seed(4)
    b = causal_lm(n_layer=2, n_embd=64, n_head=4).eval()
    path = tmp_path / "s.zarr"
    interrupted_run(path, a)
    msg = refused(path, lambda: resume(path, b), f"resume refused, {path} was made from other inputs: the model's "
                  "weights (", "parameter transformer.wte.weight", "store.mode=overwrite")
    assert "dictionaries" not in msg and "data files" not in msg and "tokenizer" not in msg
    resume(path, a)  # the same model: it goes on, and equals one whole run
    hookrun.run("lm_tokens", ["data.max_samples=8", "data.batch_size=2", "store.commit_s=0", *STOP], model=a,
                tokenizer=tokenizer(), data={"text": {"tokenizer": None}}, store={"path": str(tmp_path / "w.zarr")})
    same_store(hookrun.open(tmp_path / "w.zarr"), hookrun.open(path))


def test_a_run_resumed_with_another_tokenizer_is_refused_from_python(tmp_path):
    torch.manual_seed(3)
    model = causal_lm(n_layer=2, n_embd=64, n_head=4).eval()
    path = tmp_path / "s.zarr"
    interrupted_run(path, model)
    other = tokenizer()
    other.add_tokens(["hookrunzz"])
    refused(path, lambda: resume(path, model, other), "was made from other inputs: the tokenizer (1 changed: "
            "definition)")


def test_a_store_from_before_fingerprints_resumes_with_a_warning(tmp_path, caplog):
    import zarr

    from tests.helpers import interrupted_store

    path = tmp_path / "s.zarr"
    interrupted_store(path)
    group = zarr.open_group(str(path), mode="r+")
    group.attrs.update({"inputs": None})  # as a store written before inputs were recorded
    run_in(path, [*RANDOM, "store.mode=resume"])
    assert "records no fingerprints of its inputs" in caplog.text
    assert hookrun.open(path).status == "complete"


def test_a_ctrl_c_of_hookrun_run_names_the_store_path_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(3)
    model = causal_lm(n_layer=2, n_embd=64, n_head=4).eval()
    path = tmp_path / "mine" / "run.zarr"
    monkeypatch.setenv("HOOKRUN_TEST_STOP_SIGNAL", "SIGINT")
    monkeypatch.setenv("HOOKRUN_TEST_STOP_CALL", "4")
    with pytest.raises(KeyboardInterrupt) as err:
        hookrun.run("lm_tokens", ["data.max_samples=8", "data.batch_size=2", "store.commit_s=0", *STOP], model=model,
                    tokenizer=tokenizer(), data={"text": {"tokenizer": None}}, store={"path": str(path)})
    assert str(err.value) == (f"interrupted: the finished batches are committed in {path}; continue with the same "
                              f"call plus store={{'path': '{path}', 'mode': 'resume'}}")
    assert hookrun.open(path).status == "interrupted"


# -- dictionaries checked before the model is built --------------------------------------------------------
_built = []


def counted_lm():
    """gpt2_lm, counting its builds: a refusal before the model is built leaves the count at 0."""
    _built.append(1)
    return gpt2_lm()


def dictionary_refusal(tmp_path, corpus, spec, layer=LAYER):
    _built.clear()
    overrides = [*text_overrides(corpus), "model._target_=tests.test_safety_inputs.counted_lm",
                 f"+dictionaries={{sae1:{spec}}}",
                 f"+hooks.feats={{kind:forward,layers:[{layer}],dictionary:sae1,top_k:4}}"]
    with pytest.raises(ConfigError) as err:
        run_in(tmp_path / "x.zarr", overrides)
    assert not (tmp_path / "x.zarr").exists()
    return str(err.value)


def test_an_sae_with_a_nan_or_inf_weight_is_refused_naming_the_tensor_before_the_model(tmp_path, corpus):
    from safetensors.torch import load_file, save_file

    sae = save_sae(tmp_path / "sae", 3)
    state = load_file(sae / "sae_weights.safetensors")
    state["W_dec"][5, 7] = float("inf")
    save_file(state, sae / "sae_weights.safetensors")
    msg = dictionary_refusal(tmp_path, corpus, f"{{path:{sae}}}")
    assert (f"dictionaries.sae1.path: dictionary {sae}/sae_weights.safetensors: tensor W_dec holds 1 NaN or inf "
            "value(s) (the first at [5, 7]: inf)") in msg
    assert _built == []


def test_an_sae_with_shapes_other_than_its_cfg_is_refused_before_the_model(tmp_path, corpus):
    import json

    sae = save_sae(tmp_path / "sae", 3)
    cfg = json.loads((sae / "cfg.json").read_text())
    (sae / "cfg.json").write_text(json.dumps({**cfg, "d_sae": 64}))
    msg = dictionary_refusal(tmp_path, corpus, f"{{path:{sae}}}")
    assert "shapes do not match cfg.json's d_in=32, d_sae=64" in msg and _built == []
    (sae / "sae_weights.safetensors").write_bytes(b"not a tensor file")
    assert "is not a readable safetensors file" in dictionary_refusal(tmp_path, corpus, f"{{path:{sae}}}")


def test_an_sae_trained_on_another_layer_is_refused_naming_both_unless_allowed(tmp_path, corpus):
    sae = save_sae(tmp_path / "sae", 3)  # trained on transformer.h.0 (cfg.json's hook_name), the width of every block
    msg = dictionary_refusal(tmp_path, corpus, f"{{path:{sae}}}", layer="transformer.h.1")
    assert ("hooks.feats.layers: dictionary sae1 was trained on transformer.h.0 (cfg.json's hook_name), but this hook "
            "reads it at transformer.h.1; read it at layer 0, or set dictionaries.sae1.any_layer=true") in msg
    run_in(tmp_path / "ok.zarr", [*text_overrides(corpus), f"+dictionaries={{sae1:{{path:{sae},any_layer:true}}}}",
                                  "+hooks.feats={kind:forward,layers:[transformer.h.1],dictionary:sae1,top_k:4}"])
    assert hookrun.open(tmp_path / "ok.zarr").status == "complete"


def test_the_documented_folder_override_of_sae_features_is_checked_before_the_model_and_takes_dtype(tmp_path):
    """`dictionaries.mood={path: DIR}` on the bundled experiment (whose entry has its own loader): a damaged folder
    refused before the model is built, with the key named; `dtype` accepted and used."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    sae = save_saelens(SparseAutoencoder(64, 16, hook_name="transformer.h.1"), tmp_path / "sae",
                       hook_name="transformer.h.1")
    state = load_file(sae / "sae_weights.safetensors")
    state["b_enc"][3] = float("nan")
    save_file(state, sae / "sae_weights.safetensors")
    proc = run_cli("+experiment=sae_features", f"dictionaries.mood={{path: {sae}, dtype: float64}}",
                   "data.text.max_documents=4", f"store.path={tmp_path / 'x.zarr'}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "dictionaries.mood.path: dictionary" in out and "tensor b_enc holds 1 NaN" in out
    assert "1 problem(s)" in out and "Traceback" not in out and not (tmp_path / "x.zarr").exists()
