"""Text inputs: documents from files or a dataset, tokenized, padded or packed into batches of token ids.

    data:
      text:
        files: [corpus.txt]          # .txt one document per line (blank lines skipped); .jsonl / .parquet with `field`
                                     # (text, or a list of token ids); .pt / .npy of token ids (no tokenizer needed)
                                     # pkg://hookrun.experiments/data/corpus.txt: a file inside an installed package
        tokenizer: {_target_: hookrun.experiments.lm.tokenizer}
        max_length: 128              # pad: longer documents are truncated to this many tokens; pack: the window
        batching: pad                # pad | pack
      batch_size: 8

Each batch passes `input_ids`, `attention_mask` (and `position_ids`, counted over real tokens) as
keywords, carries a TokenInfo for the hooks and a token table (sample, position, token_id, token)
whose row i describes row i of every per-token array of the batch.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
import pandas as pd
import torch

from hookrun.config.checks import (ConfigError, Number, check_choice, check_numbers, check_target, either, resolve_file,
                                   suggest)
from hookrun.config.schema import BATCHING, PADDING_SIDES
from hookrun.data.batching import Batches, batch_ranges
from hookrun.data.inputs import Batch, build, first_line, missing_file
from hookrun.capture.tokens import TokenInfo, decoded_texts, tokenizer_digest
from hookrun.format.tokens import token_texts
from hookrun.store.index import Columns

SUFFIXES = (".txt", ".jsonl", ".parquet", ".pt", ".npy")
IDS_SUFFIXES = (".pt", ".npy")  # token ids only: a [samples, sequence] integer tensor / array, a list of 1-D ones, or
                                # (.pt) a dict of columns, one value a sample (paired roles' ids, answer ids, fields)
ROLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # a role of paired prompts: a path segment of the store's arrays
log = logging.getLogger("hookrun")


TOKENIZER_MISSING = ("data.text.tokenizer: missing; give {_target_: ...} building a Hugging Face tokenizer "
                     "(e.g. transformers.AutoTokenizer.from_pretrained with a local directory)")


NUMBERS = {"max_length": Number(whole=True, low=2, high=10 ** 7, fix="tokens a sample (pad) or a window (pack)"),
           "max_documents": Number(whole=True, low=1, null="every document")}


def check_spec(text) -> List[str]:
    """Problems with `data.text`, found without reading the corpus or building the tokenizer."""
    problems = []
    files = [str(f) for f in (text.files or [])]
    if not files and text.dataset is None:
        problems.append("data.text: no documents; give data.text.files=[corpus.txt] or data.text.dataset={_target_: ...}")
    if files and text.dataset is not None:
        problems.append("data.text: both files and dataset are set; keep one of them")
    for f in files:
        try:
            path = resolve_file(f)
        except ModuleNotFoundError as err:
            problems.append(f"data.text.files: {f!r}: {err}; pkg://PACKAGE/PATH names a file inside an installed package")
            continue
        if path.suffix not in SUFFIXES:
            problems.append(f"data.text.files: {f!r} is not {', '.join(SUFFIXES)}; give text (one document per line), "
                            "JSON lines or parquet, or token ids (.pt, .npy)")
        else:
            problems += missing_file("data.text.files", path, f)
    if text.dataset is not None:
        problems += check_target("data.text.dataset", text.dataset)
    if text.tokenizer is None and any(f.endswith(".txt") for f in files):
        problems.append(TOKENIZER_MISSING)  # a .jsonl / .parquet may hold token ids: found when it is read
    elif text.tokenizer is not None:
        problems += check_target("data.text.tokenizer", text.tokenizer)
    problems += check_numbers("data.text", text, NUMBERS)
    problems += check_choice("data.text.batching", text.batching, BATCHING,
                             either(f"{name} ({what})" for name, what in BATCHING.items()))
    if text.padding_side is not None:
        problems += check_choice("data.text.padding_side", text.padding_side, PADDING_SIDES,
                                 either([*PADDING_SIDES, "null"]), hint=False)
    problems += _fields_problems(text)
    return problems


def _fields_problems(text) -> List[str]:
    """Problems with data.text.fields (paired prompts: role -> column)."""
    fields = text.fields
    if fields is None:
        return []
    if not isinstance(fields, dict) or not fields or not all(isinstance(v, str) for v in fields.values()):
        return [f"data.text.fields: {fields!r} must map each role to a column, e.g. {{clean: clean, corrupt: "
                "corrupt}"]
    if text.batching == "pack":
        return ["data.text.fields: paired prompts are one sample an example, but data.text.batching=pack cuts the "
                "corpus into windows; use batching=pad"]
    return [f"data.text.fields: role {role!r} is not a name; a role names the store's arrays (_metrics/<role>/...): "
            "use letters, digits, _ and -, starting with a letter (e.g. clean, corrupt)"
            for role in fields if not ROLE_NAME.fullmatch(str(role))]


def read_documents(text) -> Tuple[list, list]:
    """Every example: (documents, their other fields). A document is a str, a list of token ids (datasets of 1-D
    token tensors), or with data.text.fields a dict role -> str; the other fields of a dict example (a .jsonl
    line, a .parquet row, a dataset's dict) are one dict per example ({} for plain text)."""
    docs: list = []
    meta: list = []
    most = text.max_documents  # read once: a config node lookup costs ~25 us a document
    roles = dict(text.fields) if text.fields else None
    if text.files:
        for f in text.files:
            for item, where in _read_file(resolve_file(f)):
                _add(docs, meta, item, where, "data.text.files", text.field, roles)
    else:
        for i, item in enumerate(build("data.text.dataset", text.dataset)):
            _add(docs, meta, item, f"item {i}", "data.text.dataset", text.field, roles)
            if most and len(docs) >= most:
                break
    return (docs[:most], meta[:most]) if most else (docs, meta)


def _add(docs: list, meta: list, item, where: str, key: str, field: str, roles: Optional[dict]) -> None:
    """One example's document(s) and its other fields appended."""
    if roles is None:
        docs.append(document(item, field, where, key))
        used = {field}
    else:
        if not isinstance(item, dict):
            raise ConfigError([f"data.text.fields: {where} is a {type(item).__name__}, not a record with the fields "
                               f"{sorted(set(roles.values()))}; paired prompts come from .jsonl / .parquet / dict items"])
        docs.append({role: document(item, column, where, key, "data.text.fields") for role, column in roles.items()})
        used = set(roles.values())
    meta.append({k: _scalar(v) for k, v in item.items() if k not in used} if isinstance(item, dict) else {})


def _scalar(value):
    """A field value as Python (numpy scalars from parquet as int, float, str)."""
    return value.item() if isinstance(value, np.generic) else value


def document(item, field: str, where: str, key: str = "data.text.dataset", field_key: str = "data.text.field"):
    """One item as a document: str, dict[field], or a 1-D integer tensor / list of ids; `where` and `key` name
    the item and the setting it came from in errors (`field_key`: the setting naming the field)."""
    if isinstance(item, dict):
        if field not in item:
            raise ConfigError([f"{field_key}: {field!r} is not a key of {where} ({', '.join(map(str, item))})"
                               f"{suggest(field, item)}"])
        item, where, key = item[field], f"{field!r} of {where}", field_key
    if isinstance(item, str):
        return item
    if isinstance(item, np.ndarray) and item.ndim == 1 and item.dtype.kind in "iu":
        item = item.tolist()
    if isinstance(item, torch.Tensor) and item.dim() == 1 and not item.is_floating_point() and item.dtype != torch.bool:
        item = item.tolist()
    if isinstance(item, (list, tuple)) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                        for t in item):
        return list(item)
    raise ConfigError([f"{key}: {where} is {item!r:.60} ({type(item).__name__}); a document is a str, a dict holding "
                       f"one under {field_key} ({field!r}), or token ids (a non-empty list or 1-D integer tensor of "
                       "ids >= 0)"])


