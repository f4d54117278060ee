"""Export's tensor preparation on a live model, whose tied weights share memory (the e2e tests in
tests/e2e/test_ckpt_cli.py read tensors back from DCP, where the tie is already two copies)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainmesh.checkpoint.export import ExportError, standalone_tensors
from trainmesh.recipes.gpt import GPT, GPTConfig


def test_tied_weights_are_kept_under_both_names_with_their_own_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(size="nano", block_size=8, vocab_size=64)
    model = GPT(cfg).eval()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    with pytest.raises(RuntimeError, match="share memory"):  # why export has to do something
        save_file(state, str(tmp_path / "raw.safetensors"))

    tensors = standalone_tensors(state)
    assert tensors["lm_head.weight"].data_ptr() != tensors["wte.weight"].data_ptr()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_file(tmp_path / "model.safetensors")
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    fresh = GPT(cfg).eval()
    fresh.load_state_dict(loaded, strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))  # (B, T)
    with torch.no_grad():
        assert torch.equal(fresh(idx), model(idx))


def test_non_contiguous_tensors_are_made_contiguous_and_non_tensors_refused() -> None:
    t = torch.arange(12.0).view(3, 4).t()
    out = standalone_tensors({"w": t})["w"]
    assert out.is_contiguous() and torch.equal(out, t)
    with pytest.raises(ExportError, match=r"'step' is not a tensor \(int\)"):
        standalone_tensors({"step": 3})
