"""One hook scope (hookrun.capture.scope.HookScope) under every method's temporary hooks: an error raised inside them
leaves the model with no hook, whichever forward it comes from; no module outside hookrun/capture registers a torch
hook itself; and no module imports another module's private name (the methods stand side by side on their floor)."""
import ast
import functools
import importlib.util
from pathlib import Path

import pytest
import torch

import hookrun
from hookrun.capture.hooks import hook_count
from hookrun.capture.scope import HookScope
from hookrun.capture.tokens import TokenInfo
from hookrun.experiments.lm import causal_lm, tokenizer

PACKAGE = Path(hookrun.__file__).parent
REGISTER = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
            "register_full_backward_pre_hook", "register_hook", "register_post_accumulate_grad_hook"}
# private names read/plot.py still imports: it moves into read/plots/ (the readers' change), which empties this list
ALLOWED = {("read/plot.py", "hookrun.read.captures", "_override_columns")}


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _module_of(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative ones resolved against `path`)."""
    if not node.level:
        return node.module or ""
    parts = ("hookrun",) + path.relative_to(PACKAGE).with_suffix("").parts
    base = parts[:len(parts) - node.level]
    return ".".join(base + ((node.module,) if node.module else ()))


@functools.lru_cache(maxsize=None)
def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def private_imports(paths=None):
    """(file, module, name) of every hookrun module's import of another hookrun module's `_name` (a from-import,
    multi-line ones included, or `module._name` on a module imported whole); `paths`: the files (all of hookrun)."""
    found = []
    for path in paths or _sources():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(PACKAGE).as_posix()
        modules = {}  # a local name bound to a hookrun module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _module_of(path, node)
                if not module.startswith("hookrun"):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append((rel, module, alias.name))
                    elif _is_module(f"{module}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("hookrun") and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append((rel, modules[node.value.id], node.attr))
    return found


def test_no_module_imports_another_modules_private_name():
    found = set(private_imports())
    assert found <= ALLOWED, sorted(found - ALLOWED)


def test_the_private_import_check_sees_multi_line_and_module_imports():
    probe = PACKAGE / "methods" / "_probe_private_imports.py"
    probe.write_text("from hookrun.methods.paired import (dims,\n    _hidden)\nfrom hookrun.capture import tokens as t\n"
                     "x = t._private\n")
    try:
        found = private_imports([probe])
    finally:
        probe.unlink()
    assert found == [("methods/_probe_private_imports.py", "hookrun.methods.paired", "_hidden"),
                     ("methods/_probe_private_imports.py", "hookrun.capture.tokens", "_private")]


def test_no_module_outside_capture_registers_a_torch_hook():
    found = []
    for path in _sources():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("capture/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in REGISTER:
                found.append(f"{rel}:{node.lineno} {node.attr}")
    assert not found


def test_a_scope_removes_its_hooks_on_an_error_and_can_be_filled_again():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.raises(RuntimeError, match="inside"):
        with HookScope() as scope:
            scope.forward(model[0], lambda m, a, o: o * 2)
            scope.pre(model[1], lambda m, a: None)
            scope.tensor(model[0].weight, lambda g: g)
            assert hook_count(model) == 3 and len(scope) == 3  # a parameter's tensor hook counts too
            raise RuntimeError("inside")
    assert hook_count(model) == 0 and len(scope) == 0 and not model[0].weight._backward_hooks
    scope.forward(model[0], lambda m, a, o: o + 1)
    x = torch.ones(1, 2)
    assert torch.equal(model(x), torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias) + 1))
    scope.remove()
    assert hook_count(model) == 0


# -- an error inside each method's temporary hooks ------------------------------------------------------------------
class Boom(RuntimeError):
    pass


def _bomb(module: torch.nn.Module, at: int):
    """Makes module's forward raise Boom at its `at`-th call (an attribute, not a hook: hook_count sees none)."""
    forward, calls = module.forward, [0]

    def bombed(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise Boom(f"call {at}")
        return forward(*args, **kwargs)
    module.forward = bombed
    return lambda: module.__dict__.pop("forward")


def _model():
    torch.manual_seed(0)
    return causal_lm(n_layer=2, n_embd=32, n_head=4).eval()


def _pair():
    tok = tokenizer()
    texts = ["the hooks run on a model", "a store of captures"]
    clean = [([tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] * 3)[:6] for t in texts]
    corrupt = [s[:2] + [(s[2] + 7) % 500] + s[3:] for s in clean]

    def batch(seqs):
        ids = torch.tensor(seqs)
        mask = torch.ones_like(ids)
        return ({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1)},
                TokenInfo.of_batch(mask.bool(), mask.bool(), 64))
    return batch(clean), batch(corrupt)


