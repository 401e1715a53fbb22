"""Hydra entry point: `python -m hookrun +experiment=NAME [overrides]`.

A failed run exits non-zero with one short message; HYDRA_FULL_ERROR=1 shows the traceback.
Exit codes: 0 done, 1 the run failed, 2 the config (or a Hydra override) is wrong and nothing ran,
128 + signal for SIGTERM (143) and SIGINT (130), after the finished batches are committed.
"""
import logging
import os
import sys
import time

import hydra
from omegaconf import DictConfig

from hookrun.config.schema import ConfigError, override_problems, register_configs


def process_start() -> float:
    """time.time() when this process started (Linux: from /proc, so the interpreter's and the imports' time count
    too); elsewhere, now."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks after boot
            up = float(uptime.read().split()[0])
        return time.time() - max(up - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


launched = process_start()  # the start-up time in the summary; files older than this in an inspect run's dir are
# not this launch's

register_configs()
log = logging.getLogger("hookrun")
entered = []  # set once Hydra composed a config and called main(): a SystemExit before that is Hydra's


@hydra.main(version_base="1.3", config_path="pkg://hookrun.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hookrun.capture.hooks import KINDS
    from hookrun.config.schema import parse
    from hookrun.engine.runner import Interrupted, run

    entered.append(True)
    try:
        try:
            cfg = parse(cfg, tuple(KINDS))  # typed and frozen: nothing below this reads omegaconf
            run(cfg, launched, hydra_context())
        except BrokenPipeError:  # `inspect=true | head`: the reader closed the pipe, having read what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            if not cfg.config.inspect:
                raise
        if cfg.config.inspect:  # inspect writes nothing: not even Hydra's run dir
            from hydra.core.hydra_config import HydraConfig

            from hookrun.engine.inspect import discard_run_dir

            hc = HydraConfig.get()
            named = any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in hc.overrides.hydra)
            discard_run_dir(hc.runtime.output_dir, keep_dir=named, since=launched)  # a dir the user named stays as it is
    except Interrupted as stop:
        sys.exit(128 + stop.signum)
    except Exception as err:  # noqa: BLE001 - every failure ends in one short message
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        code, message = failure(err)
        log.error("%s", message)
        sys.exit(code)


def hydra_context() -> dict:
    """Output dir, group choices and overrides of the Hydra job running now ({} outside Hydra), and the torch
    threads of a parallel sweep's job."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from hookrun.engine.cores import job_threads

    if not HydraConfig.initialized():
        return {}
    hc = HydraConfig.get()
    return {"output_dir": hc.runtime.output_dir, "choices": dict(hc.runtime.choices),  # overrides as typed, not
            "overrides": OmegaConf.to_container(hc.overrides.task), "threads": job_threads(hc)}  # resolved (${oc.env:})


def failure(err: Exception) -> tuple:
    """(exit code, the one short message) for a run that raised: 2 for a config problem, 1 otherwise."""
    if isinstance(err, ConfigError):
        return 2, str(err)
    return 1, f"run failed: {type(err).__name__}: {err}\n(set HYDRA_FULL_ERROR=1 for the full traceback)"


def cli() -> None:
    """main() with Hydra's own config errors (a malformed override, an unknown experiment) exiting 2 too, and
    overrides of keys the schema lacks refused first, with the suggestion check() gives (config.override_problems)."""
    from hydra._internal.utils import get_args_parser

    from hookrun.config.schema import conf_dir
    from hookrun.config.yamlcheck import yaml_problems

    args = get_args_parser().parse_known_args()[0]
    problems = yaml_problems(args.overrides, [args.config_dir] if args.config_dir else [],  # PyYAML's traceback,
                             args.config_name or "config", [conf_dir()])  # as one line: file:line:column
    if not problems and not args.config_name:  # another primary config: its own keys
        problems = override_problems(args.overrides)
    if problems:
        print(ConfigError(problems), file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before the store opened (imports, checks, model build): nothing was written
        print("interrupted before the run started; nothing was written", file=sys.stderr)
        sys.exit(130)
    except SystemExit as done:
        if done.code == 1 and not entered:
            sys.exit(2)
        raise


if __name__ == "__main__":
    cli()
