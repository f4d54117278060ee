"""A recipe is everything model-specific: the model, its data, its loss, and what to show at the end; it holds no state
between calls.

Details: docs/internals.md#recipesbasepy
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils.data import Dataset

from trainmesh.config.schema import Config, ModelConfig
from trainmesh.strategies.base import Objective
from trainmesh.strategies.mesh import ParallelDims
from trainmesh.strategies.plan import ParallelPlan

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime


class Datasets(NamedTuple):
    """What `Recipe.prepare` returns: datasets whose items the default collate can stack."""

    train: Dataset[Any]
    val: Dataset[Any]


class Recipe(ABC):
    name: str
    model_config_cls: type[ModelConfig]
    eval_metrics: tuple[str, ...] = ()
    """Validation metrics besides the loss that `output_sums` returns, each reported as val_<name>."""
    data_sources: str = "'embedded', or an existing file or folder"
    """What data.source may name, for error messages."""

    def check_data(self, config: Config) -> None:
        """Refuse a data.source that does not exist, before launch (what is inside is checked where it is
        read, on each node)."""
        source = config.data.source
        if source != "embedded" and not Path(source).expanduser().exists():
            raise ValueError(
                f"data.source={source!r} does not exist on this machine; it may be {self.data_sources}. "
                "Fix: --data.source=<an existing path>, or --data.source=embedded."
            )

    checkpoint_pins: tuple[str, ...] = ()
    """The config keys besides run.recipe whose values this recipe's checkpoints depend on (the shapes of the
    tensors, what a token id means): a resume must keep them, and one that changes them is refused before launch."""

    def tokens_per_sample(self, model: ModelConfig) -> int:
        """Tokens in one sample, for token-denominated batch sizes; 0 when samples are not token sequences."""
        del model
        return 0

    def complete_model(self, config: Config) -> ModelConfig:
        """The `[model]` section with the values that follow from other keys or the data filled in (a new
        object; called when the job is resolved, so the written config and the checkpoints state them)."""
        return config.model

    @abstractmethod
    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        """Make the data ready (tokenise/cache on one process per node; check it fits the model config) and
        return the train and validation datasets."""

    @abstractmethod
    def build_model(self, config: Config, runtime: Runtime) -> nn.Module:
        """A freshly initialised model, on the CPU (or the meta device); the strategy places it. Collective:
        every rank builds it (a layer may need the data-parallel group)."""

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(model input, targets) of a collated batch; the default reads (input, target) pairs."""
        return batch[0], batch[1]

    def forward(self, module: nn.Module, inputs: Any, targets: Any) -> Any:
        """The model's output for a batch; the default calls `module(inputs)`. A model that computes its loss with
        its last layer takes the targets here (the GPT's model.loss_chunk_tokens) and returns the summed loss, which
        `output_loss` then passes on. Not used where the model runs as pipeline stages."""
        del targets
        return module(inputs)

    @abstractmethod
    def output_loss(self, output: Any, targets: Any) -> torch.Tensor:
        """The loss of the model's output *summed* over the targets (normalised by the loop)."""

    @abstractmethod
    def count_targets(self, batch: Any) -> int:
        """How many targets `output_loss` sums over (tokens not equal to ignore_index, or samples)."""

    def output_sums(self, output: Any, targets: Any) -> dict[str, torch.Tensor]:
        """Validation sums for one batch: the summed loss under "loss", plus one per name in `eval_metrics`
        (e.g. "top1": correctly classified samples). The loop adds them up over batches and ranks and
        divides each by the target count. One hook, so a classifier runs one forward for all of them."""
        return {"loss": self.output_loss(output, targets)}

    def objective(self) -> Objective:
        """The three functions above, as the strategies use them (a pipeline computes the loss on its
        last stage, so the forward and the loss are separate steps)."""
        return Objective(self.split_batch, self.output_loss, self.output_sums, self.forward)

    def loss_sum(self, module: nn.Module, batch: Any) -> torch.Tensor:
        """Forward `batch` through `module` and return the summed loss (for use outside the loop)."""
        inputs, targets = self.split_batch(batch)
        return self.output_loss(self.forward(module, inputs, targets), targets)

    def check_parallel(self, config: Config, dims: ParallelDims) -> None:
        """Refuse model-parallel settings this recipe's model cannot take (ValueError naming the keys and
        a fix); called before launch, with the resolved degrees of the mesh."""
        if dims.tp > 1:
            raise ValueError(
                f"parallel.tp={dims.tp}: the {self.name} recipe has no tensor-parallel plan. Fix: --parallel.tp=1."
            )
        if config.parallel.meta_init:
            raise ValueError(
                f"parallel.meta_init=true: the {self.name} recipe cannot initialise a model built on the meta "
                "device. Fix: --parallel.meta_init=false."
            )

    def parallel_plan(self, model: nn.Module) -> ParallelPlan:
        """How the model is cut for the strategies: its blocks and, where the recipe supports them, its
        tensor-parallel plan and pipeline split (see strategies/plan.py)."""
        del model
        return ParallelPlan()

    def flops_per_token(self, model: nn.Module) -> float:
        """Training FLOPs per token (or sample) for MFU; 0 when unknown."""
        del model
        return 0.0

    def on_train_end(self, model: nn.Module, config: Config, runtime: Runtime) -> str:
        """Something to show the user at the end (e.g. generated text). Runs on every rank, since a
        sharded model's forward is collective; rank 0's result is shown. Keep it deterministic."""
        del model, config, runtime
        return ""

    def upgrade_checkpoint(self, state: dict[str, Any], model_config: dict[str, Any]) -> list[str]:
        """Convert, in place, the full state of a checkpoint saved by an older version of this recipe's model
        ({"model": ..., "optim": ...}; `model_config`: its [model] section as saved) to the current layout,
        for `trainmesh ckpt upgrade`. Returns one line per change; none (the default): nothing to convert."""
        del state, model_config
        return []
