"""Allocation tracking: how many bytes tensors hold, and the current / peak bytes allocated while code runs.

- :func:`tensors` / :func:`map_tensors` walk the tensors inside nested tuples / lists / dicts.
- :func:`nbytes` counts the bytes held by the tensors inside a (nested) output, each storage once.
- :class:`AllocationTracker` is a ``TorchDispatchMode`` that sees every ATen op (forward and backward), notes each
  storage an op creates, and follows it with a weak reference until it is freed — the approach of PyTorch's
  ``torch.distributed._tools.mem_tracker``. It works on any device and is how memory is measured on the CPU, where
  PyTorch keeps no allocator statistics. It sees tensors, not the scratch buffers a kernel allocates and frees
  internally (e.g. convolution workspaces), so on the CPU it measures tensor memory exactly and nothing else.
- :class:`MemoryMeter` gives bytes allocated above the moment it was entered: CUDA allocator statistics on a GPU, an
  AllocationTracker elsewhere. Profiling and measuring both use it, so predicted and measured memory agree on terms.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["tensors", "map_tensors", "cuda_devices", "storage_of", "storages", "nbytes", "AllocationTracker",
           "MemoryMeter"]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples / lists / dicts, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in tensors(o)]
    return []


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor ``t`` inside nested tuples / lists / dicts replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, Mapping):  # as in tensors(): what is counted is also what is copied or moved
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def cuda_devices(obj: Any) -> list[int]:
    """The indices of the CUDA devices the tensors in ``obj`` are on (what ``torch.random.fork_rng`` needs)."""
    return sorted({t.device.index or 0 for t in tensors(obj) if t.device.type == "cuda"})


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t``; None for meta tensors and layouts without one (sparse, nested)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storages(obj: Any) -> dict[int, torch.UntypedStorage]:
    """The distinct storages behind the tensors in ``obj``, keyed by ``id`` (a view shares its base's storage)."""
    out = {}
    for t in tensors(obj):
        st = storage_of(t)
        if st is not None:
            out[id(st)] = st
    return out


def nbytes(obj: Any, exclude: Iterable[torch.UntypedStorage] = ()) -> int:
    """Bytes held by the tensors in ``obj``: each storage counted once, whole (a slice keeps its whole base alive).

    Storages in ``exclude`` are not counted. A tensor without a plain storage (sparse) counts its elements' bytes.
    """
    skip = {id(s) for s in exclude}
    loose = sum(t.numel() * t.element_size() for t in tensors(obj)
                if t.device.type != "meta" and storage_of(t) is None)
    return loose + sum(st.nbytes() for k, st in storages(obj).items() if k not in skip)


class AllocationTracker(TorchDispatchMode):
    """Current and peak bytes of the storages created while the mode is active (on every device but ``meta``).

    Use as a context manager. ``current`` starts at 0 on entry and follows frees even after exit (each tracked
    storage carries a weak reference whose callback subtracts its size). ``peak`` is the largest ``current`` seen
    after any op; :meth:`reset_peak` lowers it to ``current``. A storage counts as created by an op when it is behind
    one of the op's outputs and behind none of its inputs (so views and in-place ops create nothing).
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def created(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` was created while tracking (and is still alive)."""
        ref = self._refs.get(id(storage))
        return ref is not None and ref() is storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {id(st) for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and (st := storage_of(t)) is not None}
        for t in tree_leaves(out):
            st = storage_of(t) if isinstance(t, torch.Tensor) else None
            if st is None:
                continue
            key = id(st)
            if self.created(st):
                self._resize(key, st.nbytes())  # out= and resize_ ops may grow a storage we follow
            elif key not in seen:
                self._follow(st)
        if self.current > self.peak:
            self.peak = self.current
        return out

    def _follow(self, st: torch.UntypedStorage) -> None:
        key, size = id(st), st.nbytes()
        self._sizes[key] = size
        self.current += size
        self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._freed(key))

    def _resize(self, key: int, size: int) -> None:
        self.current += size - self._sizes[key]
        self._sizes[key] = size

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


class MemoryMeter:
    """Bytes allocated on ``device`` above the level at entry: ``current``, ``peak`` and :meth:`reset_peak`.

    CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` (every tensor on the device, in the
    allocator's 512-byte blocks). Other devices: an :class:`AllocationTracker` (tensors created inside the block).
    Meters do not nest on CUDA (each resets the device's peak statistic).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.tracker = None if self.cuda else AllocationTracker()  # the CPU tracker, shared with callers
        self._base = 0

    def __enter__(self) -> MemoryMeter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        else:
            self.tracker.__exit__(*exc)

    @property
    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self._base
        return self.tracker.current

    @property
    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return self.tracker.peak

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.reset_peak()
