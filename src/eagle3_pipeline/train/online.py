"""Online training: the target's hidden states come from a vLLM server while the draft trains, and are
never stored for the whole dataset (at Kimi scale a stored record is 56 KiB per token).

More: docs/internals.md, "train/online.py".
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
from pydantic import BaseModel

from eagle3_pipeline.core.config import ExtractConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.ports import free_port
from eagle3_pipeline.core.proc import BackgroundChild
from eagle3_pipeline.core.store import write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.engine import runner, state_sketch
from eagle3_pipeline.engine.build import (
    FINGERPRINT_ENGINE_KWARGS,
    extract_hidden_states_config,
    hidden_states_kv_config,
    server_argv,
    server_env,
)
from eagle3_pipeline.engine.prompt_scores import ENV as LEAN
from eagle3_pipeline.engine.prompt_scores import wanted as lean_wanted
from eagle3_pipeline.records.contracts import (
    FP_TOP,
    ContractError,
    dequantise,
    fingerprint_from_logprobs,
    invariance_entry,
    invariance_rows,
    read_record,
    record_name,
    to_record,
    write_fingerprint,
    write_record,
)
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.results import OnlineResult  # noqa: F401 - the record lives in records/, re-exported

SKETCHES = "state-sketches"  # the server scratch dir's folder of state sketches (state_sketch.py)
RUNNER = "engine-runner"  # the server scratch dir's folder of runner records (engine/runner.py)


def sketch_path(row_file: str | Path) -> Path:
    """Where the server's engine writes the state sketch of the row whose file the connector wrote at `row_file`."""
    return Path(row_file).parent / SKETCHES / Path(row_file).name


class OnlineServerFailed(EnvironmentProblem):
    """The online-training server did not come up (died, or not ready by its deadline); the message
    carries the tail of its log."""


class PortTaken(OnlineServerFailed):
    """The server's port was free when picked and taken by another process before the server bound it (the
    server imports vLLM in between, seconds on a busy node): started again on another, `PORT_TRIES` in all."""


PORT_TRIES = 3
ADDRESS_IN_USE = "[Errno 98] Address already in use"
SERVER_LOG = "server.log"  # the start in progress; one whose port was taken is kept as server.port-N-taken.log


class OnlineRequestFailed(EnvironmentProblem):
    """The server answered a row's request with an HTTP error (its engine failed on the request, or
    died): the message names the row's length, the status and the server's own error text."""


def _dir_bytes(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass  # read and deleted between listing and stat
    except FileNotFoundError:
        return 0
    return total


class _PeakSampler(threading.Thread):
    """Samples a directory's size every `every_s` seconds; `peak` is the largest seen."""

    def __init__(self, path: Path, every_s: float = 0.05):
        super().__init__(daemon=True)
        self.path, self.every_s, self.peak = path, every_s, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _dir_bytes(self.path))
            self._stop_event.wait(self.every_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=5)
        self.peak = max(self.peak, _dir_bytes(self.path))
        return self.peak


