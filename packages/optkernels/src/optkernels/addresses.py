"""The data pointers of a plan's inputs at fixed positions: recorded when a table is
written, compared on every call.

An address table (triton_group) holds ``inputs[i].data_ptr()`` for its slots; each call
must know whether any of them moved. ``AddressCheck`` records them once and compares them
each call: through one C++ loop over the positions once optguard's native module is handed
in (``use_native_addresses``; ~5 ns per tensor), else through torch's batch compare (~100 ns
per tensor). This layer does not depend on optguard: optcompile hands the module in.

A caller whose guard check reads some inputs' data pointers anyway (optguard's native grad
check) may leave those inputs None and ``link`` the check to where it keeps them: the native
loops then take those pointers where the input list holds None (no tensor is fetched,
wrapped or read twice). Without the native module nothing is linked.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from optkernels._torch_compat import data_ptrs_equal


class NativeAddresses(Protocol):
    """What optguard's native module offers (see its ``_native.cpp``)."""

    def addresses(
        self, indices: list[int], checked: list[bool], links: list[Any] | None = None
    ) -> Any: ...

    def addresses_equal(self, spec: Any, tensors: list[Any]) -> bool: ...

    def addresses_record(self, spec: Any, tensors: list[Any]) -> list[int]: ...

    def h2d(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> bool: ...


_native: NativeAddresses | None = None


def use_native_addresses(module: NativeAddresses | None) -> None:
    """Record and compare addresses with ``module``'s C++ loops from now on (None: torch's),
    and queue staged copies through its ``h2d`` (staging.py)."""
    global _native
    _native = module


def native_module() -> NativeAddresses | None:
    """The module handed in by ``use_native_addresses`` (None: none yet)."""
    return _native


class AddressCheck:
    """The data pointers of ``inputs[i]`` for ``i`` in ``indices`` (-1: a slot with no
    input, recorded as 0); ``equal`` compares those at positions in ``checked`` (default:
    all) with what ``record`` saw last (False before the first record)."""

    def __init__(self, indices: Sequence[int], checked: Collection[int] | None = None) -> None:
        self.indices = [i if i >= 0 else -1 for i in indices]
        self._checked = [i >= 0 and (checked is None or i in checked) for i in self.indices]
        self.compared = [i for i, c in zip(self.indices, self._checked, strict=True) if c]
        self._module: NativeAddresses | None = None
        self._spec: Any = None
        self._ptrs: list[int] | None = None  # by input position (the torch compare)
        self._links: Mapping[int, tuple[Any, int]] = {}

    def link(self, links: Mapping[int, tuple[Any, int]]) -> None:
        """Where the data pointer of an input left None is found (input position -> a
        native spec and an item: see the module docstring); the next ``equal`` is False."""
        self._links = dict(links)
        self._module = self._spec = None

    def equal(self, inputs: Sequence[Any]) -> bool:
        module = self._module
        if module is not _native:
            return False  # recorded by the other kind: record again
        tensors = inputs if type(inputs) is list else list(inputs)
        if module is not None:
            return module.addresses_equal(self._spec, tensors)
        ptrs = self._ptrs
        if ptrs is None or len(ptrs) != len(tensors):
            return False
        return data_ptrs_equal(tensors, ptrs, self.compared)

    def record(self, inputs: Sequence[Any]) -> list[int]:
        """Record the current data pointers and return them, one per index."""
        tensors = inputs if type(inputs) is list else list(inputs)
        module = _native
        if module is not None:
            if module is not self._module or self._spec is None:
                links = self._links
                self._spec = (
                    module.addresses(
                        self.indices, self._checked, [links.get(i) for i in self.indices]
                    )
                    if links
                    else module.addresses(self.indices, self._checked)
                )
            self._module = module
            return module.addresses_record(self._spec, tensors)
        self._module = self._spec = None
        found = [tensors[i].data_ptr() if i >= 0 else 0 for i in self.indices]
        self._ptrs = [0] * len(tensors)
        for i, ptr in zip(self.indices, found, strict=True):
            if i >= 0:
                self._ptrs[i] = ptr
        return found
