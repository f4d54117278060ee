"""Ray Train (`make test-ray`; skipped where ray is not installed): trainmesh inside `TorchTrainer` on a local Ray
of 2 CPU workers trains exactly as trainmesh's own 2-process launch does.

Ray sets up the workers' process group itself; trainmesh adopts it. The same nano GPT job, through
trainmesh.compat.ray.fit and through run_distributed (trainmesh's own group), must end with identical
weights and optimizer state in its final DCP checkpoint, also when a rank fails halfway and Ray restarts the
workers (they continue from the run's checkpoint); and a user's loop on `Runtime` inside Ray's training
function must train as the same loop does under trainmesh, and leave Ray's group alive for Ray.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

ray = pytest.importorskip("ray", reason="Ray Train tests need ray[train]: `make test-ray`")
pytest.importorskip("ray.train.torch")

from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402  (after the skip)
from ray.train.torch import TorchTrainer  # noqa: E402

from support import nano_config, train_rank, train_records  # noqa: E402
from trainmesh.checkpoint import list_checkpoints  # noqa: E402
from trainmesh.checkpoint.dcp import read_full_state  # noqa: E402
from trainmesh.compat.ray import fit, prepare, train_loop_config, train_loop_per_worker  # noqa: E402
from trainmesh.runtime.runtime import Runtime  # noqa: E402
from trainmesh.testing import run_distributed  # noqa: E402
from trainmesh.train.faults import ENV_VAR as FAULT_VARIABLE  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # Ray starts its workers in about 20 s on 2 cores

HERE = Path(__file__).parent
# Dropout on (the RNG state must match too); checkpoints at steps 2, 4 and 6 (a restart resumes from one).
JOB = [
    "--train.global_batch=8",
    "--train.max_steps=6",
    "--model.dropout=0.1",
    "--checkpoint.every=2",
    "--checkpoint.final=true",
]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A small local Ray (2 CPUs, 200 MB object store, no dashboard) for the module. Its workers import this
    module's functions and tests/support.py by name, as the driver does: they inherit PYTHONPATH."""
    paths = [str(HERE), str(HERE.parent), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(paths))
        ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=True)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JOB's run folder under trainmesh's own launch: 2 processes, trainmesh's own process group."""
    root = tmp_path_factory.mktemp("own")
    run_distributed(train_rank, 2, args=(str(root), [*JOB, "--run.id=own"]), timeout_s=120)
    return root / "runs" / "own"


def _final_state(run_dir: Path) -> dict[str, Any]:
    """The model and optimizer state of the run's final checkpoint, read in this process."""
    checkpoints = list_checkpoints(run_dir)
    assert checkpoints, f"no checkpoint in {run_dir}"
    return read_full_state(checkpoints[-1])


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): state}


def _assert_same_final_state(run_dir: Path, reference: Path) -> None:
    """Weights and Adam's moments of the two runs' final checkpoints (step 6), bit for bit."""
    own, under_ray = _flat(_final_state(reference)), _flat(_final_state(run_dir))
    assert list_checkpoints(run_dir)[-1].name == list_checkpoints(reference)[-1].name == "step_00000006"
    assert under_ray.keys() == own.keys()
    tensors = [k for k, v in own.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optim.") for k in tensors)
    for key in tensors:
        assert torch.equal(under_ray[key], own[key]), key


def test_recipe_under_torch_trainer_trains_as_trainmesh_s_own_launch(
    local_ray: None, reference: Path, tmp_path: Path
) -> None:
    run = fit(nano_config(tmp_path, *JOB, "--run.id=ray"), ScalingConfig(num_workers=2, use_gpu=False))
    assert run.run_dir == tmp_path / "runs" / "ray" and (run.run_dir / "config.toml").is_file()
    assert [r["step"] for r in train_records(run.run_dir)] == list(range(1, 7))  # rank 0 alone wrote them
    assert [r["loss"] for r in train_records(run.run_dir)] == [r["loss"] for r in train_records(reference)]
    _assert_same_final_state(run.run_dir, reference)


def faulty_worker(loop_config: dict[str, Any]) -> None:
    """train_loop_per_worker with trainmesh's fault hook set in Ray's worker process (it fires once per run)."""
    os.environ[FAULT_VARIABLE] = loop_config["fault"]
    train_loop_per_worker(loop_config)


def test_a_ray_restart_continues_from_the_run_s_checkpoint(local_ray: None, reference: Path, tmp_path: Path) -> None:
    """Rank 1 fails after step 5; Ray restarts both workers (FailureConfig), which continue from the step-4
    checkpoint and end where the uninterrupted run ends. Built from the parts `fit` uses, without its lock."""
    job, run_dir = prepare(nano_config(tmp_path, *JOB, "--run.id=restarted"), 2)
    TorchTrainer(
        faulty_worker,
        train_loop_config={**train_loop_config(job, run_dir), "fault": "rank=1,step=5,kind=exception"},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="ray", storage_path=str(run_dir), failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert (run_dir / ".faults").is_dir()  # the fault did fire
    _assert_same_final_state(run_dir, reference)


def _runtime_loop(out: Path, tag: str) -> dict[str, Any]:
    """A user's own loop on Runtime: a small regression, 4 steps of DDP, each rank on its own half of the data."""
    rt = Runtime(strategy="ddp", seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    model = rt.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        i = (step * rt.world_size + rt.rank) * 32
        xb, yb = rt.to_device((x[i : i + 32], y[i : i + 32]))
        rt.backward(nn.functional.mse_loss(model(xb), yb))
        rt.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    seen = {
        "rank": rt.rank,
        "world": rt.world_size,
        "local_rank": rt.local_rank,
        "source": rt.env.source,
        "owns_group": rt.owns_group,
    }
    params = {k: v.detach().clone() for k, v in rt.unwrap(model).state_dict().items()}
    rt.teardown()
    result = {"seen": seen, "alive": dist.is_initialized(), "params": params}
    torch.save(result, out / f"{tag}_rank{seen['rank']}.pt")
    return result


def ray_runtime_loop(loop_config: dict[str, Any]) -> None:
    _runtime_loop(Path(loop_config["out"]), "ray")


def own_runtime_rank(rank: int, out: str) -> dict[str, Any]:
    return _runtime_loop(Path(out), "own")


def test_runtime_in_a_ray_training_function_adopts_ray_s_group(local_ray: None, tmp_path: Path) -> None:
    own = run_distributed(own_runtime_rank, 2, args=(str(tmp_path),), timeout_s=120)
    TorchTrainer(
        ray_runtime_loop,
        train_loop_config={"out": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(name="own-loop", storage_path=str(tmp_path / "ray")),
    ).fit()
    for rank in range(2):
        got = torch.load(tmp_path / f"ray_rank{rank}.pt", weights_only=True)
        assert got["seen"] == {"rank": rank, "world": 2, "local_rank": rank, "source": "adopted", "owns_group": False}
        assert got["alive"]  # teardown left Ray's group to Ray
        assert own[rank]["seen"]["owns_group"] and not own[rank]["alive"]  # trainmesh's own group: made, destroyed
        for key, value in own[rank]["params"].items():
            assert torch.equal(got["params"][key], value), key