def _metric(logits, ids):
    return logits[torch.arange(len(ids)), -1, 5] - logits[torch.arange(len(ids)), -1, 7]


def _patching(model):
    from hookrun.methods.patching import Noise, patch_grid

    (c, ic), (t, it) = _pair()
    patch_grid(model, c, t, ic, it, ["blocks.*"], metric=_metric, positions="all", sites_per_forward="auto",
               target_noise=Noise(positions=[1], std=0.1))


def _attribution(method):
    def run(model):
        from hookrun.methods.attribution import attribution_grid

        (c, ic), (t, it) = _pair()
        attribution_grid(model, c, t, ic, it, ["blocks.*.attn.heads"], heads="all", metric=_metric, method=method,
                         steps=2)
    return run


def _circuits(method):
    def run(model):
        from hookrun.methods.circuits.scores import edge_scores
        from hookrun.methods.circuits.evaluate import evaluate_circuits, patch_edges
        from hookrun.methods.circuits.graph import circuit_graph

        (c, _), (t, _) = _pair()
        g = circuit_graph(model)
        s = edge_scores(model, g, c, t, _metric, method=method, steps=2 if method != "eap" else None)
        patch_edges(model, g, t, torch.ones(len(g.senders), 2, 6, 32), [0, 1], _metric)
        evaluate_circuits(model, g, c, t, torch.ones(1, len(g), dtype=torch.bool), _metric)
        assert s.scores.shape[-1] == len(g)
    return run


def _lens(model):
    hookrun.lens(model, [[1, 2, 3, 4], [5, 6, 7]], layers="blocks.*", positions="all", k=2)


def _dla(model):
    hookrun.dla(model, [[1, 2, 3, 4], [5, 6, 7]], [5, 7])


def _features(model):
    from hookrun.methods.saes import SparseAutoencoder

    torch.manual_seed(1)
    sae = SparseAutoencoder(32, 16)
    hookrun.features(model, [[1, 2, 3, 4], [5, 6, 7]], sae, site="blocks.1", k=4, evaluate=True)


def _inspect(model):
    from hookrun.engine.inspect import describe, describe_anatomy

    ids = {"input_ids": torch.tensor([[1, 2, 3]])}
    describe(model, [], ids)
    describe_anatomy(model, [], ids, (1, 3))


METHODS = {"patching": _patching, "attribution": _attribution("gradient"), "ig": _attribution("integrated_gradients"),
           "eap": _circuits("eap"), "eap_ig_activations": _circuits("eap_ig_activations"), "lens": _lens, "dla": _dla,
           "features": _features, "inspect": _inspect}


@pytest.mark.parametrize("name", list(METHODS))
def test_an_error_inside_a_methods_hooks_leaves_the_model_without_hooks(name):
    """The final norm raises at its 1st, 2nd, ... call: every forward the method runs is cut short once, with its
    hooks on; each time the model keeps no hook (hookrun.capture.hooks.hook_count), and without the error the
    method runs through."""
    model = _model()
    raised = 0
    for at in range(1, 9):
        restore = _bomb(model.transformer.ln_f, at)
        try:
            METHODS[name](model)
        except Boom:
            raised += 1
        finally:
            restore()
        assert hook_count(model) == 0, (name, at)
    assert raised >= 2
    METHODS[name](model)
    assert hook_count(model) == 0


def test_an_error_inside_generation_leaves_the_model_without_hooks():
    """A generate run whose model fails at a decoding step (its pass pre-hook and the run's hooks on)."""
    model, tok = _model(), tokenizer()
    for at in (5, 20):  # the first-batch check, then a decoding step
        restore = _bomb(model.transformer.ln_f, at)
        try:
            with pytest.raises(Boom):
                hookrun.run("lm_tokens", ["generate.max_new_tokens=3", "data.batch_size=4"],
                            model=model, tokenizer=tok, store={"path": "memory"}, quiet=True)
        finally:
            restore()
        assert hook_count(model) == 0
