"""bench/gpu.py: the one command for a GPU machine, checked here without one.

- Without CUDA it stops at once with one line (issue #14: within 5 s).
- The developers' dry run (``--device cpu --quick``) runs every section end to end, in subprocesses that cannot import
  plotly, ipywidgets or anywidget (the GPU machine has none), and writes a report with every section.
- The runner keeps what a section wrote when it fails or runs past its time box; a missing package is one
  "skipped" line.
- The pipeline section's per-stage predictions (issue #42) are in the dry run's report.
- The mixed-precision section's training check (autocast bf16, fp16 with a GradScaler) runs on the CPU too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hchain_viz.bench import gpu

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("plotly", "ipywidgets", "anywidget")


def _env(extra_path: Path | None = None) -> dict[str, str]:
    paths = [str(p) for p in (extra_path, ROOT) if p is not None]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


@pytest.fixture(scope="module")
def no_widgets(tmp_path_factory) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import plotly`` (ipywidgets, anywidget) fail, in every process
    started with it (the section subprocesses inherit PYTHONPATH)."""
    folder = tmp_path_factory.mktemp("blocked")
    for name in BLOCKED:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError('No module named {name!r} (blocked: the GPU machine has none)', "
            f"name={name!r})\n")
    return folder


def test_without_cuda_it_stops_at_once_with_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run the whole benchmark")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hchain_viz", "bench", "gpu"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "--device cpu --quick" in lines[0], proc.stderr
    assert proc.stdout == ""
    assert seconds < 5, seconds


