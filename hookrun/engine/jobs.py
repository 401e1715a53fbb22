"""How each job of a sweep ended, so one bad job does not stop the others: its record, and the sweep's tally.

    write_record(output_dir, "failed", reason="hooks.fmaps.layers: 'conv9' matches no module", exit_code=2)
    python -m hookrun -m +experiment=conv_fmaps layers=conv1,conv9,pool1
    # ... 3 jobs: 2 complete, 1 failed (job 1: hooks.fmaps.layers: 'conv9' matches no module ...)   (exit 2)

The entry point writes `hookrun-job.json` (format.layout.JOB_RECORD) into every multirun job's output dir: the job's
number, overrides, status (complete, failed, interrupted), a one-line reason, the exit code a single run would have
given, and the store's resolved path. A failed job returns normally, so that Hydra's launchers run the rest;
`SweepTally` (a Hydra callback in conf/config.yaml) prints how the jobs ended and exits with a failed job's code.
hookrun.collect reads the same records (a `status` and a `reason` column).
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

from hookrun.format.layout import COMPLETE, FAILED, JOB_RECORD

log = logging.getLogger("hookrun")


def one_line(message: str, most: int = 300) -> str:
    """A message as one line: its lines joined with '; ' (a config error's list markers dropped), at most `most`
    characters."""
    lines = [line.strip().removeprefix("- ") for line in str(message).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith("problem(s) in the config:"):
        lines = lines[1:]
    text = "; ".join(line for line in lines if not line.startswith("(set HYDRA_FULL_ERROR"))
    return text if len(text) <= most else text[:most - 3] + "..."


def write_record(output_dir, status: str, reason: Optional[str] = None, exit_code: int = 0, job: Optional[int] = None,
                 overrides=(), store: Optional[str] = None) -> Path:
    """Write a sweep job's record (JOB_RECORD) into its output dir; returns its path."""
    path = Path(output_dir) / JOB_RECORD
    record = {"job": job, "status": status, "reason": one_line(reason) if reason else None, "exit_code": exit_code,
              "overrides": list(overrides), "store": None if store is None else str(store)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def tally(records: list) -> tuple:
    """(the line that says how a sweep's jobs ended, the exit code: 0, or the failed jobs' code when they share
    one, else 1) from its job records (dicts as write_record writes them, with their `job`)."""
    counts: dict = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    order = [COMPLETE, FAILED] + sorted(s for s in counts if s not in (COMPLETE, FAILED))
    parts = ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    bad = [r for r in records if r["status"] != COMPLETE]
    shown = "; ".join(f"job {r['job']}: {r['reason'] or r['status']}" for r in bad[:3])
    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    line = f"{len(records)} job{'s' * (len(records) != 1)}: {parts}" + (f" ({shown}{more})" if bad else "")
    codes = {int(c) if c == c and c else 1 for c in (r.get("exit_code") for r in bad)}  # NaN, None, 0: 1
    return line, (0 if not bad else codes.pop() if len(codes) == 1 else 1)


class SweepTally(Callback):
    """Hydra callback (conf/config.yaml): at the end of a multirun, how its jobs ended (from their records) in one
    line, and a non-zero exit when some failed (the failed jobs' exit code when they share one, else 1)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        from hookrun.read.captures import sweep_jobs

        jobs = sweep_jobs(sweep_dir)
        if not jobs:
            return
        line, code = tally(jobs)
        (log.info if code == 0 else log.error)("%s", line if code == 0 else
                                               f"{line}\nhookrun.collect({str(sweep_dir)!r}) lists every job")
        if code:
            sys.exit(code)
