"""Benchmark ``gpu``: one command that checks every CUDA path and writes ``gpu-report.md``.

    PYTHONPATH=. python -m hchain_viz bench gpu              # from the repository root, on a machine with a GPU
    python -m hchain_viz bench gpu --device cpu --quick      # developers: a dry run of every section, tiny sizes

The report goes to ``--out``, else to ``$OUT/gpu-report.md`` when ``$OUT`` is set, else to ``./gpu-report.md``; it is
also printed at the end. Sections (``--sections``, in this order; what each measures: docs/gpu.md): ``env``,
``pytest``, ``fidelity``, ``train``, ``sublayer``, ``fixed``, ``amp``, ``pipeline``, ``native``.

Every section runs in its own process under a time box (``SECTIONS``): a hang, a CUDA error or a traceback in one is
written into the report and never loses the others, nor what the section finished in time. A section that needs a
missing package says "skipped: ..." in one line. ``--total`` bounds the whole run (default ``TOTAL_S``). Without CUDA
the command stops at once, with one line. The path imports no plotly, ipywidgets or anywidget (the GPU machine has
none).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DependencyError, HChainError

ROOT = Path(__file__).resolve().parents[2]  # the repository root (the folder holding hchain_viz/ and tests/)
REPORT = "gpu-report.md"
TOTAL_S = 580  # the whole run, in seconds: under the 10 minutes one device call may take, with room for start-up
QUICK_SLACK = 5  # --quick runs on shared CPUs, where everything may take several times longer: looser time boxes

# name -> (title, time box in seconds). The boxes add up to more than TOTAL_S: a section gets at most what is left.
SECTIONS: dict[str, tuple[str, int]] = {
    "env": ("Environment", 60),
    "pytest": ("`pytest -m cuda`", 150),
    "fidelity": ("Profile fidelity: predicted vs measured peak and step time", 150),
    "train": ("`bench train` on CUDA: optimal vs `checkpoint_sequential` at equal measured memory", 150),
    "sublayer": ("Sub-layer granularity (issue #10)", 150),
    "fixed": ("Whole-step memory: fixed part with the optimizer (issue #12)", 90),
    "amp": ("Mixed precision: autocast bfloat16, and float16 with a GradScaler (issue #39)", 120),
    "pipeline": ("Pipeline plans profiled on one GPU: predicted per-stage peaks (issue #42)", 45),
    # last: compiling takes minutes (on an H200: 68 s for compile's 3 knob graphs, 43 s to profile the compiled
    # stages of one form, about 18 s per candidate; two forms of two candidates each), so it gets what is left
    "native": ("torch.compile of the whole model with the schedule inside (issue #22)", 260),
}

# Goals of issue #14 (measured / predicted).
PEAK_GOAL = (0.95, 1.0)
TIME_GOAL = (0.85, 1.15)
FIXED_GOAL = (0.95, 1.05)  # whole-step device peak: within 5% (issue #12)

# Model sizes. On the GPU, activations of hundreds of MiB (store-all peak); --quick: tiny, for a CPU dry run.
FIDELITY_SIZES: dict[str, dict[str, Any]] = {
    "resnet_chain": dict(batch=32, image=128, width=16),
    "nanogpt": dict(batch=4, seq=512, vocab=4096, dim=384, heads=6, layers=6),
    "gpt2": dict(batch=4, seq=512, vocab=8192, dim=384, heads=6, layers=6),
}
FIDELITY_QUICK: dict[str, dict[str, Any]] = {
    "resnet_chain": dict(batch=2, image=16, width=4, blocks=(1, 1)),
    "nanogpt": dict(batch=2, seq=16, vocab=64, dim=32, heads=2, layers=2),
    "gpt2": dict(batch=2, seq=16, vocab=64, dim=32, heads=2, layers=2),
}
NATIVE_SIZE = dict(batch=8, seq=512, dim=384, heads=6, layers=6, vocab=4096)  # nanoGPT; --quick: bench compile's SMALL
TRAIN_SIZES: dict[str, dict[str, Any]] = {
    "resnet_chain": dict(batch=32, image=128, width=16),
    "transformer_chain": dict(batch=16, seq=256, dim=256, heads=4, layers=6, vocab=2048),
    "mlp_chain": dict(batch=8192),
}
TRAIN_QUICK: dict[str, dict[str, Any]] = {  # one model: the dry run checks the plumbing, not the figures
    "resnet_chain": dict(batch=2, image=16, width=4, blocks=(1, 1)),
}
N_BUDGETS = 4  # optimal budgets per model, evenly spaced from the least feasible one up to (not at) store-all


# ---------------------------------------------------------------------------------------------- the command
def run(args: list[str]) -> None:
    """Run every section (each in a subprocess, time-boxed) and write the report; or, with the internal
    ``--section``, run one section in this process."""
    parser = argparse.ArgumentParser(prog="hchain_viz bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu only for a developers' dry run, with --quick")
    parser.add_argument("--quick", action="store_true", help="tiny models and few repeats (a dry run of the "
                                                             "machinery: the figures mean nothing)")
    parser.add_argument("--out", default=None, help=f"report file (default: $OUT/{REPORT}, else ./{REPORT})")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from: "
                                                                       + ", ".join(SECTIONS))
    parser.add_argument("--total", type=float, default=None, help=f"seconds for the whole run (default: {TOTAL_S}; "
                                                                  f"with --quick, {QUICK_SLACK}x that: a dry run on a "
                                                                  f"shared CPU may crawl)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section here
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: where that section writes
    parser.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)  # internal: its soft limit
    opts = parser.parse_args(args)
    if opts.total is None:
        opts.total = TOTAL_S * (QUICK_SLACK if opts.quick else 1)
    if opts.section is not None:
        _child(opts)
        return
    names = [n.strip() for n in opts.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise HChainError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if opts.device == "cuda":
        require_cuda()
    out = Path(opts.out) if opts.out else Path(os.environ.get("OUT") or ".") / REPORT
    report = _Report(out, opts)
    bad = report.run(names)
    print(report.text())
    print(f"wrote {out}")
    if bad:
        raise HChainError(f"{len(bad)} section(s) did not finish cleanly ({', '.join(bad)}); see {out}")


def require_cuda() -> None:
    """Raise a one-line HChainError when no CUDA GPU is usable, fast: on Linux without an NVIDIA device node,
    before importing torch at all."""
    hint = "developers can dry-run every section on the CPU with: python -m hchain_viz bench gpu --device cpu --quick"
    nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/proc/driver/nvidia")  # /dev/dxg: CUDA on WSL2
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in nodes):
        raise HChainError(f"bench gpu needs a CUDA GPU and this machine has none (no NVIDIA device in /dev); {hint}")
    try:
        import torch
    except ImportError as e:
        raise DependencyError(f"bench gpu needs torch with CUDA ({type(e).__name__}: {e}); {hint}") from None
    if not torch.cuda.is_available():
        raise HChainError(f"bench gpu needs a CUDA GPU and torch {torch.__version__} sees none "
                          f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda or 'none'}); {hint}")


class _Report:
    """The report: a head, a summary table and one part per section, rewritten to disk after every section (a run
    killed from outside still leaves every finished section)."""

    def __init__(self, path: Path, opts: argparse.Namespace):
        self.path, self.opts = path, opts
        self.started = time.monotonic()
        self.when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.parts: list[tuple[str, str, str, float]] = []  # (name, status, body, seconds)

    def run(self, names: list[str]) -> list[str]:
        """Run the sections in order within the total time; returns the names of those that failed or timed out."""
        deadline = self.started + self.opts.total
        bad = []
        with tempfile.TemporaryDirectory(prefix="hcv-gpu-") as tmp:
            for name in names:
                box = min(SECTIONS[name][1] * (QUICK_SLACK if self.opts.quick else 1), deadline - time.monotonic())
                if box < 10:
                    status, seconds = "not run", 0.0
                    body = f"not run: the whole run's {self.opts.total:.0f} s were spent"
                else:
                    print(f"[bench gpu] {name}: running (at most {box:.0f} s) ...", flush=True)
                    cmd = [sys.executable, "-m", "hchain_viz", "bench", "gpu", "--section", name, "--device",
                           self.opts.device, "--part", str(Path(tmp) / f"{name}.md"),
                           "--seconds", f"{max(5.0, box - 15):.0f}"] + (["--quick"] if self.opts.quick else [])
                    status, body, seconds = run_child(cmd, Path(tmp) / f"{name}.md", box)
                if status.startswith(("failed", "timed out")):
                    bad.append(name)
                print(f"[bench gpu] {name}: {status} ({seconds:.0f} s)", flush=True)
                self.parts.append((name, status, body, seconds))
                self.write()
        return bad

    def text(self) -> str:
        total = time.monotonic() - self.started
        dry = (" **Dry run on the CPU with tiny models (`--device cpu --quick`): the figures say nothing about a "
               "GPU.**" if self.opts.device == "cpu" else "")
        lines = [
            "# hchain_viz GPU report",
            "",
            f"`{' '.join(['PYTHONPATH=. python -m hchain_viz bench gpu', *_shown_args(self.opts)])}` — "
            f"{self.when}, {total:.0f} s in all.{dry}",
            "",
            f"Goals: measured/predicted activation peak in [{PEAK_GOAL[0]}, {PEAK_GOAL[1]}], measured/predicted step "
            f"time in [{TIME_GOAL[0]}, {TIME_GOAL[1]}].",
            "",
            md_table(("section", "status", "seconds"),
                     [(SECTIONS[n][0], s, f"{t:.0f}") for n, s, _, t in self.parts]),
        ]
        for name, _, body, _ in self.parts:
            lines += ["", f"## {SECTIONS[name][0]}", "", body.strip()]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.text())


def _shown_args(opts: argparse.Namespace) -> list[str]:
    shown = []
    if opts.device != "cuda":
        shown += ["--device", opts.device]
    if opts.quick:
        shown.append("--quick")
    if opts.sections != ",".join(SECTIONS):
        shown += ["--sections", opts.sections]
    return shown


def run_child(cmd: Sequence[str], part: Path, box: float) -> tuple[str, str, float]:
    """Run one section's process for at most ``box`` seconds; return (status, markdown body, seconds).

    The body is what the section wrote to ``part`` (kept when it is stopped), followed by the end of its output
    when it failed or timed out. Its status is the one it wrote to ``part.status``, or "failed (exit code N)" /
    "timed out after N s"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    status_file = Path(f"{part}.status")
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=os.name == "posix")  # its own group: a timeout ends its children
        try:
            rc = proc.wait(timeout=box)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, timed_out = proc.wait(), True
        seconds = time.monotonic() - start
        log.seek(0)
        output = log.read()
    body = part.read_text() if part.exists() else ""
    status = status_file.read_text().strip() if status_file.exists() else ""
    if timed_out:
        status = f"timed out after {box:.0f} s"
        body += (f"\n\n**Time box reached**: the section was stopped after {box:.0f} s; what it finished is above."
                 + _tail(output))
    elif rc != 0 or not status:
        status = f"failed (exit code {rc})"
        body += f"\n\n**The section failed** (exit code {rc}); the end of its output:" + _tail(output)
    return status, body, seconds


