"""The extract stage for real: vLLM on CPU with the tiny target, our connector, the child process and
the manifest. Three engine starts in all (an uninterrupted run, a run killed after its first shard,
its retry), shared by the module; everything else reuses their outputs or starts no engine.
Reads the session fixtures `tiny_target` and `tokenized` (tests/conftest.py) and uses its first
ROWS rows only, as an ExtractVersion of its own (tests/helpers/version.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.config import ExtractConfig, TargetConfig
from eagle3_pipeline.core.proc import ChildFailed, python_child
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.extract.stage import ExtractFailed, extract_group
from eagle3_pipeline.extract.worker import KILL_AFTER_ENV, ExtractJob, ShardSpec
from eagle3_pipeline.records import shardrun as run_mod
from eagle3_pipeline.records.contracts import RECORD_META_KEY, to_record
from eagle3_pipeline.records.layout import ExtractVersion, plan_shards
from eagle3_pipeline.records.shardrun import ShardRun
from tests.helpers.stack import expected_runner
from tests.helpers.store import record_matches
from tests.helpers.version import extract_all, make_version

ROWS, ROWS_PER_SHARD = 12, 4  # 3 shards
LAYER_IDS = [2, 4, 5, 8]      # the default for the 8-layer tiny target: [2, N//2, N-3] + N

pytestmark = pytest.mark.timeout(900)


def _cfg(**kw) -> ExtractConfig:
    return ExtractConfig(rows_per_shard=ROWS_PER_SHARD, timeout_s=600, **kw)


def _version(target: TargetConfig, tokenized: Path, out: Path, content_key: str = "test-key") -> ExtractVersion:
    """The first ROWS rows in shards of ROWS_PER_SHARD, all in one group, extracted into `out`."""
    v = make_version(target, tokenized, out, content_key=content_key, rows_per_shard=ROWS_PER_SHARD)
    assert v.layer_ids == LAYER_IDS and [len(g) for g in v.groups] == [3]
    return v


@pytest.fixture(scope="module")
def small_tokenized(tokenized, tmp_path_factory) -> Path:
    import datasets

    out = tmp_path_factory.mktemp("extract-tok") / "tokenized"
    datasets.load_from_disk(str(tokenized)).select(range(ROWS)).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def target(tiny_target) -> TargetConfig:
    return TargetConfig(model=str(tiny_target), tokenizer=str(tiny_target))


@pytest.fixture(scope="module")
def full_run(small_tokenized, target, tmp_path_factory) -> SimpleNamespace:
    """One uninterrupted extraction of all shards."""
    out = tmp_path_factory.mktemp("extract-a") / "v"
    lines: list[str] = []
    t0 = time.time()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_PROGRESS_S", "0.000001")  # a progress line per finished request
        res = extract_all(_cfg(), target, _version(target, small_tokenized, out), log=lines.append)
    print(f"full extract run: {time.time() - t0:.1f}s wall; {res.tokens} tokens at {res.tokens_per_s} tok/s; "
          + "; ".join(x for x in lines if x.startswith("extract:")))
    return SimpleNamespace(out=out, result=res, lines=lines)


def _processes_with_env(key: str, value: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.fixture(scope="module")
def killed_and_retried(small_tokenized, target, tmp_path_factory) -> SimpleNamespace:
    """A child that SIGKILLs itself after its first shard, then a plain retry. The killed child runs
    vLLM's engine core as a separate process (the production layout), so this also checks that no
    engine process outlives the attempt; the retry uses the CPU default (in-process engine core)."""
    out = tmp_path_factory.mktemp("extract-b") / "v"
    tag = f"extract-kill-{uuid.uuid4().hex}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KILL_AFTER_ENV, "1")
        mp.setenv("EAGLE3_TEST_TAG", tag)  # inherited by the child and every engine process under it
        with pytest.raises(ExtractFailed) as err:
            extract_all(_cfg(engine_in_process=False), target, _version(target, small_tokenized, out),
                        log=lambda _: None)
    survivors = _processes_with_env("EAGLE3_TEST_TAG", tag)
    after_kill = ShardRun(out).read_raw()
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").iterdir()}
    lines: list[str] = []
    res = extract_all(_cfg(), target, _version(target, small_tokenized, out), log=lines.append)
    return SimpleNamespace(out=out, error=str(err.value), after_kill=after_kill, mtimes_after_kill=mtimes,
                           result=res, lines=lines, survivors=survivors)


def _load(path: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def test_plan_shards_covers_rows_once():
    plan = plan_shards(10, 4)
    assert [(s.row_start, s.row_end) for s in plan] == [(0, 4), (4, 8), (8, 10)]
    assert plan_shards(0, 4) == []
    with pytest.raises(ValueError):
        plan_shards(10, 0)


def test_records_follow_the_contract(full_run, small_tokenized):
    import torch

    ds = load_tokenized(small_tokenized)
    res = full_run.result
    assert res.layer_ids == LAYER_IDS
    assert (res.shards_total, res.shards_published) == (3, 3)
    assert res.tokens == sum(ds["seq_len"]) and res.tokens_per_s > 0
    hs_dir = Path(res.hidden_states_dir)
    files = sorted(hs_dir.iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    assert [p.name for p in files] == [f"hs_{i}.safetensors" for i in range(ROWS)]
    assert res.bytes_on_disk == sum(p.stat().st_size for p in files)
    for i, p in enumerate(files):
        rec, meta = _load(p)
        ids = ds[i]["input_ids"]
        assert set(rec) == {"hidden_states", "token_ids"}, p
        assert rec["token_ids"].dtype == torch.int64 and rec["token_ids"].tolist() == ids, p
        assert rec["hidden_states"].dtype == torch.bfloat16, p
        assert tuple(rec["hidden_states"].shape) == (len(ids), len(LAYER_IDS), 128), p  # [T, L, H]
        assert torch.isfinite(rec["hidden_states"].float()).all(), p
        assert json.loads(meta[RECORD_META_KEY]) == {"layer_ids": LAYER_IDS, "storage_dtype": "bf16"}
    m = ShardRun(full_run.out).read_raw()
    assert m["content_key"] == "test-key" and m["layer_ids"] == LAYER_IDS
    assert set(m["tools"]) >= {"vllm", "torch", "speculators"} and m["tools"]["vllm"]
    assert [s["status"] for s in m["shards"]] == ["published"] * 3
    assert all(s["attempts"] == 1 and s["error"] is None for s in m["shards"])
    from eagle3_pipeline.core.store import sha256_file

    for s in m["shards"]:
        assert s["tokens"] == sum(ds["seq_len"][s["row_start"]:s["row_end"]])
        for name, sha in s["files"].items():
            assert sha256_file(hs_dir / name) == sha
    assert m["children"][0]["engine_start_s"] > 0
    assert any("engine ready" in x for x in full_run.lines)
    # the fingerprints' scores come from prompt_scores.py's lean path (same values as vLLM's own step:
    # tests/integration/test_prompt_scores.py)
    assert any("extract worker: lean prompt scores in place" in x for x in full_run.lines), full_run.lines


def test_progress_inside_a_shard(full_run, small_tokenized):
    """Lines from inside the engine call: requests and prompt tokens done of the shard's, and tok/s."""
    progress = [x.split("] ", 1)[-1] for x in full_run.lines if "extract: shard 0: " in x and "requests done" in x]
    assert progress, full_run.lines
    assert progress[-1].startswith(f"extract: shard 0: {ROWS_PER_SHARD} of {ROWS_PER_SHARD} requests done (")
    assert " prompt tokens, " in progress[-1] and " tok/s" in progress[-1], progress[-1]


