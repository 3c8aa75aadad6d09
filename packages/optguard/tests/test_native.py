"""The native per-tensor checks, called directly (the fast tier and gather use them)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
from optguard import DataPtrGuard, LocalSource, native


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


@pytest.mark.parametrize("kind", ["native", "python"])
def test_held_pointers_see_every_way_a_tensor_moves(module, kind, monkeypatch):
    if kind == "python":
        monkeypatch.setattr(native, "_module", None)
    tensors = [torch.randn(4), torch.randn(2, 2), torch.zeros(())]

    def check():
        ptrs = [t.data_ptr() for t in tensors]
        guards = [DataPtrGuard(LocalSource(f"t{i}"), p) for i, p in enumerate(ptrs)]
        return native.held_ptrs(tensors, guards)

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


# -- the build never waits on a lock ------------------------------------------------------


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_free_build_directory_is_claimed_and_torchs_stale_lock_removed(tmp_path: Path):
    (tmp_path / "lock").write_text("")  # torch's baton, left by a process that died
    assert native.claim(tmp_path) is None
    assert (tmp_path / "optcompile.claim").read_text() == str(os.getpid())
    assert not (tmp_path / "lock").exists()  # cpp_extension.load would wait on it forever


def test_a_fresh_claim_of_another_process_is_not_waited_for(tmp_path: Path):
    (tmp_path / "optcompile.claim").write_text("12345")
    start = time.perf_counter()
    reason = native.claim(tmp_path)
    assert time.perf_counter() - start < 1.0
    assert reason is not None and "another process is building it" in reason


def test_a_stale_claim_left_by_a_dead_builder_is_taken_over(tmp_path: Path):
    stale = tmp_path / "optcompile.claim"
    stale.write_text("12345")
    _age(stale, native.STALE_AFTER_S + 1)
    assert native.claim(tmp_path) is None
    assert stale.read_text() == str(os.getpid())


def test_the_build_directory_follows_torch_extensions_dir(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.build_directory().parent == tmp_path
