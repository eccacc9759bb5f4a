"""Which cuts a chain uses: ``_Cuts``, a mixin of ``_Plan`` (plan.py) that picks the cuts of each granularity from
the plan's analysis (``order``, ``crossing``, ``param``, ``const``, ``info``).

Module granularity: the cuts in front of each block (a transformer layer, a residual
block), found from the module each op belongs to. Sub-layer granularity: each block cut again between its heavy ops
(projections, convolutions, attention products, softmax), where a few tensors cross: the residual stream or a
residual block's input beside the current value, or a dense block's feature maps so far (values only concatenations
still read, counted as one however many); a CNN's stem (before the first block, holding a convolution) is cut
between its layers."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from .roles import _roles, _told_apart, _topk
from .values import _target_name

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Sub-layer cuts: at most this many parameter-dependent tensors cross (residual, q, k, v after the projections).
_SUBLAYER_MAX_MAINS = 4
# Between the blocks of an encoder-decoder: the decoder's activation, the encoder output, T5's position bias.
_ENCODER_DECODER_MAINS = 3
# Ops that only reshape or retype a value: a projection "reads" the value behind them.
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "contiguous", "transpose", "permute", "t", "expand", "to",
          "type", "float", "unsqueeze", "squeeze", "_to_copy", "clone", "alias"}
# Concatenations: a value whose every later use is one of these is a feature map kept for a dense block's later
# layers (DenseNet), which all cross a cut together as the list of features so far.
_CONCATS = {"cat", "concat", "concatenate"}
_PRODUCTS = {"linear", "addmm", "matmul", "bmm", "mm", "conv1d", "conv2d", "conv3d", "convolution", "einsum",
             "baddbmm"}


class _Cuts:
    """Cut choice at module and sub-layer granularity (a mixin of ``_Plan``)."""

    # -- sub-layer cuts --------------------------------------------------------------------------------------------

    def _multi_cuttable(self, p: int) -> bool:
        """A cut inside a block: a few tensors cross (the residual stream or a residual block's input, the current
        value, what attention still needs such as v), none written in place later. The feature maps of a dense
        block (values only concatenations still read) count as one, however many: the list of features so far,
        each map a tensor that crosses every later cut of the block and is counted once (docs/design.md §8)."""
        values = self.crossing[p]
        mains = [v for v in values if v in self.param]
        features = [v for v in mains if self._feature(v, p)]
        n_mains = len(mains) - len(features) + (1 if features else 0)
        return (0 < n_mains <= _SUBLAYER_MAX_MAINS + self.max_mains - 1 and all(
            self.info.kind.get(v) == "tensors" and v not in self.written_later.get(p, ()) for v in values))

    def _feature(self, v: fx.Node, p: int) -> bool:
        """Is ``v`` a kept feature map at the cut after ``p``: a single tensor that only concatenations read from
        there on (a dense block's ``torch.cat(features, 1)``), never the model's output?"""
        later = [u for u in v.users if u is self.output or (u not in self.const and self.pos[u] > p)]
        return bool(later) and all(u is not self.output and _target_name(u).split(".")[0] in _CONCATS for u in later)

    def _crossing_bytes(self, p: int) -> int:
        seen: dict[int, int] = {}
        for v in self.crossing[p]:
            seen.update(self.info.storages.get(v, {}))
        return sum(seen.values())

    def _heavy(self, n: fx.Node) -> str:
        """The kind of op that a sub-layer cut goes around: "weight" (a projection by a parameter), "qk"/"pv"
        (a product of two activations), "softmax", "fused" (a fused attention op); "" for the rest."""
        name = _target_name(n).lower()
        if "scaled_dot_product" in name or "flash_attention" in name or "flex_attention" in name:
            return "fused"
        if "softmax" in name:
            return "softmax"
        if n.op == "call_module":  # a Linear or a convolution (a weight matrix), not a norm's scale vector
            weight = getattr(self.traced.attrs[n.target], "weight", None)
            return "weight" if isinstance(weight, torch.Tensor) and weight.dim() >= 2 else ""
        if name.split(".")[0] in _PRODUCTS:
            inputs = n.all_input_nodes
            if any(m in self.const and m in self.param for m in inputs) or any(
                    m.op == "get_attr" and m in self.param for m in inputs):
                return "weight"
            if sum(m not in self.const for m in inputs) >= 2:
                return "matmul"
        return ""

    def _root(self, n: fx.Node) -> fx.Node:
        """``n``'s first activation input followed back through views (the value a projection reads)."""
        m = next((a for a in n.all_input_nodes if a not in self.const), n)
        while _target_name(m).split(".")[0] in _VIEWS and m.all_input_nodes:
            nxt = next((a for a in m.all_input_nodes if a not in self.const), None)
            if nxt is None:
                break
            m = nxt
        return m

    def _sublayer(self, segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Cut every block segment between its heavy ops, at the crossing of fewest bytes (the latest on a tie).
        Identical blocks (the same ops in the same order) are cut at the same places: a cut is taken only where it
        is valid in each of them, by their total crossing bytes."""
        out: list[tuple[int, int]] = []
        self._roles, self._parent, self._module_segments = [], [], segments
        windows: dict[int, list[list[int]]] = {}  # block index -> per gap between heavy ops, its valid cut offsets
        for index, (a, b) in enumerate(segments):
            if any(self._is_block(u) for u in self._units[a: b + 1] if u not in self._glue):
                windows[index] = self._windows(a, b)
        alike: dict[tuple, list[int]] = {}
        for index in windows:
            a, b = segments[index]
            alike.setdefault(tuple(_target_name(n) for n in self.order[a: b + 1]), []).append(index)
        for index, (a, b) in enumerate(segments):
            if index not in windows:
                parts = self._stem_parts(a, b) if index == 0 and windows else [(a, b)]
                out += parts
                self._roles += self._layer_roles(parts) if len(parts) > 1 else [""]
                self._parent += [index] * len(parts)
                continue
            twins = next(group for group in alike.values() if index in group)
            cuts = []
            for w, window in enumerate(windows[index]):
                common = [d for d in window if all(d in windows[k][w] for k in twins)]
                if common:
                    cuts.append(a + min(common, key=lambda d: (
                        sum(self._crossing_bytes(segments[k][0] + d) for k in twins), -d)))
            bounds = [a - 1, *sorted(set(cuts)), b]
            parts = [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]
            out += parts
            self._parent += [index] * len(parts)
            kinds = [[self._heavy(n) or _topk(n) for n in self.order[x: y + 1]] for x, y in parts]
            attention = any(k in ("matmul", "softmax", "fused") for part in kinds for k in part)
            self._roles += _roles(kinds) if attention or len(parts) == 1 else self._module_roles(parts, a, b)
        return out

    def _stem_parts(self, a: int, b: int) -> list[tuple[int, int]]:
        """A CNN's stem (the layers before the first block, holding a convolution) cut between its layers, where
        the cut is valid: at full resolution its activations are the model's largest (resnet's conv1, bn1 with its
        in-place relu, maxpool). A stem without a convolution (a transformer's input unpacking and embeddings)
        stays whole."""
        if not any(self._conv(n) for n in self.order[a: b + 1]):
            return [(a, b)]
        valid = set(self.valid)
        cuts = [p for p in range(a, b) if p in valid and self.owner(self.order[p]) != self.owner(self.order[p + 1])]
        bounds = [a - 1, *cuts, b]
        return [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1)]

    def _conv(self, n: fx.Node) -> bool:
        """Is ``n`` a convolution (a conv module, or a conv op of a flattened graph)?"""
        if n.op == "call_module":
            return isinstance(self.traced.attrs[n.target], nn.modules.conv._ConvNd)
        return n.op == "call_function" and _target_name(n).split(".")[0].startswith("conv")

    def _layer_roles(self, parts: list[tuple[int, int]]) -> list[str]:
        """Roles of the parts of a stem: the layers each holds (``conv1``, ``bn1..relu``) by their last name, or for
        an op of the model's own forward (``F.relu``), the op's."""
        roles = []
        for x, y in parts:
            layers = list(dict.fromkeys(self.owner(n).rsplit(".", 1)[-1] or _target_name(n).split(".")[0]
                                        for n in self.order[x: y + 1]))
            roles.append(layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}")
        return _told_apart(roles)

    def _windows(self, a: int, b: int) -> list[list[int]]:
        """For each gap between consecutive heavy-op groups of the block ``a..b``: the offsets (from ``a``) of the
        valid sub-layer cuts in it."""
        groups: list[tuple[str, int, int, fx.Node | None]] = []  # (kind, first, last, root read)
        for p in range(a, b + 1):
            kind = self._heavy(self.order[p])
            if not kind:
                continue
            root = self._root(self.order[p]) if kind == "weight" else None
            if groups and kind == "weight" and groups[-1][0] == "weight" and groups[-1][3] is root:
                groups[-1] = ("weight", groups[-1][1], p, root)  # q, k, v (or gate, up) read the same value
            else:
                groups.append((kind, p, p, root))
        return [[p - a for p in range(end, start) if a <= p < b and self._multi_cuttable(p)]
                for (_, _, end, _), (_, start, _, _) in zip(groups, groups[1:])]

    def _module_roles(self, parts: list[tuple[int, int]], a: int, b: int) -> list[str]:
        """Roles of the parts of a block without attention (a residual bottleneck, a dense block), from the modules
        of the weights each part applies, relative to the block: ``conv2`` (``layer3.2.conv2``), ``denselayer5``
        when a part holds both convolutions of a dense layer, ``denselayer5.conv1`` when it holds one; a part with
        no weight of its own is ``part{i}``. Repeated roles get ``#1``, ``#2``."""
        # the module the segment is (a dense block's units are its layers; the segment, the block holding them)
        block = _common_path(list(dict.fromkeys(
            u for u in self._units[a: b + 1] if u not in self._glue and self._is_block(u))))
        roles = []
        for i, (x, y) in enumerate(parts):
            paths = [self._weight_module(self.owner(n), block) for n in self.order[x: y + 1]
                     if self._heavy(n) == "weight"]
            paths = [p[len(block) + 1:] if block and p.startswith(block + ".") else p for p in paths if p]
            paths = list(dict.fromkeys(paths))
            common = _common_path(paths)
            roles.append(common or (f"{paths[0]}..{paths[-1]}" if paths else f"part{i}"))
        return _told_apart(roles)

    def _weight_module(self, path: str, block: str) -> str:
        """The module a weight is named by: its own (``conv2``), or, inside the block, the wrapper whose only
        weight it is (Inception's ``branch5x5_2`` for ``branch5x5_2.conv``, resnet's ``downsample`` for
        ``downsample.0``)."""
        while "." in path and path.rsplit(".", 1)[0] != block:
            parent = self._module(path.rsplit(".", 1)[0])
            weights = [m for m in parent.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                       and m.weight.dim() >= 2] if parent is not None else []
            if len(weights) != 1:
                break
            path = path.rsplit(".", 1)[0]
        return path

    # -- module cuts -----------------------------------------------------------------------------------------------

    def owner(self, n: fx.Node) -> str:
        """The path of the deepest module whose forward created this node ('' for the root's own forward)."""
        if n.op == "call_module":
            return n.target
        stack = n.meta.get("nn_module_stack")
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return ".".join(part.split("@")[0] for part in path.split(".")) if path else ""

    def _called(self, n: fx.Node, unit: str) -> str:
        """``unit``, with ``@k`` when ``n`` runs in the module's call k+1 (torch.export numbers repeated calls): a
        layer shared by weight and called once per layer (ALBERT) is as many units as calls."""
        for key, (path, _) in (n.meta.get("nn_module_stack") or {}).items():
            last = key.rsplit(".", 1)[-1]
            if "@" in last and unit and ".".join(p.split("@")[0] for p in path.split(".")) == unit:
                return f"{unit}@{last.rsplit('@', 1)[1]}"
        return unit

    def _module(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:
            return None

    def _expanded(self, module: nn.Module, depth: int, force: int, in_blocks: bool = False) -> bool:
        """Split this module's children into separate units? Yes for the model itself, for containers of blocks
        (a ModuleList of layers, resnet's ``layer2``), for wrappers holding such a container at any depth
        (GPT2Model holding ``h``; BertForSequenceClassification holding ``bert.encoder.layer``), and, when these
        units give a single stage, for every module above depth ``force``. A block of such a container
        (``in_blocks``: a transformer layer, even one holding a list of its own sub-layers) stays whole, and a
        container of single layers (``nn.Sequential(conv, bn)``) is a block itself."""
        if depth == 0 or depth < force or (isinstance(module, _CONTAINERS) and _holds_blocks(module)):
            return True
        if in_blocks:
            return False
        return any(isinstance(c, _CONTAINERS) and _holds_blocks(c) for c in module.modules() if c is not module)

    def unit(self, path: str, force: int) -> str:
        """The module a node belongs to at module granularity: the first non-expanded module on its path.
        Nodes of an expanded module's own forward (the root's flatten, a wrapper's embedding sum) get that
        module's path and are recorded as glue."""
        module, unit = self.model, []
        parts = path.split(".") if path else []
        in_blocks = False
        for depth, part in enumerate(parts):
            if not self._expanded(module, depth, force, in_blocks):
                break
            child = getattr(module, part, None)
            if not isinstance(child, nn.Module):
                break
            in_blocks = isinstance(module, _CONTAINERS) and _holds_blocks(module)
            module = child
            unit.append(part)
        else:
            if self._expanded(module, len(parts), force, in_blocks):
                self._glue.add(".".join(unit))
        return ".".join(unit)

    def _is_block(self, unit: str) -> bool:
        """A building block (layer2.1, h.3): a unit that has submodules of its own. Single layers (conv1, ln_f)
        and glue are not blocks: they are merged into the stem and the head."""
        module = self._module(unit.split("@")[0]) if unit not in self._glue else None
        return module is not None and any(True for _ in module.children())

    def _module_cuts(self) -> list[int]:
        depth = max((self.owner(n).count(".") + 1 for n in self.order if self.owner(n)), default=0)
        for force in range(depth + 1):
            self._glue: set[str] = set()
            units = [self._called(n, self.unit(self.owner(n), force)) for n in self.order]
            cuts = self._merge([p for p in self.valid if units[p] != units[p + 1]], units)
            if cuts:
                self._units = units
                return cuts
        # No module boundary is a cut (a purely functional forward): every cut point then.
        self._glue = set()
        self._units = [self.owner(n) for n in self.order]
        return self.valid

    def _merge(self, cuts: list[int], units: list[str]) -> list[int]:
        """Keep only the cuts in front of a block and after the last one: the layers before the first block form
        the stem, those after the last the head, and glue between blocks (a mask product, a pooling layer) joins
        the block before it."""
        bounds = [-1, *cuts, len(self.order) - 1]
        blocky = [any(self._is_block(u) for u in units[bounds[i] + 1: bounds[i + 1] + 1])
                  for i in range(len(bounds) - 1)]
        if not any(blocky):
            # No blocks: every module is a stage; glue (a sum, a flatten, unpacking the inputs) joins the module
            # before it, or the first module when it leads.
            glue = [all(u in self._glue for u in units[bounds[i] + 1: bounds[i + 1] + 1])
                    for i in range(len(bounds) - 1)]
            return [cuts[i] for i in range(len(cuts)) if not glue[i + 1] and not all(glue[: i + 1])]
        last = len(blocky) - 1 - blocky[::-1].index(True)
        return [cuts[i] for i in range(len(cuts)) if blocky[i + 1] or i == last]


def _is_encoder_decoder(model: nn.Module) -> bool:
    """A Hugging Face encoder-decoder (its config says so), or a model with an ``encoder`` and a ``decoder``
    (``nn.Transformer``)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True:
        return True
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return {"encoder", "decoder"} <= names


def _common_path(paths: list[str]) -> str:
    """The longest dotted module path all ``paths`` lie under ("" if none)."""
    common: list[str] = []
    for items in zip(*(p.split(".") for p in paths)):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common) if paths else ""


def _holds_blocks(container: nn.Module) -> bool:
    """A container of real blocks (non-leaf modules), not just a packaged conv+bn pair."""
    return any(any(True for _ in c.children()) for c in container.children())
