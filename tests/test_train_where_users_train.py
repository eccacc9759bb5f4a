"""A schedule applied in place trains where users already train, with the real libraries and tiny random models on
CPU: Hugging Face's Trainer with default TrainingArguments, accelerate's Accelerator.prepare in a plain loop,
PyTorch Lightning's Trainer, a PEFT LoRA model and DistributedDataParallel (gloo, two processes). Each gives the
losses and weights of the same library on the plain model, bitwise; Hugging Face's own checkpointing on top of a
schedule is refused, never run twice silently."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from gloo import gloo_rank
from tiny_lm import BATCH, SEQ, VOCAB, Tokens, fit_with_lightning
from torch import nn

import hchain_viz as hcv
from hchain_viz.errors import DoubleCheckpointing

pytestmark = pytest.mark.torch



def _gpt2(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


def _batch() -> dict[str, torch.Tensor]:
    data = Tokens()
    return {k: torch.stack([data[i][k] for i in range(BATCH)]) for k in data[0]}


def _apply_schedule(model: nn.Module) -> nn.Module:
    """Apply to ``model``, in place, a schedule profiled on ``_batch()`` that recomputes (half-way between the least
    budget and store-all)."""
    chain = hcv.profile(model, _batch(), warmup=0, repeats=1, progress=False)
    sol = hcv.solve(chain)
    schedule = sol.schedule((sol.min_budget + sol.store_all_peak) // 2)
    assert schedule.n_recomputed > 0
    hcv.apply(model, schedule, chain=chain)
    return model


def _losses_of(model: nn.Module) -> tuple[list, object]:
    """Record the loss of every training forward (a forward hook: the library under test calls the model)."""
    losses: list[torch.Tensor] = []

    def hook(module, args, kwargs, out):
        state = vars(module).get("_hcv_applied")
        if module.training and not (state is not None and state.bypass):  # not the stages being traced
            losses.append(out.loss.detach().clone())

    return losses, model.register_forward_hook(hook, with_kwargs=True)


def _hf_train(model: nn.Module, out_dir: str, data: Tokens | None = None, **args) -> list[torch.Tensor]:
    import transformers

    losses, handle = _losses_of(model)
    # Default TrainingArguments: only where to write and how many steps (no report_to: the defaults stay offline).
    args = {"max_steps": 3, **args}
    targs = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=BATCH, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=targs, train_dataset=data or Tokens()).train()
    handle.remove()
    return losses


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_hf_trainer_with_default_arguments_trains_like_the_plain_model(tmp_path):
    model = _gpt2()
    plain = copy.deepcopy(model)
    plain.config.use_cache = False  # the reference: the same Trainer on the plain model, KV cache off
    _apply_schedule(model)
    got = _hf_train(model, str(tmp_path / "applied"))
    want = _hf_train(plain, str(tmp_path / "plain"))
    assert len(got) == len(want) == 3
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert _same_weights(model, plain)
    # The Trainer kept every column (it reads forward's signature) and passed its loss argument, traced once more
    state = vars(model)["_hcv_applied"]
    assert sorted(state.structure.keys) == ["attention_mask", "input_ids", "labels"]
    assert [key for key, _ in state.executors] == [("num_items_in_batch",)]
    assert (tmp_path / "applied" / "checkpoint-3" / "model.safetensors").exists()  # save_pretrained ran


def test_hf_trainer_epochs_ending_with_a_smaller_batch_train_like_the_plain_model(tmp_path):
    """A dataset whose size is no multiple of the batch: with default TrainingArguments (dataloader_drop_last=False)
    every epoch ends with a smaller batch, which the schedule takes (its stages traced again for it)."""
    model = _gpt2()
    plain = copy.deepcopy(model)
    plain.config.use_cache = False
    _apply_schedule(model)
    data = Tokens(2 * BATCH + 3)  # batches of 4, 4 and 3 samples an epoch
    got = _hf_train(model, str(tmp_path / "applied"), data, max_steps=-1, num_train_epochs=2)
    want = _hf_train(plain, str(tmp_path / "plain"), data, max_steps=-1, num_train_epochs=2)
    assert len(got) == len(want) == 6
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    assert _same_weights(model, plain)
    assert ("num_items_in_batch", "batch=3") in [key for key, _ in vars(model)["_hcv_applied"].executors]


def test_hf_trainer_gradient_checkpointing_on_an_applied_schedule_is_refused(tmp_path):
    model = _gpt2(layers=1)
    _apply_schedule(model)
    with pytest.raises(DoubleCheckpointing, match="already checkpoints"):
        _hf_train(model, str(tmp_path), gradient_checkpointing=True)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # nothing was turned on


def test_accelerate_prepare_in_a_plain_loop():
    accelerate = pytest.importorskip("accelerate")
    results = []
    for applied in (True, False):
        model = _apply_schedule(_gpt2()) if applied else _gpt2()
        accelerator = accelerate.Accelerator(cpu=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH)
        net, opt, loader = accelerator.prepare(model, opt, loader)
        assert accelerator.unwrap_model(net) is model
        losses = []
        torch.manual_seed(0)
        for batch in loader:
            loss = net(**batch, use_cache=False).loss if not applied else net(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results.append((losses, model))
    (got, applied_model), (want, plain_model) = results
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert _same_weights(applied_model, plain_model)


def test_pytorch_lightning_trainer_on_a_module_whose_model_has_a_schedule():
    runs = []
    for applied in (True, False):
        model = _apply_schedule(_gpt2()) if applied else _gpt2()
        runs.append(fit_with_lightning(model, (lambda m, batch: m(**batch)) if applied else
                                       (lambda m, batch: m(**batch, use_cache=False))))
    got, want = runs
    assert len(got.losses) == 3 and all(torch.equal(a, b) for a, b in zip(got.losses, want.losses))
    assert _same_weights(got.model, want.model)
    assert list(got.state_dict()) == list(want.state_dict())  # Lightning's checkpoint keys are the plain ones


def test_peft_lora_model_trains_by_a_schedule_applied_to_its_base_model():
    peft = pytest.importorskip("peft")
    runs = []
    for applied in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lora = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.1))
        base = lora.get_base_model()
        if applied:  # profiled after the adapters were added: the stages run them
            _apply_schedule(base)
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        torch.manual_seed(0)
        for _ in range(2):
            batch = _batch()
            loss = (lora(**batch) if applied else lora(**batch, use_cache=False)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, lora))
    (got, lora_a), (want, lora_p) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert _same_weights(lora_a, lora_p)


def test_adapters_added_after_applying_are_refused():
    peft = pytest.importorskip("peft")
    model = _gpt2(layers=1)
    _apply_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"]))
    with pytest.raises(hcv.HChainError, match="changed after the schedule was applied"):
        lora(**_batch())


# ---------------------------------------------------------------------------------------------- DDP
@gloo_rank
def _ddp_worker(rank: int, world: int, out_dir: str, schedule_json: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    record = {}
    for label in ("plain", "applied"):
        model, x, y = _mlp()
        if label == "applied":
            hcv.apply(model, hcv.Schedule.from_json(schedule_json))
        losses = _two_steps(DDP(model), model, x, y, rank, world)
        record[label] = (losses, [p.detach().clone() for p in model.parameters()])
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


def _two_steps(net, model, x, y, rank: int, world: int) -> list[torch.Tensor]:
    """Two SGD steps of ``net`` (``model`` wrapped, or itself) on this rank's share of the batch; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    losses = []
    for step in range(2):
        torch.manual_seed(10 * rank + step)
        loss = nn.functional.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, x, y


