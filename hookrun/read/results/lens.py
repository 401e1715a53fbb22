"""The reader of a lens run: cap.read("lens"), a LensResult (with .dla a DLAResult); hookrun.lens / hookrun.dla
(hookrun.analyses) give the same types. Needs numpy and pandas, not torch.

    lens = cap.read("lens"); lens.sample_table(0); lens.to_frame(); lens.dla.frame(); lens.dla.blocks()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pandas as pd

from hookrun.format.layout import DLA, LENS, LENS_ATTR, array_key
from hookrun.format.tokens import token_texts
from hookrun.read.checks import check_count, check_index, warn_nonfinite


@dataclass(repr=False)
class DLAResult:
    """Direct logit attribution as stored: `parts` [samples, components] (the last column the constant `bias`,
    the final norm's and the unembedding's biases along the answer), `logit` [samples] the model's own logit
    (difference), `heads` [samples, layers, heads] (None where not split). parts.sum(1) == logit (checked per batch).

        dla = cap.read("lens").dla; dla.frame()       # a row a sample, a column a component (+ total, logit)
        dla.blocks()                                  # layers x (attn, mlp), means over samples
        dla.top(5)                                    # the components and heads with the largest mean |value|
    """

    parts: np.ndarray
    logit: np.ndarray
    heads: Optional[np.ndarray]
    components: List[str]
    kinds: List[str]
    layers: List[Optional[int]]
    head_layers: List[int]
    tokens: List[str]
    position: object
    samples: np.ndarray

    @property
    def answer(self) -> str:
        """What is attributed: logit(A) or logit(A) - logit(B)."""
        return f"logit({self.tokens[0]})" + (f" - logit({self.tokens[1]})" if len(self.tokens) > 1 else "")

    def frame(self) -> pd.DataFrame:
        """A row a sample: each component's contribution, `total` (their sum) and `logit` (the model's)."""
        df = pd.DataFrame(self.parts, columns=self.components, index=pd.Index(self.samples, name="sample"))
        return df.assign(total=self.parts.sum(1), logit=self.logit)

    def to_frame(self) -> pd.DataFrame:
        """A tidy view: a row a (sample, component) and a row a (sample, head): component, kind (embed | pos_embed
        | attn | mlp | bias | head), layer, head, value."""
        n = len(self.samples)
        frames = [pd.DataFrame({"sample": np.repeat(self.samples, len(self.components)),
                                "component": self.components * n, "kind": self.kinds * n,
                                "layer": pd.array(self.layers * n, dtype="Int64"), "head": pd.NA,
                                "value": self.parts.reshape(-1)})]
        if self.heads is not None:
            s, lay, h = np.meshgrid(self.samples, self.head_layers, np.arange(self.heads.shape[2]), indexing="ij")
            frames.append(pd.DataFrame({"sample": s.ravel(), "component": [f"L{a}.H{b}" for a, b in
                                                                           zip(lay.ravel(), h.ravel())],
                                        "kind": "head", "layer": pd.array(lay.ravel(), dtype="Int64"),
                                        "head": pd.array(h.ravel(), dtype="Int64"), "value": self.heads.reshape(-1)}))
        return pd.concat(frames, ignore_index=True)

    def blocks(self) -> pd.DataFrame:
        """The mean over samples of each block's attention and MLP contribution: a row a layer."""
        mean = self.parts.mean(0) if len(self.parts) else np.zeros(len(self.components))
        table = {}
        for name, kind, layer, value in zip(self.components, self.kinds, self.layers, mean):
            if kind in ("attn", "mlp"):
                table.setdefault(layer, {})[kind] = value
        return pd.DataFrame.from_dict(table, orient="index").rename_axis("layer")

    def top(self, k: int = 5) -> pd.DataFrame:
        """The k components and heads whose mean contribution over samples is largest in size."""
        df = self.to_frame().groupby(["component", "kind", "layer", "head"], dropna=False, sort=False)["value"].mean()
        df = df.reset_index().astype({"layer": "Int64", "head": "Int64"})
        return df.reindex(df["value"].abs().sort_values(ascending=False, kind="stable").index)[:k] \
            .reset_index(drop=True)

    def __repr__(self) -> str:
        lines = [f"DLA of {self.answer} at position {self.position}: {len(self.samples)} samples, "
                 f"{len(self.components)} parts" + (f", heads {list(self.heads.shape[1:])}" if self.heads is not None
                                                    else ""),
                 f"  model's mean {float(np.mean(self.logit)) if len(self.logit) else float('nan'):.4g}, parts' sum "
                 f"{float(self.parts.sum(1).mean()) if len(self.parts) else float('nan'):.4g}", "  top parts:"]
        lines += [f"    {r.component}: {r.value:+.4g}" for r in self.top(6).itertuples()]
        return "\n".join(lines)


