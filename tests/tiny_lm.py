"""What the tests that train a tiny causal LM where users train (Trainer, accelerate, Lightning) share: the token
dataset and a Lightning fit."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hchain_viz.runtime.precision import PrecisionWarning

SEQ, BATCH, VOCAB = 16, 4, 64


class Tokens(torch.utils.data.Dataset):
    """Fixed random token sequences with an attention mask, as a tokenized dataset gives them (causal LM: the labels
    are the tokens)."""

    def __init__(self, size: int = 3 * BATCH):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": ids.clone()}


def fit_with_lightning(model: nn.Module, forward: Callable[[nn.Module, dict], Any], precision: str = "32-true",
                       steps: int = 3) -> Any:
    """Train ``model`` for ``steps`` steps of :class:`Tokens` with a Lightning Trainer on the CPU (AdamW, lr 1e-3,
    seeded), ``forward(model, batch)`` giving the Hugging Face output; returns the LightningModule, whose ``losses``
    are the step losses and ``model`` the trained model. A PrecisionWarning fails the fit."""
    pl = pytest.importorskip("pytorch_lightning")

    class LitLM(pl.LightningModule):
        def __init__(self, model: nn.Module):
            super().__init__()
            self.model = model
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            out = forward(self.model, batch)
            self.losses.append(out.loss.detach().clone())
            return out.loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    lit = LitLM(model)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", PrecisionWarning)
        trainer.fit(lit, torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
    return lit
