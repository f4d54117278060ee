"""The configuration schema: one dataclass per section, each field with a one-line docstring.

Field checks that need only the field live in `__post_init__`; checks across sections (batch math,
world size) live in `trainmesh.job.spec`. The recipe supplies the `[model]` section's class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trainmesh.config.log import LogConfig

DEVICES = ("auto", "cpu", "cuda", "mps")
BACKENDS = ("auto", "nccl", "gloo", "mpi")
DEBUG_LEVELS = ("off", "info", "detail")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "fp8-mixed")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
PIPELINE_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)


def _one_of(key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ValueError(f"{key}={value} must be >= {low}")


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class RunConfig:
    recipe: str = "gpt"
    """Which built-in recipe to train: gpt | resnet."""
    id: str = ""
    """Run id (--run-id), the name of the run directory under out_dir; empty: <recipe>-<date>-<time>."""
    out_dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = 1337
    """Seed for model init (same on every rank) and, offset by rank, for dropout."""
    deterministic: bool = False
    """Use deterministic kernels only (bit-reproducible, somewhat slower)."""
    log_every: int = 10
    """Optimizer steps between metric records (loss is averaged across ranks at these steps)."""
    progress: bool = True
    """Show the live progress bar on rank 0 (plain log lines when stderr is not a terminal)."""

    def __post_init__(self) -> None:
        _at_least("run.log_every", self.log_every, 1)
        if self.id and not RUN_ID.fullmatch(self.id):
            raise ValueError(
                f"run.id={self.id!r} (--run-id) is not a run id: it must be one folder name of letters, digits, "
                "'.', '_' and '-', starting with a letter or digit, at most 128 characters (e.g. --run-id gpt-exp1)"
            )


@dataclass(frozen=True)
class DistConfig:
    device: str = "auto"
    """auto (cuda, else mps for one process, else cpu) | cpu | cuda | mps."""
    backend: str = "auto"
    """auto (nccl on cuda, gloo otherwise) | nccl | gloo | mpi."""
    timeout_s: float = 600.0
    """Collective / process-group timeout in seconds."""
    init_timeout_s: float = 300.0
    """Seconds to wait for every rank to join the group (address unreachable, processes missing)."""
    stall_timeout_s: float = 600.0
    """No step, evaluation or checkpoint finished for this long: dump every rank's stack and restart; 0: off."""
    debug: str = "off"
    """Collective checks (TORCH_DISTRIBUTED_DEBUG): off | info | detail (reports mismatched collectives)."""

    def __post_init__(self) -> None:
        _one_of("dist.device", self.device, DEVICES)
        _one_of("dist.backend", self.backend, BACKENDS)
        _one_of("dist.debug", self.debug, DEBUG_LEVELS)
        _at_least("dist.timeout_s", self.timeout_s, 1)
        _at_least("dist.init_timeout_s", self.init_timeout_s, 1)
        _at_least("dist.stall_timeout_s", self.stall_timeout_s, 0)


@dataclass(frozen=True)
class DDPConfig:
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB; each bucket is all-reduced as soon as it is ready."""
    static_graph: bool = False
    """Promise the graph is the same every step (enables extra DDP optimisations)."""
    find_unused_parameters: bool = False
    """Search for parameters without gradients each step (needed only for conditional models)."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias the communication buckets (saves one gradient-sized copy)."""
    sync_buffers: bool = True
    """Sync buffers (e.g. BatchNorm running stats) from rank 0 at each forward."""
    comm_hook: str = "none"
    """Gradient compression on the wire: none | fp16 | bf16 | powersgd (low-rank, with error feedback)."""
    powersgd_rank: int = 1
    """powersgd: rank of each gradient matrix's approximation (higher: closer to the exact gradient, more traffic)."""
    powersgd_start_iter: int = 1000
    """powersgd: optimizer steps with exact all-reduces before compression starts (torch's advice: about 10%
    of training); at least 2."""

    def __post_init__(self) -> None:
        _one_of("parallel.ddp.comm_hook", self.comm_hook, COMM_HOOKS)
        _at_least("parallel.ddp.bucket_cap_mb", self.bucket_cap_mb, 0.001)
        _at_least("parallel.ddp.powersgd_rank", self.powersgd_rank, 1)
        _at_least("parallel.ddp.powersgd_start_iter", self.powersgd_start_iter, 2)


