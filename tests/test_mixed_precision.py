"""Mixed precision as transformers are trained (docs/train.md, "Mixed precision"): a schedule applied in place or
wrapped trains under ``torch.autocast`` bfloat16 and with bfloat16 weights exactly as the plain model does in the
same precision (losses and gradients bitwise, dropout replayed), in Hugging Face's Trainer(bf16=True), accelerate's
mixed_precision="bf16" with gradient accumulation, Lightning's precision="bf16-mixed" and FSDP2's
MixedPrecisionPolicy; profiled under autocast, its predicted activation peak bounds the measured one within 10%.
Tiny random configs on the CPU."""

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
from hchain_viz.errors import ProfileError
from hchain_viz.runtime.precision import PrecisionWarning
from hchain_viz.runtime.train.wrap import ScheduledModule

pytestmark = pytest.mark.torch
transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _model(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny random ``name`` in train mode (dropout on where the family has it) and a training batch for it."""
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    configs = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **small, num_key_value_heads=2, max_position_embeddings=SEQ)),
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **small, num_key_value_heads=2, max_position_embeddings=SEQ)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0)),
        "bert": lambda: transformers.BertForMaskedLM(transformers.BertConfig(
            **small, max_position_embeddings=SEQ)),
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)),
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = configs[name]()
    model.train()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.roll(1, dims=1) if name == "t5" else ids.clone()}
    return model, batch


def _apply_schedule(model: nn.Module, batch: dict, **profile_args) -> nn.Module:
    """Apply to ``model`` in place a schedule that recomputes, profiled on ``batch`` (in the precision around the
    call, or ``autocast=``)."""
    chain = hcv.profile(model, batch, warmup=0, repeats=1, progress=False, **profile_args)
    sol = hcv.solve(chain)
    schedule = sol.schedule((sol.min_budget + sol.store_all_peak) // 2)
    assert schedule.n_recomputed > 0
    return hcv.apply(model, schedule, chain=chain)


def _steps(model: nn.Module, batch: dict, autocast: bool, steps: int = 2) -> tuple[list, list]:
    """``steps`` SGD steps (under CPU autocast bfloat16 when ``autocast``); the losses and the last gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = (model(batch) if isinstance(model, ScheduledModule) else model(**batch)).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, grads


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2", "bert", "t5"])
@pytest.mark.parametrize("precision", ["autocast", "weights"])
def test_an_applied_schedule_trains_like_the_plain_model_in_bf16(name, precision):
    """Autocast bfloat16 over float32 weights (profiled with autocast=), or bfloat16 weights: the same losses and
    gradients as the plain model in that precision, bitwise, dropout included; the chain names its precision."""
    model, batch = _model(name)
    autocast = precision == "autocast"
    if not autocast:
        model.to(BF16)
    plain = copy.deepcopy(model)
    _apply_schedule(model, batch, **({"autocast": BF16} if autocast else {}))
    chain = vars(model)["_hcv_applied"].chain
    assert chain.meta["precision"] == ("autocast bfloat16 (cpu) over float32 weights" if autocast
                                       else "bfloat16, no autocast")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # trained in the precision profiled: no warning
        got = _steps(model, batch, autocast)
    want = _steps(plain, batch, autocast)
    assert got[0][0].dtype == want[0][0].dtype and got[1][0].dtype == (torch.float32 if autocast else BF16)
    assert _bitwise(got[0], want[0]), (got[0], want[0])
    assert _bitwise(got[1], want[1])


def test_the_native_form_trains_like_the_plain_model_under_autocast():
    """Nested torch.utils.checkpoint regions (apply(..., native=True)) under autocast bfloat16: bitwise too."""
    model, batch = _model("bert")
    plain = copy.deepcopy(model)
    chain = hcv.profile(model, batch, warmup=0, repeats=1, progress=False, autocast=BF16)
    sol = hcv.solve(chain)
    schedule = sol.schedule((sol.min_budget + sol.store_all_peak) // 2)
    assert schedule.n_recomputed > 0
    hcv.apply(model, schedule, chain=chain, native=True)
    got, want = _steps(model, batch, autocast=True), _steps(plain, batch, autocast=True)
    assert _bitwise(got[0], want[0]) and _bitwise(got[1], want[1])


def test_a_schedule_profiled_in_float32_trains_under_autocast_and_warns_naming_both():
    """The stages are traced again for autocast (their dtype casts are fixed when traced), so the step is the plain
    model's, bitwise; the memory was planned for float32, which the first step says, once; hcv.wrap alike."""
    model, batch = _model("llama")
    plain = copy.deepcopy(model)
    _apply_schedule(model, batch)
    with pytest.warns(PrecisionWarning, match=r"runs in autocast bfloat16 \(cpu\) over float32 weights, but its "
                                              r"schedule was profiled in float32, no autocast"):
        got = _steps(model, batch, autocast=True)
    assert _bitwise(got[0], _steps(plain, batch, autocast=True)[0])
    hcv.remove(model)
    chain = hcv.profile(model, batch, warmup=0, repeats=1, progress=False)
    sol = hcv.solve(chain)
    schedule = sol.schedule((sol.min_budget + sol.store_all_peak) // 2)
    assert schedule.meta["precision"] == chain.meta["precision"]  # the solver carries the profiled precision
    wrapped = hcv.wrap(model, schedule)
    with pytest.warns(PrecisionWarning, match="profiled in float32"):
        got = _steps(wrapped, batch, autocast=True)
    assert _bitwise(got[0], _steps(plain, batch, autocast=True)[0])


def test_stages_traced_in_one_precision_refuse_another_and_are_cached_per_precision():
    """A torch.export stage's dtype casts are those it was traced in: run in another precision it says so, never
    the cryptic dtype assertion of its graph; the extraction cache answers per precision."""
    from hchain_viz.errors import NotSequentialError
    from hchain_viz.runtime.graph import cached_stages, extract_stages

    model, batch = _model("qwen2")
    stages = extract_stages(model, batch)
    assert stages[0][1].method == "export"
    with torch.autocast("cpu", dtype=BF16):
        assert cached_stages(model) is None
        with pytest.raises(NotSequentialError, match=r"traced with torch.export in float32, no autocast, .* now runs "
                                                     r"in autocast bfloat16 \(cpu\) over float32 weights"):
            stages[0][1](batch)
        again = extract_stages(model, batch)
        assert cached_stages(model) is again
    assert cached_stages(model) is stages


def test_a_precision_the_profile_cannot_run_is_refused():
    model, batch = _model("gpt2")
    with pytest.raises(ProfileError, match=r"autocast=torch.float32: autocast runs in torch.bfloat16 or"):
        hcv.profile(model, batch, autocast=torch.float32, progress=False)
    with pytest.raises(ProfileError, match="autocast=torch.int8"):
        hcv.checkpoint(model, batch, budget="1MiB", autocast=torch.int8, progress=False, verbose=False)


# ---------------------------------------------------------------------------------------------- libraries
def test_hf_trainer_bf16_trains_like_the_plain_model(tmp_path):
    """Trainer(bf16=True) autocasts inside its step, after hcv.checkpoint ran: checkpoint(autocast=torch.bfloat16)
    profiles in that precision. The loss argument the Trainer adds (num_items_in_batch) and accelerate's autocast
    wrapper around the forward are taken; the losses are the plain model's, bitwise."""
    runs = []
    for applied in (True, False):
        model, _ = _model("gpt2")
        if applied:
            batch = {k: torch.stack([Tokens()[i][k] for i in range(BATCH)]) for k in Tokens()[0]}
            sol = hcv.solve(hcv.profile(model, batch, warmup=0, repeats=1, progress=False, autocast=BF16))
            budget = (sol.min_budget + sol.store_all_peak) // 2
            hcv.checkpoint(model, batch, budget, autocast=BF16, progress=False, verbose=False)
            assert vars(model)["_hcv_applied"].schedule.n_recomputed > 0
        losses: list[torch.Tensor] = []

        def hook(module, args, kwargs, out, losses=losses):
            state = vars(module).get("_hcv_applied")
            if module.training and not (state is not None and state.bypass):  # not the stages being traced
                losses.append(out.loss.detach().clone())

        handle = model.register_forward_hook(hook, with_kwargs=True)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(applied)), max_steps=3, bf16=True,
                                              per_device_train_batch_size=BATCH, use_cpu=True, report_to=[],
                                              save_strategy="no")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", PrecisionWarning)
            transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
        handle.remove()
        runs.append((losses, model))
    (got, a), (want, b) = runs
    assert len(got) == 3 and _bitwise(got, want) and got[0].dtype == torch.float32
    assert _bitwise(list(a.state_dict().values()), list(b.state_dict().values()))


def test_accelerate_bf16_with_gradient_accumulation_trains_like_the_plain_model():
    accelerate = pytest.importorskip("accelerate")
    runs = []
    for applied in (True, False):
        model, batch = _model("qwen2")
        if applied:  # profiled on a micro-batch, as each forward gets
            _apply_schedule(model, {k: v[:BATCH // 2] for k, v in batch.items()}, autocast=BF16)
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(Tokens(), batch_size=BATCH // 2)
        net, opt, loader = accelerator.prepare(model, opt, loader)
        losses = []
        torch.manual_seed(0)
        for step in loader:
            with accelerator.accumulate(net):
                loss = net(input_ids=step["input_ids"], labels=step["labels"]).loss
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, model))
    (got, a), (want, b) = runs
    assert len(got) == 6 and _bitwise(got, want)
    assert _bitwise(list(a.state_dict().values()), list(b.state_dict().values()))


def test_lightning_bf16_mixed_trains_like_the_plain_model():
    runs = []
    for applied in (True, False):
        model, batch = _model("llama")
        if applied:
            _apply_schedule(model, batch, autocast=BF16)
        runs.append(fit_with_lightning(model, lambda m, batch: m(input_ids=batch["input_ids"], labels=batch["labels"]),
                                       precision="bf16-mixed"))
    got, want = runs
    assert len(got.losses) == 3 and _bitwise(got.losses, want.losses)
    assert _bitwise(list(got.model.state_dict().values()), list(want.model.state_dict().values()))


# ---------------------------------------------------------------------------------------------- FSDP2
def _mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, x, y


@gloo_rank
def _fsdp_bf16_worker(rank: int, world: int, out_dir: str, schedule_json: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    record = {}
    for label in ("plain", "applied"):
        model, x, y = _mlp()
        for stage in model:
            fully_shard(stage, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if label == "applied":
            hcv.apply(model, hcv.Schedule.from_json(schedule_json))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrecisionWarning)
            for step in range(2):
                torch.manual_seed(10 * rank + step)
                out = model(xb)
                loss = nn.functional.cross_entropy(out.float(), yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append((loss.detach(), out.dtype))
        record[label] = (losses, [p.detach().to_local().clone() for p in model.parameters()])
        # the sharded parameters stay float32; the policy's bfloat16 copies compute, as the schedule was profiled
        record[f"{label} warned"] = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_fsdp2_with_bf16_parameters_trains_like_the_plain_model_gloo_two_processes(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed missing")
    model, x, y = _mlp()
    chain = hcv.profile(model.to(BF16), x.chunk(2)[0].to(BF16), warmup=0, repeats=1, progress=False)
    solution = hcv.solve(chain)
    schedule = solution.schedule(solution.min_budget)
    assert schedule.n_recomputed > 0
    mp.spawn(_fsdp_bf16_worker, args=(2, str(tmp_path / "init"), str(tmp_path), schedule.to_json()), nprocs=2)
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        (lp, wp), (la, wa) = record["plain"], record["applied"]
        assert [dtype for _, dtype in la] == [BF16, BF16]  # the stages ran in the policy's bfloat16
        assert record["applied warned"] == []  # profiled in bfloat16, run in bfloat16: no precision warning
        assert _bitwise([v for v, _ in la], [v for v, _ in lp])
        assert _bitwise(wa, wp)


_SHARDINGS = ("layers and root", "root only")


@gloo_rank
def _fsdp_hf_worker(rank: int, world: int, out_dir: str, name: str, schedule_json: str, chain_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)

    def sharded(layers: bool, applied_first: bool = False) -> tuple[nn.Module, dict]:
        model, batch = _model(name)
        if applied_first:
            hcv.apply(model, hcv.Schedule.from_json(schedule_json))
        if layers:
            for layer in model.model.layers if name == "llama" else model.transformer.h:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, {k: v.chunk(world)[rank] for k, v in batch.items()}

    record = {}
    for sharding in _SHARDINGS:
        for label in ("plain", "applied"):
            model, batch = sharded(sharding == "layers and root")
            if label == "applied":  # sharded first, then applied (the chain's parameters: gathered in bfloat16)
                chain = torch.load(chain_path, weights_only=False)
                hcv.apply(model, hcv.Schedule.from_json(schedule_json), chain=chain)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            steps = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PrecisionWarning)
                for step in range(2):
                    torch.manual_seed(step)  # dropout (GPT-2) draws alike on both ranks and in both runs
                    out = model(**batch)
                    # which parameters are sharded between the forward and the backward: the layers' (resharded
                    # after their forward, by FSDP2 or by the stages), not the model's own (FSDP2 keeps the root's)
                    between = [isinstance(p, DTensor) for p in model.parameters()]
                    out.loss.backward()
                    # after the backward every parameter is resharded, its gradient reduce-scattered
                    resharded = all(isinstance(p, DTensor) and isinstance(p.grad, DTensor)
                                    for p in model.parameters())
                    grads = [p.grad.full_tensor().clone() for p in model.parameters()]
                    opt.step()
                    opt.zero_grad()
                    steps.append((out.loss.detach(), out.logits.dtype, grads, resharded, between))
            record[sharding, label] = steps
            record[sharding, label, "warned"] = [str(w.message) for w in caught
                                                 if issubclass(w.category, PrecisionWarning)]
    refused = {}
    try:  # applied, then sharded: the stages would read parameters FSDP2 replaced
        model, batch = sharded(True, applied_first=True)
        model(**batch).loss.backward()
    except hcv.HChainError as e:
        refused["applied first"] = (type(e).__name__, str(e))
    model, batch = sharded(True)
    try:  # hcv.wrap calls the stages, never the model: no FSDP2 hook would gather or reduce-scatter around them
        hcv.wrap(model, hcv.Schedule.from_json(schedule_json))(batch)
    except hcv.HChainError as e:
        refused["wrapped"] = (type(e).__name__, str(e))
    model, batch = _model(name)
    for layer in model.model.layers if name == "llama" else model.transformer.h:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    try:  # the layers sharded, not the model: no FSDP2 hook would gather or reduce-scatter around the stages
        hcv.apply(model, hcv.Schedule.from_json(schedule_json))
    except hcv.HChainError as e:
        refused["layers only"] = (type(e).__name__, str(e))
    record["refused"] = refused
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fsdp2_bf16_on_a_hugging_face_model_trains_like_the_plain_sharded_model_gloo_two_processes(name, tmp_path):
    """fully_shard (per layer and the model, or the model only) with MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32), then hcv.apply: the traced stages read the parameters FSDP2 gathers, in bfloat16; the
    losses and the gathered gradients are those of the same sharded model without a schedule, bitwise (GPT-2's
    tied embedding and dropout included); the layers are resharded after the forward as FSDP2 reshards them, and
    every parameter after the backward. Applied before
    fully_shard, the layers sharded without the model, or a sharded model wrapped (hcv.wrap calls the stages, not
    the model, so no FSDP2 hook gathers or reduce-scatters) is refused plainly."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed missing")
    model, batch = _model(name)
    # profiled on a bfloat16 copy: FSDP2's gathered parameters compute in bfloat16
    applied = vars(_apply_schedule(model.to(BF16), {k: v.chunk(2)[0] for k, v in batch.items()}))["_hcv_applied"]
    torch.save(applied.chain, tmp_path / "chain.pt")
    mp.spawn(_fsdp_hf_worker, nprocs=2, args=(2, str(tmp_path / "init"), str(tmp_path), name,
                                              applied.schedule.to_json(), str(tmp_path / "chain.pt")))
    records = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for record in records:
        for sharding in _SHARDINGS:
            plain, applied = record[sharding, "plain"], record[sharding, "applied"]
            assert record[sharding, "applied", "warned"] == []  # profiled in bfloat16, run in bfloat16
            for (lp, dp, gp, rp, bp), (la, da, ga, ra, ba) in zip(plain, applied, strict=True):
                assert da == dp == BF16 and rp and ra
                assert ba == bp and any(ba) == (sharding == "layers and root"), (sharding, ba, bp)
                assert torch.equal(la, lp), (sharding, la, lp)
                assert _bitwise(ga, gp), sharding
        kind, message = record["refused"]["applied first"]
        assert kind == "ScheduleMismatch" and "parameters sharded" in message
        kind, message = record["refused"]["wrapped"]
        assert kind == "NotSequentialError" and "this is not its training call" in message
        kind, message = record["refused"]["layers only"]
        assert kind == "ScheduleMismatch" and "fully_shard(model)" in message
    # the gradients were reduced: both ranks (different halves of the batch) hold the same full gradients
    for sharding in _SHARDINGS:
        for (_, _, g0, *_), (_, _, g1, *_) in zip(records[0][sharding, "applied"], records[1][sharding, "applied"]):
            assert _bitwise(g0, g1)


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_profiled_under_autocast_predictions_bound_measured_peaks(name):
    """Profiled under autocast (activations in bfloat16, softmax inputs, norms and the loss in float32), each of four
    schedules measures within [0.9, 1.0] of its predicted activation peak, measured under the same autocast."""
    model, batch = _model(name)
    with torch.autocast("cpu", dtype=BF16):
        chain = hcv.profile(model, batch, warmup=0, repeats=1, progress=False)
        sol = hcv.solve(chain)
        lo, hi = sol.min_budget, sol.store_all_peak
        for k in range(4):
            schedule = sol.schedule(lo + (hi - lo) * k // 3)
            hcv.apply(model, schedule, chain=chain)
            ratio = hcv.measure(model, batch, repeats=1).peak_bytes / hcv.simulate(chain, schedule).peak_memory
            hcv.remove(model)
            print(f"{name} budget {k}/3: {schedule.n_recomputed} recomputed, measured / predicted {ratio:.3f}")
            assert 0.9 <= ratio <= 1.0, (k, ratio)
