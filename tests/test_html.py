"""The offline HTML export: one frame per budget, the same figures, nothing loaded from the network."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import hchain_viz as hcv
from hchain_viz.errors import HChainError
from hchain_viz.viz import style
from hchain_viz.viz.html import to_html
from hchain_viz.viz.trace_view import TraceView


@pytest.fixture(scope="module")
def chain():
    # A user-chosen stage name must not be able to close the data <script>.
    names = [f"block{i}" for i in range(7)] + ["evil</script><script>alert(1)</script>"]
    c = hcv.Chain.random(8, seed=5)
    return hcv.Chain(c.fwd_time, c.bwd_time, c.x, c.xbar, c.fwd_tmp, c.bwd_tmp, names)


@pytest.fixture(scope="module")
def solution(chain):
    return hcv.solve(chain)


@pytest.fixture(scope="module")
def page(solution, tmp_path_factory):
    path = tmp_path_factory.mktemp("html") / "explorer.html"
    out = to_html(solution, path, n_budgets=6)
    assert out == str(path)
    return path.read_text(encoding="utf-8")


def payload(text):
    m = re.search(r'<script type="application/json" id="hcv-data">(.*?)</script>', text, re.S)
    assert m, "the data block is missing"
    return json.loads(m.group(1))


def test_one_frame_per_budget_from_least_feasible_to_store_all(page, solution):
    data = payload(page)
    budgets = [f["budget"] for f in data["frames"]]
    assert len(budgets) == 6 and budgets == sorted(set(budgets))
    assert budgets[0] == solution.min_budget and budgets[-1] == solution.store_all_peak
    assert f'max="{len(budgets) - 1}"' in page  # the slider spans the frames


def test_frames_hold_the_simulated_schedule_at_their_budget(page, solution):
    data = payload(page)
    for f in data["frames"]:
        trace = hcv.simulate(solution.chain, solution.schedule(f["budget"]))
        n_marks = sum(len(t["y"]) for t in f["timeline"]["data"])
        assert n_marks == len(trace.events)
        total = next(t for t in f["memory"]["data"] if t["name"] == "total (with transients)")
        assert np.array_equal(np.asarray(total["y"]), trace.memory_curve()[1])
        budget_line = next(t for t in f["memory"]["data"] if t["name"].startswith("budget"))
        assert budget_line["y"] == [f["budget"], f["budget"]]
        assert f["frontier"][0]["x"] == [f["budget"], f["budget"]]
        assert f"{trace.n_recomputed} recomputed" in f["stats"]
        held = sum(len(tr["y"]) for tr in f["tape"]["data"] if tr["name"] != "on host")
        assert held == len(TraceView.of(trace).item_kind)  # the storage tape: every held value
    frontier = data["base"]["frontier"]["data"]
    assert frontier[0]["name"] == "optimal"
    assert frontier[data["frontier_budget_index"]]["name"] == "budget"


def test_page_is_self_contained(page):
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)  # every script is inline
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']?(https?:)?//", page, re.I)
    assert not re.search(r"@import|url\(\s*[\"']?(https?:)?//", page, re.I)
    assert "MathJax.Hub" not in page and "cdn.plot.ly/plotly" not in page.split("<body>")[1]
    assert "Plotly.react" in page and len(page) > 1_000_000  # plotly.js is embedded
    assert "<script>alert(1)" not in page  # stage names cannot break out of the data block


def test_accepts_a_chain_and_checks_its_arguments(chain, tmp_path):
    path = to_html(chain, tmp_path / "c.html", n_budgets=2, strategies=False)
    data = payload(open(path, encoding="utf-8").read())
    assert len(data["frames"]) == 2
    assert [t["name"] for t in data["base"]["frontier"]["data"]][0] == "optimal"
    assert "revolve" not in {t["name"] for t in data["base"]["frontier"]["data"]}
    with pytest.raises(HChainError, match="Chain or a Solution"):
        to_html([1, 2, 3], tmp_path / "bad.html")
    with pytest.raises(HChainError, match="n_budgets"):
        to_html(chain, tmp_path / "bad.html", n_budgets=0)
    assert hcv.to_html is to_html  # the lazy public name


def test_opens_at_a_mid_budget_and_offers_over_a_hundred_budgets(solution, tmp_path):
    path = to_html(solution, tmp_path / "default.html")
    text = open(path, encoding="utf-8").read()
    data = payload(text)
    frames = data["frames"]
    assert len(frames) >= 100
    start = data["start"]
    assert start == (len(frames) - 1) // 2 and f'value="{start}"' in text
    mid = frames[start]["budget"]
    assert solution.min_budget < mid < solution.store_all_peak
    assert hcv.simulate(solution.chain, solution.schedule(mid)).n_recomputed > 0  # not store-all
    assert data["base"]["tape"]["layout"]["title"]["text"].startswith("Storage tape")
    assert '<div id="tape">' in text and "x̄: everything a stage keeps" in text


# The browser test of the page (slider, play, no network) lives in tests/ui/test_standalone_html.py.


# ---------------------------------------------------------------------------------------------- the pipeline view
def with_fixed(chain):
    """``chain`` as if profiled with an optimizer: parameters, gradients and AdamW-like state per stage."""
    import dataclasses

    from hchain_viz.core.fixed import FixedMemory

    g = [50_000 * (1 + i % 3) for i in range(chain.length)]
    return dataclasses.replace(chain, fixed=FixedMemory(params=sum(g), stage_grads=g, optimizer_state=2 * sum(g),
                                                        step_tmp=sum(g) // 2))


def test_pipeline_view_carries_memory_bars_and_timeline_per_limit(chain, tmp_path):
    from hchain_viz.core.pipeline import Pipeline
    from hchain_viz.viz import pipeline as V

    c = with_fixed(chain)
    text = open(to_html(c, tmp_path / "p.html", n_budgets=3, pipeline=(2, 4)), encoding="utf-8").read()
    assert len(payload(text)["frames"]) == 3  # the one-device part as before
    m = re.search(r'<script type="application/json" id="pipe-data">(.*?)</script>', text, re.S)
    assert m, "the pipeline's data block is missing"
    data = json.loads(m.group(1))
    pipe = Pipeline(c, 2, "1F1B")
    limits = V.limits(pipe, 4, 40)
    assert [f["label"] for f in data["frames"]] == [hcv.format_bytes(b) for b in limits]
    assert f'id="pipe-limit" type="range" min="0" max="{len(limits) - 1}"' in text  # its own slider
    for k in (0, len(limits) - 1):
        plan, f = pipe.plan(4, limits[k]), data["frames"][k]
        unit = style.byte_unit(limits[-1] * 1.08)[1]
        assert [t["name"] for t in f["bars"]["data"]] == list(V.PART_LABELS.values())
        assert np.allclose(sum(np.asarray(t["y"]) for t in f["bars"]["data"]) * unit, plan.peaks)
        rec = next(t for t in f["timeline"]["data"] if t["name"] == "recomputation inside the backward")
        assert np.allclose(rec["x"], [e.recompute for evs in plan.simulate().events for e in evs if e.kind == "B"])
    assert 'Plotly.react("pipe-bars"' in text and 'Plotly.react("pipe-timeline"' in text
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I) and "<script>alert(1)" not in text
    assert "pipe-data" not in open(to_html(c, tmp_path / "q.html", n_budgets=2), encoding="utf-8").read()


def test_pipeline_view_needs_the_fixed_part(chain, tmp_path):
    with pytest.raises(HChainError, match="optimizer="):
        to_html(chain, tmp_path / "bad.html", n_budgets=2, pipeline=(2, 4))
    with pytest.raises(HChainError, match=r"\(devices, microbatches\)"):
        to_html(with_fixed(chain), tmp_path / "bad.html", n_budgets=2, pipeline=2)


@pytest.mark.slow
def test_a_long_chain_page_says_its_answers_are_coarse_or_refines_them(tmp_path):
    """Above about 250 stages the tables are coarse (solution.coarse): the page says so, or refine=True answers each
    budget with Solution.refined (at random(300, 5)'s least budget 20%+ faster than the tables')."""
    chain = hcv.Chain.random(300, seed=5)
    sol = hcv.solve(chain)
    assert sol.coarse
    plain = open(hcv.to_html(sol, tmp_path / "plain.html", n_budgets=2)).read()
    refined = open(hcv.to_html(sol, tmp_path / "refined.html", n_budgets=2, refine=True)).read()
    assert "coarse tables" in plain and "refine=True" in plain and "coarse tables" not in refined
    assert "each answer refined for its budget" in refined
    table, better = (hcv.simulate(chain, s).makespan for s in (sol.schedule(sol.min_budget),
                                                                sol.refined(sol.min_budget)))
    assert better < 0.8 * table  # the least budget's frame shows the refined answer, the plain page the table's
    said = [f"makespan \\u003cb\\u003e{hcv.format_time(t)}\\u003c" for t in (table, better)]  # as JSON escapes it
    assert said[0] in plain and said[1] not in plain and said[1] in refined and said[0] not in refined
