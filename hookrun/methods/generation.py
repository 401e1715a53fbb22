"""Generation: each batch's prompts continued by the model's own generate(), the hooks on at every decoding step.

    generate: {max_new_tokens: 32, do_sample: false, stop: [eos], loop: auto}

The prompts (data.text) are left-padded for generate() (KV cache on), or for the plain loop (generate.loop=plain, or
auto for a model that is not a Hugging Face causal LM): any model mapping input_ids [B, T] to logits [B, T, V], fed
the whole sequence each pass (no KV cache; pass_tokens keeps each pass's newest rows), greedy or sampled through
transformers' own logits warpers, so that both loops store the same thing. The model runs once on the prompts (pass, or
step, 0), then once per decoding step on each sequence's newest token (pass k reads the k-th generated token); a
pre-hook on the model gives the hooks each pass's tokens (hookrun.capture.tokens.TokenInfo, with the step of each
token), so edits apply at every step, at the `positions:` they name (generated, {steps: [2]}, ...). Captures are
held for the batch and stored per token, one row a token the model read: each sample's prompt tokens, then its
generated tokens in order. The last token of a sequence (its EOS, stop, or the max_new_tokens-th) is never read by
the model, so it has no row; steps after a sequence stopped store nothing. The hooks' shared `select.positions`
(take_positions) keeps the rows of those tokens only. The token table gains `generated` and `step`; the generations
table (layout.GENERATIONS) holds each sample's prompt, completion, stop reason (eos | stop | length), new token count
and the chosen tokens' log-probs.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import pandas as pd
import torch

from hookrun.capture.hooks import BatchError, BatchInfo, HookError, Piece, generation_rows_error
from hookrun.capture.scope import HookScope
from hookrun.capture.tokens import TOKEN_SETS, TokenError, TokenInfo, is_steps, token_mask
from hookrun.config.registry import methods
from hookrun.config.checks import ConfigError, Number, as_list, check_choice, check_numbers, is_int
from hookrun.config.schema import Frozen, setting
from hookrun.data.inputs import seed_everything
from hookrun.format.layout import GENERATIONS
from hookrun.methods import BatchResult, Method, run_shape
from hookrun.methods.metrics import logits_of, vocabulary
from hookrun.read.results.generation import generations

GENERATE_LOOPS = ("auto", "hf", "plain")


@dataclass
class GenerateConfig(Frozen):
    """Generation instead of one forward pass a batch: the prompts (data.text) continued by the model's generate()."""

    max_new_tokens: int = setting(0, "tokens to write after each prompt; 0 = no generation (one forward pass a "
                                     "batch)")
    do_sample: bool = setting(False, "sample the next token (seeded `seed + batch`: a resume repeats it); false = "
                                     "greedy")
    temperature: float = setting(1.0, "sampling: logits divided by this")
    top_p: float = setting(1.0, "sampling: keep the smallest set of tokens holding this much probability (1 = all)")
    top_k: int = setting(0, "sampling: keep the k likeliest tokens (0 = all)")
    stop: List[Any] = setting(help="what ends a sequence: `eos` (the tokenizer's EOS), token ids, or strings (the "
                                   "completion ends with one)", factory=lambda: ["eos"])
    loop: str = setting("auto", "`hf`: the model's own `generate()` (KV cache on); `plain`: hookrun's loop for any "
                                "model mapping token ids to logits `[batch, seq, vocab]` (the whole sequence each "
                                "step, no KV cache); `auto`: hf for a Hugging Face causal LM, else plain",
                        GENERATE_LOOPS)


NUMBERS = {"max_new_tokens": Number(whole=True, low=0, high=10 ** 6, fix="tokens a prompt; 0: no generation"),
           "temperature": Number(low=0, high=10 ** 4, open_low=True, fix="sampling: logits divided by this"),
           "top_p": Number(low=0, high=1, open_low=True, fix="1 = every token"),
           "top_k": Number(whole=True, low=0, fix="0: every token")}


