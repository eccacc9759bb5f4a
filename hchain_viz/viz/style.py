"""Colours, labels and axis formatting shared by every figure, the explorer and the HTML export.

One place decides how things look: op colours (design.md §6: forward blue, backward orange, loss grey, recomputation a
distinct colour), memory-kind colours, and how bytes and seconds become axis ticks and hover text. Numbers stay in
bytes and seconds inside figures; only the labels are pretty-printed, through :mod:`hchain_viz.core.units`.
"""

from __future__ import annotations

import math

import numpy as np

from ..core.units import format_bytes

# Op categories on the timeline. Recomputed forwards get a loud colour: they are the point of the picture.
OP_COLORS = {
    "forward": "#1f77b4",  # blue: first forward of a stage
    "recompute": "#d62728",  # red: a forward run again
    "backward": "#ff7f0e",  # orange
    "loss": "#7f7f7f",  # grey
    "offload": "#8c6d31",  # brown: a copy to host (transfer lane)
    "prefetch": "#31a354",  # green: a copy back to the device (transfer lane)
}
OP_LABELS = {"forward": "forward", "recompute": "recomputed forward", "backward": "backward", "loss": "loss",
             "offload": "offload → host", "prefetch": "prefetch → device"}
IDLE_COLOR = "#bdbdbd"  # compute waiting for a prefetch
HOST_COLOR = "rgba(140, 109, 49, 0.35)"  # values resident on the host (memory band, tape marks)

# Resident memory by kind (Trace items). x̄ and the held output are both "full saved activations".
KIND_COLORS = {
    "x": "#2ca02c",  # green: plain checkpoints x_i (x_0 included)
    "saved": "#9ecae1",  # light blue: x̄ and the held output x_L, what autograd-recording forwards leave
    "delta": "#fdae6b",  # light orange: gradients δ_i
}
KIND_LABELS = {"x": "checkpoints x", "saved": "saved activations x̄ / output", "delta": "gradients δ"}
# Storage tape: one colour per item kind, drawn as bars of different widths so co-resident items stay visible.
TAPE_COLORS = {"xbar": "#6baed6", "out": "#9467bd", "delta": "#fd8d3c", "x": "#238b45", "transit": "#bcbddc",
               "consumed": "#807dba", "shared": "#74c476"}
TAPE_LABELS = {"xbar": "full x̄ (saved for backward)", "out": "output x_L (held)", "delta": "gradient δ",
               "x": "checkpoint x", "transit": "x part no backward needs (freed by its Fall)",
               "consumed": "x part only its backward needs (freed by its B)",
               "shared": "shared tensor (counted once)"}
TAPE_WIDTHS = {"xbar": 0.9, "out": 0.9, "delta": 0.6, "x": 0.35, "transit": 0.25, "consumed": 0.2, "shared": 0.15}

TOTAL_COLOR = "#222222"
BUDGET_COLOR = "#000000"
PEAK_COLOR = "#d62728"
OVERLAY_COLOR = "#8c564b"
CURSOR_COLOR = "#e377c2"
INFEASIBLE_FILL = "rgba(128, 128, 128, 0.25)"
# Baselines on the frontier, in a stable order; unknown names fall back to the cycle.
STRATEGY_COLORS = {
    "optimal": "#1f77b4",
    "store_all": "#7f7f7f",
    "recompute_all": "#8c564b",
    "periodic": "#2ca02c",
    "sqrt_n": "#9467bd",
    "revolve": "#e377c2",
    "chen_greedy": "#bcbd22",
    "per_layer": "#d62728",
    "selective": "#ff7f0e",
    "layer_periodic": "#17becf",
}
_CYCLE = ("#17becf", "#ff7f0e", "#d62728", "#aec7e8", "#98df8a", "#c5b0d5")

FONT = dict(family="Helvetica, Arial, sans-serif", size=12)
MARGIN = dict(l=60, r=20, t=36, b=30)

# Time axes hold seconds; d3's SI format turns 0.0012 into "1.2m", and the suffix makes it "1.2ms".
TIME_AXIS = dict(tickformat="~s", ticksuffix="s", zeroline=False)
TIME_HOVER = ".3~s"  # d3 format for seconds in hover templates, followed by "s"

_BINARY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


# Baselines' markers on the frontier: a shape each, open, and sizes that nest where points coincide (store-all's
# point is also the last of periodic's and chen_greedy's; revolve's and periodic's often share the lowest peak).
STRATEGY_MARKERS = {
    "store_all": ("circle-open", 16),
    "periodic": ("square-open", 11),
    "chen_greedy": ("diamond-open", 8),
    "sqrt_n": ("star-open", 12),
    "revolve": ("hexagon-open", 14),
    "recompute_all": ("pentagon-open", 10),
    "per_layer": ("hourglass-open", 10),
    "selective": ("bowtie-open", 10),
    "layer_periodic": ("cross-open", 10),
}
_MARKER_CYCLE = ("circle-open", "square-open", "diamond-open", "star-open", "hexagon-open", "pentagon-open")


def strategy_marker(name: str, index: int = 0) -> tuple[str, int]:
    """The (plotly symbol, size) of a baseline's points on the frontier."""
    return STRATEGY_MARKERS.get(name, (_MARKER_CYCLE[index % len(_MARKER_CYCLE)], 10))


