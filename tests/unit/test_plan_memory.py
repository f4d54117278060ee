"""The memory model of `trainmesh plan`: the ZeRO paper's model-state table and trainmesh's precisions (the GPT's
activations: test_plan_activations.py)."""

from __future__ import annotations

import pytest

from trainmesh.apps.plan.memory import StateBytes, model_states

pytestmark = pytest.mark.timeout(60)

ZERO_PAPER = StateBytes(weights=2, grads=2, optimizer=12)
"""The ZeRO paper's mixed-precision Adam: fp16 weights and gradients, K = 12 bytes of fp32 state (a test oracle:
trainmesh's own precisions are StateBytes.adamw)."""


def test_the_zero_papers_model_state_table_is_reproduced() -> None:
    """ZeRO (arXiv 1910.02054), figure 1 / section 5: 7.5B parameters, 64 GPUs, fp16 + Adam (K = 12)."""
    gb = [model_states(7_500_000_000, 64, stage, ZERO_PAPER).total / 1e9 for stage in (0, 1, 2, 3)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_trainmesh_precisions_and_bad_input() -> None:
    fp32 = model_states(1000, 4, 0, StateBytes.adamw("bf16-mixed"))
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4000, 4000, 8000)  # 16 bytes per parameter, as DDP
    assert model_states(1000, 4, 3, StateBytes.adamw("32-true")).total == 4000  # FSDP full shard: 16Ψ/N
    assert model_states(1000, 2, 0, StateBytes.adamw("bf16-true")).total == 8000
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        StateBytes.adamw("fp8")
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        model_states(1000, 2, 4, ZERO_PAPER)