def check_spec(cfg) -> List[str]:
    """Problems with `generate` (and what a generate run cannot take), found without the model."""
    gen = cfg.generate
    if gen is None or not gen.max_new_tokens:
        return positions_problems(cfg)
    key = "generate.max_new_tokens"
    numbers = check_numbers("generate", gen, NUMBERS if gen.do_sample else {"max_new_tokens": NUMBERS["max_new_tokens"],
                                                                            "top_k": NUMBERS["top_k"]})
    if numbers:
        return numbers
    problems = positions_problems(cfg)
    if cfg.loss is not None:
        problems.append(f"loss: {cfg.loss!r} with generation; a generate run has no backward pass: set "
                        "loss=null, or generate.max_new_tokens=0 for one forward pass a batch")
    problems += [p for method in methods().values() for p in method.generation_problems(cfg)]
    text = cfg.data.text
    if text is None:
        problems.append(f"{key}: generation continues text prompts; give them as data.text (files and a tokenizer)")
    elif text.batching == "pack":
        problems.append("data.text.batching: pack cuts documents into windows; generation continues whole prompts: "
                        "use data.text.batching=pad")
    problems += check_choice("generate.loop", gen.loop, GENERATE_LOOPS)
    for s in as_list(gen.stop):
        if not (s == "eos" or (is_int(s) and s >= 0) or
                (isinstance(s, str) and s)):
            problems.append(f"generate.stop: {s!r} is not a stop; give eos, a token id or a non-empty string")
    return problems + _select_problems(cfg)


def positions_problems(cfg) -> List[str]:
    """`positions:` that name a generate run's tokens (prompt, generated, all, {steps}) in a run that does not
    generate, and edits at steps that cannot take them (a patch from a store)."""
    generating = cfg.generate is not None and bool(cfg.generate.max_new_tokens)
    problems = []
    for name, hook in (cfg.hooks or {}).items():
        select = (hook.select) if hook is not None else None
        spec = select.get("positions") if isinstance(select, dict) else None
        if not generating and (spec in TOKEN_SETS or is_steps(spec)):
            problems.append(f"hooks.{name}.select.positions: {spec!r} names tokens of a generate run; a run without "
                            "generate stores every real token: drop select.positions (or generate.max_new_tokens=N)")
        for i, edit in enumerate(as_list((hook.edit)) if hook is not None else []):
            at = edit.get("positions") if isinstance(edit, dict) else None
            if is_steps(at) and not generating:
                problems.append(f"hooks.{name}.edit[{i}].positions: {at!r} names passes of a generate run; set "
                                "generate.max_new_tokens=N, or give positions without steps")
            elif at == "generated" and not generating:  # it matches no token: the edit would never apply
                problems.append(f"hooks.{name}.edit[{i}].positions: {at!r} names tokens of a generate run, and this "
                                "run does not generate (generate.max_new_tokens=0): the edit would never apply; set "
                                "generate.max_new_tokens=N, or drop positions (every token) or give last, first or "
                                "ints")
            elif (is_steps(at) or at in TOKEN_SETS) and "store" in edit:
                problems.append(f"hooks.{name}.edit[{i}].positions: {at!r} with a patch (store:); a patch takes rows "
                                "at prompt positions: give first, last or ints")
    return problems


def _select_problems(cfg) -> List[str]:
    """A generate run stores one token table: every hook that captures keeps the same tokens (select.positions)."""
    kept = {}
    for name, hook in (cfg.hooks or {}).items():
        if hook is not None and (hook.capture) != []:
            select = (hook.select)
            kept[name] = select.get("positions") if isinstance(select, dict) else None
    if len({repr(v) for v in kept.values()}) < 2:
        return []
    shown = ", ".join(f"hooks.{n}: {v!r}" for n, v in kept.items())
    return [f"hooks.{next(iter(kept))}.select.positions: the hooks that capture keep different tokens ({shown}); a "
            "generate run's token table lists the rows of every array: give each the same select.positions (filter "
            "cap.tokens() for the rest) or capture them in two runs"]


