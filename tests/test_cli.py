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


def tiny_mlp(batch: int = 8):
    """A small dense model for `fit` (``module:function`` taking batch=)."""
    return hcv.models.mlp_chain(batch=batch, in_features=16, widths=(64, 32), seed=0)


@pytest.mark.parametrize("precision, parts", [("bf16-mixed", "autocast weight copies"),
                                              ("bf16-master", "master weights"), ("bf16", "AdamW state")])
def test_fit_profiles_and_counts_the_step_in_the_precision_asked(precision, parts, capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "chain.json"
    assert cli.main(["fit", f"{__name__}:tiny_mlp", "--device-memory", "1MiB", "--precision", precision,
                     "--batches", "4,8", "--check", "0", "--repeats", "1", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"in {precision} ..." in text and f"({precision}: " in text
    assert parts in text.split("fixed part per rank:")[1].splitlines()[0]
    fixed = hcv.Chain.from_json(out.read_text()).fixed
    elements = sum(p.numel() for p in tiny_mlp()[0].parameters())
    weights = 4 if precision == "bf16-mixed" else 2
    assert fixed.precision == precision and fixed.params == weights * elements
    assert fixed.master_weights == (4 * elements if precision == "bf16-master" else 0)
    assert fixed.cast_cache == (2 * elements if precision == "bf16-mixed" else 0)


def test_fit_names_an_unknown_precision_before_profiling(capsys, monkeypatch):
    from hchain_viz.runtime import batch

    monkeypatch.setattr(batch, "profile_batches", lambda *a, **k: pytest.fail("profiled a bad precision"))
    assert cli.main(["fit", "mlp_chain", "--device-memory", "24GiB", "--precision", "bf17"]) == 1
    err = capsys.readouterr().err
    assert "unknown precision 'bf17'" in err and "bf16-mixed" in err
