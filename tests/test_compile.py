"""torch.compile and hchain_viz: measuring and profiling leave compiled modules compiled (issue 11)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hchain_viz.errors import HChainError, NotSequentialError  # noqa: E402
from hchain_viz.runtime.compiled import compile_options  # noqa: E402
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
    # Blocks under 64 KiB come from heap pages that may already be resident, so the OS can see a little less than
    # the log: 0.99-1.00 of it here, 0.96 on CI's machines. Counting a 2 MiB activation twice, or missing one,
    # would move the ratio by 15%.
    assert 0.92 * logged <= os_peak <= 1.02 * logged


def test_a_compiled_module_is_not_cut_into_stages():
    compiled = torch.compile(mlp(), backend=CountingBackend())
    with pytest.raises(NotSequentialError, match="compile=True"):
        profile(compiled, torch.randn(8, 32), progress=False)


# ---------------------------------------------------------------------------------------------- compiled stages
def block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3))


def bn_dropout_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(block(), block(), block(), nn.Linear(16, 4))


def reference_step(model: nn.Module, x: torch.Tensor, options: dict) -> tuple:
    """The same stages, each compiled the same way, run one after another with autograd (no schedule)."""
    from hchain_viz.runtime.stages import sequentialize

    h = x
    for _, stage in sequentialize(model):
        h = torch.compile(stage, **options)(h)
    return _loss_and_results(model, h)


def _loss_and_results(model: nn.Module, out: torch.Tensor) -> tuple:
    loss = (out ** 2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads, [b.clone() for b in model.buffers()], torch.get_rng_state()


@pytest.mark.parametrize("strategy", ["recompute_all", "periodic"])
def test_compiled_stages_under_a_schedule_equal_the_compiled_stages_without_one(strategy):
    # Dropout (RNG replayed), BatchNorm (statistics updated once) and recomputed compiled stages: bitwise equal to
    # the same compiled stages run without a schedule (aot_eager: AOTAutograd's graphs, without inductor's cost).
    from hchain_viz.core import strategies
    from hchain_viz.core.chain import Chain
    from hchain_viz.runtime.train.wrap import wrap

    x = torch.randn(8, 16)
    model = bn_dropout_net()
    chain = Chain.homogeneous(13)
    schedule = strategies.recompute_all(chain) if strategy == "recompute_all" else strategies.periodic(chain, 3)
    assert schedule.n_recomputed > 0
    wrapped = wrap(model, schedule, compile={"backend": "aot_eager"})
    assert "compiled stages" in repr(wrapped)
    for step in range(2):  # the second step reuses the graphs compiled in the first
        start = [b.clone() for b in model.buffers()]
        torch.manual_seed(step)
        expected = reference_step(model, x, {"backend": "aot_eager", "fullgraph": True})
        for b, s in zip(model.buffers(), start):
            b.copy_(s)
        torch.manual_seed(step)
        got = _loss_and_results(model, wrapped(x))
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
        assert all(torch.equal(a, b) for a, b in zip(got[2], expected[2]))
        assert torch.equal(got[3], expected[3])


def test_identical_layers_share_compiled_graphs():
    from hchain_viz.core import strategies
    from hchain_viz.core.chain import Chain
    from hchain_viz.runtime.train.wrap import wrap

    backend = CountingBackend()
    model = bn_dropout_net()
    wrapped = wrap(model, strategies.store_all(Chain.homogeneous(13)), compile={"backend": backend})
    wrapped(torch.randn(8, 16)).sum().backward()
    # 13 stages of 4 kinds (Linear, BatchNorm1d, ReLU, Dropout): the first stage sees an input that needs no grad
    assert backend.calls == 13
    assert backend.compiles <= 6


def test_torch_compile_of_a_wrapped_module_says_to_use_compile_true():
    from hchain_viz.core import strategies
    from hchain_viz.core.chain import Chain
    from hchain_viz.errors import HChainError
    from hchain_viz.runtime.train.wrap import wrap

    wrapped = wrap(mlp(), strategies.recompute_all(Chain.homogeneous(3)))
    x = torch.randn(8, 32)
    with pytest.raises(HChainError, match="compile=True"):
        torch.compile(wrapped, backend="eager")(x)
    step = torch.compile(lambda x: wrapped(x).sum(), backend="eager")
    with pytest.raises(HChainError, match="compile=True"):
        step(x)
    wrapped(x).sum().backward()  # still fine outside compiled code


def test_profile_compiled_stages_predicts_the_compiled_schedule():
    from hchain_viz.core import strategies
    from hchain_viz.core.chain import Chain
    from hchain_viz.core.simulate import simulate
    from hchain_viz.runtime.train.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 8))
    x = torch.randn(64, 64)
    options = {"backend": "aot_eager"}
    chain = profile(model, x, compile=options, warmup=0, repeats=1, progress=False)
    assert "aot_eager" in chain.meta["compile"]
    assert Chain.from_json(chain.to_json()).meta["compile"] == chain.meta["compile"]
    assert len(chain) == 9 and all(t > 0 for t in chain.fwd_time)
    for schedule in (strategies.store_all(chain), strategies.periodic(chain, 3)):
        predicted = simulate(chain, schedule).peak_memory
        measured = measure(wrap(model, schedule, compile=options), x, repeats=1).peak_bytes
        # (0.85: on this chain of 16 KiB activations the backward transients of the compiled Linear stages run
        # about 12 KiB high; the executor no longer keeps the 5 KiB RNG state that used to hide part of it)
        assert 0.85 <= measured / predicted <= 1.0, (schedule, measured, predicted)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return torch.tanh(self.down(torch.nn.functional.gelu(self.up(x))))


def test_per_stage_activation_memory_budget_shrinks_what_compiled_stages_save():
    """compile={"activation_memory_budget": b}: each stage's graph is partitioned under b; the chain sees what the
    graphs then save, and the schedule's peak stays predicted."""
    from hchain_viz.core import strategies
    from hchain_viz.core.simulate import simulate
    from hchain_viz.runtime.train.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(_Mlp(), _Mlp())  # two stages, each a graph of several ops
    x = torch.randn(128, 64)
    full = profile(model, x, compile=True, warmup=0, repeats=1, progress=False)
    lean_options = {"activation_memory_budget": 0.0}
    lean = profile(model, x, compile=lean_options, warmup=0, repeats=1, progress=False)
    assert "activation_memory_budget=0.0" in lean.meta["compile"]
    assert sum(lean.xbar) < sum(full.xbar)
    schedule = strategies.store_all(lean)
    measured = measure(wrap(model, schedule, compile=lean_options), x, repeats=1).peak_bytes
    assert 0.9 <= measured / simulate(lean, schedule).peak_memory <= 1.0