def take_positions(plans) -> Optional[tuple]:
    """(key, select.positions) the capturing hooks share (check_spec made sure), taken out of their plans (None: no
    select.positions): a generate run keeps those tokens' rows after the passes (_picked), the hooks every token's."""
    shared = next(((f"hooks.{plan.name}.select.positions", plan.shrink.positions) for plan in plans
                   if plan.capture and plan.shrink.positions is not None), None)
    for plan in plans:
        plan.shrink.positions = None
    return shared


def is_causal_lm(model) -> bool:
    """Whether the model is a Hugging Face causal LM with its own generate() (a decoder)."""
    can = getattr(model, "can_generate", None)
    return callable(can) and bool(can()) and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def loop_of(cfg, model) -> str:
    """The loop that generates: hf (the model's generate()) or plain (hookrun's, generate.loop=auto: any other)."""
    loop = cfg.generate.loop
    return loop if loop != "auto" else "hf" if is_causal_lm(model) else "plain"


def model_problems(cfg, model) -> List[str]:
    """generate.loop against the model: hf needs a Hugging Face causal LM; plain a forward taking input_ids and
    attention_mask by name (as every text run's model does), and transformers' samplers when sampling."""
    gen = cfg.generate
    if not gen.max_new_tokens or gen.loop not in GENERATE_LOOPS:
        return []
    if gen.loop == "hf" and not is_causal_lm(model):
        return [f"generate.loop: hf but the model ({type(model).__name__}) is not a Hugging Face causal LM with "
                "generate(); set generate.loop=plain (or auto) for hookrun's loop over any model that maps token ids "
                "to logits"]
    if loop_of(cfg, model) == "plain" and gen.do_sample:
        try:
            import transformers  # noqa: F401 - the plain loop samples with its logits warpers
        except ImportError:
            return ["generate.do_sample: sampling in the plain loop uses transformers' logits warpers; pip install "
                    "\"hookrun[lm]\", or set generate.do_sample=false"]
    return []


def stop_problems(cfg, model, tokenizer) -> List[str]:
    """generate.stop's token ids against the vocabulary (an id past it never comes: the stop never applies), and
    `eos` of a tokenizer without one."""
    stops = as_list(cfg.generate.stop)
    size = vocabulary(model, tokenizer)
    problems = [f"generate.stop: {s} is not a token id of the model's {size}-token vocabulary (ids 0..{size - 1}): "
                "the model never writes it, so it never stops a sequence; give an id below "
                f"{size}, a string, or eos" for s in stops if is_int(s) and size is not None and s >= size]
    if "eos" in stops and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is None:
        problems.append("generate.stop: eos, but the tokenizer has no EOS token (eos_token_id is None); give token "
                        "ids or strings, or a tokenizer with an EOS")
    return problems


def first_pass_problems(job) -> List[str]:
    """The plain loop's model on the first prompt: its output must hold logits [batch, seq, vocab] (a tensor, a
    tuple's first item or .logits), found before anything is written."""
    if loop_of(job.cfg, job.model) != "plain":
        return []
    batch = next(iter(job.inputs.batches())).to(job.device)
    ids, mask = batch.kwargs["input_ids"][:1], batch.kwargs["attention_mask"][:1]
    with torch.no_grad():
        out = job.model(input_ids=ids, attention_mask=mask, **_extra_inputs(job, mask))
    try:
        step_logits(out, ids)
    except HookError as err:
        return [str(err)]
    return []


