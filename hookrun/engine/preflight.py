"""Does the data fit the model, and the config what the model produces? The first batch, checked before any
store is created; and one batch as the run computes it (`step`), whose failures name the batch.

    problems = first_batch_problems(job)                     # job: a hookrun.engine.build.Run; [] or one line a problem
    result = step(job, i, batch, hookset)   # a BatchResult: batch, loss, forward_s, backward_s, columns, tables

The first batch must load (collate), fill the recorded fields (data.record) and bind to `forward`'s
signature. Then its first sample, and its first two, run as the run runs them (the run's mode, the hooks,
the loss and the backward pass, and on the first sample the methods; buffers and gradients put back after), with
a sink that stores nothing.
What they capture must fit the config: every `select`, `reduce`, `dtype`, `positions`, edit and loss works
on it, every role named in `capture:` or in an edit's `roles:` is one the layers produce, every hook
captures something, and every dtype can be stored. Whether each array's axis 0 follows the batch size (a
row per sample) or not (a per-batch tensor, like Llama's [1, T] position ids) is decided here, from the
two sizes, and kept for the whole run (HookPlan.per_batch).

A batch size the run never uses that the model cannot take (one sample in a BatchNorm in train mode) falls
back to the whole first batch; a last batch that the model cannot take is refused. A failure that is the
config's (a hook setting, an edit, the loss, the inputs' dtype or shape) is a problem naming the key; any
other error is the model's own and is raised as is.
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch

from hookrun.config.checks import ConfigError
from hookrun.data.inputs import seed_everything
from hookrun.capture.hooks import KINDS, BatchError, BatchInfo, HookError, HookSet, forward, matches
from hookrun.data.samples import sample_table
from hookrun.threads import one_thread
from hookrun.methods import BatchResult, nonfinite_cause, nonfinite_weights
from hookrun.capture.layers import ROOT
from hookrun.store import NonFiniteError, StoreError
from hookrun.format.layout import ATTRIBUTION, DLA, LENS, PATCHING, to_stored

FIX = ("set data.targets=[...] for fields that go to the loss, not the model; data.fields=[...] to name a "
       "dataset's tuple items; data.keyword=true to pass inputs by name")
INPUT_ERRORS = ("dtype", "scalar type", "type (", "shapes cannot be multiplied", "size mismatch", "must match the size",
                "Expected", "expected input", "positional argument", "unexpected keyword")
NAMED = (HookError, StoreError, NonFiniteError)  # errors that already name their key, site and batch


def _describe(batch) -> str:
    def one(v):
        return f"{list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else type(v).__name__
    parts = [f"input.{i} {one(a)}" for i, a in enumerate(batch.args)]
    parts += [f"{k} {one(v)}" for k, v in batch.kwargs.items()]
    return ", ".join(parts) or "no inputs"


def _first(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# -- one batch --------------------------------------------------------------------------------------------------
@contextmanager
def _doing(info: BatchInfo, what: str):
    """Errors inside raise BatchError naming the batch, its samples and `what` failed (named errors pass)."""
    try:
        yield
    except NAMED:
        raise
    except Exception as err:  # noqa: BLE001 - every failure of a batch names the batch
        message = "; ".join(err.problems) if isinstance(err, ConfigError) else f"{type(err).__name__}: {err}"
        raise BatchError(f"batch {info.index} (samples {info.start}..{info.stop}): {what} failed: {message}",
                         what) from err


# torch warns when a full backward hook fires on a module none of whose inputs need a gradient (the first layer of a
# model): the hook still gets grad_output, which is what kind: backward captures there (its grad_input roles are None)
BACKWARD_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"


def step(job, i: int, batch, hookset: HookSet, measure: bool = True):
    """Batch `i` of the run `job` (a hookrun.engine.build.Run): seed, forward, loss, backward, with the hooks of
    `hookset`, then its methods' measures (metrics, patching grid, lens, ...; `measure=False`: none); returns a
    BatchResult whose columns are the metrics. A failure raises BatchError (or the hooks' and store's own errors,
    which name the batch)."""
    seed_everything(job.cfg.seed + i)  # each batch's randomness (dropout) is its own: resumable
    batch = batch.to(job.device)
    info = BatchInfo(i, batch.start, batch.stop, job.inputs.batched, batch.tokens, batch.fields)
    args, kwargs = hookset.begin_batch(info, batch.args, batch.kwargs)
    t0 = time.perf_counter()
    with _doing(info, "the forward pass"):
        output = forward(job.model, args, kwargs, job.plans)
    loss = None
    if job.loss_fn is not None:
        with _doing(info, "the loss"):
            loss = job.loss_fn(output, batch)
    t1 = time.perf_counter()
    if loss is not None:
        job.model.zero_grad(set_to_none=True)
        with _doing(info, "the backward pass"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=BACKWARD_HOOK_WARNING)  # a hooked first layer: on purpose
            loss.backward()
    t2 = time.perf_counter()
    hookset.end_batch()
    columns, spent = {}, {}
    for method in job.methods:
        if not measure:
            method.skip(job)
            continue
        with _doing(info, "the metrics"):
            t3 = time.perf_counter()
            columns.update(method.measure(job, i, batch, output, hookset))
            spent[method.key] = time.perf_counter() - t3  # its own passes (a circuit's scores, a grid's patches)
    return BatchResult(batch, loss, t1 - t0, t2 - t1, columns=columns, methods_s=spent)


def numbered(batches, inputs, first: int) -> Iterator[tuple]:
    """(batch number, batch) from batch `first` on; a batch that does not load raises BatchError naming it, its
    samples and (for a dataset with __getitem__) the first item that raises."""
    it, i = iter(batches), first
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as err:  # noqa: BLE001 - named below
            raise _load_error(inputs, i, err) from err
        yield i, batch
        i += 1


def _load_error(inputs, i: int, err: Exception) -> BatchError:
    ranges = inputs.ranges()
    span = ranges[i] if ranges is not None and i < len(ranges) else None
    what = f"batch {i}" + (f" (samples {span[0]}..{span[1]})" if span else "")
    cause = "; ".join(err.problems) if isinstance(err, ConfigError) else f"{type(err).__name__}: {_first(str(err))}"
    dataset = getattr(inputs, "dataset", None)
    if span is not None and dataset is not None and hasattr(dataset, "__getitem__"):
        for j in range(*span):  # which item: the loader's error does not say (nor does a worker's traceback)
            try:
                dataset[j]
            except Exception as item_err:  # noqa: BLE001
                cause = (f"item {j} raises {type(item_err).__name__}: {_first(str(item_err))}; fix or skip that item "
                         "in the dataset")
                break
    return BatchError(f"{what}: loading its data failed: {cause}", "loading")


# -- the first-batch check -------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Trial:
    """The first `size` samples of the first batch, run as the run runs them."""

    size: int
    error: Optional[BaseException] = None
    hookset: Optional[HookSet] = None
    captured: set = dataclasses.field(default_factory=set)  # hooks that captured something
    problems: List[str] = dataclasses.field(default_factory=list)  # captures the store cannot hold
    nonfinite: Dict[str, tuple] = dataclasses.field(default_factory=dict)  # a method's array -> (its key, count)


def _head(batch, n: int):
    """The first `n` samples of a batch: model inputs, targets, fields and tokens."""
    size = batch.stop - batch.start
    if n >= size:
        return batch
    cut = lambda v: v[:n] if (isinstance(v, list) or isinstance(v, torch.Tensor) and v.dim()) and len(v) == size \
        else v  # noqa: E731
    tokens = batch.tokens
    if tokens is not None:
        tokens = tokens.head(n)
    return dataclasses.replace(batch.head(n), targets={k: cut(v) for k, v in batch.targets.items()},
                               fields={k: cut(v) for k, v in batch.fields.items()}, tokens=tokens, table=None)


def _trial(job, batch, size: int, measure: bool = True) -> _Trial:
    """Run the first `size` samples with every hook and a sink that only looks, and (`measure`) the methods;
    model buffers (BatchNorm statistics) and gradients are put back, so the run's first batch sees the model as it
    was."""
    trial = _Trial(size)

    def sink(capture):
        site, t = capture.site, capture.tensor
        trial.captured.add(site.hook)
        key = result_key(site)
        if key is not None and t.is_floating_point():
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad:
                trial.nonfinite.setdefault(f"{site.hook}/{site.layer}/{site.role}", (key, bad))
        try:
            to_stored(t.detach()[:0].cpu() if t.dim() else t.detach().cpu())
        except (TypeError, RuntimeError) as err:
            trial.problems.append(f"hooks.{site.hook}.dtype: {site.layer} {site.role} is "
                                  f"{str(t.dtype).replace('torch.', '')}, which the store cannot hold ({err}); set "
                                  f"hooks.{site.hook}.dtype=float32 (or another numpy dtype)")

    model = job.model
    saved = {k: v.detach().clone() for k, v in model.named_buffers()} if model.training else {}
    try:
        with job.hooked(sink, observe=True) as hookset:
            trial.hookset = hookset
            step(job, 0, _head(batch, size), hookset, measure)
    except Exception as err:  # noqa: BLE001 - sorted out by the caller
        trial.error = err
    finally:
        with torch.no_grad():
            buffers = dict(model.named_buffers())
            for k, v in saved.items():
                buffers[k].copy_(v)
        model.zero_grad(set_to_none=True)
    return trial


def _config_problem(err: BaseException, batch, job) -> List[str]:
    """The problem a failed trial shows, if it is the config's; raises the model's own errors as they are."""
    model = job.model
    if isinstance(err, HookError) and err.key:
        return [str(err)]
    cause = err.__cause__ if isinstance(err, BatchError) else None
    owner = next((m for m in job.methods if isinstance(cause, m.config_errors)), None)
    if isinstance(err, BatchError) and err.what == "the metrics" and owner is not None:
        return [str(cause) if getattr(cause, "key", None) else f"{owner.key}: the first batch: {cause}"]
    if isinstance(err, BatchError) and err.what == "the loss":
        if isinstance(cause, ConfigError):
            return cause.problems
        return [f"loss: computing it on the first batch's output failed: {type(cause).__name__}: "
                f"{_first(str(cause))}; check loss.name, loss.index, loss.output and loss.target against the model's "
                "output and the data"]
    if isinstance(err, BatchError) and err.what == "the forward pass" and isinstance(cause, (TypeError, ValueError,
                                                                                             RuntimeError, IndexError)):
        message = _first(str(cause)) or type(cause).__name__
        if any(hint in message for hint in INPUT_ERRORS):
            return [f"data: the first batch ({_describe(batch)}) does not fit {type(model).__name__}: "
                    f"{type(cause).__name__}: {message}; check the inputs' dtype and shape (data.inputs.<x>.dtype, "
                    f"the dataset's transform) or {FIX}"]
    raise cause if cause is not None else err


def _last_batch_problem(err: BaseException, ranges, size: int) -> List[str]:
    """A last batch of `size` samples that the model (or a hook) cannot take, where the full batches pass."""
    start, stop = ranges[-1]
    total = sum(b - a for a, b in ranges)
    message = f"{type(err).__name__}: {_first(str(err))}"
    if isinstance(err, BatchError) and err.__cause__ is not None:
        message = f"{err.what} failed: {type(err.__cause__).__name__}: {_first(str(err.__cause__))}"
    return [f"data.batch_size: the last batch (batch {len(ranges) - 1}, samples {start}..{stop}) has {size} "
            f"sample(s), and the run fails on {size}: {message}; the full batches pass. Choose data.batch_size (or "
            f"data.max_samples={total - size}) so that no batch has {size} sample(s)"]


def _role_problems(plans, trials: List[_Trial]) -> List[str]:
    """Roles named in `capture:` or an edit's `roles:` that no hooked layer produced, hooks that captured
    nothing, and captures the store cannot hold."""
    seen: Dict[tuple, set] = {}
    edited: Dict[tuple, set] = {}
    problems: List[str] = []
    for t in trials:
        for k, v in t.hookset.seen.items():
            seen.setdefault(k, set()).update(v)
        for k, v in t.hookset.edited.items():
            edited.setdefault(k, set()).update(v)
        problems += [p for p in t.problems if p not in problems]
    captured = set().union(*(t.captured for t in trials))
    for plan in plans:
        problems += _plan_problems(plan, seen, edited, plan.name in captured)
    return problems


EAGER_HINT = ("; an attention pattern comes only from eager attention: give the model `attn_implementation: eager` "
              "(from_pretrained and the HF config classes take it; sdpa, the default of Llama, Qwen2 and GPT-2, "
              "returns no pattern)")


def _attention_pattern(pattern: str, layers) -> bool:
    """Whether a missing role looks like an attention pattern (output.1, output.2 of an attention module)."""
    return pattern.startswith("output.") and pattern != "output.0" and any(
        "attn" in layer.lower() or "attention" in layer.lower() for layer in layers)


def _plan_problems(plan, seen: Dict[tuple, set], edited: Dict[tuple, set], captured: bool) -> List[str]:
    """One hook's roles that its layers did not produce (`seen`, `edited`: roles by (hook, layer)), or that it
    captured nothing."""
    key = f"hooks.{plan.name}"
    ran = {layer: sorted(seen.get((plan.name, layer), ())) for layer in plan.targets
           if (plan.name, layer) in seen or plan.kind == "input_grad"}
    produced = "; ".join(f"{layer}: {', '.join(roles) or 'none'}" for layer, roles in ran.items())
    layers = ", ".join(plan.targets)
    if plan.kind == "input_grad" and not ran[ROOT]:
        return [f"{key}: the model has no floating-point input to take the gradient of (token ids are "
                "integers); use kind: output_grad on the embedding layer (the gradient at the embeddings)"]
    if not ran:
        return [f"{key}.layers: {layers} never ran (or got no gradient) in the first batch, so the hook "
                "would store nothing; hook layers the forward pass calls (inspect=true lists them)"]
    problems = []
    roles = set().union(*ran.values())
    if plan.capture != list(KINDS[plan.kind].default):
        for pattern in plan.capture:
            if not any(matches(r, [pattern]) for r in roles):
                problems.append(f"{key}.capture: {pattern!r} is not a role {layers} produced in the first batch, "
                                f"so nothing would be stored for it; they produce {produced}"
                                + (EAGER_HINT if _attention_pattern(pattern, plan.targets) else ""))
    unmatched = bool(problems)
    met = set().union(*(edited.get((plan.name, layer), set()) for layer in ran))
    for i, edit in enumerate(plan.edits):
        missing = [r for r in edit.roles if not any(m == r or m.startswith(r + ".") for m in met)]
        if missing:
            problems.append(f"{key}.edit[{i}].roles: {missing} is not a role this hook edits on {layers}, so "
                            f"the edit would never apply; it edits {', '.join(sorted(met)) or 'nothing'}")
    if plan.capture and not captured and not unmatched:  # capture: [] is an edit-only hook
        problems.append(f"{key}: captured nothing in the first batch (capture {plan.capture}); {layers} produce "
                        f"{produced}")
    return problems


def _per_batch(plans, trials: List[_Trial]) -> None:
    """Mark every (layer, role) whose axis 0 did not follow the two sizes tried as per batch (plan.per_batch)."""
    a, b = trials[0], trials[1]
    by_name = {plan.name: plan for plan in plans}
    for key, n in a.hookset.axis0.items():
        if key in b.hookset.axis0 and (n, b.hookset.axis0[key]) != (a.size, b.size):
            hook, layer, role = key
            by_name[hook].per_batch.add((layer, role))


# first-batch checks passed in this process: (what the check depends on) -> (the model, each hook's per-batch
# arrays); a rerun of the same config on the same inputs and model (a notebook's) is not checked again
_PASSED: "OrderedDict[tuple, tuple]" = OrderedDict()
REMEMBERED = 32


def first_batch_problems(job, same: Optional[tuple] = None) -> List[str]:
    """Problems with feeding the run's first batch to the model, and with what the hooks (`job.plans`) and the
    loss make of it, found before anything is written; marks each plan's per-batch arrays (HookPlan.per_batch).
    `same`: what else the outcome depends on (the config's hash, the inputs' digests, the device): a check that
    passed in this process for the same `same`, model object and parameters' requires_grad is not run again."""
    key = None if same is None else (*same, id(job.model), tuple(p.requires_grad for p in job.model.parameters()))
    passed = _PASSED.get(key)
    if passed is not None and passed[0]() is job.model:
        for plan in job.plans:
            plan.per_batch |= passed[1].get(plan.name, set())
        return []
    problems = _check_first_batch(job)
    if not problems and key is not None:
        _PASSED[key] = (weakref.ref(job.model), {plan.name: set(plan.per_batch) for plan in job.plans})
        while len(_PASSED) > REMEMBERED:
            _PASSED.popitem(last=False)
    return problems


