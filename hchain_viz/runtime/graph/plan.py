"""``_Plan``: the analysis of one traced graph, and the class that joins choosing the cuts (``cuts.py``), naming them
(``roles.py``) and building a stage (``build.py``) as mixins over that analysis.

The analysis: which values are constants (recomputed by every stage), literals (sizes, specialised where they cross),
parameter-carrying *main* values or parameter-free *side* values, what crosses the cut after each op, and which of
those cuts are valid."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .build import _Building
from .cuts import _ENCODER_DECODER_MAINS, _Cuts, _is_encoder_decoder
from .roles import _Naming
from .tracing import _module_from_graph, _Traced
from .values import _impure, _Info, _mutates, _random, _Recorder, _target_name, _written
from .verify import _preserved


class _NoCut(Exception):
    """The traced graph has no point where a single activation crosses."""


class _Plan(_Cuts, _Naming, _Building):
    """The analysis of one traced graph: which values are constants, literals, activations or side values,
    where the cuts are, and how to turn a range of ops into a stage."""

    def __init__(self, traced: _Traced, model: nn.Module, info: _Info):
        self.traced, self.model, self.info = traced, model, info
        # How many values that carry gradients may cross a cut between blocks: one in a chain of blocks; in an
        # encoder-decoder, the encoder output travels beside the decoder's activation (and T5's position bias, made
        # from a parameter by the first layer, beside both).
        self.max_mains = _ENCODER_DECODER_MAINS if _is_encoder_decoder(model) else 1
        graph = traced.graph
        self.x = next(n for n in graph.nodes if n.op == "placeholder")
        self.output = next(n for n in graph.nodes if n.op == "output")
        attrs = traced.attrs

        # Main values carry gradients to parameters; side values (masks, ids) are parameter-free.
        self.param: set[fx.Node] = set()
        for n in graph.nodes:
            if n.op == "get_attr":
                obj = attrs[n.target]
                if isinstance(obj, torch.Tensor) and obj.requires_grad:
                    self.param.add(n)
            elif (n.op == "call_module" and any(True for _ in attrs[n.target].parameters())) or any(
                    m in self.param for m in n.all_input_nodes):
                self.param.add(n)
        # Constants: recomputed by every stage that needs them, so they never cross a cut. In an encoder-decoder,
        # where cuts may carry several values, a value made from a trainable parameter (T5's position bias) is made
        # once and crosses instead: remade by every stage, its parameter's gradient would add the stages' parts in
        # another order than eager (equal to rounding, not bitwise).
        self.const: set[fx.Node] = set()
        for n in graph.nodes:
            if n.op == "get_attr":
                self.const.add(n)
            elif self.max_mains > 1 and n in self.param:
                continue
            elif n.op in ("call_function", "call_method") and all(m in self.const for m in n.all_input_nodes):
                if not (_mutates(n, attrs) or _random(n) or _impure(n)
                        or any(n in _written(u, attrs) for u in n.users)):
                    self.const.add(n)
        # The order of the ops that run once; literals (sizes) are specialised where they cross, so free too.
        self.order = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in self.const]
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.pos[self.x] = -1
        # Numbers read from tensor *values* (x.item()) are data, not shapes: never specialised.
        data: set[fx.Node] = set()
        for n in graph.nodes:
            if _target_name(n) in ("item", "tolist", "_local_scalar_dense") or any(
                    m in data for m in n.all_input_nodes):
                data.add(n)
        self.literal = {n for n in self.order if info.kind.get(n) == "literal" and not _impure(n)
                        and not _mutates(n, attrs) and n not in data}
        # Liveness: a value crosses the cut after position p when pos <= p < last use.
        end = len(self.order)
        self.last: dict[fx.Node, int] = {}
        for n in [self.x, *self.order]:
            if n in self.literal:
                continue
            uses = [end if u is self.output else self.pos[u] for u in n.users if u not in self.const]
            self.last[n] = max(uses, default=self.pos[n])
        self.crossing: list[list[fx.Node]] = []
        live: dict[fx.Node, None] = {}
        by_end: dict[int, list[fx.Node]] = {}
        for n, last in self.last.items():
            by_end.setdefault(last, []).append(n)
        if self.last[self.x] > -1:
            live[self.x] = None
        for p, n in enumerate(self.order):
            if n in self.last and self.last[n] > p:
                live[n] = None
            for gone in by_end.get(p, ()):
                live.pop(gone, None)
            mains = [v for v in live if v in self.param]
            self.crossing.append(mains + [v for v in live if v not in self.param])
        last_write: dict[fx.Node, int] = {}
        for n in self.order:
            for v in _written(n, attrs):
                if isinstance(v, fx.Node) and v not in self.const:
                    last_write[v] = self.pos[n]
        self.written_later: dict[int, set[fx.Node]] = {}
        for v, at in last_write.items():
            for p in range(self.pos.get(v, -1), at):
                self.written_later.setdefault(p, set()).add(v)
        self.valid = [p for p in range(end - 1) if self._cuttable(p)]

    @classmethod
    def make(cls, traced: _Traced, model: nn.Module, sample_input: Any, *, timed: bool = False) -> _Plan:
        """Run the whole graph once on the sample input to learn what each node yields (and, when ``timed``,
        a second time to learn what each op costs) and analyse it."""
        info = _Info()
        gm = _module_from_graph(traced.graph, traced.attrs, model, "Whole")
        nodes = dict(zip(gm.graph.nodes, traced.graph.nodes))
        with _preserved(model):
            _Recorder(gm, info, nodes).run(sample_input)
            first = dict(info.seconds)
            if timed:
                _Recorder(gm, info, nodes).run(sample_input)  # the first run pays one-off costs (kernel selection)
        info.seconds = {n: min(t, first.get(n, t)) for n, t in info.seconds.items()}
        return cls(traced, model, info)

    def _cuttable(self, p: int) -> bool:
        values = self.crossing[p]
        if not values or sum(v in self.param for v in values) > self.max_mains:
            return False
        # No cut where a later stage would write into its input in place (a standalone ReLU(inplace=True)): the
        # op stays with the stage that made the value, so a kept checkpoint is never the one overwritten.
        return all(self.info.kind.get(v) == "tensors" and v not in self.written_later.get(p, ()) for v in values)

    # -- grouping ------------------------------------------------------------------------------------------------

    def segments(self, mode: str | int) -> list[tuple[int, int]]:
        """Inclusive ranges of ``self.order`` positions, one per stage."""
        if not self.valid:
            raise _NoCut(self._no_cut_reason())
        self._roles: list[str] = []
        if mode == "finest":
            cuts = self.valid
        elif isinstance(mode, int):
            cuts = self._balanced(mode)
        else:
            cuts = self._module_cuts()
        bounds = [-1, *cuts, len(self.order) - 1]
        segments = [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]
        if mode == "sublayer":
            segments = self._sublayer(segments)
        return segments

    def _no_cut_reason(self) -> str:
        # Show the narrowest point of the graph: what crosses there.
        counts = [(sum(v in self.param for v in c), p) for p, c in enumerate(self.crossing[:-1]) if c]
        if not counts:
            return "the traced graph has no place where one activation alone crosses (no cut point)"
        _, p = min(counts)
        names = ", ".join(v.name for v in self.crossing[p] if v in self.param)
        return (f"no cut point: everywhere at least two activations cross from one part of the graph to the rest "
                f"(at best: {names})")

    def _balanced(self, n_stages: int) -> list[int]:
        valid = self.valid
        if n_stages - 1 > len(valid):
            import warnings

            warnings.warn(f"granularity={n_stages} asks for more stages than the model's {len(valid) + 1} cut "
                          f"segments; returning the finest chain", stacklevel=4)
            return valid
        if n_stages == 1:
            return []
        prefix = [0.0]
        for n in self.order:
            prefix.append(prefix[-1] + self.info.seconds.get(n, 0.0))
        bounds = [-1, *valid, len(self.order) - 1]  # candidate boundaries; segment (bounds[i], bounds[j]]
        cost = lambda i, j: prefix[bounds[j] + 1] - prefix[bounds[i] + 1]
        last = len(bounds) - 1
        # best[k][j]: least maximal stage cost for k stages covering (bounds[0], bounds[j]]
        best = [[math.inf] * len(bounds) for _ in range(n_stages + 1)]
        prev = [[0] * len(bounds) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, n_stages + 1):
            for j in range(k, last + 1):
                for i in range(k - 1, j):
                    value = max(best[k - 1][i], cost(i, j))
                    if value < best[k][j]:
                        best[k][j], prev[k][j] = value, i
        cuts, j = [], last
        for k in range(n_stages, 0, -1):
            j = prev[k][j]
            cuts.append(bounds[j])
        return sorted(c for c in cuts if c >= 0)
