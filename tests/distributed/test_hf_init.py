"""`model.init_from` in every layout on 2 gloo ranks: DDP, FSDP built on the meta device (each rank materialises
only its shards and fills them from the folder), tensor parallelism (whole and meta-built) and pipeline stages
(meta-built) hold the same weights as one process, bit for bit (each rank's part is cut from the same full
tensor), and the layouts that run a whole forward give transformers' GPT-2 logits (fp32; atol 1e-5: the
row-parallel layers sum partial products in another order)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from support import nano_config
from trainmesh.config.schema import DistConfig
from trainmesh.job.spec import resolve
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

LAYOUTS = {
    "ddp": ["--parallel.strategy=ddp"],
    "fsdp, meta_init": ["--parallel.strategy=fsdp", "--parallel.meta_init=true"],
    "tp 2": ["--parallel.tp=2"],
    "tp 2, meta_init": ["--parallel.tp=2", "--parallel.meta_init=true"],
    "pp 2, meta_init": ["--parallel.pp=2", "--parallel.pipeline.microbatches=2", "--parallel.meta_init=true"],
}
CUT = {"fsdp, meta_init", "tp 2", "tp 2, meta_init"}
"""Layouts whose ranks hold parts of the attention weights (the others: whole ones, or whole stages)."""


def init_rank(rank: int, root: str, folder: str, layout: str, idx: torch.Tensor) -> dict[str, Any]:
    """Build the GPT from `folder` in `layout` as a run would; its full weights (what this rank holds) and logits."""
    config = nano_config(Path(root), f"--model.init_from={folder}", *LAYOUTS[layout])
    job = resolve(config, world_size=2)
    runtime = job.runtime()
    with torch.device("meta") if config.parallel.meta_init else contextlib.nullcontext():
        model = job.recipe.build_model(config, runtime)
    wrapped = runtime.setup(model, plan=job.recipe.parallel_plan(model))
    state = runtime.unwrap(wrapped).state_dict()
    sharded = [k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel() < v.numel()]
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}
    with torch.no_grad():  # a pipeline stage runs only under its schedule
        logits = None if job.layout.dims.pp > 1 else wrapped(idx)
    runtime.teardown()
    return {"state": full, "logits": logits, "sharded": sharded}


def test_init_from_under_fsdp_meta_init_and_tensor_parallel_equals_one_process(tmp_path: Path) -> None:
    torch.manual_seed(0)
    settings = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 256}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    with torch.no_grad():  # random biases and norms: GPT-2's init (zeros and ones) would hide misplaced ones
        for name, param in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.normal_(0.5 if name.endswith("weight") else 0.0, 0.1)
    hf.eval().save_pretrained(tmp_path / "gpt2")
    idx = torch.randint(0, 256, (2, 32))  # (B, T), the same on both ranks
    with torch.no_grad():
        expected = hf(idx).logits

    single = nano_config(tmp_path, f"--model.init_from={tmp_path / 'gpt2'}")
    runtime = Runtime(strategy="single", dist_config=DistConfig(device="cpu"))
    reference = resolve(single, 1).recipe.build_model(single, runtime).state_dict()
    for name in LAYOUTS:
        per_rank = run_distributed(init_rank, 2, args=(str(tmp_path), str(tmp_path / "gpt2"), name, idx))
        for rank, got in enumerate(per_rank):
            assert ("blocks.0.attn.qkv.weight" in got["sharded"]) == (name in CUT), name
            assert got["state"].keys() <= reference.keys(), name
            for key, tensor in got["state"].items():
                assert torch.equal(tensor, reference[key]), f"{name}, rank {rank}: {key}"
            if got["logits"] is not None:
                torch.testing.assert_close(got["logits"], expected, atol=1e-5, rtol=1e-5, msg=f"{name}, rank {rank}")
        held = set().union(*(got["state"] for got in per_rank))
        assert held == reference.keys(), f"{name}: the ranks together hold the whole model"
