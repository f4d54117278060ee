from __future__ import annotations

import pytest
import torch

from trainmesh.config.schema import ParallelConfig
from trainmesh.core.dist import select_backend, select_device
from trainmesh.core.env import DistEnv
from trainmesh.recipes.gpt.model import GPT, GPTConfig
from trainmesh.strategies import Layout, ParallelDims, build_strategy, resolve_parallelism
from trainmesh.strategies.base import Strategy
from trainmesh.strategies.fsdp import FSDPStrategy

SINGLE = DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "single")
CPU = torch.device("cpu")
ONE_RANK = ParallelDims()


def _resolve(strategy: str, world_size: int) -> Layout:
    return resolve_parallelism(ParallelConfig(strategy=strategy), world_size)


def test_auto_picks_ddp_for_several_processes() -> None:
    assert _resolve("auto", 1)[0] == "single"
    assert _resolve("auto", 4)[0] == "ddp"


def test_single_with_several_processes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"strategy=.single. keeps one model replica, but the world size is 2.*ddp"):
        _resolve("single", 2)


def test_data_parallel_needs_gpus_and_says_what_to_use_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"needs CUDA GPUs.*--parallel.strategy=ddp.*--nproc-per-node 2"):
        build_strategy(Layout("dp", ONE_RANK), env=SINGLE, device=CPU)


def test_device_and_backend_choice_on_cpu() -> None:
    assert select_device("cpu", SINGLE) == CPU
    assert select_backend("auto", CPU) == "gloo"
    with pytest.raises(ValueError, match=r"dist.backend='nccl' needs CUDA tensors.*--dist.backend=gloo"):
        select_backend("nccl", CPU)


def test_cuda_requested_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # whatever this machine has
    assert select_device("auto", SINGLE) == CPU
    with pytest.raises(RuntimeError, match=r"dist.device='cuda' but torch sees no CUDA GPU.*--dist.device=cpu"):
        select_device("cuda", SINGLE)


def test_data_parallel_with_several_processes_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"strategy='dp' drives all local GPUs from ONE process.*world size is 2"):
        _resolve("dp", 2)


def _compiled(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)]


def test_compile_makes_one_graph_of_a_whole_model_and_one_per_block_where_blocks_are_sharded() -> None:
    """One graph where nothing is sharded: per-block graphs left the head and loss eager and cost a GPT-2 step
    a third of its speed on an H100 (BENCHMARKS.md). FSDP shards by block, so it keeps one graph per block."""
    single = build_strategy(Layout("single", ONE_RANK), env=SINGLE, device=CPU, compile=True)
    assert single.compiles_whole_model
    assert _compiled(single.setup_module(GPT(GPTConfig(size="nano", vocab_size=256)))) == [""]
    assert build_strategy(Layout("ddp", ONE_RANK), env=SINGLE, device=CPU, compile=True).compiles_whole_model
    assert FSDPStrategy.compiles_whole_model is Strategy.compiles_whole_model  # False: fsdp keeps one per block