class HiddenStateServer:
    """`with HiddenStateServer(...) as srv:` a running server; `srv.endpoint` (…/v1) and `srv.model` are
    what a client (speculators' loader, `take_sample`) needs."""

    def __init__(self, extract_cfg: ExtractConfig, target: TargetConfig, version: ExtractVersion, work_dir: Path, *,
                 max_model_len: int, start_timeout_s: float, log: Callable[[str], None] = print):
        self.cfg, self.target, self.version = extract_cfg, target, version
        self.work_dir = Path(work_dir)
        self.scratch = self.work_dir / "server_hidden_states"
        self.max_model_len, self.start_timeout_s, self.log = max_model_len, start_timeout_s, log
        self.port = 0
        self.start_s = 0.0
        self.child: BackgroundChild | None = None
        self.sampler: _PeakSampler | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def model(self) -> str:
        return self.target.model  # the served model name (engine.server_argv)

    def __enter__(self) -> HiddenStateServer:
        for attempt in range(1, PORT_TRIES):
            try:
                return self._start()
            except PortTaken:
                kept = (self.work_dir / SERVER_LOG).rename(self.work_dir / f"server.port-{self.port}-taken.log")
                self.log(f"online: port {self.port} was taken by another process before the server bound it (log "
                         f"{kept}); starting again on another port (try {attempt + 1} of {PORT_TRIES})")
        return self._start()

    def _start(self) -> HiddenStateServer:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        cfg = self.cfg
        self.port = free_port()
        batched = {} if cfg.max_num_batched_tokens is None else {"max_num_batched_tokens": cfg.max_num_batched_tokens}
        argv = server_argv(cfg, self.target, max_model_len=self.max_model_len, port=self.port,
                           speculative_config=extract_hidden_states_config(self.version.layer_ids),
                           kv_transfer_config=hidden_states_kv_config(cfg.connector_module, cfg.connector_name,
                                                                      str(self.scratch)),
                           max_num_seqs=cfg.max_num_seqs, enable_chunked_prefill=False, enable_prefix_caching=False,
                           **batched, **FINGERPRINT_ENGINE_KWARGS)
        log_path = self.work_dir / SERVER_LOG
        self.log(f"online: starting a vLLM server of {self.target.model} on 127.0.0.1:{self.port} (layers "
                 f"{self.version.layer_ids}, max_num_seqs {cfg.max_num_seqs}, log {log_path})")
        t0 = time.time()

        # every row's fingerprint scores: the lean path in the server's engine (prompt_scores.py, a vLLM plugin)
        # and every row's state sketch (state_sketch.py, a vLLM plugin): files beside the connector's, which
        # request_row reads (bf16: the rows reach the trainer in bf16)
        env = server_env(cfg) | {LEAN: os.environ.get(LEAN, "1"), state_sketch.ENV: str(self.scratch / SKETCHES),
                                 state_sketch.STORAGE_ENV: "bf16", runner.RECORD_ENV: str(self.scratch / RUNNER)}
        self.child = BackgroundChild(argv, name="online-server", log_path=log_path, env=env).__enter__()
        try:
            self._wait_ready()
            hooks = ("state_sketch", "prompt_scores") if lean_wanted(env[LEAN]) else ("state_sketch",)
            self.log(f"online: server runner {self._prove(hooks)}, hooks live: {', '.join(hooks)}")
        except BaseException:
            self.__exit__(None, None, None)  # the server's group and its scratch dir go with the failure
            raise
        self.start_s = round(time.time() - t0, 2)
        self.log(f"online: server ready in {self.start_s:.1f}s at {self.endpoint} (processes: "
                 f"{', '.join(self.processes())})")
        self.sampler = _PeakSampler(self.scratch)
        self.sampler.start()
        return self

    def processes(self) -> list[str]:
        """The server's processes now, named: "API server", then each descendant by the title vLLM gives it
        (VLLM::EngineCore, VLLM::Worker...) or what it runs (multiprocessing's resource tracker)."""
        assert self.child is not None and self.child.proc is not None
        names = []
        try:
            for p in psutil.Process(self.child.proc.pid).children(recursive=True):
                cmd = p.cmdline()
                names.append("resource tracker" if "resource_tracker" in " ".join(cmd)
                             else cmd[0].strip() if cmd and cmd[0].startswith("VLLM::") else p.name())
        except psutil.Error:
            pass
        return ["API server", *sorted(names)]

    def _wait_ready(self) -> None:
        assert self.child is not None
        deadline = time.time() + self.start_timeout_s
        while True:
            if not self.child.alive():
                why = self.child.describe_exit()
                taken = f"first error in the log: OSError: {ADDRESS_IN_USE}" in why
                raise (PortTaken if taken else OnlineServerFailed)(
                    f"online: the vLLM server died while starting{f' (port {self.port} taken)' if taken else ''}: "
                    f"{why}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/models", timeout=2) as r:
                    served = [m["id"] for m in json.loads(r.read())["data"]]
                if self.model not in served:
                    raise OnlineServerFailed(f"online: the server on port {self.port} serves {served}, not "
                                             f"{self.model} (another process on that port?)")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.time() > deadline:
                raise OnlineServerFailed(f"online: the vLLM server was not ready after train.online_start_timeout_s="
                                         f"{self.start_timeout_s:.0f}s; last output:\n" + "\n".join(self.child.tail))
            time.sleep(0.5)

    def _prove(self, hooks: tuple[str, ...]) -> str:
        """One two-token row through the server before any training row: the runner its engine built is the
        expected one (V1 where vLLM has it) and every hook of `hooks` ran in it (engine/runner.py)."""
        path, _ = request_row(self.endpoint, self.model, [0, 0], timeout_s=self.start_timeout_s)
        Path(path).unlink(missing_ok=True)
        sketch_path(path).unlink(missing_ok=True)
        return runner.prove(self.scratch / RUNNER, hooks, "online server")

    def scratch_peak(self) -> int:
        return self.sampler.peak if self.sampler else 0

    def __exit__(self, *exc) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.child is not None:
            self.child.__exit__(*exc)
        shutil.rmtree(self.scratch, ignore_errors=True)

    # ------------------------------------------------------------ one row, the way the sample is taken

    def hidden_states(self, ids: list[int], timeout_s: float, *, fingerprint: bool = True) -> tuple[dict, dict | None]:
        """({hidden_states [T, L, H], token_ids [T]}, fingerprint tensors or None) of one row, read from the
        server (the same request speculators' loader sends, plus top-2 logprobs), its file removed."""
        import torch
        from safetensors.torch import load_file

        try:
            path, fp = request_row(self.endpoint, self.model, ids, timeout_s, fingerprint=fingerprint)
        except OnlineRequestFailed as e:
            alive = "running" if self.child is not None and self.child.alive() else "exited"
            tail = "\n".join(list(self.child.tail)[-20:]) if self.child is not None else ""  # tail: a deque
            raise OnlineRequestFailed(f"{e} (the server is {alive}; its log: {self.work_dir / 'server.log'}, "
                                      f"last lines:\n{tail})") from e
        data = load_file(path)
        Path(path).unlink(missing_ok=True)
        data["token_ids"] = data["token_ids"].to(torch.int64)
        return data, fp


