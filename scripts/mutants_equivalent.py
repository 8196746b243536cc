"""Mutants that cosmic-ray makes and no test can tell from the original, each with why
(scripts/mutants.py leaves them out of a module's score). A mutant is named by its module
and its one changed line, before and after (stripped), so a line that moves stays named."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Equivalent:
    module: str
    before: str
    after: str
    why: str


EQUIVALENT: tuple[Equivalent, ...] = (
)
