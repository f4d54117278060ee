"""Export's tensor preparation on a live model, whose tied weights share memory (the e2e tests in
tests/e2e/test_ckpt_cli.py read tensors back from DCP, where the tie is already two copies), and the mode of the
files it writes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainmesh.checkpoint.export import ExportError, save_safetensors, standalone_tensors
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


@pytest.fixture(params=[0o022, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test runs under this umask (the usual one, and a shared group's)."""
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def test_safetensors_files_get_the_mode_of_any_new_file(tmp_path: Path, umask: int) -> None:
    """safetensors' save_file makes its file mode 0600 whatever the umask; an export's is as any file's."""
    save_file({"w": torch.zeros(2)}, str(tmp_path / "raw.safetensors"))
    assert stat.S_IMODE((tmp_path / "raw.safetensors").stat().st_mode) == 0o600  # why export has to do something
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")  # replaced as a whole
    save_safetensors(out, {"w": torch.ones(2)}, {"format": "pt"})
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert torch.equal(load_file(out)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "raw.safetensors"]  # no temporary


def test_inspect_allocates_nothing_for_metadata_claiming_more_than_is_stored(tmp_path: Path) -> None:
    """A forged .metadata naming a 10^12-element tied copy: the tied-weight check reads nothing (it would allocate
    terabytes) and names no tie."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from trainmesh.checkpoint.inspect import tied_copies

    size = torch.Size([10**6, 10**6])
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata([0, 0], size)])
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 64)
    assert tied_copies(tmp_path, {"wte.weight": meta, "lm_head.weight": meta}, {"wte.weight"}) == {}