def test_require_cuda_asks_torch_when_a_device_node_exists(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(gpu.os.path, "exists", lambda p: True)  # as on a machine with an NVIDIA driver
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(gpu.HChainError, match=r"torch\.cuda\.is_available\(\) is False") as info:
        gpu.require_cuda()
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_dry_run_writes_every_section_without_plotly(tmp_path, no_widgets):
    check = subprocess.run([sys.executable, "-c", "import plotly"], env=_env(no_widgets), capture_output=True)
    assert check.returncode != 0  # the blocker works, so the run below really had no plotly
    out = tmp_path / "report" / "gpu-report.md"
    proc = subprocess.run([sys.executable, "-m", "hchain_viz", "bench", "gpu", "--device", "cpu", "--quick",
                           "--out", str(out)], cwd=tmp_path, env=_env(no_widgets), capture_output=True, text=True,
                          timeout=3000)  # about 30 s on a quiet machine; minutes on a shared one (the run caps itself)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    assert report in proc.stdout  # printed as well as written
    for title, _ in gpu.SECTIONS.values():
        assert f"\n## {title}\n" in report
    statuses = [line.split(" | ")[1] for line in report.split("\n## ")[0].splitlines()[-len(gpu.SECTIONS):]]
    assert not [s for s in statuses if s.startswith(("failed", "timed out", "not run"))], statuses
    assert "Dry run on the CPU" in report
    # environment
    assert "| torch |" in report and "| device | cpu (dry run" in report
    # pytest -m cuda: every CUDA test collected and skipped (no GPU), none failed
    assert "tests/test_wrap_cuda.py" in report
    counts = report.split("## `pytest -m cuda`")[1]
    assert "0 passed, 0 failed, 0 errors" in counts and " skipped**" in counts
    # fidelity: a row per point for each model (GPT-2 only where transformers imports)
    fidelity = report.split("## Profile fidelity")[1].split("\n## ")[0]
    models = ["resnet_chain", "nanogpt"] + (["gpt2"] if _imports("transformers") else [])
    for name in models:
        assert f"**{name}**" in fidelity
    assert fidelity.count("| store-all |") == len(models)
    assert fidelity.count("| optimal @ ") == len(models) * gpu.N_BUDGETS
    # the train comparison, through bench train's own code
    train = report.split("on CUDA: optimal vs")[2].split("\n## ")[0]
    assert "configuration" in train and "average throughput gain over checkpoint_sequential" in train
    # sub-layer and whole-step tables (a stale feature probe once wrote "not available" here, silently)
    for title in ("Sub-layer granularity", "Whole-step memory"):
        body = report.split(f"## {title}")[1].split("\n## ")[0]
        assert "| schedule |" in body and "not available" not in body
    # mixed precision: training fidelity under autocast bf16 and fp16 (GradScaler), then the fidelity table in each
    amp = report.split("## Mixed precision")[1].split("\n## ")[0]
    for dtype in ("bfloat16", "float16"):
        assert f"- training under autocast {dtype} (" in amp
    assert amp.count("losses equal") == 2 and "more than" not in amp
    assert amp.count("| store-all |") == 2 and "throughput gain over checkpoint_sequential" in amp
    # pipeline plans: per-stage predictions at P = 2 and 4, two limits each, beside both baselines
    pipe = report.split("## Pipeline plans")[1].split("\n## ")[0]
    assert "**P = 2**" in pipe and "**P = 4**" in pipe
    assert pipe.count("| least ") == 2 + 4 and pipe.count("| halfway ") == 2 + 4
    # the native form compiled whole, through bench compile's own code
    native = report.split("## torch.compile of the whole model")[1].split("\n## ")[0]
    assert "nanogpt native: vs torch.compile budget at equal measured memory" in native


def test_a_failing_or_hanging_section_keeps_what_it_wrote(tmp_path):
    part = tmp_path / "s.md"
    fail = (f"import pathlib; p = pathlib.Path({str(part)!r}); p.write_text('first model: done\\n'); "
            f"raise RuntimeError('second model broke')")
    status, body, _ = gpu.run_child([sys.executable, "-c", fail], part, box=60)
    assert status == "failed (exit code 1)"
    assert body.startswith("first model: done") and "RuntimeError: second model broke" in body

    hang = (f"import pathlib, time; pathlib.Path({str(part)!r}).write_text('row 1\\n'); time.sleep(60)")
    start = time.monotonic()
    status, body, _ = gpu.run_child([sys.executable, "-c", hang], part, box=3)
    assert time.monotonic() - start < 30
    assert status == "timed out after 3 s" and body.startswith("row 1") and "Time box reached" in body


def test_a_missing_package_is_one_skipped_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    ctx = gpu.Ctx(device="cpu", quick=True, deadline=time.monotonic() + 60, part=tmp_path / "p.md")
    ctx.part.write_text("")
    status, ratios = gpu.fidelity_model(ctx, "gpt2", gpu.FIDELITY_QUICK["gpt2"])
    assert status == "skipped" and ratios == []
    text = ctx.part.read_text().strip()
    assert text == "- gpt2: skipped: transformers is not installed (ModuleNotFoundError: import of transformers " \
                   "halted; None in sys.modules)"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_amp_training_compares_the_applied_schedule_with_plain_training(tmp_path, dtype):
    """The mixed-precision section's training check on the CPU: under autocast (float16 with a GradScaler) the
    applied schedule trains exactly as the plain model; a schedule that recomputes is what is compared."""
    torch = pytest.importorskip("torch")
    ctx = gpu.Ctx(device="cpu", quick=True, deadline=time.monotonic() + 300, part=tmp_path / "p.md")
    ctx.part.write_text("")
    assert gpu.amp_training(ctx, gpu.FIDELITY_QUICK["nanogpt"], getattr(torch, dtype)) == "ok"
    line = ctx.part.read_text().strip()
    assert line.startswith(f"- training under autocast {dtype} (") and "losses equal" in line
    assert "bitwise equal" in line and " (0 recomputed" not in line


def test_junit_counts_and_cuda_test_files(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite errors="0" failures="1" skipped="1" tests="4">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_ok2"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">trace</failure>'
        '</testcase><testcase classname="tests.test_a" name="test_skip"><skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    assert gpu.junit_counts(xml) == (2, 1, 0, 1, [("tests.test_a::test_bad", "failure", "assert 1 == 2")])
    files = [p.name for p in gpu.cuda_test_files(ROOT / "tests")]
    assert "test_wrap_cuda.py" in files and "test_bench_gpu.py" not in files
    assert all("ui" not in p.parts for p in gpu.cuda_test_files(ROOT / "tests"))


def _imports(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
