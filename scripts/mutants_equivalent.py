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


_FP = "gpufn/wire/fingerprint.py"
EQUIVALENT: tuple[Equivalent, ...] = (
    Equivalent(_FP, "def fingerprint(target: Any) -> Fingerprint | None:",
               "def fingerprint(target: Any) -> Fingerprint & None:",
               "an annotation: never evaluated (from __future__ import annotations)"),
    Equivalent(_FP, "@dataclass(slots=True)", "@dataclass(slots=False)",
               "slots only save memory; no attribute is set outside the fields"),
    Equivalent(_FP, "except ImportError:  # pragma: no cover - another cloudpickle layout: "
               "always re-pickle", "except CosmicRayTestingException:  # pragma: no cover - "
               "another cloudpickle layout: always re-pickle",
               "the import succeeds with every cloudpickle gpufn installs; the fallback's "
               "behaviour (None: pickle every time) is tested by setting the helpers to None"),
)