def test_layers_match_hf_transformers(full_run, small_tokenized, tiny_target):
    """Layer id k == HF output_hidden_states[k]; id N == the last decoder layer's output before the
    final norm (HF's hidden_states[N] is after it, so it is taken with a hook)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    ds = load_tokenized(small_tokenized)
    try:
        for row in (0, ROWS - 1):
            rec, _ = _load(Path(full_run.result.hidden_states_dir) / f"hs_{row}.safetensors")
            ids = torch.tensor(ds[row]["input_ids"])[None]  # [1, T]
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            refs = [out.hidden_states[k][0] for k in LAYER_IDS[:-1]] + [captured["last"][0]]  # each [T, H]
            for j, (k, ref) in enumerate(zip(LAYER_IDS, refs)):
                got = rec["hidden_states"][:, j].float()  # [T, H]
                cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)  # [T]
                assert cos.min() > 0.99, f"hs_{row}: layer {k}: min cosine {cos.min():.4f} vs HF"
    finally:
        hook.remove()


def test_second_call_with_everything_published_starts_no_child(full_run, small_tokenized, target, monkeypatch):
    def no_child(*a, **k):
        raise AssertionError("a child was started although every shard is published")

    monkeypatch.setattr(run_mod, "run_child", no_child)
    lines: list[str] = []
    version = _version(target, small_tokenized, full_run.out)
    recs = extract_group(_cfg(), target, version, [0, 1, 2], log=lines.append)
    assert [r.status for r in recs] == ["published"] * 3 and all(r.reused for r in recs)
    assert extract_all(_cfg(), target, version, log=lines.append) == full_run.result
    assert len(ShardRun(full_run.out).read_raw()["children"]) == 1


def test_damaged_file_sends_only_its_shard_back(full_run, small_tokenized, target, tmp_path, monkeypatch):
    """A published shard whose file no longer hashes to the manifest is extracted again; the others
    are not. (The child is faked here: it records its job and fails.)"""
    out = tmp_path / "v"
    shutil.copytree(full_run.out, out)
    victim = out / "hidden_states" / "hs_5.safetensors"  # row 5 -> shard 1
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    jobs = []

    def fake_child(argv, **kw):
        jobs.append(ExtractJob.model_validate_json(Path(argv[-1]).read_text()))
        raise ChildFailed("fake child: exited with code 1; last output:\nboom")

    monkeypatch.setattr(run_mod, "run_child", fake_child)
    lines: list[str] = []
    with pytest.raises(ExtractFailed, match=r"(?s)shards \[1\] not published.*boom"):
        extract_group(_cfg(), target, _version(target, small_tokenized, out), [0, 1, 2], log=lines.append)
    assert [s.index for s in jobs[0].shards] == [1]
    assert any("hs_5.safetensors no longer hashes" in x for x in lines)
    m = ShardRun(out).read_raw()
    assert [s["status"] for s in m["shards"]] == ["published", "failed", "published"]
    assert "boom" in m["shards"][1]["error"] and m["shards"][1]["attempts"] == 2
    assert not (out / ".scratch").exists()


def test_wrong_content_key_is_refused(full_run, small_tokenized, target):
    with pytest.raises(ExtractFailed, match="belongs to content key 'test-key'"):
        extract_all(_cfg(), target, _version(target, small_tokenized, full_run.out, content_key="other"),
                    log=lambda _: None)


def test_sigkill_mid_group_then_retry_publishes_the_rest(killed_and_retried, full_run):
    kr = killed_and_retried
    assert "shards [1, 2] not published" in kr.error and "code -9" in kr.error, kr.error
    assert [s["status"] for s in kr.after_kill["shards"]] == ["published", "failed", "failed"]
    assert "code -9" in kr.after_kill["shards"][1]["error"]
    assert kr.survivors == [], f"engine processes outlived the killed child: {kr.survivors}"
    assert kr.result.shards_published == 3
    m = ShardRun(kr.out).read_raw()
    assert [c["shards"] for c in m["children"]] == [[0, 1, 2], [1, 2]]
    assert [s["attempts"] for s in m["shards"]] == [1, 2, 2]
    hs = kr.out / "hidden_states"
    for i in range(ROWS_PER_SHARD):  # shard 0 was left alone by the retry
        assert hs.joinpath(f"hs_{i}.safetensors").stat().st_mtime_ns == kr.mtimes_after_kill[f"hs_{i}.safetensors"]
    ref = Path(full_run.result.hidden_states_dir)
    for i in range(ROWS):  # the retry's records come from another engine process: by content (tests/helpers/store.py)
        name = f"hs_{i}.safetensors"
        if not record_matches(hs / name, ref / name):
            print(f"{name}: equal to the uninterrupted run's at rounding level only")


def test_no_temporary_files_are_left(full_run, killed_and_retried):
    for out in (full_run.out, killed_and_retried.out):
        assert not list(out.rglob("*.tmp-*")), list(out.rglob("*.tmp-*"))
        assert not (out / ".scratch").exists()
        assert sorted(p.suffix for p in (out / "hidden_states").iterdir()) == [".safetensors"] * ROWS


def test_fp8_records_carry_per_token_scales(tmp_path):
    import torch

    torch.manual_seed(0)
    hs = torch.randn(7, 4, 128, dtype=torch.bfloat16) * torch.linspace(0.01, 300, 7)[:, None, None]  # [T, L, H]
    hs[3] = 0  # an all-zero token must not divide by zero
    tok = torch.arange(7)
    rec = to_record(hs, tok, "fp8")
    assert rec["hidden_states"].dtype == torch.float8_e4m3fn and tuple(rec["hidden_states"].shape) == (7, 4, 128)
    assert rec["hidden_states_scales"].dtype == torch.float32 and tuple(rec["hidden_states_scales"].shape) == (7, 1, 1)
    back = rec["hidden_states"].float() * rec["hidden_states_scales"]  # [T, L, H]
    err = (back - hs.float()).abs().amax(dim=(1, 2)) / hs.float().abs().amax(dim=(1, 2)).clamp(min=1e-30)
    assert err.max() < 0.07 and back[3].abs().max() == 0
    from safetensors.torch import load_file, save_file

    save_file(rec, str(tmp_path / "hs_0.safetensors"))
    again = load_file(str(tmp_path / "hs_0.safetensors"))
    assert all(again[k].dtype == rec[k].dtype and torch.equal(again[k].view(torch.uint8), rec[k].view(torch.uint8))
               for k in ("hidden_states", "token_ids"))
    bf = to_record(hs, tok, "bf16")
    assert set(bf) == {"hidden_states", "token_ids"} and bf["hidden_states"].dtype == torch.bfloat16


RUNNER_LINE = f"extract worker: engine runner {expected_runner()}, hooks live: "


def test_the_engine_runs_the_v1_runner_with_its_hooks_live(full_run):
    """Before the first shard the worker names the runner its engine built (V1, with the pin) and the hooks
    that ran in it (engine/runner.py)."""
    assert any(RUNNER_LINE + "state_sketch, prompt_scores" in x for x in full_run.lines), full_run.lines[:40]
    first_shard = next(i for i, x in enumerate(full_run.lines) if "shard 0" in x and "published" in x)
    assert min(i for i, x in enumerate(full_run.lines) if RUNNER_LINE in x) < first_shard


def test_a_hook_missing_from_the_engine_stops_before_the_first_shard(small_tokenized, target, tmp_path, monkeypatch):
    """The state sketch's plugin left out of vLLM's engine process (VLLM_PLUGINS, engine core in its own
    process): the worker stops after the warm-up request, naming the hook and the runner class, no shard is
    published, and no retry pays another model load (exit code 5, not transient)."""
    from eagle3_pipeline.core.errors import chain, exit_code, is_transient
    from eagle3_pipeline.engine.start import RunnerRefused

    monkeypatch.setenv("VLLM_PLUGINS", "eagle3_pipeline_amx,eagle3_pipeline_prompt_scores,eagle3_pipeline_runner")
    out = tmp_path / "v"
    with pytest.raises(ExtractFailed) as err:
        extract_all(_cfg(engine_in_process=False), target, _version(target, small_tokenized, out), log=lambda _: None)
    refused = [e for e in chain(err.value) if isinstance(e, RunnerRefused)]
    assert refused, str(err.value)
    assert f"the hook(s) state_sketch never ran in the engine's runner {expected_runner()}" \
        in str(refused[0])
    assert exit_code(err.value) == 5 and not is_transient(err.value, (OSError, ChildFailed))
    shards = ShardRun(out).read_raw()["shards"]
    assert all(s["status"] == "failed" and s["attempts"] == 1 for s in shards), shards
    assert not list((out / "hidden_states").glob("hs_*.safetensors"))


def test_worker_failure_prints_the_traceback(small_tokenized, tiny_target, tmp_path):
    cfg = ExtractConfig()
    job = ExtractJob(target=TargetConfig(model=str(tiny_target)), engine=cfg.engine(), layer_ids=LAYER_IDS,
                     hidden_size=128, tokenized_dir=str(small_tokenized), hidden_states_dir=str(tmp_path / "hs"),
                     scratch_dir=str(tmp_path / "scratch"), shards=[ShardSpec(index=0, row_start=0, row_end=999)],
                     connector_module=cfg.connector_module, connector_name=cfg.connector_name)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job.model_dump()))
    proc = subprocess.run(python_child("eagle3_pipeline.extract.worker", str(path)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "rows [0, 999) outside the tokenized dataset of 12 rows" in proc.stderr


def test_tensor_parallel_2_on_cpu_writes_once_from_rank_0(full_run, small_tokenized, target, tmp_path):
    """TP=2 on vLLM's CPU backend (one core per rank, gloo): the same connector and worker code as
    TP=1; rank 0 writes, rank 1 says it does not, and the records equal the TP=1 run's up to bf16
    reduction-order differences (the two ranks sum their partial matmuls in another order)."""
    import torch

    from eagle3_pipeline.extract.connector import CONNECTOR_LOG

    out, lines = tmp_path / "tp2", []
    res = extract_all(_cfg(tensor_parallel_size=2), target, _version(target, small_tokenized, out), log=lines.append)
    assert (res.shards_total, res.shards_published) == (3, 3)
    ranks = [x for x in lines if CONNECTOR_LOG in x]
    assert any(RUNNER_LINE in x for x in lines), lines[-30:]  # both ranks' workers recorded the V1 runner
    assert any("TP rank 0 of 2 writes hidden states" in x for x in ranks), ranks or lines[-30:]
    assert any("TP rank 1 of 2 does not write" in x for x in ranks), ranks or lines[-30:]
    ref_dir, tp2_dir = Path(full_run.result.hidden_states_dir), Path(res.hidden_states_dir)
    assert sorted(p.name for p in tp2_dir.iterdir()) == sorted(p.name for p in ref_dir.iterdir())
    for p in sorted(ref_dir.iterdir()):
        ref, _ = _load(p)
        got, _ = _load(tp2_dir / p.name)
        assert torch.equal(got["token_ids"], ref["token_ids"]), p.name
        a, b = ref["hidden_states"].float(), got["hidden_states"].float()  # [T, L, H]
        assert a.shape == b.shape, (p.name, a.shape, b.shape)
        rel = ((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)).max().item()
        assert rel < 0.05, f"{p.name}: TP=2 differs from TP=1 by relative error {rel:.4f}"
    assert not list(out.rglob("*.tmp-*"))


def test_engine_start_refused_is_not_retried_and_names_the_key(small_tokenized, target, tmp_path, monkeypatch):
    """gpu_memory_utilization too small for the engine process itself: vLLM refuses at start-up. The
    failure is a config error (exit code 2) that no retry policy retries, naming the key and a value
    that fits; the shards stay unpublished with the reason in the manifest."""
    from eagle3_pipeline.core.errors import chain, exit_code, is_transient
    from eagle3_pipeline.engine.start import EngineStartRefused

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the suite's fixed CPU KV cache: the setting decides
    out = tmp_path / "v"
    with pytest.raises(ExtractFailed) as err:
        extract_all(_cfg(gpu_memory_utilization=0.01), target, _version(target, small_tokenized, out),
                    log=lambda _: None)
    refused = [e for e in chain(err.value) if isinstance(e, EngineStartRefused)]
    assert refused, str(err.value)
    msg = str(refused[0])
    assert msg.startswith("extract: vLLM refused to start: extract.gpu_memory_utilization 0.01 reserves "), msg
    assert "Set extract.gpu_memory_utilization: 0." in msg and "or more" in msg, msg
    assert exit_code(err.value) == 2 and not is_transient(err.value, (OSError, ChildFailed))
    shards = ShardRun(out).read_raw()["shards"]
    assert all(s["status"] == "failed" and "vLLM refused to start" in s["error"] for s in shards)
