from __future__ import annotations

import pytest
import torch
from optsidefx import Build, ItemStore, Output
from opttrace import TraceError, eager_only_reason, init_state, trace_step


def test_init_state_creates_the_state_eager_would(params):
    opt = torch.optim.AdamW(params, lr=1e-3)
    eager = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params])
    init_state(opt)
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[params[0]]["step"].item() == 0.0
    assert opt.state[params[0]]["exp_avg"].abs().sum().item() == 0.0
    assert not eager.state  # untouched optimizer: state is created lazily


def test_init_state_skips_params_without_grad(params):
    params[0].grad = None
    opt = torch.optim.Adam(params)
    init_state(opt)
    assert params[0] not in opt.state
    assert params[1] in opt.state


def test_sgd_momentum_first_step_stores_new_buffers_in_state(params):
    traced = trace_step(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    stores = [e for e in traced.effects if isinstance(e, ItemStore)]
    assert len(stores) == len(params)
    assert all(e.key.value == "momentum_buffer" and isinstance(e.value, Output) for e in stores)
    assert traced.num_outputs == len(params)


def test_state_entry_created_in_step_is_built_fresh(params):
    class Lazy(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "avg" not in state:
                        self.state[p] = {"avg": torch.zeros_like(p)}
                    self.state[p]["avg"].add_(p.grad)
                    p.add_(self.state[p]["avg"], alpha=-group["lr"])

    traced = trace_step(Lazy(params))
    stores = [e for e in traced.effects if isinstance(e, ItemStore)]
    assert len(stores) == len(params)
    assert all(isinstance(e.value, Build) and e.value.keys == ("avg",) for e in stores)


@pytest.mark.parametrize("option", ["fused", "differentiable"])
def test_eager_only_options_are_refused_with_reason(params, option):
    opt = torch.optim.Adam(params, **{option: True})
    assert option in (eager_only_reason(opt) or "")
    with pytest.raises(TraceError, match=f"{option}=True"):
        trace_step(opt)


def test_float_hyperparameters_are_graph_inputs_guarded_by_type_only(params):
    traced = trace_step(torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.9)))
    guards = traced.guards.describe()
    inputs = [s.name() for s in traced.input_sources]
    for name in ("['lr']", "['betas'][0]", "['betas'][1]", "['eps']", "['weight_decay']"):
        assert f"L['opt'].param_groups[0]{name}" in inputs
        assert f"L['opt'].param_groups[0]{name} is a float" in guards
        assert not any(g.startswith(f"L['opt'].param_groups[0]{name} ==") for g in guards)
    # The trace forces capturable=True but guards the user's value.
    assert "L['opt'].param_groups[0]['capturable'] == False" in guards


def test_keys_the_step_never_reads_are_not_guarded(params):
    opt = torch.optim.SGD(params, lr=0.1)
    opt.param_groups[0]["initial_lr"] = 0.1  # what an LR scheduler adds
    guards = trace_step(opt).guards.describe()
    assert not any("['initial_lr'] ==" in g for g in guards)


def test_tracing_leaves_the_real_optimizer_untouched(params):
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = [p.detach().clone() for p in params]
    trace_step(opt)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert opt.param_groups[0]["capturable"] is False
    assert all(opt.state[p]["step"].item() == 0.0 for p in params)


def _python_float_sources(traced) -> set[str]:
    nodes = traced.graph_module.graph.nodes
    return {n.meta["source"].name() for n in nodes if n.meta.get("python_float")}


def test_capturable_trace_marks_what_eager_reads_as_python_floats(params):
    """A capturable trace standing for capturable=False marks the step counts (and NAdam's
    mu_product) that eager's path reads with .item(): a backend computes with them as
    Python floats. The trace itself still computes in their dtype (no cast in the graph)."""
    traced = trace_step(torch.optim.NAdam(params, lr=0.1), capturable=True)
    marked = _python_float_sources(traced)
    assert marked == {
        f"L['opt'].state[L['opt'].param_groups[0]['params'][{i}]][{key!r}]"
        for i in range(len(params))
        for key in ("step", "mu_product")
    }
    targets = {n.target for n in traced.graph_module.graph.nodes}
    assert torch.ops.aten._to_copy.default not in targets


def test_custom_steps_and_eager_paths_mark_nothing(params):
    class Counting(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, {"lr": 0.1, "capturable": False})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                    state["step"] += 1
                    p.sub_(p.grad * group["lr"] / state["step"])

    opt = Counting(params)
    opt.step()
    assert not _python_float_sources(trace_step(opt, capturable=True))
    assert not _python_float_sources(trace_step(torch.optim.Adam(params)))


def test_foreach_none_is_the_for_loop_where_torchs_step_never_defaults_to_foreach():
    """Adafactor tests ``if foreach:``: None is its for-loop on every device (a CUDA param
    made the view show foreach=True: the trace took the foreach path, eager the for-loop).
    The others choose by device, as does a step outside torch.optim."""
    from opttrace._torch_compat import none_means_for_loop

    class Custom(torch.optim.Optimizer):
        def step(self, closure=None):
            return None

    assert none_means_for_loop(torch.optim.Adafactor)
    others = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.ASGD, Custom]
    assert not any(none_means_for_loop(cls) for cls in others)


def test_adafactor_with_foreach_none_traces_its_for_loop(params):
    traced = trace_step(torch.optim.Adafactor(params, lr=1e-2, foreach=None))
    targets = {str(n.target) for n in traced.graph_module.graph.nodes}
    assert not any("_foreach_" in t for t in targets)


def test_a_zero_dim_params_state_is_not_marked_as_python_floats():
    """Only the values eager's path reads as numbers (step counts): a 0-dim param's state
    (Adam's exp_avg) is a tensor eager computes with in its dtype, as any param's."""
    scalar = torch.nn.Parameter(torch.randn(()))
    scalar.grad = torch.randn(())
    traced = trace_step(torch.optim.Adam([scalar], lr=0.1), capturable=True)
    assert _python_float_sources(traced) == {
        "L['opt'].state[L['opt'].param_groups[0]['params'][0]]['step']"
    }


def test_asgd_with_a_foreach_group_beside_its_for_loop_traces_eagers_path_on_the_cpu():
    """ASGD's foreach path makes mu from a step count read as a Python float
    (``as_tensor(1 / max(1, step.item() - t0))``): traced as a 0-dim tensor of it, so the
    trace keeps eager's path for every group (its for-loop groups' ops are eager's, not the
    capturable path's) and computes eager's mu."""
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(()))]
    params.append(torch.nn.Parameter(torch.randn(4)))
    for p in params:
        p.grad = torch.randn_like(p)
    groups = [{"params": params[:2]}, {"params": params[2:], "foreach": True}]
    opt = torch.optim.ASGD(groups, lr=0.01, t0=1.0)
    for _ in range(3):
        opt.step()
    traced = trace_step(opt)
    assert not traced.capturable
    targets = {str(n.target) for n in traced.graph_module.graph.nodes}
    assert "aten.scalar_tensor.default" in targets  # (mu, made from the step count)
