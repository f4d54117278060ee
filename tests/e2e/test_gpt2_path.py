"""The GPT-2 path of docs/gpt2.md at toy scale, through the real commands: `trainmesh data prepare` with GPT-2's
tokenizer, `trainmesh run` of configs/gpt2-124m.toml scaled down (the same code path and tokenizer) with a loss
that falls, and `trainmesh ckpt export --format hf` loaded back by transformers with its tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmesh.cli import main
from trainmesh.data.corpus import embedded_files

transformers = pytest.importorskip("transformers")
pytest.importorskip("tiktoken")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAINMESH = Path(sys.executable).parent / "trainmesh"
CORPUS_BYTES = 300_000  # ~137k GPT-2 tokens of the embedded corpus: 130k to train on, 7k held out
SCALED_DOWN = [  # GPT-2's config with a smaller body: 2 layers, 64 wide, 64 tokens of context; the vocabulary stays
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=64",
    "--model.block_size=64",
    "--train.micro_batch=2",
    "--train.global_batch_tokens=0",
    "--train.global_batch=4",  # 2 accumulation steps, as the real config accumulates
    "--train.max_steps=20",  # at this learning rate enough to fall from ~10.5 to ~5 (the unigram statistics and more)
    "--train.precision=32-true",
    "--train.compile=false",
    "--train.eval_every=10",
    "--train.eval_samples=16",
    "--optim.warmup_steps=4",
    "--optim.lr=1e-2",
    "--optim.min_lr=1e-3",
    "--data.num_workers=0",
    "--checkpoint.every=0",
    "--checkpoint.final=true",
    "--run.log_every=5",
    "--run.progress=false",
    "--dist.device=cpu",
]


@pytest.mark.timeout(300)
def test_prepare_train_export_with_gpt2_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"  # part of the embedded corpus (Python's own source) as text files
    corpus.mkdir()
    for i, path in enumerate(embedded_files(CORPUS_BYTES)):
        (corpus / f"{i:04d}_{path.stem}.txt").write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    shards = tmp_path / "shards"
    assert main(["data", "prepare", str(corpus), "--out", str(shards), "--tokenizer", "gpt2", "--workers", "2"]) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["tokenizer"]["name"] == "gpt2"

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [str(TRAINMESH), "run", "gpt", "--config", str(ROOT / "configs" / "gpt2-124m.toml")]
    run += ["--nproc-per-node", "1", "--run-id", "g", "--", f"--run.out_dir={tmp_path / 'runs'}"]
    run += [f"--data.source={shards}", "--sample.max_new_tokens=0", *SCALED_DOWN]
    done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "g"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["loss"] for r in records if r["kind"] == "train"]
    val = [r["val_loss"] for r in records if r["kind"] == "val"]
    # ln 50304 = 10.8 untrained, and still above 9 over the first 5 steps: GPT-2's vocabulary, not bytes (ln 256 = 5.5)
    assert val[0] > 10 and train[0] > 9, (train, val)
    assert train[-1] < train[0] - 3 and val[-1] < val[0] - 3, (train, val)  # it learns the text
    config = (run_dir / "config.toml").read_text()
    assert 'tokenizer = "gpt2"' in config and "vocab_size = 50304" in config

    capsys.readouterr()
    assert main(["ckpt", "export", "--format", "hf", str(run_dir)]) == 0
    (folder,) = (run_dir / "export").iterdir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    assert model.config.vocab_size == 50304 and model.config.eos_token_id == 50256
    text = embedded_files(CORPUS_BYTES)[0].read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :64]  # (1, T): Python source, as it trained on
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)  # transformers' own forward and loss
    assert loss < train[0] - 3, (loss, train)  # the trained model, carried over with its tokenizer
