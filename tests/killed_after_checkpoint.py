"""`python -m hookrun ARGS`, whose process SIGKILLs itself right after writing its train block's checkpoint number
HOOKRUN_TEST_KILL_SAVE when its torchrun RANK (0 without torchrun) is HOOKRUN_TEST_KILL_RANK (default 0): a run
killed after its checkpoint was written and before its batch was committed (tests/test_train_run.py).

    HOOKRUN_TEST_KILL_SAVE=3 python -m tests.killed_after_checkpoint OVERRIDES...   # or as torchrun's -m module
"""
import os
import runpy
import signal
import sys

from hookrun.methods import training

save = training.Train._save
written = {"n": 0}


def save_then_die(self, job, state, every_rank=False):
    """Train's checkpoint write, then SIGKILL at the chosen one (only writes this rank makes are counted)."""
    save(self, job, state, every_rank)
    if self.rank != 0 and not every_rank:
        return
    written["n"] += 1
    if os.environ.get("RANK", "0") == os.environ.get("HOOKRUN_TEST_KILL_RANK", "0") and \
            written["n"] == int(os.environ.get("HOOKRUN_TEST_KILL_SAVE", "0")):
        os.kill(os.getpid(), signal.SIGKILL)


training.Train._save = save_then_die
sys.argv = ["hookrun", *sys.argv[1:]]
runpy.run_module("hookrun", run_name="__main__", alter_sys=True)
