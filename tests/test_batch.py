"""runtime/batch.py (profile_batches), the ``fit`` command and the throughput figure: a chain as a function of the
batch size, checked on a held-out size, and the largest batch per strategy on a device (docs/design.md §7)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import hchain_viz as hcv  # noqa: E402
from hchain_viz.__main__ import main  # noqa: E402
from hchain_viz.core import device  # noqa: E402
from hchain_viz.errors import HChainError, ProfileError  # noqa: E402

pytestmark = pytest.mark.torch

SMALL = dict(in_features=32, widths=(256, 64, 512))


def make(b: int):
    return hcv.models.mlp_chain(batch=b, **SMALL)[1:]


@pytest.fixture(scope="module")
def fitted():
    model = hcv.models.mlp_chain(**SMALL)[0]
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, hcv.profile_batches(model, make, (8, 16), optimizer=opt, repeats=1, warmup=0,
                                           progress=False)


def test_profile_batches_fits_and_checks_on_a_held_out_size(fitted):
    model, _, chain = fitted
    assert chain.batch == 8 and chain.fixed is not None and chain.meta["batch_sizes"] == [8, 16]
    check = chain.meta["batch_fit_check"]
    assert check["batch"] == 24
    assert abs(check["store_all_peak"]) < 0.02 and check["size_max"] < 0.05  # sizes are linear in the batch size
    # the fit reproduces a fresh profile's sizes at a size it never saw
    x, loss = make(40)
    fresh = hcv.profile(model, x, loss, repeats=1, warmup=0, progress=False)
    got = hcv.at_batch(chain, 40)
    assert got.x == fresh.x
    assert got.xbar == pytest.approx(fresh.xbar, rel=0.01)


def test_profile_batches_argument_errors(fitted):
    model = fitted[0]
    with pytest.raises(HChainError, match="two or more"):
        hcv.profile_batches(model, make, (8, 8))
    with pytest.raises(HChainError, match="so the check is honest"):
        hcv.profile_batches(model, make, (8, 16), check=16)
    with pytest.raises(ProfileError, match="make_batch\\(8\\) failed"):
        hcv.profile_batches(model, lambda b: 1 / 0, (8, 16))


def test_fit_command_prints_the_largest_batch_per_strategy(capsys, tmp_path):
    out = tmp_path / "chain.json"
    code = main(["fit", "mlp_chain", "--device-memory", "200MiB", "--batches", "8,16", "--repeats", "1",
                 "--optimizer", "sgd-momentum", "--world-size", "2", "--quiet", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    chain = hcv.Chain.from_json(out)
    assert chain.fixed.world_size == 2 and chain.fixed.optimizer == "SGD"
    for s in device.BATCH_STRATEGIES:
        p = device.largest_batch(chain, "200MiB", s)
        row = next(line for line in text.splitlines() if line.startswith(s + " "))
        assert row.split()[1] == str(p.batch)  # the table shows what the core computes
    assert "fit checked at batch 24" in text and "sharded over 2 ranks" in text
    assert main(["fit", "mlp_chain", "--device-memory", "lots", "--quiet"]) == 1
    assert "cannot read the device memory" in capsys.readouterr().err


def test_throughput_figure_marks_the_largest_batch(fitted):
    chain = fitted[2]
    fig = hcv.figures.throughput(chain, "64MiB", batches=[8, 64, 512, 4096])
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    stars = [t for t in fig.data if t.mode == "markers+text"]
    assert [t.name for t in lines] == ["optimal", "store-all", "checkpoint_sequential"]
    for t, s in zip(stars, device.BATCH_STRATEGIES):
        assert t.x[0] == device.largest_batch(chain, "64MiB", s).batch
    assert all(b <= stars[0].x[0] for b in lines[0].x)  # only batches that fit are drawn
    with pytest.raises(HChainError, match="profile_batches"):
        hcv.figures.throughput(hcv.Chain.random(3), "1GiB")