def step_logits(out, ids: torch.Tensor) -> torch.Tensor:
    """metrics.logits_of(out), checked to be the logits [B, T, V] of the plain loop's pass on `ids` [B, T];
    HookError naming generate.loop if the output holds none."""
    logits = logits_of(out)
    if isinstance(logits, torch.Tensor) and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape) and \
            logits.is_floating_point():
        return logits
    got = f"shape {list(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(out).__name__
    raise HookError(f"generate.loop: plain needs the model's output to be logits [batch, seq, vocab] (a tensor, a "
                    f"tuple's first item or .logits); on input_ids {list(ids.shape)} it gave {got}; return the "
                    "logits of every position, or give a Hugging Face causal LM", "generate.loop")


def _extra_inputs(job, mask: torch.Tensor) -> dict:
    """What the plain loop gives the model besides input_ids and attention_mask: position_ids counted over the real
    tokens as a text batch gives them (data.text.position_ids; the prompts are left-padded), and use_cache=False where
    the forward names it."""
    extra = {"use_cache": False} if "use_cache" in inspect.signature(job.model.forward).parameters else {}
    if job.cfg.data.text.position_ids:
        extra["position_ids"] = (mask.long().cumsum(1) - 1).clamp(min=0)
    return extra


class Stopper:
    """A StoppingCriteria: records the step each sequence stopped at and why (EOS, a stop id or string)."""

    def __init__(self, prompt_len: int, eos: set, stop_ids: set, strings: list, tokenizer, size: int):
        self.prompt_len, self.eos, self.stop_ids, self.strings, self.tokenizer = (prompt_len, eos, stop_ids, strings,
                                                                                   tokenizer)
        self.new = [0] * size  # 0: still running
        self.reason = ["length"] * size

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        k = input_ids.shape[1] - self.prompt_len
        last = input_ids[:, -1].tolist()
        for b, token in enumerate(last):
            if self.new[b]:
                continue
            reason = "eos" if token in self.eos else "stop" if token in self.stop_ids else None
            if reason is None and self.strings:
                text = self.tokenizer.decode(input_ids[b, self.prompt_len:].tolist())
                reason = "stop" if any(s in text for s in self.strings) else None
            if reason:
                self.new[b], self.reason[b] = k, reason
        return torch.tensor([bool(n) for n in self.new], device=input_ids.device)

    def counts(self, generated: int) -> List[int]:
        """New tokens of each sequence (max_new_tokens where it ran to the end)."""
        return [n or generated for n in self.new]


def left_padded(ids: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor):
    """(ids, mask, keep) with every sequence's real tokens moved to the right end (generate() needs left padding)."""
    real = mask.bool()
    shift = (real.flip(1).cumsum(1) == 0).sum(1)  # pads after the last real token
    cols = (torch.arange(ids.shape[1], device=ids.device)[None, :] - shift[:, None]) % ids.shape[1]
    return ids.gather(1, cols), mask.gather(1, cols), keep.gather(1, cols)


def pass_tokens(prompt: TokenInfo, n: int, ids: torch.Tensor) -> TokenInfo:
    """The tokens pass `n` reads (`ids` [B, L]): the prompt (n = 0), each sequence's newest token (a cached pass,
    L = 1), or the whole sequence with only the tokens of step n kept (the plain loop, L = prompt + n)."""
    if n == 0:
        return prompt
    b, length = ids.shape
    if length == 1:
        ones = torch.ones_like(ids, dtype=torch.bool)
        return TokenInfo(ones, ones, prompt.max_length, True, None, ids, torch.full_like(ids, n))
    if length != prompt.mask.shape[1] + n:
        raise HookError(f"generate: pass {n} read {length} tokens a sequence; a generation pass reads the newest token "
                        f"(a KV cache) or the whole sequence ({prompt.mask.shape[1] + n})")
    written = torch.arange(1, n + 1, device=ids.device).expand(b, n)
    step = torch.cat([prompt.step, written], 1)
    mask = torch.cat([prompt.mask, torch.ones_like(written, dtype=torch.bool)], 1)
    info = TokenInfo.of_batch(mask, step == n, prompt.max_length, ids)
    info.step = step
    return info


