"""Automatic chain extraction: turn any ``nn.Module`` into a list of named stages with torch.fx (docs/design.md §8).

Real models are graphs (skip connections, masks and position ids reach far ahead); a chain needs stages that each
take exactly one value from the stage before (docs/design.md §2). :func:`extract_stages` traces the model (``torch.fx``
first: stages stay shape-generic and keep the model's leaf modules, so ``train()``/``eval()`` still switch dropout
and batch norm; ``torch.export`` when that fails, specialised to the sample's shapes and the mode at extraction),
finds the cut points where one activation crosses, groups the segments by ``granularity`` and builds a
:class:`GraphStage` per group, sharing the model's parameters and buffers. Every extraction is checked: the stages
in sequence must reproduce the model's output on the sample (RNG and buffers restored after). NOTE [cuts] below.

One concern per file: ``extract.py`` (entry points :func:`extract_stages`, :func:`cached_stages`, the input
convention: a tensor ``x`` is ``model(x)``, a tuple ``model(*x)``, a dict ``model(**x)``), ``tracing.py`` (fx /
export into one normalised graph), ``values.py`` (what each node is, learnt from one run), ``plan.py`` (constants,
side values, what crosses each cut), ``cuts.py`` (which cuts: whole blocks or their parts), ``roles.py`` (stage
names and roles, ``h.3.attn.probs``), ``build.py`` (:class:`GraphStage`), ``verify.py`` (the reproduction check).
"""

# NOTE [cuts]. Three kinds of value never block a cut: constants (parameter or buffer reads and pure computations on
# them only, e.g. a causal mask built from arange) are recomputed by every stage that uses them; Python numbers
# (sizes read with x.size(0)) are specialised to their value on the sample input when they cross; parameter-free
# tensors derived from the inputs (an attention mask, the input ids) travel beside the activation in a tuple
# (activation, side_1, ...). Stage 0 takes the model's input object; every later stage takes the previous stage's
# output; the last stage returns what the model returns.

from __future__ import annotations

from .build import GraphStage
from .extract import _as_call, _without_cache, cached_stages, extract_stages

__all__ = ["extract_stages", "cached_stages", "GraphStage", "_as_call", "_without_cache"]