@dataclass(repr=False)
class LensResult:
    """The logit lens as stored: `top_ids` / `top_probs` [samples, layers, positions, k] (ids -1 and probabilities
    NaN past a sample's end), `logprob` / `rank` [samples, layers, positions, tokens] of the given tokens (None
    without tokens), `kl` / `entropy` [samples, layers, positions] (KL from the model's own output distribution to
    the lens's, and the lens's entropy, in nats; None in stores written before they were), the axes (`layers`, `positions`: real-token positions, -1 the last; `tokens`: their labels),
    and `dla` (a DLAResult, or None). Token texts come from the run's tokenizer (data.text.tokenizer, rebuilt
    here) or the one given.

        lens = cap.read("lens"); lens.sample_table(0)   # layers x positions: the top token and its probability
        lens.to_frame()                               # a row a (sample, layer, position)
    """

    top_ids: np.ndarray
    top_probs: np.ndarray
    logprob: Optional[np.ndarray]
    rank: Optional[np.ndarray]
    layers: List[str]
    positions: List[int]
    tokens: List[str]
    samples: np.ndarray
    dla: Optional[DLAResult]
    tokenizer: object = None
    _texts: dict = field(default_factory=dict)
    kl: Optional[np.ndarray] = None  # [samples, layers, positions]: KL(the model's output || the lens), nats
    entropy: Optional[np.ndarray] = None  # [samples, layers, positions]: the lens distribution's entropy, nats

    def decode(self, ids) -> List[str]:
        """Each id's text (the run's tokenizer; the id itself without one); '' for -1 (past a sample's end)."""
        out = []
        for i in np.asarray(ids).reshape(-1).tolist():
            i = int(i)
            if i not in self._texts:
                self._texts[i] = ("" if i < 0 else token_texts(self.tokenizer, [i])[0] if self.tokenizer is not None
                                  else str(i))
            out.append(self._texts[i])
        return out

    def sample_table(self, sample: int = 0, k: int = 1) -> pd.DataFrame:
        """Sample `sample`'s lens as a table: a row a layer, a column a position, each cell the top-k tokens' texts
        with their probabilities (`' Paris' 0.41`).

            lens.sample_table(1)        # sample 1 (not "the top 1"); k=3: each cell's three most likely tokens
        """
        return self.top(sample, k)

    def top(self, sample: int = 0, k: int = 1) -> pd.DataFrame:
        """sample_table's older name (kept working): `lens.top(1)` is sample 1's table, not the top 1 of anything."""
        check_index("top", "sample", sample, len(self.top_ids), f"the lens holds {len(self.top_ids)} samples")
        check_count("top", "k", k)
        if k > self.top_ids.shape[3]:
            raise ValueError(f"top(k={k}): the run stored the top {self.top_ids.shape[3]} tokens a site (lens.top_k); "
                             f"give k in 1..{self.top_ids.shape[3]}, or rerun with a larger lens.top_k")
        ids, probs = self.top_ids[sample, :, :, :k], self.top_probs[sample, :, :, :k]
        texts = np.array(self.decode(ids), dtype=object).reshape(ids.shape)
        cells = [[", ".join(f"{texts[a, p, j]!r} {probs[a, p, j]:.2f}" for j in range(ids.shape[2])
                            if ids[a, p, j] >= 0) for p in range(ids.shape[1])] for a in range(ids.shape[0])]
        return pd.DataFrame(cells, index=pd.Index(self.layers, name="layer"),
                            columns=pd.Index(self.positions, name="position"))

    def to_frame(self) -> pd.DataFrame:
        """A tidy view: a row a (sample, layer, position) with `token` and `prob` (the top token), `top_tokens`,
        `top_ids`, `top_probs` (lists of k), `kl` and `entropy`, and per given token `logprob[<label>]`,
        `rank[<label>]`. Positions past a sample's end are left out."""
        s, lay, p = np.meshgrid(np.arange(len(self.samples)), np.arange(len(self.layers)),
                                np.arange(len(self.positions)), indexing="ij")
        ids = self.top_ids.reshape(-1, self.top_ids.shape[-1])
        probs = self.top_probs.reshape(-1, self.top_probs.shape[-1])
        texts = np.array(self.decode(ids), dtype=object).reshape(ids.shape)
        df = pd.DataFrame({"sample": self.samples[s.ravel()], "layer": np.array(self.layers, dtype=object)[lay.ravel()],
                           "position": np.asarray(self.positions)[p.ravel()], "token": texts[:, 0],
                           "prob": probs[:, 0], "top_tokens": list(map(list, texts)), "top_ids": list(map(list, ids)),
                           "top_probs": list(map(list, probs))})
        if self.kl is not None:
            df["kl"], df["entropy"] = self.kl.reshape(-1), self.entropy.reshape(-1)
        if self.logprob is not None:
            lp = self.logprob.reshape(-1, len(self.tokens))
            rk = self.rank.reshape(-1, len(self.tokens))
            for j, label in enumerate(self.tokens):
                df[f"logprob[{label}]"] = lp[:, j]
                df[f"rank[{label}]"] = rk[:, j]
        return df[ids[:, 0] >= 0].reset_index(drop=True)

    def __repr__(self) -> str:
        head = (f"LensResult: {len(self.samples)} samples x {len(self.layers)} layers x {len(self.positions)} "
                f"positions, top {self.top_ids.shape[-1]}")
        head += f", tokens {', '.join(self.tokens)}" if self.tokens else ""
        body = self.top(0).to_string() if len(self.samples) else ""
        return "\n".join([head, "sample 0:", body] + ([repr(self.dla)] if self.dla is not None else []))