def _kill(proc: subprocess.Popen) -> None:
    """End the section's process and everything it started (its own process group)."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _tail(output: str, lines: int = 30) -> str:
    kept = output.strip().splitlines()[-lines:]
    return "\n\n```\n" + "\n".join(kept) + "\n```" if kept else " (no output)"


# ---------------------------------------------------------------------------------------------- one section
@dataclass
class Ctx:
    """What a section gets: the device, whether sizes are tiny, its soft deadline and where it writes."""

    device: str
    quick: bool
    deadline: float  # time.monotonic() after which no new measurement starts
    part: Path

    def write(self, text: str = "") -> None:
        """Append ``text`` (and a newline) to the section's markdown, at once (a stopped section keeps it)."""
        with open(self.part, "a") as f:
            f.write(text + "\n")

    def code(self, text: str) -> None:
        self.write("```\n" + text.rstrip() + "\n```")

    def table(self, head: Sequence[object], rows: Sequence[Sequence[object]]) -> None:
        self.write(md_table(head, rows))

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def failure(self, what: str, e: BaseException) -> str:
        """Write one line for a failure (a missing package: "skipped"), with the traceback for a real error;
        returns the line's status word."""
        missing = _missing_package(e)
        if missing:
            self.write(f"- {what}: skipped: {missing}")
            return "skipped"
        self.write(f"- {what}: **failed**: {type(e).__name__}: {_first_line(e)}")
        self.code("".join(traceback.format_exception(type(e), e, e.__traceback__)[-12:]))
        return "failed"


