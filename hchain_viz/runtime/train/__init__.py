"""Training by a schedule: the executor and the forms that use it.

- ``executor.py``: :class:`Executor`, one training step's ops on a model's stages, and its protocol (§5.1);
- ``native.py``: :class:`NativeSchedule`, the schedule as nested ``torch.utils.checkpoint`` regions (§5.3);
- ``wrap.py``: ``hcv.wrap``, a new module that trains by the schedule (§5.1);
- ``inplace.py``: ``hcv.apply`` / ``hcv.remove``, the model itself trains by it (§5.2);
- ``auto.py``: ``hcv.checkpoint``, profile, solve, apply and verify in one call.

The sections are docs/design.md's.
"""
