"""hcv.wrap composes with FSDP2 (``torch.distributed.fsdp.fully_shard``), on gloo with two CPU processes: the loss
and the gradients equal those of the same FSDP2 model without wrap, and the fixed memory predicted with
``world_size=2`` matches what each rank holds (docs/design.md §7)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import hchain_viz as hcv  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")]
from gloo import gloo_rank  # noqa: E402

WORLD = 2


def _model():
    """Dense stages with even first dimensions, so FSDP2's dim-0 shards are exact halves (no padding)."""
    model, x, loss_fn = hcv.models.mlp_chain(batch=16, in_features=32, widths=(64, 128, 32), classes=10)
    return model, x, loss_fn.target


def _local_bytes(tensors) -> int:
    """Bytes this rank holds for (possibly sharded) tensors: a DTensor's local shard, or the tensor itself."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


@gloo_rank
def _fsdp_worker(rank: int, world: int, out_dir: str, schedule_json: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    schedule = hcv.Schedule.from_json(schedule_json)
    record = {}
    for label in ("plain", "wrapped"):
        model, x, y = _model()  # the same weights in both runs
        for stage in model:
            fully_shard(stage, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = hcv.wrap(model, schedule) if label == "wrapped" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
        losses, grads = [], []
        for _ in range(2):
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
            if label == "wrapped" and not record.get("fixed"):
                held_grads = _local_bytes(p.grad for p in model.parameters())
            opt.step()
            opt.zero_grad()
        record[label] = (losses, grads)
        if label == "wrapped":
            state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
            record["fixed"] = {"params": _local_bytes(model.parameters()), "grads": held_grads,
                               "state": _local_bytes(state), "n_scalars": sum(t.dim() == 0 for t in state),
                               "buffers": _local_bytes(model.buffers())}
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


def test_wrap_composes_with_fully_shard_on_two_gloo_processes(tmp_path):
    model, x, y = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chain = hcv.profile(model, x.chunk(WORLD)[0], lambda out: nn.functional.cross_entropy(out, y.chunk(WORLD)[0]),
                        optimizer=opt, world_size=WORLD, repeats=1, warmup=0, progress=False)
    schedule = hcv.strategies.recompute_all(chain)  # every stage recomputed: the hardest case for FSDP2's hooks
    assert hcv.simulate(chain, schedule).n_recomputed > 0
    mp.spawn(_fsdp_worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path), schedule.to_json()), nprocs=WORLD,
             join=True)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rec in records:  # the wrapped FSDP2 model gives the loss and the (sharded) gradients of the plain one
        (lw, gw), (lp, gp) = rec["wrapped"], rec["plain"]
        for a, b in zip(lw, lp):
            assert torch.equal(a, b)
        for step_w, step_p in zip(gw, gp):
            assert all(torch.equal(a, b) for a, b in zip(step_w, step_p))
    f = chain.fixed
    assert f.world_size == WORLD
    for rec in records:  # each rank holds half the parameters, gradients and optimizer state; buffers whole
        got = rec["fixed"]
        assert got["params"] == f.params // WORLD
        assert got["grads"] == f.grads_per_rank
        # Adam's step counters are one 4-byte scalar per parameter on every rank (replicated, not sharded)
        assert got["state"] - 2 * got["n_scalars"] == f.optimizer_state // WORLD
        assert got["params"] + got["state"] + got["buffers"] == pytest.approx(f.static_per_rank, abs=2 * 8)
