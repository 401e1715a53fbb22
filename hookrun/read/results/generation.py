"""The reader of a generate run: cap.generations() (cap.read("generate")), a row per sample. Needs pandas, not torch.

    cap.generations()[["sample", "completion", "stop_reason", "new_tokens"]]
"""
from __future__ import annotations

import pandas as pd

from hookrun.format.layout import GENERATION_COLUMNS, GENERATIONS


def generations(cap) -> pd.DataFrame:
    """cap.generations(): a row per sample of a generate run (sample, batch, prompt, prompt_ids, completion,
    completion_ids, stop_reason, new_tokens, logprobs of each chosen token), ids and log-probs as lists; KeyError on
    a run without a generate block. Beside a running run: the committed batches' rows (none before the first
    commit), a prefix of the final table."""
    generating = bool(((cap.config or {}).get("generate") or {}).get("max_new_tokens"))
    if not generating and GENERATIONS not in cap.tables():
        raise KeyError(f"{cap.path} holds no generations: its run had no generate block (generate.max_new_tokens"
                       "=0); cap.tokens() and cap.load() hold what it captured")
    table = cap.table(GENERATIONS) if GENERATIONS in cap.tables() else pd.DataFrame()
    if not len(table):  # no batch committed yet (a run still being written, or stopped before its first commit)
        return pd.DataFrame({c: pd.Series(dtype=object) for c in GENERATION_COLUMNS})
    for column in ("prompt_ids", "completion_ids", "logprobs"):
        table[column] = [list(v) for v in table[column]]
    return table[GENERATION_COLUMNS].sort_values("sample").reset_index(drop=True)