def run_tokenizer(cap):
    """The run's tokenizer, built again from its stored config (data.text.tokenizer); None if it has none or it
    cannot be built here."""
    node = (((cap.config or {}).get("data") or {}).get("text") or {}).get("tokenizer")
    if not node:
        return None
    try:
        from hydra.utils import instantiate

        return instantiate(node)
    except Exception:  # noqa: BLE001 - the texts fall back to ids (a tokenizer that needs torch, on a laptop without)
        return None


def load_lens(cap, tokenizer=None) -> LensResult:
    """What a run with a `lens:` block stored (KeyError for a run without one)."""
    attrs = cap.attrs.get(LENS_ATTR)
    if attrs is None:
        raise KeyError(f"{cap.path} has no logit lens; a run with a lens: block stores one")
    samples = cap.samples["sample"].to_numpy() if len(cap.samples) else np.arange(0)
    arrays = set(cap.index["array"]) if len(cap.index) else set()
    load = lambda hook, layer, role: cap.load(hook=hook, layer=layer, role=role)  # noqa: E731
    n, n_layers, n_pos, k = len(samples), len(attrs["layers"]), len(attrs["positions"]), int(attrs["k"])
    if attrs["layers"] and array_key(LENS, "top", "ids") in arrays:
        ids, probs = load(LENS, "top", "ids").astype(np.int64), load(LENS, "top", "probs")
    else:
        ids, probs = np.zeros((n, n_layers, n_pos, k), np.int64), np.zeros((n, n_layers, n_pos, k), np.float32)
    logprob = rank = None
    if attrs["tokens"] and array_key(LENS, "tokens", "logprob") in arrays:
        logprob, rank = load(LENS, "tokens", "logprob"), load(LENS, "tokens", "rank").astype(np.int64)
    kl = entropy = None
    if attrs["layers"] and array_key(LENS, "dist", "kl") in arrays:
        kl, entropy = load(LENS, "dist", "kl"), load(LENS, "dist", "entropy")
    dla = None
    if attrs.get("dla"):
        d = attrs["dla"]
        heads = load(DLA, "answer", "heads") if array_key(DLA, "answer", "heads") in arrays else None
        dla = DLAResult(load(DLA, "answer", "parts"), load(DLA, "answer", "logit"), heads, list(d["components"]),
                        list(d["kinds"]), list(d["component_layers"]), list(d["head_layers"]), list(d["tokens"]),
                        d["position"], samples)
    warn_nonfinite("cap.read('lens')", {"_lens/top/probs": probs, "_lens/tokens/logprob": logprob, "_lens/dist/kl": kl,
                                        "_lens/dist/entropy": entropy, "_dla/answer/parts": dla and dla.parts,
                                        "_dla/answer/logit": dla and dla.logit})
    return LensResult(ids, probs, logprob, rank, list(attrs["layers"]), list(attrs["positions"]),
                      list(attrs["tokens"]), samples, dla, tokenizer if tokenizer is not None else run_tokenizer(cap),
                      kl=kl, entropy=entropy)
