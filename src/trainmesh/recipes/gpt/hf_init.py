"""`model.init_from`: start a GPT from a local folder of Hugging Face GPT-2 weights (config.json and model.safetensors
only), checked when the job is resolved and read tensor by tensor at initialisation.

Details: docs/internals.md#recipesgpthf_initpy
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trainmesh.core.machine import host_memory
from trainmesh.recipes.gpt.hf import HF_BUFFERS, HF_PREFIX, from_hf_tensor, gpt_names, hf_name, hf_problems, hf_shapes
from trainmesh.recipes.gpt.model import GPTConfig

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_SHAPE = ("n_layer", "n_head", "n_embd")
_MAX_CONFIG_BYTES = 2**20  # GPT-2's config.json is under 1 KiB; a larger one is not a config, and is not read
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""The safetensors dtypes read (as the header names them): the float types save_pretrained writes. Anything else
(I8, BOOL, ...) would be cast into the parameters silently, as wrong values."""
_MIN_BYTES = 2  # per parameter, in the smallest of FLOAT_DTYPES
_MAX_DIM = 2**31  # far above any real model; keeps the size arithmetic in floats' range (10**200 would overflow)


def complete_folder(model: GPTConfig, sharded: bool = False) -> GPTConfig:
    """`model` with its shape from model.init_from's config.json (ValueError naming the key to fix when the
    folder cannot be read, does not hold GPT-2 weights trainmesh reads, or disagrees with a key set here).
    `sharded`: parallel.meta_init, where a rank gives storage only to its share of the model."""
    folder = Path(model.init_from).expanduser()
    given = f"model.init_from={model.init_from!r}"
    if not folder.is_dir():
        raise ValueError(
            f"{given} is not a folder on this machine. trainmesh reads local folders only and downloads nothing. "
            "Fix: fetch the model first (e.g. `hf download openai-community/gpt2 config.json model.safetensors "
            "--local-dir gpt2`) and pass that folder."
        )
    folder = folder.resolve()  # recorded absolute: every rank and a later --resume read the same folder
    _check_files(folder, given)
    config = _read_config(folder / CONFIG, given)
    from_file = _shape_of(config, folder / CONFIG, given)
    _check_size(from_file, folder, given, sharded)
    problems = hf_problems(config)
    if problems:
        raise ValueError(
            f"{given}: {folder / CONFIG} describes a model trainmesh's GPT does not compute: {'; '.join(problems)}. "
            "Fix: another model.init_from (a GPT-2 model)."
        )
    if not model.bias:
        raise ValueError(f"model.bias=false, but the GPT-2 weights of {given} have biases. Fix: --model.bias=true.")
    filled: dict[str, Any] = {"init_from": str(folder)}
    for key in (*_SHAPE, "vocab_size"):
        value = getattr(model, key)
        if not value:
            filled[key] = from_file[key]
        elif key != "vocab_size" and value != from_file[key]:
            raise ValueError(
                f"model.{key}={value}, but {folder / CONFIG} (model.init_from) has {key}={from_file[key]}. "
                f"Fix: leave model.{key} unset (it is then taken from the folder), or set it to {from_file[key]}."
            )
    vocab = filled.get("vocab_size", model.vocab_size)
    if vocab < from_file["vocab_size"]:
        raise ValueError(
            f"model.vocab_size={vocab} is smaller than the vocabulary of model.init_from ({from_file['vocab_size']} "
            f"in {folder / CONFIG}); rows cannot be dropped. Fix: model.vocab_size >= {from_file['vocab_size']} "
            "(larger pads it), or unset."
        )
    if model.block_size > from_file["n_positions"]:
        raise ValueError(
            f"model.block_size={model.block_size} is longer than the {from_file['n_positions']} positions of "
            f"model.init_from (n_positions in {folder / CONFIG}). Fix: --model.block_size={from_file['n_positions']} "
            "or less."
        )
    completed = replace(model, **filled)
    _check_tensors(folder, completed, from_file["vocab_size"], from_file["n_positions"], given)
    return completed


def _read_config(path: Path, given: str) -> Any:
    """config.json, decoded (ValueError naming the file when it is too large to be one, or not JSON)."""
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ValueError(f"{size} bytes; a GPT-2 config.json is under 1 KiB, and over 1 MiB is not read")
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ValueError(
            f"{given}: cannot read {path}: {e or type(e).__name__}. Fix: a folder saved by save_pretrained."
        ) from None


