"""Position slots of per-position edges (method.edges.per_position): one name for a position across pairs, so that
an edge's score at "S2" in one pair and at "S2" in another are one unit of the run's ranking.

  role   each position is its role where the pair names one (data=ioi: IO, S1, S2; facts: subject; the last token:
         end), else the first token after a role (`S1+1`, as Wang et al. 2022 name it), the rest of the stretch after
         it (`after S1`), or `start` before the first role (BOS included). A role over several tokens is one slot.
  index  counted back from the last token (the target's position): end, end-1, end-2, ...; for pairs of one
         template, where the same count is the same role in every pair.
  auto   role where every pair names a role besides `end`, else index.

A unit's score is the sum of its positions' scores in the pair (an edge's position scores sum to its edge score), 0
where the pair has no position of that slot.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from runner.data.prompts import pair_strings
from runner.errors import RunnerError
from runner.options.method.lm_edges import PositionSlots

log = logging.getLogger(__name__)
START = "start"


def role_slots(roles: Sequence[str | None]) -> list[str]:
    """Each position's slot name from its role (None: no role): the role, `R+1` right after role R, `after R` further
    on, `start` before the first role."""
    out: list[str] = []
    last: str | None = None
    last_at = -1
    for i, role in enumerate(roles):
        if isinstance(role, str):
            out.append(role)
            last, last_at = role, i
        elif last is None:
            out.append(START)
        else:
            out.append(f"{last}+1" if i == last_at + 1 else f"after {last}")
    return out


@dataclass(frozen=True)
class Slots:
    """The run's position slots, in order (`labels`), and each pair's slot per position (`by_pair`, role slots; None
    when counted back from the last token)."""

    how: PositionSlots  # role | index
    labels: list[str]
    by_pair: dict[str, list[int]] | None

    @staticmethod
    def of(how: PositionSlots, pairs: dict[str, list[str | None]], key: str) -> Slots:
        """The slots of the data set's pairs (sample id -> each position's role)."""
        named = bool(pairs) and all(any(isinstance(r, str) and r != "end" for r in roles) for roles in pairs.values())
        if how is PositionSlots.auto:
            how = PositionSlots.role if named else PositionSlots.index
            log.info("%s.positions=auto: %s slots", key, "role" if named else "index (the pairs name no roles)")
        if how is PositionSlots.index:
            longest = max((len(r) for r in pairs.values()), default=1)
            return Slots(how, [_counted(k) for k in range(longest - 1, -1, -1)], None)
        if not named:
            raise RunnerError(
                f"{key}.positions=role: some pairs name no role but the last token's (data=ioi names IO, S1 and S2; a"
                " pair of data=prompts its `roles` or `subject`). Use positions=index (counted back from the last token)."
            )
        names = {sample: role_slots(roles) for sample, roles in pairs.items()}
        first: dict[str, list[int]] = {}
        for slots in names.values():
            for label in dict.fromkeys(slots):
                first.setdefault(label, []).append(slots.index(label))
        labels = sorted(first, key=lambda label: (sum(first[label]) / len(first[label]), label))
        index = {label: i for i, label in enumerate(labels)}
        return Slots(how, labels, {sample: [index[s] for s in slots] for sample, slots in names.items()})

    def __len__(self) -> int:
        return len(self.labels)

    def of_batch(self, sample_ids: Sequence[str], mask: torch.Tensor) -> torch.Tensor:
        """(B, T) long: each position's slot in a left-padded batch, -1 at padding."""
        b, t = mask.shape
        out = torch.full((b, t), -1, dtype=torch.long)
        lengths = mask.sum(1).tolist()
        for row, (sample, length) in enumerate(zip(sample_ids, lengths, strict=True)):
            length = int(length)
            if self.by_pair is None:
                out[row, t - length :] = torch.arange(len(self) - length, len(self))
                continue
            slots = self.by_pair.get(sample)
            if slots is None or len(slots) != length:
                raise RunnerError(f"per-position edges: pair {sample} has no roles for its {length} positions.")
            out[row, t - length :] = torch.tensor(slots)
        return out.to(mask.device)


def _counted(k: int) -> str:
    return "end" if k == 0 else f"end-{k}"


def pair_roles(dataset: Dataset) -> dict[str, list[str | None]]:
    """Each pair's roles by position (runner/data/prompts.py; None where it names none), from a data set of pairs."""
    out: dict[str, list[str | None]] = {}
    for i in range(len(dataset)):  # type: ignore[arg-type]
        x, _, sample = dataset[i]
        roles = pair_strings(dataset, sample)["roles"]
        length = int(x.shape[-1])
        out[sample] = [r if isinstance(r, str) else None for r in roles] if len(roles) == length else [None] * length
    return out
