"""CLI: `python -m runner [experiment=NAME] [key=value ...]`; `-m` for sweeps; `--cfg job` prints the config."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from runner.app import run
from runner.errors import RunnerError
from runner.schema import register_configs

log = logging.getLogger("runner")

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except RunnerError as e:
        log.debug("failure detail", exc_info=True)  # the full traceback goes to the run's log file only
        log.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    main()
