"""torch.compile and hchain_viz: measuring and profiling leave compiled modules compiled (issue 11)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hchain_viz.errors import NotSequentialError  # noqa: E402
from hchain_viz.runtime.measure import measure  # noqa: E402
from hchain_viz.runtime.memtrack import AllocationTracker  # noqa: E402
from hchain_viz.runtime.profile import profile  # noqa: E402

pytestmark = pytest.mark.torch


class CountingBackend:
    """A Dynamo backend that runs the captured graph as it is and counts the calls of compiled graphs."""

    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1

        def run(*args: object) -> object:
            self.calls += 1
            return gm.forward(*args)

        return run


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_measure_and_profile_run_compiled_code_and_leave_it_compiled():
    backend = CountingBackend()
    model = mlp()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 32)
    compiled(x).sum().backward()
    assert backend.compiles == 1 and backend.calls == 1
    m = measure(compiled, x, repeats=2)
    assert backend.calls == 1 + 1 + 2 + 1  # warm-up, timed steps, memory step: every one ran the compiled graph
    assert m.peak_bytes > 0
    compiled(x)
    assert backend.calls == 6 and backend.compiles == 1
    fresh = torch.compile(mlp(), backend=backend)  # a newly compiled one runs compiled too (no skip mark)
    fresh(x)
    assert backend.calls == 7


def test_the_dispatch_mode_tracker_would_have_decompiled():
    # Why measuring no longer uses AllocationTracker: under a TorchDispatchMode Dynamo runs the code eager.
    backend = CountingBackend()
    compiled = torch.compile(mlp(), backend=backend)
    x = torch.randn(8, 32)
    compiled(x)
    with AllocationTracker():
        compiled(x)
    assert backend.calls == 1


_OS_PEAK = """
import sys, torch
from torch import nn
from hchain_viz.runtime.measure import measure
torch.set_num_threads(1)

def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
compiled = torch.compile(model, backend=sys.argv[1])
x = torch.randn(512, 256)
m = measure(compiled, x, repeats=1)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
before = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set (VmHWM)
out = compiled(x)
out.pow(2).mean().backward()
print(m.peak_bytes - m.input_bytes, rss("VmHWM") - before)
"""


def test_compiled_peak_agrees_with_the_operating_system():
    # The known answer: the process's own peak resident set over one step, in a fresh process where every block
    # of 64 KiB or more is its own mapping (returned to the OS when freed), so resident memory follows allocations.
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, "-c", _OS_PEAK, "aot_eager"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    logged, os_peak = map(int, run.stdout.split()[-2:])
    assert logged > 10 * 2**20
    assert abs(os_peak - logged) <= 0.01 * logged


def test_a_compiled_module_is_not_cut_into_stages():
    compiled = torch.compile(mlp(), backend=CountingBackend())
    with pytest.raises(NotSequentialError, match="compile=True"):
        profile(compiled, torch.randn(8, 32), progress=False)
