"""Allocation tracking: how many bytes tensors hold, and the current / peak bytes allocated while code runs.

- :func:`tensors` / :func:`map_tensors` walk the tensors inside nested tuples / lists / dicts.
- :func:`nbytes` counts the bytes held by the tensors inside a (nested) output, each storage once.
- :class:`AllocationLog` records what the device's allocator itself reports to PyTorch's profiler
  (``profile_memory``): every allocation and free, in order, with its address. It is how memory is measured on the
  CPU, where PyTorch keeps no allocator statistics, and how profiling tells which saved tensors a forward created.
  It changes nothing the code does: compiled code (``torch.compile``) stays compiled, unlike under a
  ``TorchDispatchMode``, which makes Dynamo run eager and mark the code as skipped for the rest of the process.
  It sees every tensor and every scratch buffer that goes through c10's allocator (convolution workspaces included);
  it does not see memory that bypasses it: oneDNN / MKL / OpenMP internal scratch, stack arrays inside compiled
  C++ kernels, Python objects, and memory allocated before the log started (only its frees would show, and those
  are ignored).
- :class:`AllocationTracker` is a ``TorchDispatchMode`` that notes each storage an ATen op creates and follows it with
  a weak reference (the approach of ``torch.distributed._tools.mem_tracker``). It sees tensors only (not scratch
  buffers), and it de-compiles compiled code (see above), so measuring no longer uses it.
- :class:`MemoryMeter` gives bytes allocated above the moment it was entered, split into spans by :meth:`mark`:
  CUDA allocator statistics on a GPU, an AllocationLog elsewhere. Profiling and measuring both use it, so predicted
  and measured memory agree on terms.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import ProfileError

__all__ = ["tensors", "map_tensors", "cuda_devices", "storage_of", "storages", "nbytes", "AllocationLog", "Span",
           "AllocationTracker", "MemoryMeter"]


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
    if t.is_meta:  # (not t.device.type: a device object per call, on the executor's per-tensor path)
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def transit_storages(inputs: list[torch.Tensor], candidates: list[bool], saved: set[int],
                     outputs: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages of a stage input x_i that no backward needs (``chain.transit``, docs/design.md §3.4), by data
    pointer: those of the tensors ``inputs[k]`` with ``candidates[k]`` (made by stage i-1 and not saved by its
    backward), that this stage's backward does not save either (``saved``: data pointers of what autograd saved) and
    that it does not hand on in ``outputs``. The profiler sums their bytes; the executor frees them after Fall(i)."""
    return split_inputs(inputs, candidates, saved, pointers(outputs))[0]


def consumed_storages(inputs: list[torch.Tensor], candidates: list[bool], saved: set[int],
                      outputs: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages of a stage input x_i that only this stage's backward needs (``chain.consumed``): candidates as
    in :func:`transit_storages` that this stage saves and does not hand on. The profiler sums their bytes; the
    executor frees them after B(i) when x_i is the output inside x̄_i."""
    return split_inputs(inputs, candidates, saved, pointers(outputs))[1]


def split_inputs(inputs: list[torch.Tensor], candidates: list[bool], saved: set[int], handed_on: set[int]
                 ) -> tuple[dict[int, torch.UntypedStorage], dict[int, torch.UntypedStorage]]:
    """(:func:`transit_storages`, :func:`consumed_storages`) in one pass over the inputs, given the data pointers of
    the outputs (the executor's per-stage path: a dense block's stages take every feature map so far)."""
    transit: dict[int, torch.UntypedStorage] = {}
    consumed: dict[int, torch.UntypedStorage] = {}
    for ptr, st in _candidate_storages(inputs, candidates).items():
        if ptr not in handed_on:
            (consumed if ptr in saved else transit)[ptr] = st
    return transit, consumed


def _candidate_storages(inputs: list[torch.Tensor], candidates: list[bool]) -> dict[int, torch.UntypedStorage]:
    """The storages of the candidate input tensors, by data pointer, less any that a non-candidate also holds."""
    found: dict[int, torch.UntypedStorage] = {}
    others: set[int] = set()
    for t, candidate in zip(inputs, candidates):
        st = storage_of(t)
        if st is None:
            continue
        if not candidate:
            others.add(st.data_ptr())
        elif st.nbytes():
            found[st.data_ptr()] = st
    return {ptr: st for ptr, st in found.items() if ptr not in others}


def pointers(ts: Iterable[torch.Tensor]) -> set[int]:
    """The data pointers of the storages behind ``ts``."""
    return {st.data_ptr() for t in ts if (st := storage_of(t)) is not None}


def made_storages(input_ptrs: set[int], output_ptrs: set[int], module: torch.nn.Module) -> set[int]:
    """Data pointers of the storages of the outputs (``output_ptrs``) that the stage made: not its inputs' (handed
    on), nor its parameters' or buffers' (never transit)."""
    made = output_ptrs - input_ptrs
    return made - pointers([*module.parameters(), *module.buffers()]) if made else made


def backward_handing_over(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Back-propagate the gradients into the outputs of ``pairs`` (output, gradient), handing both over to autograd:
    the list is emptied, and with no other reference left (the caller's job) autograd frees each gradient and each
    output it does not save as soon as it is done with it, as in eager mode. (``torch.autograd.backward(outs, grads)``
    would keep them all alive to the end through its arguments.) Nothing to do for no pairs."""
    if not pairs:
        return
    box = [tuple(g for _, g in pairs)]
    with torch.enable_grad():
        root = _Root.apply(box, *[o for o, _ in pairs])
    pairs.clear()
    torch.autograd.backward(root, torch.empty(0))