def request_row(endpoint: str, model: str, ids: list[int], timeout_s: float, *,
                fingerprint: bool = True) -> tuple[Path, dict | None]:
    """Ask the server for one row's hidden states: (the file its connector wrote, once written; the row's
    fingerprint tensors from the response's top-2 prompt logprobs, or None). The online sample and every
    row the online trainer reads (train/online_data.py) are asked for this way."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
    if fingerprint:
        body |= {"prompt_logprobs": FP_TOP, "logprobs": FP_TOP, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"{endpoint}/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise OnlineRequestFailed(f"online: the server at {endpoint} answered HTTP {e.code} ({e.reason}) to a row "
                                  f"of {len(ids)} tokens: {_error_text(e)}") from e
    choice = out["choices"][0]
    if choice.get("prompt_token_ids") not in (None, ids):
        raise ContractError(f"online: the server tokenized the row differently ({len(choice['prompt_token_ids'])} "
                            f"token ids back for {len(ids)} sent)")
    path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise ContractError(f"online: the server returned no hidden_states_path (kv_transfer_params="
                            f"{out.get('kv_transfer_params')!r}); is the extract_hidden_states method active?")
    await_hidden_states_file(Path(path), timeout_s)
    fp = None
    sketch = state_sketch.read(str(sketch_path(path)))  # written in the step that computed the prompt
    sketch_path(path).unlink(missing_ok=True)
    if fingerprint:
        fp = fingerprint_from_logprobs(_prompt_logprobs(choice.get("prompt_logprobs") or [None]),
                                       _last_logprobs(choice.get("logprobs")), len(ids))
        if sketch is not None:
            fp[state_sketch.KEY] = sketch
    return Path(path), fp


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's own error message from an HTTP error's body (vLLM: {"error": {"message": ...}}), or
    the body's start."""
    try:
        body = e.read().decode("utf-8", "replace")
    except OSError:
        return "(no body)"
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message") or err) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body[:2000] or "(an empty body)"


def await_hidden_states_file(path: Path, timeout_s: float) -> None:
    """Wait until the connector has written `path` (it holds `<path>.lock` while writing), then drop the lock."""
    lock = Path(f"{path}.lock")
    deadline = time.time() + timeout_s
    while True:
        if lock.exists():
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = False
            except BlockingIOError:
                locked = True
            finally:
                os.close(fd)
            if not locked and path.exists():
                lock.unlink(missing_ok=True)
                return
        elif path.exists():
            return
        if time.time() > deadline:
            raise TimeoutError(f"online: hidden-state file {path} not written by the server within {timeout_s:.0f}s")
        time.sleep(0.01)


def _prompt_logprobs(entries: list) -> list:
    """The server's JSON prompt logprobs ({"<id>": {"logprob", "rank"}} per position) as the objects
    `contracts.fingerprint_from_logprobs` reads (vLLM's in-process form)."""
    return [None if e is None else {int(k): SimpleNamespace(rank=v.get("rank"), logprob=v["logprob"])
                                    for k, v in e.items()} for e in entries]


def _last_logprobs(lp: dict | None) -> dict | None:
    """The generated token's top logprobs ("token_id:<id>" -> logprob with return_tokens_as_token_ids),
    ranked by logprob."""
    top = ((lp or {}).get("top_logprobs") or [None])[0]
    if not top:
        return None
    ranked = sorted(((int(k.split(":", 1)[1]), v) for k, v in top.items()), key=lambda kv: -kv[1])
    return {tid: SimpleNamespace(rank=i + 1, logprob=v) for i, (tid, v) in enumerate(ranked)}


# ---------------------------------------------------------------- the sample the gate checks

def sample_rows(n_rows: int, count: int) -> list[int]:
    """`count` rows spread evenly over the dataset (first and last included), deterministic."""
    if count >= n_rows:
        return list(range(n_rows))
    if count == 1:
        return [0]
    return sorted({round(i * (n_rows - 1) / (count - 1)) for i in range(count)})