@contextmanager
def _passes(model, hookset, base: BatchInfo, prompt: TokenInfo):
    """A pre-hook on the model giving the hooks each pass's tokens (pass_tokens); yields (held, infos): the hooks'
    pieces as (pass, piece) instead of going to the store, and each pass's TokenInfo."""
    held, infos, sink = [], [], hookset.sink

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        infos.append(pass_tokens(prompt, len(infos), ids))
        hookset.batch = dataclasses.replace(base, tokens=infos[-1])
        hookset.calls.clear()

    with HookScope() as scope:
        scope.pre(model, pre, with_kwargs=True, prepend=True)
        hookset.sink = lambda piece: held.append((len(infos) - 1, piece))
        try:
            yield held, infos
        finally:
            hookset.sink = sink
            hookset.batch = base


def _order(prompt_rows: List[int], new: List[int], size: int) -> torch.Tensor:
    """Indices into [prompt rows of every sample; step 1 rows of every sample; ...] putting each sample's prompt
    rows, then its rows of steps 1 .. new-1, in sample order."""
    total, start, out = sum(prompt_rows), 0, []
    for b, (rows, n) in enumerate(zip(prompt_rows, new)):
        out += list(range(start, start + rows)) + [total + (k - 1) * size + b for k in range(1, n)]
        start += rows
    return torch.as_tensor(out, dtype=torch.long)


def _picked(infos: List[TokenInfo], positions, key: Optional[str], order: torch.Tensor) -> Optional[torch.Tensor]:
    """[len(order)] bool: the stored rows (in `order`) of the tokens `positions` names (a generate run's
    select.positions, hookrun.capture.tokens.token_mask); None: every row."""
    if positions is None:
        return None
    try:
        chosen = torch.cat([token_mask(info, positions, key)[info.keep] for info in infos])
    except TokenError as err:
        raise HookError(str(err), key) from err
    return chosen.cpu()[order]


def _store(held: list, order: torch.Tensor, sink, steps: int) -> None:
    """One piece a site: its passes' rows joined and put in token order (the rows `order` lists)."""
    by_site: dict = {}
    for n, piece in held:
        if piece.unit != "token":
            site = piece.site
            raise HookError(f"hooks.{site.hook}: {site.layer} {site.role} is not per token (shape "
                            f"{list(piece.tensor.shape)}); a generate run stores one row a token: capture per-token "
                            f"tensors [batch, seq, ...]", f"hooks.{site.hook}")
        by_site.setdefault((piece.site.hook, piece.site.layer, piece.site.role, piece.site.call), []).append(piece)
    for pieces in by_site.values():
        if len(pieces) != steps:
            site = pieces[0].site
            raise HookError(f"hooks.{site.hook}: {site.layer} {site.role} ran in {len(pieces)} of the {steps} "
                            "passes of generation; hook modules that run at every step", f"hooks.{site.hook}")
        shapes = {tuple(p.tensor.shape[1:]) for p in pieces}
        if len(shapes) > 1:
            site = pieces[0].site
            raise generation_rows_error(site.hook, site.layer, site.role, list(pieces[-1].tensor.shape))
        rows = torch.cat([p.tensor for p in pieces]).index_select(0, order.to(pieces[0].tensor.device))
        sink(Piece(pieces[0].site, pieces[0].kind, rows, True, "token"))


def _stops(gen, tokenizer):
    """(EOS ids, other stop ids) of `generate.stop`."""
    stops = as_list(gen.stop)
    eos = {tokenizer.eos_token_id} if "eos" in stops and tokenizer.eos_token_id is not None else set()
    ids = {s for s in stops if is_int(s)}
    return eos, ids - eos


