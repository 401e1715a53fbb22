"""The batching rule (hookrun.data.batching), one rule for every input source: over a grid of data lengths,
batch sizes, strides and max_samples, the batches of tensor inputs, map-style and iterable datasets and text
inputs are the ones a per-sample computation written here gives."""
import copy
import itertools

import torch

from hookrun.config.schema import DataConfig, TextConfig
from hookrun.data import make_inputs
from hookrun.data.batching import slices
from hookrun.data.inputs import Inputs
from hookrun.data.text import TextInputs

GRID = list(itertools.product((1, 7, 12), (1, 2, 5), (1, 3), (None, 1, 4, 7, 30)))  # length, batch_size, stride, max


def expected(length, batch_size, stride, max_samples):
    """[start, stop) of each batch, sample by sample: sample j lies in slice j // batch_size, which is kept when
    its number is a multiple of stride; the first max_samples kept samples are used, grouped by slice."""
    used = [j for j in range(length) if (j // batch_size) % stride == 0][:max_samples]
    groups = [list(g) for _, g in itertools.groupby(used, key=lambda j: j // batch_size)]
    return [(g[0], g[-1] + 1) for g in groups]


class Numbered(torch.utils.data.Dataset):
    """Item i shows which sample it is: tensor([i]), or (tokens=True) the document of token ids
    [i + 1] * (1 + i % 3), as a dataset of 1-D token tensors (text inputs) holds."""

    def __init__(self, n, tokens=False):
        self.n, self.tokens = n, tokens

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((1 + i % 3,), i + 1, dtype=torch.long) if self.tokens else torch.tensor([float(i)])


class NumberedStream(torch.utils.data.IterableDataset):
    """Numbered without len(): read in order."""

    def __init__(self, n):
        self.items = Numbered(n)

    def __iter__(self):
        return (self.items[i] for i in range(len(self.items)))


def grid(**source):
    """(length, batch_size, stride, max_samples) over GRID, with a data config
    set to each point in turn; `source` is its inputs, dataset or text."""
    for length, bs, stride, most in GRID:
        cfg = DataConfig(**{"text": None, **copy.deepcopy(source)}, batch_size=bs, stride=stride, max_samples=most)
        yield cfg, length, expected(length, bs, stride, most)


def samples_of(batch):
    """The sample numbers a batch holds (tensor inputs and datasets: the values; text: the first token id - 1)."""
    if "input_ids" in batch.kwargs:
        return (batch.kwargs["input_ids"][:, 0] - 1).tolist()
    return batch.args[0][:, 0].long().tolist()


def check(inputs, want, known_length=True):
    got = list(inputs.batches())
    assert [(b.start, b.stop) for b in got] == want
    assert [samples_of(b) for b in got] == [list(range(a, b)) for a, b in want]
    if known_length:
        assert inputs.ranges() == want
        assert inputs.batch_count() == len(want) and inputs.sample_count() == sum(b - a for a, b in want)
    if len(want) > 1:  # a resume from batch 1 gets the same batches after it
        assert [(b.start, b.stop) for b in inputs.batches(1)] == want[1:]


def test_the_rule_cuts_slices_keeps_every_stride_th_and_stops_at_max_samples():
    assert list(slices(4, 2, 6, 20)) == [(0, 4, True), (4, 8, False), (8, 10, True)]
    assert list(slices(4, 3, None, 10)) == [(0, 4, True), (4, 8, False), (8, 10, False)]
    assert list(itertools.islice(slices(2, 1), 3)) == [(0, 2, True), (2, 4, True), (4, 6, True)]  # no end given


def test_the_reference_computation_on_cases_worked_by_hand():
    assert expected(12, 5, 2, 7) == [(0, 5), (10, 12)]  # slices 0..5 kept, 5..10 skipped, 10..12 kept
    assert expected(5, 2, 3, None) == [(0, 2)]  # slices 2..4 and 4..5 skipped
    assert expected(7, 3, 1, 4) == [(0, 3), (3, 4)]  # max_samples cuts the second batch


def test_tensor_inputs_batch_by_the_rule():
    for cfg, length, want in grid():
        cfg.inputs = {"x": [[float(i)] for i in range(length)]}
        check(Inputs(cfg, seed=0), want)


def test_a_map_style_dataset_batches_by_the_rule():
    for cfg, length, want in grid(dataset={"_target_": "tests.test_batching.Numbered", "n": 0}):
        cfg.dataset["n"] = length
        check(Inputs(cfg, seed=0), want)


def test_a_dataset_without_len_batches_by_the_rule():
    for cfg, length, want in grid(dataset={"_target_": "tests.test_batching.NumberedStream", "n": 0}):
        cfg.dataset["n"] = length
        inputs = Inputs(cfg, seed=0)
        assert inputs.ranges() is None and inputs.batch_count() is None
        check(inputs, want, known_length=False)


def test_text_inputs_batch_by_the_rule():
    for cfg, length, want in grid(text=TextConfig(max_length=8)):
        docs = [[i + 1] * (1 + i % 3) for i in range(length)]
        check(TextInputs(cfg, seed=0, docs=docs), want)


def test_a_dataset_of_token_tensors_is_text_inputs_batched_by_the_rule():
    for cfg, length, want in grid(dataset={"_target_": "tests.test_batching.Numbered", "n": 0, "tokens": True}):
        cfg.dataset["n"] = length
        inputs = make_inputs(cfg, seed=0)
        assert isinstance(inputs, TextInputs)
        check(inputs, want)


def test_a_text_batch_and_its_token_info_are_what_torch_gives_row_by_row():
    """TextInputs builds a batch in numpy: its ids, mask, position ids, stored tokens, lengths, first columns and
    token table equal torch's, worked out here a row at a time, on both padding sides with a token left out."""
    docs = [[3, 5, 7], [9], [5, 4, 6, 8, 2], [1, 1]]
    for side in ("right", "left"):
        cfg = DataConfig(text=TextConfig(max_length=8, padding_side=side), batch_size=4)
        inputs = TextInputs(cfg, seed=0, docs=docs)
        inputs.special = {5}  # as exclude_special leaves BOS / EOS / pad ids out
        batch = next(iter(inputs.batches()))
        info, kwargs, table = batch.tokens, batch.kwargs, batch.table.frame()
        ids, mask = torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long)
        for row, doc in enumerate(docs):
            cols = slice(0, len(doc)) if side == "right" else slice(5 - len(doc), 5)
            ids[row, cols], mask[row, cols] = torch.tensor(doc), 1
        keep = mask.bool() & (ids != 5)
        assert torch.equal(kwargs["input_ids"], ids) and torch.equal(kwargs["attention_mask"], mask)
        assert torch.equal(kwargs["position_ids"], (mask.cumsum(1) - 1).clamp(min=0))
        assert torch.equal(info.mask, mask.bool()) and torch.equal(info.keep, keep) and not info.all_kept
        assert torch.equal(info.kept_rows, keep.reshape(-1).nonzero().squeeze(1))
        assert torch.equal(info.lengths, mask.sum(1)) and torch.equal(info.first, (mask.cumsum(1) == 0).sum(1))
        sample, col = keep.nonzero(as_tuple=True)
        assert table["sample"].tolist() == sample.tolist()
        assert table["position"].tolist() == (col - (mask.cumsum(1) == 0).sum(1)[sample]).tolist()
        assert table["token_id"].tolist() == ids[sample, col].tolist()
        assert table["token"].tolist() == [str(i) for i in ids[sample, col].tolist()]  # (no tokenizer: the ids)
