"""CLI: `python -m runner [experiment=NAME] [key=value ...]`; `-m` for sweeps; `--cfg job` prints the config.

Exit codes: 0 done; 2 bad input (config, files, data) or an interrupted run, with one message on
stderr and the traceback in the run's log; anything else is a bug in the runner.
"""

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
_started = False  # whether Hydra got as far as calling the task: if not, it failed on the config


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _started
    _started = True
    try:
        run(cfg)
    except RunnerError as e:
        log.debug("failure detail", exc_info=True)  # the full traceback goes to the run's log file only
        log.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as done:
        # Hydra reports a config it cannot compose (unknown key, wrong type, missing group option) with
        # one message and exit 1; that is bad input too, so it gets the bad-input code.
        sys.exit(2 if done.code == 1 and not _started else done.code)