def _generation_config(gen, tokenizer, model, pad_id: int):
    """(generate()'s GenerationConfig from the `generate` block: sampling, EOS and stop ids; EOS ids; other stop
    ids). Every setting is in the config: generate() warns when given it and keywords both."""
    eos, stop_ids = _stops(gen, tokenizer)
    config = copy.copy(model.generation_config)  # attributes are set, none mutated: a shallow copy will do
    config.eos_token_id = sorted(eos | stop_ids) or None
    config.pad_token_id = pad_id
    sampling = dict(do_sample=True, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k) if gen.do_sample \
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    config.update(max_new_tokens=gen.max_new_tokens, use_cache=True, return_dict_in_generate=True,
                  output_logits=True, **sampling)
    return config, eos, stop_ids


@dataclasses.dataclass
class Generated:
    """What generating a batch gave: the new token ids [B, max new], the raw logits of each pass, why each stopped."""

    new_ids: torch.Tensor
    logits: tuple
    stopper: Stopper


def step(job, i: int, batch, hookset):
    """Batch `i` generated with the hooks of `hookset`; returns a BatchResult: the batch with its token table, the
    seconds of generation as its forward, the generations table."""
    seed_everything(job.cfg.seed + i)  # sampling seeded per batch: a resume repeats it
    batch, inputs = batch.to(job.device), job.inputs
    ids, mask, keep = left_padded(batch.kwargs["input_ids"], batch.kwargs["attention_mask"], batch.tokens.keep)
    prompt = TokenInfo.of_batch(mask.bool(), keep, batch.tokens.max_length, ids)
    prompt.step = torch.zeros_like(ids)
    base = BatchInfo(i, batch.start, batch.stop, True, prompt, batch.fields)
    hookset.begin_batch(base, [], {})
    t0 = time.perf_counter()
    with torch.no_grad(), _passes(job.model, hookset, base, prompt) as (held, infos):
        out = (_hf_generate if loop_of(job.cfg, job.model) == "hf" else _plain_generate)(job, ids, mask)
    forward_s = time.perf_counter() - t0
    new = out.stopper.counts(out.new_ids.shape[1])
    order = _order(keep.sum(1).tolist(), new, len(ids))
    key, positions = job.method("generate").kept_tokens or (None, None)
    picked = _picked(infos, positions, key, order)
    _store(held, order if picked is None else order[picked], hookset.sink, out.new_ids.shape[1])
    hookset.end_batch()
    table = _token_table(batch.table.frame(), out.new_ids, new, mask.sum(1).tolist(), batch.start, inputs)
    batch.table = table if picked is None else table[picked.numpy()].reset_index(drop=True)
    gens = _generations(i, batch.start, ids, mask, out.new_ids, new, out.stopper.reason, out.logits, inputs.tokenizer)
    _same_as_counted(job, i, gens)
    return BatchResult(batch, None, forward_s, 0.0, tables={GENERATIONS: gens})


def count_rows(job, first: int, stop: int, sink) -> int:
    """A data-parallel run's batches [first, stop) of this rank generated before the run (edits on, captures to
    `sink`, nothing stored): the token rows they store (every rank's arrays are made at their final size before any
    rank writes); each batch's completions are kept (job.counted) for the run to check it generates them again."""
    rows = 0
    with job.hooked(sink) as hookset:
        for i, batch in enumerate(itertools.islice(job.inputs.batches(first), stop - first), first):
            result = step(job, i, batch, hookset)
            rows += len(result.batch.table)
            job.method("generate").counted[i] = result.tables[GENERATIONS]["completion_ids"].tolist()
    return rows


def _same_as_counted(job, i: int, gens: pd.DataFrame) -> None:
    """Batch i's completions against those of the counting pass (count_rows): a BatchError where they differ."""
    counted = job.method("generate").counted.get(i)
    if counted is not None and counted != gens["completion_ids"].tolist():
        raise BatchError(f"batch {i}: generated other tokens than when this rank counted its rows (data-parallel "
                         "runs generate each batch twice); generation is not deterministic here: run one process, "
                         "or make it deterministic (torch.use_deterministic_algorithms)", "generation")


