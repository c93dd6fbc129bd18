"""train.mode online, for real: the train stage starts a vLLM server of the target (OpenAI API, native
`extract_hidden_states` + our connector), the verify gate checks rows sampled from that server, and
speculators' trainer asks the server for every row's hidden states (nothing stored for the dataset).

Five server starts in all: the tiny Llama clean (sample verified, a few training steps, the draft
exported and checked), the tiny Llama with a connector that shifts batched requests by one token (the
gate stops the stage before training), the tiny MoE target (MLA + MoE) clean and with rows corrupted after
its sample (training stops), and one tiny Llama server with rows corrupted after the sample that serves
three corruptions in turn (each its own run of the gate and the trainer, each stopped by its own check).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.core.proc import CHILD_MARKER_ENV, LAUNCHER_ENV
from eagle3_pipeline.engine.build import vllm_is_cpu_build
from eagle3_pipeline.verify.stage import VerifyFailed
from tests.helpers.stack import expected_runner
from tests.helpers.store import describe_processes, processes_with_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(1200)

ONLINE = ["train.mode=online", "train.epochs=1", "train.max_steps=4", "train.max_seq_len=512",
          "verify.online_rows=24", "verify.reference_samples=1"]


def _servers_left() -> list[str]:
    """The online servers' processes that this test process launched and that are still running (the
    server's group, its engine core), described. Only ours: the other xdist worker may be running a test
    that starts a server of its own at the same moment (CI once counted that one as our leftover)."""
    ours = set(processes_with_env(LAUNCHER_ENV, str(os.getpid())))
    return describe_processes([p for p in processes_with_env(CHILD_MARKER_ENV, "online-server") if p in ours])


def _run_online(cfg, log_lines: list[str]):
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare, stage_train, stage_vocab

    prep = stage_prepare(cfg, log=log_lines.append)
    pre = stage_preflight(cfg, prep, log=log_lines.append)
    version = plan_extract(cfg, prep, pre)
    voc = stage_vocab(cfg, prep, version, log=log_lines.append)
    return version, stage_train(cfg, version, voc, log=log_lines.append)


@pytest.fixture(scope="module")
def llama_online(tiny_config, tmp_path_factory):
    """The session's tiny data in a store of its own (the session store holds the offline extraction of the
    same version, and this run must show that online training writes no records)."""
    overrides = {**_flat(tiny_config), "store": str(tmp_path_factory.mktemp("online-store"))}
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"{k}={v}" for k, v in overrides.items()] + ONLINE)
    lines: list[str] = []
    version, tr = _run_online(cfg, lines)
    return cfg, version, tr, lines


def _flat(cfg) -> dict:
    """The session config's store, target and sources as overrides (the module adds its own on top)."""
    d = cfg.model_dump(mode="json")
    return {"store": d["store"], "target.model": d["target"]["model"],
            "prepare.sources": json.dumps(d["prepare"]["sources"]), "prepare.heldout_rows": d["prepare"]["heldout_rows"]}


