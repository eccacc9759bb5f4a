"""Names and roles: one readable, unique name per stage ("h.3", "stem", "h.3.attn.probs") and the role of each
part of a block at sub-layer granularity, read from the heavy ops it holds. ``_Naming`` is a mixin of ``_Plan``."""

from __future__ import annotations

import re

import torch.fx as fx

from .values import _target_name

_ATTN_CORE = {"core", "scores", "probs", "context"}  # the roles of attention's core parts


def _topk(n: fx.Node) -> str:
    """"topk" for a top-k selection (a mixture-of-experts router picking experts), else ""."""
    return "topk" if "topk" in _target_name(n).lower() else ""


def _roles(parts: list[list[str]]) -> list[str]:
    """Readable roles of the parts of one transformer block, from the heavy ops each holds (see _Plan._heavy; "topk"
    marks a top-k selection): attn.qkv, attn.scores, attn.probs, attn.context (or attn.core for a fused attention
    op), attn.out, mlp.up, mlp.down. A second attention (a decoder's cross-attention) gets the same roles under xattn
    (a third under xattn2, ...). A mixture-of-experts layer after the attentions gets moe.in0.. (what runs before the
    router, e.g. a shared expert), moe.router (the gate's projection) and moe.experts, moe.experts2, ... (from the
    router's softmax or top-k on). A block without attention or router gets part0, part1, ..."""
    if len(parts) == 1:
        return [""]
    kinds = [set(k) - {""} for k in parts]
    core = [i for i, k in enumerate(kinds) if k & {"matmul", "softmax", "fused"}]
    runs: list[list[int]] = []  # consecutive core parts
    for i in core:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    # An attention multiplies two activations (scores, context) or calls a fused attention op; a softmax or top-k
    # without such a product is a router choosing experts: from there on, the block is a mixture of experts.
    runs = [run for run in runs if any(kinds[j] & {"matmul", "fused"} for j in run)]
    after = runs[-1][-1] + 1 if runs else 0
    route = next((i for i in range(after, len(parts)) if kinds[i] & {"softmax", "topk"}), None)
    if route is not None:
        gate = route - 1 if route - 1 >= after and "weight" in kinds[route - 1] else route
        n_head = min(after + 1, gate) if runs else 0  # the attentions and their out projection
        head = _roles_attention(kinds[:after + 1], runs)[:n_head] if runs else []
        moe = [f"moe.in{i - n_head}" for i in range(n_head, gate)]
        moe += ["moe.router"] * (gate < route)
        moe += ["moe.experts" if i == route else f"moe.experts{i - route + 1}" for i in range(route, len(parts))]
        return _numbered(head + moe)
    if not runs:
        return [f"part{i}" for i in range(len(parts))]
    return _numbered(_roles_attention(kinds, runs))


def _numbered(roles: list[str]) -> list[str]:
    """Repeated roles numbered from the second on (DeBERTa's scores, c2p and p2c: attn.scores, attn.scores2, ...)."""
    seen: dict[str, int] = {}
    out = []
    for role in roles:
        seen[role] = seen.get(role, 0) + 1
        out.append(role if seen[role] == 1 else f"{role}{seen[role]}")
    return out


def _roles_attention(kinds: list[set[str]], runs: list[list[int]]) -> list[str]:
    """Roles of a block's parts around its attentions (``runs``: each attention's consecutive core parts)."""
    prefix = ["attn", "xattn"] + [f"xattn{r}" for r in range(2, len(runs))]
    roles = []
    for i, k in enumerate(kinds):
        r = sum(run[-1] < i for run in runs)  # attentions wholly before part i
        if r < len(runs) and i >= runs[r][0]:  # a core part of attention r
            soft = next((j for j in runs[r] if "softmax" in kinds[j]), None)
            core = ("core" if "fused" in k else "probs" if "softmax" in k else
                    "scores" if soft is not None and i < soft else "context")
            roles.append(f"{prefix[r]}.{core}")
        elif r > 0 and i == runs[r - 1][-1] + 1:
            roles.append(f"{prefix[r - 1]}.out")
        elif r < len(runs):  # before attention r: its projections (numbered from the block's or the last out)
            first = runs[r - 1][-1] + 2 if r else 0
            roles.append(f"{prefix[r]}.qkv" if i == runs[r][0] - 1 else f"{prefix[r]}.in{i - first}")
        elif i == len(kinds) - 1:
            roles.append("mlp.down")
        else:
            k_up = i - runs[-1][-1] - 2
            roles.append("mlp.up" if k_up == 0 else f"mlp.up{k_up + 1}")
    return roles