def _check_first_batch(job) -> List[str]:
    batch, problems = _first_batch(job)
    if problems:
        return problems
    size = batch.stop - batch.start
    whole = not job.inputs.batched or size == 1 or any(e.patch is not None
                                                       for p in job.plans for e in p.edits)  # matched by sample range
    # the methods (a patching grid, attribution: most of the check's time) run on one sample; the second size only
    # tells which arrays follow the batch size
    if whole:
        trials = [_trial(job, batch, size)]
    else:
        with one_thread():  # one and two samples: too small for torch's threads to share (hookrun.threads)
            trials = [_trial(job, batch, 1), _trial(job, batch, 2, measure=False)]
    if any(t.error for t in trials) and not whole:
        trials.append(_trial(job, batch, size))
    ranges = job.inputs.ranges()
    last = ranges[-1][1] - ranges[-1][0] if ranges and len(ranges) > 1 else size
    failed = next((t for t in trials if t.size == size and t.error is not None), None)  # (measured or not)
    if failed is not None:
        return _config_problem(failed.error, batch, job)
    for t in trials:
        if t.error is not None and t.size == last != size:  # the full batches pass, the last one would not
            return _last_batch_problem(t.error, ranges, last)
    passed = [t for t in trials if t.error is None]  # a size the run never uses may fail (BatchNorm, one sample)
    if len(passed) >= 2:
        _per_batch(job.plans, passed[:2])
    return _nonfinite_problems(job, passed) or _role_problems(job.plans, passed)


