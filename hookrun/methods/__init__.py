"""The method protocol: an analysis a run declares with a top-level config block, in one module.

    class L2Norm(Method):                        # a user's method, registered as an entry point (hookrun.methods)
        key = "l2norm"                           # its config block: `l2norm: {layers: [...]}`
        help = "per-token L2 norm of layers' outputs"
        @classmethod
        def check(cls, cfg): ...                 # problems without the model
        def hooks(self): return {...}            # hooks it plans, as in the hooks block
        def measure(self, job, i, batch, output, hookset): ...   # its per-batch step: sample columns
        @staticmethod
        def read(cap, **kw): ...                 # cap.read("l2norm", **kw)

A method owns, in one place: its block's schema (`annotation`, `default`, `help`: a field of the run's schema),
its checks (`check` without a model, `data_problems` against the data before the model, `model_problems` and `compile` against the model and the data,
`first_batch_problems`), the hooks it plans (`hooks`), its per-batch step (`measure` after each forward, or `step`
for a method that runs the batch itself, as generation does), the arrays it writes (`emit` hands them to the store,
`attrs` and `columns` describe them) and its reader (`read`: a plug-in's own; hookrun's own methods' delegate to
hookrun.read.results, which cap.read finds without importing the method or torch). The runner (hookrun.engine)
knows this protocol only; the registry (hookrun.config.registry) finds the methods.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from hookrun.capture.hooks import Piece
from hookrun.capture.site import Site


@dataclasses.dataclass
class BatchResult:
    """What running one batch gives the runner (hookrun.engine.preflight.step, or a method's own `step`)."""

    batch: object  # the batch on the device, with its token table (a generate run's: prompt and generated tokens)
    loss: Optional[torch.Tensor]
    forward_s: float
    backward_s: float
    columns: Dict[str, object] = dataclasses.field(default_factory=dict)  # cap.samples columns: the metrics
    tables: Dict[str, object] = dataclasses.field(default_factory=dict)  # other tables of the batch: generations
    methods_s: Dict[str, float] = dataclasses.field(default_factory=dict)  # seconds in each method's measure
    commit: bool = False  # the store commits this batch before the next starts (a checkpoint of it was written)


@dataclasses.dataclass(frozen=True)
class MetricUse:
    """A metric of the metrics block that a method scores with (Method.metric_uses), read from the method's own
    block: the key naming it (patching.metric), the metric's name, the roles whose runs it is measured on (each a
    `<metric>.<role>` column of cap.samples), whether the method takes its gradient (`fix`: what the refusal of a
    metric without a useful one adds), and whether the first role is the run a `kl` metric compares to."""

    key: str
    metric: str
    roles: Tuple[str, ...] = ()
    gradient: bool = False
    fix: str = ""
    reference: bool = False

    @property
    def columns(self) -> List[str]:
        """The cap.samples columns of its runs: `<metric>.<role>` a role."""
        return [f"{self.metric}.{role}" for role in self.roles]


class Method:
    """One analysis of a run (see the module's docstring); an instance per run, made from the parsed config."""

    key: str = ""  # the top-level config key of its block
    annotation: Any = Any  # the block's type in the run's schema (a dataclass for a typed block)
    default: Any = None  # the block's default (a dataclass: its defaults); `factory` for a dict, list or dataclass
    factory: Optional[Any] = None
    help: str = ""  # the block's line in the config reference
    own_table: bool = False  # its keys get a table of their own in the config reference (a dataclass block)
    config_errors: tuple = ()  # exception types a failed first batch raises that are the config's (named keys)

    def __init__(self, cfg):
        self.cfg = cfg
        self.spec = getattr(cfg, self.key, None)

    # -- checks ---------------------------------------------------------------------------------------------------
    @classmethod
    def active(cls, cfg) -> bool:
        """Whether the run uses this method (its block is set)."""
        value = getattr(cfg, cls.key, None)
        return value is not None and value != {} and value != []

    @classmethod
    def check(cls, cfg) -> List[str]:
        """Problems with the block that show without the model or the data (every registered method is asked, used
        or not: it may refuse settings of other blocks that need it)."""
        return []

    @classmethod
    def metric_uses(cls, cfg) -> List[MetricUse]:
        """The metrics of the metrics block this method scores with, from its own block: the metrics method checks
        that each exists (and has a gradient where it is taken), and writes down which method writes each
        `<metric>.<role>` column (one writer a column: `metric_columns`)."""
        return []

    @classmethod
    def dictionary_uses(cls, cfg) -> List[Tuple[str, Any]]:
        """(key, name) of each dictionary of the dictionaries block that its own block names: that method checks
        the names (a dictionary it lacks) and loads each once (job.method("dictionaries").load)."""
        return []

    metric_columns: Tuple[str, ...] = ()  # set at compile by the metrics method: the <metric>.<role> columns this
    # method writes to cap.samples (of its metric_uses, those no method before it writes)

    @classmethod
    def generation_problems(cls, cfg) -> List[str]:
        """What this block cannot do in a run that generates (the `generate:` method asks every registered method
        when it runs the batches itself): [] where it works there, or its block is not set."""
        return []

    def hooks(self) -> Dict[str, dict]:
        """Hooks this method plans, by name, as entries of the hooks block (`{kind, layers, capture, reduce, ...}`)."""
        return {}

    def data_problems(self, inputs) -> List[str]:
        """Problems with the block against the data, found before the model is built (the tokenizer is cheap, the
        model is not): roles the data lacks, pairs of unequal token length."""
        return []

    def model_problems(self, model) -> List[str]:
        """Problems with the block against the built model (the inputs are made and checked before it)."""
        return []

    def compile(self, job) -> None:
        """Resolve the block against the model and the data (job: hookrun.engine.build.Run); ConfigError names the
        key of each problem."""

    def memory_need(self, job) -> List[Tuple[float, str, str]]:
        """What the block will hold at once, estimated after compile and before the first batch: (bytes, the key
        to lower, what it is) for each part (IG steps, copies stacked along the batch axis, random circuits);
        memory_problems refuses a run whose parts do not fit the device's free memory."""
        return []

    def first_batch_problems(self, job) -> List[str]:
        """Problems the first batch shows, found before the store exists."""
        return []

    # -- per batch ------------------------------------------------------------------------------------------------
    runs_batch: bool = False  # True: `step` runs each batch in place of one forward (and backward)

    def step(self, job, i: int, batch, hookset) -> BatchResult:
        """Batch `i` run by this method (only where `runs_batch`)."""
        raise NotImplementedError

    def count_rows(self, job, first: int, stop: int, sink) -> Optional[int]:
        """A method that runs the batches itself, in a data-parallel run: the per-token rows of batches
        [first, stop) (found by running them, captures to `sink`); None: the prompt's tokens are the rows."""
        return None

    def measure(self, job, i: int, batch, output, hookset) -> Dict[str, np.ndarray]:
        """After batch `i`'s forward (and backward): hand arrays to the store (`emit`), return cap.samples columns."""
        return {}

    def skip(self, job) -> None:
        """After a forward that is not measured (the first-batch check's second size: it only sizes the hooks'
        arrays): drop whatever was kept for `measure`."""

    def close(self, job) -> None:
        """At the end of the run, also on an error: remove whatever it put on the model outside the run's hooks."""

    # -- what it writes, and its reader ---------------------------------------------------------------------------
    def attrs(self) -> dict:
        """Root attrs describing what the method stored (its arrays' axes, columns)."""
        return {}

    def columns(self) -> List[str]:
        """The cap.samples columns that hold its numbers (collect() averages them per job)."""
        return []

    @staticmethod
    def read(cap, *args, **kwargs):
        """What `cap.read(key, ...)` returns for a run that used this method (cap.read calls a plug-in's; hookrun's
        own methods' delegate to hookrun.read.results, which cap.read calls without importing the method)."""
        raise NotImplementedError


def free_memory(device: torch.device) -> int:
    """Bytes the device can still give: CUDA's free memory (torch.cuda.mem_get_info), else what the OS can give
    this process (MemAvailable of /proc/meminfo; psutil elsewhere; 1 GiB when neither can say).

        free_memory(torch.device("cpu"))    # e.g. 12_884_901_888
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return 1 << 30


def gigabytes(n: float) -> str:
    """'1.2 GB', '340 MB': a byte count as a message says it."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a memory estimate multiplies (Method.memory_need): the largest batch, the longest sequence, the model's
    width, blocks and vocabulary, and its parameters' bytes a value.

        s = run_shape(job); s.batch * s.tokens * s.vocab * 4    # a batch's float32 logits
    """

    batch: int
    tokens: int
    d_model: int
    layers: int
    vocab: int
    itemsize: int


def run_shape(job) -> Shape:
    """The Shape of a compiled run: batches from the data's ranges, tokens from its sequences (else
    data.text.max_length), the rest from the model's embedding and config (GPT-2's and Llama's names)."""
    ranges = job.inputs.ranges() if hasattr(job.inputs, "ranges") else []
    text = job.cfg.data.text
    batch = max((b - a for a, b in ranges), default=int(job.cfg.data.batch_size))
    seqs = getattr(job.inputs, "seqs", None)
    tokens = max((len(s) for s in seqs), default=1) if seqs else int(text.max_length) if text else 1
    config = getattr(job.model, "config", None)
    embed = job.model.get_input_embeddings() if hasattr(job.model, "get_input_embeddings") else None
    weight = getattr(embed, "weight", None)
    d = int(weight.shape[1]) if weight is not None else int(getattr(config, "hidden_size", 1024))
    vocab = int(getattr(config, "vocab_size", 0) or (weight.shape[0] if weight is not None else 1))
    layers = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1)
    param = next(job.model.parameters(), None)
    return Shape(batch, tokens, d, layers, vocab, param.element_size() if param is not None else 4)