class _Root(torch.autograd.Function):
    """An empty tensor whose backward hands the gradients (kept only in ``box``) to the outputs."""

    @staticmethod
    def forward(ctx: Any, box: list, *outs: torch.Tensor) -> torch.Tensor:
        ctx.box = box
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = ctx.box.pop()
        ctx.box = None
        return (None, *grads)


def copy_with_layout(t: torch.Tensor, copies: dict[int, tuple]) -> torch.Tensor:
    """A detached copy of ``t`` with its sizes, strides and storage offset, in a copy of its whole storage.

    Tensors copied with the same ``copies`` dict that share a storage (q, k and v split from one projection) share one
    copy of it, as views again: what an op allocates for strided views (a matmul's contiguous copies) and whether an
    output aliases an input come out as with the originals. Without a plain storage: a plain clone."""
    st = storage_of(t)
    if st is None:
        return t.detach().clone()
    key = id(st)
    if key not in copies:
        copies[key] = (st, st.clone())  # keeps ``st`` alive, so its id is not reused while the dict is
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(copies[key][1], t.storage_offset(), t.size(),
                                                                t.stride())


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


@dataclass(frozen=True)
class Span:
    """One stretch of a measurement (between :meth:`MemoryMeter.mark` calls), in bytes above the level at entry:
    the level when it began, the highest level inside it, and the level when it ended."""

    start: int
    peak: int
    end: int


_MARK = "hchain_viz::mark"


