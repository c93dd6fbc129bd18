"""The extract child process: `python -m eagle3_pipeline.extract.worker JOB.json`.

More: docs/internals.md, "extract/worker.py".
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.proc import child_main, emit_event
from eagle3_pipeline.core.progress import LineProgress
from eagle3_pipeline.core.store import durable_files
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.engine import runner, state_sketch
from eagle3_pipeline.engine.build import (
    ENGINE_PRELOAD,
    FINGERPRINT_ENGINE_KWARGS,
    build_llm,
    extract_hidden_states_config,
    hidden_states_kv_config,
    vllm_is_cpu_build,
)
from eagle3_pipeline.engine.prompt_scores import ENV, install, wanted
from eagle3_pipeline.engine.state_sketch import KEY as SKETCH_KEY
from eagle3_pipeline.records.contracts import (
    FP_TOP,
    RECORD_META_KEY,
    ContractError,
    dequantise,
    fingerprint_from_flat,
    fingerprint_name,
    invariance_entry,
    invariance_rows,
    read_record,
    record_file_problem,
    record_name,
    row_hash,
    to_record,
    write_fingerprint,
    write_record,
)
from eagle3_pipeline.records.layout import Shard

# what a fork server imports before forking this worker (core/forkserver.py)
FORK_PRELOAD = (*ENGINE_PRELOAD, "eagle3_pipeline.extract.connector", "vllm.v1.spec_decode.extract_hidden_states")

KILL_AFTER_ENV = "EAGLE3_TEST_KILL_AFTER_SHARDS"
RECORD_DELAY_ENV = "EAGLE3_TEST_RECORD_DELAY_S"
# Fault injection (tests, chaos drills): "3,7" makes shards 3 and 7 fail with an error, once per
# marker file: the file `<hidden_states_dir>/../.fail-shard-<k>` is created on the first failure, so
# a retry of the same shard succeeds (a transient fault, as a lost node would be).
FAIL_SHARDS_ENV = "EAGLE3_TEST_FAIL_SHARDS"


class ShardSpec(Shard):
    """A planned shard (layout.Shard) as the child runs it."""
    rows: list[int] | None = None  # only these rows of the range (the rest came from the record pool)

    def row_ids(self) -> list[int]:
        return list(range(self.row_start, self.row_end)) if self.rows is None else list(self.rows)


class ExtractJob(BaseModel):
    """Everything the child needs; written as JSON by the parent, one per attempt."""
    model_config = ConfigDict(extra="forbid")
    target: TargetConfig
    engine: EngineConfig
    layer_ids: list[int]            # aux ids + N, ascending
    hidden_size: int                # H, to check records
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    tokenized_dir: str
    hidden_states_dir: str          # final records hs_{row}.safetensors
    scratch_dir: str                # vLLM's per-request files; deleted as they are consumed
    storage_dtype: Literal["bf16", "fp8"] = "bf16"
    attempt: int = 1                # tags temporary file names
    shards: list[ShardSpec]
    file_timeout_s: float = 300.0   # how long to wait for vLLM's file of one request
    nudge_after_s: float = 2.0      # separate engine core: then send a one-token request (see _Engine)
    connector_module: str           # the vLLM KV connector that writes each request's file
    connector_name: str             # (ExtractConfig.connector_*; tests load deliberately broken ones)
    fingerprints_dir: str | None = None  # fp_{row}.safetensors from vLLM's logits (None: not written)
    invariance_rows: int = 0        # rows of the group re-run alone at its end (batch of one), compared


# ---------------------------------------------------------------- engine side (child only)

def _load_file(path: str) -> dict:
    """vLLM's file once complete: on CPU our connector renames it into place when done; on CUDA the
    parent connector writes in place under an exclusive lock on `path.lock`, so wait on that lock."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
            return load_file(path, device="cpu")
    return load_file(path, device="cpu")


