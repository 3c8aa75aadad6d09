"""One call's host values, where the kernels read them: computed once for every lane when
every lane holds the same 0-dim values (the lanes' step counts advance together unless a
param joined later or a state was loaded), else lane by lane; put into a ``host_vals`` block
(a row stride, 3 unused values, then one row per lane or one for all: see host.host_reads);
the 0-dim results returned, to be written back by the caller (the C loops and Triton's host
mode alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from optkernels.host import HOST_ROWS, HostFunction

UNIFORM_HEAD = [0.0] * HOST_ROWS  # a block's head when every lane has the same row

# A 0-dim result to write back: (column, value, whether one number stands for every lane)
Write = tuple[int, Any, bool]


def uniform_values(
    one: HostFunction | None, views: dict[int, np.ndarray], scalars: list[float]
) -> dict[int, Any] | None:
    """The host vars as one Python number each, when every lane holds the same values,
    computed once with Python floats (``one``, host.host_function). None when the lanes
    differ (``one`` is None where they read different numbers by construction) or that
    arithmetic raised; the caller then computes every lane."""
    if one is None:
        return None
    first: dict[int, Any] = {}
    for k, view in views.items():
        head = view[:1]
        if view.tobytes() != head.tobytes() * len(view):  # bitwise: cheap, NaN-safe
            return None
        first[k] = head.item()
    try:
        return one(first, scalars, 1)
    except (ArithmeticError, ValueError):
        return None


def fill_rows(
    one: HostFunction | None,
    every: HostFunction,
    views: dict[int, np.ndarray],
    scalars: list[float],
    lanes: int,
    host_read: Sequence[int],
    small_writes: Sequence[tuple[int, int]],
    block: np.ndarray,
) -> list[Write]:
    """Put the vars ``host_read`` into ``block`` (one row for all lanes where
    ``uniform_values`` gives them, else a row per lane) and return the 0-dim results to
    write back (``small_writes``: (var, column)), without writing them: an input's value may
    be its column's view itself (a float64 one, read without a copy), which a write would
    change before the rows read it (ASGD's old eta was its new one on the C loops)."""
    values = uniform_values(one, views, scalars)
    if values is not None:
        block[: HOST_ROWS + len(host_read)] = [*UNIFORM_HEAD, *[values[v] for v in host_read]]
        return [(k, values[var], True) for var, k in small_writes]
    with np.errstate(all="ignore"):
        values = every(views, scalars, lanes)
    width = len(host_read)
    block[0] = width
    rows = block[HOST_ROWS : HOST_ROWS + lanes * width].reshape(lanes, width)
    for j, var in enumerate(host_read):
        rows[:, j] = values[var]
    return [(k, values[var], False) for var, k in small_writes]


def write_results(views: dict[int, np.ndarray], writes: list[Write]) -> None:
    """Write ``fill_rows``' 0-dim results into the columns' numpy views (CPU buffers)."""
    for k, value, uniform in writes:
        if uniform:
            views[k].fill(value)
        else:
            np.copyto(views[k], value, casting="unsafe")
