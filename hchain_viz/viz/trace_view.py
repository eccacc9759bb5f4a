"""A Trace read once into numpy arrays, the form every figure draws from.

The simulator (``core/simulate.py``) is the only memory model; this module never decides what is resident. It copies
what each :class:`~hchain_viz.core.simulate.Event` reports (times, memory before / peak / after) and the trace's item
lifetimes (which op created and freed each resident item) into arrays, and sums the resident bytes by kind after
every op for the stacked memory figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.simulate import Trace

# Resident item kinds folded into the three memory layers of the memory figure.
LAYERS = ("x", "saved", "delta")
# Each item kind's index into LAYERS (transit, consumed: parts of an x_i; shared: a tensor in several x, §8).
LAYER_OF = {"x": 0, "transit": 0, "consumed": 0, "shared": 0, "xbar": 1, "out": 1, "delta": 2}
# Op categories of the timeline, in trace order.
CATEGORIES = ("forward", "recompute", "backward", "loss", "offload", "prefetch")


@dataclass(frozen=True)
class TraceView:
    """Per-op and per-item arrays of one Trace. Times in seconds, memory in bytes.

    ``n`` ops; op arrays have length ``n``. ``layers[j, k]`` is the resident bytes of layer ``LAYERS[j]`` after
    ``k`` ops (column 0: before the first op). Items (one row per lifetime of a resident item) have ``kind``,
    ``stage``, ``size``, times ``t0``/``t1`` (start of the op that created it / end of the op that freed it, or the
    makespan) and op indices ``i0``/``i1`` (creating op, -1 for x_0; freeing op, ``n`` when never freed).
    """

    trace: Trace
    start: np.ndarray
    end: np.ndarray
    stage: np.ndarray
    category: np.ndarray  # index into CATEGORIES
    labels: np.ndarray  # object array: "Fall3 · layer3"
    mem_before: np.ndarray
    mem_peak: np.ndarray
    mem_after: np.ndarray
    layers: np.ndarray
    item_kind: np.ndarray  # object array of "x", "xbar", "out", "delta", "shared"
    item_stage: np.ndarray
    item_size: np.ndarray
    item_t0: np.ndarray
    item_t1: np.ndarray
    item_i0: np.ndarray
    item_i1: np.ndarray

    @property
    def n(self) -> int:
        return len(self.start)

    @property
    def makespan(self) -> float:
        return self.trace.makespan

    @property
    def peak(self) -> int:
        return self.trace.peak_memory

    def time_at(self, step: int | None) -> float:
        """The time after ``step`` ops (``None``: the whole step)."""
        if step is None or step >= self.n:
            return self.makespan
        return float(self.end[:step].max()) if step > 0 else 0.0  # a copy may end after later compute ops

    @classmethod
    def of(cls, trace: Trace) -> TraceView:
        """Read ``trace`` into arrays: one pass over its events and one over its item lifetimes."""
        events = trace.events
        n = len(events)
        L = trace.chain.length
        names = trace.chain.names
        start = np.fromiter((e.start for e in events), float, n)
        end = np.fromiter((e.end for e in events), float, n)
        stage = np.fromiter((e.op.stage for e in events), np.int64, n)
        code = {"Loss": 3, "B": 2, "Off": 4, "Pre": 5}
        category = np.fromiter((code.get(e.op.kind, 1 if e.recompute else 0) for e in events), np.int64, n)
        labels = np.array([f"{e.op} · {names[e.op.stage] if e.op.stage < L else 'loss'}" for e in events]
                          + [""], dtype=object)[:n]  # the extra "" keeps numpy from building a 2-D char array
        before = np.fromiter((e.mem_before for e in events), np.int64, n)
        peak = np.fromiter((e.mem_peak for e in events), np.int64, n)
        after = np.fromiter((e.mem_after for e in events), np.int64, n)

        lts = trace.lifetimes
        kind = np.array([lt.kind for lt in lts] + [None], dtype=object)[:-1]
        i0 = np.fromiter((lt.created for lt in lts), np.int64, len(lts))  # -1: x_0, resident before the first op
        i1 = np.fromiter((n if lt.freed is None else lt.freed for lt in lts), np.int64, len(lts))
        size = np.fromiter((lt.size for lt in lts), np.int64, len(lts))
        # Column c of `layers` is the state after c ops; an item is resident in columns created+1 .. freed.
        layer = np.fromiter((LAYER_OF[k] for k in kind), np.int64, len(lts))
        diff = np.zeros((len(LAYERS), n + 2), np.int64)
        np.add.at(diff, (layer, i0 + 1), size)
        np.add.at(diff, (layer, i1 + 1), -size)
        layers = np.cumsum(diff[:, : n + 1], axis=1)
        t0 = np.where(i0 >= 0, start[np.maximum(i0, 0)] if n else 0.0, 0.0)
        t1 = np.where(i1 < n, end[np.minimum(i1, n - 1)] if n else 0.0, trace.makespan)
        return cls(
            trace=trace, start=start, end=end, stage=stage, category=category, labels=labels,
            mem_before=before, mem_peak=peak, mem_after=after, layers=layers,
            item_kind=kind, item_stage=np.fromiter((lt.stage for lt in lts), np.int64, len(lts)),
            item_size=size, item_t0=t0, item_t1=t1, item_i0=i0, item_i1=i1,
        )
