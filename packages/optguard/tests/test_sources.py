from __future__ import annotations

import copy
import pickle
from collections import defaultdict

import torch
from optguard import AttrSource, ItemSource, KeyedSource, LocalSource, variable_name
from optguard_paths import GROUP, OPT, PARAM, STATE


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=lr)


def test_local_source_name_is_an_index_into_L():
    assert OPT.name() == "L['opt']"


def test_item_source_name_prints_the_access_path():
    assert ItemSource(GROUP, "lr").name() == "L['opt'].param_groups[0]['lr']"


def test_keyed_source_name_nests_the_key_path():
    assert STATE.name() == "L['opt'].state[L['opt'].param_groups[0]['params'][0]]"


def test_str_and_repr_are_the_name():
    source = ItemSource(GROUP, "lr")
    assert str(source) == repr(source) == "L['opt'].param_groups[0]['lr']"


def test_equal_paths_are_equal_sources_with_equal_hashes():
    a, b = ItemSource(GROUP, "lr"), ItemSource(ItemSource(AttrSource(OPT, "param_groups"), 0), "lr")
    assert a == b and hash(a) == hash(b)


def test_equal_paths_are_one_object_however_made():
    made = ItemSource(base=ItemSource(AttrSource(OPT, "param_groups"), 0), key="lr")
    copied, unpickled = copy.deepcopy(made), pickle.loads(pickle.dumps(made))
    assert made is ItemSource(GROUP, "lr") is copied is unpickled


def test_different_paths_are_different_sources():
    assert ItemSource(GROUP, "lr") != ItemSource(GROUP, "eps")
    assert ItemSource(GROUP, 0) != AttrSource(GROUP, "0")


def test_fetch_returns_the_live_value_after_a_change():
    opt, lr = _opt(lr=0.1), ItemSource(GROUP, "lr")
    opt.param_groups[0]["lr"] = 0.5
    assert lr.fetch({"opt": opt}) == 0.5


def test_item_source_fetch_returns_the_object_itself():
    opt = _opt()
    assert PARAM.fetch({"opt": opt}) is opt.param_groups[0]["params"][0]


def test_attr_source_fetch_reads_the_attribute():
    opt = _opt()
    grad = torch.ones(3)
    opt.param_groups[0]["params"][0].grad = grad
    assert AttrSource(PARAM, "grad").fetch({"opt": opt}) is grad


def test_keyed_source_fetch_returns_the_entry_for_the_key_object():
    opt = _opt()
    entry = {"momentum_buffer": torch.zeros(3)}
    opt.state[opt.param_groups[0]["params"][0]] = entry
    assert STATE.fetch({"opt": opt}) is entry


def test_keyed_source_fetch_on_defaultdict_returns_none_for_a_missing_key():
    opt = _opt()
    assert isinstance(opt.state, defaultdict)
    assert STATE.fetch({"opt": opt}) is None


def test_keyed_source_fetch_on_defaultdict_does_not_create_the_entry():
    state: defaultdict[str, dict[str, int]] = defaultdict(dict)
    source = KeyedSource(LocalSource("state"), LocalSource("key"))
    source.fetch({"state": state, "key": "missing"})
    assert "missing" not in state


def test_parents_of_keyed_source_are_the_dict_and_the_key():
    assert STATE.parents() == (AttrSource(OPT, "state"), PARAM)


def test_expr_reads_from_the_parent_variables():
    assert ItemSource(GROUP, "lr").expr(("group",)) == "group['lr']"
    assert AttrSource(OPT, "state").expr(("opt",)) == "opt.state"
    assert STATE.expr(("state", "p")) == "state.get(p)"


def test_variable_name_drops_punctuation_from_the_path():
    assert variable_name(ItemSource(GROUP, "lr")) == "opt_param_groups_0_lr"


def test_variable_name_of_keyed_source_is_an_identifier():
    assert variable_name(STATE).isidentifier()


def test_variable_name_prefixes_a_leading_digit():
    assert variable_name(LocalSource("0x")) == "v_0x"


def test_variable_name_of_punctuation_only_name_is_an_identifier():
    assert variable_name(LocalSource("!?")).isidentifier()


def test_variable_name_of_a_nested_source_joins_its_path_by_underscores():
    local = AttrSource(ItemSource(ItemSource(STATE, "exp_avg"), ""), "_local_tensor")
    assert variable_name(local) == "opt_state_opt_param_groups_0_params_0_exp_avg_local_tensor"
    assert variable_name(AttrSource(LocalSource("0x"), "grad")) == "v_0x_grad"
