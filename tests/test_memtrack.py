"""runtime/memtrack.py: byte counting (storages once) and the allocation tracker, checked against hand counts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from hchain_viz.errors import ProfileError  # noqa: E402
from hchain_viz.runtime.memtrack import (  # noqa: E402
    AllocationLog,
    AllocationTracker,
    MemoryMeter,
    nbytes,
    storages,
    tensors,
)

pytestmark = pytest.mark.torch


def test_nbytes_counts_each_storage_once():
    a = torch.zeros(10, 10)  # 400 bytes
    b = torch.zeros(5, dtype=torch.float64)  # 40 bytes
    assert nbytes(a) == 400
    assert nbytes((a, a.view(100), a[:, :3])) == 400  # views and slices share (and keep alive) a's storage
    assert nbytes([a, {"k": b, "n": None}, 3]) == 440
    assert nbytes((a, b), exclude=[a.untyped_storage()]) == 40
    assert nbytes(a[:2]) == 400  # a slice holds its whole base
    assert nbytes(a[:2].clone()) == 80
    assert nbytes(None) == 0 and nbytes(torch.empty(0)) == 0
    assert len(storages((a, a.t(), b))) == 2
    assert [t.shape for t in tensors((a, [b], {"x": a}))] == [a.shape, b.shape, a.shape]


def test_tracker_follows_allocations_and_frees():
    keep = torch.ones(100)
    with AllocationTracker() as tr:
        x = torch.empty(1000)  # 4000 bytes
        assert tr.current == 4000 and tr.peak == 4000
        v = x.view(10, 100).t()  # views create nothing
        x.add_(1)  # in-place creates nothing
        _ = keep[:10]  # a view of an older storage is not an allocation
        assert tr.current == 4000
        y = x * 2
        assert tr.current == 8000
        del y
        assert tr.current == 4000 and tr.peak == 8000
        tr.reset_peak()
        assert tr.peak == 4000
        assert tr.created(x.untyped_storage()) and not tr.created(keep.untyped_storage())
        del x
        assert tr.current == 4000  # v still holds the storage
        del v
        assert tr.current == 0
        z = torch.zeros(10, dtype=torch.float64)
    assert tr.current == 80
    del z  # frees are followed after the mode exits
    assert tr.current == 0 and tr.peak == 4000  # since reset_peak


def test_tracker_sees_backward_allocations():
    lin = nn.Linear(100, 200)
    x = torch.randn(32, 100, requires_grad=True)
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    with AllocationTracker() as tr:
        y = lin(x)
        assert tr.current == 32 * 200 * 4
        g = torch.ones_like(y)
        tr.reset_peak()
        y.backward(g)
        # at once: y, g, x.grad, and the fresh weight and bias gradients before they are added in place
        assert tr.peak == 4 * (32 * 200 * 2 + 32 * 100 + 200 * 100 + 200)
        assert tr.current == 4 * (32 * 200 * 2 + 32 * 100)  # the parameter-grad temporaries are gone
    x.grad = None
    del y, g
    assert tr.current == 0


def test_tracker_follows_out_resize():
    with AllocationTracker() as tr:
        out = torch.empty(0)
        torch.add(torch.ones(3), 1, out=torch.empty(0))  # unnamed result, freed at once
        torch.mul(torch.ones(50), 2, out=out)  # out grows from 0 to 200 bytes
        assert tr.current == 200
    del out
    assert tr.current == 0


def test_memory_meter_cpu_spans():
    keep = torch.ones(100)
    with MemoryMeter("cpu") as m:
        a = torch.empty(256)  # 1024 bytes
        b = torch.empty(256)
        del b
        m.mark()
        c = torch.empty(512)  # 2048 bytes
        del c, keep  # keep was allocated before the meter: its free is not counted
    assert [(s.start, s.peak, s.end) for s in m.spans] == [(0, 2048, 1024), (1024, 3072, 1024)]
    assert m.current == 1024 and m.peak == 3072
    assert m.log.created_addresses(0) == {a.untyped_storage().data_ptr()}
    assert m.log.created_addresses(1) == set()
    del a


def test_allocation_log_is_read_after_the_block_and_does_not_nest():
    with AllocationLog() as log:
        with pytest.raises(ProfileError, match="after its block"):
            _ = log.peak
        with pytest.raises(ProfileError, match="already running"), AllocationLog():
            pass
    assert log.peak == 0


def test_allocation_log_agrees_with_the_tensor_tracker_and_sees_scratch_buffers():
    # A linear layer allocates nothing but tensors: both must agree exactly. A convolution's backward allocates
    # scratch buffers (unfolded columns) that only the allocator sees.
    lin, x = nn.Linear(100, 200), torch.randn(32, 100, requires_grad=True)
    conv, img = nn.Conv2d(8, 8, 3, padding=1), torch.randn(2, 8, 16, 16, requires_grad=True)
    for model, inp in ((lin, x), (conv, img)):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        peaks = []
        for meter in (AllocationTracker(), AllocationLog()):
            with meter:
                out = model(inp)
                out.backward(torch.ones_like(out))
            inp.grad = None
            del out
            peaks.append(meter.peak)
        if model is lin:
            assert peaks[0] == peaks[1] == 4 * (32 * 200 * 2 + 32 * 100 + 200 * 100 + 200)
        else:
            assert peaks[1] > peaks[0]



class _ColumnMajor(torch.autograd.Function):
    """2x, laid out column-major; its backward copies a gradient that arrives in another layout (as a
    convolution's backward makes a gradient channels-last)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype).copy_(x).mul_(2)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g.t().contiguous().t() * 2


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


class _ColumnMajorStage(nn.Module):
    def forward(self, x):
        return _ColumnMajor.apply(x)


class _Mean(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def test_a_backward_is_measured_with_its_gradient_laid_out_as_the_next_backward_makes_it():
    """The profiler's stand-in for δ_2 has x_2's column-major layout; in a step whose backwards join, δ_2 arrives
    row-major from the mean's backward, and B(1) copies it (one more x_2). Its transient counts that copy, and the
    measured peak stays at or below the predicted one (both ways of handing δ_2 over: joined and apart)."""
    import hchain_viz as hcv
    from hchain_viz.runtime.measure import measure

    torch.manual_seed(0)
    model, x = nn.Sequential(_Scale(), _ColumnMajorStage(), _Mean()), torch.randn(512, 256)
    chain = hcv.profile(model, x, warmup=0, repeats=1, progress=False)
    assert chain.bwd_tmp[1] >= nbytes(x)  # the copy (and the doubled gradient beyond δ_1)
    sol = hcv.solve(chain)
    for budget in (sol.min_budget, sol.store_all_peak):
        schedule = sol.schedule(budget)
        predicted = hcv.simulate(chain, schedule).peak_memory
        measured = measure(hcv.wrap(model, schedule), x, repeats=1).peak_bytes
        assert 0.9 * predicted <= measured <= predicted, (str(schedule), measured, predicted)

@pytest.mark.cuda
def test_memory_meter_cuda():
    dev = torch.device("cuda")
    with MemoryMeter(dev) as m:
        a = torch.empty(2**20, device=dev)  # 4 MiB, a multiple of the allocator's block size
        b = torch.empty(2**20, device=dev)
        del b
        assert m.current == 4 * 2**20 and m.peak == 8 * 2**20
        m.mark()
        assert m.peak == 8 * 2**20 and m.spans[-1].peak == 4 * 2**20
    del a