def test_online_training_takes_every_row_from_the_server(llama_online):
    cfg, version, tr, lines = llama_online
    assert tr.mode == "online" and tr.steps == 4 and tr.export_checked
    on = tr.online  # the OnlineRecord (records/results.py); its verify is the VerifyResult as written
    # the gate ran on rows from the server before training: every check, nothing failed
    ver = on.verify
    assert ver["mode"] == "online" and ver["passed"] and ver["samples_checked"] == len(on.sample_rows) == 24
    fp = ver["fingerprint"]
    assert fp["rows_checked"] == 24 and fp["rows_failed"] == fp["rows_without"] == 0 and fp["skipped"] is None
    assert fp["min_agreement"] >= 0.9
    assert ver["reference_samples"] and ver["reference_max_rel_err"] < 0.05
    assert ver["invariance_samples"] and ver["invariance_max_rel_err"] < 0.05
    # nothing stored for the dataset: the version has no records, the server's scratch dir is gone
    assert not version.hidden_states_dir.exists() or not any(version.hidden_states_dir.iterdir())
    assert not (Path(on.work_dir) / "server_hidden_states").exists()
    assert on.scratch_peak_bytes > 0  # files really passed through the scratch dir while training
    assert tr.hidden_states_peak_bytes == on.sample_bytes + on.scratch_peak_bytes
    dumped = tr.model_dump(mode="json")  # what report.json and Prefect get: the online fields are real fields
    assert dumped["hidden_states_peak_bytes"] == tr.hidden_states_peak_bytes and dumped["online"]["verify"]["passed"]
    assert tr.hidden_states_peak_bytes < on.offline_bytes_estimate / 2
    # the server is gone with the stage, and its log is kept
    assert _servers_left() == []
    server_log = (Path(on.work_dir) / "server.log").read_text()
    assert "Application startup complete" in server_log
    assert "lean prompt scores in place" in server_log  # the server's engine scores rows as extraction does
    ready = [ln for ln in lines if ln.startswith("online: server ready in")]
    assert len(ready) == 1, lines
    if vllm_is_cpu_build():  # one rank: the API server and the engine core, which runs the model itself (no worker)
        assert ready[0].endswith("(processes: API server, VLLM::EngineCore, resource tracker)"), ready
    # before the first row: the server's engine built the V1 runner (pinned by server_env) and both hooks ran in it
    assert any(ln == f"online: server runner {expected_runner()}, hooks live: "
               "state_sketch, prompt_scores" for ln in lines), [ln for ln in lines if "runner" in ln]
    # training really learned from the server's states (loss falls over 4 steps of a fresh draft)
    assert tr.first_loss is not None and tr.final_loss < tr.first_loss


def test_online_train_key_differs_from_offline(llama_online):
    from eagle3_pipeline.pipeline.stages import train_key

    cfg, version, tr, _ = llama_online
    offline = cfg.model_copy(update={"train": cfg.train.model_copy(update={"mode": "offline"})})
    assert train_key(cfg, version) != train_key(offline, version)
    assert Path(tr.dir) == version.train_dir(train_key(cfg, version)).resolve()


def test_a_server_that_shifts_batched_requests_fails_the_gate_before_training(tiny_config, tmp_path, monkeypatch):
    """tests/helpers/broken_connector.OffsetDriftConnector in the server: every request after the first of
    an engine step is read one token late. The sampled rows go to the server concurrently (as training's
    do), so the verify gate sees the drift (fingerprints, batch invariance, identity) and the stage stops
    before any training step; the server is ended all the same."""
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    overrides = {**_flat(tiny_config), "store": str(tmp_path / "store")}
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"{k}={v}" for k, v in overrides.items()] + ONLINE + [
        "extract.connector_module=tests.helpers.broken_connector", "extract.connector_name=OffsetDriftConnector",
        "verify.reference_samples=0", "verify.allow_skip=[reference]"])
    lines: list[str] = []
    with pytest.raises(VerifyFailed) as ei:
        _run_online(cfg, lines)
    msg = str(ei.value)
    assert "verify failed" in msg and "hs_" in msg, msg
    train_dirs = list((tmp_path / "store").rglob("checkpoints"))
    assert train_dirs == [] or all(not any(d.iterdir()) for d in train_dirs), train_dirs
    assert not any("train: step" in ln for ln in lines)
    assert _servers_left() == []


