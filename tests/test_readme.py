"""The README's quick start is executed, so it cannot rot; its CLI commands are checked to exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()


@pytest.mark.torch
def test_quick_start_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    quick = next(b for b in blocks if "hcv.profile" in b and "hcv.wrap" in b)
    assert len(quick.strip().splitlines()) <= 14  # "a ten-line quick start" (plus imports and the loop body)
    scope: dict = {}
    exec(compile(quick, "README quick start", "exec"), scope)
    assert scope["wrapped"].schedule.ops == scope["schedule"].ops


def test_readme_gives_the_two_setup_commands_and_the_benchmarks():
    bash = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert any(b.strip().endswith("python -m hchain_viz demo") for b in bash)
    assert any(b.strip().endswith("python -m pytest") for b in bash)
    for name in ("solver", "train", "profile", "widget", "models", "fit"):
        assert f"python -m hchain_viz bench {name}" in README


@pytest.mark.torch
def test_will_it_fit_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    block = next(b for b in blocks if "device_memory=" in b and "profile_batches" in b)
    scope: dict = {"print": lambda *a: None}
    exec(compile(block, "README will it fit", "exec"), scope)
    import hchain_viz as hcv

    trace = hcv.simulate(scope["c64"], scope["schedule"])
    assert trace.n_recomputed > 0 and trace.device_peak <= 0.95 * 256 * 2**20
    assert "python -m hchain_viz fit " in README
