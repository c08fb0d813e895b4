"""Processes that share the CPUs wait asleep (runner/cpu_sharing.py): a parallel sweep's workers and torchrun's ranks
that would run more torch threads than the machine has CPUs start with OMP_WAIT_POLICY=PASSIVE; a process alone on
its CPUs, a one-thread worker and a policy the user set are left as they are."""

from __future__ import annotations

import os
import sys

import pytest
from omegaconf import OmegaConf

from runner import cpu_sharing
from runner.cpu_sharing import PASSIVE, WAIT_POLICY, SharedCpusCallback, concurrent_jobs, oversubscribed
from tests.conftest import CONF


@pytest.mark.parametrize(
    ("processes", "threads", "cpus", "expected"),
    [
        (2, None, 2, True),  # two joblib workers, each with every CPU's thread
        (4, 1, 2, False),  # one thread each: nothing waits
        (2, 1, 2, False),
        (1, None, 16, False),  # a plain run alone on its CPUs
        (2, 4, 8, False),  # 8 threads on 8 CPUs: fits
        (3, 3, 8, True),  # 9 threads on 8 CPUs
    ],
)
def test_oversubscribed_counts_every_process_thread_against_the_cpus(
    processes: int, threads: int | None, cpus: int, expected: bool
) -> None:
    assert oversubscribed(processes, threads, cpus) is expected


def test_concurrent_jobs_counts_as_joblib_does() -> None:
    launcher = OmegaConf.create
    assert concurrent_jobs(launcher({"n_jobs": 4}), cpus=2) == 4
    assert concurrent_jobs(launcher({"n_jobs": -1}), cpus=8) == 8  # joblib's default: every CPU
    assert concurrent_jobs(launcher({"n_jobs": -2}), cpus=8) == 7
    assert concurrent_jobs(launcher({"n_jobs": -20}), cpus=8) == 1
    assert concurrent_jobs(launcher({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}), 8) == 1


def _sweep_config(n_jobs: int, threads: int | None) -> object:
    return OmegaConf.create({"threads": threads, "hydra": {"launcher": {"n_jobs": n_jobs}}})


def test_the_sweeps_workers_start_asleep_when_they_would_oversubscribe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's process sets the policy its workers start with, and removes it when the sweep ends."""
    monkeypatch.setattr(cpu_sharing, "available_cpus", lambda: 2)
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    callback = SharedCpusCallback()
    callback.on_multirun_start(_sweep_config(n_jobs=-1, threads=None))  # 2 workers x 2 threads on 2 CPUs
    assert os.environ.get(WAIT_POLICY) == PASSIVE
    callback.on_multirun_end(_sweep_config(n_jobs=-1, threads=None))
    assert WAIT_POLICY not in os.environ

    callback.on_multirun_start(_sweep_config(n_jobs=2, threads=1))  # one thread each: left alone
    assert WAIT_POLICY not in os.environ
    callback.on_multirun_end(_sweep_config(n_jobs=2, threads=1))


def test_a_policy_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_sharing, "available_cpus", lambda: 2)
    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    callback = SharedCpusCallback()
    callback.on_multirun_start(_sweep_config(n_jobs=4, threads=None))
    callback.on_multirun_end(_sweep_config(n_jobs=4, threads=None))
    assert os.environ[WAIT_POLICY] == "ACTIVE"


def test_a_torchrun_rank_sets_it_only_before_torch_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """libgomp reads the policy when torch loads it: a rank sets it before its first torch import, never after."""
    monkeypatch.setattr(cpu_sharing, "available_cpus", lambda: 2)
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not cpu_sharing.rank_waits_asleep_where_shared(None)  # torch is loaded in this process: too late
    monkeypatch.delitem(sys.modules, "torch")
    assert not cpu_sharing.rank_waits_asleep_where_shared(1)
    assert cpu_sharing.rank_waits_asleep_where_shared(None) and os.environ[WAIT_POLICY] == PASSIVE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv(WAIT_POLICY)
    assert not cpu_sharing.rank_waits_asleep_where_shared(None) and WAIT_POLICY not in os.environ


def test_every_sweep_registers_the_callback() -> None:
    """The composed config's Hydra callbacks name it (conf/hydra/default.yaml), so Hydra calls it in every sweep's
    own process, with the joblib launcher too."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=joblib"], return_hydra_config=True)
    assert cfg.hydra.callbacks.shared_cpus._target_ == "runner.cpu_sharing.SharedCpusCallback"
    assert concurrent_jobs(cfg.hydra.launcher, cpus=4) == 4  # its default n_jobs=-1: every CPU