def test_online_on_the_moe_target(tiny_moe_target, tmp_path):
    tiny_moe = tiny_moe_target
    """The tiny MoE (MLA, routed experts, trust_remote_code tokenizer, thinking/tool template): the
    server batches requests like the dense target's, the sampled rows pass the gate (fingerprints, identity,
    invariance, the streamed reference), and training runs on its states."""
    cfg = load_config(ROOT / "configs" / "tiny-moe.yaml", [
        f"store={tmp_path / 'store'}", f"target.model={tiny_moe}",
        f"prepare.sources=[{{path: {tiny_moe / 'corpus' / 'openai.jsonl'}, limit: 80}}]", "prepare.heldout_rows=8",
        *ONLINE, "train.max_steps=2"])
    lines: list[str] = []
    version, tr = _run_online(cfg, lines)
    assert version.dims.mla and tr.mode == "online" and tr.steps == 2 and tr.export_checked
    ver = tr.online.verify
    assert ver["passed"] and ver["samples_checked"] == 24 and ver["fingerprint"]["rows_checked"] == 24
    assert ver["identity_files"] == 24 and ver["invariance_samples"]
    assert ver["reference_samples"] and ver["reference_skipped"] is None and ver["reference_min_cosine"] > 0.9
    assert tr.hidden_states_peak_bytes < tr.online.offline_bytes_estimate
    assert _servers_left() == []


def _judged(run: Callable[[list[str]], object]) -> tuple[str, list[str]]:
    """`run(log_lines)` must fail the gate on a row the trainer read after a clean sample (exit 4).
    Returns (its message, the log lines)."""
    from eagle3_pipeline.core.errors import exit_code

    lines: list[str] = []
    with pytest.raises(VerifyFailed) as ei:
        run(lines)
    msg = str(ei.value)
    assert exit_code(ei.value) == 4 and "online row" in msg, msg
    assert any(ln.startswith("online:") and "taken from the server" in ln for ln in lines)  # the sample passed
    return msg, lines


def _late_corruption(cfg, mode: str, monkeypatch) -> tuple[str, list[str]]:
    """Run the online train stage with LateCorruptionConnector corrupting a third of the rows in `mode` after the
    sample's requests; the stage must fail the gate (exit 4) and end its server. Returns (its message, the log lines)."""
    from tests.helpers.broken_connector import CORRUPT_AFTER_ENV, CORRUPT_EVERY_ENV, CORRUPT_MODE_ENV

    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # the server's first request is its runner proof (train/online.py HiddenStateServer._prove: one two-token
    # row), then the sample's rows and its invariance rows: all of them written clean
    monkeypatch.setenv(CORRUPT_AFTER_ENV, str(1 + cfg.verify.online_rows + cfg.extract.invariance_rows))
    monkeypatch.setenv(CORRUPT_EVERY_ENV, "3")
    monkeypatch.setenv(CORRUPT_MODE_ENV, mode)
    msg, lines = _judged(lambda log_lines: _run_online(cfg, log_lines))
    assert _servers_left() == []
    return msg, lines


# the late-corruption runs skip the streamed reference on their (clean) sample: it reads no row from the server
# and cannot see a later row; the clean runs above prove it on both targets
LATE = ["extract.connector_module=tests.helpers.broken_connector", "extract.connector_name=LateCorruptionConnector",
        "verify.reference_samples=0", "verify.allow_skip=[reference]"]


def test_a_stale_last_block_from_the_moe_server_stops_online_training(tiny_moe_target, tmp_path, monkeypatch):
    """The same on the tiny MoE (MLA + MoE), through the whole train stage (its server started and ended with
    it): a row whose last KV block holds another request's states, after a clean sample, fails its fingerprint
    on those tokens and stops training."""
    cfg = load_config(ROOT / "configs" / "tiny-moe.yaml", [
        f"store={tmp_path / 'store'}", f"target.model={tiny_moe_target}",
        f"prepare.sources=[{{path: {tiny_moe_target / 'corpus' / 'openai.jsonl'}, limit: 80}}]",
        "prepare.heldout_rows=8", *ONLINE, "train.max_steps=2", *LATE])
    msg, _ = _late_corruption(cfg, "a stale last KV block", monkeypatch)
    assert "final layer disagrees" in msg and "positions [" in msg, msg


