"""Benchmark: an applied store-all schedule against the plain model in Hugging Face Trainer steps
(``python -m hchain_viz bench trainer``).

Per size, a tiny random GPT-2 (``LAYERSxWIDTHxSEQ``, 4 heads, a small vocabulary, batch 8 by default) trains for a
few steps in its own ``transformers.Trainer`` with default arguments (no logging, saving or progress bar), plain or
with ``hcv.apply(model, store_all(chain))``; the two kinds alternate in a shuffled order each round. A callback times
each step and reads the process's user CPU time and minor page faults. The first two steps of each Trainer are
dropped, as warm-up for both kinds: the executor learns in its second step what each stage frees (and notes every
saved tensor to find it), then runs without noting them, as in the rest of a training run.
Goal (issue #22): the applied model at most 3% slower (median step ratio <= 1.03).

Measure with glibc's heap kept, ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=
4294967296``: otherwise glibc hands freed memory back to the system and a step page-faults up to tens of thousands of
times (about 2.5 us each), differently in every run, which swamps a difference of a few percent. The table says how
many faults a step took.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import warnings
from typing import Any

from . import positive_int, print_table

GOAL = 1.03
WARM = 2  # steps dropped per Trainer
HEAP_KEPT = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def run(args: list[str]) -> None:
    """Print one row per size: median step times, their ratio and spread, page faults, user CPU ratio, the goal."""
    p = argparse.ArgumentParser(prog="python -m hchain_viz bench trainer", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2x128x128,2x256x256",
                   help="comma-separated GPT-2 sizes LAYERSxWIDTHxSEQ (default %(default)s)")
    p.add_argument("--batch", type=positive_int, default=8, help="per-device batch size (default %(default)s)")
    p.add_argument("--vocab", type=positive_int, default=256, help="vocabulary size (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=6,
                   help="rounds of one Trainer per kind (default %(default)s)")
    p.add_argument("--steps", type=int, default=WARM + 4,
                   help=f"steps per Trainer, the first {WARM} dropped (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is; default 1)")
    opts = p.parse_args(args)
    if opts.steps <= WARM:
        p.error(f"--steps must be more than {WARM}: the first {WARM} steps of each Trainer are dropped")
    import torch

    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    head = ("size", "steps", "plain ms", "applied ms", "ratio", "IQR/median", "faults/step", "user CPU ratio", "goal",
            "ok")
    rows = []
    for size in [s.strip() for s in opts.sizes.split(",") if s.strip()]:
        layers, width, seq = (int(v) for v in size.split("x"))
        res = _measure(layers, width, seq, opts)
        plain, applied = (statistics.median(res[k]["t"]) for k in ("plain", "applied"))
        ratio = applied / plain
        spread = max(_iqr(res[k]["t"]) / statistics.median(res[k]["t"]) for k in res)
        faults = "/".join(f"{statistics.median(res[k]['f']):.0f}" for k in ("plain", "applied"))
        cpu = statistics.median(res["applied"]["u"]) / statistics.median(res["plain"]["u"])
        rows.append((size, len(res["plain"]["t"]), f"{plain * 1e3:.1f}", f"{applied * 1e3:.1f}", f"{ratio:.3f}",
                     f"{spread:.0%}", faults, f"{cpu:.3f}", f"<= {GOAL}", "yes" if ratio <= GOAL else "NO"))
    print(f"applied store-all vs plain GPT-2 in HF Trainer steps: batch {opts.batch}, vocab {opts.vocab}, "
          f"{opts.rounds} shuffled rounds x {opts.steps - WARM} timed steps per kind")
    print_table(head, rows, left=1)
    if "trim_threshold" not in os.environ.get("GLIBC_TUNABLES", ""):
        print(f"note: glibc may return freed memory to the system between steps (page faults above); set "
              f"GLIBC_TUNABLES={HEAP_KEPT} for steadier times")


def _measure(layers: int, width: int, seq: int, opts: Any) -> dict[str, dict[str, list[float]]]:
    """Per kind ("plain", "applied"): step times ``t``, user CPU times ``u`` (s) and minor page faults ``f``."""
    import torch

    data = _Tokens(seq, opts.vocab)
    sample = {k: torch.stack([data[i][k] for i in range(opts.batch)]) for k in data[0]}
    res: dict[str, dict[str, list[float]]] = {k: {"t": [], "u": [], "f": []} for k in ("plain", "applied")}
    order = random.Random(0)
    for _ in range(opts.rounds):
        kinds = ["plain", "applied"]
        order.shuffle(kinds)
        for kind in kinds:
            clock = _train(kind, layers, width, seq, data, sample, opts)
            for key in "tuf":
                res[kind][key].extend(getattr(clock, key)[WARM:])
    return res


def _train(kind: str, layers: int, width: int, seq: int, data: Any, sample: dict, opts: Any) -> Any:
    import torch
    import transformers

    import hchain_viz as hcv
    from hchain_viz.core.strategies import store_all

    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, n_positions=seq, vocab_size=opts.vocab,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.GPT2LMHeadModel(config)
    if kind == "applied":
        chain = hcv.profile(model, sample, warmup=0, repeats=1, progress=False)
        hcv.apply(model, store_all(chain), chain=chain)
    clock = _clock()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=opts.steps,
                                              per_device_train_batch_size=opts.batch, report_to=[],
                                              save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                              use_cpu=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[clock])
        trainer.remove_callback(transformers.PrinterCallback)  # its end-of-training line would split the table
        trainer.train()
    return clock


def _clock() -> Any:
    """A Trainer callback that times each step: wall time ``t``, user CPU ``u`` and minor page faults ``f``."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.t: list[float] = []
            self.u: list[float] = []
            self.f: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = (time.perf_counter(), *_usage())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            t0, u0, f0 = self.start
            u, f = _usage()
            self.t.append(time.perf_counter() - t0)
            self.u.append(u - u0)
            self.f.append(f - f0)

    return Clock()


def _usage() -> tuple[float, int]:
    """This process's user CPU time (s; kernel time, page faults' included, left out) and minor page faults."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_minflt


class _Tokens:
    """Fixed random token sequences, as a tokenized dataset gives them (causal LM: labels are the tokens)."""

    def __init__(self, seq: int, vocab: int):
        self.seq, self.vocab = seq, vocab

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(self.seq, dtype=torch.long), "labels": ids.clone()}


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]
