"""The online trainer's data path: speculators' `ArrowDataset` (rows generated on demand by the vLLM server,
`on_missing: generate`) that fetches the rows of one packed batch concurrently, and the file transfer
that reads the server's files (`ServerFileTransfer`).

speculators fetches a batch's rows one after another (PyTorch calls `dataset[i]` per index), so online every
row waited for its own server round trip, and the server never saw more than one request (docs/training.md,
"Online training"). PyTorch's map-style fetcher calls `__getitems__(indices)`
when a dataset has it; here it sends the batch's rows at once (up to `max_in_flight`), so the server
batches them like an extraction. Imported in the train child only (it imports speculators); a module of
its own so that DataLoader worker processes (spawned) can unpickle the dataset.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hs_connectors.transfer import FP8Transfer
from safetensors.torch import load_file
from speculators.train.data import ArrowDataset


class ConcurrentArrowDataset(ArrowDataset):
    max_in_flight: int = 16

    def __getitems__(self, indices: list[int]) -> list:
        pool = getattr(self, "_eagle3_pool", None)
        if pool is None:  # one per process, made on first use (never pickled)
            pool = self._eagle3_pool = ThreadPoolExecutor(max_workers=self.max_in_flight)
        if self.on_missing == "generate" and self.client is None:
            self._setup_client()  # once, before the threads share the client
        return list(pool.map(self.__getitem__, indices))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_eagle3_pool", None)
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
        from eagle3_pipeline.train.online import await_hidden_states_file

        path = Path(hs_transfer_params.get("hidden_states_path") or hs_transfer_params.get("handle"))
        await_hidden_states_file(path, self.wait_s)
        row = self._dequantize(load_file(path))
        problems = row_problems(row, self.layers, self.hidden_size)
        if problems:
            raise ValueError(f"online row {path.name} from the server fails the per-row checks: " + "; ".join(problems))
        return row


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

    def delete(self, handle: str) -> None:
        Path(handle).unlink(missing_ok=True)
        Path(f"{handle}.lock").unlink(missing_ok=True)
