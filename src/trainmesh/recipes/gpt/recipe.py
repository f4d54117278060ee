"""The GPT recipe: a byte-level (or any tokenizer) language model on a memory-mapped token corpus."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainmesh.config.schema import Config, ModelConfig
from trainmesh.core.logging import get_logger
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
from trainmesh.data.manifest import read_manifest
from trainmesh.data.tokenizer import get_tokenizer
from trainmesh.recipes.base import Datasets, Recipe
from trainmesh.recipes.gpt.hf_init import HFWeights, complete_folder, describe
from trainmesh.recipes.gpt.model import GPT, IGNORE_INDEX, GPTConfig, init_gpt_weights, summed_lm_loss
from trainmesh.recipes.gpt.parallel import check_pipeline, check_tensor_parallel, parallelize_gpt, pipeline_stage_gpt
from trainmesh.recipes.gpt.upgrade import fuse_qkv
from trainmesh.strategies.mesh import ParallelDims
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.strategies.schedules import SCHEDULES, shared_across_v_message

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)


class GPTRecipe(Recipe):
    name = "gpt"
    model_config_cls = GPTConfig
    data_sources = "'embedded', a text file, or a folder of token shards"
    checkpoint_pins = (
        "data.tokenizer",
        *(f"model.{key}" for key in ("size", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")),
    )

    def tokens_per_sample(self, model: ModelConfig) -> int:
        assert isinstance(model, GPTConfig)
        return model.block_size

    def complete_model(self, config: Config) -> ModelConfig:
        """The vocabulary, and with model.init_from the shape, that follow from the data and the weights.
        model.init_from's config.json fills in the shape and vocabulary (checked against the keys set here). The
        data's vocabulary: a folder `trainmesh data prepare` wrote names its tokenizer in manifest.json (checked
        against data.tokenizer); text sources use data.tokenizer's; other shard folders must state
        model.vocab_size."""
        model = config.model
        assert isinstance(model, GPTConfig)
        source = Path(config.data.source).expanduser()
        prepared = read_manifest(source) if source.is_dir() else None
        if prepared is not None:
            _check_tokenizer(config.data.source, config.data.tokenizer, prepared.tokenizer.name)
            tokens = prepared.tokenizer.vocab_size
        else:  # 0: unknown, shards without a manifest
            tokens = 0 if source.is_dir() else get_tokenizer(config.data.tokenizer).vocab_size
        if model.init_from:
            model = complete_folder(model, sharded=config.parallel.meta_init)
            if tokens > model.vocab_size:  # else found only once the data is tokenised, in every worker
                raise ValueError(
                    f"data.tokenizer={config.data.tokenizer!r} has {tokens} tokens, more than model.vocab_size="
                    f"{model.vocab_size} (model.init_from's vocabulary). Fix: the tokenizer the weights were trained "
                    f"with, or --model.vocab_size={tokens} (pads the embedding)."
                )
        if model.vocab_size:
            return model
        if not tokens:
            raise ValueError(
                f"data.source={config.data.source!r} holds pre-tokenised shards without a manifest.json, so the "
                "vocabulary size is unknown. Fix: set --model.vocab_size (e.g. 50304 for GPT-2's tokenizer), or "
                "prepare the data with trainmesh data prepare, which records its tokenizer."
            )
        return replace(model, vocab_size=tokens)

    def check_data(self, config: Config) -> None:
        """Also the cheap part of what training checks in a folder of shards (data/corpus.py `shard_corpus`: the
        manifest, each shard's header, size and token count; not the full read), so that `trainmesh check`
        fails a folder that cannot train, with the message training would give."""
        source = Path(config.data.source).expanduser()
        try:
            super().check_data(config)
            if config.data.source != "embedded" and source.is_dir():
                shard_corpus(source)
        except OSError as e:  # unreadable (no permission, removed meanwhile): a ValueError, as the config's error
            raise BadShardError(
                f"data.source={config.data.source!r}: cannot read {e.filename or source} ({e.strerror or e}). "
                "Fix: make it readable to this user, or --data.source=<a folder you may read>."
            ) from None

    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        model = config.model
        assert isinstance(model, GPTConfig)
        if not model.vocab_size:
            raise ValueError("model.vocab_size is 0: complete the config first (trainmesh.job.spec.load_config does)")
        # One process per node tokenises into the (node-local) cache and reads every shard whole to check it
        # (once a node is enough); the others wait, then take the shards from the cache.
        with runtime.local_main_first():
            corpus = _resolve_corpus(config)
            if runtime.local_rank == 0:
                check_token_range(corpus, model.vocab_size, _cache_dir(config))
        return Datasets(TokenWindows(corpus.train, model.block_size), TokenWindows(corpus.val, model.block_size))

    def build_model(self, config: Config, runtime: Runtime) -> nn.Module:
        """The GPT, its weights from model.init_from when set (a resumed run then loads its checkpoint over them);
        on the meta device, `parallel_plan`'s init_weights gives them after sharding."""
        cfg = config.model
        assert isinstance(cfg, GPTConfig)
        del runtime
        weights = HFWeights(cfg) if cfg.init_from else None
        model = GPT(cfg, config.run.seed, weights)  # the seed: also of init_weights after a meta build
        if weights is not None and not any(p.is_meta for p in model.parameters()):
            log.info("%s", describe(cfg))
        return model

    def forward(self, module: nn.Module, inputs: Any, targets: Any) -> Any:
        return module(inputs, targets)  # the GPT returns logits, or its summed loss with model.loss_chunk_tokens

    def output_loss(self, output: Any, targets: Any) -> torch.Tensor:
        return summed_lm_loss(output, targets)  # logits (B, T, V) or the loss (model.loss_chunk_tokens), targets (B, T)

    def check_parallel(self, config: Config, dims: ParallelDims) -> None:
        model = config.model
        assert isinstance(model, GPTConfig)
        if model.loss_chunk_tokens and dims.pp * dims.tp > 1:  # the stages' head, a vocabulary-parallel head
            raise ValueError(
                f"model.loss_chunk_tokens={model.loss_chunk_tokens} fuses the head of a GPT run whole, not one cut "
                f"by parallel.pp={dims.pp} or parallel.tp={dims.tp}. Fix: --model.loss_chunk_tokens=0, or "
                "parallel.pp=1 and parallel.tp=1."
            )
        if dims.tp > 1:
            check_tensor_parallel(model, dims.tp)
        if dims.pp > 1:
            schedule = config.parallel.pipeline.schedule
            _, per_rank, placement = SCHEDULES[schedule]
            check_pipeline(model, dims.pp * per_rank)
            # A V schedule holds the first and the last stage on one rank: the tied embedding and head
            # can only stay one tensor there without replicas, tensor parallelism or a meta build.
            if placement == "v" and (dims.dp_size > 1 or dims.tp > 1 or config.parallel.meta_init):
                raise ValueError(shared_across_v_message(schedule, ["wte.weight", "lm_head.weight"]))

    def parallel_plan(self, model: nn.Module) -> ParallelPlan:
        assert isinstance(model, GPT)
        seed, cfg = model.init_seed, model.cfg
        weights = HFWeights(cfg) if cfg.init_from else None

        def init_weights(part: nn.Module) -> None:
            init_gpt_weights(part, seed, weights)
            if weights is not None:
                log.info("%s", describe(cfg))

        return ParallelPlan(
            tensor_parallel=parallelize_gpt, pipeline_stage=pipeline_stage_gpt, init_weights=init_weights
        )

    def count_targets(self, batch: Any) -> int:
        return int((batch[1] != IGNORE_INDEX).sum())

    def flops_per_token(self, model: nn.Module) -> float:
        return model.flops_per_token() if isinstance(model, GPT) else 0.0

    def upgrade_checkpoint(self, state: dict[str, Any], model_config: dict[str, Any]) -> list[str]:
        return fuse_qkv(state, model_config)

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
        # eager even under train.compile: a few tokens at batch 1 and a growing length would compile the model
        # twice more (once at that shape, once with lengths dynamic), 15 s of the nano model's on this CPU
        with runtime.autocast(), torch.random.fork_rng(devices=[]), torch.compiler.set_stance("force_eager"):
            torch.manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
            out = model.generate(idx, sample.max_new_tokens, sample.temperature, sample.top_k)
        model.train(was_training)
        return tokenizer.decode(out[0].tolist())


def _check_tokenizer(source: str, tokenizer: str, prepared_with: str) -> None:
    """The config's tokenizer must be the one the shards were made with: it turns the prompt into ids and the
    sample back into text, and another's ids would make both nonsense."""
    if tokenizer != prepared_with:
        raise ValueError(
            f"data.source={source!r} was tokenised with {prepared_with!r} (its manifest.json), but "
            f"data.tokenizer={tokenizer!r}, which would encode the sample's prompt and decode the text it writes. "
            f"Fix: --data.tokenizer={prepared_with}."
        )


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
