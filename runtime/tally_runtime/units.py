"""PURE, shared by the runtime and the operator: a budget's unit, as weights per kind of token. Both sides count
a tenant's spend with the same weights (the runtime its counter and reservations, the operator the ledger), so
a lease is in the unit the pod admits in. Imports only the standard library (the operator imports it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_WEIGHT = 1_000_000  # credits per token


@dataclass(frozen=True, slots=True)
class Weights:
    """What a tenant's counter counts per token: prompt tokens not served from the cache, cached prompt tokens,
    completion tokens. Tokens are 1, 1, 1 (or a part of them: `completion`, `prompt`); credits any whole
    numbers up to MAX_WEIGHT."""

    prompt: int = 1
    cached: int = 1
    completion: int = 1

    def of(self, prompt: float, cached: float, completion: float) -> float:
        return self.prompt * (prompt - cached) + self.cached * cached + self.completion * completion

    def as_message(self) -> dict[str, int]:
        return {"prompt": self.prompt, "cachedPrompt": self.cached, "completion": self.completion}


COUNTS = {"total": Weights(1, 1, 1), "completion": Weights(0, 0, 1), "prompt": Weights(1, 1, 0)}
CREDITS = "credits"


def weights_of(count: object, raw: object) -> Weights:
    """A unit as a lease message or a spec names it: a count by name, or `credits` with whole-number weights.
    ValueError for anything else."""
    if count == CREDITS:
        if not isinstance(raw, Mapping):
            raise ValueError("credits need weights: prompt, cachedPrompt and completion")
        values = [raw.get(k) for k in ("prompt", "cachedPrompt", "completion")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_WEIGHT for v in values):
            raise ValueError(f"weights must be whole numbers from 0 to {MAX_WEIGHT}")
        return Weights(*values)  # type: ignore[arg-type]
    if not isinstance(count, str) or count not in COUNTS:
        raise ValueError(f"count must be {CREDITS} or one of {', '.join(COUNTS)}")
    return COUNTS[count]


def credits_label(weights: Weights) -> str:
    """A unit in credits as one string (`credits:2,1,8`: prompt, cached prompt, completion), as the status keeps
    the unit in force: two services of one budget may weigh differently."""
    return f"{CREDITS}:{weights.prompt},{weights.cached},{weights.completion}"


def label_weights(label: str) -> Weights:
    """The weights a unit label stands for (a count's name, or a credits label); ValueError for anything else."""
    if label.startswith(CREDITS + ":"):
        parts = label[len(CREDITS) + 1:].split(",")
        if len(parts) != 3 or not all(p.isdigit() and len(p) <= 7 for p in parts):
            raise ValueError(f"not a unit: {label[:64]!r}")
        return weights_of(CREDITS, dict(zip(("prompt", "cachedPrompt", "completion"), map(int, parts), strict=True)))
    return weights_of(label, None)


def message_unit(label: str) -> dict[str, object]:
    """How a lease message names the unit: `count`, and with credits its `weights`."""
    weights = label_weights(label)
    if label.startswith(CREDITS + ":"):
        return {"count": CREDITS, "weights": weights.as_message()}
    return {"count": label}