@pytest.mark.parametrize("bad", [{"activation_memory_budget": 1.5}, {"activation_memory_budget": "low"},
                                 {"activation_memory_budget": 0.5, "backend": "aot_eager"}])
def test_bad_activation_memory_budget_is_an_hchain_error(bad):
    with pytest.raises(HChainError, match="activation_memory_budget"):
        compile_options(bad)


# ---------------------------------------------------------------------------------------------- native form (issue 22)
def _native_case():
    """Dropout and BatchNorm in nested regions: a least-memory DP schedule on a random chain of 9 stages."""
    from hchain_viz.core.chain import Chain
    from hchain_viz.core.solver import solve

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32),
                          nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    sol = solve(Chain.random(len(model), seed=5))
    return model, x, y, sol.schedule(sol.min_budget)


def test_native_form_compiled_whole_gives_eager_losses_gradients_buffers_and_rng():
    """torch.compile(model) of the native form: one graph (after the checks' graph break), nested checkpoint regions
    inside, and bitwise the eager plain model's losses, gradients, BatchNorm statistics (updated once) and global RNG
    with aot_eager (ATen's own kernels and random numbers; inductor's fused kernels round differently)."""
    import copy

    import hchain_viz as hcv
    from hchain_viz.core.regions import Region, segment_tree

    model, x, y, schedule = _native_case()
    tree = segment_tree(schedule)
    assert any(isinstance(n, Region) and any(isinstance(b, Region) for b in n.body) for n in tree)  # nested
    twin = copy.deepcopy(model)
    hcv.apply(model, schedule, native=True)
    compiled = torch.compile(model, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for step in range(2):
        results = []
        for net in (compiled, twin):
            torch.manual_seed(10 + step)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            results.append((loss.detach(), torch.get_rng_state()))
        (la, ra), (le, re_) = results
        assert torch.equal(la, le) and torch.equal(ra, re_)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_native_form_records_checkpoint_regions_in_the_compiled_graph():
    """What Dynamo captures holds the schedule: one checkpoint higher-order op per top-level region."""
    import hchain_viz as hcv
    from hchain_viz.core.regions import Region, segment_tree

    model, x, y, schedule = _native_case()
    hcv.apply(model, schedule, native=True)
    graphs = []

    def keep(gm, example_inputs):  # keeps Dynamo's graph, then compiles as aot_eager (functionalized BatchNorm)
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    nn.functional.cross_entropy(torch.compile(model, backend=keep)(x), y).backward()
    assert len(graphs) == 1
    hops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    assert len(hops) == sum(isinstance(n, Region) for n in segment_tree(schedule))


def test_native_form_in_eager_mode_is_bitwise_like_eager_and_refuses_offloading():
    import copy

    import hchain_viz as hcv
    from hchain_viz.errors import NotNative

    model, x, y, schedule = _native_case()
    twin = copy.deepcopy(model)
    hcv.apply(model, schedule, native=True)
    for net in (model, twin):
        torch.manual_seed(3)
        nn.functional.cross_entropy(net(x), y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))  # statistics updated once
    hcv.remove(model)
    with pytest.raises(NotNative, match="Off/Pre"):
        hcv.apply(model, hcv.Schedule.parse("Fall0 Off0 Fall1 Loss B1 Pre0 B0"), native=True)


