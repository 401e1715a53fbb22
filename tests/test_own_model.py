"""Your own model and tokenizer in one override (issue 56): `model=hf model.path=DIR` uses the folder's
tokenizer.json where AutoTokenizer would rebuild it as the model type's own (a WordLevel tokenizer beside a Qwen2
config came back as Qwen2Tokenizer, every word one id), the run says which tokenizer class it built, and a
tokenizer that maps most of the first batch to one id or to the unknown token is warned about; a wrong model.path
is exit 2 with hookrun's message alone; a refused key says how to drop it on the command line."""
import logging

import pytest
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

import hookrun
from hookrun.data.text import dominant_problem
from hookrun.engine.runner import run
from tests.helpers import make_cfg, run_cli

WORDS = "the cat sat on a mat dog ran far away and then came back home".split()
DOCS = ["the cat sat on a mat", "a dog ran far away", "and then the dog came back home", "the cat ran home",
        "then a cat came", "the dog sat on the mat and ran far away"]


@pytest.fixture(scope="module")
def qwen2_wordlevel(tmp_path_factory):
    """A folder: a tiny random Qwen2 and a WordLevel tokenizer.json (one id a word), as save_pretrained writes them;
    and a corpus file of DOCS."""
    folder = tmp_path_factory.mktemp("qwen2_wordlevel")
    vocab = {"[UNK]": 0, "[PAD]": 1, "[BOS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                     bos_token="[BOS]")
    tok.save_pretrained(folder)
    config = tf.Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, pad_token_id=1,
                            eos_token_id=None)
    tf.Qwen2ForCausalLM(config).save_pretrained(folder)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(DOCS) + "\n")
    return folder, corpus


def test_auto_tokenizer_rebuilds_the_file_as_the_model_types_own(qwen2_wordlevel):
    """The upstream behaviour this guards against, so the test notices when transformers changes it."""
    folder, _ = qwen2_wordlevel
    auto = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert len(set(auto("the cat sat on a mat")["input_ids"])) == 1  # every word one id


def test_model_hf_stores_the_folders_own_tokens_and_says_which_class(qwen2_wordlevel, tmp_path, caplog):
    folder, corpus = qwen2_wordlevel
    with caplog.at_level(logging.INFO, logger="hookrun"):
        cap = hookrun.open(run(make_cfg(["+experiment=lm_tokens", "model=hf", f"model.path={folder}",
                                         f"data.text.files=[{corpus}]", "layers=[blocks.0]",
                                         f"store.path={tmp_path / 'run.zarr'}"])))
    tokens = cap.tokens()
    per_doc = [list(tokens.query(f"sample == {i}")["token_id"]) for i in range(len(DOCS))]
    file = tf.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    assert per_doc == [[2, *file(doc)["input_ids"]] for doc in DOCS]  # the file's WordLevel ids, BOS first
    assert [t.strip() for t in tokens.query("sample == 0")["token"]] == ["[BOS]", *DOCS[0].split()]
    log = caplog.text
    assert "AutoTokenizer built Qwen2Tokenizer" in log and "using the file itself" in log
    assert "data.text.tokenizer: TokenizersBackend from" in log
    assert "tokens are one id" not in log


def test_a_tokenizer_mapping_most_tokens_to_one_id_is_warned_about(qwen2_wordlevel, tmp_path, caplog):
    """AutoTokenizer itself as data.text.tokenizer (the rebuilt Qwen2Tokenizer): the run warns in its first batch,
    naming the id, its token, the class and the fix."""
    folder, corpus = qwen2_wordlevel
    with caplog.at_level(logging.INFO, logger="hookrun"):
        run(make_cfg(["+experiment=lm_tokens", "model=hf", f"model.path={folder}", f"data.text.files=[{corpus}]",
                      "layers=[blocks.0]", "data.text.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
                      f"+data.text.tokenizer.pretrained_model_name_or_path={folder}", "~data.text.tokenizer.path",
                      f"store.path={tmp_path / 'run.zarr'}"]))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "one id" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    auto = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)  # the ids it stored, counted here
    ids = [i for d in DOCS for i in auto(d, add_special_tokens=False)["input_ids"]]
    top = max(set(ids), key=ids.count)
    assert ids.count(top) > len(ids) / 2
    assert (f"{ids.count(top)} of the first batch's {len(ids)} tokens are one id ({top}, "
            f"{auto.convert_ids_to_tokens(top)!r})") in warned[0]
    assert "the tokenizer is Qwen2Tokenizer" in warned[0] and "PreTrainedTokenizerFast(tokenizer_file=" in warned[0]


def test_dominant_problem_counts_the_unknown_token_and_leaves_specials_out(qwen2_wordlevel):
    folder, _ = qwen2_wordlevel
    tok = tf.PreTrainedTokenizerFast.from_pretrained(folder)
    unknown = [tok("zebra yak gnu the")["input_ids"]] * 5  # 15 of 20 are [UNK]
    assert "15 of the first batch's 20 tokens are the unknown token (0, '[UNK]')" in dominant_problem(unknown, tok)
    assert dominant_problem([[2] * 30 + [5, 6]], tok) is None  # BOS is special: 2 real tokens, fewer than 8
    words = [w for d in DOCS for w in d.split()] * 3
    assert words.count("the") < len(words) / 2
    assert dominant_problem([tok(d)["input_ids"] for d in DOCS] * 3, tok) is None


@pytest.mark.parametrize("kind", ["missing", "no_config"])
def test_a_wrong_model_path_is_exit_2_with_hookruns_message_alone(kind, tmp_path):
    """`model=hf model.path=DIR` where DIR is no folder, or a folder without config.json: exit 2, one problem naming
    model.path, the value and the fix, and no Hydra InstantiationException around it."""
    folder = tmp_path / "nope"
    if kind == "no_config":
        folder.mkdir()
    proc = run_cli("+experiment=lm_tokens", "model=hf", f"model.path={folder}", f"store.path={tmp_path / 'run.zarr'}",
                   check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert "1 problem(s) in the config" in said and f"model.path: '{folder}'" in said
    assert ("is not a folder" if kind == "missing" else "holds no config.json") in said
    assert "InstantiationException" not in said and "Traceback" not in said
    assert not (tmp_path / "run.zarr").exists()


def test_a_method_without_steps_over_an_experiment_that_sets_them_says_how_to_drop_them():
    """Sweeping circuit.method=eap over induction_circuit (method eap_ig, steps 16): the eap job is refused naming
    the command line's way to drop the key, and that way is a config the circuit block takes."""
    from hookrun.config.registry import method

    circuit = method("circuit")
    cfg = hookrun.compose("induction_circuit", overrides=["circuit.method=eap"])
    problems = circuit.check(cfg)
    assert any("circuit.steps: 16 but method is eap" in p and "'~circuit.steps' on the command line" in p
               for p in problems), problems
    assert not [p for p in circuit.check(hookrun.compose("induction_circuit",
                                                          overrides=["circuit.method=eap", "~circuit.steps"]))
                if "steps" in p]
