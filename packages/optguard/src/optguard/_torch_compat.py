"""Every private torch API optguard uses, in one place (a torch upgrade edits this).

The fast tier of a check is a tree of dynamo's C++ guard managers
(``torch._C._dynamo.guards``): accessors (dict item, attribute, list item, ``.grad``) and
leaf guards (type, id, equality, length, None, tensor metadata, CPython's dict version
tags) evaluated without Python frames. ``available()`` says whether this torch has what
we use; without it every call runs the generated Python check (correct, slower).
"""

from __future__ import annotations

import operator
import os
import sys
from typing import Any

import torch

_Root: Any = None
_PLAIN: Any = None
try:
    from torch._C._dynamo import guards as _guards

    # The C++ side checks for this exact enum (torch._dynamo.guards.GuardManagerType).
    from torch._dynamo.guards import GuardManagerType as _ManagerKind

    _Root = _guards.RootGuardManager
    _PLAIN = _ManagerKind.GUARD_MANAGER
except (ImportError, AttributeError):  # pragma: no cover - depends on the torch build
    _Root = _PLAIN = None

# A manager finds an existing child by scanning its children (matching each one's key), so
# adding n children to one manager costs n**2 / 2 matches (10,000 params: ~0.4 s). Longer
# lists and tuples are reached through slices of this many items: n * CHUNK / 2 matches.
CHUNK = 128
_VALUES = operator.methodcaller("values")


def available() -> bool:
    return _Root is not None and _PLAIN is not None


class GuardTree:
    """A C++ guard tree: ``node(path)`` finds or adds the accessor chain for a value and
    ``add_*`` attach leaf guards to it; ``check(L)`` runs them all."""

    def __init__(self) -> None:
        assert _Root is not None
        self.root: Any = _Root()

    def check(self, L: Any) -> bool:
        return bool(self.root.check(L))

    # -- accessors: each returns the child manager for a value of ``parent`` --------------

    @staticmethod
    def local(parent: Any, name: str, example: Any, label: str) -> Any:
        return parent.dict_getitem_manager(name, label, example, _PLAIN)

    @staticmethod
    def attr(parent: Any, name: str, example: Any, label: str) -> Any:
        if name == "grad":
            return parent.grad_manager(label, example, _PLAIN)
        return parent.getattr_manager(name, label, example, _PLAIN)

    @staticmethod
    def item(parent: Any, container: Any, key: Any, example: Any, label: str) -> Any:
        if type(container) is list:
            return parent.list_getitem_manager(key, label, example, _PLAIN)
        if type(container) is tuple:
            return parent.tuple_getitem_manager(key, label, example, _PLAIN)
        return parent.dict_getitem_manager(key, label, example, _PLAIN)

    @staticmethod
    def chunk(parent: Any, container: Any, start: int, label: str) -> tuple[Any, Any]:
        """The manager of ``container[start:start + CHUNK]`` (a list or tuple reached
        through ``parent``; its items are then that manager's items) and that slice."""
        part = operator.itemgetter(slice(start, start + CHUNK))
        example = part(container)
        name = f"{label}[{start}:{start + CHUNK}]"
        return parent.lambda_manager(part, name, example, _PLAIN), example

    @staticmethod
    def versions(node: Any, d: dict[Any, Any], label: str) -> None:
        """``d`` (reached through ``node``) and each of its values (dicts) keep their
        version tags: no entry of ``d`` or of its values was set, added or removed. The
        values are reached by position, through ``list(d.values())`` (a dict manager's
        children by position are kept sorted on each insertion: quadratic)."""
        node.add_dict_version_guard(d, [f"{label} is unchanged (dict version)"], None)
        values = list(d.values())
        view = node.lambda_manager(_VALUES, f"{label}.values()", d.values(), _PLAIN)
        listed = view.lambda_manager(list, f"list({label}.values())", values, _PLAIN)
        for start in range(0, len(values), CHUNK):
            parent, offset = listed, 0
            if len(values) > CHUNK:
                parent, _ = GuardTree.chunk(listed, values, start, f"{label}.values()")
                offset = start
            for i, value in enumerate(values[start : start + CHUNK], start):
                text = f"{label} entry {i}"
                entry = parent.list_getitem_manager(i - offset, text, value, _PLAIN)
                entry.add_dict_version_guard(value, [f"{text} is unchanged"], None)

    # -- leaf guards --------------------------------------------------------------------

    @staticmethod
    def type_is(node: Any, cls: type, text: str) -> None:
        node.add_type_match_guard(id(cls), [text], None)

    @staticmethod
    def id_is(node: Any, obj: Any, text: str) -> None:
        node.add_id_match_guard(id(obj), [text], None)

    @staticmethod
    def equals(node: Any, value: Any, text: str) -> None:
        node.add_equals_match_guard(value, [text], None)

    @staticmethod
    def length(node: Any, n: int, is_dict: bool, text: str) -> None:
        if is_dict:
            node.add_dict_length_check_guard(n, [text], None)
        else:
            node.add_length_check_guard(n, [text], None)

    @staticmethod
    def none(node: Any, is_none: bool, text: str) -> None:
        if is_none:
            node.add_none_match_guard([text], None)
        else:
            node.add_not_none_guard([text], None)

    @staticmethod
    def predicate(node: Any, fn: Any, text: str) -> None:
        """``fn(value)`` is true (a callable run from C++; cheap when ``fn`` is itself C)."""
        node.add_lambda_guard(fn, [text], None)

    @staticmethod
    def tensor(node: Any, t: torch.Tensor, text: str) -> None:
        """Same type, dtype, device, dispatch keys, shape, stride, requires_grad as ``t``."""
        node.add_tensor_match_guard(
            t,
            list(t.shape),
            list(t.stride()),
            text,
            [text],
            None,
            type(t),
            torch._C._dispatch_keys(t),
        )


