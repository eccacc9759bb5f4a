"""Shared test settings: markers, CUDA auto-skip, deterministic torch where torch is used."""

from __future__ import annotations

import os

import pytest

# Keep hypothesis quick and reproducible in CI.
try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
    settings.register_profile("dev", max_examples=60, deadline=None)
    settings.load_profile("ci" if os.environ.get("CI") else "dev")
except ImportError:  # pragma: no cover
    pass


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _torch_single_thread():
    """Torch tests run with one intra-op thread: on 2 shared cores, more threads make them several times slower
    and timings noisy. Core-only runs never import torch for this."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