def _remove(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


ENGINE_TAG = "engine"  # a request's file beside its record: hs_{row}.safetensors.tmp-<attempt>-engine


def _engine_path(hs_dir: Path, row: int, attempt: int) -> str:
    """Where the connector writes row `row`'s file: a temporary name beside its record (same filesystem:
    renamed into place, never copied; the `*.tmp-<attempt>-*` names the parent removes after a kill)."""
    return str(hs_dir / f"{record_name(row)}.tmp-{attempt}-{ENGINE_TAG}")


class _Engine:
    """The LLM plus the one workaround it needs: a request's file is written on the engine step
    *after* the request finished (the scheduler hands the finished request to the connector in the
    next step's metadata). A separate engine-core process keeps stepping on its own until that is
    done; an in-process engine core only steps when asked, so `await_files` steps it
    (`llm_engine.step()`). As a fallback for the separate process, after `nudge_after_s` it sends a
    one-token request, whose own file is removed later."""

    def __init__(self, llm, job: ExtractJob, nudge_token: int):
        from vllm import SamplingParams
        from vllm.v1.engine.core_client import InprocClient

        self.llm, self.job = llm, job
        self.in_process = isinstance(llm.llm_engine.engine_core, InprocClient)
        # with fingerprints: vLLM's top-2 next-token scores (raw logits: engine.FINGERPRINT_ENGINE_KWARGS)
        # at every prompt position and for the generated token, as flat lists (no Python object per
        # position) of ids (no detokenization)
        fp = {"prompt_logprobs": FP_TOP, "logprobs": FP_TOP, "detokenize": False, "flat_logprobs": True} \
            if job.fingerprints_dir else {}
        self.params = SamplingParams(max_tokens=1, temperature=0.0, **fp)
        self.outputs: list = []  # the RequestOutputs of the last prefill
        self.nudge_token = nudge_token
        self.nudge_files: list[str] = []

    def _params(self, path: str | None):
        if path is None:
            return self.params
        sp = self.params.clone()
        sp.extra_args = {"kv_transfer_params": {"hidden_states_path": path}}
        return sp

    def prefill(self, rows: list[list[int]], paths: list[str] | None = None, what: str | None = None) -> list[str]:
        """Prefill `rows`; `paths`: where each request's file should go (the connector may write
        elsewhere: the paths it reports are returned). `what` names the work in progress lines."""
        params = [self._params(p) for p in paths] if paths else self.params
        progress = LineProgress(what, total_tokens=sum(map(len, rows)), generates=False) if what else False
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in rows], params, use_tqdm=progress)
        self.outputs = outs
        got = []
        for i, out in enumerate(outs):
            params = out.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise RuntimeError(f"request {out.request_id} (batch position {i}): vLLM returned no "
                                   f"hidden_states_path in kv_transfer_params={params!r}; is the "
                                   f"extract_hidden_states method + {self.job.connector_name} active?")
            got.append(params["hidden_states_path"])
        return got

    def await_files(self, paths: list[str]) -> None:
        t0 = last_nudge = time.time()
        while missing := [p for p in paths if not os.path.exists(p)]:
            now = time.time()
            if now - t0 > self.job.file_timeout_s:
                raise TimeoutError(f"{len(missing)} hidden-state file(s) not written by vLLM after "
                                   f"{self.job.file_timeout_s:.0f}s, e.g. {missing[0]}")
            if self.in_process:
                self.llm.llm_engine.step()  # runs the connector's get_finished -> writes
                continue
            if now - last_nudge > self.job.nudge_after_s:
                print(f"extract worker: {len(missing)} file(s) not written yet; driving another engine step",
                      flush=True)
                self.nudge_files += self.prefill([[self.nudge_token]])
                last_nudge = time.time()
            time.sleep(0.005)

    def warm_up(self) -> str:
        """One short request through the whole path (prefill, prompt logprobs, the connector's write)
        before the first shard, so that first-use costs count as start-up, not as a shard's work; the path
        it asked the connector to write (removed)."""
        path = str(Path(self.job.scratch_dir) / "warm-up.safetensors")
        self.await_files(self.prefill([[self.nudge_token] * 2], [path]))
        _remove(path)
        return path

    def drop_nudge_files(self) -> None:
        for p in self.nudge_files:
            _remove(p)


class _Durable:
    """The shard's files made durable and put in place together: each is written complete under its
    temporary name (the connector's, or ours), `wait()` flushes them all to disk, then renames each
    into place (store.durable_files: one syncfs per filesystem on Linux instead of an fsync per file,
    so no per-file journal commits stand in the way of the next files' writes; docs/benchmarks.md)."""

    def __init__(self):
        self.pending: list[tuple[Path, Path]] = []

    def submit(self, tmp: Path, final: Path) -> None:
        self.pending.append((Path(tmp), Path(final)))

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        durable_files(pending)


