"""train stage on CPU, for real: speculators' EAGLE-3 trainer in a child process on a tiny dataset.

Until the session fixtures (`tiny_target`, `extracted`) exist, the inputs are built here: chat rows
from the tiny target's corpus, tokenized with its chat template (loss mask on assistant content and
its end-of-turn token), hidden states from HF transformers (`hidden_states[k]` for the aux ids; the
last decoder layer's output before the final norm for id N, via a forward hook) in the offline
format, and the draft vocab from the counts of supervised tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3_pipeline.config import TargetConfig, TrainConfig, VocabConfig
from eagle3_pipeline.train import ExportCheckError, export_check, make_untrained_draft, train_draft
from eagle3_pipeline.vocab import build_vocab

TINY_TARGET = Path(os.environ.get("EAGLE3_TINY_TARGET", "/tmp/tt150"))


def build_offline_inputs(model_dir: Path, out: Path, rows: int, layer_ids: list[int]) -> SimpleNamespace:
    """tokenized/ + hidden_states/ + token_freq.safetensors in `out` from the model's own corpus."""
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    corpus = model_dir / "corpus" / "openai.jsonl"
    convs = [json.loads(line)["messages"] for line in corpus.read_text().splitlines()[:rows]]
    data = {"input_ids": [], "loss_mask": [], "seq_len": [], "sample_id": []}
    for i, msgs in enumerate(convs):
        ids, mask = [tok.bos_token_id], [0]
        for m in msgs:
            head = tok(f"<|{m['role']}|>\n", add_special_tokens=False)["input_ids"]
            body = tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"]
            nl = tok("\n", add_special_tokens=False)["input_ids"]
            sup = 1 if m["role"] == "assistant" else 0
            ids += head + body + nl
            mask += [0] * len(head) + [sup] * len(body) + [0] * len(nl)
        data["input_ids"].append(ids)
        data["loss_mask"].append(mask)
        data["seq_len"].append(len(ids))
        data["sample_id"].append(f"conv-{i}")
    tokenized = out / "tokenized"
    Dataset.from_dict(data).save_to_disk(str(tokenized))

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    n = model.config.num_hidden_layers
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _i, o: captured.__setitem__(
        "last", o[0] if isinstance(o, tuple) else o))
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    with torch.no_grad():
        for i, ids in enumerate(data["input_ids"]):
            x = torch.tensor([ids])
            o = model(x, output_hidden_states=True)
            layers = [o.hidden_states[k][0] for k in layer_ids[:-1]] + [captured["last"][0]]
            assert layer_ids[-1] == n
            hs = torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()  # [T, L, H]
            save_file({"hidden_states": hs, "token_ids": x[0].clone()}, str(hs_dir / f"hs_{i}.safetensors"))
    hook.remove()
    counts = np.zeros(model.config.vocab_size, dtype=np.int64)  # [V]
    for ids, mask in zip(data["input_ids"], data["loss_mask"], strict=True):
        np.add.at(counts, np.asarray(ids)[np.asarray(mask, dtype=bool)], 1)
    from safetensors.numpy import save_file as save_np

    save_np({"counts": counts}, str(out / "token_freq.safetensors"))
    return SimpleNamespace(tokenized=tokenized, hidden_states=hs_dir, layer_ids=layer_ids,
                           token_freq=out / "token_freq.safetensors", eos=tok.eos_token_id,
                           vocab_size=model.config.vocab_size)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    if not (TINY_TARGET / "config.json").exists():
        pytest.skip(f"tiny target model not built at {TINY_TARGET}")
    out = tmp_path_factory.mktemp("train-inputs")
    ex = build_offline_inputs(TINY_TARGET, out, rows=48, layer_ids=[2, 4, 5, 8])
    vocab = build_vocab(VocabConfig(draft_vocab_size=256), ex.token_freq, ex.vocab_size, out / "vocab", [ex.eos])
    assert vocab.coverage > 0.9
    return SimpleNamespace(**vars(ex), vocab_dir=out / "vocab", target=TargetConfig(model=str(TINY_TARGET)))


def _cfg(**kw) -> TrainConfig:
    base = dict(epochs=2, lr=1e-2, max_seq_len=512, draft_layers=1, ttt_steps=3, attention="sdpa",
                device="cpu", val_ratio=0.15, timeout_s=900)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-run")
    lines: list[str] = []
    res = train_draft(_cfg(), inputs.target, inputs.tokenized, inputs.hidden_states, inputs.vocab_dir,
                      inputs.layer_ids, out, log=lines.append)
    return SimpleNamespace(res=res, out=out, lines=lines)


