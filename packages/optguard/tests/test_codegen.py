from __future__ import annotations

import ast

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from optguard import (
    AttrSource,
    ItemSource,
    KeyedSource,
    LocalSource,
    SourceCode,
    build_function,
    codegen,
    compile_fetch,
)
from optguard_paths import GROUP, GROUPS, OPT, PARAMS


def _opt() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_compile_fetch_returns_values_in_source_order():
    opt = _opt()
    fetch, _ = compile_fetch([ItemSource(GROUP, "momentum"), ItemSource(GROUP, "lr")])
    assert fetch({"opt": opt}) == [0.9, 0.1]


def test_compile_fetch_returns_the_live_objects():
    opt = _opt()
    fetch, _ = compile_fetch([ItemSource(PARAMS, 1)])
    assert fetch({"opt": opt})[0] is opt.param_groups[0]["params"][1]


def test_compile_fetch_code_fetches_a_common_prefix_once():
    _, code = compile_fetch([ItemSource(PARAMS, 0), ItemSource(PARAMS, 1), ItemSource(GROUP, "lr")])
    assert (code.count(".param_groups"), code.count("['params']")) == (1, 1)


def test_compile_fetch_code_is_valid_python_named_after_the_function():
    _, code = compile_fetch([ItemSource(GROUP, "lr")], name="gather_inputs")
    tree = ast.parse(code)
    assert [f.name for f in tree.body] == ["gather_inputs"]  # type: ignore[attr-defined]


def test_compile_fetch_of_no_sources_returns_an_empty_list():
    fetch, _ = compile_fetch([])
    assert fetch({}) == []


def test_compile_fetch_reads_a_missing_defaultdict_entry_as_none():
    opt = _opt()
    fetch, _ = compile_fetch([KeyedSource(AttrSource(OPT, "state"), ItemSource(PARAMS, 0))])
    assert fetch({"opt": opt}) == [None]
    assert len(opt.state) == 0


def test_var_names_the_variable_after_its_source():
    code = SourceCode()
    assert code.var(ItemSource(GROUP, "lr")) == "opt_param_groups_0_lr"


def test_var_emits_parents_before_children():
    code = SourceCode(indent="")
    code.var(GROUP)
    assert code.lines == [
        "opt = L['opt']",
        "opt_param_groups = opt.param_groups",
        "opt_param_groups_0 = opt_param_groups[0]",
    ]


def test_var_reuses_the_variable_of_a_repeated_source():
    code = SourceCode()
    first = code.var(GROUP)
    lines = len(code.lines)
    assert code.var(ItemSource(GROUPS, 0)) == first and len(code.lines) == lines


def test_sources_with_the_same_identifier_get_distinct_variables():
    xs = LocalSource("xs")
    fetch, _ = compile_fetch([ItemSource(xs, "a b"), ItemSource(xs, "a_b")])
    assert fetch({"xs": {"a b": 1, "a_b": 2}}) == [1, 2]


def test_a_local_named_L_does_not_shadow_the_argument():
    fetch, _ = compile_fetch([LocalSource("L"), LocalSource("x")])
    assert fetch({"L": 1, "x": 2}) == [1, 2]


def test_constant_reuses_the_name_of_the_same_object():
    code = SourceCode()
    assert code.constant(torch.float32, "float32") == code.constant(torch.float32, "dtype")


def test_constant_name_does_not_clash_with_a_variable():
    code = SourceCode()
    var = code.var(LocalSource("float32"))
    assert code.constant(torch.float32, "float32") != var


def test_build_function_binds_constants_as_globals():
    fn, code = build_function("f", "x", ["    return x + offset"], {"offset": 10})
    assert (fn(1), code) == (11, "def f(x):\n    return x + offset\n")


_KEYS = st.one_of(st.integers(-3, 3), st.text(max_size=4))
_TREES = st.recursive(
    st.integers(),
    lambda children: st.dictionaries(_KEYS, children, min_size=1, max_size=3),
    max_leaves=8,
)


def _paths(tree, source):
    yield source
    if isinstance(tree, dict):
        for key, child in tree.items():
            yield from _paths(child, ItemSource(source, key))


@given(_TREES)
def test_compile_fetch_agrees_with_fetch_on_every_path(tree):
    sources = list(_paths(tree, LocalSource("tree")))
    fetch, _ = compile_fetch(sources)
    assert fetch({"tree": tree}) == [s.fetch({"tree": tree}) for s in sources]


def test_generated_code_is_compiled_once_then_loaded_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTGUARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codegen, "_CODE", {})
    text = "def f(L):\n    return L['x'] + 1\n"
    first = codegen.code_object(text, "<optguard:f>")
    assert codegen.code_object(text, "<optguard:f>") is first  # in this process
    (stored,) = tmp_path.iterdir()

    def no_compile(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(codegen, "_CODE", {})  # a new process: only the disk cache
    monkeypatch.setattr(codegen, "compile", no_compile, raising=False)
    loaded = codegen.code_object(text, "<optguard:f>")
    namespace = {}
    exec(loaded, namespace)
    assert namespace["f"]({"x": 41}) == 42
    with pytest.raises(AssertionError, match="compiled again"):  # other text: compiled
        codegen.code_object(text.replace("+ 1", "+ 2"), "<optguard:f>")

    monkeypatch.undo()
    monkeypatch.setenv("OPTGUARD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codegen, "_CODE", {})
    stored.write_bytes(b"not marshal data")  # a damaged file: compiled again, rewritten
    namespace = {}
    exec(codegen.code_object(text, "<optguard:f>"), namespace)
    assert namespace["f"]({"x": 1}) == 2
    assert stored.read_bytes() != b"not marshal data"


def test_a_traceback_through_generated_code_shows_the_generated_line():
    import traceback

    fn, _ = build_function("ratio", "x", ["    y = x - 1", "    return 1 / y"], {})
    try:
        fn(1)
    except ZeroDivisionError:
        text = traceback.format_exc()
    else:
        raise AssertionError("no error")
    assert "<optguard:ratio:" in text
    assert "return 1 / y" in text  # the line itself, read back through linecache