def _converted(path, ids: list[int], who: str, job: ExtractJob, dest: Path) -> Path:
    """The engine's file `path` of another layout (another connector, vLLM's own) read, checked against the
    tokenized row `ids` and written as our record for `dest` under a temporary name (returned)."""
    import torch

    L, H = len(job.layer_ids), job.hidden_size
    data = _load_file(path)
    hs, tok = data["hidden_states"], data["token_ids"]  # [T, L, H], [T]
    expect = torch.tensor(ids, dtype=torch.int64)  # [T]
    if tok.shape != expect.shape or not torch.equal(tok.to(torch.int64), expect):
        n = min(len(tok), len(expect))
        diff = next((i for i in range(n) if int(tok[i]) != int(expect[i])), n)
        raise ContractError(f"{who}: vLLM token_ids differ from the tokenized row: expected "
                            f"[{len(expect)}], found [{len(tok)}], first difference at position {diff}")
    if tuple(hs.shape) != (len(ids), L, H):
        raise ContractError(f"{who}: layers {job.layer_ids}: hidden_states expected "
                            f"{[len(ids), L, H]}, found {list(hs.shape)} (file {path})")
    return write_record(dest, to_record(hs, tok, job.storage_dtype), job.layer_ids,
                        job.storage_dtype, tag=str(job.attempt), durable=False)


def _run_shard(engine: _Engine, ds, job: ExtractJob, shard: ShardSpec, durable: _Durable) -> None:
    t0 = time.time()
    row_ids = shard.row_ids()
    rows = ds.select(row_ids)
    input_ids: list[list[int]] = rows["input_ids"]
    sample_ids = rows["sample_id"] if "sample_id" in rows.column_names else [None] * len(rows)
    hs_dir = Path(job.hidden_states_dir)
    t_prefill = time.time()
    requested = [_engine_path(hs_dir, r, job.attempt) for r in row_ids]
    paths = engine.prefill(input_ids, requested, what=f"extract: shard {shard.index}")
    outs = engine.outputs
    t_await = time.time()
    engine.await_files(paths)
    t_files = time.time()
    files, fp_files, tokens, converted = [], [], 0, 0
    for k, (ids, sid, path) in enumerate(zip(input_ids, sample_ids, paths)):
        row = row_ids[k]
        who = f"{record_name(row)} (row {row}, sample {sid})"
        name = record_name(row)
        if _is_record(path, hs_dir, ids, job):
            durable.submit(path, hs_dir / name)  # the connector wrote the record itself
        else:  # another layout (another connector, vLLM's own): read, check, convert, write
            durable.submit(_converted(path, ids, who, job, hs_dir / name), hs_dir / name)
            _remove(path)
            converted += 1
        files.append(name)
        if job.fingerprints_dir:
            out = outs[k]
            last = out.outputs[0].logprobs if out.outputs else None
            fp = fingerprint_from_flat(out.prompt_logprobs, last, len(ids))
            fp[SKETCH_KEY] = _take_sketch(job, requested[k], who)
            fp_path = Path(job.fingerprints_dir) / fingerprint_name(row)
            durable.submit(write_fingerprint(fp_path, fp, tag=str(job.attempt), durable=False), fp_path)
            fp_files.append(fingerprint_name(row))
        if delay := float(os.environ.get(RECORD_DELAY_ENV, "0") or 0):
            durable.wait()
            time.sleep(delay)  # test hook (RECORD_DELAY_ENV): the record is in place, then a pause
        tokens += len(ids)
    t_wait = time.time()
    durable.wait()  # every file of the shard fsynced and under its final name
    t1 = time.time()
    # where the shard's time went: rows read, engine prefill, the last files written, records checked and
    # fingerprints written, waiting for the last fsyncs
    phases = {"rows": t_prefill - t0, "prefill": t_await - t_prefill, "files": t_files - t_await,
              "records": t_wait - t_files, "fsync_wait": t1 - t_wait}
    masks = rows["loss_mask"]
    emit_event(kind="shard_done", shard=shard.index, files=files, fingerprint_files=fp_files, tokens=tokens,
               seconds=round(t1 - t0, 4), converted=converted, phases={k: round(v, 4) for k, v in phases.items()},
               row_hashes={str(r): row_hash(ids, m) for r, ids, m in zip(row_ids, input_ids, masks)})


