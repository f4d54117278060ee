"""fp8-mixed on the CPU: the refusals (no fp8 tensor cores, no torchao, tensor parallelism), the config path through
`resolve` and `trainmesh check`, which linear layers torchao's Float8Linear replaces (also on a meta-built GPT),
checkpoints that move between fp8-mixed and bf16-mixed, and float8's numerics against bf16's through torchao's
emulation (the same float8 roundings computed in high precision; fp8 tensor cores are tested in tests/gpu)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from support import nano_config, refused_before_writing, train_records
from trainmesh.cli import main
from trainmesh.config import ConfigError
from trainmesh.config.schema import DistConfig, Float8Config, ParallelConfig
from trainmesh.core.env import DistEnv
from trainmesh.job.spec import load_config, resolve
from trainmesh.job.worker import run_worker
from trainmesh.metrics import mfu
from trainmesh.precision import build_precision, check_precision_supported
from trainmesh.precision.fp8 import Float8MixedPrecision, float8_linears, fp8_problem
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.recipes.gpt.model import GPT, GPTConfig, summed_lm_loss
from trainmesh.runtime.runtime import Runtime

CPU = torch.device("cpu")
CPU_ONLY = DistConfig(device="cpu")
EMULATED = Float8Config(emulate=True)
FP8 = ["--train.precision=fp8-mixed", "--float8.emulate=true"]
BLOCK_LINEARS = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]


def _nano(seed: int = 0) -> GPT:
    return GPT(GPTConfig(size="nano", vocab_size=256, block_size=32), seed)


# -- refusals ---------------------------------------------------------------------------------------------------
def test_a_cpu_is_refused_before_the_model_is_built_with_the_fixes() -> None:
    with pytest.raises(ValueError) as refused:
        Runtime(precision="fp8-mixed", dist_config=CPU_ONLY)
    message = str(refused.value)
    assert "compute capability 8.9 or newer" in message and "the device here is cpu" in message
    assert "--train.precision=bf16-mixed" in message and "--float8.emulate=true" in message
    check_precision_supported("fp8-mixed", CPU, EMULATED)  # the emulation runs anywhere


def test_a_gpu_without_float8_tensor_cores_is_named_with_its_capability() -> None:
    message = fp8_problem("fp8-mixed", "cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert message is not None
    assert "NVIDIA A100-SXM4-80GB has compute capability 8.0" in message and "8.9 or newer" in message
    assert "Fix: --train.precision=bf16-mixed" in message
    assert fp8_problem("fp8-mixed", "cuda", (8, 9), "NVIDIA L4") is None
    assert fp8_problem("fp8-mixed", "cuda", (9, 0), "NVIDIA H100 80GB HBM3") is None
    assert "device here is mps" in str(fp8_problem("fp8-mixed", "mps", None, ""))


def test_without_torchao_the_message_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` now raises ImportError
    with pytest.raises(ValueError, match=r"needs torchao .* Fix: pip install 'trainmesh\[fp8\]'"):
        check_precision_supported("fp8-mixed", CPU, EMULATED)


def test_tensor_parallelism_is_refused_alike_by_resolve_and_by_a_runtime_in_code() -> None:
    config = load_config(None, ["--train.precision=fp8-mixed", "--parallel.tp=2"], "gpt")
    with pytest.raises(ConfigError) as cli:
        resolve(config, 2)
    two_ranks = DistEnv(0, 0, 2, 2, "127.0.0.1", 1, "torchrun")
    with pytest.raises(ValueError) as library:
        Runtime(precision="fp8-mixed", float8=EMULATED, parallel=ParallelConfig(tp=2), env=two_ranks)
    assert str(library.value) == str(cli.value)
    assert "parallel.tp=2 is not supported yet" in str(cli.value) and "--parallel.tp=1" in str(cli.value)


def test_float8_options_that_cannot_work_are_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"float8.fsdp_all_gather=true with float8.recipe='rowwise'"):
        load_config(None, ["--float8.recipe=rowwise", "--float8.fsdp_all_gather=true"], "gpt")
    gather = load_config(None, ["--train.precision=fp8-mixed", "--float8.fsdp_all_gather=true"], "gpt")
    with pytest.raises(ConfigError, match=r"strategy is 'ddp'.*Fix: --parallel.strategy=fsdp"):
        resolve(gather, 2)
    fsdp = load_config(
        None, ["--train.precision=fp8-mixed", "--float8.fsdp_all_gather=true", "--parallel.strategy=fsdp"]
    )
    assert resolve(fsdp, 2).layout.strategy == "fsdp"
    # The [float8] options are fp8-mixed's: the fix the refusals suggest, bf16-mixed, needs no other change.
    assert resolve(load_config(None, ["--float8.fsdp_all_gather=true"], "gpt"), 2).layout.strategy == "ddp"


def test_a_forward_whose_token_count_is_not_a_multiple_of_16_is_refused_with_a_micro_batch_that_fits() -> None:
    """torch._scaled_mm on CUDA needs a multiple of 16 for the inner dimension of the weight gradient's matmul (the
    tokens); the CPU's does not, so this is checked where the config is resolved, not found on the GPU."""
    odd = ["--train.precision=fp8-mixed", "--model.block_size=20", "--train.micro_batch=2"]
    with pytest.raises(ConfigError, match=r"holds 40 tokens.*Fix: --train.micro_batch=4 \(a multiple of 4\)"):
        resolve(load_config(None, odd, "gpt"), 1)
    piped = [*odd[:2], "--train.micro_batch=12", "--parallel.pp=2", "--parallel.pipeline.microbatches=4"]
    with pytest.raises(ConfigError, match=r"micro_batch=12 / parallel.pipeline.microbatches=4 .* holds 60 tokens"):
        resolve(load_config(None, piped, "gpt"), 2)
    assert resolve(load_config(None, [*odd[:2], "--train.micro_batch=4"], "gpt"), 1).batch.micro_batch == 4


