"""A thread's last result computed from a tensor, reused while the very same tensor comes back unmodified.

Every layer of a forward is handed the same attention mask (its key ranges are read once a forward:
`exact_attention`), and the q and k projections, like gate and up, the same input (quantized to int8 once:
`quantization`). The entry holds the tensor itself, so its identity cannot pass to another tensor while it is
remembered; an in-place change bumps its version counter. A tensor made under `torch.inference_mode()` has no
version counter: then identity alone, where the caller knows its tensors are never edited in place, else nothing
is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch


class LastCall:
    """`get(tensor, key, compute)`: `compute()`, or the result it gave this thread last time for the same
    `tensor` object (or None), at the same version, under an equal `key`."""

    def __init__(self, unversioned_by_identity: bool):
        # inference tensors: reuse by identity (True: their owner never edits them in place) or never (False)
        self.unversioned_by_identity = unversioned_by_identity
        self._local = threading.local()

    def get(self, tensor: torch.Tensor | None, key: Hashable, compute: Callable[[], Any]) -> Any:
        unversioned = tensor is not None and tensor.is_inference()
        if unversioned and not self.unversioned_by_identity:
            return compute()
        version = None if tensor is None or unversioned else tensor._version
        last = getattr(self._local, "entry", None)
        if last is not None and last[0] is tensor and last[1] == version and last[2] == key:
            return last[3]
        result = compute()
        self._local.entry = (tensor, version, key, result)
        return result
