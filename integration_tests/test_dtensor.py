"""Sharded steps (FSDP2 ``fully_shard``, DTensor) compile, fuse like plain ones and match eager.

Two spawned processes over a gloo process group (world size 2) run every scenario of
dtensor_scenarios.py once; each test reads its scenario's result on both ranks. Parity is
against eager torch.optim on a twin FSDP2 model fed the same batches: every parameter and
state shard, state of the same kind (a DTensor with the parameter's mesh and placements),
the trace count, and no FallbackWarning.
"""

from __future__ import annotations

import os

import dtensor_scenarios
import dtensor_setup
import pytest
import torch
import torch.distributed as dist

WORLD_SIZE = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = str(tmp_path_factory.mktemp("dtensor"))
    return dtensor_setup.spawn_ranks(dtensor_scenarios.__file__, WORLD_SIZE, out)


@pytest.mark.parametrize("scenario", list(dtensor_scenarios.SCENARIOS))
def test_sharded_scenario_matches_eager(results: list[dict[str, str]], scenario: str) -> None:
    if scenario == "triton_backend_fuses_like_plain" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on the CPU under TRITON_INTERPRET=1 only")
    for rank, by_name in enumerate(results):
        outcome = by_name.get(scenario, "did not run")
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


def test_dtensor_module_needs_no_cuda() -> None:
    assert torch.distributed.is_gloo_available()
