"""Generate runs under the real `torchrun` (gloo on CPU): every rank generates its own batches into one store, the
store a single process writes (completions, token table, arrays bitwise), sequences stopping at different steps."""
from types import SimpleNamespace

import pandas as pd
import pytest

import hookrun
from hookrun.capture.hooks import BatchError
from hookrun.methods.generation import _same_as_counted
from tests.test_parallel import same_store, torchrun

GEN = ["+experiment=lm_tokens", "data.max_samples=10", "data.batch_size=2", "data.text.max_length=16",
       "generate.max_new_tokens=6", "generate.do_sample=true", "generate.temperature=1.5", "generate.top_k=50",
       "generate.stop=[eos,e]",  # a completion stops at its first 'e': sequences stop at different steps
       "+hooks.steer={kind:forward,layers:[transformer.h.0],capture:[],"
       "edit:[{op:add,value:0.5,coef:2.0,positions:{steps:[1,2]}}]}",
       "+hooks.resid.select={positions:last}", "store.chunk_rows=4", "store.commit_s=0"]


@pytest.mark.slow  # a kill, a resume or several processes: CI's full run
def test_three_ranks_generate_the_store_one_process_generates(tmp_path):
    torchrun(1, *GEN, f"hydra.run.dir={tmp_path / 'one'}")  # one process on one thread, as each rank runs
    proc = torchrun(3, *GEN, f"hydra.run.dir={tmp_path / 'three'}")
    assert "rank 2 of 3: batches 3..4, 4 samples" in proc.stdout + proc.stderr
    one, three = hookrun.open(tmp_path / "one"), hookrun.open(tmp_path / "three")
    same_store(one, three)
    assert one.generations().equals(three.generations()) and one.tokens().equals(three.tokens())
    gens, tokens = three.generations(), three.tokens()
    assert len(gens) == 10 and gens["new_tokens"].nunique() > 1 and set(gens["stop_reason"]) >= {"stop", "length"}
    assert len(tokens) == gens["new_tokens"].sum() == len(three.load(layer="transformer.h.1", role="output"))


def test_a_rank_generating_other_tokens_than_it_counted_fails_the_batch():
    generation = SimpleNamespace(counted={3: [[5, 6], [7]]})
    job = SimpleNamespace(method=lambda key: generation)
    _same_as_counted(job, 3, pd.DataFrame({"completion_ids": [[5, 6], [7]]}))  # the same: nothing to say
    _same_as_counted(job, 4, pd.DataFrame({"completion_ids": [[1]]}))  # not counted (one process): nothing to say
    with pytest.raises(BatchError, match="batch 3: generated other tokens than when this rank counted its rows"):
        _same_as_counted(job, 3, pd.DataFrame({"completion_ids": [[5, 6], [8]]}))