class _Naming:
    """Stage names, groups and tags (a mixin of ``_Plan``)."""

    def names(self, segments: list[tuple[int, int]], mode: str | int) -> list[str]:
        """One readable, unique name per segment: the module it is ("h.3", "denseblock1"), "stem"/"head" at
        module granularity, a range of modules ("wte..h.1"), or part of one module ("layer1.0[conv1..bn2]");
        at sub-layer granularity the block's name and the part's role ("h.3.attn.probs"). Sets ``self.groups``
        (the block of each segment, or None) and ``self.tags`` ("attn_core" on the core attention's parts)."""
        if mode == "sublayer":
            blocks = self.names(self._module_segments, "module")
            block_groups = self.groups
            self.groups = [block_groups[k] for k in self._parent]
            self.tags = ["attn_core" if re.sub(r"\d+$", "", role.split(".")[-1]) in _ATTN_CORE else ""
                         for role in self._roles]
            return [blocks[k] + (f".{role}" if role else "") for k, role in zip(self._parent, self._roles)]
        self.groups: list[str | None] = [None] * len(segments)
        self.tags = [""] * len(segments)
        owners = [self.owner(n) for n in self.order]
        if mode != "module":
            self._glue = set()
            self._units = [self.unit(o, 0) for o in owners]
        units = self._units
        full: list[tuple[str, ...]] = []  # (kind, ...) entries, turned into names by _shorten
        for a, b in segments:
            paths = owners[a: b + 1]
            if mode == "module":
                # A whole block with the single layers beside it (the decoder's embedding after the encoder's last
                # layer) is named after the block, not after the module of its ops (T5's block.0.layer).
                blocks = [u for u in dict.fromkeys(units[a: b + 1]) if u not in self._glue and self._is_block(u)]
                if len(blocks) == 1 and units.count(blocks[0]) == units[a: b + 1].count(blocks[0]):
                    full.append(("module", blocks[0]))
                    continue
            common = _common_prefix(paths)
            if common and sum(1 for o in owners if _under(o, common)) == b - a + 1:
                full.append(("module", common))  # exactly the ops of one module
                continue
            inner = [u for u in units[a: b + 1] if u not in self._glue] or units[a: b + 1]
            first, last = inner[0], inner[-1]
            if first == last and first and sum(1 for o in owners if _under(o, first)) == sum(
                    1 for o in paths if _under(o, first)):
                full.append(("module", first))  # one whole module and the glue after it
                continue
            if first != last:
                full.append(("range", first, last))
                continue
            depth = first.count(".") + 1 if first else 0
            kids = [o.split(".")[depth] for o in paths if o.count(".") >= depth and _under(o, first) and o != first]
            part = "" if not kids else f"[{kids[0]}]" if kids[0] == kids[-1] else f"[{kids[0]}..{kids[-1]}]"
            full.append(("part", first or "model", part))
        names_are_blocks = False
        if mode == "module":
            blocky = [any(self._is_block(u) for u in units[a: b + 1]) for a, b in segments]
            names_are_blocks = any(blocky)
            if any(blocky):
                first_block, last_block = blocky.index(True), len(blocky) - 1 - blocky[::-1].index(True)
                for i in range(len(full)):
                    if i < first_block:
                        full[i] = ("fixed", "stem")
                    elif i > last_block:
                        full[i] = ("fixed", "head")
        names = _shorten(full)
        if names_are_blocks:
            self.groups = [n if blocky[i] else None for i, n in enumerate(names)]
        return names


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _brief(path: str, k: int = 1) -> str:
    """The last ``k`` parts of a module path, keeping a list index with its container ("h.3", not "3")."""
    parts = path.split(".")
    k = max(k, 2 if parts[-1].isdigit() and len(parts) >= 2 else 1)
    return ".".join(parts[-k:])


def _shorten(full: list[tuple[str, ...]]) -> list[str]:
    """Turn ("module", path), ("range", first, last), ("part", path, "[children]") and ("fixed", name) entries
    into names: module paths lose leading parts while they stay unique ("transformer.h.3" -> "h.3"); names still
    repeated get "#1", "#2"."""
    # A unit of a repeated call (``layer@1``: see _Cuts._called) is named after its module; "#k" tells them apart.
    full = [(kind, *(re.sub(r"@\d+", "", part) for part in rest)) for kind, *rest in full]
    paths = [entry[1] for entry in full if entry[0] == "module"]
    names = []
    for kind, *rest in full:
        if kind == "range":
            names.append(f"{_brief(rest[0])}..{_brief(rest[1])}")
        elif kind == "part":
            names.append(_brief(rest[0]) + rest[1])
        elif kind == "fixed":
            names.append(rest[0])
        else:
            path = rest[0]
            for k in range(1, path.count(".") + 2):
                if all(_brief(other, k) != _brief(path, k) for other in paths if other != path):
                    break
            names.append(_brief(path, k))
    return _told_apart(names)


def _told_apart(names: list[str]) -> list[str]:
    """The names with each repeated one told apart by "#1", "#2", ... in order; unique names stay as they are."""
    counts = {name: names.count(name) for name in names}
    seen: dict[str, int] = {}
    out = []
    for name in names:
        if counts[name] > 1:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name}#{seen[name]}"
        out.append(name)
    return out
