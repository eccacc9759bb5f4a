"""Benchmark of recompute-or-offload (docs/design.md §9), in simulation.

    python -m hchain_viz bench offload [--gpu H100] [--grid N] [--layers 32]

What it measures and how (docs/design.md §9): NOTE [what bench offload measures] below; the runs: docs/benchmarks.md.
"""

# NOTE [what bench offload measures]
# It prints, for resnet_chain, nanogpt, a
# synthetic chain and a LLaMA-7B-like decoder, at three links (PCIe 4.0 x16, PCIe 5.0 x16, NVLink-C2C) and four budgets
# each: the remat-only optimal makespan, the remat+offload makespan (``solve_offload(chain)``), both as overhead
# over store-all, and the share of the remat-only overhead that offloading removes. The remat-only reference is the
# DP's answer or, when faster, a schedule of a larger budget's breakpoint that still fits once simulated (the DP rounds
# sizes up to its slots), so that rounding is not credited to offloading. Then a table of that share averaged over the
# budgets where remat-only costs at least 10%, per chain and over all chains, per link; and per link the same averages
# in one line (goal at PCIe 5.0: at least 1/3), whether offloading was ever slower (goal: never), and the time of one
# budget change at L = 50 (the synthetic chain; goal: 100 ms).
#
# Stage times must be GPU-like (CPU compute is so slow that any link hides every copy). All are labelled by
# ``chain.meta["times"]``:
#
# - resnet_chain and nanogpt are profiled on the CPU for their sizes, with times from a roofline **estimate** for
#   ``--gpu`` (``profile(estimate_for=...)``). They are small: they make activations at 200-400 GiB/s of compute, far
#   above a PCIe link, so copies hide only where the compute between two uses is long.
# - synthetic is ``Chain.random(50, scale=16 MiB)`` with times divided by 10 (L = 50: the budget-change timing).
# - llama-7b (:func:`llama_chain`) is the case the Beaumont–Eyraud-Dubois–Shilova results are about: hidden 4096,
#   32 layers at two stages each, seq 4096, bf16, flash-style attention, FLOPs and bytes from analytic counts turned
#   into times by the same roofline **estimate** (``runtime.roofline``). Matmul FLOPs grow with d² per token and
#   activation bytes with d, so at this width it makes activations at about 64 GiB/s, the order of PCIe 5.0.
#
# The four budgets of each chain are added to the offload solver's precomputed grid (its answer between grid budgets is
# the one at the grid budget below), and "solve" is the time of that whole precomputation. "act. rate" is the chain's
# activation bytes (all x̄) over its store-all time: offloading pays when the link is a fair share of it.

from __future__ import annotations

import argparse
import math
import statistics
import time

from ..core.chain import BANDWIDTH_LABELS, Chain
from ..core.offload import default_grid_size, grid_budgets, remat_refined, solve_offload
from ..core.simulate import simulate
from ..core.solver import solve
from ..core.units import format_bytes, format_time
from . import positive_int, print_table

BUDGET_FRACTIONS = (0.05, 0.2, 0.4, 0.6)  # of the way from the remat-only least budget to the store-all peak
GOAL_SHARE = 1 / 3  # at PCIe 5.0, averaged over budgets where remat-only costs >= 10%
GOAL_CHANGE = 0.100  # seconds per budget change at L = 50


def synthetic() -> Chain:
    c = Chain.random(50, seed=0, scale=16 * 2**20)
    return Chain(fwd_time=[t / 10 for t in c.fwd_time], bwd_time=[t / 10 for t in c.bwd_time], x=c.x, xbar=c.xbar,
                 fwd_tmp=c.fwd_tmp, bwd_tmp=c.bwd_tmp, names=c.names, meta={"times": "synthetic"})


