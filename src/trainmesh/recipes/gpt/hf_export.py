"""`trainmesh ckpt export --format hf`: what goes into a folder that transformers loads as GPT-2 (weights, config.json,
and GPT-2's tokenizer files when the run used it); checkpoint/export.py writes it.

Details: docs/internals.md#recipesgpthf_exportpy
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from trainmesh.checkpoint.export import ExportError, ExportUsageError, export_metadata, save_safetensors
from trainmesh.checkpoint.state import TrainerState
from trainmesh.data.gpt2 import gpt2_vocab
from trainmesh.recipes.gpt.hf import hf_config, to_hf_state
from trainmesh.recipes.gpt.hf_init import CONFIG, WEIGHTS
from trainmesh.recipes.gpt.model import GPTConfig
from trainmesh.recipes.gpt.upgrade import fuse_qkv

EOT_TEXT = "<|endoftext|>"


class HFFormat:
    """The `FolderFormat` (checkpoint/export.py) of Hugging Face's GPT-2."""

    name = "hf"

    def check(self, state: TrainerState) -> None:
        run = state.config.get("run", {})
        recipe = run.get("recipe", "") if isinstance(run, dict) else ""
        if recipe != "gpt":
            raise ExportUsageError(
                f"--format hf writes the gpt recipe's models as Hugging Face GPT-2; this checkpoint was saved by the "
                f"{recipe or 'unknown'} recipe. Fix: --format safetensors (the default: its weights under trainmesh's "
                "names)."
            )
        if _gpt2_tokens(state):
            gpt2_vocab()  # its files are missing or not OpenAI's: refused before any weight is written

    def write(self, model_state: dict[str, torch.Tensor], state: TrainerState, folder: Path) -> int:
        cfg = saved_gpt_config(state.config.get("model", {}))
        full = {"model": dict(model_state)}
        fuse_qkv(full, state.config.get("model", {}))  # a checkpoint from before q, k, v were fused: in memory
        try:
            tensors = to_hf_state(full["model"], cfg)
        except ValueError as e:
            raise ExportError(f"cannot export this checkpoint as GPT-2: {e}") from None
        save_safetensors(folder / WEIGHTS, tensors, export_metadata(state))  # its format=pt: transformers'
        dtype = full["model"]["wte.weight"].dtype
        gpt2_tokens = _gpt2_tokens(state)
        _write_json(folder / CONFIG, hf_config(cfg, dtype, gpt2_tokens))
        if gpt2_tokens:
            write_gpt2_tokenizer(folder, cfg.block_size)
        return len(tensors)


def _gpt2_tokens(state: TrainerState) -> bool:
    """Whether the run trained on GPT-2's tokenizer (then the export carries it)."""
    data = state.config.get("data", {})
    return isinstance(data, dict) and data.get("tokenizer") == "gpt2"


def saved_gpt_config(saved: Any) -> GPTConfig:
    """The GPTConfig a checkpoint recorded (keys this version does not know, from another one, left out)."""
    if not isinstance(saved, dict):
        raise ExportError("the checkpoint records no [model] section; it cannot be exported as GPT-2")
    known = {f.name for f in fields(GPTConfig)}
    try:
        return GPTConfig(**{k: v for k, v in saved.items() if k in known})
    except (TypeError, ValueError) as e:
        raise ExportError(f"the checkpoint's model config is not a GPT's: {e}") from None


def write_gpt2_tokenizer(folder: Path, block_size: int) -> None:
    """GPT-2's tokenizer files in Hugging Face's names: the byte-level BPE's vocabulary and merges are OpenAI's
    files as they are (the formats are the same; checked against their SHA-256 first), plus the special token."""
    vocab = gpt2_vocab()
    (folder / "vocab.json").write_bytes(vocab.encoder_json)
    (folder / "merges.txt").write_bytes(vocab.vocab_bpe)
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "GPT2Tokenizer",
            "model_max_length": block_size,
            "bos_token": EOT_TEXT,
            "eos_token": EOT_TEXT,
            "unk_token": EOT_TEXT,
            "add_prefix_space": False,
            "errors": "replace",
        },
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
