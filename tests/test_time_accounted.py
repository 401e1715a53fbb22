"""Where a run's time went (issue 56): each method's own passes (its per-batch measure) have their line in the
summary, the summary attrs and the progress line, by the method's config key; what a run does in its loop adds up."""
import logging
import re

import hookrun
from hookrun.engine import summary
from hookrun.engine.progress import Progress
from hookrun.engine.runner import run
from tests.helpers import make_cfg


def test_a_patching_runs_own_passes_are_in_the_summary(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hookrun"):
        cap = hookrun.open(run(make_cfg(["+experiment=patching_grid", f"store.path={tmp_path / 'run.zarr'}"])))
    line = next(m for m in caplog.messages for m in m.splitlines() if m.startswith("wall "))
    found = re.search(r"loop ([\d.]+) s \(forward ([\d.]+) s, backward ([\d.]+) s, hooks ([\d.]+) s, "
                      r"metrics ([\d.]+) s, patching ([\d.]+) s\)", line)
    assert found, line
    loop, forward, backward, hooks, metrics, patching = map(float, found.groups())
    assert patching > forward  # a grid runs a patched forward a site: far more than the run's own one a batch
    assert forward + backward + metrics + patching <= loop + 1e-3
    timing = cap.attrs["summary"]["timing"]
    assert set(timing["methods_s"]) == {"metrics", "patching"}
    assert round(timing["methods_s"]["patching"], 3) == patching


def test_the_summary_and_the_progress_line_name_each_methods_time():
    timing = dict(wall_s=2.0, loop_s=1.5, forward_s=1.0, backward_s=0.25, capture_s=0.125, write_s=2.5,
                  methods_s={"circuit": 0.0625})
    text = summary.text("x.zarr", [], timing, 10, "sync")
    assert "loop 1.500 s (forward 1.000 s, backward 0.250 s, hooks 0.125 s, circuit 0.062 s) + closing" in text
    progress = Progress(iter(()), total=40, initial=10, every_s=0, show=False)
    line = progress.line(20, 80, 0, 0, 10.0, {"circuit": 41.04, "metrics": 0.01})
    assert line == "batch 20/40 (50%), 80 samples, 0.0 MB/s, circuit 41.0 s, ETA 0:00:20"  # metrics: under 0.05 s