def _child(opts: argparse.Namespace) -> None:
    part = Path(opts.part)
    part.write_text("")
    ctx = Ctx(device=opts.device, quick=opts.quick, deadline=time.monotonic() + opts.seconds, part=part)
    warnings.simplefilter("ignore")  # library warnings (deprecations, HF notices) would drown the report
    try:
        status = RUNNERS[opts.section](ctx)
    except Exception as e:  # the section as a whole: report it and let the parent carry on
        status = ctx.failure("the section", e)
        status = "skipped" if status == "skipped" else f"failed: {type(e).__name__}"
    Path(f"{part}.status").write_text(status)


def _missing_package(e: BaseException) -> str | None:
    """A message for an exception that means "a package is missing" (ImportError, our DependencyError)."""
    if isinstance(e, ModuleNotFoundError):
        return f"{e.name or 'a package'} is not installed ({type(e).__name__}: {_first_line(e)})"
    if isinstance(e, (ImportError, DependencyError)):
        return f"{type(e).__name__}: {_first_line(e)}"
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]


def md_table(head: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (pipes in cells escaped)."""
    def row(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([row(head), "|" + "---|" * len(head), *(row(r) for r in rows)])


# ---------------------------------------------------------------------------------------------- env
def section_env(ctx: Ctx) -> str:
    import platform
    from importlib import metadata

    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("CUDA (torch build)", torch.version.cuda or "none")]
    if ctx.device == "cuda":
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        free, total = torch.cuda.mem_get_info(dev)
        rows += [("GPU", f"{props.name} (compute capability {props.major}.{props.minor}, "
                         f"{props.multi_processor_count} SMs)"),
                 ("GPU memory", f"{_gib(props.total_memory)} total, {_gib(free)} free at start"),
                 ("GPUs visible", str(torch.cuda.device_count())),
                 ("cuDNN", str(torch.backends.cudnn.version()))]
        smi = _nvidia_smi()
        if smi:
            rows.append(("nvidia-smi", smi))
    else:
        rows.append(("device", "cpu (dry run: no GPU figures)"))
    for pkg in ("numpy", "numba", "tqdm", "transformers", "torchvision", "timm", "pytest", "hypothesis"):
        try:
            rows.append((pkg, metadata.version(pkg)))
        except metadata.PackageNotFoundError:
            rows.append((pkg, "not installed"))
    rows.append(("hchain_viz commit", _git_commit()))
    ctx.table(("what", "value"), rows)
    return "ok"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _nvidia_smi() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if out.returncode != 0 or not out.stdout.strip():
        return "unknown (not a git checkout)"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip()[:100] + (" (the files differ from it: changes not committed)" if dirty else "")


# ---------------------------------------------------------------------------------------------- pytest -m cuda
def section_pytest(ctx: Ctx) -> str:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        ctx.write("skipped: pytest is not installed")
        return "skipped"
    files = cuda_test_files(ROOT / "tests")
    if not files:
        ctx.write(f"skipped: no test file under {ROOT / 'tests'} has a test marked `cuda`")
        return "skipped"
    junit = ctx.part.with_suffix(".junit.xml")
    # Only the files with CUDA tests: collecting the others would import plotly and ipywidgets, which a GPU machine
    # may lack. -p no:cacheprovider: write nothing into the working tree.
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *(str(f.relative_to(ROOT)) for f in files)]
    ctx.write(f"`{' '.join(['python', *cmd[1:-len(files)]]).replace(str(junit), 'report.xml')} "
              f"{' '.join(str(f.relative_to(ROOT)) for f in files)}`")
    ctx.write()
    limit = max(5.0, ctx.deadline - time.monotonic())
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=os.name == "posix")
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        ctx.write(f"**timed out** after {limit:.0f} s; the end of its output:")
        ctx.code("\n".join(output.strip().splitlines()[-30:]))
        return f"timed out after {limit:.0f} s"
    seconds = time.monotonic() - start
    counts = junit_counts(junit) if junit.exists() else None
    if counts is None:
        ctx.write(f"pytest exited with code {proc.returncode} without a result file; the end of its output:")
        ctx.code("\n".join(output.strip().splitlines()[-30:]))
        return f"failed: pytest exit code {proc.returncode}"
    passed, failed, errors, skipped, problems = counts
    ctx.write(f"**{passed} passed, {failed} failed, {errors} errors, {skipped} skipped** in {seconds:.0f} s "
              f"(pytest exit code {proc.returncode}).")
    if problems:
        ctx.write()
        ctx.table(("test", "outcome", "message"), problems)
    summary = [ln for ln in output.splitlines() if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    if summary:
        ctx.write()
        ctx.code("\n".join(summary[:40]))
    return f"{passed} passed, {failed} failed, {errors} errors, {skipped} skipped"


def cuda_test_files(tests: Path) -> list[Path]:
    """Test files (outside tests/ui, whose browser fixtures a GPU machine lacks) that mark a test ``cuda``."""
    if not tests.is_dir():
        return []
    return sorted(p for p in tests.rglob("test_*.py")
                  if "ui" not in p.relative_to(tests).parts[:-1] and "mark.cuda" in p.read_text(errors="replace"))


def junit_counts(path: Path) -> tuple[int, int, int, int, list[tuple[str, str, str]]] | None:
    """(passed, failed, errors, skipped, [(test, outcome, message)] for failures and errors) from a JUnit XML file."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    failed = errors = skipped = total = 0
    problems = []
    for case in root.iter("testcase"):
        total += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                problems.append((name, kind, (el.get("message") or "").splitlines()[0][:200] if el.get("message")
                                 else ""))
        if case.find("failure") is not None:
            failed += 1
        elif case.find("error") is not None:
            errors += 1
        elif case.find("skipped") is not None:
            skipped += 1
    # Errors outside test cases (collection) are counted on the suite, not as test cases.
    suite_errors = sum(int(s.get("errors", 0)) for s in root.iter("testsuite"))
    errors = max(errors, suite_errors)
    return total - failed - skipped - min(errors, total - failed - skipped), failed, errors, skipped, problems


# ---------------------------------------------------------------------------------------------- fidelity
def section_fidelity(ctx: Ctx) -> str:
    sizes = FIDELITY_QUICK if ctx.quick else FIDELITY_SIZES
    ctx.write("Measured peak = x_0 + (`torch.cuda.max_memory_allocated` − `memory_allocated` before the step), as "
              "`hcv.measure` reports it; the simulator counts x_0 too. Step times: CUDA events, median of the "
              "timed steps. `eager` is the plain model against the store-all prediction; the other rows run "
              "`hcv.wrap(model, schedule)`." if ctx.device == "cuda" else
              "CPU dry run: peaks from the allocation tracker, times from `perf_counter`.")
    results = [fidelity_model(ctx, name, sizes[name]) for name in sizes]
    return _summary(results)


def fidelity_model(ctx: Ctx, name: str, size: dict[str, Any], granularity: Any = None, optimizer: str | None = None,
                   compare: bool = False) -> tuple[str, list]:
    """Profile model ``name`` at ``size`` (and ``granularity``), then measure eager, store-all and N_BUDGETS optimal
    schedules; write a table; return (status word, [(peak ratio, time ratio or None)] of the measured points).

    ``optimizer`` ("adamw"): the whole step (docs/design.md §7): profile and measure with that optimizer and compare
    ``device_peak`` (fixed part + activations), predicted vs measured. ``compare``: also the throughput gain over
    ``checkpoint_sequential`` on the same stages at equal measured memory (``bench models``' comparison)."""
    from torch import nn

    from ..core import strategies
    from ..core.device import device_peak
    from ..core.simulate import simulate
    from ..core.solver import solve
    from ..core.units import format_bytes, format_time
    from ..runtime.fixed import make_optimizer
    from ..runtime.measure import measure
    from ..runtime.profile import profile
    from ..runtime.train.wrap import wrap

    label = f"{name}" + (f" (granularity={granularity!r})" if granularity is not None else "") + \
        (f" with {optimizer}" if optimizer else "")
    ctx.write()
    if ctx.expired():
        ctx.write(f"- {label}: not run (the section's time box was spent)")
        return "not run", []
    try:
        stages, x, loss_fn, shape = build_stages(name, size, ctx.device, granularity)
        seq = nn.Sequential(*[m for _, m in stages])
        extra = {"optimizer": make_optimizer(optimizer, seq.parameters())} if optimizer else {}
        t0 = time.perf_counter()
        chain = profile(stages, x, loss_fn, progress=False, warmup=0 if ctx.quick else 2,
                        repeats=1 if ctx.quick else 5, **extra)
        t_profile = time.perf_counter() - t0
        sol = solve(chain)
    except Exception as e:
        return ctx.failure(label, e), []
    lo, hi = sol.min_budget, sol.store_all_peak
    ctx.write(f"**{label}**, input {shape}: {chain.length} stages, profiled in {t_profile:.1f} s; store-all peak "
              f"{format_bytes(hi)}, least feasible budget {format_bytes(lo)}"
              + (f"; fixed part {chain.fixed.describe()}" if optimizer else "") + ".")
    ctx.write()
    store = strategies.store_all(chain)
    points: list[tuple[str, Any, Any]] = [("eager (plain model)", None, simulate(chain, store)),
                                          ("store-all", store, simulate(chain, store))]
    for k in range(N_BUDGETS):
        budget = lo + (hi - lo) * k // N_BUDGETS
        schedule = sol.schedule(budget)
        points.append((f"optimal @ {format_bytes(budget)}", schedule, simulate(chain, schedule)))
    goal = FIXED_GOAL if optimizer else PEAK_GOAL
    rows, ratios, status = [], [], "ok"
    for point, schedule, trace in points:
        pred = device_peak(trace) if optimizer else trace.peak_memory
        if ctx.expired():
            rows.append((point, "", format_bytes(pred), "not run (time box)", "", "", "", "", ""))
            status = "partial"
            continue
        try:
            module = seq if schedule is None else wrap(seq, schedule)
            m = measure(module, x, loss_fn, repeats=1 if ctx.quick else 5, **extra)
        except Exception as e:
            missing = _missing_package(e)
            rows.append((point, "", format_bytes(pred), f"skipped: {missing}" if missing else
                         f"failed: {type(e).__name__}: {_first_line(e)[:120]}", "", "", "", "", ""))
            status = "partial"
            continue
        finally:
            _free(ctx.device)
        meas = m.device_peak if optimizer else m.peak_bytes
        rp, rt = meas / pred, m.step_time / trace.makespan
        ratios.append((rp, None if optimizer else rt))  # with an optimizer the step also runs optimizer.step()
        verdict = ", ".join(w for w, bad in (("peak off", not _within(rp, goal)),
                                             ("time off", not optimizer and not _within(rt, TIME_GOAL))) if bad)
        rows.append((point, str(trace.n_recomputed), format_bytes(pred), format_bytes(meas), f"{rp:.3f}",
                     format_time(trace.makespan), format_time(m.step_time), f"{rt:.3f}", verdict or "ok"))
    peak = "device peak" if optimizer else "peak"
    ctx.table(("schedule", "recomputed fwds", f"pred {peak}", f"meas {peak}", "meas/pred", "pred step",
               "meas step" + (" (with optimizer)" if optimizer else ""), "meas/pred", "goals"), rows)
    if compare:
        status = _compare(ctx, stages, x, loss_fn, status)
    del seq, stages, x, chain, sol
    _free(ctx.device)
    return status, ratios


def _compare(ctx: Ctx, stages: list, x: Any, loss_fn: Callable, status: str) -> str:
    """The gain of the optimal schedule over checkpoint_sequential(n) on these stages at equal measured memory, by
    ``bench models``' own comparison; one line."""
    import statistics
    from types import SimpleNamespace

    from .models import optimal_gains

    if ctx.expired():
        ctx.write("\n- comparison with checkpoint_sequential: not run (the section's time box was spent)")
        return "partial"
    try:
        gains, efficient, n = optimal_gains(stages, x, loss_fn, SimpleNamespace(rounds=1 if ctx.quick else 5,
                                                                                budgets=N_BUDGETS))
    except Exception as e:
        ctx.write()
        ctx.failure("comparison with checkpoint_sequential", e)
        return "partial"
    finally:
        _free(ctx.device)
    kept = [g for g, e in zip(gains, efficient) if e]  # Pareto-efficient segment counts only, as bench models
    text = (f"average {100 * statistics.mean(kept):+.1f}%, best {100 * max(kept):+.1f}% over the {len(kept)} "
            f"Pareto-efficient segment counts (all {len(gains)} matched counts: "
            f"{100 * statistics.mean(gains):+.1f}%)" if kept else
            "no Pareto-efficient checkpoint_sequential point is matched by an optimal schedule at or below its "
            "measured peak")
    ctx.write(f"\n- throughput gain over checkpoint_sequential at equal measured memory (`bench models`' "
              f"comparison; {len(gains)} of {n} segment counts matched): {text}")
    return status


def build_stages(name: str, size: dict[str, Any], device: str, granularity: Any = None
                 ) -> tuple[list[tuple[str, Any]], Any, Callable, str]:
    """(stages, input, loss_fn, input shape) of a demo model or of Hugging Face GPT-2 (``gpt2``, from a config)."""
    from ..runtime import models
    from ..runtime.stages import sequentialize

    if name == "gpt2":
        model, x, loss_fn = gpt2(device=device, **size)
        shape = f"{size['batch']}x{size['seq']} tokens (dict with attention_mask)"
    else:
        model, x, loss_fn = models.demo_model(name, device=device, **size)
        shape = "x".join(map(str, x.shape)) + (" tokens" if not x.is_floating_point() else "")
    model.train()
    stages = sequentialize(model, x) if granularity is None else sequentialize(model, x, granularity=granularity)
    return stages, x, loss_fn, shape


def gpt2(*, batch: int, seq: int, vocab: int, dim: int, heads: int, layers: int, device: str,
         seed: int = 0) -> tuple[Any, dict, Callable]:
    """Hugging Face ``GPT2LMHeadModel`` built from a config (random weights, no download), with a dict input
    (``input_ids``, ``attention_mask``) and next-token cross-entropy on random targets."""
    import torch
    import transformers

    from .models import cross_entropy

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.GPT2LMHeadModel(config)
        ids, target = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    model = model.to(device)
    ids, target = ids.to(device), target.to(device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cross_entropy(target)


def _within(r: float, goal: tuple[float, float]) -> bool:
    return goal[0] <= r <= goal[1]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _summary(results: list[tuple[str, list]], goal: tuple[float, float] = PEAK_GOAL) -> str:
    """A section's status from its models' (status, ratios): how many points meet the goals."""
    ratios = [r for _, rs in results for r in rs]
    words = [s for s, _ in results]
    if ratios:
        peaks, times = [rp for rp, _ in ratios], [rt for _, rt in ratios if rt is not None]
        text = (f"peak goal met at {sum(_within(r, goal) for r in peaks)}/{len(peaks)} points (meas/pred "
                f"{min(peaks):.3f}–{max(peaks):.3f})")
        if times:
            text += (f", time goal at {sum(_within(t, TIME_GOAL) for t in times)}/{len(times)} "
                     f"({min(times):.3f}–{max(times):.3f})")
    else:
        text = "no point measured"
    bad = [w for w in words if w != "ok"]
    return text + (f"; {len(bad)} of {len(words)} models {'/'.join(sorted(set(bad)))}" if bad else "")


# ---------------------------------------------------------------------------------------------- train
def section_train(ctx: Ctx) -> str:
    from . import train

    sizes = TRAIN_QUICK if ctx.quick else TRAIN_SIZES
    ctx.write(f"The output of `python -m hchain_viz bench train --device {ctx.device}`, one model per run at the "
              f"sizes below (its \"all models\" line left out). "
              + ("Step times: CUDA events, median of interleaved rounds; peaks: allocator statistics."
                 if ctx.device == "cuda" else ""))
    words = []
    for name, size in sizes.items():
        ctx.write()
        ctx.write(f"**{name}** ({', '.join(f'{k}={v}' for k, v in size.items())})")
        ctx.write()
        if ctx.expired():
            ctx.write(f"- {name}: not run (the section's time box was spent)")
            words.append("not run")
            continue
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                train.run(["--models", name, "--rounds", "1" if ctx.quick else "7", "--device", ctx.device],
                          sizes={name: size})
        except Exception as e:
            if buf.getvalue().strip():
                ctx.code(buf.getvalue())
            words.append(ctx.failure(name, e))
            continue
        finally:
            _free(ctx.device)
        ctx.code("\n".join(ln for ln in buf.getvalue().splitlines() if not ln.startswith("all models:")))
        words.append("ok")
        lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith(f"{name}: average")]
        if lines:
            ctx.write(f"- {lines[0]}")
    bad = [w for w in words if w != "ok"]
    return "ok" if not bad else f"{len(words) - len(bad)}/{len(words)} models ok ({', '.join(sorted(set(bad)))})"


# ---------------------------------------------------------------------------------------------- sub-layer (#10)
def section_sublayer(ctx: Ctx) -> str:
    sizes = FIDELITY_QUICK if ctx.quick else FIDELITY_SIZES
    results = [fidelity_model(ctx, name, sizes[name], "sublayer", compare=True) for name in ("nanogpt", "gpt2")]
    return _summary(results)


# ---------------------------------------------------------------------------------------------- fixed memory (#12)
def section_fixed(ctx: Ctx) -> str:
    sizes = FIDELITY_QUICK if ctx.quick else FIDELITY_SIZES
    ctx.write("Profiled and measured with the optimizer: the predicted `device_peak` (fixed part + activations, "
              "design.md §7) against the measured one (forward, backward, `optimizer.step()`, `zero_grad()`); goal "
              f"within 5% ([{FIXED_GOAL[0]}, {FIXED_GOAL[1]}]).")
    results = [fidelity_model(ctx, name, sizes[name], optimizer="adamw") for name in ("resnet_chain", "nanogpt")]
    return _summary(results, FIXED_GOAL)


# ---------------------------------------------------------------------------------------------- mixed precision (#39)
AMP_STEPS = 3  # training steps compared, plain against applied


def section_amp(ctx: Ctx) -> str:
    """nanoGPT in mixed precision: fidelity of training (losses and gradients of the applied schedule against plain
    training in the same precision) and of the profile (the fidelity table under that autocast)."""
    import torch

    size = (FIDELITY_QUICK if ctx.quick else FIDELITY_SIZES)["nanogpt"]
    ctx.write(f"nanoGPT profiled, solved and trained under `torch.autocast({ctx.device!r}, dtype=...)` with float32 "
              f"weights, as `Trainer(bf16=True)` / `Trainer(fp16=True)` train (docs/design.md §11). Training: "
              f"{AMP_STEPS} SGD steps of the plain model and of `hcv.wrap(model, schedule)` at the least feasible "
              f"budget, from the same weights and seed; float16 scales the loss with `torch.amp.GradScaler` and the "
              f"gradients are compared unscaled. The fidelity table measures under the same autocast (the scaler "
              f"only multiplies the loss, so its memory and time are those of the step without it).")
    words = []
    for dtype, compare in ((torch.bfloat16, True), (torch.float16, False)):
        name = f"autocast {str(dtype).removeprefix('torch.')}"
        ctx.write()
        ctx.write(f"### {name}" + (" with a GradScaler" if dtype == torch.float16 else ""))
        if ctx.device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            ctx.write(f"- {name}: skipped: this GPU has no bfloat16")
            words.append("skipped")
            continue
        words.append(amp_training(ctx, size, dtype))
        with torch.autocast(ctx.device, dtype=dtype):
            status, ratios = fidelity_model(ctx, "nanogpt", size, compare=compare)
        words.append(status)
        if ratios:
            ctx.write(f"\n- {name}: {_summary([(status, ratios)])}")
    bad = [w for w in words if w != "ok"]
    return "ok" if not bad else f"{len(words) - len(bad)}/{len(words)} parts ok ({', '.join(sorted(set(bad)))})"


def amp_training(ctx: Ctx, size: dict[str, Any], dtype: Any) -> str:
    """Train nanoGPT plain and applied at the least feasible budget for AMP_STEPS steps under autocast ``dtype``
    (float16: with a GradScaler); write one line comparing losses and gradients; return the status word."""
    import copy

    import torch
    from torch import nn

    from ..core.solver import solve
    from ..runtime.profile import profile
    from ..runtime.train.wrap import wrap

    label = f"training under autocast {str(dtype).removeprefix('torch.')}"
    if ctx.expired():
        ctx.write(f"- {label}: not run (the section's time box was spent)")
        return "not run"
    try:
        stages, x, loss_fn, _ = build_stages("nanogpt", size, ctx.device)
        seq = nn.Sequential(*[m for _, m in stages])
        with torch.autocast(ctx.device, dtype=dtype):
            chain = profile(stages, x, loss_fn, progress=False, warmup=0 if ctx.quick else 1, repeats=1)
        sol = solve(chain)
        schedule = sol.schedule(sol.min_budget)
        runs = [_amp_steps(m, m if k == 0 else wrap(m, schedule), x, loss_fn, ctx.device, dtype)
                for k, m in enumerate((copy.deepcopy(seq), copy.deepcopy(seq)))]
    except Exception as e:
        return ctx.failure(label, e)
    finally:
        _free(ctx.device)
    (plain_losses, plain_grads), (losses, grads) = runs
    same_losses = all(a == b for a, b in zip(plain_losses, losses))
    scale = max(g.abs().max().item() for g in plain_grads) or 1.0
    diff = max((a - b).abs().max().item() for a, b in zip(plain_grads, grads)) / scale
    exact = same_losses and diff == 0
    # recomputed kernels may sum in another order on a GPU: allow one unit in the last place of the precision
    ok = exact or diff <= torch.finfo(dtype).eps
    ctx.write(f"- {label} ({schedule.n_recomputed} recomputed forwards): losses "
              f"{'equal' if same_losses else 'differ'} "
              f"({', '.join(f'{v:.6g}' for v in plain_losses)}), gradients "
              + ("bitwise equal" if diff == 0 else f"max |Δ| {diff:.2e} of the largest")
              + ("" if ok else f" — **more than float{torch.finfo(dtype).bits}'s eps**"))
    return "ok" if ok else "failed"


def _amp_steps(params_of: Any, module: Any, x: Any, loss_fn: Callable, device: str,
               dtype: Any) -> tuple[list[float], list[Any]]:
    """AMP_STEPS SGD steps of ``module`` under autocast ``dtype`` (float16: with a GradScaler) from seed 0; the
    losses and, over all steps, the unscaled gradients of ``params_of``'s parameters, concatenated per step."""
    import torch

    params = list(params_of.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
    torch.manual_seed(0)
    losses, grads = [], []
    for _ in range(AMP_STEPS):
        with torch.autocast(device, dtype=dtype):
            loss = loss_fn(module(x))
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in params if p.grad is not None]))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return losses, grads