@dataclass(frozen=True)
class FSDPConfig:
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (full shard, ZeRO-3); false: keep them for backward (ZeRO-2)."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory; the optimizer steps on the CPU."""
    prefetch: int = 1
    """All-gather the next N blocks' parameters ahead, in forward and backward (0: FSDP's default)."""
    reduce_every_microstep: bool | None = None
    """With gradient accumulation: true: reduce-scatter after every micro-step, so gradients stay sharded (more
    communication); false: hold whole gradients until the step's last micro-step (one reduce-scatter a step); unset
    or "auto": for the gpt recipe `trainmesh run` picks what fits this machine's devices and is faster, by the plan
    (other recipes, and a worker started another way: false)."""

    def __post_init__(self) -> None:
        _at_least("parallel.fsdp.prefetch", self.prefetch, 0)


@dataclass(frozen=True)
class PipelineConfig:
    schedule: str = "1f1b"
    """gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble | zbv_zero_bubble | dualpipev."""
    microbatches: int = 4
    """Pieces each micro-batch is cut into as it flows through the stages; train.micro_batch must be a multiple."""

    def __post_init__(self) -> None:
        _one_of("parallel.pipeline.schedule", self.schedule, PIPELINE_SCHEDULES)
        _at_least("parallel.pipeline.microbatches", self.microbatches, 1)