# a method's result arrays checked for NaN and inf at the first batch (the circuit checks its own, naming the
# metric too): the hook name (or a dictionary's role) -> the block whose result it is
RESULTS = {PATCHING: "patching", ATTRIBUTION: "attribution", LENS: "lens", DLA: "lens"}
FEATURE_ROLES = ("features.values", "error_norm")


def result_key(site) -> Optional[str]:
    """The block whose stored result `site` is (patching, attribution, lens, a dictionary's hook), None for a
    plain capture (those follow on_nonfinite)."""
    if site.hook in RESULTS:
        return RESULTS[site.hook]
    return f"hooks.{site.hook}.dictionary" if site.role in FEATURE_ROLES else None


def _nonfinite_problems(job, trials: List[_Trial]) -> List[str]:
    """A method's result holding NaN or inf in the first batch while the model's weights hold NaN or inf: refused
    naming the array and the weights (every value after it would be NaN too, stored as a `complete` run of NaN).
    NaN a result holds by design (the sites `verify` skips, padding) never refuses a model whose weights are finite."""
    found: Dict[str, tuple] = {}
    for t in trials:
        for array, hit in t.nonfinite.items():
            found.setdefault(array, hit)
    if not found:
        return []
    weights = nonfinite_weights(job.model)
    if not weights:
        return []
    array, (key, count) = next(iter(found.items()))
    more = f" (and {len(found) - 1} other array(s))" if len(found) > 1 else ""
    return [f"{key}: {array} holds {count} NaN or inf value(s) in the first batch{more}; likely cause: "
            f"{nonfinite_cause(job.model, weights=weights)}"]


