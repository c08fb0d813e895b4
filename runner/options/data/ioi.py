"""Indirect object identification pairs (Wang et al. 2022), generated from templates: "When Mary and John went to
the store, John gave a drink to" -> " Mary" (the indirect object, IO) rather than " John" (the subject, S).

A template names three slots: {name1} and {name2}, the two names of the first clause, and {S}, the subject's second
mention. Order ABBA puts IO in name1 and S in name2 ("When Mary and John ..., John gave ..."); BABA the reverse
("When John and Mary ..., John gave ..."). The corrupted prompt of the `abc` corruption is the template filled with
three other names, all different from IO and S ("When Alice and Tom ..., Kate gave ..."): no name is repeated, so
the prompt says nothing about which name to give; `s2` puts a third name at {S} only (IO and S kept in the first
clause). Names are written without their leading space (each slot follows one); the ones that are not a single
token in the model's tokenizer are left out when the pairs are made (runner/data/ioi.py, the count logged), so
that every pair's prompts line up position by position and the answer and distractor are one token each."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from enum import Enum

from runner.errors import RunnerError
from runner.options.data.prompts import TextDataConfig
from runner.options.registry import DATA

SLOTS = ("name1", "name2", "S")

# Wang et al.'s templates, each with its place and object filled in; every slot follows a space.
TEMPLATES = [
    "When {name1} and {name2} went to the store, {S} gave a drink to",
    "Then, {name1} and {name2} went to the park. {S} gave a ball to",
    "Then, {name1} and {name2} were working at the office. {S} decided to give a book to",
    "Then, {name1} and {name2} had a long argument, and afterwards {S} said to",
    "After {name1} and {name2} went to the restaurant, {S} gave a ring to",
    "When {name1} and {name2} got a snack at the school, {S} decided to give it to",
    "While {name1} and {name2} were commuting to the hospital, {S} gave a letter to",
    "Friends {name1} and {name2} found a bone at the garden. {S} gave it to",
]

NAMES = [
    "Mary", "John", "Alice", "Bob", "Sarah", "Tom", "Kate", "James", "Lisa", "David", "Emily", "Michael", "Anna",
    "Paul", "Rachel", "Mark", "Daniel", "Peter", "George", "Jack", "Henry", "Robert", "Thomas", "Frank", "Simon",
    "Laura", "Jessica", "Susan", "Karen", "Linda", "Steven", "Kevin", "Brian", "Jason", "Eric", "Adam", "Ryan",
    "Jacob", "Emma", "Olivia", "Sophie", "Grace", "Lucy", "Amy", "Helen", "Richard", "Charles", "Joseph", "Andrew",
]  # fmt: skip


class IoiOrder(str, Enum):
    ABBA = "ABBA"  # IO first: "When Mary and John ..., John gave ... to"
    BABA = "BABA"  # S first: "When John and Mary ..., John gave ... to"


class IoiCorruption(str, Enum):
    abc = "abc"  # three other names in all three slots
    s2 = "s2"  # another name at {S} only


@DATA.option("runner.data.ioi:ioi_source")
@dataclass
class IoiConfig(TextDataConfig):
    name: str = "ioi"
    n_pairs: int = 64  # pairs made; the orders alternate, the templates take turns, names drawn with the run's seed
    orders: list[IoiOrder] = field(default_factory=lambda: [IoiOrder.ABBA, IoiOrder.BABA])
    templates: list[str] = field(default_factory=lambda: list(TEMPLATES))  # each with {name1}, {name2} and {S}
    names: list[str] = field(default_factory=lambda: list(NAMES))  # at least 5 (IO, S and the 3 of abc)
    corruption: IoiCorruption = IoiCorruption.abc

    def check(self) -> list[str]:
        bad = super().check()
        if self.n_pairs < 1:
            bad.append(f"data.n_pairs={self.n_pairs}")
        if not self.orders or len(set(self.orders)) != len(self.orders):
            raise RunnerError("data.orders: each of ABBA, BABA at most once, at least one.")
        if not self.templates:
            raise RunnerError("data.templates: at least one template with {name1}, {name2} and {S}.")
        for template in self.templates:
            slots = sorted({name for _, name, _, _ in string.Formatter().parse(template) if name is not None})
            if slots != sorted(SLOTS):
                raise RunnerError(
                    f"data.templates: {template!r} has the slots {slots}; an IOI template has exactly {{name1}},"
                    " {name2} (the first clause's names) and {S} (the subject's second mention)."
                )
        if len(set(self.names)) < 5 or len(set(self.names)) != len(self.names):
            raise RunnerError(
                f"data.names: {len(self.names)} names ({len(set(self.names))} distinct); give at least 5 distinct"
                " names (the indirect object, the subject and the abc corruption's three others)."
            )
        return bad