def llama_chain(gpu: str = "H100", layers: int = 32, seq: int = 4096, batch: int = 1, hidden: int = 4096,
                ffn: int = 11008, heads: int = 32) -> Chain:
    """A LLaMA-7B-like decoder stack from analytic counts (the embedding and the LM head are outside the chain: x_0
    is the embedded input, x_L the last hidden states), two stages per layer, bf16, flash-style attention (no
    seq x seq scores stored). Per stage, with T = batch * seq tokens, d = hidden, f = ffn, one (T, d) tensor = a
    bytes and one (T, f) tensor = m bytes:

    - ``layers.k.attn`` (RMSNorm, QKV, RoPE, causal flash attention, output projection, residual): forward FLOPs
      ``8 T d^2`` (projections) + ``2 batch seq^2 d`` (causal: half of QK^T and PV); backward twice the projections
      plus 2.5 times the attention (flash recomputes the scores). Saved beside the output: the norm output, q, k, v,
      the attention output (5a), the per-token rstd and the logsumexp. Transients: the pre-RoPE q, k (2a) forward;
      the q, k, v, output and norm gradients (10a) backward.
    - ``layers.k.mlp`` (RMSNorm, SwiGLU): forward ``6 T d f``, backward twice that. Saved: the norm output (a), and
      gate, up, silu(gate) and their product (4m, as eager PyTorch keeps them), the rstd. Transients: none forward;
      three (T, f) gradients and the norm gradient (3m + a) backward.

    Times come from the same roofline as ``profile(estimate_for=gpu)`` (``runtime.roofline.estimate_time``, its
    peaks and efficiencies), with the same byte counts as the profiler's: the forward reads its input and
    parameters and writes x̄; the backward reads x̄, twice its input, its output and twice the parameters.
    """
    from ..runtime.roofline import estimate_time, gpu_of

    g = gpu_of(gpu)
    T, d, f, e = batch * seq, hidden, ffn, 2  # bf16
    a, m, rstd, lse = T * d * e, T * f * e, T * 4, batch * heads * seq * 4
    fwd, bwd, x, xbar, ftmp, btmp, names, groups = [], [], [a], [], [], [], [], []

    def stage(name: str, f_flops: float, b_flops: float, params: int, saved: int, tmp_f: int, tmp_b: int) -> None:
        inp, out, p = x[-1], a, params * e
        fwd.append(estimate_time(g, "bfloat16", f_flops, inp + p + out + saved))
        bwd.append(estimate_time(g, "bfloat16", b_flops, out + saved + 2 * inp + out + 2 * p))
        x.append(out)
        xbar.append(out + saved)
        ftmp.append(tmp_f)
        btmp.append(tmp_b)
        names.append(name)

    proj, attn, mlp = 8 * T * d * d, 2 * batch * seq * seq * d, 6 * T * d * f
    for k in range(layers):
        stage(f"layers.{k}.attn", proj + attn, 2 * proj + 2.5 * attn, 4 * d * d, 5 * a + rstd + lse, 2 * a, 10 * a)
        stage(f"layers.{k}.mlp", mlp, 2 * mlp, 3 * d * f, a + 4 * m + rstd, 0, 3 * m + a)
        groups.append((f"layers.{k}", 2 * k, 2 * k + 1))
    return Chain(fwd_time=fwd, bwd_time=bwd, x=x, xbar=xbar, fwd_tmp=ftmp, bwd_tmp=btmp, names=names,
                 groups=groups, meta={
                     "model": f"LLaMA-7B-like decoder, {layers} layers, hidden {d}, ffn {f}, seq {seq}, batch {batch}",
                     "times": f"estimate: roofline for {g.name} from analytic FLOP and byte counts (not measured)"})


def demo_chain(name: str, gpu: str) -> Chain:
    from ..runtime.models import demo_model
    from ..runtime.profile import profile

    model, x, loss = demo_model(name)
    return profile(model, x, loss, estimate_for=gpu, warmup=0, repeats=1, progress=False)


