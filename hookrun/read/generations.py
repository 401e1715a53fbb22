"""cap.generations(): a generate run's completions, a row per sample (hookrun.run.generate writes them).

    gens = cap.generations()   # sample, batch, prompt, prompt_ids, completion, completion_ids, stop_reason,
                               # new_tokens, logprobs (of each chosen token)
"""
from __future__ import annotations

import pandas as pd

from hookrun.format.layout import GENERATION_COLUMNS, GENERATIONS


def generations(cap) -> pd.DataFrame:
    """A row per sample of a generate run, ids and log-probs as lists; KeyError on a run that generated nothing."""
    if GENERATIONS not in cap._files().tables():
        raise KeyError(f"{cap.path} holds no generations: its run had no generate block (generate.max_new_tokens"
                       "=0); cap.tokens() and cap.load() hold what it captured")
    table = cap.table(GENERATIONS)
    for column in ("prompt_ids", "completion_ids", "logprobs"):
        table[column] = [list(v) for v in table[column]]
    return table[GENERATION_COLUMNS].sort_values("sample").reset_index(drop=True)