def _read_file(path: Path) -> Iterator[Tuple[object, str]]:
    """(item, where) of every example of one corpus file: a str line (.txt) or a dict (.jsonl line, .parquet row);
    an unreadable file or line is a ConfigError naming it (and the line)."""
    if path.suffix in IDS_SUFFIXES:
        return _id_rows(path)
    try:
        if path.suffix == ".parquet":
            rows = pd.read_parquet(path).to_dict("records")
        else:
            raw = path.read_bytes()
            lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        line, byte = raw.count(b"\n", 0, err.start) + 1, raw[err.start:err.start + 1]
        raise ConfigError([f"data.text.files: {path} line {line} is not UTF-8 text (byte {byte!r}); save the file as "
                           "UTF-8"]) from None
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError([f"data.text.files: {str(path)!r} cannot be read ({type(err).__name__}: {first_line(err)}); "
                           "give a text, JSON lines or parquet file"]) from None
    if path.suffix == ".parquet":
        return ((row, f"{path} row {i}") for i, row in enumerate(rows))
    if path.suffix == ".txt":
        return ((line.rstrip("\r\n"), f"{path} line {n}") for n, line in enumerate(lines, start=1) if line.strip())
    return _json_lines(path, lines)


def _id_rows(path: Path) -> Iterator[Tuple[object, str]]:
    """(item, where) of every sample of a .pt / .npy of token ids: a row of a 2-D integer tensor (every token real),
    an element of a list of 1-D ones, or (a dict of columns, one value a sample) a record of that row's values."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True) if path.suffix == ".pt" else \
            np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - not a tensor file, or one holding more than tensors
        raise ConfigError([f"data.text.files: {str(path)!r} cannot be read ({type(err).__name__}: {first_line(err)}); "
                           "give token ids: a [samples, sequence] integer tensor (torch.save) or array (np.save), a "
                           "list of 1-D tensors, or a dict of such columns"]) from None
    if isinstance(data, dict):
        columns = {str(k): _rows_of(v, f"{path} column {k!r}") for k, v in data.items()}
        sizes = {k: len(v) for k, v in columns.items()}
        if not columns or len(set(sizes.values())) > 1:
            raise ConfigError([f"data.text.files: {path}: the columns {sizes} must hold one value a sample each"])
        n = next(iter(sizes.values()))
        return (({k: _plain(v[i]) for k, v in columns.items()}, f"{path} row {i}") for i in range(n))
    return ((row, f"{path} row {i}") for i, row in enumerate(_rows_of(data, str(path))))


def _rows_of(data, where: str) -> list:
    """One value a sample of a tensor (its rows), an array, or a list."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        if data.ndim == 0:
            raise ConfigError([f"data.text.files: {where} is one number, not one value a sample"])
        return list(data)
    if isinstance(data, (list, tuple)):
        return list(data)
    raise ConfigError([f"data.text.files: {where} is a {type(data).__name__}; give a tensor, an array or a list"])


