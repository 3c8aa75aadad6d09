"""The optcompile.* loggers: topics, set_logs / OPTCOMPILE_LOGS, one line per retrace."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import optcompile
import pytest
import torch
from optcompile.testing import run_pair, set_grads, small_model


@pytest.fixture(autouse=True)
def _logs_off():
    yield
    optcompile.set_logs(None)


def _retrace_lr(opt: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    opt.param_groups[0]["lr"] = 2  # an int is a constant: a new value retraces
    set_grads(model, 5)
    opt.step()


def test_set_logs_prints_one_line_per_retrace_with_source_and_values(capsys):
    optcompile.set_logs("recompiles")
    model, opt, *_ = run_pair(lambda ps: torch.optim.SGD(ps, lr=1), steps=1, backend="torch")
    capsys.readouterr()
    _retrace_lr(opt, model)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[optcompile.recompiles] SGD.step: retrace (entry 2, recompile_limit 8): "
        "L['opt'].param_groups[0]['lr']: value changed (1 -> 2)"
    ]


def test_topics_not_named_stay_quiet_and_none_turns_the_handler_off(capsys):
    optcompile.set_logs("perf")
    run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1), steps=1, backend="torch")
    err = capsys.readouterr().err
    assert "[optcompile.perf] SGD.step: entry 1: trace" in err
    assert "[optcompile.graph]" not in err and "[optcompile.guards]" not in err
    optcompile.set_logs(None)
    run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1), steps=1, backend="torch")
    assert capsys.readouterr().err == ""


def test_plus_prefix_enables_debug_with_the_generated_code(capsys):
    optcompile.set_logs("+guards")
    run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1), steps=1, backend="torch")
    err = capsys.readouterr().err
    assert "[optcompile.guards] check compiled: " in err
    assert "def check(L):" in err  # the DEBUG line


def test_each_package_logs_under_its_topic(caplog):
    caplog.set_level(logging.DEBUG, logger="optcompile")
    run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=1, backend="torch")
    names = {r.name for r in caplog.records}
    expected = {"guards", "graph", "sidefx", "kernels", "cudagraphs", "perf", "recompiles"}
    assert names >= {f"optcompile.{t}" for t in expected}, names
    graph = [r.getMessage() for r in caplog.records if r.name == "optcompile.graph"]
    assert any(m.startswith("traced ") and " ops over " in m for m in graph), graph


def test_an_unknown_topic_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"'recompile'.*recompiles, guards, graph"):
        optcompile.set_logs("recompile")


def test_all_enables_every_topic():
    optcompile.set_logs("all")
    for topic in optcompile.LOG_TOPICS:
        assert logging.getLogger(f"optcompile.{topic}").level == logging.INFO


def test_the_environment_variable_is_read_at_import():
    code = (
        "import torch, optcompile\n"
        "opt = optcompile.compile(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1))\n"
        "opt.param_groups[0]['params'][0].grad = torch.ones(2)\n"
        "opt.step(); opt.param_groups[0]['lr'] = 3; opt.step()\n"
    )
    env = {**os.environ, "OPTCOMPILE_LOGS": "recompiles"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "[optcompile.recompiles] SGD.step: retrace (entry 2" in done.stderr
    assert "value changed (1 -> 3)" in done.stderr


def test_a_fallback_is_logged_as_well_as_warned(caplog):
    caplog.set_level(logging.INFO, logger="optcompile.recompiles")
    model = small_model()
    opt = optcompile.compile(torch.optim.Adam(model.parameters(), fused=True))
    set_grads(model, 0)
    with pytest.warns(optcompile.FallbackWarning):
        opt.step()
    assert any("Adam.step runs eagerly" in r.getMessage() for r in caplog.records)