def strategy_color(name: str, index: int = 0) -> str:
    """The colour of a strategy on the frontier and in overlays."""
    return STRATEGY_COLORS.get(name, _CYCLE[index % len(_CYCLE)])


def byte_unit(max_bytes: float) -> tuple[str, int]:
    """The binary unit (name, scale) that keeps ``max_bytes`` readable: 300 MiB rather than 0.29 GiB."""
    for name, scale in _BINARY_UNITS:
        if max_bytes >= scale:
            return name, scale
    return "B", 1


def byte_ticks(lo: float, hi: float, n: int = 6) -> tuple[list[float], list[str]]:
    """Tick positions (bytes) at round binary values between ``lo`` and ``hi``, labelled like ``256 MiB``."""
    hi = max(hi, lo + 1)
    _, scale = byte_unit(max(abs(hi), abs(lo)))
    span = (hi - lo) / scale
    raw = span / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if scale == 1:
        step = max(1.0, round(step))  # whole bytes
    first = math.ceil(lo / scale / step) * step
    vals = [v * scale for v in np.arange(first, hi / scale + step * 1e-9, step)]
    return vals, [format_bytes(v) for v in vals]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values (steps of 1, 2, 2.5 or 5 times a power of ten) between ``lo`` and ``hi``."""
    raw = (hi - lo) / max(n - 1, 1)
    if not raw > 0:
        return [lo]
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(float(v), 10) for v in np.arange(first, hi + step * 1e-9, step)]


def byte_axis(lo: float, hi: float, title: str = "memory") -> dict:
    """Layout for a memory axis over [lo, hi] bytes with MiB/GiB tick labels."""
    vals, text = byte_ticks(lo, hi)
    return dict(tickmode="array", tickvals=vals, ticktext=text, title_text=title, zeroline=False)


def base_layout(title: str, height: int = 320) -> dict:
    """Common layout of every figure: compact margins, legend below the plot."""
    return dict(
        title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)),
        height=height,
        margin=MARGIN,
        font=FONT,
        template="plotly_white",
        legend=dict(orientation="h", yanchor="top", y=-0.08, xanchor="left", x=0.0),  # below: titles stay clear
        hoverlabel=dict(namelength=-1),
    )


# ---------------------------------------------------------------------------------------------- abstract units
_BYTES_TEXT = r"(-?\d[\d.]*(?:e[+-]?\d+)?) (?:B|KiB|MiB|GiB)\b"
_SECONDS_TEXT = r"(-?\d[\d.]*(?:e[+-]?\d+)?) (?:s|ms|µs|ns)\b"


def in_abstract_units(fig) -> None:  # noqa: ANN001 (a plotly Figure)
    """Relabel ``fig`` for a teaching chain whose numbers are plain units (``hchain_viz.course.abstract``): time
    axes lose their "s", memory ticks their "B", titles and hover texts say "units". The data are unchanged.

    Memory ticks are rewritten from their positions (a byte formatter would print 12 as "12 B" and 2048 as "2 KiB").
    """
    import re

    def plain(v: float) -> str:
        return f"{v:.4g}"

    lay = fig.layout
    for name in [k for k in lay.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]:
        ax = lay[name]
        if ax.ticksuffix == "s":
            ax.ticksuffix = ""
            ax.tickformat = ""
            if name.startswith("y"):
                ax.title.text = f"{ax.title.text or 'time'} (time units)"
            else:  # the legend sits right under the plot: move it below the axis title
                ax.title.text = "time (units)"
                lay.legend.y = -0.3
                lay.margin.b = max(lay.margin.b or 0, 90)
        elif ax.tickmode == "array" and ax.ticktext and any(re.search(_BYTES_TEXT, str(t)) for t in ax.ticktext):
            ax.ticktext = [plain(v) for v in ax.tickvals]
            ax.title.text = f"{ax.title.text} (units)" if ax.title.text else "memory (units)"
            if name.startswith("x"):
                lay.legend.y = -0.3
                lay.margin.b = max(lay.margin.b or 0, 90)
    if lay.title.text:
        lay.title.text = _units_text(lay.title.text)
    for ann in lay.annotations or ():
        if ann.text:
            ann.text = _units_text(ann.text)
    for tr in fig.data:
        if getattr(tr, "hovertemplate", None):
            tr.hovertemplate = (tr.hovertemplate.replace("}s", "} time units").replace(" B<", " units<")
                                .replace(" B (", " units (").replace(" KiB", " units").replace(" MiB", " units"))
        if getattr(tr, "name", None):
            tr.name = _units_text(tr.name)
        text = getattr(tr, "text", None)
        if text is not None and not isinstance(text, str) and len(text) and isinstance(text[0], str):
            tr.text = [_units_text(t) for t in text]


def _units_text(s: str) -> str:
    """"peak 12 B of 14 B budget, 56 s" → "peak 12 units of 14 units budget, 56 time units" (values re-read as
    plain numbers: "1.5 KiB" is 1536 units)."""
    import re

    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "s": 1, "ms": 1e-3, "µs": 1e-6, "ns": 1e-9}

    def b(m: re.Match) -> str:
        return f"{float(m.group(1)) * scale[m.group(0).split()[-1]]:.4g} units"

    def t(m: re.Match) -> str:
        return f"{float(m.group(1)) * scale[m.group(0).split()[-1]]:.4g} time units"

    return re.sub(_SECONDS_TEXT, t, re.sub(_BYTES_TEXT, b, s))