# ---------------------------------------------------------------------------------------------- native (#22)
def section_native(ctx: Ctx) -> str:
    """``bench compile --native`` on this device: the schedule as checkpoint regions, the whole model compiled by
    inductor, against torch.compile's activation_memory_budget at equal measured memory."""
    from . import compile as bench_compile

    if ctx.quick:
        args = ["--small", "--budgets", "1.0", "--candidates", "1"]  # one knob graph: each compiles for ~20 s on a CPU
    else:
        # two knob budgets: each knob graph took 23 s to compile on an H200, and the section gets what is left
        args = ["--threads", "0", "--budgets", "1.0,0.5", "--candidates", "2", "--rounds", "7"]
        args += [f"--set=nanogpt.{k}={v}" for k, v in NATIVE_SIZE.items()]
    ctx.write("`python -m hchain_viz bench compile --native` on this device (docs/compile.md): the single-level "
              "optimum applied as checkpoint regions and the whole model compiled by inductor, against "
              "`torch.compile`'s `activation_memory_budget`; per knob budget, the fastest candidate whose measured "
              "peak is at most the knob's; speedups are medians of same-round ratios.")
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            bench_compile.run(["--native", "--device", ctx.device, "--models", "nanogpt", *args])
    except Exception as e:
        if buf.getvalue().strip():
            ctx.code(buf.getvalue())
        return ctx.failure("nanogpt", e)
    finally:
        _free(ctx.device)
    ctx.code(buf.getvalue())
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("nanogpt native:")]
    return lines[0].split(": ", 1)[1] if lines else "ok"