def sample_version(version: ExtractVersion, work_dir: Path) -> ExtractVersion:
    """An extraction-shaped directory for the sample (records, fingerprints, manifest, verify.json):
    the version's identity, dims and layers, its own directory, no record pool."""
    return version.model_copy(update={"dir": str((Path(work_dir) / "sample").resolve()), "pool_dir": None})


class OnlineSample(BaseModel):
    """The rows `take_sample` took from the server, written as records of a sample version."""
    version: ExtractVersion  # the sample's extraction-shaped directory (sample_version)
    rows: list[int]
    tokens: int
    seconds: float
    bytes: int  # records and fingerprints kept on disk


def take_sample(srv: HiddenStateServer, cfg: PipelineConfig, version: ExtractVersion, work_dir: Path,
                log: Callable[[str], None] = print) -> OnlineSample:
    """Take `verify.online_rows` rows from the running server (concurrently, as training will), a few of
    them again alone (`extract.invariance_rows`: batch invariance) and write them as records of a sample
    version, for the verify gate to check."""
    request_timeout_s = cfg.train.online_request_timeout_s
    t0 = time.time()
    sv = sample_version(version, work_dir)
    shutil.rmtree(sv.path, ignore_errors=True)
    sv.hidden_states_dir.mkdir(parents=True)
    sv.fingerprints_dir.mkdir(parents=True)
    ds = load_tokenized(version.tokenized_dir)
    rows = sample_rows(len(ds), cfg.verify.online_rows)
    sel = ds.select(rows)
    ids_of = dict(zip(rows, sel["input_ids"]))
    L, H = len(version.layer_ids), version.dims.hidden_size

    def take(row: int) -> int:
        ids = [int(x) for x in ids_of[row]]
        data, fp = srv.hidden_states(ids, request_timeout_s)
        hs, tok = data["hidden_states"], data["token_ids"]
        if tok.tolist() != ids:
            raise ContractError(f"online sample {record_name(row)} (row {row}): the server's token_ids differ from "
                                f"the tokenized row ([{len(tok)}] vs [{len(ids)}])")
        if tuple(hs.shape) != (len(ids), L, H):
            raise ContractError(f"online sample {record_name(row)} (row {row}): layers {version.layer_ids}: hidden_states "
                                f"expected {[len(ids), L, H]}, found {list(hs.shape)}")
        write_record(sv.record_path(row), to_record(hs, tok, sv.storage_dtype), sv.layer_ids, sv.storage_dtype)
        if sv.storage_dtype != "bf16":  # the server's sketches are of bf16 rows (the trainer's)
            fp.pop(state_sketch.KEY, None)
        write_fingerprint(sv.fingerprint_path(row), fp)
        return len(ids)

    with ThreadPoolExecutor(max_workers=max(1, min(srv.cfg.max_num_seqs, 16))) as pool:
        tokens = sum(pool.map(take, rows))
    # batch invariance: a few rows again, alone, compared with what the concurrent pass wrote
    inv: dict[str, dict] = {}
    seq_lens = [len(ids_of[r]) for r in rows]
    for i in invariance_rows(seq_lens, cfg.extract.invariance_rows):
        row = rows[i]
        data, _ = srv.hidden_states([int(x) for x in ids_of[row]], request_timeout_s, fingerprint=False)
        alone = dequantise(to_record(data["hidden_states"], data["token_ids"], sv.storage_dtype))
        stored = dequantise(read_record(sv.record_path(row)))
        if tuple(alone.shape) != tuple(stored.shape):
            inv[str(row)] = {"error": f"stored {list(stored.shape)}, alone {list(alone.shape)}"}
            continue
        inv[str(row)] = invariance_entry(stored, alone, sv.layer_ids)
    extract_cfg = {"fingerprints": True, "invariance_rows": cfg.extract.invariance_rows}
    write_json(sv.manifest_path, {"content_key": sv.content_key, "online_sample": True, "shards": [],
                                  "config": {"extract": extract_cfg, "state_sketch": sv.storage_dtype == "bf16"},
                                  "invariance": inv, "rows": rows,
                                  "endpoint": srv.endpoint})
    seconds = round(time.time() - t0, 2)
    nbytes = _dir_bytes(sv.hidden_states_dir) + _dir_bytes(sv.fingerprints_dir)
    log(f"online: {len(rows)} rows ({tokens} tokens) taken from the server in {seconds:.1f}s for the verify gate "
        f"({nbytes / 1e6:.1f} MB kept in {sv.path})")
    return OnlineSample(version=sv, rows=rows, tokens=tokens, seconds=seconds, bytes=nbytes)
