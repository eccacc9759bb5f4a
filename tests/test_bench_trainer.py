"""bench trainer: an applied store-all schedule against the plain GPT-2 in Hugging Face Trainer steps."""

from __future__ import annotations

import pytest


def test_trainer_bench_times_both_kinds_in_hf_trainer_steps(capsys):
    """bench trainer: one row per size with both kinds timed over the steps asked for (the first two of each Trainer
    dropped: the executor learns in its second), a ratio, the page faults of each kind and the goal."""
    pytest.importorskip("transformers")
    from hchain_viz.__main__ import main

    main(["bench", "trainer", "--sizes", "1x32x16", "--batch", "2", "--rounds", "1", "--steps", "4"])
    out = capsys.readouterr().out
    table = out[out.index("size "):].splitlines()
    row = table[1].split()
    assert row[0] == "1x32x16" and row[1] == "2"  # 1 round x (4 - 2) timed steps
    plain, applied, ratio = float(row[2]), float(row[3]), float(row[4])
    assert plain > 0 and applied > 0 and abs(ratio - applied / plain) < 0.05 * ratio  # the times are printed rounded
    assert "/" in row[6] and row[-2] == "1.03" and row[-1] in ("yes", "NO")


def test_trainer_bench_needs_a_step_after_the_warm_up():
    from hchain_viz.__main__ import main

    with pytest.raises(SystemExit):
        main(["bench", "trainer", "--steps", "2"])