# -- the config path: `trainmesh check` plans an fp8 GPU run from anywhere ---------------------------------------
def test_check_accepts_fp8_mixed_anywhere_and_plan_refuses_it(capfd: pytest.CaptureFixture[str]) -> None:
    """`trainmesh check` resolves without touching a device, as for every CUDA-only setting (the GPU is checked
    where the run starts), so an fp8 GPU run is planned from a CPU; its memory line is bf16-mixed's, said so.
    `trainmesh plan` does not model fp8: refused, naming what to plan instead."""
    common = ["gpt", "--nproc-per-node", "2", "--", "--parallel.strategy=fsdp"]
    assert main(["check", *common, "--train.precision=bf16-mixed"]) == 0
    bf16 = capfd.readouterr().out.splitlines()
    assert main(["check", *common, "--train.precision=fp8-mixed"]) == 0
    fp8 = capfd.readouterr().out.splitlines()
    assert fp8[0].startswith("world size 2: OK — fsdp") and fp8[:2] == bf16[:2]  # layout and memory
    assert fp8[2] == "  (fp8-mixed predicted as bf16-mixed, which holds the same model states and activations)"
    assert main(["plan", "gpt", "--cluster", "h100", "--", "--train.precision=fp8-mixed"]) == 2
    assert "does not model train.precision='fp8-mixed'" in capfd.readouterr().err


def test_run_refuses_fp8_mixed_on_a_cpu_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`trainmesh run` checks this machine's device (check does not: it plans for others) before the run folder."""
    out = f"--run.out_dir={tmp_path / 'runs'}"
    err = refused_before_writing(
        tmp_path, capsys, "run", "gpt", "--nproc-per-node", "1", "--", out, "--train.precision=fp8-mixed"
    )
    assert "train.precision='fp8-mixed' computes in float8" in err and "the device here is cpu" in err
    assert "Fix: run on such a GPU, or --train.precision=bf16-mixed, or --float8.emulate=true" in err


def test_mfu_of_fp8_counts_against_the_fp8_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak = mfu.device_peak(cuda, torch.float8_e4m3fn)
    assert peak is not None and peak.flops == 1979e12 and "attention and head in bf16" in peak.describe()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert mfu.device_peak(cuda, torch.float8_e4m3fn) is None  # no fp8 tensor cores: no fp8 peak
    fp8 = build_precision("fp8-mixed", CPU, EMULATED)
    assert fp8.peak_dtype == torch.float8_e4m3fn  # MFU's peak
    assert fp8.compute_dtype == torch.bfloat16  # what flows between layers: parity's nudges and floors


# -- which layers are converted ---------------------------------------------------------------------------------
def test_the_gpt_gets_float8_blocks_and_keeps_its_tied_head_in_bf16() -> None:
    model = _nano()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = build_precision("fp8-mixed", CPU, EMULATED).convert_module(model)
    float8 = sorted(name for name, m in converted.named_modules() if isinstance(m, Float8Linear))
    assert float8 == sorted(f"blocks.{i}.{linear}" for i in range(2) for linear in BLOCK_LINEARS)
    assert type(converted.lm_head) is nn.Linear and converted.lm_head.weight is converted.wte.weight
    after = converted.state_dict()
    assert list(after) == list(before)  # same keys, same order: checkpoints are interchangeable
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in after.items())


