"""`python -m hookrun ARGS`, whose process SIGKILLs itself right after writing its train block's checkpoint number
HOOKRUN_TEST_KILL_SAVE when its torchrun RANK (0 without torchrun) is HOOKRUN_TEST_KILL_RANK (default 0): a run
killed after its checkpoint was written and before its batch was committed (tests/test_train_run.py).
With HOOKRUN_TEST_KILL_FINISH=STORE:BATCH instead, that rank dies as its training finishes (Train._finish, after
every checkpoint), once the store STORE holds batch BATCH committed (another rank's last: that rank has finished).

    HOOKRUN_TEST_KILL_SAVE=3 python -m tests.killed_after_checkpoint OVERRIDES...   # or as torchrun's -m module
"""
import os
import runpy
import signal
import sys
import time

from hookrun.methods import training

save, finish = training.Train._save, training.Train._finish
written = {"n": 0}


def _chosen() -> bool:
    return os.environ.get("RANK", "0") == os.environ.get("HOOKRUN_TEST_KILL_RANK", "0")


def save_then_die(self, job, state, every_rank=False, final=False):
    """Train's checkpoint write, then SIGKILL at the chosen one (only writes this rank makes are counted)."""
    save(self, job, state, every_rank, final)
    if self.rank != 0 and not every_rank:
        return
    written["n"] += 1
    if _chosen() and written["n"] == int(os.environ.get("HOOKRUN_TEST_KILL_SAVE", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


def committed(store: str, batch: int) -> bool:
    """Whether the (unfinished) store at `store` holds batch `batch` committed."""
    import hookrun
    try:
        return batch in set(hookrun.open(store).samples["batch"])
    except Exception:  # noqa: BLE001 - not readable yet: not committed
        return False


def die_when_the_other_finished(self, job):
    """SIGKILL before the training's finish, once the other rank's last batch is committed (60 s at most)."""
    store, batch = os.environ["HOOKRUN_TEST_KILL_FINISH"].rsplit(":", 1)
    deadline = time.monotonic() + 60
    while not committed(store, int(batch)) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


training.Train._save = save_then_die
if os.environ.get("HOOKRUN_TEST_KILL_FINISH") and _chosen():
    training.Train._finish = die_when_the_other_finished
sys.argv = ["hookrun", *sys.argv[1:]]
runpy.run_module("hookrun", run_name="__main__", alter_sys=True)