def test_native_form_compiled_whole_measures_its_compiled_prediction():
    """torch.compile's partitioner (min-cut, as inductor; aot_eager_decomp_partition runs its graphs without
    inductor's code generation) recomputes each node once and holds the parameter gradients to the end of the
    backward: a nested schedule measures above its eager prediction, at its compiled one (core/regions.py), and
    warns; the schedule for_compile picks fits its budget compiled, without a warning."""
    import copy
    import warnings

    import hchain_viz as hcv
    from hchain_viz.core.regions import compiled_peak, compiled_schedule, for_compile
    from hchain_viz.core.simulate import simulate
    from hchain_viz.runtime.train.native import grad_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())])
    x = torch.randn(512, 256)  # activations (6 MiB) above the gradients held (1.5 MiB)

    def loss_fn(out):
        return out.pow(2).mean()

    chain = hcv.profile(model, x, loss_fn, warmup=0, repeats=1, progress=False)
    sol = hcv.solve(chain)
    grads = grad_bytes(list(model))
    nested = sol.schedule(sol.min_budget)
    budget = (sol.min_budget + sol.store_all_peak) // 2
    fit = for_compile(sol, budget, grads)
    assert compiled_schedule(nested) is not nested and fit.n_recomputed > 0
    for schedule in (nested, fit):
        net = copy.deepcopy(model)
        hcv.apply(net, schedule, chain=chain, native=True)
        compiled = torch.compile(net, backend="aot_eager_decomp_partition")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            measured = hcv.measure(compiled, x, loss_fn, repeats=1).peak_bytes
        predicted = compiled_peak(chain, schedule, grads)
        warned = [str(w.message) for w in caught if "torch.compile of a model trained by" in str(w.message)]
        assert 0.9 * predicted <= measured <= predicted, (measured / predicted, str(schedule))
        if schedule is nested:
            assert measured > 1.1 * simulate(chain, nested).peak_memory
            assert len(warned) == 1 and "compiled whole it is predicted" in warned[0]
        else:  # within its budget; the warning left is inductor's scheduling (this backend has none)
            assert measured <= budget and len(warned) == 1 and "inductor's kernel scheduling" in warned[0]


def test_selective_native_form_is_bitwise_like_eager_compiled_whole_and_not():
    """apply(..., native=True, selective=True): every stage saves only its matrix products' outputs and recomputes the
    rest (BatchNorm, ReLU, dropout) in its backward. Eager and compiled whole (aot_eager): losses, gradients,
    BatchNorm statistics (updated once) and the global RNG (dropout's draws replayed) bitwise the plain model's."""
    import copy

    import hchain_viz as hcv

    model, x, y, schedule = _native_case()
    eager_net, twin = copy.deepcopy(model), copy.deepcopy(model)
    for net in (model, eager_net):
        hcv.apply(net, schedule, native=True, selective=True)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        results = []
        for net in (compiled, eager_net, twin):
            torch.manual_seed(20 + step)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            results.append((loss.detach(), torch.get_rng_state()))
        for (loss, rng), net in zip(results[:2], (model, eager_net)):
            assert torch.equal(loss, results[2][0]) and torch.equal(rng, results[2][1])
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), twin.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(net.buffers(), twin.buffers()))