def _is_record(path: str, hs_dir: Path, ids: list[int], job: ExtractJob) -> bool:
    """The connector's file at `path` is this row's finished record, beside its final name (not one
    still being written under a lock: the CUDA path), so renaming it into place is all that is left."""
    if os.path.dirname(path) != str(hs_dir) or os.path.exists(path + ".lock"):
        return False
    try:
        return record_file_problem(path, ids, job.layer_ids, job.hidden_size, job.storage_dtype) is None
    except Exception:  # noqa: BLE001 - unreadable as a record: the general path reads it and says why
        return False


def _load_record(path: str, storage_dtype: str) -> dict:
    """The record of a connector's file in either layout (ours as written, vLLM's converted)."""
    from safetensors import safe_open


    with safe_open(path, framework="pt") as f:
        ours = RECORD_META_KEY in (f.metadata() or {})
    if ours:
        return read_record(Path(path))
    data = _load_file(path)
    return to_record(data["hidden_states"], data["token_ids"], storage_dtype)


def _sketch_dir(job: ExtractJob) -> Path:
    return Path(job.scratch_dir) / "state-sketches"


def _sketches_on(job: ExtractJob) -> bool:
    """The engine's processes (a vLLM plugin) and this one write the state sketch of every request
    (state_sketch.py) into the scratch dir; the fingerprint sidecar carries it. Returns whether it is in place."""

    shutil.rmtree(_sketch_dir(job), ignore_errors=True)
    _sketch_dir(job).mkdir(parents=True)
    os.environ[state_sketch.ENV] = str(_sketch_dir(job))
    os.environ[state_sketch.STORAGE_ENV] = job.storage_dtype
    return state_sketch.install()


def _take_sketch(job: ExtractJob, requested: str, who: str):
    """fp32 [T, L, DIM]: the engine's state sketch of the request that was asked to write `requested`
    (removed once read). Raises when the engine wrote none: the check it feeds could not run."""
    path = _sketch_dir(job) / os.path.basename(requested)
    got = state_sketch.read(str(path))
    if got is None:

        raise EnvironmentProblem(
            f"{who}: the engine wrote no state sketch ({path}): the hook state_sketch.install is not in place in "
            f"vLLM's processes (is the eagle3-pipeline package installed, with its vllm.general_plugins entry "
            f"points, and does this vLLM have what state_sketch.missing() asks?)")
    _remove(str(path))
    return got


def _invariance(engine: _Engine, ds, job: ExtractJob) -> None:
    """Batch invariance with the engine already loaded: a few rows of this group prefilled again alone
    (a batch of one) and compared with the records the batched pass just wrote. Catches what depends
    on a request's place in a batch (offsets that drift between requests, one request's states under
    another's name, stale cache slots) without a second model load. Prints one `invariance` event per
    row with per-layer differences; the verify gate judges them (thresholds live in its config)."""
    rows = [r for s in job.shards for r in s.row_ids()]  # only rows this engine extracted
    seq_lens = [int(x) for x in ds.select(rows)["seq_len"]]
    first_of_shard = {s.row_ids()[0] for s in job.shards if s.row_ids()}
    picks = invariance_rows(seq_lens, job.invariance_rows, avoid={i for i, r in enumerate(rows) if r in first_of_shard})
    for i in picks:
        row = rows[i]
        ids = ds[row]["input_ids"]
        (path,) = engine.prefill([ids], [str(Path(job.scratch_dir) / f"invariance-{row}.safetensors")])
        engine.await_files([path])
        alone = dequantise(_load_record(path, job.storage_dtype))  # [T, L, H]
        _remove(path)
        stored = dequantise(read_record(Path(job.hidden_states_dir) / record_name(row)))  # [T, L, H]
        if tuple(alone.shape) != tuple(stored.shape):
            emit_event(kind="invariance", row=row, error=f"stored {list(stored.shape)}, alone {list(alone.shape)}")
            continue
        emit_event(kind="invariance", row=row, **invariance_entry(stored, alone, job.layer_ids))


