"""The command line's first contact: what `python -m hchain_viz demo` prints and where it writes."""

from __future__ import annotations

import dataclasses
import os

import pytest

import hchain_viz as hcv
from hchain_viz import __main__ as cli

pytestmark = pytest.mark.torch


@pytest.fixture
def demo(monkeypatch, tmp_path, capsys):
    """Run the demo on a random chain (no profiling) in ``tmp_path``; return its printout."""
    from hchain_viz.runtime import models

    chain = hcv.Chain.random(12, seed=3)
    chain = dataclasses.replace(chain, meta={"repeats": 5, "time_spread": {"fwd": [0.3] * 12, "bwd": [0.3] * 12}})
    monkeypatch.setattr(models, "demo_model", lambda name=None: (None, None, None))
    monkeypatch.setattr(hcv, "profile", lambda *a, **k: chain, raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args):
        assert cli.main(["demo", "--quiet", *args]) == 0
        return capsys.readouterr().out

    return run


def test_demo_leads_with_the_headline_and_explains_its_terms(demo, tmp_path):
    out = demo()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert lines[1].startswith("Headline: within the same memory budget, the optimal schedule")
    assert "stage times varied ±30% across 5 repeats." in out and "A busy machine: profile again" in out
    long = [ln for ln in lines if len(ln) > 100 and "Wrote" not in ln]  # (the path is as long as it is)
    assert long == []  # no 170-character sentences
    terms = out.split("Terms:\n")[1].split("\n\n")[0].splitlines()
    assert {t.split()[0] for t in terms} >= {"budget", "store-all", "step", "recompute", "optimal", "periodic"}
    frontier = out.split("Optimal step time by budget")[1].split("\n\n")[0].splitlines()
    assert len(frontier) <= 3 + 7 and "bytes" not in frontier[1]  # short, no raw-bytes column
    path = tmp_path / "out" / "hchain_demo.html"
    assert path.exists() and f"Wrote the interactive explorer to {path}" in out  # the absolute path, in out/


def test_demo_full_prints_every_breakpoint_and_explains_the_chain_columns(demo):
    out = demo("--full", "--out", "x/demo.html")
    for term in ("xbar", "fwd_tmp", "fwd / bwd"):
        assert f"\n  {term}" in out
    assert "bytes" in out.split("Optimal step time by budget")[1].splitlines()[1]
    assert os.path.exists("x/demo.html")


def test_default_output_is_git_ignored():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ignored = open(os.path.join(root, ".gitignore")).read().split()
    default = cli.build_parser().parse_args(["demo"]).out
    assert default.split(os.sep)[0] + "/" in {p.strip("/") + "/" for p in ignored}