class _Block(nn.Module):
    """A matrix product, then cheap ops whose outputs a plain stage saves and a selective one recomputes."""

    def __init__(self, width: int, norm: type[nn.Module] = nn.BatchNorm1d):
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), norm(width)

    def forward(self, x):
        return torch.tanh(self.norm(self.linear(x)).relu())


def test_compiled_selective_stage_keeps_a_batch_norms_statistics_not_its_output():
    """Under torch.compile a selective stage leaves its batch norms to the partitioner, which, with inductor's
    decompositions, saves the per-channel statistics and recomputes the normalisation: the full-size tensors the
    forward saves are the convolutions' outputs and the stage's input, no more (told to recompute the norm, the
    policy would recompute its reduction over the input too)."""
    import copy

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from hchain_viz.runtime.train.native import selective_call

    saved = []

    def forward_compiler(gm, example_inputs):
        outputs = gm.graph.output_node().args[0]
        saved.extend(tuple(a.meta["val"].shape) for a in outputs if isinstance(a, torch.fx.Node) and "val" in a.meta)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, bias=False))
    x = torch.randn(4, 3, 16, 16, requires_grad=True)
    twin = copy.deepcopy(stage)
    out = torch.compile(lambda v: selective_call(stage, v), backend=backend)(x)
    out.sum().backward()
    full = [shape for shape in saved if len(shape) == 4 and shape[0] == 4]
    # the outputs: the stage's (4x8x12x12); saved: its input, the first convolution's output; the rest per channel
    assert sorted(full) == sorted([(4, 8, 12, 12), (4, 3, 16, 16), (4, 8, 14, 14)]), saved
    assert any(shape == (1, 8, 1, 1) for shape in saved), saved  # the statistics
    y = twin(x.detach())  # and it computes the same: outputs, running statistics
    assert torch.allclose(out, y, atol=1e-5) and torch.allclose(stage[1].running_var, twin[1].running_var)


def test_selective_profile_saves_less_and_the_profiles_go_where_they_belong():
    import hchain_viz as hcv
    from hchain_viz.errors import ScheduleMismatch

    torch.manual_seed(0)
    # aot_eager: ATen's ops whole, its default partition saving what the backward reads (a layer norm, unlike a
    # batch norm, is recomputed whole: _keep_costly_compiled)
    model, x = nn.Sequential(*[_Block(64, nn.LayerNorm) for _ in range(3)], nn.Linear(64, 4)), torch.randn(32, 64)
    aot = {"backend": "aot_eager"}
    plain = hcv.profile(model, x, compile=aot, warmup=0, repeats=1, progress=False)
    chain = hcv.profile(model, x, compile=aot, selective=True, warmup=0, repeats=1, progress=False)
    assert chain.meta["selective"] is True and "selective" not in plain.meta
    assert hcv.Chain.from_json(chain.to_json()).meta["selective"] is True
    for i in range(3):  # each block keeps its linear's output (its norm's input) and no more
        assert chain.xbar[i] < plain.xbar[i], (i, chain.xbar, plain.xbar)
    sol = hcv.solve(chain, single_level=True)
    schedule = sol.schedule(sol.min_budget)
    with pytest.raises(hcv.HChainError, match="native=True"):
        hcv.apply(model, schedule, chain=plain, selective=chain)
    with pytest.raises(ScheduleMismatch, match="chain= takes the plain profile"):
        hcv.apply(model, schedule, chain=chain, native=True)
    with pytest.raises(ScheduleMismatch, match="selective= takes a chain profiled"):
        hcv.apply(model, schedule, chain=plain, native=True, selective=plain)
    with pytest.raises(hcv.ProfileError, match="compile=True"):
        hcv.profile(model, x, selective=True, progress=False)
    assert hcv.apply(model, schedule, chain=plain, native=True, selective=chain) is model


