"""train/window.py: the bounded window between capture and training. Capture blocks when the window is full and
goes on when the trainer releases what a checkpoint covers; a shard is released after its passes; the store never
holds more than the window. One test runs capture as its own process against the trainer in this one (the window's
lock between processes, as between nodes on the store). `plan`: the arithmetic of the two epoch policies."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.train.window import ShardWindow, WindowError, WindowStalled, epoch_key, plan


def _write(w: ShardWindow, key: str, text: str) -> None:
    d = w.shard_dir(key)
    d.mkdir(parents=True)
    (d / "rows.txt").write_text(text)


def test_capture_blocks_when_full_and_goes_on_when_the_trainer_releases(tmp_path):
    w = ShardWindow(tmp_path, max_shards=2)
    for k in ("a", "b"):
        assert w.try_reserve(k, 10)
        _write(w, k, k)
        w.publish(k, 10)
    assert w.try_reserve("c", 10) is False
    with pytest.raises(WindowStalled, match="stayed full for 0s .*2 of 2 shards, 20 bytes held.*released nothing"):
        w.reserve("c", 10, wait_s=0.0)
    assert isinstance(WindowStalled("x"), EnvironmentProblem)
    assert w.ready() == ["a", "b"]
    assert w.consume("a") is True and not w.shard_dir("a").exists() and w.shard_dir("b").exists()
    w.reserve("c", 10, wait_s=0.0)
    st = w.state()
    assert (st.peak_shards, st.peak_bytes, st.released, st.released_bytes) == (2, 20, 1, 10)
    assert set(st.shards) == {"b", "c"} and st.shards["c"].state == "reserved"
    assert w.ready() == ["b"]  # a reserved shard is not readable


def test_bytes_bound_the_window_and_a_shard_that_can_never_fit_is_refused(tmp_path):
    w = ShardWindow(tmp_path, max_shards=10, max_bytes=100)
    assert w.try_reserve("a", 60) and w.try_reserve("b", 40)
    assert w.try_reserve("c", 1) is False  # 100 of 100 bytes held
    with pytest.raises(WindowError, match="101 bytes can never fit a window of 100 bytes"):
        w.try_reserve("d", 101)
    w.abandon("a")
    assert w.try_reserve("c", 60)


def test_a_shard_is_released_after_its_passes(tmp_path):
    w = ShardWindow(tmp_path, max_shards=1, passes=3)
    w.reserve("a", 5, wait_s=0.0)
    w.publish("a", 5)
    assert [w.consume("a") for _ in range(3)] == [False, False, True]
    with pytest.raises(WindowError, match="not published"):
        w.consume("a")


def test_misuse_is_refused_naming_it(tmp_path):
    w = ShardWindow(tmp_path, max_shards=2)
    with pytest.raises(WindowError, match="has max_shards 2.*one window, one setting"):
        ShardWindow(tmp_path, max_shards=3)
    with pytest.raises(WindowError, match="was not reserved"):
        w.publish("x", 1)
    w.try_reserve("x", 1)
    with pytest.raises(WindowError, match="already in the window"):
        w.try_reserve("x", 1)
    w.close()
    with pytest.raises(WindowError, match="capture closed"):
        w.try_reserve("y", 1)
    with pytest.raises(WindowError, match="1 shard or more"):
        ShardWindow(tmp_path / "other", max_shards=0)
    with pytest.raises(WindowStalled, match="capture published nothing"):
        w.wait_published(wait_s=0.0)  # closed, but x is still reserved (being written)
    w.abandon("x")
    assert w.wait_published(wait_s=0.0) == [] and w.ready() is None


CAPTURE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from eagle3_pipeline.train.window import ShardWindow, epoch_key
    w = ShardWindow(Path(sys.argv[1]), max_shards=2)
    for epoch in range(2):
        for shard in range(4):
            key = epoch_key(epoch, f"shard-{shard}")
            w.reserve(key, 100, wait_s=600, poll_s=0.01)
            d = w.shard_dir(key)
            d.mkdir(parents=True)
            (d / "rows.txt").write_text(key)
            w.publish(key, 100)
    w.close()
""")