@dataclass(frozen=True)
class ParallelConfig:
    strategy: str = "auto"
    """Data parallelism across replicas: auto (ddp; fsdp with tp; single: one replica) | single | dp | ddp | fsdp."""
    pp: int = 1
    """Pipeline-parallel stages (ranks one model is cut across by layers); -1: infer (with dp_shard set)."""
    tp: int = 1
    """Tensor-parallel degree (ranks each layer's weights are split over); -1: infer (with dp_shard set)."""
    dp_replicate: int = 1
    """Data-parallel replicas (fsdp: hybrid sharding, all-reduce across replicas); -1: infer."""
    dp_shard: int = -1
    """fsdp: ranks each replica is sharded over (ddp: more replicas); -1: world / (pp × tp × dp_replicate)."""
    meta_init: bool = False
    """Build the model on the meta device and give storage only to what this rank holds after sharding
    (fsdp, tp, pp), then initialise it: for a model larger than one rank's memory. Same weights either way."""
    activation_checkpointing: int = 0
    """Recompute every Nth block's activations in backward instead of storing them (1: all; 0: none)."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """DistributedDataParallel options."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Fully sharded data parallel options."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline-parallel options (parallel.pp > 1)."""

    def __post_init__(self) -> None:
        _one_of("parallel.strategy", self.strategy, STRATEGIES)
        _at_least("parallel.activation_checkpointing", self.activation_checkpointing, 0)


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 300
    """Number of optimizer steps."""
    micro_batch: int = 8
    """Samples per process per forward/backward (what must fit in memory)."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks; 0: micro_batch × data-parallel size (no accumulation)."""
    global_batch_tokens: int = 0
    """Tokens per optimizer step (token recipes; e.g. 524288 for GPT-2); overrides global_batch."""
    precision: str = "32-true"
    """32-true | bf16-mixed | 16-mixed | bf16-true | fp8-mixed (bf16-mixed with float8 linear layers through
    torchao: GPUs of compute capability 8.9+, see [float8])."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    compile: bool = False
    """torch.compile the model and the loss: the whole model as one graph under single and ddp, each block
    under fsdp, tensor and pipeline parallelism (where blocks are sharded or split across ranks)."""
    tf32: bool = True
    """CUDA: let float32 matmuls and convolutions use TF32 tensor cores (about 8x the fp32 rate, 10-bit mantissa
    products); false: full fp32. Affects 32-true and the fp32 parts of mixed precision; the run logs it at start."""
    nonfinite: str = "abort"
    """A NaN/inf gradient: abort (the step not taken; naming step and ranks) | skip (all ranks skip the step). With
    the fused AdamW (optim.fused, the default on CUDA) the step is skipped on the device and the decision read at
    the next logging window, evaluation or checkpoint, where an abort then stops the run."""
    max_skipped_steps: int = 5
    """Abort after more than this many consecutive skipped steps (non-finite gradients, or fp16 overflows)."""
    eval_every: int = 100
    """Optimizer steps between validation passes; 0: only at the end."""
    eval_samples: int = 256
    """Validation samples per evaluation: a fixed slice, the same at every world size."""

    def __post_init__(self) -> None:
        _at_least("train.max_steps", self.max_steps, 1)
        _at_least("train.micro_batch", self.micro_batch, 1)
        _at_least("train.global_batch", self.global_batch, 0)
        _at_least("train.global_batch_tokens", self.global_batch_tokens, 0)
        _one_of("train.precision", self.precision, PRECISIONS)
        _at_least("train.grad_clip", self.grad_clip, 0)
        _one_of("train.nonfinite", self.nonfinite, ("abort", "skip"))
        _at_least("train.max_skipped_steps", self.max_skipped_steps, 1)
        _at_least("train.eval_every", self.eval_every, 0)
        _at_least("train.eval_samples", self.eval_samples, 1)


@dataclass(frozen=True)
class Float8Config:
    recipe: str = "tensorwise"
    """fp8-mixed: torchao's scaling recipe: tensorwise (one scale per tensor, the fastest) | rowwise (a scale per
    row, e4m3 gradients and power-of-2 scales: more accurate, slower)."""
    fsdp_all_gather: bool = False
    """fp8-mixed under fsdp: all-gather the float8 layers' weights in float8 (half of bf16's traffic), their scales
    computed in one all-reduce after each optimizer step; tensorwise only."""
    emulate: bool = False
    """fp8-mixed without float8 tensor cores (a CPU, an older GPU): torchao computes the same float8 roundings in
    high precision. No speed-up: for testing fp8-mixed's numerics and setup."""

    def __post_init__(self) -> None:
        _one_of("float8.recipe", self.recipe, FLOAT8_RECIPES)
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"float8.fsdp_all_gather=true with float8.recipe={self.recipe!r}: torchao casts weights to float8 "
                "before the all-gather with one scale per tensor only. "
                "Fix: --float8.recipe=tensorwise, or --float8.fsdp_all_gather=false."
            )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many steps."""
    schedule: str = "cosine"
    """Decay after warmup: cosine | linear | constant."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not biases or norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool | None = None
    """Fused AdamW kernel: true | false | unset or "auto": on CUDA."""

    def __post_init__(self) -> None:
        _at_least("optim.lr", self.lr, 0)
        _at_least("optim.min_lr", self.min_lr, 0)
        _at_least("optim.warmup_steps", self.warmup_steps, 0)
        _one_of("optim.schedule", self.schedule, ("cosine", "linear", "constant"))
        if self.lr > 1:
            raise ValueError(
                f"optim.lr={self.lr} is far above any AdamW learning rate (typically 1e-4 to 1e-2): each step moves "
                "every weight by about lr, so training diverges at once. Fix: e.g. --optim.lr=3e-4"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} is above optim.lr={self.lr}; it must be <= lr")