class AllocationLog:
    """The allocations and frees ``device``'s allocator reports while the log is active (a context manager).

    Read it after the block: ``spans`` (one :class:`Span` per stretch between :meth:`mark` calls), ``peak`` and
    ``current`` (bytes above entry), and :meth:`created_addresses` (the memory allocated in a span and still alive
    at its end). Only memory allocated inside the block is followed: frees of older memory are ignored, so
    ``current`` starts at 0 and never counts what was resident before.

    It runs PyTorch's profiler with ``profile_memory`` and nothing else recorded (``torch.autograd``'s low-level
    entry points: a session costs under a millisecond, the public ``torch.profiler.profile`` about 100 ms). It cannot
    run inside another profiler session.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.spans: list[Span] = []
        self._alive: list[set[int]] = []  # per span: addresses allocated in it and alive at its end
        self._on = False

    def __enter__(self) -> AllocationLog:
        from torch._C._profiler import ProfilerActivity, _ExperimentalConfig
        from torch.autograd import ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

        if torch._C._autograd._profiler_enabled():
            raise ProfileError("memory is measured through PyTorch's profiler, which is already running; call "
                               "measure() / profile() outside torch.profiler.profile(...)")
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        with _quiet_stderr():
            _prepare_profiler(config, {ProfilerActivity.CPU})
            _enable_profiler(config, {ProfilerActivity.CPU})
        self._on = True
        return self

    def mark(self) -> None:
        """End the current span and start the next one."""
        handle = torch.ops.profiler._record_function_enter_new(_MARK, None)
        torch.ops.profiler._record_function_exit._RecordFunction(handle)

    def __exit__(self, *exc: Any) -> None:
        from torch.autograd import _disable_profiler

        with _quiet_stderr():
            result = _disable_profiler()
        self._on = False
        self._read(result.experimental_event_tree())

    def _read(self, roots: list) -> None:
        from torch._C._profiler import _EventType

        events: list[tuple[int, int, int, int]] = []  # (time, order, bytes or 0 for a mark, address)
        stack = list(reversed(roots))
        while stack:  # depth first, in order
            e = stack.pop()
            if e.tag == _EventType.Allocation:
                a = e.typed[1]
                if _same_device(a.device, self.device):
                    events.append((e.start_time_ns, len(events), a.alloc_size, a.ptr))
            elif e.name == _MARK:
                events.append((e.start_time_ns, len(events), 0, 0))
            stack.extend(reversed(e.children))
        events.sort()
        live: dict[int, int] = {}  # address -> bytes, for memory allocated inside the log
        level = start = peak = 0
        first: set[int] = set()  # addresses allocated in the current span
        for _, _, size, ptr in events:
            if size > 0:
                live[ptr] = size
                first.add(ptr)
                level += size
                peak = max(peak, level)
            elif size < 0:
                if ptr in live:  # a free of older memory (allocated before the log) is not ours to count
                    level -= live.pop(ptr)
            else:  # a mark
                self.spans.append(Span(start, peak, level))
                self._alive.append({p for p in first if p in live})
                start = peak = level
                first = set()
        self.spans.append(Span(start, peak, level))
        self._alive.append({p for p in first if p in live})

    @property
    def peak(self) -> int:
        return max(s.peak for s in self._read_spans())

    @property
    def current(self) -> int:
        return self._read_spans()[-1].end

    def _read_spans(self) -> list[Span]:
        if not self.spans:
            raise ProfileError("an allocation log is read after its block has ended (the allocator's events are "
                               "collected when the profiler stops)")
        return self.spans

    def created_addresses(self, span: int = 0) -> set[int]:
        """Addresses of the memory allocated during span ``span`` and still alive when it ended (compare with
        ``storage.data_ptr()``)."""
        return self._alive[span]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type != "cuda" or (a.index or 0) == (b.index or 0))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints a line to the process's stderr each time a profiler session starts and stops: silence that
    file descriptor for the duration of those two calls only (never around user code)."""
    try:
        fd = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(fd, 2)
    finally:
        os.close(fd)


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
    """Bytes allocated on ``device`` above the level at entry, split into :class:`Span` s by :meth:`mark`.

    CUDA: the caching allocator's ``memory_allocated`` / ``max_memory_allocated`` (every tensor on the device, in the
    allocator's 512-byte blocks); the statistics are reset at entry and at each mark, so meters do not nest.
    Other devices: an :class:`AllocationLog` (``log``), whose ``created_addresses`` callers may use. Read ``spans``,
    ``peak`` and ``current`` after the block (on CUDA, they can also be read inside it).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.log = None if self.cuda else AllocationLog(self.device)
        self._base = 0
        self._spans: list[Span] = []
        self._start = 0
        self._closed = False

    def __enter__(self) -> MemoryMeter:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.log.__enter__()
        return self

    def mark(self) -> None:
        """End the current span and start the next one."""
        if self.cuda:
            self._spans.append(self._cuda_span())
            self._start = self._spans[-1].end
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.log.mark()

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self._spans.append(self._cuda_span())
            self._closed = True
        else:
            self.log.__exit__(*exc)

    def _cuda_span(self) -> Span:
        torch.cuda.synchronize(self.device)
        end = torch.cuda.memory_allocated(self.device) - self._base
        return Span(self._start, max(torch.cuda.max_memory_allocated(self.device) - self._base, self._start), end)

    @property
    def spans(self) -> list[Span]:
        """The spans so far: on CUDA inside the block, the open one is included as it stands."""
        if not self.cuda:
            return self.log._read_spans()
        return self._spans if self._closed else [*self._spans, self._cuda_span()]

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.spans)

    @property
    def current(self) -> int:
        return self.spans[-1].end


# ---------------------------------------------------------------------------------------------- structures
_TENSOR = ("tensor",)  # spec of a bare tensor; others: ("seq", type, children), ("map", type, keys, children),
# ("const", value) for anything that is not a tensor (passed through unchanged)


def flatten(obj: Any) -> tuple[list[torch.Tensor], tuple]:
    """The tensors inside nested tuples / lists / dicts, and a spec for :func:`unflatten` to rebuild the structure
    around new tensors, with the containers' own types (a Hugging Face ``ModelOutput``, a namedtuple)."""
    if isinstance(obj, torch.Tensor):
        return [obj], _TENSOR
    if type(obj) in (list, tuple) and all(map(isinstance, obj, repeat(torch.Tensor))):
        # the common cut (a DenseNet's feature maps, a residual stream and its value), taken on every op of a step
        return list(obj), ("seq", type(obj), [_TENSOR] * len(obj))
    tensors: list[torch.Tensor] = []
    return tensors, _spec(obj, tensors)


def _spec(obj: Any, tensors: list[torch.Tensor]) -> tuple:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TENSOR
    if isinstance(obj, (tuple, list)):
        return ("seq", type(obj), [_spec(o, tensors) for o in obj])
    if isinstance(obj, Mapping):
        return ("map", type(obj), list(obj.keys()), [_spec(v, tensors) for v in obj.values()])
    return ("const", obj)


def unflatten(spec: tuple, tensors: list[torch.Tensor]) -> Any:
    if spec is _TENSOR:
        return tensors[0]
    if (spec[0] == "seq" and spec[1] in (list, tuple) and len(spec[2]) == len(tensors)
            and all(c is _TENSOR for c in spec[2])):
        return spec[1](tensors)  # flatten's common cut
    return _build(spec, iter(tensors))


def _build(spec: tuple, it: Iterator[torch.Tensor]) -> Any:
    tag = spec[0]
    if tag == "tensor":
        return next(it)
    if tag == "const":
        return spec[1]
    if tag == "seq":
        kind, items = spec[1], [_build(c, it) for c in spec[2]]
        if kind is tuple or kind is list:
            return kind(items)
        return kind(*items) if hasattr(kind, "_fields") else kind(items)  # a namedtuple, or a tuple/list subclass
    kind, keys, values = spec[1], spec[2], [_build(c, it) for c in spec[3]]
    return kind(zip(keys, values))
