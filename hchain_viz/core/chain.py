"""The chain model (design.md §2): per-stage times and sizes of a network seen as stages 0..L-1 followed by the loss.

A :class:`Chain` is plain numbers. It is what the profiler produces, what the solver and the simulator read, and what
round-trips through JSON so a profile taken on a GPU machine can be explored anywhere.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import HChainError, InvalidChain
from .fixed import FixedMemory
from .units import finite_nonnegative, format_bytes, format_time

CHAIN_FORMAT = "hchain-chain/1"

# Device–host links, bytes/s each way: the nominal rates of the specifications (measured pinned copies reach about
# 80% of them on PCIe). NVLink-C2C is Grace–Hopper's 900 GB/s total, 450 GB/s each way.
BANDWIDTH_PRESETS: dict[str, float] = {
    "pcie4": 32e9,  # PCIe 4.0 x16
    "pcie5": 64e9,  # PCIe 5.0 x16
    "nvlink-c2c": 450e9,  # NVLink-C2C (Grace–Hopper)
}
BANDWIDTH_LABELS: dict[str, str] = {"pcie4": "PCIe 4.0 x16", "pcie5": "PCIe 5.0 x16", "nvlink-c2c": "NVLink-C2C"}


def bandwidth_of(value: float | str) -> float:
    """Bytes/s from a positive number or a preset name (``"pcie4"``, ``"PCIe 5.0 x16"``, ``"nvlink-c2c"``)."""
    if isinstance(value, str):
        key = value.strip().lower()
        for name, label in BANDWIDTH_LABELS.items():
            if key in (name, label.lower()):
                return BANDWIDTH_PRESETS[name]
        raise InvalidChain(f"unknown bandwidth preset {value!r}; use one of {', '.join(BANDWIDTH_PRESETS)} or a "
                           f"number of bytes/s")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InvalidChain(f"bandwidth must be bytes/s (a positive number) or a preset name, got {value!r}") from None
    if isinstance(value, bool) or not (f > 0) or math.isinf(f):
        raise InvalidChain(f"bandwidth must be a positive, finite number of bytes/s, got {value!r}")
    return f


#: The chain fields that depend on the batch size; the fixed part (parameters, optimizer state) does not.
BATCH_FIELDS = ("fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp")


@dataclass(frozen=True)
class BatchFit:
    """Per-entry linear fits ``value = intercept + slope · batch`` of every batch-dependent chain field.

    - ``batch``: the batch size the chain carrying this fit is at.
    - ``sizes``: the batch sizes profiled for the fit.
    - ``coef``: ``((field, intercepts, slopes), ...)`` for each of :data:`BATCH_FIELDS`, one pair per entry; and
      ``"shared"`` for the bytes of the chain's shared tensors (docs/design.md §8) when it has any.
    """

    batch: int
    sizes: tuple[int, ...]
    coef: tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...]

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "batch", check_batch(self.batch))
        set_(self, "sizes", tuple(check_batch(b) for b in self.sizes))
        coef = tuple((str(f), tuple(float(v) for v in a), tuple(float(v) for v in s)) for f, a, s in self.coef)
        given = sorted(f for f, _, _ in coef if f != "shared")
        if given != sorted(BATCH_FIELDS):
            raise InvalidChain(f"batch_fit.coef must give the fields {', '.join(BATCH_FIELDS)} (and optionally "
                               f"'shared'), got {', '.join(f for f, _, _ in coef)}")
        for f, a, s in coef:
            if len(a) != len(s) or not all(map(math.isfinite, a + s)):
                raise InvalidChain(f"batch_fit.coef[{f!r}] needs finite intercepts and slopes of equal length")
        set_(self, "coef", coef)

    def values(self, batch: int) -> dict[str, list[float]]:
        """Every field at ``batch``, before rounding (times clipped at 0, sizes not yet rounded)."""
        return {f: [max(0.0, ai + si * batch) for ai, si in zip(a, s)] for f, a, s in self.coef}

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "sizes": list(self.sizes),
                "coef": {f: {"intercept": list(a), "slope": list(s)} for f, a, s in self.coef}}

    @classmethod
    def from_dict(cls, d: Any) -> BatchFit:
        try:
            coef = tuple((f, tuple(v["intercept"]), tuple(v["slope"])) for f, v in d["coef"].items())
            return cls(batch=d["batch"], sizes=tuple(d["sizes"]), coef=coef)
        except (KeyError, TypeError, AttributeError):
            raise InvalidChain("chain JSON field 'batch_fit' must be an object with 'batch', 'sizes' and 'coef' "
                               "({field: {'intercept': [...], 'slope': [...]}})") from None


def check_batch(b: Any) -> int:
    """``b`` as an int when it is a positive integer batch size; else raises HChainError."""
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
        raise HChainError(f"a batch size must be a positive integer, got {b!r}")
    return int(b)


@dataclass(frozen=True)
class Chain:
    """A heterogeneous chain of ``L`` stages followed by the loss: what the solver and the simulator read.

    Times are seconds (float), sizes bytes (int); index i is stage i, index L the loss. Each field is described
    where it is declared below and in the table of docs/design.md §2 (the optional ones in §3.4, §7-§10).

    Args:
        fwd_time, bwd_time: per stage, one forward (u_f) and its share of a backward (u_b).
        x: length L+1, bytes of the value entering stage i (ω_x); ``x[L]`` is the network output.
        xbar: per stage, bytes a recording forward leaves (ω_x̄): its output plus what autograd saved, not ``x[i]``.
        fwd_tmp, bwd_tmp, nograd_tmp, delta, names, ...: optional, see the fields.

    Raises:
        InvalidChain: a field of the wrong length, sign or type; the message names it.
    """

    fwd_time: tuple[float, ...]
    bwd_time: tuple[float, ...]
    x: tuple[int, ...]
    xbar: tuple[int, ...]  #: always ``xbar[i] >= x[i+1]``
    #: transient bytes above the resident set during a recording forward (``Fall``) / during B(i)
    fwd_tmp: tuple[int, ...] = None  # type: ignore[assignment]  # default: zeros
    bwd_tmp: tuple[int, ...] = None  # type: ignore[assignment]  # default: zeros
    names: tuple[str, ...] = None  # type: ignore[assignment]  # default: "stage0", "stage1", ...
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    #: bytes/s of the device-host link *each way* for ``Off``/``Pre`` (§9), None: no link. Full duplex: offloads and
    #: prefetches each have their own channel at this rate. Presets: :data:`BANDWIDTH_PRESETS`, :meth:`with_bandwidth`.
    bandwidth: float | None = None
    #: named contiguous stage ranges ``(name, first, last)``, inclusive, in order, non-overlapping (``("h.3", 12, 17)``:
    #: one layer); the per-layer baselines and the grouped figures read them (§8).
    groups: tuple[tuple[str, int, int], ...] = ()
    #: per stage a free-form role; ``"attn_core"`` marks Megatron's core attention, which selective recomputation
    #: recomputes.
    tags: tuple[str, ...] = None  # type: ignore[assignment]  # default: "" for every stage
    #: ``(first, last, bytes)`` with ``0 <= first < last <= L``: one tensor that is part of every ``x[first..last]``
    #: (and the ``xbar`` that contain them), counted once by the simulator (§8).
    shared: tuple[tuple[int, int, int], ...] = ()
    #: length L+1, zero at 0 and L: bytes of x_i no backward needs, freed once ``Fall(i)`` consumed them (§3.4).
    transit: tuple[int, ...] = None  # type: ignore[assignment]  # default: zeros
    #: length L+1, zero at 0 and L: bytes of x_i that B(i) needs and B(i-1) does not, freed after B(i) when x_i is
    #: the output inside x̄_i (§3.4). Disjoint from ``transit``; together at most x[i]'s bytes no shared tensor holds.
    consumed: tuple[int, ...] = None  # type: ignore[assignment]  # default: zeros
    #: length L+1, bytes of δ_i; None: as ``x`` (read :attr:`delta_bytes`). A profile measures it: tensors that need
    #: no gradient (token ids, masks) have none; a broadcast view's gradient is larger than its storage (§3.2).
    delta: tuple[int, ...] | None = None
    #: per stage, bytes of δ_{i+1} that B(i) hands on unchanged in δ_i, at most the smaller of the two (§3.2).
    delta_through: tuple[int, ...] = None  # type: ignore[assignment]  # default: zeros
    #: indices into ``shared`` of tensors crossing cuts ``(first, first + 1)`` that only B(last) needs, freed once it
    #: has run when x_last is the output inside x̄_{last-1} (§8).
    consumed_shared: tuple[int, ...] = ()
    #: transient bytes of a forward without autograd (``Fck``, ``Fn``); None: as ``fwd_tmp``
    #: (read :attr:`nograd_tmp_bytes`).
    nograd_tmp: tuple[int, ...] | None = None
    #: the memory no schedule changes (parameters, gradients, optimizer state, buffers, the step's transient, a
    #: sharding factor, §7); with it ``device_peak(simulate(...))`` predicts the whole step.
    fixed: FixedMemory | None = None
    #: the fields as functions of the batch size (§7.3), for :func:`~hchain_viz.core.batch.at_batch`.
    batch_fit: BatchFit | None = None
    #: disjoint sorted tuples (two or more) of structurally identical stages whose times were set to the median of
    #: the copies, so that noise does not decide which copy is recomputed (§10.1; ``hcv.profile`` finds them).
    tied: tuple[tuple[int, ...], ...] = ()
    #: per ``tied`` set, ``(fwd, bwd)``: half the copies' range over the median (0.2: ±20%); :meth:`timing_note`.
    copy_spread: tuple[tuple[float, float], ...] = ()
    #: seconds each separate backward call costs beyond its stages' shares, charged once per group of stages whose
    #: graphs the executor joins (store-all: one call; §3.3).
    backward_call: float = 0.0

    def __post_init__(self) -> None:
        L = _length_of(self.fwd_time, "fwd_time")
        if L == 0:
            raise InvalidChain("a chain needs at least one stage; got fwd_time of length 0")
        zeros = (0,) * L
        set_ = object.__setattr__  # frozen: normalise once here, never again
        set_(self, "fwd_time", _floats(self.fwd_time, "fwd_time", L))
        set_(self, "bwd_time", _floats(self.bwd_time, "bwd_time", L))
        set_(self, "backward_call", _floats([self.backward_call], "backward_call", 1)[0])
        set_(self, "x", _ints(self.x, "x", L + 1))
        set_(self, "xbar", _ints(self.xbar, "xbar", L))
        set_(self, "fwd_tmp", _ints(zeros if self.fwd_tmp is None else self.fwd_tmp, "fwd_tmp", L))
        set_(self, "bwd_tmp", _ints(zeros if self.bwd_tmp is None else self.bwd_tmp, "bwd_tmp", L))
        if self.names is None:
            names = tuple(f"stage{i}" for i in range(L))
        elif isinstance(self.names, str) or not hasattr(self.names, "__iter__"):
            raise InvalidChain(f"names must be a list of strings, one per stage; got {self.names!r}")
        else:
            names = tuple(str(n) for n in self.names)
        if len(names) != L:
            raise InvalidChain(f"names has {len(names)} entries but the chain has {L} stages; give one name per stage")
        set_(self, "names", names)
        if self.bandwidth is not None:
            set_(self, "bandwidth", bandwidth_of(self.bandwidth))
        bad = [i for i in range(L) if self.xbar[i] < self.x[i + 1]]
        if bad:
            i = bad[0]
            raise InvalidChain(
                f"xbar[{i}] = {self.xbar[i]} is smaller than x[{i + 1}] = {self.x[i + 1]}, but x̄ contains the stage's "
                f"output; xbar[i] must be at least x[i+1] (stage {names[i]!r})"
            )
        set_(self, "groups", _groups(self.groups, L))
        set_(self, "tags", _tags(self.tags, L))
        set_(self, "shared", _shared(self.shared, self.x))
        set_(self, "transit", _part_of_x(self.transit, "transit", (0,) * (L + 1), self.x, self.shared, names))
        set_(self, "consumed", _part_of_x(self.consumed, "consumed", self.transit, self.x, self.shared, names))
        if self.delta is not None:
            set_(self, "delta", _ints(self.delta, "delta", L + 1))
        if self.nograd_tmp is not None:
            set_(self, "nograd_tmp", _ints(self.nograd_tmp, "nograd_tmp", L))
        set_(self, "delta_through", _delta_through(self.delta_through, self.delta_bytes, names))
        set_(self, "consumed_shared", _consumed_shared(self.consumed_shared, self.shared, L))
        if self.fixed is not None:
            if not isinstance(self.fixed, FixedMemory):
                raise InvalidChain(f"fixed must be a FixedMemory (or None), got {type(self.fixed).__name__}")
            if len(self.fixed.stage_grads) != L:
                raise InvalidChain(f"fixed.stage_grads has {len(self.fixed.stage_grads)} entries but the chain has "
                                   f"{L} stages; give one gradient size per stage")
        set_(self, "tied", _tied(self.tied, L))
        set_(self, "copy_spread", _copy_spread(self.copy_spread, len(self.tied)))
        if self.batch_fit is not None:
            if not isinstance(self.batch_fit, BatchFit):
                raise InvalidChain(f"batch_fit must be a BatchFit (or None), got {type(self.batch_fit).__name__}")
            lengths = {f: len(a) for f, a, _ in self.batch_fit.coef}
            want = {"x": L + 1, "shared": len(self.shared)}
            wrong = [f for f, n in lengths.items() if n != want.get(f, L)]
            if wrong:
                raise InvalidChain(f"batch_fit.coef has the wrong number of entries for {wrong} on a {L}-stage chain")

    # ------------------------------------------------------------------ basic facts
    @property
    def length(self) -> int:
        """Number of stages L (the loss is not a stage)."""
        return len(self.fwd_time)

    def __len__(self) -> int:
        return self.length

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields as numpy arrays (float64 times, int64 sizes), for kernels."""
        return {
            "fwd_time": np.asarray(self.fwd_time, dtype=np.float64),
            "bwd_time": np.asarray(self.bwd_time, dtype=np.float64),
            "x": np.asarray(self.x, dtype=np.int64),
            "xbar": np.asarray(self.xbar, dtype=np.int64),
            "fwd_tmp": np.asarray(self.fwd_tmp, dtype=np.int64),
            "bwd_tmp": np.asarray(self.bwd_tmp, dtype=np.int64),
        }

    @property
    def delta_bytes(self) -> tuple[int, ...]:
        """Bytes of each gradient δ_i (L+1 entries): ``delta`` when measured, else ``x``."""
        return self.x if self.delta is None else self.delta

    @property
    def nograd_tmp_bytes(self) -> tuple[int, ...]:
        """Transient bytes of each stage's forward without autograd: ``nograd_tmp`` when measured, else
        ``fwd_tmp``."""
        return self.fwd_tmp if self.nograd_tmp is None else self.nograd_tmp

    @property
    def store_all_time(self) -> float:
        """Makespan with no recomputation: every forward and every backward once, in one backward call."""
        return float(sum(self.fwd_time) + sum(self.bwd_time) + self.backward_call)

    @property
    def time_spread(self) -> float | None:
        """How much the profiled times varied across repeats, as a fraction (0.18: times ±18%), weighted by each
        stage's share of the step time; None when unknown (a chain not from ``hcv.profile``). Read from
        ``meta["time_spread"]`` = ``{"fwd": [...], "bwd": [...]}``, per stage half the range over the median."""
        s = self.meta.get("time_spread") if isinstance(self.meta, dict) else None
        try:
            f, b = np.asarray(s["fwd"], np.float64), np.asarray(s["bwd"], np.float64)
        except (TypeError, KeyError, ValueError):
            return None
        if f.shape != (self.length,) or b.shape != (self.length,) or self.store_all_time <= 0:
            return None
        return float((np.dot(f, self.fwd_time) + np.dot(b, self.bwd_time)) / self.store_all_time)

    def timing_note(self) -> str | None:
        """One line on how far the times can be trusted, for the explorer and the demo; None when nothing is known
        (a chain not from ``hcv.profile``). Says how many identical stages share one cost and how much their copies
        differed, and how much the remaining stages' repeats varied."""
        parts = []
        if self.tied:
            n = sum(len(t) for t in self.tied)
            worst = max(max(f, b) for f, b in self.copy_spread) if self.copy_spread else 0.0
            parts.append(f"{n} identical stages in {len(self.tied)} kind{'s' * (len(self.tied) > 1)} share their "
                         f"median time (copies differed by up to ±{100 * worst:.0f}%)")
        spread = self.untied_spread
        if spread is not None:
            parts.append(f"{'other ' if self.tied else ''}stage times varied ±{100 * spread:.0f}% across "
                         f"{self.meta.get('repeats', '?')} repeats")
        return "; ".join(parts) or None

    @property
    def untied_spread(self) -> float | None:
        """:attr:`time_spread` over the stages outside ``tied`` only (what sharing a median does not steady),
        weighted by their share of those stages' step time; None when unknown or when every stage is tied."""
        s = self.meta.get("time_spread") if isinstance(self.meta, dict) else None
        try:
            f, b = np.asarray(s["fwd"], np.float64), np.asarray(s["bwd"], np.float64)
        except (TypeError, KeyError, ValueError):
            return None
        if f.shape != (self.length,) or b.shape != (self.length,):
            return None
        free = np.ones(self.length, bool)
        for t in self.tied:
            free[list(t)] = False
        fwd, bwd = np.asarray(self.fwd_time)[free], np.asarray(self.bwd_time)[free]
        total = fwd.sum() + bwd.sum()
        if not free.any() or total <= 0:
            return None
        return float((np.dot(f[free], fwd) + np.dot(b[free], bwd)) / total)

    # ------------------------------------------------------------------ whole step (docs/design.md §7)
    @property
    def batch(self) -> int | None:
        """The batch size this chain is at, when it carries a batch-size fit."""
        return None if self.batch_fit is None else self.batch_fit.batch

    def with_world_size(self, world_size: int) -> Chain:
        """This chain with its fixed part sharded over ``world_size`` ranks (FSDP / ZeRO-3 style; docs/design.md §7)."""
        if self.fixed is None:
            raise InvalidChain("this chain does not know its fixed memory; profile it with optimizer=... "
                               "(hcv.profile(model, x, loss_fn, optimizer=opt)) before sharding it")
        return replace(self, fixed=self.fixed.with_world_size(world_size))

    def with_bandwidth(self, bandwidth: float | str | None) -> Chain:
        """The same chain with a device–host link of ``bandwidth`` bytes/s each way, or a preset name from
        :data:`BANDWIDTH_PRESETS` (``"pcie4"``, ``"pcie5"``, ``"nvlink-c2c"``); None removes the link."""
        return dataclasses.replace(self, bandwidth=None if bandwidth is None else bandwidth_of(bandwidth))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = {"format": CHAIN_FORMAT}
        for k in ("names", "fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp"):
            d[k] = list(getattr(self, k))
        if self.backward_call:
            d["backward_call"] = self.backward_call
        if self.bandwidth is not None:
            d["bandwidth"] = self.bandwidth
        if self.groups:
            d["groups"] = [list(g) for g in self.groups]
        if any(self.tags):
            d["tags"] = list(self.tags)
        if self.shared:
            d["shared"] = [list(t) for t in self.shared]
        if any(self.transit):
            d["transit"] = list(self.transit)
        if any(self.consumed):
            d["consumed"] = list(self.consumed)
        if self.delta is not None:
            d["delta"] = list(self.delta)
        if self.nograd_tmp is not None:
            d["nograd_tmp"] = list(self.nograd_tmp)
        if any(self.delta_through):
            d["delta_through"] = list(self.delta_through)
        if self.consumed_shared:
            d["consumed_shared"] = list(self.consumed_shared)
        if self.meta:
            d["meta"] = self.meta
        if self.fixed is not None:
            d["fixed"] = self.fixed.to_dict()
        if self.batch_fit is not None:
            d["batch_fit"] = self.batch_fit.to_dict()
        if self.tied:
            d["tied"] = [list(t) for t in self.tied]
            d["copy_spread"] = [list(c) for c in self.copy_spread]
        return d

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = 1) -> str:
        """JSON text of the chain; also written to ``path`` when given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Chain:
        if not isinstance(d, dict) or d.get("format") != CHAIN_FORMAT:
            raise InvalidChain(f"not a chain: expected a JSON object with \"format\": \"{CHAIN_FORMAT}\"")
        missing = [k for k in ("fwd_time", "bwd_time", "x", "xbar") if k not in d]
        if missing:
            raise InvalidChain(f"chain JSON lacks the field(s) {missing}")
        return cls(
            fwd_time=d["fwd_time"], bwd_time=d["bwd_time"], x=d["x"], xbar=d["xbar"],
            fwd_tmp=d.get("fwd_tmp"), bwd_tmp=d.get("bwd_tmp"), names=d.get("names"), meta=d.get("meta", {}),
            fixed=None if d.get("fixed") is None else FixedMemory.from_dict(d["fixed"]),
            batch_fit=None if d.get("batch_fit") is None else BatchFit.from_dict(d["batch_fit"]),
            bandwidth=d.get("bandwidth"),
            groups=d.get("groups", ()), tags=d.get("tags"), shared=d.get("shared", ()), transit=d.get("transit"),
            consumed=d.get("consumed"), delta=d.get("delta"), nograd_tmp=d.get("nograd_tmp"),
            delta_through=d.get("delta_through"), consumed_shared=d.get("consumed_shared", ()),
            tied=d.get("tied", ()), copy_spread=d.get("copy_spread", ()), backward_call=d.get("backward_call", 0.0),
        )

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> Chain:
        """Read a chain from JSON text or from a file path."""
        return cls.from_dict(read_json(text_or_path, InvalidChain, "chain"))

    # ------------------------------------------------------------------ teaching / test chains
    @classmethod
    def homogeneous(
        cls, length: int, *, fwd_time: float = 1.0, bwd_time: float = 2.0, x: int = 1, xbar: int | None = None,
        fwd_tmp: int = 0, bwd_tmp: int = 0,
    ) -> Chain:
        """``length`` identical stages (the setting of Griewank–Walther's revolve). ``xbar`` defaults to ``2 * x``."""
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise InvalidChain(f"length must be a positive integer, got {length!r}")
        xbar = 2 * x if xbar is None else xbar
        return cls(
            fwd_time=[fwd_time] * length, bwd_time=[bwd_time] * length, x=[x] * (length + 1), xbar=[xbar] * length,
            fwd_tmp=[fwd_tmp] * length, bwd_tmp=[bwd_tmp] * length,
        )

    @classmethod
    def random(
        cls, length: int, *, seed: int | None = 0, scale: int = 2**20, zero_fraction: float = 0.0,
        transients: bool = True,
    ) -> Chain:
        """A heterogeneous random chain: times and sizes vary several-fold (log-uniform over ~10x).

        ``scale`` is the typical activation size in bytes; ``zero_fraction`` makes that share of times and sizes
        exactly zero (edge cases for tests).
        """
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise InvalidChain(f"length must be a positive integer, got {length!r}")
        rng = np.random.default_rng(seed)

        def loguniform(n: int, lo: float, hi: float) -> np.ndarray:
            v = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
            if zero_fraction:
                v[rng.random(n) < zero_fraction] = 0
            return v

        fwd = loguniform(length, 1e-4, 1e-3)
        bwd = fwd * rng.uniform(1.0, 3.0, length)
        x = np.ceil(loguniform(length + 1, scale / 8, scale * 2)).astype(np.int64)
        extra = np.ceil(loguniform(length, scale / 8, scale * 3)).astype(np.int64)
        xbar = x[1:] + extra
        tmp_f = np.ceil(loguniform(length, scale / 16, scale)).astype(np.int64) if transients else np.zeros(length)
        tmp_b = np.ceil(loguniform(length, scale / 16, scale)).astype(np.int64) if transients else np.zeros(length)
        return cls(fwd_time=fwd, bwd_time=bwd, x=x, xbar=xbar, fwd_tmp=tmp_f, bwd_tmp=tmp_b,
                   names=[f"layer{i}" for i in range(length)])

    @classmethod
    def transformer(
        cls, layers: int = 4, *, batch: int = 4, seq: int = 256, hidden: int = 256, heads: int = 4,
        vocab: int = 1024, dtype_bytes: int = 4, flops: float = 1e12, bandwidth: float = 1e11,
    ) -> Chain:
        """A GPT-style decoder at sub-layer granularity (a model of one, not a measurement): the embedding, six
        stages per layer, and the head, with the structure fields set (``groups``, ``tags``, ``shared``).

        Per layer ``h.k`` (B = batch, T = seq, H = hidden, a = B·T·H values, p = B·heads·T² values):

        ==================  ====================================  ======================  =====================
        stage               output (the cut after it)             saved beside it          tag
        ==================  ====================================  ======================  =====================
        ``h.k.ln_qkv``      (residual, qkv): 4a                   the LN output: a
        ``h.k.attn.scores`` (residual, probabilities, v): 2a + p  nothing more             ``attn_core``
        ``h.k.attn.pv``     (residual, context): 2a               nothing more             ``attn_core``
        ``h.k.attn.out``    the new residual: a                   nothing more
        ``h.k.mlp.up``      (residual, activation): 5a            LN output, pre-GELU: 5a
        ``h.k.mlp.down``    the new residual: a                   nothing more
        ==================  ====================================  ======================  =====================

        The residual crosses the first four cuts of the layer and the new residual the last two: ``shared``.
        Times are FLOPs / ``flops`` plus bytes moved / ``bandwidth`` (seconds); a backward costs twice its forward.
        Sizes are bytes (``dtype_bytes`` per value; the token ids are int64).
        """
        for name, v in (("layers", layers), ("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads),
                        ("vocab", vocab), ("dtype_bytes", dtype_bytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise InvalidChain(f"{name} must be a positive integer, got {v!r}")
        if hidden % heads:
            raise InvalidChain(f"hidden ({hidden}) must be a multiple of heads ({heads})")
        B, T, H, V = batch, seq, hidden, vocab
        a = B * T * H * dtype_bytes
        p = B * heads * T * T * dtype_bytes
        fwd, x, xbar, tmp, names, tags, groups, shared = [], [B * T * 8], [], [], [], [], [], []

        def stage(name: str, flop: float, out: int, saved: int = 0, transient: int = 0, tag: str = "") -> None:
            fwd.append(flop / flops + (x[-1] + out + transient) / bandwidth)
            x.append(out)
            xbar.append(out + saved)
            tmp.append(transient)
            names.append(name)
            tags.append(tag)

        stage("embed", B * T * H, a)
        for k in range(layers):
            first = len(names)
            stage(f"h.{k}.ln_qkv", 6 * B * T * H * H, 4 * a, saved=a)
            stage(f"h.{k}.attn.scores", 2 * B * T * T * H, 2 * a + p, transient=p, tag="attn_core")
            stage(f"h.{k}.attn.pv", 2 * B * T * T * H, 2 * a, tag="attn_core")
            stage(f"h.{k}.attn.out", 2 * B * T * H * H, a)
            stage(f"h.{k}.mlp.up", 8 * B * T * H * H, 5 * a, saved=5 * a)
            stage(f"h.{k}.mlp.down", 8 * B * T * H * H, a)
            groups.append((f"h.{k}", first, first + 5))
            shared += [(first, first + 3, a), (first + 4, first + 5, a)]
        stage("head", 2 * B * T * H * V, B * T * V * dtype_bytes, saved=a)
        return cls(fwd_time=fwd, bwd_time=[2 * f for f in fwd], x=x, xbar=xbar, fwd_tmp=tmp, bwd_tmp=tmp,
                   names=names, groups=groups, tags=tags, shared=shared,
                   meta={"model": f"transformer(layers={layers}, batch={B}, seq={T}, hidden={H}, heads={heads})"})

    # ------------------------------------------------------------------ display
    def _rows(self) -> list[tuple[str, ...]]:
        rows = [(str(i), self.names[i], format_time(self.fwd_time[i]), format_time(self.bwd_time[i]),
                 format_bytes(self.x[i]), format_bytes(self.xbar[i]), format_bytes(self.fwd_tmp[i]),
                 format_bytes(self.bwd_tmp[i])) for i in range(self.length)]
        rows.append((str(self.length), "(output)", "", "", format_bytes(self.x[-1]), "", "", ""))
        return rows

    _HEAD = ("#", "stage", "fwd", "bwd", "x (input)", "xbar", "fwd_tmp", "bwd_tmp")

    def __repr__(self) -> str:
        rows = self._rows()
        if len(rows) > 24:
            rows = rows[:10] + [("...",) + ("",) * 7] + rows[-10:]
        widths = [max(len(r[c]) for r in rows + [self._HEAD]) for c in range(len(self._HEAD))]
        line = lambda r: "  ".join(s.rjust(w) if c != 1 else s.ljust(w) for c, (s, w) in enumerate(zip(r, widths)))
        head = (f"Chain: {self.length} stages, store-all {format_time(self.store_all_time)}, "
                f"activations {format_bytes(sum(self.xbar) + self.x[0])}")
        if self.batch_fit is not None:
            head += f", batch {self.batch_fit.batch}"
        if self.fixed is not None:
            head += f", fixed {self.fixed.describe()}"
        return "\n".join([head, line(self._HEAD)] + [line(r) for r in rows])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self._HEAD)
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in self._rows())
        extra = "" if self.batch_fit is None else f", batch {self.batch_fit.batch}"
        extra += "" if self.fixed is None else f", fixed {html.escape(self.fixed.describe())}"
        return (f"<b>Chain</b>: {self.length} stages, store-all {format_time(self.store_all_time)}{extra}"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def write_json(d: dict[str, Any], path: str | os.PathLike | None, indent: int | None) -> str:
    """``d`` as JSON text, also written to ``path`` when given (the ``to_json`` of chains and schedules)."""
    text = json.dumps(d, indent=indent)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def read_json(text_or_path: str | os.PathLike, error: type[Exception], what: str) -> Any:
    """The JSON value of ``text_or_path``: JSON text (it starts with ``{``) or a file path. Raises ``error`` naming
    ``what`` (``"chain"``, ``"schedule"``) when the file cannot be read or the text is not JSON."""
    if isinstance(text_or_path, os.PathLike):
        text_or_path = os.fspath(text_or_path)
    if not isinstance(text_or_path, str):
        raise error(f"{what} JSON must be text or a file path, got {type(text_or_path).__name__} "
                    f"(for a dict use from_dict)")
    text = text_or_path
    if not text.lstrip().startswith("{"):
        try:
            with open(text_or_path) as f:
                text = f.read()
        except OSError as e:
            raise error(f"cannot read {what} file {text_or_path!r}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} JSON is malformed: {e}") from None


def _int_field(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidChain(f"{what} must be an integer, got {v!r}")
    return int(v)


def _groups(groups: Any, L: int) -> tuple[tuple[str, int, int], ...]:
    out: list[tuple[str, int, int]] = []
    for g in groups or ():
        if isinstance(g, str) or len(g) != 3:
            raise InvalidChain(f"each group is (name, first_stage, last_stage); got {g!r}")
        name = str(g[0])
        first, last = _int_field(g[1], "a group's first stage"), _int_field(g[2], "a group's last stage")
        if not 0 <= first <= last < L:
            raise InvalidChain(f"group {name!r} spans stages {first}..{last}, outside 0..{L - 1} or reversed")
        if out and first <= out[-1][2]:
            raise InvalidChain(f"group {name!r} starts at stage {first}, inside or before group {out[-1][0]!r} "
                               f"(..{out[-1][2]}); groups must be in order and must not overlap")
        out.append((name, first, last))
    return tuple(out)


def _tied(tied: Any, L: int) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for t in tied or ():
        try:
            stages = tuple(sorted(int(i) for i in t))
        except (TypeError, ValueError):
            raise InvalidChain(f"tied must be a list of lists of stage indices, got {t!r}") from None
        if len(stages) < 2 or len(set(stages)) != len(stages) or stages[0] < 0 or stages[-1] >= L:
            raise InvalidChain(f"each set in tied needs two or more distinct stages from 0 to {L - 1}, got {t!r}")
        if seen & set(stages):
            raise InvalidChain(f"the sets in tied must not overlap: stage(s) {sorted(seen & set(stages))} appear twice")
        seen.update(stages)
        out.append(stages)
    return tuple(out)


def _copy_spread(spread: Any, n: int) -> tuple[tuple[float, float], ...]:
    try:
        out = tuple((float(f), float(b)) for f, b in spread or ())
    except (TypeError, ValueError):
        raise InvalidChain(f"copy_spread must be a list of [fwd, bwd] pairs, got {spread!r}") from None
    if len(out) != n:
        raise InvalidChain(f"copy_spread has {len(out)} entries but tied has {n} sets; give one [fwd, bwd] per set")
    if not all(math.isfinite(v) and v >= 0 for p in out for v in p):
        raise InvalidChain(f"copy_spread values must be finite and non-negative, got {spread!r}")
    return out


def _tags(tags: Any, L: int) -> tuple[str, ...]:
    if tags is None:
        return ("",) * L
    if isinstance(tags, str) or len(tags) != L:
        raise InvalidChain(f"tags must be a list of {L} strings, one per stage; got {tags!r}")
    return tuple(str(t) for t in tags)


def _shared(shared: Any, x: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    L = len(x) - 1
    out = []
    for t in shared or ():
        if isinstance(t, str) or len(t) != 3:
            raise InvalidChain(f"each shared tensor is (first_boundary, last_boundary, bytes); got {t!r}")
        first, last = _int_field(t[0], "a shared tensor's first boundary"), _int_field(t[1], "its last boundary")
        size = _int_field(t[2], "a shared tensor's bytes")
        if not 0 <= first < last <= L:
            raise InvalidChain(f"shared tensor {t!r}: need 0 <= first < last <= {L} (boundaries x[0..{L}])")
        if size < 0:
            raise InvalidChain(f"shared tensor {t!r} has a negative size")
        small = [i for i in range(first, last + 1) if x[i] < size]
        if small:
            raise InvalidChain(f"shared tensor {t!r} has {size} bytes, more than x[{small[0]}] = {x[small[0]]} "
                               f"holds; it must be part of every x[i] it crosses")
        out.append((first, last, size))
    for i in range(L + 1):  # the shared tensors at one cut are distinct parts of x[i]
        inside = sum(size for first, last, size in out if first <= i <= last)
        if inside > x[i]:
            raise InvalidChain(f"the shared tensors crossing boundary {i} hold {inside} bytes in all, more than "
                               f"x[{i}] = {x[i]}; each must be a distinct part of every x[i] it crosses")
    return tuple(out)


def unshared_bytes(x: Sequence[int], shared: Sequence[tuple[int, int, int]]) -> list[int]:
    """Per boundary i, the bytes of x[i] that no shared tensor holds (what transit and consumed bytes may be part
    of)."""
    return [x[i] - sum(size for first, last, size in shared if first <= i <= last) for i in range(len(x))]


def _part_of_x(part: Any, name: str, beside: tuple[int, ...], x: tuple[int, ...],
               shared: tuple[tuple[int, int, int], ...], names: tuple[str, ...]) -> tuple[int, ...]:
    """Validate ``transit`` or ``consumed``: per boundary, a part of what stage i-1 made of x[i], disjoint from
    ``beside`` (the other of the two)."""
    L = len(x) - 1
    if part is None:
        return (0,) * (L + 1)
    out = _ints(part, name, L + 1)
    if out[0] or out[L]:
        raise InvalidChain(f"{name}[0] and {name}[L] must be 0: the caller holds the input x_0 and the output x_L "
                           f"for the whole step; got {out[0]} and {out[L]}")
    for i, held in enumerate(unshared_bytes(x, shared)):
        if 0 < i < L and out[i] + beside[i] > held:
            also = f" beside transit[{i}] = {beside[i]}" if beside[i] else ""
            raise InvalidChain(f"{name}[{i}] = {out[i]}{also} is more than the {held} bytes of x[{i}] that no shared "
                               f"tensor holds (the output of stage {names[i - 1]!r}); {name} bytes are a part of x[i] "
                               f"that stage {i - 1} made and stage {i} does not hand on")
    return out


def _length_of(v: Any, name: str) -> int:
    try:
        return len(v)
    except TypeError:
        raise InvalidChain(f"{name} must be a sequence of numbers, got {type(v).__name__}") from None


def _check_numbers(vals: Sequence[Any], name: str, expected: int) -> list[float]:
    if _length_of(vals, name) != expected:
        raise InvalidChain(
            f"{name} has {len(vals)} entries but needs {expected} "
            f"({'L+1: one per stage input plus the output' if name == 'x' else 'one per stage'})"
        )
    return [finite_nonnegative(v, f"{name}[{i}]") for i, v in enumerate(vals)]


def _floats(vals: Sequence[Any], name: str, expected: int) -> tuple[float, ...]:
    return tuple(_check_numbers(vals, name, expected))


def _consumed_shared(indices: Any, shared: tuple[tuple[int, int, int], ...], L: int) -> tuple[int, ...]:
    """Validate ``consumed_shared``: distinct indices into ``shared`` of tensors that cross two cuts, inside the
    chain."""
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise InvalidChain(f"consumed_shared must be a list of indices into shared, got {indices!r}")
    given = list(indices)  # once: an iterator would be empty the second time
    out = tuple(sorted({int(n) for n in given}))
    if len(out) != len(given):
        raise InvalidChain(f"consumed_shared lists an index twice: {given!r}")
    for n in out:
        if not 0 <= n < len(shared):
            raise InvalidChain(f"consumed_shared index {n} is not one of shared's {len(shared)} tensors")
        first, last, _ = shared[n]
        if not (0 < first and last == first + 1 and last < L):
            raise InvalidChain(f"consumed_shared lists shared[{n}] = {shared[n]!r}, but only a tensor made by a "
                               f"stage and handed on by the next one, to a stage before the loss (first > 0, "
                               f"last == first + 1 < L) can be consumed by B(last)")
    return out


def _delta_through(through: Any, delta: tuple[int, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    """Validate ``delta_through``: per stage i, a part of both δ_i and δ_{i+1}."""
    L = len(names)
    if through is None:
        return (0,) * L
    out = _ints(through, "delta_through", L)
    for i, v in enumerate(out):
        if v > min(delta[i], delta[i + 1]):
            raise InvalidChain(f"delta_through[{i}] = {v} is more than δ_{i} ({delta[i]} B) or δ_{i + 1} "
                               f"({delta[i + 1]} B), of which it is a part (stage {names[i]!r})")
    return out


def _ints(vals: Sequence[Any], name: str, expected: int) -> tuple[int, ...]:
    # Sizes are whole bytes; fractional input is rounded up so memory is never under-counted.
    return tuple(int(math.ceil(f)) for f in _check_numbers(vals, name, expected))