@dataclass(frozen=True)
class DataConfig:
    source: str = "embedded"
    """embedded (gpt: the Python standard library's source; resnet: UCI's handwritten digits, shipped) | a text file or
    a folder of token shards, e.g. from `trainmesh data prepare` (gpt) | a folder of class sub-folders of
    images (resnet)."""
    tokenizer: str = "byte"
    """Tokenizer for text sources, and for the sample's text: byte (256 symbols, nothing to install) | gpt2
    (OpenAI's GPT-2 BPE, 50257 tokens, offline; the trainmesh[gpt2] extra). A prepared folder's must match."""
    val_fraction: float = 0.05
    """Share of a text corpus (or of the images, without a train/val split on disk) held out for validation."""
    max_corpus_mb: float = 8.0
    """Cap on the embedded corpus size in MiB."""
    cache_dir: str = ""
    """Where tokenised corpora are cached; empty: $XDG_CACHE_HOME/trainmesh or ~/.cache/trainmesh."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    shuffle: bool = True
    """Reshuffle the samples every epoch (deterministically from run.seed and the epoch)."""

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be between 0 and 1 (exclusive)")
        _at_least("data.max_corpus_mb", self.max_corpus_mb, 0.01)
        _at_least("data.num_workers", self.num_workers, 0)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Optimizer steps between checkpoints; 0: only the final one."""
    final: bool = True
    """Save a checkpoint when training ends."""
    resume: bool = False
    """Continue from the newest valid checkpoint in the run directory (implied on a torchrun restart)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: keep all); the newest is never deleted."""
    on_corrupt: str = "fallback"
    """A checkpoint that fails verification on resume: fallback (move it aside, use an older one) | abort."""
    async_save: bool = False
    """Write checkpoints in the background (training stalls only to copy the state to CPU memory)."""

    def __post_init__(self) -> None:
        _at_least("checkpoint.every", self.every, 0)
        _at_least("checkpoint.keep_last", self.keep_last, 0)
        _one_of("checkpoint.on_corrupt", self.on_corrupt, ("fallback", "abort"))


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False
    """Record torch.profiler traces (CPU ops, CUDA kernels) into <run>/profile/rank_<r>/ for Perfetto or TensorBoard."""
    wait: int = 5
    """Optimizer steps skipped before each recording cycle (start-up and compilation are not typical steps)."""
    warmup: int = 2
    """Steps the profiler runs but discards at the start of each cycle (its own start-up cost)."""
    active: int = 3
    """Steps recorded per cycle."""
    repeat: int = 1
    """Recording cycles (0: cycle until training ends, a trace every wait + warmup + active steps)."""
    ranks: str = "0"
    """Ranks that record: comma-separated ranks (e.g. 0,8) | all."""
    record_shapes: bool = False
    """Record the input shapes of every operator (larger traces)."""
    profile_memory: bool = False
    """Record tensor allocations and frees."""
    with_stack: bool = False
    """Record the Python source line of every operator (larger traces, more overhead)."""
    nvtx: bool = False
    """CUDA: mark the phases of each step (data, forward_backward, optimizer, log) as NVTX ranges for Nsight
    Systems (nsys profile ...), whether or not enabled is set."""
    oom_snapshot: bool = False
    """CUDA: record the allocation history and, on out-of-memory, write <run>/memory/oom_rank_<r>.pickle for
    https://pytorch.org/memory_viz (costs a little time per allocation)."""

    def __post_init__(self) -> None:
        for key in ("wait", "warmup", "repeat"):
            _at_least(f"profile.{key}", getattr(self, key), 0)
        _at_least("profile.active", self.active, 1)
        profiled_ranks(self.ranks)  # raises on a malformed list


def profiled_ranks(text: str) -> frozenset[int] | None:
    """The ranks named by profile.ranks; None: all of them."""
    if text.strip() == "all":
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(
            f"profile.ranks={text!r} is not a rank list: give comma-separated ranks (e.g. 0 or 0,8) or all"
        )
    return frozenset(int(p) for p in parts)


@dataclass(frozen=True)
class SampleConfig:
    prompt: str = "def "
    """Text the model continues after training (generative recipes)."""
    max_new_tokens: int = 200
    """Length of the generated sample; 0 disables sampling."""
    temperature: float = 0.8
    """Softmax temperature; lower is more conservative."""
    top_k: int = 40
    """Sample only among the k most likely tokens; 0: all."""

    def __post_init__(self) -> None:
        _at_least("sample.max_new_tokens", self.max_new_tokens, 0)
        _at_least("sample.top_k", self.top_k, 0)
        if self.temperature <= 0:
            raise ValueError(f"sample.temperature={self.temperature} must be > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Base of each recipe's `[model]` section."""


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    log: LogConfig = field(default_factory=LogConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