def _shape_of(config: Any, path: Path, given: str) -> dict[str, int]:
    """The model's shape in a config.json (ValueError naming the file and key when it is not one)."""
    fix = "Fix: a folder saved by transformers' save_pretrained."
    if not isinstance(config, dict):
        raise ValueError(f"{given}: {path} holds a JSON {type(config).__name__}, not a config object. {fix}")
    shape = {}
    for key in (*_SHAPE, "vocab_size", "n_positions"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{given}: {path} has {key}={value!r}, not a positive whole number. {fix}")
        if value > _MAX_DIM:
            digits = len(str(value))
            shown = str(value) if digits <= 20 else f"a {digits}-digit number"
            raise ValueError(f"{given}: {path} has {key}={shown}; at most 2**31 is read. {fix}")
        shape[key] = value
    return shape


def parameter_count(shape: Mapping[str, int]) -> int:
    """The parameters of a GPT-2 of config.json's `shape` (the tied head counted once): per block, ln_1 and
    ln_2 4C, c_attn 3C² + 3C, c_proj C² + C, c_fc 4C² + 4C, the MLP's c_proj 4C² + C."""
    c = shape["n_embd"]
    blocks = shape["n_layer"] * (12 * c * c + 13 * c)
    return (shape["vocab_size"] + shape["n_positions"]) * c + blocks + 2 * c  # + ln_f


def largest_tensor(shape: Mapping[str, int]) -> int:
    """The elements of a GPT-2's largest tensor: the token or position embedding (V×C, P×C) or c_fc (C×4C)."""
    return max(shape["vocab_size"], shape["n_positions"], 4 * shape["n_embd"]) * shape["n_embd"]


def _check_size(shape: Mapping[str, int], folder: Path, given: str, sharded: bool) -> None:
    """Refuse, from config.json's numbers alone, a model that its file cannot hold (2 bytes a parameter at least),
    or that this machine's memory cannot take in fp32: the whole model, or with parallel.meta_init (each rank
    holds its share) the largest tensor, which a rank reads whole. A config.json with absurd dimensions is refused
    here, before anything of its size is built."""
    params = parameter_count(shape)
    dims = ", ".join(f"{key}={shape[key]}" for key in ("n_layer", "n_embd", "vocab_size", "n_positions"))
    implied = f"{given}: {folder / CONFIG} has {dims}; they imply {params:,} parameters ({_bytes(4 * params)} in fp32)"
    stored = (folder / WEIGHTS).stat().st_size
    if params * _MIN_BYTES > stored:
        raise ValueError(
            f"{implied}, but {folder / WEIGHTS} holds {stored} bytes, too few for them even at {_MIN_BYTES} bytes "
            "each. Fix: a config.json that describes its model.safetensors (both as save_pretrained wrote them)."
        )
    memory = host_memory()
    if sharded and 4 * largest_tensor(shape) > memory:
        raise ValueError(
            f"{implied}, and its largest tensor alone takes {_bytes(4 * largest_tensor(shape))} in fp32, more than "
            f"the {_bytes(memory)} of memory this machine has: even with parallel.meta_init, a rank reads each "
            "tensor whole. Fix: a smaller model.init_from, or run where the memory is."
        )
    if not sharded and 4 * params > memory:
        raise ValueError(
            f"{implied}, more than the {_bytes(memory)} of memory this machine has: without parallel.meta_init a "
            "rank holds the whole model in fp32. Fix: --parallel.meta_init=true (with fsdp, tp or pp: a rank then "
            "holds its share and one whole tensor at a time), a smaller model.init_from, or run where the memory is."
        )


def _bytes(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


def _check_files(folder: Path, given: str) -> None:
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{given}: {folder} has no {CONFIG}. Fix: a folder saved by save_pretrained (it writes both).")
    if (folder / WEIGHTS).is_file():
        return
    if any(folder.glob("model-*-of-*.safetensors")) or (folder / f"{WEIGHTS}.index.json").is_file():
        raise ValueError(
            f"{given}: {folder} holds the weights in several files (model-*-of-*.safetensors); trainmesh reads one "
            f"{WEIGHTS}. Fix: save it again as one file: model.save_pretrained(folder, max_shard_size='100GB')."
        )
    found = ", ".join(sorted(p.name for p in folder.glob("*.bin"))) or "no weights"
    raise ValueError(
        f"{given}: {folder} has no {WEIGHTS} ({found}). trainmesh reads safetensors only: a pickled .bin file can run "
        'code when it is loaded. Fix: convert it once, where you trust the file: python -c "from transformers import '
        f"GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('{folder}').save_pretrained('{folder}-safetensors')\", "
        f"then --model.init_from={folder}-safetensors."
    )


def _check_tensors(folder: Path, model: GPTConfig, vocab_size: int, n_positions: int, given: str) -> None:
    """The file holds GPT-2's tensors of config.json's shape, all floats, and nothing trainmesh would leave out
    (all from the file's header: no tensor is read)."""
    expected = hf_shapes(model, vocab_size, n_positions)
    try:
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            found = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ValueError(f"{given}: {folder / WEIGHTS} is not a readable safetensors file: {e}") from None
    read = {name.removeprefix(HF_PREFIX): name for name in found if not HF_BUFFERS.fullmatch(name)}  # as stored
    read.pop("lm_head.weight", None)  # tied to wte (tie_word_embeddings, checked): transformers ignores it too
    not_float = [f"{name} is {found[name][1]}" for name in read.values() if found[name][1] not in FLOAT_DTYPES]
    if not_float:
        raise ValueError(
            f"{given}: {folder / WEIGHTS}: {'; '.join(not_float[:3])}; weights are read as "
            f"{', '.join(FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]} only (another dtype would be cast into wrong "
            "values). Fix: save the model's float weights (as GPT2LMHeadModel.save_pretrained does)."
        )
    shapes = {name: found[stored][0] for name, stored in read.items()}
    problems = [f"{name}: missing" for name in expected if name not in shapes]
    problems += [f"{name}: not a GPT-2 weight" for name in shapes if name not in expected]
    problems += [
        f"{name}: {shapes[name]}, config.json's shape needs {shape}"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ValueError(
            f"{given}: {folder / WEIGHTS} does not hold the GPT-2 model its config.json describes: {shown}. "
            "Fix: a folder written by GPT2LMHeadModel.save_pretrained."
        )


class HFWeights(Mapping[str, torch.Tensor]):
    """The initial weights of a GPT of `cfg` (completed by `complete_folder`) from its init_from folder, by
    trainmesh parameter name, each read from model.safetensors when asked for (so a rank holds one full
    tensor at a time), in trainmesh's layout, cut or padded to `cfg`'s block_size and vocab_size."""

    def __init__(self, cfg: GPTConfig) -> None:
        assert cfg.init_from, "HFWeights needs model.init_from"
        self.cfg = cfg
        self.path = Path(cfg.init_from) / WEIGHTS
        self._names = [name for name in gpt_names(cfg) if name != "lm_head.weight"]
        self._stored: dict[str, str] | None = None  # GPT-2 name without prefix -> as stored

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            if self._stored is None:
                self._stored = {key.removeprefix(HF_PREFIX): key for key in f.keys()}  # noqa: SIM118
            stored = self._stored[hf_name(name).removeprefix(HF_PREFIX)]
            tensor = from_hf_tensor(stored, f.get_tensor(stored), self.cfg.n_head)
        if name == "wpe.weight":
            return tensor[: self.cfg.block_size]  # positions beyond the context are never used
        if name == "wte.weight" and tensor.shape[0] < self.cfg.vocab_size:
            pad = tensor.float().mean(dim=0).to(tensor.dtype).expand(self.cfg.vocab_size - tensor.shape[0], -1)
            return torch.cat([tensor, pad])
        return tensor


def describe(cfg: GPTConfig) -> str:
    """One line for the log: where the weights came from and what was adapted."""
    with safe_open(str(Path(cfg.init_from) / WEIGHTS), framework="pt") as f:
        stored = {key.removeprefix(HF_PREFIX): key for key in f.keys()}  # noqa: SIM118
        vocab, positions = (f.get_slice(stored[n]).get_shape()[0] for n in ("wte.weight", "wpe.weight"))
    notes = [f"{len(gpt_names(cfg)) - 1} tensors"]
    if vocab < cfg.vocab_size:
        notes.append(f"vocabulary padded {vocab} -> {cfg.vocab_size} with the mean embedding")
    if positions > cfg.block_size:
        notes.append(f"positions cut {positions} -> {cfg.block_size}")
    return f"initial weights from {cfg.init_from} (model.init_from): {', '.join(notes)}"