def _stopper(job, ids: torch.Tensor, eos: set, stop_ids: set) -> Stopper:
    """The stop criteria of the `generate` block for prompts `ids` [B, T]."""
    strings = [s for s in as_list(job.cfg.generate.stop) if isinstance(s, str) and s != "eos"]
    return Stopper(ids.shape[1], eos, stop_ids, strings, job.inputs.tokenizer, len(ids))


def _hf_generate(job, ids: torch.Tensor, mask: torch.Tensor) -> Generated:
    """The model's own generate() on left-padded prompts (the KV cache on)."""
    config, eos, stop_ids = _generation_config(job.cfg.generate, job.inputs.tokenizer, job.model, job.inputs.pad_id)
    stopper = _stopper(job, ids, eos, stop_ids)
    out = job.model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=[stopper], generation_config=config)
    return Generated(out.sequences[:, ids.shape[1]:].cpu(), out.logits, stopper)


def _plain_generate(job, ids: torch.Tensor, mask: torch.Tensor) -> Generated:
    """hookrun's loop on left-padded prompts: the whole sequence each pass (no KV cache), the next token from the
    last position's logits (greedy, or sampled as generate() samples), until every sequence stopped."""
    gen, pad = job.cfg.generate, job.inputs.pad_id
    eos, stop_ids = _stops(gen, job.inputs.tokenizer)
    stopper, choose = _stopper(job, ids, eos, stop_ids), _chooser(gen)
    running, logits = torch.ones(len(ids), dtype=torch.bool, device=ids.device), []
    seq = ids
    for _ in range(gen.max_new_tokens):
        out = job.model(input_ids=seq, attention_mask=mask, **_extra_inputs(job, mask))
        logits.append(step_logits(out, seq)[:, -1].to(dtype=torch.float32, copy=True))
        token = torch.where(running, choose(seq, logits[-1]), torch.full_like(running, pad, dtype=torch.long))
        seq, mask = torch.cat([seq, token[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        running &= ~stopper(seq)
        if not bool(running.any()):
            break
    return Generated(seq[:, ids.shape[1]:].cpu(), tuple(logits), stopper)


def _chooser(gen):
    """The next token from the last position's float32 logits: argmax, or a sample of generate()'s own logits
    warpers (temperature, top_k, top_p, in its order) with torch.multinomial, as generate() draws it."""
    if not gen.do_sample:
        return lambda seq, scores: scores.argmax(-1)
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(gen.temperature)] if gen.temperature != 1.0 else [])
    warpers += [TopKLogitsWarper(top_k=gen.top_k)] if gen.top_k else []
    warpers += [TopPLogitsWarper(top_p=gen.top_p)] if gen.top_p < 1.0 else []
    return lambda seq, scores: torch.multinomial(torch.softmax(warpers(seq, scores), -1), num_samples=1).squeeze(1)


def _token_table(prompt: pd.DataFrame, new_ids: torch.Tensor, new: List[int], lengths: List[int], start: int,
                 inputs) -> pd.DataFrame:
    """The prompt's rows (step 0), then each sample's generated tokens the model read (all but its last; the k-th
    is read in pass k), by sample."""
    read = np.maximum(np.asarray(new, dtype=np.int64) - 1, 0)
    b = np.repeat(np.arange(len(new)), read)
    k = np.arange(len(b)) - np.repeat(np.cumsum(read) - read, read)  # 0 .. read-1 within each sample
    generated = pd.DataFrame({"sample": start + b, "position": np.asarray(lengths, dtype=np.int64)[b] + k,
                              "token_id": new_ids.numpy()[b, k].astype(np.int64), "step": k + 1})
    uniq, which = np.unique(generated["token_id"].to_numpy(), return_inverse=True)
    generated.insert(3, "token", np.array([inputs.token(int(t)) for t in uniq], dtype=object)[which])
    table = pd.concat([prompt.assign(generated=False, step=0), generated.assign(generated=True)], ignore_index=True)
    table = table[[*prompt.columns, "generated", "step"]].astype({"step": "int64"})
    return table.sort_values("sample", kind="stable").reset_index(drop=True)


def _generations(i: int, start: int, ids, mask, new_ids, new: List[int], reasons: List[str], logits,
                 tokenizer) -> pd.DataFrame:
    """A row per sample: prompt and completion (text, ids), stop reason, new tokens, the chosen tokens' log-probs."""
    steps = torch.stack([x.float() for x in logits], 1).cpu() if logits else torch.zeros(len(ids), 0, 1)
    chosen = steps.log_softmax(-1).gather(2, new_ids[:, :steps.shape[1], None]).squeeze(2)
    rows = []
    for b, n in enumerate(new):
        prompt_ids = ids[b][mask[b].bool()].tolist()
        completion = new_ids[b, :n].tolist()
        rows.append(dict(sample=start + b, batch=i, prompt=tokenizer.decode(prompt_ids), prompt_ids=prompt_ids,
                         completion=tokenizer.decode(completion, skip_special_tokens=True),
                         completion_ids=completion, stop_reason=reasons[b], new_tokens=n,
                         logprobs=np.asarray(chosen[b, :n], dtype=np.float32).tolist()))
    return pd.DataFrame(rows)


class Generation(Method):
    """The `generate:` block: each batch's prompts continued by the model (step), its completions stored in the
    generations table and read back by cap.generations()."""

    key = "generate"
    annotation = GenerateConfig
    factory = GenerateConfig
    runs_batch = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.kept_tokens: Optional[tuple] = None  # (key, select.positions) of the capturing hooks
        self.counted: dict = {}  # a data-parallel run: batch -> completions of its count (count_rows)

    @classmethod
    def active(cls, cfg) -> bool:
        return cfg.generate is not None and bool(cfg.generate.max_new_tokens)

    @classmethod
    def check(cls, cfg) -> List[str]:
        return check_spec(cfg)

    def model_problems(self, model) -> List[str]:
        return model_problems(self.cfg, model)

    def compile(self, job) -> None:
        problems = stop_problems(self.cfg, job.model, getattr(job.inputs, "tokenizer", None))
        if problems:
            raise ConfigError(problems)
        self.kept_tokens = take_positions(job.plans)  # a generate run keeps its tokens' rows after the passes

    def memory_need(self, job) -> List[tuple]:
        """Generation's parts held at once: every step's logits (max_new_tokens x batch x vocab, float32, kept to
        the end of the batch), the KV cache of the prompt and the tokens written (generate(): two values a block and
        width in the model's dtype), or hookrun's loop's forward over the whole sequence (no cache: its logits)."""
        gen, s = self.cfg.generate, run_shape(job)
        new, length = int(gen.max_new_tokens), s.tokens + int(gen.max_new_tokens)
        logits = (4.0 * new * s.batch * s.vocab, "generate.max_new_tokens",
                  f"{new} steps' logits x {s.batch} prompts x {s.vocab} tokens")
        if loop_of(job.cfg, job.model) == "plain":
            return [logits, (4.0 * s.batch * length * s.vocab, "generate.max_new_tokens",
                             f"a forward's logits over {s.batch} sequences of up to {length} tokens")]
        return [logits, (2.0 * s.layers * s.batch * length * s.d_model * s.itemsize, "generate.max_new_tokens",
                         f"the KV cache of {s.batch} sequences of up to {length} tokens")]

    def first_batch_problems(self, job) -> List[str]:
        return first_pass_problems(job)

    def step(self, job, i: int, batch, hookset) -> BatchResult:
        return step(job, i, batch, hookset)

    def count_rows(self, job, first: int, stop: int, sink) -> Optional[int]:
        return count_rows(job, first, stop, sink)

    @staticmethod
    def read(cap) -> pd.DataFrame:
        return generations(cap)
