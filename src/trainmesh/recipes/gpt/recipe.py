"""The GPT recipe: a byte-level (or any tokenizer) language model on a memory-mapped token corpus."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainmesh.config.schema import Config, ModelConfig
from trainmesh.data.corpus import (
    BadShardError,
    TokenCorpus,
    check_token_range,
    default_cache_dir,
    embedded_files,
    shard_corpus,
    text_corpus,
)
from trainmesh.data.datasets import TokenWindows
from trainmesh.data.tokenizer import get_tokenizer
from trainmesh.recipes.base import Recipe
from trainmesh.recipes.gpt.model import GPT, IGNORE_INDEX, GPTConfig, init_gpt_weights, summed_lm_loss
from trainmesh.recipes.gpt.parallel import check_pipeline, check_tensor_parallel, parallelize_gpt, pipeline_stage_gpt
from trainmesh.strategies.mesh import MeshShape
from trainmesh.strategies.pipeline import SCHEDULES, shared_across_v_message
from trainmesh.strategies.plan import ParallelPlan

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime


class GPTRecipe(Recipe):
    name = "gpt"
    model_config_cls = GPTConfig
    data_sources = "'embedded', a text file, or a folder of token shards"

    def __init__(self) -> None:
        self.corpus: TokenCorpus | None = None
        self.block_size = 0
        self.seed = 0

    def tokens_per_sample(self, model: ModelConfig) -> int:
        assert isinstance(model, GPTConfig)
        return model.block_size

    def complete_config(self, config: Config) -> None:
        model = config.model
        assert isinstance(model, GPTConfig)
        if not model.vocab_size and not Path(config.data.source).expanduser().is_dir():
            model.vocab_size = get_tokenizer(config.data.tokenizer).vocab_size  # text sources: the tokenizer's

    def prepare(self, config: Config, runtime: Runtime) -> None:
        cfg = config.data
        model = config.model
        assert isinstance(model, GPTConfig)
        # One process per node tokenises into the (node-local) cache and scans the shards; the others wait,
        # then read the cache.
        with runtime.local_main_first():
            self.corpus = _resolve_corpus(config)
            vocab = model.vocab_size or self.corpus.vocab_size
            if vocab:
                check_token_range(self.corpus, vocab, _cache_dir(config))
        if not model.vocab_size:
            if not self.corpus.vocab_size:
                raise ValueError(
                    f"data.source={cfg.source!r} holds pre-tokenised shards, so the vocabulary size is "
                    "unknown. Fix: set --model.vocab_size (e.g. 50304 for GPT-2's tokenizer)."
                )
            model.vocab_size = self.corpus.vocab_size
        self.block_size = model.block_size

    def build_model(self, config: Config) -> nn.Module:
        assert isinstance(config.model, GPTConfig)
        self.seed = config.run.seed  # of the initial weights, also for init_weights after a meta build
        return GPT(config.model, self.seed)

    def datasets(self) -> tuple[Dataset[Any], Dataset[Any]]:
        assert self.corpus is not None, "prepare() first"
        return TokenWindows(self.corpus.train, self.block_size), TokenWindows(self.corpus.val, self.block_size)

    def output_loss(self, output: Any, targets: Any) -> torch.Tensor:
        return summed_lm_loss(output, targets)  # logits (B, T, V), targets (B, T)

    def check_parallel(self, config: Config, strategy: str, shape: MeshShape) -> None:
        model = config.model
        assert isinstance(model, GPTConfig)
        if shape.tp > 1:
            check_tensor_parallel(model, shape.tp)
        if shape.pp > 1:
            schedule = config.parallel.pipeline.schedule
            _, per_rank, placement = SCHEDULES[schedule]
            check_pipeline(model, shape.pp * per_rank)
            # A V schedule holds the first and the last stage on one rank: the tied embedding and head
            # can only stay one tensor there without replicas, tensor parallelism or a meta build.
            if placement == "v" and (shape.dp_size > 1 or shape.tp > 1 or config.parallel.meta_init):
                raise ValueError(shared_across_v_message(schedule, ["wte.weight", "lm_head.weight"]))
        del strategy

    def parallel_plan(self, model: nn.Module) -> ParallelPlan:
        seed = self.seed
        return ParallelPlan(
            tensor_parallel=parallelize_gpt,
            pipeline_stage=pipeline_stage_gpt,
            init_weights=lambda part: init_gpt_weights(part, seed),
        )

    def count_targets(self, batch: Any) -> int:
        return int((batch[1] != IGNORE_INDEX).sum())

    def flops_per_token(self, model: nn.Module) -> float:
        return model.flops_per_token() if isinstance(model, GPT) else 0.0

    def on_train_end(self, model: nn.Module, config: Config, runtime: Runtime) -> str:
        sample = config.sample
        if not sample.max_new_tokens or not isinstance(model, GPT):
            return ""
        tokenizer = get_tokenizer(config.data.tokenizer)
        prompt = tokenizer.encode(sample.prompt).astype("int64")
        idx = torch.tensor(prompt, device=runtime.device).view(1, -1)  # (1, T)
        gen = torch.Generator(device=runtime.device).manual_seed(config.run.seed)
        was_training = model.training
        model.eval()
        with runtime.precision.autocast(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            out = model.generate(idx, sample.max_new_tokens, sample.temperature, sample.top_k)
        model.train(was_training)
        return tokenizer.decode(out[0].tolist())


def _cache_dir(config: Config) -> Path:
    return Path(config.data.cache_dir).expanduser() if config.data.cache_dir else default_cache_dir()


def _resolve_corpus(config: Config) -> TokenCorpus:
    cfg = config.data
    cache = _cache_dir(config)
    if cfg.source == "embedded":
        files = embedded_files(int(cfg.max_corpus_mb * 2**20))
    else:
        path = Path(cfg.source).expanduser()
        if path.is_dir():
            return shard_corpus(path)
        if not path.is_file():
            raise BadShardError(
                f"data.source={cfg.source!r} is neither 'embedded', a text file, nor a folder of token shards. "
                "Fix: --data.source=<an existing file or folder>, or embedded."
            )
        files = [path]
    return text_corpus(files, get_tokenizer(cfg.tokenizer), cfg.val_fraction, cache)