def test_layers_whose_features_are_not_multiples_of_16_stay_in_high_precision() -> None:
    embed = nn.Embedding(10, 32)
    model = nn.Sequential(embed, nn.Linear(32, 48), nn.Linear(48, 10), nn.Linear(32, 10, bias=False))
    model[3].weight = nn.Parameter(torch.randn(10, 32))
    head = nn.Linear(32, 10, bias=False)
    head.weight = embed.weight  # a head tied to the embedding (10 × 32)
    model.append(head)
    chosen, kept = float8_linears(model)
    assert chosen == ["1"]
    assert kept == {
        "2": "48->10 features, not multiples of 16",
        "3": "32->10 features, not multiples of 16",
        "4": "weight shared with 0",
    }


def test_a_meta_built_gpt_converts_and_is_initialised_like_a_whole_one(capfd: pytest.CaptureFixture[str]) -> None:
    """Conversion works on meta modules (parallel.meta_init), and the GPT's init marker survives the swap
    (residual projections scaled by 1/sqrt(2·n_layer)): the same weights as a model built whole."""
    config = load_config(None, ["--model.size=nano", *FP8], "gpt")
    recipe = GPTRecipe()
    whole = recipe.build_model(config, None)  # type: ignore[arg-type]  # the GPT recipe does not use the runtime
    with torch.device("meta"):
        late = recipe.build_model(config, None)  # type: ignore[arg-type]
    runtime = Runtime(strategy="single", precision="fp8-mixed", float8=EMULATED, dist_config=CPU_ONLY)
    late = runtime.setup(late, plan=recipe.parallel_plan(late))
    assert isinstance(late.blocks[0].mlp.proj, Float8Linear) and not late.blocks[0].mlp.proj.weight.is_meta
    assert late.lm_head.weight is late.wte.weight
    for name, value in whole.state_dict().items():
        assert torch.equal(late.state_dict()[name], value), name
    assert (
        "fp8-mixed: 8 linear layers compute in float8 (tensorwise scaling, emulated); "
        "kept in bf16: lm_head (weight shared with wte)"
    ) in capfd.readouterr().err


# -- numerics and checkpoints -----------------------------------------------------------------------------------
def test_a_float8_forward_and_backward_stays_close_to_bf16() -> None:
    """The nano GPT's loss and gradients under fp8-mixed (emulated float8 roundings) against bf16-mixed from the
    same weights and batch: e4m3 keeps 3 mantissa bits, so close, not equal."""
    batch = torch.randint(256, (4, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for precision in (build_precision("bf16-mixed", CPU), Float8MixedPrecision(CPU, EMULATED)):
        model = precision.convert_module(_nano(seed=3))
        with precision.autocast():
            loss = summed_lm_loss(model(batch[:, :-1]), batch[:, 1:]) / batch[:, 1:].numel()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((float(loss.detach()), grads))
    (bf16_loss, bf16_grads), (fp8_loss, fp8_grads) = results
    assert not torch.equal(fp8_grads, bf16_grads)  # float8 really rounded something
    assert fp8_loss == pytest.approx(bf16_loss, rel=0.01)
    assert torch.nn.functional.cosine_similarity(fp8_grads, bf16_grads, dim=0) > 0.99


def test_fp8_training_tracks_bf16_and_its_checkpoints_resume_under_bf16_and_back(tmp_path: Path) -> None:
    steps = ["--train.max_steps=8", "--checkpoint.every=4", "--checkpoint.final=true", "--train.eval_every=0"]
    runs = {
        "bf16": ["--train.precision=bf16-mixed"],
        "fp8": FP8,
    }
    losses = {}
    for name, precision in runs.items():
        run_worker(nano_config(tmp_path, *steps, *precision, f"--run.id={name}"), tmp_path / "runs" / name)
        losses[name] = [r["loss"] for r in train_records(tmp_path / "runs" / name)]
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02)
    assert losses["fp8"][-1] < losses["fp8"][0] - 1.0
    # The fp8 run's checkpoint at step 8 resumes under bf16-mixed, and that run's under fp8-mixed again.
    bf16 = ["--train.precision=bf16-mixed", "--train.max_steps=10", "--checkpoint.resume=true", "--run.id=fp8"]
    resumed = run_worker(nano_config(tmp_path, *steps, *bf16), tmp_path / "runs" / "fp8")
    assert resumed.steps == 10 and math.isfinite(resumed.train_loss)
    again = [*FP8, "--train.max_steps=12", "--checkpoint.resume=true", "--run.id=fp8"]
    result = run_worker(nano_config(tmp_path, *steps, *again), tmp_path / "runs" / "fp8")
    assert result.steps == 12 and isinstance(result.model.blocks[0].attn.qkv, Float8Linear)