ACTIVATIONS = 24  # values a token keeps per block and width in a forward and backward (the circuit's figure, float32)


def nonfinite_weights(model) -> List[str]:
    """The names of the model's parameters that hold NaN or inf (a damaged model folder), in order.

        nonfinite_weights(model)    # ["transformer.h.0.attn.c_attn.weight"]
    """
    with torch.no_grad():
        return [n for n, w in model.named_parameters() if w.is_floating_point() and not bool(torch.isfinite(w).all())]


def nonfinite_cause(model, metric: Optional[str] = None, weights: Optional[List[str]] = None) -> str:
    """The likely cause of NaN or inf in a method's first-batch result, as a message ends: the weights that hold
    NaN or inf (named), else the metric (`metric`: its name), else the activations.

        f"... holds 3 NaN or inf value(s); likely cause: {nonfinite_cause(job.model, 'ld')}"
    """
    weights = nonfinite_weights(model) if weights is None else weights
    if weights:
        return (f"the model's weights hold NaN or inf ({', '.join(weights[:3])}{' ...' if len(weights) > 3 else ''}): "
                "fix the model's files")
    if metric is not None:
        return (f"metric {metric} is NaN or inf on these prompts (a token of probability 0, a function dividing by "
                f"0): check metrics.{metric}")
    return "the model's activations overflow on these prompts (a half-precision model: load it in float32)"


