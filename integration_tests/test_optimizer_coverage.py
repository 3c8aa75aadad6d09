"""Every torch.optim optimizer the compiler targets, default options, foreach on and off."""

from __future__ import annotations

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair

optim = torch.optim
OPTIMIZERS = {
    "Adam": lambda ps, f: optim.Adam(ps, lr=1e-2, foreach=f),
    "AdamW": lambda ps, f: optim.AdamW(ps, lr=1e-2, foreach=f),
    "NAdam": lambda ps, f: optim.NAdam(ps, lr=1e-2, foreach=f),
    "RAdam": lambda ps, f: optim.RAdam(ps, lr=1e-2, foreach=f),
    "Adamax": lambda ps, f: optim.Adamax(ps, lr=1e-2, foreach=f),
    "Adadelta": lambda ps, f: optim.Adadelta(ps, foreach=f),
    "Adagrad": lambda ps, f: optim.Adagrad(ps, lr=1e-2, foreach=f),
    "RMSprop": lambda ps, f: optim.RMSprop(ps, lr=1e-2, foreach=f),
    "Rprop": lambda ps, f: optim.Rprop(ps, lr=1e-2, foreach=f),
    "SGD": lambda ps, f: optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=f),
    "ASGD": lambda ps, f: optim.ASGD(ps, lr=1e-2, foreach=f),
}


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_options_compile_and_match_eager(name, foreach):
    model, opt, reference, eager = run_pair(lambda ps: OPTIMIZERS[name](ps, foreach), steps=3)
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    # Only SGD creates state (momentum buffers) inside its first step: one retrace for that.
    assert report.traces == (2 if name == "SGD" else 1), report.retrace_reasons
