"""One site vocabulary and one selection rule for every language-model method (runner/site_kinds.py): each LM option
says what it reads, a repeated or empty layer list and an unknown or repeated site are refused by the config's check
with one message, and the model adapters read the same list."""

from __future__ import annotations

import dataclasses

import pytest

from runner.errors import RunnerError
from runner.models import lm_sites
from runner.options.registry import LM_FAMILY, METHODS, discover
from runner.site_kinds import DICTIONARY_KINDS, PER_HEAD, SITE_KINDS, check_layers, check_sites


def lm_configs() -> dict[str, object]:
    discover()
    return {option.name: option.schema() for option in METHODS if option.family == LM_FAMILY}


def test_every_language_model_method_says_which_sites_it_reads() -> None:
    configs = lm_configs()
    assert set(configs) == {"lm_patching", "lm_grad_x_act", "lm_logit_lens", "lm_attention", "lm_edges", "lm_dla",
                            "lm_cache", "train_sae"}  # fmt: skip
    for name, cfg in configs.items():
        selection = cfg.selection()
        assert selection is not None and selection.sites and set(selection.sites) <= set(SITE_KINDS), name
        selection.check()  # the defaults pass the rule
    assert lm_sites.SITE_KINDS is SITE_KINDS and set(PER_HEAD) <= {*SITE_KINDS, *DICTIONARY_KINDS}


def with_layers(cfg: object, layers: list[int]) -> object:
    if hasattr(cfg, "patching"):
        return dataclasses.replace(cfg, patching=dataclasses.replace(cfg.patching, layers=layers))
    return dataclasses.replace(cfg, layers=layers)


@pytest.mark.parametrize("name", ["lm_patching", "lm_grad_x_act", "lm_logit_lens", "lm_attention", "lm_cache"])
def test_a_repeated_or_empty_layer_list_is_refused_by_every_method_alike(name: str) -> None:
    cfg = lm_configs()[name]
    key = "method.patching.layers" if name == "lm_patching" else "method.layers"
    with pytest.raises(RunnerError, match=rf"^{key}=\[1, 1\] names layer\(s\) \[1\] twice: give each layer once\.$"):
        with_layers(cfg, [1, 1]).check()
    with pytest.raises(RunnerError, match=rf"^{key}=\[\]: give at least one layer"):
        with_layers(cfg, []).check()
    assert with_layers(cfg, [0, 1]).check() == []


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        (["head", "head"], r"method.sites=\['head', 'head'\]: each one of resid_pre, .*, once \(at least one\)\.$"),
        (["hed"], r"Did you mean: head\?$"),
        ([], r"method.sites=\[\]: each one of"),
    ],
)
def test_sites_are_known_and_named_once(sites: list[str], message: str) -> None:
    with pytest.raises(RunnerError, match=message):
        check_sites("method.sites", sites)
    cfg = dataclasses.replace(lm_configs()["lm_grad_x_act"], sites=sites)
    with pytest.raises(RunnerError, match=message):
        cfg.check()


def test_every_layer_is_null_not_an_empty_list() -> None:
    check_layers("method.layers", None)  # null: every layer, no refusal
    with pytest.raises(RunnerError):
        check_layers("method.layers", [])
