"""Run speculators' OWN training entry point on CPU: `python tests/helpers/speculators_cpu.py
<flags>` takes exactly the flags of `python -m speculators.train` / `speculators train` and calls its `main`.

Owns nothing of the pipeline; it exists so that tests (test_speculators_interop.py) and
bench/train_vs_speculators.py can run speculators' trainer, unmodified, on our data;
`speculators_train_argv(...)` builds the command line for the draft train_draft trains. Before calling
`speculators.train.cli.main` it patches the two places where speculators 0.9.0 assumes an accelerator
(train/worker.py installs the same shim for the pipeline's own trainer), plus the autocast device that follows from the first:
  1. `Trainer.setup_model` moves the model to the local rank (`model.to(0)`): the device becomes "cpu"
     (and the autocast device type "cpu", bf16, instead of "cuda", which would silently disable autocast);
  2. `torch.accelerator.synchronize()` (the step timer) becomes a no-op when no accelerator exists;
  and a resumed run loads its checkpoint to "cpu" (`checkpointer.get_current_device`).
The flags must select what runs on CPU: `--draft-attn-impl sdpa|eager`, `--loss-implementation eager`,
`--num-workers 0`, `--on-missing raise` (or skip/warn: never generate from a vLLM server).
With SPECULATORS_CPU_METRICS=<path>, every metrics dict speculators logs (`speculators.metrics`: one
per logged train step, one per validation pass) is also appended to <path> as a JSON line; this only
listens, it changes nothing in training.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

METRICS_ENV = "SPECULATORS_CPU_METRICS"


class _JsonlTap(logging.Handler):
    def __init__(self, path: str):
        super().__init__(logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and ("train" in record.msg or "val" in record.msg):
            with open(self.path, "a") as f:
                f.write(json.dumps(record.msg, default=float) + "\n")


def install_cpu_shim() -> None:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.cli as cli
    import torch
    from speculators.train.trainer import Trainer

    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    orig_setup_model = Trainer.setup_model

    def setup_model(self):
        self.local_rank = torch.device("cpu")
        self.device_type = "cpu"
        orig_setup_model(self)

    Trainer.setup_model = setup_model
    checkpointer.get_current_device = lambda: "cpu"

    path = os.environ.get(METRICS_ENV)
    if path:
        orig_setup_metric_logger = cli.setup_metric_logger

        def setup_metric_logger(*a, **k):  # speculators' dictConfig replaces the handlers: add ours after it
            orig_setup_metric_logger(*a, **k)
            logging.getLogger("speculators.metrics").addHandler(_JsonlTap(path))
            logging.getLogger("speculators").info(f"cpu shim: torch threads {torch.get_num_threads()}")

        cli.setup_metric_logger = setup_metric_logger


def speculators_train_argv(target: Path, tokenized: Path, hidden_states: Path, vocab_dir: Path, aux: list[int],
                           save_path: Path, *, seq_len: int, epochs: int, lr: float, max_steps: int | None = None,
                           seed: int = 0, val_ratio: float = 0.1) -> list[str]:
    """`speculators train` flags for the draft train_draft builds (1 llama layer, full attention,
    kl_div), with what CPU needs: sdpa attention, eager loss, no loader workers, never generate."""
    from eagle3_pipeline.records.vocab import vocab_paths

    d2t, t2d = vocab_paths(vocab_dir)
    argv = [sys.executable, "-u", str(Path(__file__).resolve()),
            "--verifier-name-or-path", str(target), "--data-path", str(tokenized),
            "--hidden-states-path", str(hidden_states), "--d2t-path", str(d2t), "--t2d-path", str(t2d),
            "--target-layer-ids", *map(str, aux), "--num-layers", "1", "--full-attention-indices", "0",
            "--sliding-window", str(seq_len), "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--loss-fn", "kl_div", "--ttt-steps", "3", "--optimizer", "muon", "--num-workers", "0",
            "--on-missing", "raise", "--total-seq-len", str(seq_len), "--train-data-ratio", str(1 - val_ratio),
            "--epochs", str(epochs), "--lr", str(lr), "--seed", str(seed), "--save-path", str(save_path),
            "--log-dir", str(save_path.parent / "logs")]
    return argv + (["--max-steps", str(max_steps)] if max_steps else [])


def main(argv: list[str]) -> None:
    install_cpu_shim()
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    speculators_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
