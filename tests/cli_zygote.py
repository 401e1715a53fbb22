"""Runs `python -m hookrun ARGS` for the tests without paying the interpreter's start-up each time: this process
imports what the CLI imports once (torch, transformers, Hydra, zarr, pandas: 4-5 s of a 2-core machine's CPU), then
forks one child per call, which runs hookrun's `__main__` as `python -m hookrun` does (its argv, current directory,
environment, stdin from /dev/null, stdout and stderr to files) and exits with its exit code.

    python tests/cli_zygote.py      # reads one JSON request a line on stdin: {"args", "cwd", "env", "out", "err"}
                                    # answers {"pid": N} when the child starts, then {"rc": code} when it ends

tests/helpers.py (run_cli) starts it and keeps it; nothing imported here runs a model or starts a thread before the
fork, so the child starts from the same state as a fresh interpreter whose imports are done.
"""
import atexit
import json
import os
import runpy
import sys
import traceback

# What `python -m hookrun` imports on its way to a run, done once here (the child finds them in sys.modules)
import hydra  # noqa: F401,E402
import hydra._internal.utils  # noqa: F401,E402
import numpy  # noqa: F401,E402
import pandas  # noqa: F401,E402
import pyarrow.parquet  # noqa: F401,E402
import torch  # noqa: F401,E402
import transformers  # noqa: F401,E402
import zarr  # noqa: F401,E402

import hookrun  # noqa: F401,E402
import hookrun.config.parsing  # noqa: F401,E402
import hookrun.engine.runner  # noqa: F401,E402
from hookrun.config.registry import methods  # noqa: E402

methods()  # every method module imported (the schema needs them)


def child(request: dict) -> None:
    """The CLI run in this forked process, as `python -m hookrun ARGS` in `cwd` with `env`; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        sys.path[0] = os.getcwd()  # python -m puts the current directory first
        sys.argv = ["-m", *request["args"]]  # run_module sets argv[0] to hookrun/__main__.py, as -m does
        code = 0
        runpy.run_module("hookrun", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # as the interpreter exits for it
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    """One request at a time: fork, say the child's pid, wait for it, say its exit code (-N: killed by signal N)."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    serve()