def _first_batch(job) -> tuple:
    """(the first batch, []) if it loads, fills the recorded fields and binds to `forward`; else (None, problems)."""
    try:
        batch = next(iter(job.inputs.batches()))
    except StopIteration:
        return None, ["data: the run has no batches (no samples after max_samples and stride); give data that holds "
                      "samples"]
    except Exception as err:  # noqa: BLE001 - a dataset that cannot be batched is the config's problem
        if hasattr(err, "problems"):
            return None, list(err.problems)
        return None, [f"data: the first batch does not load ({type(err).__name__}: {_first(str(err))}); "
                      "every item must be a tensor, a tuple or a dict of tensors of one shape (no None, no ragged "
                      "lengths: pad or crop them in the dataset)"]
    cfg, model = job.cfg, job.model
    try:
        sample_table(batch.fields, job.record, 0, batch.start, batch.stop, 0,
                     strict=cfg.data.record is not None)
    except ConfigError as err:
        return None, err.problems
    try:
        _signature(model).bind(*batch.args, **batch.kwargs)
    except TypeError as err:
        params = ", ".join(_signature(model).parameters)
        return None, [f"data: {type(model).__name__}.forward({params}) cannot take the first batch "
                      f"({_describe(batch)}): {err}; {FIX}"]
    except ValueError:
        pass  # no signature to check
    return batch, []


def _signature(model) -> inspect.Signature:
    """The signature `model(...)` binds to: model.forward's, less the `self` of a function a wrapper put on the
    instance (nnsight's NNsight installs one that calls the class's forward with the module)."""
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    if params and params[0].name == "self" and not inspect.ismethod(model.forward):
        sig = sig.replace(parameters=params[1:])
    return sig