def run(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m hchain_viz bench offload", description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="H100", help="GPU of the roofline estimate for the demo models")
    ap.add_argument("--grid", type=positive_int, default=None,
                    help="budgets precomputed by the offload solver (default: its own, 48)")
    ap.add_argument("--changes", type=positive_int, default=20, help="budget changes timed at L = 50")
    ap.add_argument("--layers", type=positive_int, default=32, help="layers of the LLaMA-7B-like chain")
    args = ap.parse_args(argv)

    chains = {"resnet_chain": demo_chain("resnet_chain", args.gpu), "nanogpt": demo_chain("nanogpt", args.gpu),
              "synthetic": synthetic(), "llama-7b": llama_chain(args.gpu, layers=args.layers)}
    rows, worse, change = [], 0, {}
    shares: dict[tuple[str, str], list[float]] = {(n, k): [] for n in chains for k in BANDWIDTH_LABELS}
    for name, chain in chains.items():
        rate = sum(chain.xbar) / chain.store_all_time
        remat = solve(chain)
        lo, hi = remat.min_budget, remat.store_all_peak
        budgets = [int(lo + f * (hi - lo)) for f in BUDGET_FRACTIONS]
        base = chain.store_all_time
        for link in BANDWIDTH_LABELS:
            c = chain.with_bandwidth(link)
            t0 = time.perf_counter()
            # the default grid, plus the budgets of the table (a budget change reads the grid; it never solves)
            grid = grid_budgets(remat, remat.store_all_peak, args.grid or default_grid_size(c)) + budgets
            sol = solve_offload(c, grid=grid, remat=remat)
            built = time.perf_counter() - t0
            for b in budgets:
                r, o = remat_refined(chain, remat, b)[0], sol.makespan(b)
                trace = simulate(c, sol.schedule(b))
                assert trace.peak_memory <= b and math.isclose(trace.makespan, o, rel_tol=1e-9)  # simulated
                worse += o > r * (1 + 1e-12)
                removed = max(0.0, (r - o) / (r - base)) if r > base else 0.0  # 0 when equal up to float noise
                if r / base - 1 >= 0.10:
                    shares[(name, link)].append(removed)
                rows.append((name, BANDWIDTH_LABELS[link], format_bytes(b), format_time(r),
                             f"{100 * (r / base - 1):+.1f}%", format_time(o), f"{100 * (o / base - 1):+.1f}%",
                             f"{100 * removed:.0f}%",
                             trace.n_transfers, format_time(trace.idle_time), f"{built:.2f}s"))
            if name == "synthetic":  # L = 50
                times = []
                for k in range(args.changes):
                    b = int(lo + (hi - lo) * k / max(1, args.changes - 1))
                    t0 = time.perf_counter()
                    simulate(c, sol.schedule(b))
                    times.append(time.perf_counter() - t0)
                change[link] = (statistics.median(times), max(times))
        print(f"{name}: {chain.length} stages, store-all {format_time(base)}, activations "
              f"{format_bytes(sum(chain.xbar))}, act. rate {format_bytes(rate)}/s, times: "
              f"{chain.meta.get('times', 'measured')}")
    print()
    print_table(("chain", "link", "budget", "remat-only", "ovh", "remat+offload", "ovh", "removed", "transfers",
                 "idle", "solve"), rows, left=2, rule=True)
    print()

    def mean(s: list[float]) -> str:
        return f"{100 * statistics.mean(s):.0f}% ({len(s)})" if s else "- (0)"

    print("overhead removed, averaged over the budgets where remat-only costs >= 10% (how many in brackets):")
    print_table(("link", *chains, "all chains"),
                [(label, *(mean(shares[(n, link)]) for n in chains), mean([v for n in chains
                                                                            for v in shares[(n, link)]]))
                 for link, label in BANDWIDTH_LABELS.items()], left=1, rule=True)
    print()
    for link, label in BANDWIDTH_LABELS.items():
        every = [v for n in chains for v in shares[(n, link)]]
        large = shares[("llama-7b", link)]
        goal = ""
        if link == "pcie5":
            verdict = {True: "met", False: "NOT met"}
            met_all = verdict[bool(every) and statistics.mean(every) >= GOAL_SHARE]
            met_large = verdict[bool(large) and statistics.mean(large) >= GOAL_SHARE]
            goal = f" (goal >= {100 * GOAL_SHARE:.0f}%: {met_all} over all chains, {met_large} on llama-7b)"
        med, worst = change.get(link, (float("nan"),) * 2)
        print(f"{label}: overhead removed {mean(every)} over all chains, {mean(large)} on llama-7b{goal}; budget "
              f"change at L=50 (schedule + simulate) median {1e3 * med:.1f} ms, max {1e3 * worst:.1f} ms "
              f"(goal {1e3 * GOAL_CHANGE:.0f} ms)")
    print(f"remat+offload slower than remat-only: {worse} times (goal: never)")
