"""progress.LineProgress: the calls vLLM's LLM.generate makes on its tqdm bar give timed lines."""

from eagle3_pipeline.core.progress import LineProgress


def test_lines_every_interval_and_at_the_end():
    out: list[str] = []
    bar = LineProgress("extract: shard 2", total_tokens=1000, every_s=0.0, out=out.append)(total=3, desc="x")
    for _ in range(3):  # what vLLM does per finished request: postfix, then update
        bar.postfix = "est. speed input: 250.00 toks/s, output: 3.00 toks/s"
        bar.update(1)
    bar.refresh()
    bar.close()
    assert len(out) == 4 and out[2].startswith("extract: shard 2: 3 of 3 requests done (")
    assert " of 1,000 prompt tokens, 250 tok/s, 3 generated tok/s" in out[2], out[2]


def test_the_prompts_vllm_adds_pass_through():
    prompts = [[1, 2], [3]]
    assert LineProgress("extract")(prompts, desc="Adding requests") is prompts


def test_quiet_below_the_interval():
    out: list[str] = []
    bar = LineProgress("evaluate", every_s=3600, out=out.append)(total=2)
    bar.update(2)
    bar.close()
    assert out == []


def test_train_step_lines_say_how_far_the_run_is():
    from eagle3_pipeline.train.stage import _format_event

    ev = {"kind": "train_step", "step": 90, "epoch": 0, "loss": 11.15, "acc": [0.24, 0.06], "tokens_per_s": 138}
    assert _format_event(ev, 218).startswith("train: step 90/218 epoch 0 loss 11.150 acc[0.24 0.06] 138 tok/s")
    assert _format_event(ev).startswith("train: step 90 epoch 0")
