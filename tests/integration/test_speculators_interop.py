"""speculators' OWN training entry point trains on our data: the session's tokenized dataset and
vLLM-extracted hidden states, with the vocab stage's d2t/t2d files, through `speculators.train`'s
`main` (flags exactly as for `python -m speculators.train`), run by tests/helpers/speculators_cpu.py
with only the CPU shim applied. A few optimizer steps, ≈ 30 s on 2 cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle3_pipeline.core.proc import run_child
from tests.helpers.speculators_cpu import speculators_train_argv

STEPS = 6


@pytest.fixture(scope="module")
def vocab_dir(tiny_config, prepared, extracted) -> Path:
    from eagle3_pipeline.pipeline.stages import stage_vocab

    return Path(stage_vocab(tiny_config, prepared, extracted.version, log=lambda _: None).dir)


def test_speculators_own_trainer_trains_on_our_data(tiny_target, extracted, vocab_dir, tmp_path):
    from eagle3_pipeline.train.export import export_check

    aux = extracted.version.aux_layer_ids  # the draft's inputs: the captured ids without the final layer N
    assert aux + [json.loads((tiny_target / "config.json").read_text())["num_hidden_layers"]] == extracted.layer_ids
    save = tmp_path / "checkpoints"
    metrics = tmp_path / "metrics.jsonl"
    argv = speculators_train_argv(tiny_target, extracted.tokenized, extracted.hidden_states, vocab_dir, aux, save,
                                  seq_len=512, epochs=1, lr=1e-2, max_steps=STEPS)
    run_child(argv, name="speculators-train", timeout_s=600, log_path=tmp_path / "train.log",
              env={"SPECULATORS_CPU_METRICS": str(metrics), "TQDM_DISABLE": "1"})

    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [r for r in rows if "train" in r]
    val = [r for r in rows if "val" in r]
    assert [r["global_step"] for r in train] == list(range(STEPS))
    losses = [r["train"]["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses), losses
    assert len(val) == 1 and math.isfinite(val[0]["val"]["loss_epoch"])
    assert losses[-1] < losses[0], losses
    assert train[-1]["profile"]["tokens_per_s"] > 0

    ckpt = save / "0"
    for f in ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json"):
        assert (ckpt / f).exists(), f
    assert (save / "checkpoint_best").resolve() == ckpt.resolve()
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == aux
    # the draft speculators' trainer wrote is consistent with our vocab files and the target
    export_check(ckpt, vocab_dir, tiny_target)


def test_speculators_cli_draft_has_the_architecture_of_ours(tiny_target, extracted, vocab_dir, tmp_path):
    """`speculators train --dry-run` (its initialised checkpoint) and our make_untrained_draft agree
    on the architecture: config fields that shape the draft and every tensor's name and shape."""
    from safetensors import safe_open

    from eagle3_pipeline.core.config import TargetConfig, TrainConfig
    from eagle3_pipeline.train.stage import make_untrained_draft

    aux = extracted.version.aux_layer_ids
    theirs = tmp_path / "theirs"
    argv = speculators_train_argv(tiny_target, extracted.tokenized, extracted.hidden_states, vocab_dir, aux, theirs,
                                  seq_len=512, epochs=1, lr=1e-2) + ["--dry-run"]
    run_child(argv, name="speculators-dry-run", timeout_s=300, log_path=tmp_path / "dry-run.log")
    ours = make_untrained_draft(TargetConfig(model=str(tiny_target)), extracted.version, vocab_dir, tmp_path / "ours",
                                TrainConfig(max_seq_len=512, draft_layers=1), log=lambda _: None)
    a, b = json.loads((theirs / "config.json").read_text()), json.loads((ours / "config.json").read_text())
    for key in ("speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                "fc_norm", "norm_output", "norm_before_residual", "embed_requires_grad"):
        assert a.get(key) == b.get(key), key
    la, lb = a["transformer_layer_config"], b["transformer_layer_config"]
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "layer_types", "hidden_act"):
        assert la.get(key) == lb.get(key), key

    def shapes(d: Path) -> dict:
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(theirs) == shapes(ours)
