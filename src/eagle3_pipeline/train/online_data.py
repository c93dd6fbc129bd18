"""The online trainer's data path: speculators' `ArrowDataset` (rows generated on demand by the vLLM server,
`on_missing: generate`) that fetches the rows of one packed batch concurrently, and the file transfer
that reads the server's files (`ServerFileTransfer`).

More: docs/internals.md, "train/online_data.py".
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import load_file
from speculators.train.data import ArrowDataset
from speculators.train.recovery import SampleUnavailable

from eagle3_pipeline.checks.final_layer import FinalLayerCheck
from eagle3_pipeline.checks.layer_identity import problems_of, row_features
from eagle3_pipeline.engine import state_sketch as sk
from eagle3_pipeline.records.contracts import record_name, to_record, write_record
from eagle3_pipeline.train.job import RowChecksSpec
from eagle3_pipeline.train.online import await_hidden_states_file, request_row, sketch_path

FLAGGED = "flagged by the layer profiles, held for confirmation: "
_current = threading.local()  # the dataset index whose row this thread is asking for


class RowRejected(RuntimeError):
    """A row the server sent failed a check against the target itself, on every attempt: training stops."""


class ConcurrentArrowDataset(ArrowDataset):
    max_in_flight: int = 16
    checks_spec: RowChecksSpec | None = None  # every row judged against the target (set by train/worker.py)

    @property
    def row_checks(self) -> RowChecks | None:
        """The checks, built once per process from `checks_spec` (DataLoader workers get the spec, not the weights)."""
        if self.checks_spec is None:
            return None
        rc = getattr(self, "_eagle3_checks", None)
        if rc is None:
            rc = self._eagle3_checks = RowChecks(self.checks_spec)
        return rc

    def _get_raw_data(self, index: int):
        checks = self.row_checks
        if checks is None:
            return super()._get_raw_data(index)
        row = _current.index = int(self._map_to_file_idx(index))  # the tokenized dataset's row
        out = super()._get_raw_data(index)
        if isinstance(out, SampleUnavailable):
            why = checks.rejected.get(row)
            if why:  # the target disagreed on every attempt: never train around it
                raise RowRejected(f"online row {row} failed the per-row checks on every attempt: {why} "
                                  f"(every rejected row: {checks.spec.rejected_path})")
            if not out.reason.startswith(FLAGGED):  # flagged rows are in flagged_path already
                checks.note(row, "unavailable", out.reason)
        return out

    def _generate_hidden_states_once(self, dataset_item: dict, client_item) -> dict:
        """One row from the server, asked for with its top-2 prompt logprobs, judged before training sees it
        (RowChecks); a row only the learned profiles flag is kept out of training (SampleUnavailable)."""
        if self.row_checks is None:
            return super()._generate_hidden_states_once(dataset_item, client_item)

        if not self.client:
            self._setup_client()
        ids = dataset_item["input_ids"].tolist()
        path, fp = request_row(self.vllm_endpoint, self.model, ids, self.request_timeout)
        try:
            row = self.transfer.get_generated({"hidden_states_path": str(path)})
        except ValueError as e:  # the row's structure (ServerFileTransfer): as wrong as a disagreeing fingerprint
            self.row_checks.reject(_current.index, str(e))
            raise
        finally:
            self.transfer.delete(str(path))
        if row["token_ids"].tolist() != ids:
            why = f"online row {_current.index}: the server's token ids differ from the tokenized row"
            self.row_checks.reject(_current.index, why)
            raise ValueError(why)
        return self.row_checks.judge(_current.index, row, fp)

    def __getitems__(self, indices: list[int]) -> list:
        pool = getattr(self, "_eagle3_pool", None)
        if pool is None:  # one per process, made on first use (never pickled)
            pool = self._eagle3_pool = ThreadPoolExecutor(max_workers=self.max_in_flight)
        if self.on_missing == "generate" and self.client is None:
            self._setup_client()  # once, before the threads share the client
        _ = self.row_checks  # loaded once, before the threads share it
        return list(pool.map(self.__getitem__, indices))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_eagle3_pool", None)
        state.pop("_eagle3_checks", None)
        return state


class ServerFileTransfer(FP8Transfer):
    """hs_connectors' file transfer for the online server's files, waiting for a file as long as a request
    may take (`wait_s`, train.online_request_timeout_s) instead of its fixed 10 s lock wait, which a busy
    machine exceeded (each time the row was generated again), and removing the connector's `.lock` too.
    Every row the server sends is checked before the trainer sees it (`row_problems`: layers and hidden
    size, finite values, no all-zero token or layer, no two identical layers); a bad row raises, naming
    the file, and the trainer's generation recovery asks for it again, then stops."""

    def __init__(self, hidden_states_path: Path, wait_s: float, layers: int | None = None,
                 hidden_size: int | None = None):
        super().__init__(hidden_states_path, torch.bfloat16)
        self.wait_s, self.layers, self.hidden_size = wait_s, layers, hidden_size

    def get_generated(self, hs_transfer_params: dict) -> dict | None:
        path = Path(hs_transfer_params.get("hidden_states_path") or hs_transfer_params.get("handle"))
        await_hidden_states_file(path, self.wait_s)
        row = self._dequantize(load_file(path))
        problems = row_problems(row, self.layers, self.hidden_size)
        if problems:
            raise ValueError(f"online row {path.name} from the server fails the per-row checks: " + "; ".join(problems))
        return row

    def delete(self, handle: str) -> None:
        Path(handle).unlink(missing_ok=True)
        Path(f"{handle}.lock").unlink(missing_ok=True)
        sketch_path(handle).unlink(missing_ok=True)  # its state sketch, if unread