def _plain(value):
    """A column's value for one sample: token ids as a 1-D tensor, a 0-d one as its number, strings as they are."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value.tolist() if isinstance(value, np.generic) else value


def _json_lines(path: Path, lines: List[str]) -> Iterator[Tuple[object, str]]:
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError([f"data.text.files: {path} line {n} is not JSON ({err.msg} at column {err.colno}); "
                               "every line of a .jsonl file is one JSON object, e.g. {\"text\": \"a document\"}"]
                              ) from None
        yield row, f"{path} line {n}"


def listed(items) -> list:
    """A list of prompts given in the config as a dataset (what hookrun.run(inputs=[...]) sets as data.text.dataset):
    strings, lists of token ids (as 1-D long tensors), or records (paired prompts), as plain Python.

        data.text.dataset: {_target_: hookrun.data.text.listed, items: ["The cat", "A dog"]}"""
    def plain(x):
        if isinstance(x, (str, int)):
            return x
        if hasattr(x, "keys"):
            return {k: plain(x[k]) for k in x.keys()}
        return torch.tensor([int(v) for v in x], dtype=torch.long)
    return [plain(x) for x in items]


def special_ids(tokenizer) -> set:
    """The BOS, EOS and pad ids of a tokenizer (what exclude_special leaves out)."""
    if tokenizer is None:
        return set()
    return {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}


def sequences(docs: list, tokenizer, text) -> List[List[int]]:
    """Token ids per sample: one per document truncated to max_length (pad), or windows of max_length (pack)."""
    ids = [d if isinstance(d, list) else None for d in docs]
    strings = [d for d in docs if isinstance(d, str)]
    if strings:
        if tokenizer is None:
            raise ConfigError(["data.text.tokenizer: missing, but the documents are text; give {_target_: ...}"])
        try:
            encoded = iter(tokenizer(strings, add_special_tokens=False)["input_ids"])
        except Exception as err:  # noqa: BLE001 - not a tokenizer, or one that cannot read these documents
            raise ConfigError([f"data.text.tokenizer: {type(tokenizer).__name__} does not tokenize the documents "
                               f"({type(err).__name__}: {first_line(err)}); give a Hugging Face tokenizer (called "
                               "with a list of str, it returns input_ids)"]) from None
        given = [i for i in ids if i is not None]
        vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        bad = next((seq for seq in given if vocab is not None and max(seq) >= vocab), None)
        if bad is not None:
            raise ConfigError([f"data.text: texts and token ids in one run, but the ids {bad[:8]} hold {max(bad)}, "
                               f"not a token of data.text.tokenizer ({vocab} tokens): the ids were made by another "
                               "tokenizer; give every prompt as ids, or ids of this tokenizer"])
        ids = [next(encoded) if i is None else i for i in ids]
    bos = _special(tokenizer, "bos") if text.bos else None
    if text.batching == "pack":
        eos = getattr(tokenizer, "eos_token_id", None)
        sep = eos if eos is not None else bos  # between documents; none for a tokenizer without EOS and bos=false
        stream = [t for doc in ids for t in (doc + ([sep] if sep is not None else []))]
        width = text.max_length - (bos is not None)
        windows = [stream[s:s + width] for s in range(0, len(stream) - width + 1, width)]
        if not windows:
            raise ConfigError([f"data.text.max_length: {text.max_length} but the corpus has {len(stream)} tokens, "
                               "less than one window; lower max_length or add documents"])
        return [([bos] if bos is not None else []) + w for w in windows]
    prefix = [bos] if bos is not None else []
    full = [prefix + list(doc) for doc in ids]
    longest = int(text.max_length)  # read once: a config node lookup costs ~25 us, per document it added up
    truncated = sum(len(seq) > longest for seq in full)
    if truncated:
        log.info("data.text: %d of %d documents truncated to max_length=%d tokens", truncated, len(full), longest)
    return [seq[:longest] for seq in full]  # (empty ones too: the caller drops them with their fields)


def tokenizer_problem(tokenizer) -> str:
    """What to check when a tokenizer turns a corpus into nothing: its class and folder, and the usual cause."""
    where = getattr(tokenizer, "name_or_path", "") or ""
    return (f"the tokenizer is {type(tokenizer).__name__}{f' from {where!r}' if where else ''}: does it know the "
            "corpus's words? AutoTokenizer on a folder that also holds a model's config.json can rebuild a custom "
            "tokenizer as that model type's own (transformers 5); keep the tokenizer in a folder of its own, or build "
            "it directly (e.g. PreTrainedTokenizerFast(tokenizer_file=.../tokenizer.json)) in data.text.tokenizer")


def words_problem(seqs: List[List[int]], tokenizer) -> Optional[str]:
    """The problem of a corpus whose every sample has at most one token, or special tokens alone (BOS, EOS, pad,
    unknown): nothing of its text survived tokenizing. None otherwise (or without a tokenizer: token ids as given)."""
    if tokenizer is None or not seqs:
        return None
    special = special_ids(tokenizer) | set(getattr(tokenizer, "all_special_ids", None) or [])
    if any(len(seq) > 1 and any(t not in special for t in seq) for seq in seqs):
        return None
    shown = ", ".join(repr(tokenizer.convert_ids_to_tokens(list(seq))) if hasattr(tokenizer, "convert_ids_to_tokens")
                      else repr(seq) for seq in seqs[:2])
    return (f"data.text.tokenizer: every one of the {len(seqs)} documents tokenizes to at most one token or to special "
            f"tokens alone (first: {shown}); {tokenizer_problem(tokenizer)}")


def dominant_problem(seqs: List[List[int]], tokenizer, share: float = 0.5, least: int = 8) -> Optional[str]:
    """The warning for a tokenizer that maps most of the first batch's tokens to one id or to its unknown token (a
    tokenizer rebuilt as another model type's own reads every word as one id): None when no id (special tokens
    aside) holds more than `share` of at least `least` tokens, or without a tokenizer.

        dominant_problem([[5, 5, 5, 5]] * 4, tok)   # "... 16 of 16 tokens are id 5 ('a') ..."
    """
    if tokenizer is None:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    special = special_ids(tokenizer) - {unk}
    ids = np.fromiter((t for seq in seqs for t in seq if t not in special), dtype=np.int64)
    if ids.size < least:
        return None
    values, counts = np.unique(ids, return_counts=True)
    top = int(np.argmax(counts))
    if counts[top] <= share * ids.size:
        return None
    token = tokenizer.convert_ids_to_tokens(int(values[top])) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    what = "the unknown token" if values[top] == unk else "one id"
    return (f"data.text.tokenizer: {counts[top]} of the first batch's {ids.size} tokens are {what} "
            f"({int(values[top])}, {token!r}); {tokenizer_problem(tokenizer)}")


def _special(tokenizer, name: str) -> int:
    value = getattr(tokenizer, f"{name}_token_id", None) if tokenizer is not None else None
    if tokenizer is None:
        raise ConfigError([f"data.text.{name}: true, but the prompts are token ids and the run has no tokenizer to "
                           f"take the {name.upper()} id from; put it in the ids and set data.text.{name}=false, or "
                           "give data.text.tokenizer"])
    if value is None:
        raise ConfigError([f"data.text: the tokenizer has no {name.upper()} token ({name}_token); set it when building "
                           f"the tokenizer, or turn off data.text.bos" + (" / use batching=pad" if name == "eos" else "")])
    return value


def padded(seqs: List[List[int]], pad_id: int, side: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [B, longest] int64, mask [B, longest] bool, lengths [B] int64) in numpy, with pads on `side`."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    longest = int(lengths.max())
    ids = np.full((len(seqs), longest), pad_id, dtype=np.int64)  # filled row by row: half torch.tensor(lists)'s time
    for row, seq, n in zip(ids, seqs, lengths.tolist()):
        if n:
            row[slice(0, n) if side == "right" else slice(longest - n, longest)] = seq
    at = np.arange(longest)
    mask = (at < lengths[:, None]) if side == "right" else (at >= (longest - lengths)[:, None])
    return ids, mask, lengths


def pad(seqs: List[List[int]], pad_id: int, side: str):
    """(input_ids, attention_mask) [B, longest] tensors with pads on `side`."""
    ids, mask, _ = padded(seqs, pad_id, side)
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def encode_batch(seqs: List[List[int]], pad_id: int, side: str, max_length: int, special=(),
                 position_ids: bool = True) -> Tuple[dict, TokenInfo, np.ndarray, np.ndarray, np.ndarray]:
    """One batch of token ids as the model takes it: (forward keywords, TokenInfo, and in numpy the padded ids, the
    flat indices of the stored tokens and each sequence's first real column). Worked out in numpy and handed to torch
    without a copy (a dozen small torch calls cost ~0.1 ms a batch more); `special` ids are not stored.

        kwargs, info, ids, rows, first = encode_batch([[5, 6], [7]], pad_id=0, side="right", max_length=8)"""
    ids, real, lengths = padded(seqs, pad_id, side)
    keep = real & ~np.isin(ids, sorted(special)) if special else real
    mask = real.astype(np.int64)
    kwargs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    if position_ids:
        kwargs["position_ids"] = torch.from_numpy(np.maximum(mask.cumsum(1) - 1, 0))
    rows = np.flatnonzero(keep)
    longest = ids.shape[1]  # first: each sequence's leading pad columns (all of them for an empty one)
    first = np.where(lengths > 0, 0, longest) if side == "right" else longest - lengths
    info = TokenInfo.of_batch(torch.from_numpy(real), torch.from_numpy(keep), max_length, kwargs["input_ids"],
                              kept_rows=torch.from_numpy(rows), lengths=torch.from_numpy(lengths),
                              first=torch.from_numpy(first))
    return kwargs, info, ids, rows, first


class TextInputs(Batches):
    """Batches of a tokenized corpus; the same interface as data.Inputs."""

    batched = True

    def __init__(self, data_cfg, seed: int, docs: Optional[list] = None, tokenizer=None):
        self.cfg = data_cfg
        text = data_cfg.text
        self.text = text  # `tokenizer`: one already loaded (hookrun.run(tokenizer=...)), where the config gives none
        self.tokenizer = build("data.text.tokenizer", text.tokenizer) if text.tokenizer is not None else tokenizer
        docs, meta = read_documents(text) if docs is None else (docs, [{}] * len(docs))
        if not docs:
            where = f"files {list(text.files)}" if text.files else "data.text.dataset"
            raise ConfigError([f"data.text: the corpus is empty ({where} holds no documents); give at least one"])
        self.roles = list(text.fields) if text.fields else []  # paired prompts: the first is what the model is fed
        if len(self.roles) > 1:  # said, since a command-line dict is merged into an experiment's (Hydra's rule)
            log.info("data.text.fields: roles %s; the model's own pass (hooks, captures, metrics) runs on %r, the first "
                     "(to replace an experiment's roles, give data.text.fields=null before the new dict)",
                     ", ".join(self.roles), self.roles[0])
        self.role_seqs = self._tokenized(docs, meta)
        self.seqs = self.role_seqs[self.roles[0]] if self.roles else self.role_seqs[None]
        if not self.seqs:
            raise ConfigError(["data.text: no document has a token after tokenizing; check data.text.field and the files"
                               + (f" ({tokenizer_problem(self.tokenizer)})" if self.tokenizer is not None else "")])
        empty = words_problem(self.seqs, self.tokenizer)
        if empty:
            raise ConfigError([empty])
        tok = self.tokenizer
        self._batches = batch_ranges(data_cfg.batch_size, data_cfg.stride, data_cfg.max_samples, len(self.seqs))
        if tok is not None:
            log.info("data.text.tokenizer: %s%s", type(tok).__name__,
                     f" from {tok.name_or_path}" if getattr(tok, "name_or_path", "") else "")
            start, stop = self._batches[0] if self._batches else (0, 0)
            dominant = dominant_problem(self.seqs[start:stop], tok)
            if dominant:
                log.warning(dominant)
        self.side = text.padding_side or (getattr(tok, "padding_side", None) or "right")
        self.pad_id = next((i for i in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None))
                            if i is not None), 0)
        self.special = special_ids(tok) if text.exclude_special else set()
        self.tokenizer_digest = tokenizer_digest(tok)  # (the store's fingerprint of it: hookrun.engine.fingerprint)
        self.decoded: dict = decoded_texts(tok, self.tokenizer_digest)

    def _tokenized(self, docs: list, meta: list) -> dict:
        """role -> token ids per sample (role None: one prompt a sample); sets `self.meta` (column -> one value per
        sample: the examples' other fields; None when packing, where a sample is no example). Examples with a role
        that has no token are dropped, with their fields."""
        text = self.text
        if text.batching == "pack":
            self.meta = None
            return {None: sequences(docs, self.tokenizer, text)}
        roles = self.roles or [None]
        by_role = {r: sequences([d[r] for d in docs] if r else docs, self.tokenizer, text) for r in roles}
        keep = [i for i in range(len(docs)) if all(by_role[r][i] for r in roles)]
        columns = sorted({k for m in meta for k in m})
        self.meta = {c: [meta[i].get(c) for i in keep] for c in columns}
        return {r: [seqs[i] for i in keep] for r, seqs in by_role.items()}

    def field_names(self) -> List[str]:
        """The per-sample fields of the examples besides the prompts (what data.record and metrics can name)."""
        return list(self.meta or {})

    def length_problems(self, source: str, target: str, key: str, fix: Optional[str] = None) -> List[str]:
        """The first sample of the run whose `source` and `target` prompts differ in token length (a position-wise
        patch takes the same position from both), as a problem naming `key`; `fix` (the method's own keys) ends it,
        else patching's."""
        a, b = self.role_seqs[source], self.role_seqs[target]
        for start, stop in self._batches:
            for i in range(start, stop):
                if len(a[i]) != len(b[i]):
                    return [f"{key}: sample {i} has {len(a[i])} tokens in {source!r} but {len(b[i])} in {target!r} "
                            f"({self.tokenizer.convert_ids_to_tokens(a[i]) if self.tokenizer else a[i]} vs "
                            f"{self.tokenizer.convert_ids_to_tokens(b[i]) if self.tokenizer else b[i]}); "
                            + (fix or "patching every position takes the same position from both prompts, so pairs "
                               "need one length: give pairs of the same token length, or patch positions: last "
                               "(mapped last to last), or map them with patching.source_positions")]
        return []

    def check(self, model=None, model_cfg=None) -> List[str]:
        """Problems with the model taking these token ids and sequence lengths, found before any work: an id
        beyond its input embedding, or a sequence longer than its learned position embedding."""
        if model is None:
            return []
        batches = [self.seqs[start:stop] for start, stop in self._batches]
        seqs = [seq for batch in batches for seq in batch]
        padded = any(len({len(seq) for seq in batch}) > 1 for batch in batches)
        top = max(max(max(s) for s in seqs), self.pad_id if padded else 0)
        source = ("data.text.tokenizer" if self.tokenizer is not None else
                  "data.dataset" if self.cfg.dataset is not None else "data.text.dataset")

        def named(key: str) -> str:
            return f"model.{key}" if model_cfg is not None and key in model_cfg else f"its config's {key}"

        problems = []
        rows = _embedding_rows(model)
        if rows is not None and top >= rows:
            what = "the pad id" if top == self.pad_id and padded else "a token id of the corpus"
            problems.append(f"{source}: {what} is {top} but the model's input embedding has {rows} rows "
                            f"({named('vocab_size')}); give the model a vocabulary of at least {top + 1}, or the "
                            "tokenizer it was made for")
        name, limit = _positions(model)
        longest = max(map(len, seqs))
        if limit is not None and longest > limit:
            problems.append(f"data.text.max_length: sequences of up to {longest} tokens (max_length "
                            f"{self.text.max_length}) but the model has {limit} positions ({named(name)}); lower "
                            f"data.text.max_length to {limit} or raise {named(name)}")
        return problems

    def token(self, i: int) -> str:
        """The decoded text of one token id."""
        self._decode([i])
        return self.decoded[i]

    def _decode(self, ids: List[int]) -> None:
        """The texts of the ids not decoded yet, in one call (its tokenizer's vocabulary is read once, not per id)."""
        new = sorted(set(ids).difference(self.decoded))
        if new:
            texts = token_texts(self.tokenizer, new) if self.tokenizer is not None else [str(i) for i in new]
            self.decoded.update(zip(new, texts))

    def ranges(self) -> List[Tuple[int, int]]:
        """The sample range [start, stop) of every batch the run sees."""
        return list(self._batches)

    def token_count(self) -> int:
        """Stored tokens of the run: every real token of its samples but those exclude_special leaves out."""
        special = sorted(self.special)  # list.count runs in C: no Python step a token at start-up
        return sum(len(seq) - sum(seq.count(t) for t in special)
                   for start, stop in self._batches for seq in self.seqs[start:stop])

    def batches(self, first: int = 0) -> Iterator[Batch]:
        """Batches from batch `first` on (a resume skips the committed ones without padding them)."""
        for start, stop in self._batches[first:]:
            kwargs, info, table = self._encode(self.seqs[start:stop], start)
            fields = {**kwargs, **{c: values[start:stop] for c, values in (self.meta or {}).items()}}
            roles = {r: (kwargs, info) if r == self.roles[0] else self._encode(self.role_seqs[r][start:stop], start)[:2]
                     for r in self.roles}
            yield Batch([], kwargs, {}, start, stop, fields, tokens=info, table=table, roles=roles or None)

    def _encode(self, seqs: List[List[int]], start: int) -> tuple:
        """(keyword inputs, TokenInfo, token table) of the token ids of one batch's samples."""
        kwargs, info, ids, rows, first = encode_batch(seqs, self.pad_id, self.side, self.text.max_length, self.special,
                                                      self.text.position_ids)
        sample, col = np.divmod(rows, ids.shape[1])
        token_ids = ids.reshape(-1)[rows]
        listed = token_ids.tolist()
        try:  # the texts are known (a rerun, a later batch); else the new ones are decoded first
            texts = list(map(self.decoded.__getitem__, listed))
        except KeyError:
            self._decode(listed)
            texts = list(map(self.decoded.__getitem__, listed))
        table = Columns({"sample": sample + start, "position": col - first[sample], "token_id": token_ids,
                         "token": texts})
        return kwargs, info, table


def _embedding_rows(model) -> Optional[int]:
    """Rows of the model's input embedding (token ids it takes): get_input_embeddings(), else its only Embedding."""
    try:
        embedding = model.get_input_embeddings()
    except Exception:  # noqa: BLE001 - not a Hugging Face model, or one without it
        embedding = None
    if not isinstance(embedding, torch.nn.Embedding):
        found = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        embedding = found[0] if len(found) == 1 else None
    return embedding.num_embeddings if embedding is not None else None


def _positions(model) -> tuple:
    """(config key, positions) of a model with a learned position table of that many rows (GPT-2's n_positions,
    BERT's max_position_embeddings); (None, None) otherwise (rotary positions take any length)."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == limit
                                          for m in model.modules()):
            return name, limit
    return None, None