@pytest.fixture(scope="module")
def late_server(tiny_config, tmp_path_factory):
    """One server of the tiny Llama with LateCorruptionConnector for the three cases below (a server start each
    was ~20 s of their ~35 s): its corruption is set per case in a control file (broken_connector
    CORRUPT_CONTROL_ENV): nothing for the server's runner proof, then the case's mode on a third of the rows,
    every row of the verified sample clean. Each case runs the train stage's online work on it
    (online_training.train_on_server: sample, gate, training); the stage's own start and end of its server
    are the MoE case's and the other tests' (the MoE case runs before these: this server lives to the module's
    end, and that test counts the online servers left). Yields (cfg, TrainInputs, the server, the control file)."""
    from eagle3_pipeline.pipeline.online_training import online_server, online_work_dir
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare, stage_vocab
    from eagle3_pipeline.train.stage import TrainInputs
    from tests.helpers.broken_connector import CORRUPT_CONTROL_ENV, CORRUPT_EVERY_ENV

    store = tmp_path_factory.mktemp("late-store")
    overrides = {**_flat(tiny_config), "store": str(store)}
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [f"{k}={v}" for k, v in overrides.items()] + ONLINE + LATE)
    control = store / "corruption.json"
    control.write_text(json.dumps({"mode": None, "clean": []}))
    lines: list[str] = []
    prep = stage_prepare(cfg, log=lines.append)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=lines.append))
    inputs = TrainInputs(version=version, voc=stage_vocab(cfg, prep, version, log=lines.append))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        mp.setenv(CORRUPT_CONTROL_ENV, str(control))
        mp.setenv(CORRUPT_EVERY_ENV, "3")
        with online_server(cfg, version, online_work_dir(cfg, version), lines.append) as srv:
            yield cfg, inputs, srv, control
    assert _servers_left() == []


def _sample_clean(control: Path, cfg, version, mode: str) -> None:
    """Set the late server's corruption: `mode`, every row of the verify gate's sample (and so its invariance
    rows) written clean."""
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.train.online import sample_rows
    from tests.helpers.broken_connector import ids_key

    ds = load_tokenized(version.tokenized_dir)
    rows = sample_rows(len(ds), cfg.verify.online_rows)
    control.write_text(json.dumps({"mode": mode, "clean": [ids_key(ids) for ids in ds.select(rows)["input_ids"]]}))


@pytest.mark.parametrize("mode, caught_by", [("a single token (the last)", "final layer disagrees"),
                                             ("permuted aux layers", "states differ from the ones the target computed"),
                                             ("one aux layer of a single token",
                                              "states differ from the ones the target computed at 1 token-layer")])
def test_rows_the_sample_never_saw_are_judged_before_training(mode, caught_by, late_server):
    """Issue 30, online mode: the verified sample is clean, the rows training asks for afterwards are not
    (tests/helpers/broken_connector.LateCorruptionConnector: a third of the rows, keyed by token ids, none of
    the sample's). Every row the trainer reads is judged against the target: a row whose final
    layer disagrees with the target's logits on one token stops training (asked again, wrong again).
    The stage fails the gate (exit 4) and names the rows. Aux layers permuted, or one aux layer of one token from another request (the final
    layer right), differ from the server engine's state sketch of the states it computed: the row is
    rejected on every attempt, naming the position and layer slot."""
    from eagle3_pipeline.pipeline.online_training import train_on_server

    cfg, inputs, srv, control = late_server
    _sample_clean(control, cfg, inputs.version, mode)
    msg, _ = _judged(lambda log_lines: train_on_server(cfg, inputs, srv, log_lines.append))
    assert caught_by in msg, msg
    if mode.startswith("a single"):  # the disagreeing token is named: the row's last position
        assert "positions [" in msg and "at 1 of" in msg, msg
    else:  # the engine's sketch: every state of every token
        assert "layer slot 0" in msg and "failed the per-row checks against the target on every attempt" in msg, msg
