"""Which pairs find the circuit (discovery) and which test it (held out): a deterministic split of the run's pairs.

By pair: the round(n x fraction) pairs whose seeded hash of the id is smallest are held out. By template (data=ioi,
whose ids end in -t<k>): whole templates are held out, round(templates x fraction) of them by the same hash, so no
template is in both parts. The split depends on the ids, the fraction and the seed only, not on the order of the pairs
or the batch size; adding pairs to the data can move a pair to the other part (the count held out changes).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence

from runner.errors import RunnerError
from runner.options.method.lm_edges import HeldOutBy

log = logging.getLogger(__name__)

DISCOVERY, HELD_OUT = "discovery", "held_out"
AUTO_FRACTION, AUTO_MIN_PAIRS = 0.5, 8  # held_out=null: half the pairs when there are at least 8
_TEMPLATE = re.compile(r"-t(\d+)$")


def _hash(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "big")


def split_pairs(ids: Sequence[str], fraction: float | None, by: HeldOutBy, seed: int) -> dict[str, str]:
    """Each pair id's part, DISCOVERY or HELD_OUT (`fraction` None: AUTO_FRACTION from AUTO_MIN_PAIRS pairs on, else
    none); refused: a split that leaves a part empty, a template split of ids without templates."""
    n = len(ids)
    auto = fraction is None
    if auto:
        fraction = AUTO_FRACTION if n >= AUTO_MIN_PAIRS else 0.0
    assert fraction is not None
    if fraction == 0:
        why = f"fewer than {AUTO_MIN_PAIRS} pairs" if auto else "method.edges.held_out=0"
        log.info("lm_edges: all %d pairs find the circuit and are scored with it; none held out (%s)", n, why)
        return dict.fromkeys(ids, DISCOVERY)
    if by is HeldOutBy.template:
        keys = [_TEMPLATE.search(i) for i in ids]
        if any(k is None for k in keys):
            bad = next(i for i, k in zip(ids, keys, strict=True) if k is None)
            raise RunnerError(
                f"method.edges.held_out_by=template reads each pair's template from its id's -t<k> ending (data=ioi);"
                f" pair '{bad}' has none. Use method.edges.held_out_by=pair."
            )
        units = [k.group(1) for k in keys if k is not None]
    else:
        units = list(ids)
    distinct = sorted(set(units), key=lambda u: (_hash(seed, u), u))
    count = round(len(distinct) * fraction)
    if not 0 < count < len(distinct):
        what = "templates" if by is HeldOutBy.template else "pairs"
        raise RunnerError(
            f"method.edges.held_out={fraction} of {len(distinct)} {what} holds out {count}: both parts need at least one."
            " Give more pairs, another fraction, or method.edges.held_out=0 (no held-out part)."
        )
    held = set(distinct[:count])
    parts = {i: HELD_OUT if u in held else DISCOVERY for i, u in zip(ids, units, strict=True)}
    found = sum(p == DISCOVERY for p in parts.values())
    log.info(
        "lm_edges: %d pairs find the circuit (discovery), %d held out to test it (method.edges.held_out=%s%s, by %s,"
        " seed %d)", found, n - found, fraction, " by default" if auto else "", by.value, seed,
    )  # fmt: skip
    return parts