def plain_grad_types() -> tuple[type, ...]:
    """Tensor types whose ``.grad`` is TensorBase's own getter, which the native checks may
    read in C++ (a subclass may override ``grad``)."""
    grad = torch._C.TensorBase.grad
    types: list[type] = [torch.Tensor, torch.nn.Parameter]
    # A DTensor's ``.grad`` is TensorBase's getter too, but reached through its disabled
    # ``__torch_function__`` (~250 ns in Python): the same tensor, read in C++ directly.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    disabled = getattr(torch._C, "_disabled_torch_function_impl", None)
    if dtensor is not None and disabled is not None and dtensor.__torch_function__ is disabled:
        types.append(dtensor)
    return tuple(t for t in types if getattr(t, "grad", None) is grad)


def autocast_state() -> str:
    """The ``torch.autocast`` regions around the call, ``"cpu:bfloat16"``, ``""`` when none:
    autocast rewrites the dtypes of some ops (matmuls, reductions), so a trace bakes it in."""
    if not torch._C._is_any_autocast_enabled():
        return ""
    return ",".join(
        f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
        for device in torch._C._autocast_supported_devices()
        if torch.is_autocast_enabled(device)
    )


# -- DTensor (torch.distributed.tensor): what the native checks read of one -----------------

# The attributes _native.cpp reads of a DTensor: its local shard, its spec (a DTensorSpec)
# and that spec's mesh and placements (DTensor's ``device_mesh`` and ``placements`` getters
# return those two).
LOCAL_TENSOR = "_local_tensor"


def native_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (exactly; no subclass) whose ``device_mesh`` and
    ``placements`` are its ``_spec.mesh`` and ``_spec.placements`` and whose
    ``_local_tensor`` is a plain strided tensor: what the native checks read instead of the
    getters (tested on the live value: another torch that stores them elsewhere keeps the
    checks in the guard tree)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    if cls is None or type(value) is not cls:
        return False
    try:
        spec = value._spec
        local = getattr(value, LOCAL_TENSOR)
        return (
            value.device_mesh is spec.mesh
            and value.placements is spec.placements
            and type(local) is torch.Tensor
            and local.layout == torch.strided
        )
    except AttributeError:
        return False


def extension_root() -> str:
    """torch's default root folder of built extensions (``cpp_extension``'s
    ``get_default_build_root``), without importing ``torch.utils.cpp_extension``: it imports
    setuptools, ~35 ms of a process's first compiled call."""
    try:
        from torch import _appdirs

        root: str = _appdirs.user_cache_dir(appname="torch_extensions")  # type: ignore[no-untyped-call]
        return os.path.realpath(root)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch version
        from torch.utils import cpp_extension

        return cpp_extension.get_default_build_root()
