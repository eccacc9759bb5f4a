"""docs/train.md ("Train with it") is executed block by block, so its examples cannot rot."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

DOC = (Path(__file__).parent.parent / "docs" / "train.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, re.S)
SECTIONS = ["Hugging Face Trainer", "accelerate", "PyTorch Lightning", "Mixed precision", "A plain loop",
            "torch.compile", "PEFT (LoRA)"]

pytestmark = pytest.mark.torch


def _block_of(section: str) -> str:
    text = DOC.split(f"## {section}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_page_has_a_block_for_each_place_users_train():
    for section in SECTIONS:
        assert "hcv." in _block_of(section), section
    assert len(BLOCKS) == len(SECTIONS) + 2  # plus the one-liner and the shared setup


@pytest.mark.parametrize("section", ["one-liner", *SECTIONS])
def test_block_runs(section, tmp_path, monkeypatch, capsys):
    for name in ("transformers", "accelerate", "pytorch_lightning", "peft"):
        if name in DOC and (section != "one-liner" or name == "transformers"):
            pytest.importorskip(name)
    import hchain_viz as hcv
    from hchain_viz.runtime.train.inplace import is_applied

    monkeypatch.chdir(tmp_path)  # the Trainer writes its output_dir here
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(BLOCKS[1], "docs/train.md setup", "exec"), scope)
        block = BLOCKS[0] if section == "one-liner" else _block_of(section)
        exec(compile(block, f"docs/train.md {section}", "exec"), scope)
    model = scope["model"] if "model" in scope else scope["lora"].get_base_model()
    if section == "A plain loop":
        assert not is_applied(model) and scope["schedule"].n_recomputed > 0
    else:
        state = vars(model)["_hcv_applied"]
        assert state.schedule.n_recomputed > 0  # 500 KiB is below store-all: the schedule recomputes
        assert "recomputed forwards" in capsys.readouterr().out
        assert state.native == (section == "torch.compile")
    if section == "Hugging Face Trainer":
        assert (tmp_path / "out" / "checkpoint-3").exists()
    del hcv
