"""The executor's transfer channel (docs/design.md §9): ``Off(i)`` / ``Pre(i)`` for ``runtime/train/executor.py``.

What moves: for ``Off(i)`` on x̄_{i+1} (after ``Fall(i)``), the tensors autograd saved for B(i) — packed into
:class:`Box` es by ``saved_tensors_hooks`` while the stage ran, so they can be swapped for a host copy and back —
and the stage's output x_{i+1} (also the tensors of later stages that alias it: the next stage's detached input and
what it saved of it), minus what is resident anyway (the stage's input, parameters, buffers, and the network output
x_L, which the caller holds). For ``Off(i)`` on a checkpoint x_i kept by ``Fck(i)``, its tensors. Tensors are swapped
in place (``Box.t``, or ``tensor.data`` for tensors other objects refer to), so autograd and the step's bookkeeping
never notice; values are copied exactly, so gradients are bitwise those of a run without transfers.

On CUDA: copies run on two side streams (one per direction, the link is full duplex), to and from pinned host
buffers, each waiting for an event recorded on the compute stream where the schedule places it; the device copy of an
offloaded tensor is recorded on the copy stream and dropped, so the caching allocator reuses its memory once the copy
completes; a compute op waits (on the GPU, not the host) only for the prefetches of the values it reads. On the CPU
the same code path runs with plain host copies (``clone``), synchronously. NOTE: the CUDA path is not yet measured
(no GPU in CI); see the README.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .memtrack import storage_of

Holder = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]


class Box:
    """A saved tensor, packed by the hooks of a recording forward: ``t`` is swapped for its host copy and back."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


def box_holder(box: Box) -> Holder:
    return (lambda: box.t, lambda v: setattr(box, "t", v))


def data_holder(t: torch.Tensor) -> Holder:
    """Swap the data under a tensor object others refer to (a stage output, a detached input alias)."""

    def put(v: torch.Tensor) -> None:
        t.data = v

    return (lambda: t.data, put)


def storage_key(t: torch.Tensor) -> int | None:
    st = storage_of(t)
    return None if st is None else st.data_ptr()


class Link:
    """Off/Pre of one training step. ``boxes[i]``: the saved tensors of the last recording forward of stage i."""

    def __init__(self, device: torch.device | None):
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        self.boxes: dict[int, list[Box]] = {}
        self.hosted: dict[int, list[Holder]] = {}
        self.off_done: dict[int, torch.cuda.Event] = {}
        self.ready: dict[int, torch.cuda.Event] = {}

    def hooks(self, i: int, stand_in: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> torch.autograd.graph.saved_tensors_hooks:
        """Pack the tensors that the recording forward of stage i saves into boxes (``boxes[i]``), each first
        mapped by ``stand_in`` if given."""
        boxes: list[Box] = []
        self.boxes[i] = boxes

        def pack(t: torch.Tensor) -> Box:
            b = Box(stand_in(t) if stand_in is not None else t)
            boxes.append(b)
            return b

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t)

    def off(self, i: int, holders: Iterable[Holder]) -> None:
        """Start copying what ``holders`` hold to the host; the device copies go when the copies complete."""
        holders = list(holders)
        self.hosted[i] = holders
        if not self.cuda:
            for get, put in holders:
                put(get().detach().clone())
            return
        start = torch.cuda.Event()
        start.record()  # after the compute op listed before this Off
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(start)
            for get, put in holders:
                dev = get()
                if not dev.is_cuda:  # on the host already: a value this stage shares with one offloaded before it
                    continue  # (Pre copies it back all the same, as on the CPU path)
                host = torch.empty_strided(dev.size(), dev.stride(), dtype=dev.dtype, device="cpu", pin_memory=True)
                host.copy_(dev, non_blocking=True)
                dev.record_stream(self.d2h)  # NOTE: its memory is reused only once this copy is done
                put(host)
                del dev
            done = torch.cuda.Event()
            done.record(self.d2h)
        self.off_done[i] = done

    def pre(self, i: int) -> None:
        """Start copying stage i's values back; the device memory is allocated now, when the copy starts."""
        holders = self.hosted.pop(i)
        if not self.cuda:
            for get, put in holders:
                put(get().clone())
            return
        start = torch.cuda.Event()
        start.record()
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(start)
            off = self.off_done.pop(i, None)
            if off is not None:
                self.h2d.wait_event(off)
            for get, put in holders:
                host = get()
                dev = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                dev.record_stream(compute)  # used (and freed) on the compute stream later
                put(dev)
            done = torch.cuda.Event()
            done.record(self.h2d)
        self.ready[i] = done

    def wait_for(self, stages: Iterable[int]) -> None:
        """Make the compute stream wait for the prefetches of ``stages`` (the values the next op reads)."""
        if not self.cuda:
            return
        for s in stages:
            ev = self.ready.pop(s, None)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
