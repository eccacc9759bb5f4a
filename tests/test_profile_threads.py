"""Profiling on a CPU that other programs share: no more torch threads than idle cores, torch's setting restored."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hchain_viz as hcv  # noqa: E402
import hchain_viz.runtime.profile as P  # noqa: E402

pytestmark = pytest.mark.torch


class Probe(torch.nn.Module):
    """A stage that records torch's thread count each time it runs."""

    def __init__(self, seen):
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(4, 4), seen

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        return self.lin(x)


@pytest.mark.parametrize("idle, used", [(1.0, 1), (0.2, 1), (2.0, 2), (None, None)])
def test_profiling_uses_the_idle_cores_and_restores_torchs_threads(monkeypatch, idle, used):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(P, "_idle_cores", lambda *a: idle)
        seen = []
        chain = hcv.profile(torch.nn.Sequential(Probe(seen), Probe(seen)), torch.randn(2, 4), warmup=0, repeats=1,
                            progress=False)
        assert chain.meta["threads"] == used
        assert seen.count(used or 2) >= 4  # the stages' timed and measured runs (tracing runs before, at 2)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)


def test_idle_cores_reads_the_machines_load():
    idle = P._idle_cores(0.05)
    if idle is None:
        pytest.skip("no /proc/stat here")
    import os

    assert 0.0 <= idle <= os.cpu_count() + 0.01
