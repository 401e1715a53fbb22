"""Hydra entry point: `python -m hookrun +experiment=NAME [overrides]`."""
import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from hookrun.config import ConfigError, register_configs
from hookrun.hooks import HookError
from hookrun.store import StoreError

register_configs()
log = logging.getLogger("hookrun")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hookrun.runner import run

    try:
        run(cfg)
    except (ConfigError, HookError, StoreError) as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", err)
        sys.exit(2)


if __name__ == "__main__":
    main()
