"""Several plans' next calls' host values, sent to the device in one copy.

A plan whose host computes values for its kernels (the bias corrections from a
capturable=False optimizer's CPU step counts) computes and copies them in its ``prepare``,
each call. Where the caller knows that several plans are about to be called (the buckets
of a step inside backward, at the backward's start), ``Ahead.stage`` computes each plan's
values for its next call now (``TritonPlan.stage_ahead``) and sends all of them at once:
one host -> device copy into a buffer of its own (through a pinned staging ring, as a
plan's), then one ``_foreach_copy_`` into the plans' value buffers, on the current stream.
Each plan's next ``prepare`` takes its values (writing its step counts back as it would
have) instead of computing and copying them, or, if what they came from changed (another
learning rate, state loaded, a step count moved), ignores them and computes as usual.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from optkernels.staging import Staging


class Ahead:
    """The staging of ``stage``'s copies (one ring per device, reused every round)."""

    def __init__(self) -> None:
        self.staging = Staging()
        self.buffers: dict[torch.device, torch.Tensor] = {}
        # Each buffer's views, one per plan's values, as last split (the sizes, the views)
        self._splits: dict[torch.device, tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}
        self.rounds = 0  # stage calls that sent something
        self.sent = 0  # plan parts' values sent ahead

    def stage(self, calls: Iterable[tuple[Any, Sequence[Any]]]) -> int:
        """Send the next call's values of each ``(plan, inputs)`` (plans without
        ``stage_ahead`` are skipped; ``inputs`` needs only the positions the plan's
        ``ahead_inputs`` names); returns how many value buffers were sent."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, np.ndarray]]] = {}
        plans = []
        for plan, inputs in calls:
            found = getattr(plan, "stage_ahead", None)
            if found is not None:
                plans.append(plan)
                for buffer, values in found(inputs):
                    by_device.setdefault(buffer.device, []).append((buffer, values))
        if not by_device:
            return 0
        self.staging.begin()
        try:
            for device, pairs in by_device.items():
                self._send(device, pairs)
        except BaseException:
            for plan in plans:  # (their next calls must not take values never sent)
                plan.forget_ahead()
            raise
        finally:
            self.staging.end()
        self.rounds += 1
        count = sum(len(pairs) for pairs in by_device.values())
        self.sent += count
        return count

    def _send(self, device: torch.device, pairs: list[tuple[torch.Tensor, np.ndarray]]) -> None:
        sizes = [values.size for _, values in pairs]
        buffer, host = self.staging.stage(
            self.buffers.get(device), (sum(sizes),), torch.float64, device
        )
        self.buffers[device] = buffer
        np.concatenate([values for _, values in pairs], out=host)
        self.staging.send(buffer)
        split = self._splits.get(device)
        if split is None or split[0] is not buffer or split[1] != sizes:
            starts = np.cumsum([0, *sizes]).tolist()
            views = [buffer[a:b] for a, b in itertools.pairwise(starts)]
            split = self._splits[device] = (buffer, sizes, views)
        with torch.no_grad():
            torch._foreach_copy_([b for b, _ in pairs], split[2])
