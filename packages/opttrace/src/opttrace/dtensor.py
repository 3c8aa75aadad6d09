"""Tracing through DTensor (FSDP2's ``fully_shard``, tensor parallel).

The step sees each DTensor input as a DTensor around a traced local shard, bound to a graph
placeholder whose Source is the input's ``._local_tensor``. Every op then runs through
DTensor's own dispatch: its sharding rules decide the local op and any collective (a
functional all-reduce of the partial sums of a norm), and the recorder below it records
exactly those local ops and collectives. The graph is over plain local tensors: an
elementwise step's graph is the plain step's over the shards, and the backends fuse it the
same way. A DTensor the step creates (state made inside ``step()``) is a graph output
rebuilt each call around its local tensor with the same mesh and placements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from opttrace import _torch_compat as compat


def is_dtensor(value: Any) -> bool:
    cls = compat.dtensor_class()
    return cls is not None and isinstance(value, cls)


@functools.cache
def _traced_class() -> type:
    base = compat.dtensor_class()
    assert base is not None

    class TracedDTensor(base):  # type: ignore[valid-type, misc]
        """A DTensor input of a traced step. ``.grad`` is kept as TracedTensor keeps it: in
        the instance dict, a store reported to the recorder (the replay repeats it)."""

        @property
        def grad(self) -> Any:
            return self.__dict__.get("_grad_value")

        @grad.setter
        def grad(self, value: Any) -> None:
            recorder = getattr(compat.local_tensor(self), "_recorder", None)
            if recorder is not None and recorder.on_grad_store is not None:
                recorder.on_grad_store(self, value)
            self.__dict__["_grad_value"] = value

    return TracedDTensor


def traced(local: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """What the step sees for the DTensor input ``real``: a DTensor with its spec around
    ``local``, the traced stand-in of its local shard."""
    wrapper: torch.Tensor = compat.make_dtensor(_traced_class(), local, real)
    return wrapper


def rebuilder(value: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function that makes, from a new local tensor, a DTensor like ``value`` (mesh,
    placements, global shape and stride): the replay's way to rebuild state the step made."""
    from torch.distributed.tensor import DTensor

    assert isinstance(value, DTensor)
    return functools.partial(
        _from_local,
        mesh=value.device_mesh,
        placements=tuple(value.placements),
        shape=tuple(value.shape),
        stride=tuple(value.stride()),
    )


def _from_local(
    local: torch.Tensor, *, mesh: Any, placements: Any, shape: Any, stride: Any
) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def local_of(value: torch.Tensor) -> torch.Tensor:
    return compat.local_tensor(value)


def describe_placements(value: Any) -> str:
    """``(Shard(dim=0),)`` as a reason prints it."""
    return repr(tuple(value))