def row_problems(row: dict, layers: int | None, hidden_size: int | None) -> list[str]:
    """What is wrong with one row from the server ({"hidden_states": [T, L, H], "token_ids": [T]}): the
    per-record checks of verify/structure.py that need no other record."""
    hs, ids = row.get("hidden_states"), row.get("token_ids")
    if hs is None or ids is None:
        return [f"keys {sorted(row)}, expected hidden_states and token_ids"]
    want = (len(ids), layers or hs.shape[1] if hs.dim() == 3 else -1, hidden_size or hs.shape[-1])
    if hs.dim() != 3 or tuple(hs.shape) != want:
        return [f"hidden_states expected [T, L, H] = {list(want)}, found {list(hs.shape)}"]
    x = hs.float()
    out = []
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        out.append(f"non-finite values (first at token {bad[0]}, layer slot {bad[1]})")
    norms = x.norm(dim=-1)  # [T, L]
    if (norms == 0).any():
        t, slot = (norms == 0).nonzero()[0].tolist()
        out.append(f"token {t} is all zeros in layer slot {slot}")
    for a in range(x.shape[1]):
        for b in range(a + 1, x.shape[1]):
            if torch.equal(x[:, a], x[:, b]):
                out.append(f"layer slots {a} and {b} are identical")
    return out


def _sketch_problem(name: str, hs, fp: dict) -> str | None:
    """Every state of the row (bf16, as the trainer reads it) against the server engine's sketch of the states
    it computed (state_sketch.py): where they differ, or that the response had no sketch."""
    got = fp.get(sk.KEY)
    if got is None:
        return f"{name}: the server wrote no state sketch for it (is the state_sketch plugin in its vLLM?)"
    x = sk.stored(hs, "bf16")
    if tuple(got.shape) != (*x.shape[:2], sk.DIM):
        return f"{name}: state sketch [{', '.join(map(str, got.shape))}] for hidden states {list(x.shape)}"
    dev = sk.deviation(sk.project(x, x.shape[-1]), got.float(), x.norm(dim=-1)) / sk.TOLERANCE  # [T, L]
    bad = (dev > 1).nonzero().tolist()
    if not bad:
        return None
    return (f"{name}: states differ from the ones the target computed at {len(bad)} token-layer pairs (first: "
            f"position {bad[0][0]}, layer slot {bad[0][1]}; largest deviation {float(dev.max()):.3g}x the tolerance)")


class RowChecks:
    """Every row the server sends, judged like a verified record before the trainer sees it: the final
    layer against the target's own logits on every token (final_layer.py, the fingerprint the response
    carries) and the aux layers against the layer profiles the verify gate learned from the sample
    (layer_identity.py). A fingerprint disagreement raises (speculators asks for the row again, and the
    dataset stops training when every attempt failed); a row only the profiles flag is written for the
    stage to confirm with the target (online_training.train_online) and kept out of training."""

    def __init__(self, spec: RowChecksSpec):

        self.spec = spec
        self.final = FinalLayerCheck(spec.model_dir, spec.norm_eps, spec.atol, spec.rtol, spec.slack, spec.stol) \
            if spec.fingerprint else None
        prof = spec.identity
        self.med = None if not prof else np.asarray(prof["median"], dtype=np.float64)
        self.scale = None if not prof else np.asarray(prof["scale"], dtype=np.float64)
        self.rejected: dict[int, str] = {}
        self.lock = threading.Lock()

    def _fingerprint_problem(self, name: str, hs, fp: dict) -> str | None:
        """Every token's final layer against the target's logits in the response; every token must be scored."""
        agree, n, bad, _ = self.final.agreement_many([(hs[:, -1].float(), fp)])[0]
        T = hs.shape[0]
        if not n:
            return f"{name}: no token had a usable fingerprint"
        if n < T:
            return f"{name}: its fingerprint scores {n} of {T} tokens: every token's final layer must be checked"
        if agree < 1.0:
            return (f"{name}: final layer disagrees with the target's logits at {round((1 - agree) * n)} of {n} tokens "
                    f"(positions {bad})")
        return None

    def note(self, index: int, kind: str, why: str, path: str | None = None) -> None:
        line = json.dumps({"row": int(index), "kind": kind, "why": why, "pid": os.getpid()}) + "\n"
        with self.lock, open(path or self.spec.rejected_path, "a") as f:
            f.write(line)

    def reject(self, index: int, why: str) -> None:
        self.rejected[index] = why
        self.note(index, "rejected", why)

    def judge(self, index: int, row: dict, fp: dict | None) -> dict:
        hs = row["hidden_states"]  # [T, L, H]
        name = f"online row {index} ({len(row['token_ids'])} tokens)"
        if fp is None and self.final is not None:
            why = f"{name}: the server's response carried no prompt logprobs (no fingerprint)"
        else:
            why = self._fingerprint_problem(name, hs, fp) if self.final is not None else None
        if why is None and self.spec.sketch:
            why = _sketch_problem(name, hs, fp or {})
        if why:
            self.reject(index, why)
            raise ValueError(why)
        if self.rejected.pop(index, None) is not None:  # wrong before, right when asked again: not a rejected row
            self.note(index, "passed", "passed when asked again")
        if self.med is None:
            return row
        found, _ = problems_of(row_features(hs)[None], self.med, self.scale, self.spec.layer_ids,
                               float(self.spec.identity["max_z"]))
        if found:
            why = f"{name}: {found[0][1]}"
            dest = Path(self.spec.flagged_dir) / record_name(index)
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_record(dest, to_record(hs, row["token_ids"], self.spec.storage_dtype), self.spec.layer_ids,
                         self.spec.storage_dtype)
            self.note(index, "flagged", why, self.spec.flagged_path)
            return SampleUnavailable(reason=FLAGGED + why)
        return row