def memory_problems(methods, job, free: Optional[int] = None, share: float = 0.8) -> List[str]:
    """A run whose methods' estimated memory (Method.memory_need) is more than `share` of the device's free memory,
    refused before the first batch with the figure and the key to lower (nothing runs into the allocator).

        problems = memory_problems(job.methods, job)   # ["circuit: about 1.2 TB ... lower circuit.copies ..."]
    """
    free = free_memory(job.device) if free is None else free
    problems = []
    for method in methods:
        parts = method.memory_need(job)
        total = sum(need for need, _, _ in parts)
        if not parts or total <= share * free:
            continue
        need, key, what = max(parts, key=lambda p: p[0])
        problems.append(f"{method.key}: the run would hold about {gigabytes(total)} at once ({what}: "
                        f"{gigabytes(need)}), more than the {gigabytes(free)} free on {job.device}; lower {key}")
    return problems


def emit(hookset, index: int, batch, hook: str, layer: str, role: str, values: torch.Tensor,
         kind: str = "metric") -> None:
    """A method's per-sample array `<hook>/<layer>/<role>` ([samples, ...] of batch `index`) handed to the store."""
    site = Site(hook, layer, role, 0, index, batch.start, batch.stop)
    values = values.detach()
    if values.is_floating_point() or values.dtype == torch.bool:  # integers (token ids, ranks) stay exact
        values = values.float()
    hookset.sink(Piece(site, kind, values, True, "sample"))
