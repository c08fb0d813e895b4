"""`data=ioi`: indirect object identification pairs made from templates (runner/options/data/ioi.py says what the
slots, orders and corruptions are), then tokenised and checked as any prompt pairs (runner/data/prompts.py).

Pair k takes order k mod len(orders) and template (k // len(orders)) mod len(templates), so the orders alternate and
an ABBA pair and the BABA pair after it share a template; its names are drawn with random.Random((seed, k)): the
same pairs for the same seed, whatever n_pairs is. Its id says what it is: ioi-K-abba-tT.
"""

from __future__ import annotations

import logging
import random
import string
from typing import Any

from torch.utils.data import Dataset

from runner.data.prompts import prompts_source
from runner.errors import RunnerError
from runner.options.data.ioi import IoiConfig, IoiCorruption, IoiOrder
from runner.options.data.prompts import PromptsConfig

log = logging.getLogger(__name__)


def ioi_source(cfg: IoiConfig, tokenizer: Any, seed: int) -> Dataset:
    """The configured IOI pairs, tokenised with the model's tokenizer and checked."""
    if tokenizer is None or not callable(tokenizer):
        raise RunnerError("data=ioi is text for a language model: use model=hf_lm (it brings a tokenizer).")
    names = one_token_names(cfg.names, tokenizer)
    pairs = ioi_pairs(cfg, names, seed)
    return prompts_source(PromptsConfig(pairs=pairs, bos=cfg.bos, batch_size=cfg.batch_size), tokenizer, seed)


def one_token_names(names: list[str], tokenizer: Any) -> list[str]:
    """The names that are one known token with their leading space (as a slot reads them; the unknown token is no
    name); the others are logged and left out. Fewer than 5 left is an error: a pair needs IO, S and three others."""
    unknown = getattr(tokenizer, "unk_token_id", None)

    def one_token(name: str) -> bool:
        ids = tokenizer(" " + name, add_special_tokens=False)["input_ids"]
        return len(ids) == 1 and ids[0] != unknown

    kept = [n for n in names if one_token(n)]
    dropped = [n for n in names if n not in kept]
    if dropped:
        log.info("data=ioi: %d of %d names are one token in this tokenizer; left out: %s", len(kept), len(names),
                 ", ".join(dropped))  # fmt: skip
    if len(kept) < 5:
        raise RunnerError(
            f"data=ioi: only {len(kept)} of data.names are one token in this model's tokenizer ({', '.join(kept)});"
            " give at least 5 names that are (with a leading space, as the templates read them)."
        )
    return kept


def ioi_pairs(cfg: IoiConfig, names: list[str], seed: int) -> list[dict[str, Any]]:
    """cfg.n_pairs pairs as data.pairs takes them (id, clean, corrupted, answer, distractor), from `names`."""
    orders = [IoiOrder(o) for o in cfg.orders]
    pairs = []
    for k in range(cfg.n_pairs):
        order = orders[k % len(orders)]
        t = (k // len(orders)) % len(cfg.templates)
        rng = random.Random(f"{seed}:{k}")
        io, s, *others = rng.sample(names, 5)
        first = (io, s) if order is IoiOrder.ABBA else (s, io)
        clean = {"name1": first[0], "name2": first[1], "S": s}
        if IoiCorruption(cfg.corruption) is IoiCorruption.abc:
            corrupted = dict(zip(("name1", "name2", "S"), others, strict=True))
        else:
            corrupted = {**clean, "S": others[0]}
        template = cfg.templates[t]
        text, spans = _filled(template, clean)
        io_slot, s1_slot = ("name1", "name2") if order is IoiOrder.ABBA else ("name2", "name1")
        roles = {"IO": spans[io_slot], "S1": spans[s1_slot], "S2": spans["S"]}
        pairs.append({
            "id": f"ioi-{k:04d}-{order.value.lower()}-t{t}",
            "clean": text, "corrupted": template.format(**corrupted),
            "answer": f" {io}", "distractor": f" {s}", "roles": roles,
        })  # fmt: skip
    return pairs


def _filled(template: str, values: dict[str, str]) -> tuple[str, dict[str, list[int]]]:
    """`template` filled with `values`, and each slot's [start, end) characters in the text (its first use)."""
    text, spans = "", {}
    for literal, field, _, _ in string.Formatter().parse(template):
        text += literal
        if field is not None:
            spans.setdefault(field, [len(text), len(text) + len(values[field])])
            text += values[field]
    return text, spans