def _start_engine(job: ExtractJob, ds, max_len: int) -> _Engine:
    """The extract engine, warmed up, with its hooks proven live in the runner it built (engine/runner.py)."""
    # one request = one whole prompt and one file: no chunked prefill, no prefix cache
    batched = {} if job.max_num_batched_tokens is None else {"max_num_batched_tokens": job.max_num_batched_tokens}
    kv = hidden_states_kv_config(job.connector_module, job.connector_name, job.scratch_dir,
                                 record={"layer_ids": job.layer_ids, "storage_dtype": job.storage_dtype},
                                 locks=not vllm_is_cpu_build())
    scores = FINGERPRINT_ENGINE_KWARGS if job.fingerprints_dir else {}
    hooks: tuple[str, ...] = ()
    records = runner.watch(Path(job.scratch_dir) / "engine-runner")
    if job.fingerprints_dir:  # the engine's processes (vLLM plugin) and this one score prompts without a float32 copy

        os.environ.setdefault(ENV, "1")
        lean = install()
        print(f"extract worker: lean prompt scores {'in place' if lean else 'off: vLLM own path'}, state sketches "
              f"{'in place' if _sketches_on(job) else 'NOT in place'}", flush=True)
        hooks = ("state_sketch", "prompt_scores") if wanted() else ("state_sketch",)
    llm = build_llm(job.engine, job.target, max_model_len=max_len + 1,
                    speculative_config=extract_hidden_states_config(job.layer_ids), kv_transfer_config=kv,
                    max_num_seqs=job.max_num_seqs, enable_chunked_prefill=False, enable_prefix_caching=False,
                    **batched, **scores)
    engine = _Engine(llm, job, nudge_token=int(ds[job.shards[0].row_ids()[0]]["input_ids"][0]))
    warm = engine.warm_up()
    # before the first shard: the hooks ran in the runner instance the engine uses, and it is the expected one
    print(f"extract worker: engine runner {runner.prove(records, hooks, 'extract')}, hooks live: "
          f"{', '.join(hooks) or 'none asked'}", flush=True)
    if job.fingerprints_dir:  # and the sketch hook wrote where the worker reads
        _take_sketch(job, warm, "the warm-up request")
    return engine


def main(argv: list[str]) -> int:
    heap.tune()  # before the imports main makes
    job = ExtractJob.model_validate_json(Path(argv[0]).read_text())
    t_start = time.time()
    # engine.engine_env (in the parent) decided the in-process engine core and the OpenMP settings
    print(f"extract worker: VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}, "
          f"in-process engine core: {os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING') == '0'}", flush=True)


    ds = load_tokenized(job.tokenized_dir)
    for s in job.shards:
        if not 0 <= s.row_start < s.row_end <= len(ds):
            raise ContractError(f"shard {s.index}: rows [{s.row_start}, {s.row_end}) outside the "
                                f"tokenized dataset of {len(ds)} rows ({job.tokenized_dir})")
        if not s.row_ids() or any(not s.row_start <= r < s.row_end for r in s.row_ids()):
            raise ContractError(f"shard {s.index}: rows {s.rows} empty or outside [{s.row_start}, {s.row_end})")
    max_len = max(max(ds.select(s.row_ids())["seq_len"]) for s in job.shards)
    Path(job.scratch_dir).mkdir(parents=True, exist_ok=True)
    Path(job.hidden_states_dir).mkdir(parents=True, exist_ok=True)

    engine = _start_engine(job, ds, int(max_len))
    emit_event(kind="engine_ready", seconds=round(time.time() - t_start, 2))
    durable = _Durable()
    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
    fail = {int(x) for x in os.environ.get(FAIL_SHARDS_ENV, "").split(",") if x.strip()}
    for n, shard in enumerate(job.shards, start=1):
        marker = Path(job.hidden_states_dir).parent / f".fail-shard-{shard.index}"
        if shard.index in fail and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected fault in shard {shard.index} ({FAIL_SHARDS_ENV})")
        _run_shard(engine, ds, job, shard, durable)
        if kill_after and n >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die like an OOM kill, mid-group
    if job.invariance_rows > 0:
        _invariance(engine, ds, job)
    engine.drop_nudge_files()  # any still unwritten go with scratch_dir, which the parent removes
    return 0


if __name__ == "__main__":
    child_main(main)  # every file is written before main returns: no engine teardown (proc.exit_child)
