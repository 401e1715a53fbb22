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

from hookrun.config.checks import ConfigError
from hookrun.config.commandline import override_problems
from hookrun.config.rundir import register as register_run_dir
from hookrun.config.schema import register_configs
from hookrun.format.layout import COMPLETE, FAILED, INTERRUPTED


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
register_run_dir()
log = logging.getLogger("hookrun")
entered = []  # set once Hydra composed a config and called main(): a SystemExit before that is Hydra's


@hydra.main(version_base="1.3", config_path="pkg://hookrun.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hookrun.capture.hooks import KINDS
    from hookrun.config.parsing import parse
    from hookrun.engine.jobs import write_record
    from hookrun.engine.runner import Interrupted, run

    entered.append(True)
    logging.raiseExceptions = False  # `... | head`: a log line after the reader closed the pipe has nowhere to go
    job = sweep_job(cfg)  # a multirun's job: it records how it ended and a failure lets the sweep go on
    where = None
    try:
        try:
            cfg = parse(cfg, tuple(KINDS))  # typed and frozen: nothing below this reads omegaconf
            where = run(cfg, launched, hydra_context())
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
        elif job:
            write_record(status=COMPLETE, **{**job, "store": where or job["store"]})
    except Interrupted as stop:
        if job:
            write_record(status=INTERRUPTED, reason=f"interrupted by {stop}", exit_code=128 + stop.signum, **job)
        sys.exit(128 + stop.signum)
    except Exception as err:  # noqa: BLE001 - every failure ends in one short message
        code, message = failure(err)
        if job:  # recorded before anything else: the sweep's tally and hookrun.collect read it
            write_record(status=FAILED, reason=message, exit_code=code, **job)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", message)
        if job:
            return  # Hydra's launcher runs the sweep's other jobs; SweepTally exits non-zero at its end
        sys.exit(code)


def sweep_job(cfg: DictConfig) -> dict:
    """{output_dir, job, overrides, store} of the multirun job running now, for its record (hookrun.engine.jobs);
    {} outside a multirun. `store` is store.path resolved (${hydra:job.num} and all), else the job's captures.zarr."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return {}
    hc = HydraConfig.get()
    try:
        store = OmegaConf.select(cfg, "store.path", throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve: the run says why
        store = None
    if store and "://" not in str(store):
        store = os.path.abspath(os.path.expanduser(str(store)))  # collect finds it from any directory
    return {"output_dir": hc.runtime.output_dir, "job": hc.job.num, "overrides": list(hc.overrides.task),
            "store": store or os.path.join(hc.runtime.output_dir, "captures.zarr")}


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


def open_block(override: str) -> str:
    """`KEY={...}` where KEY is (inside) a free-form block of the schema (data.inputs, vars, hooks, model, metrics,
    patching, loss, ...) as `++KEY={...}`: the mapping merges into the block as Hydra merges dicts, new keys
    included, instead of Hydra's `Key 'x' is not in struct` (Hydra closes every dict of a typed config). Other
    overrides come back as they are."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from hookrun.config.schema import run_schema, schema_field

    try:
        o = OverridesParser.create().parse_overrides([override])[0]
    except HydraException:
        return override  # Hydra says what is malformed itself
    if (o.is_add() or o.is_force_add() or o.is_delete() or o.package is not None or o.is_hydra_override()
            or o.is_sweep_override() or not isinstance(o.value(), dict)):
        return override
    schema = run_schema()
    for part in o.key_or_group.split("."):
        if part not in getattr(schema, "__dataclass_fields__", {}):
            return override  # not a key of the schema: override_problems (or Hydra) says so
        schema = schema_field(schema, part)
        if schema is None:  # Any or Dict[str, Any]: the user's own keys belong here
            return f"++{override}"
    return override


def cli() -> None:
    """main() with Hydra's own config errors (a malformed override, an unknown experiment) exiting 2 too, and
    overrides of keys the schema lacks refused first, with the suggestion check() gives (config.override_problems)."""
    from hydra._internal.utils import get_args_parser

    from hookrun.config.schema import conf_dir
    from hookrun.config.yamlcheck import yaml_problems

    args = get_args_parser().parse_known_args()[0]
    if not args.config_name:  # a block given whole on the command line merges into a free-form block
        sys.argv[1:] = [open_block(a) if a in args.overrides else a for a in sys.argv[1:]]
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