def test_checkpoint_selective_profiles_compiled_selective_stages_and_applies_them(capsys):
    import copy

    import hchain_viz as hcv

    torch.manual_seed(0)
    model, x = nn.Sequential(_Block(32), _Block(32), nn.Linear(32, 4)), torch.randn(16, 32)
    twin = copy.deepcopy(model)
    hcv.checkpoint(model, x, budget="1MiB", native=True, selective=True, progress=False)
    state = vars(model)["_hcv_applied"]
    assert state.selective and state.selective_chain.meta["selective"] is True and "selective" not in state.chain.meta
    assert "compile" in state.chain.meta and "compile" in state.selective_chain.meta
    assert "selective stages" in state.describe() and "hchain_viz: Sequential in 3 stages" in capsys.readouterr().out
    for net in (model, twin):  # eager here: bitwise the plain model
        net(x).pow(2).mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    with pytest.raises(hcv.HChainError, match="native=True"):
        hcv.checkpoint(twin, x, budget="1MiB", selective=True, progress=False)


def test_selective_form_with_a_region_measures_its_mixed_prediction_compiled():
    """The stages of a region run plain, the others selective (train/native.py: a selective stage inside a region
    would keep its saved outputs through it), and selective_chain predicts that mix: measured compiled whole
    (aot_eager_decomp_partition: inductor's partition, ATen's kernels) within [0.9, 1.0] of compiled_peak, and below
    the selective form without regions (which measures under its prediction)."""
    import copy

    import hchain_viz as hcv
    from hchain_viz.core.regions import compiled_peak, segment_tree
    from hchain_viz.runtime.train.native import grad_bytes

    torch.manual_seed(0)
    model, x = nn.Sequential(*[_Block(256) for _ in range(6)], nn.Linear(256, 4)), torch.randn(512, 256)

    def loss_fn(out):
        return out.pow(2).mean()

    backend = {"backend": "aot_eager_decomp_partition"}
    plain = hcv.profile(model, x, loss_fn, compile=backend, warmup=0, repeats=1, progress=False)
    chain = hcv.profile(model, x, loss_fn, compile=backend, selective=True, warmup=0, repeats=1, progress=False)
    sol = hcv.solve(plain, single_level=True)
    low = sol.schedule(sol.min_budget)
    assert segment_tree(low) != tuple(range(plain.length))  # it has regions
    peaks = {}
    for schedule in (low, hcv.strategies.store_all(plain)):
        net = copy.deepcopy(model)
        hcv.apply(net, schedule, chain=plain, native=True, selective=chain)
        compiled = torch.compile(net, backend="aot_eager_decomp_partition")
        peaks[schedule.n_recomputed] = measured = hcv.measure(compiled, x, loss_fn, repeats=1).peak_bytes
        predicted = compiled_peak(plain, schedule, grad_bytes(list(model)), chain)
        assert measured <= predicted, (schedule.n_recomputed, measured / predicted)
        # Without regions, the whole graph recomputes even the blocks' outputs (their tanh, from the saved matrix
        # product) where each stage compiled alone must keep its output: measured 0.65x of the prediction here.
        if schedule is low:
            assert 0.9 * predicted <= measured, measured / predicted
    assert peaks[low.n_recomputed] < peaks[0]


def test_selective_chain_takes_a_regions_stages_from_the_plain_profile():
    import dataclasses

    from hchain_viz.core.chain import Chain
    from hchain_viz.core.regions import compiled_schedule, selective_chain
    from hchain_viz.core.solver import solve
    from hchain_viz.errors import InvalidSchedule

    plain = Chain.random(8, seed=3)
    picked = dataclasses.replace(plain, xbar=[b + 1 for b in plain.xbar], bwd_time=[t * 2 for t in plain.bwd_time],
                                 meta={"selective": True})
    sol = solve(plain, single_level=True)
    schedule = compiled_schedule(sol.schedule(sol.min_budget))
    in_region = {op.stage for op in schedule.ops if op.kind in ("Fck", "Fn")}
    assert 0 < len(in_region) < plain.length
    mixed = selective_chain(plain, picked, schedule)
    for i in range(plain.length):
        source = plain if i in in_region else picked
        assert (mixed.xbar[i], mixed.bwd_time[i]) == (source.xbar[i], source.bwd_time[i]), i
    with pytest.raises(InvalidSchedule, match="selective=True"):
        selective_chain(plain, plain, schedule)
    assert selective_chain(plain, None, schedule) is plain  # the plain form