def test_capture_and_trainer_as_two_processes_hold_at_most_the_window(tmp_path):
    """Two epochs over a stream of 4 shards through a window of 2: capture (its own process) publishes 8 shards,
    blocking when 2 are held; the trainer reads each in order and releases it; the store never held 3."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cap = subprocess.Popen([sys.executable, "-c", CAPTURE, str(tmp_path)], env=env)
    w = ShardWindow(tmp_path, max_shards=2)
    read = []
    try:
        while keys := w.wait_published(wait_s=600, poll_s=0.01):
            for k in keys:
                read.append((w.shard_dir(k) / "rows.txt").read_text())
                assert w.consume(k)
    finally:
        assert cap.wait(600) == 0
    assert read == [epoch_key(e, f"shard-{s}") for e in range(2) for s in range(4)]
    st = w.state()
    assert (st.published, st.released, st.released_bytes, st.shards) == (8, 8, 800, {})
    assert st.peak_shards <= 2 and st.peak_bytes <= 200
    assert not any((tmp_path / "shards").iterdir())


def test_plan_of_a_kimi_scale_run():
    """6 B tokens at 56 KiB per token (Kimi, bf16) are ~344 TB offline; a window of 64 shards of 2 M tokens holds
    ~7.3 TB. Over a stream, 10 epochs capture 10 times; with passes, once, in a different order."""
    stream = plan(6_000_000_000, 57_344, 2_000_000, 64, 10, "stream")
    assert stream.dataset_bytes == 344_064_000_000_000 and stream.window_bytes == 64 * 2_000_000 * 57_344
    assert (stream.shards, stream.capture_passes, stream.captured_tokens) == (3000, 10, 60_000_000_000)
    passes = plan(6_000_000_000, 57_344, 2_000_000, 64, 10, "passes")
    assert (passes.capture_passes, passes.window_bytes) == (1, stream.window_bytes)
    assert "10 passes over each block of 64 shards" in passes.pass_order
    whole = plan(1_000, 10, 100, 64, 10, "stream")  # the window holds the dataset: the offline store
    assert (whole.window_bytes, whole.capture_passes) == (whole.dataset_bytes, 1)
    with pytest.raises(WindowError):
        plan(0, 1, 1, 1, 1)


def test_a_failed_capture_stops_the_trainer_instead_of_a_wait(tmp_path):
    """Capture marks the window failed (a shard that failed verify, an engine that died): the trainer's next look
    raises WindowFailed with capture's reason, at once, where it would otherwise wait for a shard."""
    from eagle3_pipeline.train.window import WindowFailed

    w = ShardWindow(tmp_path, max_shards=2)
    assert w.try_reserve("a", 10)
    w.abandon("a")
    w.fail("window shard a failed verify and was not published")
    with pytest.raises(WindowFailed, match="capture failed.*shard a failed verify"):
        w.wait_published(wait_s=600)
    st = w.state()
    assert st.published == 0 and st.shards == {} and "shard a" in st.failed


def test_records_dir_of_a_shard_written_as_an_extract_version(tmp_path):
    """A shard captured by the extract stage holds its records under hidden_states/ (beside its manifest); the
    sampler finds them there, a flat shard (records in the shard dir) as before."""
    from eagle3_pipeline.train.window_sampler import shard_rows

    w = ShardWindow(tmp_path, max_shards=2)
    for key, sub in (("flat", ""), ("version", "hidden_states")):
        d = w.shard_dir(key) / sub
        d.mkdir(parents=True)
        for r in (3, 1):
            (d / f"hs_{r}.safetensors").write_bytes(b"x")
        (w.shard_dir(key) / "manifest.json").write_text("{}")
        assert shard_rows(w, key) == [1, 3]
    assert w.records_dir("version") == w.shard_dir("version") / "hidden_states"


def test_merge_verify_sums_counts_joins_samples_and_keeps_the_worst():
    from eagle3_pipeline.pipeline.window_training import merge_verify
    from eagle3_pipeline.records.verification import VerifyResult

    def shard(records, err, cos, samples, seconds):
        return VerifyResult.model_validate({
            "content_key": "shard", "passed": True, "problems": [], "bad_rows": [], "seconds": seconds,
            "rows_rechecked": records,
            "checks": {"structure": {"ran": True, "records": records, "tokens_checked": 10 * records},
                       "reference": {"ran": True, "records": len(samples), "samples": samples,
                                     "max_rel_err": err, "min_cosine": cos},
                       "masks": {"ran": False, "skipped": "not asked"}}})

    ver = merge_verify([shard(3, 0.01, 0.99, [1, 2], 1.0), shard(5, 0.02, 0.98, [7], 2.5)], "version")
    assert ver.passed and ver.mode == "window" and ver.content_key == "version"
    assert ver.samples_checked == 8 and ver.checks.structure.tokens_checked == 80
    assert ver.checks.reference.samples == [1, 2, 7] and ver.reference_max_rel_err == 0.02
    assert ver.checks.reference.min_cosine == 0.98 and ver.rows_rechecked == 8 and ver.seconds == 3.5
    assert not ver.checks.masks.ran and ver.checks.masks.skipped == "not asked"
    assert not merge_verify([shard(1, 0.0, 1.0, [], 0.1).model_copy(update={"passed": False})], "v").passed
