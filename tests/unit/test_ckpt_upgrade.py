"""The GPT's fused q/k/v projection, and `trainmesh ckpt upgrade` for checkpoints saved before it.

The fused projection is checked against the old three-projection attention written out independently here;
the upgrade against a checkpoint put back into the old layout (every tensor split head by head, the
optimizer's moments and param groups too): refused on resume with the command to run, upgraded by the
CLI, then resumed to the very weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.support import nano_config, train_rank
from torch.nn import functional as F

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.checkpoint.dcp import CheckpointMismatchError, read_full_state
from trainmesh.checkpoint.manifest import write_manifest_here
from trainmesh.checkpoint.state import TRAINER_STATE
from trainmesh.cli import main
from trainmesh.job.worker import run_worker
from trainmesh.recipes.gpt import GPT, GPTConfig
from trainmesh.recipes.gpt.upgrade import fuse_heads

pytestmark = pytest.mark.timeout(180)


def separate_attention(x: torch.Tensor, w: dict[str, torch.Tensor], n_head: int) -> torch.Tensor:
    """The attention of trainmesh before the fusion: three projections, heads cut from each."""
    B, T, C = x.shape
    q, k, v = (F.linear(x, w[f"{n}.weight"], w[f"{n}.bias"]).view(B, T, n_head, -1).transpose(1, 2) for n in "qkv")
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    return F.linear(y, w["proj.weight"], w["proj.bias"])


def test_the_fused_projection_computes_what_the_three_separate_ones_did() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(size="nano", n_head=4, block_size=16, vocab_size=64)
    attn = GPT(cfg).blocks[0].attn
    C = cfg.n_embd
    old = {f"{n}.weight": torch.randn(C, C) / C**0.5 for n in "qkv"} | {f"{n}.bias": torch.randn(C) for n in "qkv"}
    old |= {"proj.weight": attn.proj.weight.detach(), "proj.bias": attn.proj.bias.detach()}
    with torch.no_grad():
        for kind in ("weight", "bias"):
            getattr(attn.qkv, kind).copy_(fuse_heads(*(old[f"{n}.{kind}"] for n in "qkv"), cfg.n_head))
    x = torch.randn(3, cfg.block_size, cfg.n_embd)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), separate_attention(x, old, cfg.n_head), rtol=1e-5, atol=1e-6)


def split_heads(fused: torch.Tensor, n_head: int) -> list[torch.Tensor]:
    """fuse_heads's inverse: (3C, ...) laid out head by head -> q, k, v, each (C, ...)."""
    per_head = fused.reshape(n_head, 3, -1, *fused.shape[1:])
    return [per_head[:, i].reshape(-1, *fused.shape[1:]).clone() for i in range(3)]


def to_old_layout(ckpt: Path, n_head: int) -> None:
    """Rewrite a checkpoint as trainmesh saved it before the fusion (attn.q, attn.k, attn.v)."""
    state = read_full_state(ckpt)

    def split(values: dict[str, Any], fn: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in values.items():
            if ".attn.qkv." not in key:
                out[key] = value
                continue
            for i, part in enumerate(fn(value)):
                out[key.replace(".qkv.", f".{'qkv'[i]}.")] = part
        return out

    def split_moments(moments: dict[str, Any]) -> list[dict[str, Any]]:
        parts = {k: split_heads(v, n_head) if v.dim() else [v.clone()] * 3 for k, v in moments.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(3)]

    state["model"] = split(state["model"], lambda t: split_heads(t, n_head))
    state["optim"]["state"] = split(state["optim"]["state"], split_moments)
    for group in state["optim"]["param_groups"]:
        group["params"] = [
            name.replace(".qkv.", f".{n}.") for name in group["params"] for n in ("qkv" if ".qkv." in name else "_")
        ]
    old = ckpt.with_name("old")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(old), no_dist=True)
    shutil.copy2(ckpt / TRAINER_STATE, old / TRAINER_STATE)
    shutil.copytree(ckpt / "rng", old / "rng")
    write_manifest_here(old)
    shutil.rmtree(ckpt)
    old.rename(ckpt)


def test_an_old_checkpoint_is_refused_with_the_fix_then_upgraded_and_resumed_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--model.n_head=4", "--checkpoint.final=true"]
    whole = train_rank(0, str(tmp_path), [*common, "--run.id=whole", "--train.max_steps=4"])
    first = train_rank(0, str(tmp_path), [*common, "--run.id=cut", "--train.max_steps=2"])
    run_dir = tmp_path / "runs" / "cut"
    (ckpt,) = list_checkpoints(run_dir)
    to_old_layout(ckpt, n_head=4)
    assert "model.blocks.0.attn.q.weight" in {f"model.{k}" for k in read_full_state(ckpt)["model"]}

    resume = nano_config(tmp_path, *common, "--run.id=cut", "--train.max_steps=4", "--checkpoint.resume=true")
    with pytest.raises(CheckpointMismatchError, match=rf"attn\.q\.weight(.|\n)*trainmesh ckpt upgrade {ckpt}"):
        run_worker(resume, run_dir)

    assert main(["ckpt", "upgrade", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"upgraded {ckpt}:" in out and "blocks.1.attn.q.weight, blocks.1.attn.k.weight" in out
    assert ckpt.with_name(ckpt.name + ".pre-upgrade").is_dir()  # the original is kept, not listed
    assert list_checkpoints(run_dir) == [ckpt]
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    assert main(["ckpt", "upgrade", str(run_dir)]) == 0  # again: nothing left to convert
    assert f"current  {ckpt} (nothing to convert)" in capsys.readouterr().out

    resumed = train_rank(0, str(tmp_path), [*common, "--run.id=cut", "--train.max_steps=4", "--checkpoint.resume=true"])
    assert first["losses"] == whole["losses"][:2]
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_a_damaged_checkpoint_is_not_upgraded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train_rank(0, str(tmp_path), ["--checkpoint.final=true", "--run.id=r", "--train.max_steps=1"])
    (ckpt,) = list_checkpoints(tmp_path / "runs" / "r")
    to_old_layout(ckpt, n_head=2)
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in ckpt.parent.iterdir())
    assert main(["ckpt", "upgrade", str(ckpt)]) == 1
    assert "does not verify, so it was not upgraded" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.parent.iterdir()) == before


def test_a_symlink_or_an_unconvertible_checkpoint_is_refused_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train_rank(0, str(tmp_path), ["--checkpoint.final=true", "--run.id=r", "--train.max_steps=1"])
    (ckpt,) = list_checkpoints(tmp_path / "runs" / "r")
    to_old_layout(ckpt, n_head=2)
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    assert main(["ckpt", "upgrade", str(link)]) == 1
    assert "is a symbolic link" in capsys.readouterr().err and link.is_symlink()
    # its recorded [model] made impossible to map: 3 heads do not divide 32 columns
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    state["config"]["model"]["n_head"] = 3
    (ckpt / TRAINER_STATE).write_text(json.dumps(state))
    write_manifest_here(ckpt)
    before = sorted(p.name for p in ckpt.parent.iterdir())
    assert main(["ckpt", "upgrade", str(ckpt)]) == 1
    assert "cannot be converted" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.parent.iterdir()) == before