# ---------------------------------------------------------------------------------------------- pipeline (#42)
PIPELINE_SIZE = dict(batch=4, seq=512, dim=384, heads=6, layers=8, vocab=4096)  # per microbatch
PIPELINE_QUICK = dict(batch=2, seq=16, dim=32, heads=2, layers=4, vocab=64)
PIPELINE_M = 8  # microbatches per step


def section_pipeline(ctx: Ctx) -> str:
    """Per-stage predictions of pipeline plans for a chain profiled on this device (docs/design.md §12)."""
    import torch

    from ..core.pipeline import Pipeline
    from ..core.units import format_bytes, format_time
    from ..runtime.models import transformer_chain
    from ..runtime.profile import profile

    size = PIPELINE_QUICK if ctx.quick else PIPELINE_SIZE
    model, x, loss_fn = transformer_chain(**size, dropout=0.0, device=ctx.device)
    chain = profile(model, x, loss_fn, optimizer=torch.optim.AdamW(model.parameters()), warmup=1 - ctx.quick,
                    repeats=1 if ctx.quick else 3, progress=False)
    del model, x, loss_fn
    _free(ctx.device)
    ctx.write(f"transformer_chain({size}) profiled on {ctx.device} with AdamW, one microbatch; M = {PIPELINE_M}, "
              f"1F1B. Predictions only (one device): peak = fixed + in flight + working per stage.")
    for P in (2, 4):
        if ctx.expired():
            ctx.write(f"- P = {P}: not run (time box)")
            return "partial"
        pipe = Pipeline(chain, P)
        least = pipe.least_memory(PIPELINE_M)
        top = pipe.plan(PIPELINE_M, 2**60).peak
        rows = []
        for name, limit in (("least", least), ("halfway", (least + top) // 2)):
            plan = pipe.plan(PIPELINE_M, limit)
            base = {k: v.step_time if v else None for k, v in pipe.baselines(PIPELINE_M, limit).items()}
            for s, st in enumerate(plan.stages):
                rows.append((f"{name} {format_bytes(limit)}", s, f"{chain.names[st.first]}..{chain.names[st.end - 1]}",
                             st.in_flight, format_bytes(st.fixed), format_bytes(st.in_flight_bytes),
                             format_bytes(st.working), format_bytes(st.peak), st.schedule.n_recomputed,
                             format_time(plan.step_time) if s == 0 else "",
                             " / ".join(format_time(t) if t else "does not fit" for t in base.values()) if s == 0
                             else ""))
        ctx.write(f"\n**P = {P}**: least per-device memory {format_bytes(least)}, nothing faster above "
                  f"{format_bytes(top)}\n")
        ctx.table(("limit", "stage", "layers", "in flight", "fixed", "in flight bytes", "working", "peak",
                   "recomputed", "plan step", "(i) uniform / (ii) per-stage step"), rows)
    return "ok"


RUNNERS: dict[str, Callable[[Ctx], str]] = {
    "env": section_env,
    "pytest": section_pytest,
    "fidelity": section_fidelity,
    "train": section_train,
    "sublayer": section_sublayer,
    "fixed": section_fixed,
    "amp": section_amp,
    "pipeline": section_pipeline,
    "native": section_native,
}
