"""Schedules: the op lists every strategy produces (docs/design.md §3, §6).

A :class:`Schedule` is a sequence of :class:`Op` — ``Fck``, ``Fn``, ``Fall``, ``Loss``, ``B`` with a stage index —
plus free-form metadata (strategy name, budget, predicted makespan). One simulator scores every schedule, one
executor runs it, one set of figures draws it.

Two more kinds run on the transfer channel instead of the compute stream (design.md §9): ``Off(i)`` starts copying a
held value of stage i (x̄_{i+1} left by ``Fall(i)``, else the checkpoint x_i kept by ``Fck(i)``) to host memory, and
``Pre(i)`` starts copying it back. A schedule without them is a remat-only schedule, exactly as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..errors import InvalidSchedule
from .chain import read_json, write_json

SCHEDULE_FORMAT = "hchain-schedule/1"
OP_KINDS = ("Fck", "Fn", "Fall", "Loss", "B", "Off", "Pre")
FORWARD_KINDS = ("Fck", "Fn", "Fall")
TRANSFER_KINDS = ("Off", "Pre")


class Op(NamedTuple):
    """One operation: ``kind`` in ``Fck, Fn, Fall, Loss, B, Off, Pre`` and the ``stage`` it acts on (``Loss`` is
    stage L)."""

    kind: str
    stage: int

    def __str__(self) -> str:
        return self.kind if self.kind == "Loss" else f"{self.kind}{self.stage}"

    @property
    def is_forward(self) -> bool:
        return self.kind in FORWARD_KINDS

    @property
    def is_transfer(self) -> bool:
        """An ``Off`` or ``Pre``: runs on the transfer channel, not on the compute stream."""
        return self.kind in TRANSFER_KINDS


@dataclass(frozen=True)
class Schedule:
    """An ordered tuple of ops and its metadata. ``str(s)`` reads like ``Fck0 Fn1 Fall2 Loss B2 ...``."""

    ops: tuple[Op, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if all(type(op) is Op and op.kind in OP_KINDS and type(op.stage) is int and op.stage >= 0 for op in self.ops):
            object.__setattr__(self, "ops", tuple(self.ops))  # already checked Ops (solvers build these)
            return
        ops = []
        for k, op in enumerate(self.ops):
            try:
                kind, stage = op
            except (TypeError, ValueError):
                raise InvalidSchedule(f"op #{k} is {op!r}; each op must be a (kind, stage) pair", k) from None
            if kind not in OP_KINDS:
                raise InvalidSchedule(f"op #{k} has kind {kind!r}; the kinds are {', '.join(OP_KINDS)}", k)
            if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
                try:
                    if isinstance(stage, bool) or int(stage) != stage or stage < 0:
                        raise ValueError
                    stage = int(stage)
                except (TypeError, ValueError, OverflowError):
                    raise InvalidSchedule(
                        f"op #{k} ({kind}) has stage {stage!r}; stages are integers >= 0", k) from None
            ops.append(Op(kind, stage))
        object.__setattr__(self, "ops", tuple(ops))

    @classmethod
    def parse(cls, text: str, **meta: Any) -> Schedule:
        """Read the ``__str__`` form back: ``"Fck0 Fn1 Fall2 Off2 Loss Pre2 B2"``; ``Loss`` may carry its stage
        (``Loss3``)."""
        ops = []
        for tok in text.split():
            kind = next((k for k in ("Fall", "Fck", "Fn", "Loss", "B", "Off", "Pre") if tok.startswith(k)), None)
            rest = tok[len(kind):] if kind else ""
            if kind is None or (rest and not (rest.isascii() and rest.isdigit())) or (not rest and kind != "Loss"):
                raise InvalidSchedule(f"cannot read op {tok!r}; write ops like Fck0, Fn1, Fall2, Loss, B2, Off2, Pre2")
            ops.append([kind, int(rest) if rest else None])
        forwards = [s for k, s in ops if k in FORWARD_KINDS]
        loss_at = max(forwards) + 1 if forwards else 0
        return cls(tuple(Op(k, loss_at if s is None else s) for k, s in ops), dict(meta))

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        return iter(self.ops)

    def __str__(self) -> str:
        return " ".join(str(op) for op in self.ops)

    def __repr__(self) -> str:
        name = self.meta.get("strategy", "schedule")
        text = str(self)
        if len(text) > 200:
            text = text[:200] + " ..."
        return f"Schedule({name}, {len(self.ops)} ops: {text})"

    @property
    def n_recomputed(self) -> int:
        """Forward ops beyond the first of each stage: the recomputations this schedule pays for."""
        seen: set[int] = set()
        n = 0
        for op in self.ops:
            if op.is_forward:
                n += op.stage in seen
                seen.add(op.stage)
        return n

    @property
    def single_level(self) -> bool:
        """No stage is forwarded more than twice: each is recomputed at most once, so every checkpoint region holds
        plain stages only (what ``solve(chain, single_level=True)`` returns, and what torch.compile runs as
        scheduled, ``core/regions.py``)."""
        count: dict[int, int] = {}
        for op in self.ops:
            if op.is_forward:
                count[op.stage] = count.get(op.stage, 0) + 1
        return max(count.values(), default=0) <= 2

    @property
    def n_transfers(self) -> int:
        """Number of ``Off`` and ``Pre`` ops (0 for a remat-only schedule)."""
        return sum(op.is_transfer for op in self.ops)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {"format": SCHEDULE_FORMAT, "ops": [[op.kind, op.stage] for op in self.ops], **self.meta}

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = None) -> str:
        """``{"format": "hchain-schedule/1", "ops": [["Fck", 0], ...], ...metadata}``; also written to ``path``."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        if not isinstance(d, dict) or d.get("format") != SCHEDULE_FORMAT or "ops" not in d:
            raise InvalidSchedule(f"not a schedule: expected a JSON object with \"format\": \"{SCHEDULE_FORMAT}\" "
                                  "and \"ops\"")
        if not isinstance(d["ops"], list):
            raise InvalidSchedule(f"schedule \"ops\" must be a list of [kind, stage] pairs, got {d['ops']!r}")
        meta = {k: v for k, v in d.items() if k not in ("format", "ops")}
        return cls(tuple(d["ops"]), meta)  # each op's shape is checked in __post_init__

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> Schedule:
        """Read a schedule from JSON text or a file path."""
        return cls.from_dict(read_json(text_or_path, InvalidSchedule, "schedule"))


def make_schedule(ops: Iterable[tuple[str, int]], **meta: Any) -> Schedule:
    """Build a Schedule from ``(kind, stage)`` pairs (checked, and made Ops, by ``Schedule`` itself)."""
    return Schedule(tuple(ops), meta)
