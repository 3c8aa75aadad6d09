"""The native per-tensor checks, called directly (the fast tier and gather use them)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from optguard import native


@pytest.fixture(scope="module")
def module():
    built = native.start(wait=True)
    if built is None:
        if os.environ.get("OPTCOMPILE_NATIVE") == "0":
            pytest.skip("OPTCOMPILE_NATIVE=0")
        pytest.fail(f"the native checks did not build: {native.status()}")
    return built


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that they are a prototype
        return torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])


def test_match_checks_every_items_metadata_and_identity(module):
    params = [torch.nn.Parameter(torch.randn(4, 2)) for _ in range(3)]
    spec = module.spec(params, True)
    assert module.match(spec, False, params)
    assert not module.match(spec, False, params[:2])  # another length
    assert not module.match(spec, False, (*params,))  # not a list
    same = [params[0], torch.nn.Parameter(params[1].detach().clone()), params[2]]
    assert not module.match(spec, False, same)  # equal metadata, another object
    assert module.match(module.spec(params, False), False, same)  # without identity
    params[2].data = params[2].data.t()  # same object, other stride
    assert not module.match(spec, False, params)


def test_match_both_checks_items_and_their_grads_in_one_visit(module):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(3)
    grads = module.spec([p.grad for p in params], False)
    items = module.spec(params, True, True)
    assert module.match_both(grads, items, params)
    assert [g is p.grad for g, p in zip(module.take(grads), params, strict=True)] == [True] * 3
    params[1].grad = torch.randn(6)[::2]  # a grad with another stride
    assert not module.match_both(grads, items, params) and module.take(grads) is None
    params[1].grad = torch.randn(3)
    params[2].data = params[2].data.clone()  # an item moved
    assert not module.match_both(grads, items, params) and module.take(grads) is None
    with pytest.raises(ValueError, match="different lengths"):
        module.match_both(grads, module.spec(params[:2], True), params)


@pytest.mark.parametrize("shape", [(), (5,), (2, 1, 3, 1), (2, 1, 3, 1, 2, 2)])
def test_match_compares_every_size_and_stride_at_any_rank(module, shape):
    tensors = [torch.randn(shape)]
    spec = module.spec(tensors, False)
    assert module.match(spec, False, [torch.randn(shape)])
    if shape:
        last = (*shape[:-1], shape[-1] + 1)
        assert not module.match(spec, False, [torch.randn(last)])  # one size differs
        assert not module.match(spec, False, [torch.randn(shape).unsqueeze(0)])  # rank
        strided = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]  # last stride 2
        assert not module.match(spec, False, [strided])
    else:
        assert not module.match(spec, False, [torch.randn(1)])


def test_match_reads_grads_and_a_tensor_torch_cannot_size_is_a_miss_not_a_crash(module):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    params[0].grad = torch.randn(3)
    spec = module.spec([p.grad for p in params], False)  # [tensor, None]
    assert module.match(spec, True, params)
    params[1].grad = torch.randn(3)
    assert not module.match(spec, True, params)  # was None
    values = module.spec([torch.randn(3), torch.randn(2)], False)
    assert not module.match(values, False, [_nested(), torch.randn(2)])
    with pytest.raises(ValueError, match="item 0"):
        module.spec([_nested()], False)


def test_grads_agree_with_python(module):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    params[1].grad = torch.randn(3)
    assert all(g is p.grad for g, p in zip(module.grads(params), params, strict=True))


def test_count_grads_counts_what_python_sees(module):
    """Plain params read in C++, a subclass through its own ``grad`` property."""

    class Hidden(torch.Tensor):
        @property
        def grad(self) -> torch.Tensor | None:
            return None  # (whatever torch holds)

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    hidden = torch.randn(2).as_subclass(Hidden).requires_grad_()
    assert module.count_grads([*params, hidden]) == 0
    (params[0] * 2 + params[2]).sum().backward()  # grads made by autograd, in C++
    torch.Tensor.grad.__set__(hidden, torch.ones(2))
    assert module.count_grads([*params, hidden]) == 2
    params[3].grad = torch.zeros(3)
    assert module.count_grads(params) == 3 == sum(p.grad is not None for p in params)
    with pytest.raises(TypeError):
        module.count_grads(tuple(params))  # not a list


def test_clear_grads_sets_every_grad_to_none_as_the_setter_does(module):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    plain = torch.randn(2, requires_grad=True)
    for t in (*params[:2], plain):
        t.grad = torch.ones_like(t)
    grad = params[0].grad
    assert module.clear_grads([*params, plain]) is None
    assert all(t.grad is None for t in (*params, plain))
    assert grad.sum().item() == 3  # (the grad object itself is left as it was)
    with pytest.raises(TypeError):
        module.clear_grads((params[0],))  # not a list


def test_clear_grads_goes_through_a_subclass_setter_and_a_torch_function_mode(module):
    set_to: list[object] = []

    class Watched(torch.Tensor):
        @property
        def grad(self) -> torch.Tensor | None:
            return torch.Tensor.grad.__get__(self)

        @grad.setter
        def grad(self, value: torch.Tensor | None) -> None:
            set_to.append(value)
            torch.Tensor.grad.__set__(self, value)

    watched = torch.randn(2).as_subclass(Watched).requires_grad_()
    watched.grad = torch.randn(2).as_subclass(Watched)
    module.clear_grads([watched])
    assert set_to[-1] is None and watched.grad is None

    seen: list[str] = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    p = torch.nn.Parameter(torch.randn(2))
    p.grad = torch.randn(2)
    with Mode():
        module.clear_grads([p])
    assert p.grad is None and seen  # the mode saw the assignment, as with p.grad = None


def test_dict_version_changes_when_an_entry_is_set_added_or_removed(module):
    if not hasattr(module, "dict_version"):
        pytest.skip("this CPython has no dict version tags")
    key = torch.randn(2)
    entry = {"step": 1}
    state = {key: entry}
    tag = module.dict_version(state)
    entry["step"] = 2  # a value changed inside an entry: not the dict's own
    assert module.dict_version(state) == tag
    assert module.dict_version(dict(state)) != tag  # an equal copy is another dict
    state[key] = {"step": 2}
    assert module.dict_version(state) != tag
    tag = module.dict_version(state)
    state[torch.randn(2)] = {}
    assert module.dict_version(state) != tag
    tag = module.dict_version(state)
    state.popitem()
    assert module.dict_version(state) != tag
    entries = [entry]  # not a dict: never the same version
    assert module.dict_version(entries) != module.dict_version(entries)


def test_addresses_record_positions_and_compare_the_checked_ones(module):
    tensors = [torch.randn(2), 1.0, torch.randn(2), torch.randn(3)]
    spec = module.addresses([0, -1, 2, 3], [True, True, True, False])
    assert not module.addresses_equal(spec, tensors)  # nothing recorded yet
    ptrs = module.addresses_record(spec, tensors)
    assert ptrs == [tensors[0].data_ptr(), 0, tensors[2].data_ptr(), tensors[3].data_ptr()]
    assert module.addresses_equal(spec, tensors)
    assert module.addresses_equal(spec, [*tensors[:3], torch.randn(3)])  # 3 is not checked
    assert not module.addresses_equal(spec, [tensors[0], 1.0, torch.randn(2), tensors[3]])
    assert not module.addresses_equal(spec, tensors[:2])  # position 2 is out of range
    assert not module.addresses_equal(spec, [1.0, 1.0, tensors[2], tensors[3]])  # no tensor
    assert not module.addresses_equal(spec, (*tensors,))  # not a list
    tensors[2].set_(torch.randn(5))  # the same object, moved
    assert not module.addresses_equal(spec, tensors)
    with pytest.raises(TypeError, match="input 0 is not a tensor"):
        module.addresses_record(spec, [1.0, *tensors[1:]])
    with pytest.raises(TypeError, match="input 2 is not a tensor"):
        module.addresses_record(spec, tensors[:2])
    assert module.addresses_equal(spec, [*tensors[:2], tensors[2], tensors[3]]) is False


def test_grads_read_by_address_keep_their_pointers_for_linked_addresses(module):
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(3)
    grads, items = module.spec([p.grad for p in params], False), module.spec(params, True, True)
    assert module.by_address(grads)
    spec = module.addresses([1, 0], [True, True], [(grads, 1), None])
    inputs = [params[0], None]  # slot 1: params[1]'s grad, left None
    with pytest.raises(TypeError, match="input 1 is not a tensor"):
        module.addresses_record(spec, inputs)  # no match has read the grads yet
    assert module.match_both(grads, items, params) and module.take(grads) is None
    assert module.addresses_record(spec, inputs) == [
        params[1].grad.data_ptr(),
        params[0].data_ptr(),
    ]
    assert module.addresses_equal(spec, inputs)
    params[1].grad = torch.randn(3)  # a new grad: the next match reads its address
    assert module.addresses_equal(spec, inputs)  # (not read again until a match)
    assert module.match_both(grads, items, params)
    assert not module.addresses_equal(spec, inputs)
    module.addresses_record(spec, inputs)
    params[1].grad = torch.randn(6)[::2]  # another stride: the match fails, no pointer given
    assert not module.match_both(grads, items, params)
    assert not module.addresses_equal(spec, inputs)
    assert module.addresses_equal(spec, [params[0], params[1].grad]) is False  # (its own)
    with pytest.raises(ValueError, match="not by_address"):
        module.addresses([0], [True], [(items, 0)])


@pytest.mark.parametrize("kind", ["native", "python"])
def test_held_pointers_see_every_way_a_tensor_moves(module, kind, monkeypatch):
    if kind == "python":
        monkeypatch.setattr(native, "_module", None)
    tensors = [torch.randn(4), torch.randn(2, 2), torch.zeros(())]

    def check():
        return native.held_ptrs(tensors, [t.data_ptr() for t in tensors])

    held = check()
    assert held(None)
    tensors[0].data = tensors[0].data.clone()  # .data: a new storage
    assert not held(None)
    held = check()
    tensors[1].set_(torch.randn(2, 2))
    assert not held(None)
    held = check()
    tensors[2].untyped_storage().resize_(0)  # the storage itself gives its memory back
    assert not held(None)
    held = check()
    same = tensors[0].clone()
    torch.utils.swap_tensors(tensors[0], same)  # the same Python object, another tensor
    assert not held(None)
    held = check()
    tensors[1].t_()  # metadata changed in place: the same object and storage
    assert not held(None)
    held = check()
    tensors[1].as_strided_((2, 2), (2, 1))  # strides alone (t_() left (1, 2)), same storage
    assert not held(None)
    held = check()
    address = tensors[0].data_ptr()
    tensors[0].resize_(2)  # a smaller shape fits in place: same object, storage, address
    assert tensors[0].data_ptr() == address and not held(None)


@pytest.mark.parametrize("kind", ["native", "python"])
def test_held_without_a_pointer_allows_a_move_and_sees_every_metadata_change(
    module, kind, monkeypatch
):
    """A held tensor with no expected pointer (a 0-dim step count a backend moves) may move;
    its metadata, as TensorMatchGuard compares it, may not change."""
    if kind == "python":
        monkeypatch.setattr(native, "_module", None)
    step = torch.zeros(())
    changes = [
        lambda: setattr(step, "data", step.data.double()),
        lambda: setattr(step, "data", step.data.reshape(1)),
        lambda: step.requires_grad_(),
        lambda: setattr(step, "__class__", torch.nn.Parameter),
    ]
    for change in changes:
        step = torch.zeros(())
        held = native.held_ptrs([step], [None])
        step.set_(torch.ones(()))  # moved, same metadata
        assert held(None)
        change()
        assert not held(None)


def test_held_refuses_what_is_not_a_tensor_with_a_pointer(module):
    with pytest.raises(TypeError):
        module.held([torch.randn(2), 3], [0, 0])
    with pytest.raises(TypeError):
        module.held([torch.randn(2)], [])  # lengths differ


def test_versions_change_with_any_entry_of_the_dict_or_of_its_values(module):
    if not hasattr(module, "versions"):
        pytest.skip("this CPython has no dict version tags")
    keys = [torch.randn(2) for _ in range(3)]
    state = {k: {"step": 1, "buf": torch.zeros(2)} for k in keys}
    spec = module.versions(state)
    assert module.versions_match(spec, state)
    assert not module.versions_match(spec, dict(state))  # an equal copy is another dict
    state[keys[1]]["buf"] = torch.zeros(2)
    assert not module.versions_match(spec, state)
    spec = module.versions(state)
    state[keys[2]]["extra"] = 0
    assert not module.versions_match(spec, state)
    spec = module.versions(state)
    state[keys[0]] = {"step": 1, "buf": torch.zeros(2)}  # an entry replaced
    assert not module.versions_match(spec, state)
    spec = module.versions(state)
    del state[keys[0]]
    assert not module.versions_match(spec, state)
    with pytest.raises(TypeError):
        module.versions({keys[0]: 1})  # values must be dicts


def test_match_with_pointers_sees_a_moved_item(module):
    params = [torch.nn.Parameter(torch.randn(4, 2)) for _ in range(2)]
    spec = module.spec(params, True, True)
    assert module.match(spec, False, params)
    params[1].data = params[1].data.clone()  # same object and metadata, another address
    assert not module.match(spec, False, params)
    assert module.match(module.spec(params, True), False, params)  # without pointers


# -- built ahead, loaded without a lock, never built while a step runs ----------------------


def _fresh_native(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """A process that has not loaded the module yet, with its cache in ``cache``."""
    monkeypatch.setenv("OPTCOMPILE_CACHE_DIR", str(cache))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_status", "not loaded yet")
    monkeypatch.setattr(native, "_callbacks", [])


def test_the_cache_follows_optcompile_cache_dir_then_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("OPTCOMPILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert native.library_path().parent == tmp_path / "torch" / "optguard"
    monkeypatch.setenv("OPTCOMPILE_CACHE_DIR", str(tmp_path / "ours"))
    path = native.library_path()
    assert path.parent == tmp_path / "ours" / "optguard"
    assert torch.__version__.replace(".", "_").replace("+", "_") in path.name


def test_without_either_the_cache_is_torch_s_extension_root_found_without_cpp_extension(
    monkeypatch,
):
    import subprocess
    import sys

    monkeypatch.delenv("OPTCOMPILE_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    from torch.utils import cpp_extension

    expected = Path(cpp_extension.get_default_build_root()) / "optguard"
    assert native.cache_directory() == expected
    # (a fresh process: finding it imports neither cpp_extension nor setuptools)
    script = (
        "import sys; from optguard import native\n"
        "before = set(sys.modules); print(native.cache_directory())\n"
        "print(sorted(m for m in ('torch.utils.cpp_extension', 'setuptools') "
        "if m in set(sys.modules) - before))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == [str(expected), "[]"]


def test_a_missing_module_is_not_built_by_a_step_and_status_says_how_to_build_it(
    tmp_path, monkeypatch
):
    _fresh_native(monkeypatch, tmp_path)
    monkeypatch.delenv("OPTCOMPILE_NATIVE", raising=False)
    start = time.perf_counter()
    assert native.start() is None
    assert time.perf_counter() - start < 1.0  # no build, no wait
    assert "python -m optguard build" in native.status()
    assert "run in Python" in native.status()
    assert not native.library_path().exists()


def test_a_module_built_ahead_is_loaded_by_path_with_no_lock_taken(tmp_path, monkeypatch):
    built = native.start(wait=True)  # the cache of this test session (built if need be)
    if built is None:
        pytest.fail(f"the native checks did not build: {native.status()}")
    source = native.library_path()
    _fresh_native(monkeypatch, tmp_path)
    target = native.library_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(source.read_bytes())
    # A lock torch's cpp_extension would wait on forever, left by a dead builder: ignored.
    (target.parent / "lock").write_text("")
    seen: list[object] = []
    native.when_loaded(seen.append)
    monkeypatch.delenv("OPTCOMPILE_NATIVE", raising=False)
    loaded = native.start()
    assert loaded is not None and seen == [loaded]
    assert native.status() == f"loaded ({target})"
    t = torch.zeros(3)
    assert loaded.match(loaded.spec([t], False), False, [t])


def test_off_means_never_loaded(tmp_path, monkeypatch):
    _fresh_native(monkeypatch, tmp_path)
    monkeypatch.setenv("OPTCOMPILE_NATIVE", "0")
    assert native.start(wait=True) is None
    assert native.status().startswith("off (OPTCOMPILE_NATIVE=0)")


def test_a_failed_build_says_why_and_leaves_nothing_behind(tmp_path, monkeypatch):
    _fresh_native(monkeypatch, tmp_path)
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    assert native.start(wait=True) is None
    assert native.status().startswith("failed: RuntimeError: building bad.cpp failed: ")
    assert "error" in native.status()  # the compiler's own message, not ninja's last line
    assert not native.library_path().exists()
    leftovers = list(native.cache_directory().iterdir())
    assert leftovers == []  # its private build directory is gone


def test_the_command_line_reports_status(tmp_path, monkeypatch, capsys):
    _fresh_native(monkeypatch, tmp_path)
    monkeypatch.delenv("OPTCOMPILE_NATIVE", raising=False)
    assert native.main(["status"]) == 0
    assert "not built" in capsys.readouterr().out
    assert native.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(native.library_path())
    assert native.main(["frobnicate"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no CUDA driver loaded")
def test_h2d_declines_where_no_cuda_driver_is_loaded(module):
    """The staged copies' fast path (optkernels' staging) needs the driver torch's CUDA
    runtime loads; without it the caller copies with torch."""
    host = torch.zeros(4, dtype=torch.float64)
    assert module.h2d(host.data_ptr(), host.data_ptr(), 32, 0, 0) is False
    with pytest.raises(TypeError):
        module.h2d(0, 0, 32)


@pytest.fixture
def cpu_mesh():
    """A world of one (gloo, in this process) and its 1-D mesh."""
    from torch.distributed.tensor import init_device_mesh

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch.distributed.destroy_process_group()


def test_spec_of_dtensors_checks_mesh_placements_and_local_tensor(module, cpu_mesh):
    from optguard import _torch_compat as compat
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    module.plain(compat.plain_grad_types())  # DTensor's grad read in C++ too
    params = [
        torch.nn.Parameter(distribute_tensor(torch.randn(4, 2), cpu_mesh, [Shard(0)]))
        for _ in range(3)
    ]
    for p in params:
        p.grad = distribute_tensor(torch.randn(4, 2), cpu_mesh, [Shard(0)])
    assert all(compat.native_dtensor(p) and compat.native_dtensor(p.grad) for p in params)
    entries = [(p.device_mesh, p.placements, True) for p in params]
    items = module.spec(params, True, False, entries)
    grads = module.spec(
        [p.grad for p in params],
        False,
        False,
        [(p.device_mesh, p.placements, False) for p in params],
    )
    assert module.match_both(grads, items, params)
    assert [g is p.grad for g, p in zip(module.take(grads), params, strict=True)] == [True] * 3
    taken = module.take_locals(grads)
    assert [t is p.grad._local_tensor for t, p in zip(taken, params, strict=True)] == [True] * 3
    assert module.take_locals(grads) is None  # once
    assert [
        t is p._local_tensor for t, p in zip(module.take_locals(items), params, strict=True)
    ] == [True] * 3

    # An equal mesh and placements (new objects) pass: the guard compares with ==.
    g = params[0].grad
    g._spec = DTensorSpec(g._spec.mesh, (Shard(0),), g._spec.tensor_meta)
    assert module.match_both(grads, items, params)
    # Other placements, on a grad or on an item: a miss, and nothing stashed.
    g._spec = DTensorSpec(g._spec.mesh, (Replicate(),), g._spec.tensor_meta)
    assert not module.match_both(grads, items, params)
    assert module.take(grads) is None and module.take_locals(grads) is None
    g._spec = DTensorSpec(g._spec.mesh, (Shard(0),), g._spec.tensor_meta)
    p = params[1]
    spec_before = p._spec
    p._spec = DTensorSpec(p._spec.mesh, (Replicate(),), p._spec.tensor_meta)
    assert not module.match(items, False, params)
    p._spec = spec_before
    assert module.match(items, False, params)
    # The item's local tensor: another object (identity recorded), another address, other
    # metadata, requires_grad toggled, no longer a tensor.
    local = p._local_tensor
    no_ids = module.spec(params, False, False, entries)
    p._local_tensor = local.view_as(local)
    assert not module.match(items, False, params)
    assert module.match(no_ids, False, params)  # the same address and metadata
    p._local_tensor = local.clone()
    assert not module.match(no_ids, False, params)  # another address
    p._local_tensor = local.t()
    assert not module.match(no_ids, False, params)  # other metadata
    p._local_tensor = local
    local.requires_grad_(True)
    assert not module.match(items, False, params)
    local.requires_grad_(False)
    g = params[2].grad
    g_local = g._local_tensor
    g._local_tensor = g_local.double()
    assert not module.match_both(grads, items, params)
    del g._local_tensor  # reading it fails: a miss, no error
    assert not module.match_both(grads, items, params)
    g._local_tensor = g_local
    assert module.match_both(grads, items, params)