@pytest.mark.slow
def test_distributed_data_parallel_on_an_applied_model_gloo_two_processes(tmp_path):
    _two_ranks_train_like_plain(_ddp_worker, tmp_path)


@gloo_rank
def _fsdp_worker(rank: int, world: int, out_dir: str, schedule_json: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    record = {}
    for label in ("plain", "applied"):
        model, x, y = _mlp()
        for stage in model:
            fully_shard(stage, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if label == "applied":  # after sharding, on the root: its forward hooks run around the schedule
            hcv.apply(model, hcv.Schedule.from_json(schedule_json))
        losses = _two_steps(model, model, x, y, rank, world)
        record[label] = (losses, [p.detach().to_local().clone() for p in model.parameters()])
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_fsdp2_fully_shard_then_apply_gloo_two_processes(tmp_path):
    _two_ranks_train_like_plain(_fsdp_worker, tmp_path)


def _two_ranks_train_like_plain(worker, tmp_path) -> None:
    """Run ``worker`` on two gloo ranks with a recomputing schedule of ``_mlp``; each rank's losses and parameters
    of the applied model must equal the plain model's bitwise."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed missing")
    model, x, y = _mlp()
    chain = hcv.profile(model, x.chunk(2)[0], warmup=0, repeats=1, progress=False)
    solution = hcv.solve(chain)
    schedule = solution.schedule(solution.min_budget)
    assert schedule.n_recomputed > 0
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path), schedule.to_json()), nprocs=2)
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        (lp, wp), (la, wa) = record["plain"], record["applied"]
        assert all(torch.equal(a, b) for a, b in zip(la, lp))
        assert all(torch.equal(a, b) for a, b in zip(wa, wp))
