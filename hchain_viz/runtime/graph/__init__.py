"""Automatic chain extraction: turn any ``nn.Module`` into a list of named stages with torch.fx.

The optimal schedules need a *chain*: stages ``0..L-1`` where stage i takes exactly one value (a tensor or a tuple
of tensors) and hands exactly one value to stage i+1 (DESIGN §2). Real models are graphs: skip connections, masks
and position ids reach far ahead. This module

1. traces the model into an fx graph: ``torch.fx`` symbolic tracing first (stages stay shape-generic and keep the
   model's leaf modules, so ``train()``/``eval()`` still switch dropout and batch norm), ``torch.export`` when tracing
   fails (Hugging Face models; the stages are then specialised to the sample input's shapes and to the
   train/eval mode the model had when it was extracted);
2. finds the *cut points*: positions in the graph where one activation crosses from the prefix to the rest.
   Three kinds of value never block a cut: constants (parameter or buffer reads, and pure computations on them
   only, e.g. a causal mask built from ``arange``) are recomputed by every stage that uses them; Python numbers
   (sizes read with ``x.size(0)``) are specialised to their value on the sample input when they cross; and
   parameter-free tensors derived from the inputs (an attention mask, the input ids) travel beside the activation
   in a tuple ``(activation, side_1, ...)``;
3. groups the segments between cuts by ``granularity`` and turns each into a :class:`GraphStage` (an
   ``fx.GraphModule`` over the segment) that shares the model's parameters and buffers: no copies, so the model's
   ``state_dict`` keys and optimizer param groups keep working.

The package, one concern per file:

- ``extract.py``: the entry points :func:`extract_stages` and :func:`cached_stages`, the input convention;
- ``tracing.py``: torch.fx / torch.export tracing into one normalised graph (``_Traced``);
- ``values.py``: what each node of that graph is (tensors, a literal, in place, random), learnt from one run;
- ``plan.py``: ``_Plan``, the analysis of one graph: constants, side values, what crosses each cut;
- ``cuts.py``: which cuts to use: whole blocks (module granularity) and the parts of a block (sub-layer);
- ``roles.py``: readable stage names and the roles of a block's parts (``h.3.attn.probs``);
- ``build.py``: :class:`GraphStage` and building one from a range of ops;
- ``verify.py``: the check that the stages in sequence reproduce the model.

Input convention (the same for the model and for stage 0): a tensor ``x`` means ``model(x)``, a tuple or list
means ``model(*x)``, a dict means ``model(**x)`` (Hugging Face: ``{"input_ids": ids}``). Stage 0 takes that one
object; every later stage takes the previous stage's output; the last stage returns what the model returns.

Every extraction is checked before it is returned: the stages run in sequence must reproduce the model's output
on the sample input (RNG and buffers are restored afterwards, so the check leaves no trace).
"""

from __future__ import annotations

from .build import GraphStage
from .extract import _as_call, _without_cache, cached_stages, extract_stages

__all__ = ["extract_stages", "cached_stages", "GraphStage", "_as_call", "_without_cache"]