def test_training_reduces_loss_and_writes_metrics(trained):
    res = trained.res
    rows = [json.loads(x) for x in (trained.out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train_step"]
    vals = [r for r in rows if r["kind"] == "val"]
    assert len(steps) == res.steps >= 6 and len(vals) == 2
    assert all(len(r["acc"]) == 3 and r["loss"] is not None for r in steps)
    first = np.mean([r["loss"] for r in steps[:2]])
    last = np.mean([r["loss"] for r in steps[-2:]])
    assert last < 0.8 * first, f"loss did not decrease: {first:.3f} -> {last:.3f}"
    assert vals[-1]["loss"] < vals[0]["loss"]
    assert res.tokens_per_s > 0 and res.tokens > 0
    assert any("tok/s" in x for x in trained.lines)  # events reached the parent's log
    assert (trained.out / "train.log").exists()


def test_checkpoint_is_a_servable_speculators_draft(trained, inputs):
    best = trained.res.checkpoint_best
    assert best.is_symlink() and (best / "config.json").exists()
    from safetensors import safe_open

    with safe_open(str(best / "model.safetensors"), framework="pt") as f:
        assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(f.keys())
    conf = json.loads((best / "config.json").read_text())
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert conf["draft_vocab_size"] == 256
    export_check(best, inputs.vocab_dir, TINY_TARGET)


def test_export_check_catches_altered_d2t(trained, inputs, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(trained.res.checkpoint_best, bad)
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"] = w["d2t"].clone()
    w["d2t"][7] += 1
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="d2t differs .* index 7"):
        export_check(bad, inputs.vocab_dir, TINY_TARGET)
    # and a draft whose lm_head no longer matches the target's rows
    w = load_file(str(trained.res.checkpoint_best / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"].clone()
    w["lm_head.weight"][3] *= 2
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ExportCheckError, match="lm_head.weight differs .* row 3"):
        export_check(bad, inputs.vocab_dir, TINY_TARGET)


def test_resume_continues_from_last_epoch(trained, inputs):
    lines: list[str] = []
    res = train_draft(_cfg(epochs=3), inputs.target, inputs.tokenized, inputs.hidden_states, inputs.vocab_dir,
                      inputs.layer_ids, trained.out, log=lines.append)
    assert res.resumed_from_epoch == 1 and res.epochs_done == 3
    assert trained.res.steps < res.steps < trained.res.steps * 2
    rows = [json.loads(x) for x in (trained.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train_step"] == list(range(res.steps))
    export_check(res.checkpoint_best, inputs.vocab_dir, TINY_TARGET)


def test_untrained_draft_has_same_architecture(trained, inputs, tmp_path):
    out = make_untrained_draft(inputs.target, inputs.vocab_dir, inputs.layer_ids, tmp_path / "untrained",
                               _cfg(), log=lambda _: None)
    export_check(out, inputs.vocab_dir, TINY_TARGET)
    a = json.loads((out / "config.json").read_text())
    b = json.loads((trained.res.checkpoint_best / "config.json").read_text())
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "norm_output"):
        assert a[key] == b[key]
    from safetensors.torch import load_file

    wa, wb = load_file(str(out / "model.safetensors")), load_file(str(trained.res.checkpoint_best / "model.safetensors"))
    assert set(wa) == set(wb) and all(wa[k].shape == wb[k].shape for k in wa)
    assert not torch.equal(wa["fc.weight"], wb["fc.weight"])


def test_incomplete_checkpoint_is_moved_aside_and_spec_guards_resume(tmp_path):
    from eagle3_pipeline.train import _check_resume_spec, _move_incomplete_checkpoints

    save = tmp_path / "checkpoints"
    for epoch, files in ((0, ("config.json", "model.safetensors", "optimizer_state_dict.pt", "training_state.json")),
                         (1, ("config.json",))):
        (save / str(epoch)).mkdir(parents=True)
        for f in files:
            (save / str(epoch) / f).write_text("x")
    (save / "checkpoint_best").symlink_to("1")
    lines: list[str] = []
    _move_incomplete_checkpoints(save, lines.append)
    names = sorted(p.name for p in save.iterdir())
    assert names[0] == "0" and names[1].startswith("1.incomplete-") and len(names) == 2
    assert "incomplete" in lines[0]
    spec = {"target": "t", "aux_layer_ids": [2, 4, 5], "d2t_sha256": "a"}
    _check_resume_spec(tmp_path, save, spec)
    _check_resume_spec(tmp_path, save, spec)  # same draft: fine
    with pytest.raises(ValueError, match="d2t_sha256"):
        _check_resume_spec(tmp_path, save, {**spec, "d2t_sha256": "b"})
