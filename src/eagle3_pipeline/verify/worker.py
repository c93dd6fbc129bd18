"""The reference child: `python -m eagle3_pipeline.verify.worker JOB.json`.

How it works, what it reads and writes, its test hooks: docs/internals.md, `verify/worker.py`.
"""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import shutil
import struct
import sys
import time
import traceback
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import TargetConfig
from eagle3_pipeline.core.proc import emit_event
from eagle3_pipeline.core.store import write_json
from eagle3_pipeline.records.families import known_model_type, layer_config, text_config

# what a fork server imports before forking this worker (core/forkserver.py): torch and transformers' models
FORK_PRELOAD = ("torch", "safetensors.torch", "transformers", "transformers.models.llama.modeling_llama",
                "transformers.models.qwen3.modeling_qwen3")

BUDGET_EXIT = 3
HS_FILE, RESULT_FILE = "reference.safetensors", "result.json"
_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_FLOAT = {"BF16", "F16", "F32", "F64"}
_COPY_CHUNK = 64 << 20


class ReferenceSample(BaseModel):
    model_config = ConfigDict(extra="forbid")
    row: int
    token_ids: list[int]


class ReferenceJob(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: TargetConfig
    layer_ids: list[int]            # captured ids, ascending (id k = residual stream after k layers)
    samples: list[ReferenceSample]
    memory_budget_bytes: int
    out_dir: str


class ReferenceOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rows: list[int] = []
    hidden_states_path: str | None = None   # safetensors, `row_{i}`: [T, L, H] in the model dtype
    dtype: str | None = None
    peak_rss_bytes: int | None = None
    baseline_rss_bytes: int | None = None   # after imports, before any layer
    max_layer_bytes: int | None = None      # the largest layer's weights in the checkpoint
    layers_run: int = 0
    layer_seconds: list[float] = []
    seconds: float | None = None
    skipped: str | None = None
    error: str | None = None


class BudgetExceeded(RuntimeError):
    """Peak RSS past the memory budget (or one layer alone larger than it)."""


class CannotStream(RuntimeError):
    """The checkpoint cannot be streamed here (no safetensors, unknown layout or architecture)."""


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---------------------------------------------------------------- the checkpoint, read by byte ranges

class Checkpoint:
    """The safetensors of a model directory, read without loading: header entries and byte ranges."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            self.weight_map = {k: "model.safetensors" for k in self._header("model.safetensors")[0]}
        else:
            found = sorted(p.name for p in self.dir.iterdir())[:10] if self.dir.is_dir() else "no such directory"
            raise CannotStream(f"{self.dir}: no model.safetensors or model.safetensors.index.json (found {found})")
        self._headers: dict[str, tuple[dict, int]] = {}

    def _header(self, file: str) -> tuple[dict, int]:
        """({name: {dtype, shape, data_offsets}}, byte offset where the data starts) of one file."""
        with open(self.dir / file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n))
        head.pop("__metadata__", None)
        return head, 8 + n

    def info(self, name: str) -> tuple[str, dict, int]:
        """(file, header entry, data start) of tensor `name`."""
        file = self.weight_map[name]
        if file not in self._headers:
            self._headers[file] = self._header(file)
        head, start = self._headers[file]
        if name not in head:
            raise CannotStream(f"{self.dir / file}: the index names {name} but the file does not hold it")
        return file, head[name], start

    def nbytes(self, name: str) -> int:
        b, e = self.info(name)[1]["data_offsets"]
        return e - b

    def text_prefix(self, num_layers: int) -> str:
        """The name prefix of the decoder layers: `model.` for a CausalLM, `language_model.model.` for
        Kimi-K2.5. The prefix whose layers 0..N-1 all exist, preferring one next to `embed_tokens.weight`."""
        found: dict[str, set[int]] = {}
        for name in self.weight_map:
            m = re.match(r"^(.*?)layers\.(\d+)\.", name)
            if m:
                found.setdefault(m.group(1), set()).add(int(m.group(2)))
        full = [p for p, ids in found.items() if set(range(num_layers)) <= ids]
        full.sort(key=lambda p: (p + "embed_tokens.weight" not in self.weight_map, len(p)))
        if not full:
            raise CannotStream(f"{self.dir}: no weight prefix holds decoder layers 0..{num_layers - 1} "
                               f"(prefixes with layers: { {p: len(i) for p, i in found.items()} })")
        return full[0]

    def layer_names(self, prefix: str, k: int) -> list[str]:
        start = f"{prefix}layers.{k}."
        return sorted(n for n in self.weight_map if n.startswith(start))

    def write_renamed(self, names: dict[str, str], out: Path) -> int:
        """Write the tensors `names` (source -> new name) into one safetensors file `out`, copying raw
        bytes in chunks; return the bytes written. No tensor is materialised."""
        header, offset, plan = {}, 0, []
        for src, dst in names.items():
            file, entry, start = self.info(src)
            b, e = entry["data_offsets"]
            header[dst] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + e - b]}
            plan.append((file, start + b, e - b))
            offset += e - b
        raw = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out, "wb") as w:
            w.write(struct.pack("<Q", len(raw)))
            w.write(raw)
            for file, pos, size in plan:
                with open(self.dir / file, "rb") as r:
                    r.seek(pos)
                    while size > 0:
                        chunk = r.read(min(size, _COPY_CHUNK))
                        if not chunk:
                            raise CannotStream(f"{self.dir / file}: truncated at byte {pos}")
                        w.write(chunk)
                        size -= len(chunk)
        return offset

    def rows(self, name: str, ids: list[int]):
        """Rows `ids` of the 2-D tensor `name` (an embedding) [len(ids), H], read by byte offset."""
        import torch

        file, entry, start = self.info(name)
        dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
        if entry["dtype"] not in dtypes or len(entry["shape"]) != 2:
            raise CannotStream(f"{name}: embedding stored as {entry['dtype']} {entry['shape']}; expected a 2-D float tensor")
        V, H = entry["shape"]
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the embedding's {V} rows")
        size = _ST_BYTES[entry["dtype"]] * H
        base = start + entry["data_offsets"][0]
        buf = bytearray()
        with open(self.dir / file, "rb") as f:
            for t in ids:
                f.seek(base + t * size)
                buf += f.read(size)
        return torch.frombuffer(buf, dtype=dtypes[entry["dtype"]]).reshape(len(ids), H).clone()  # [T, H]


# ---------------------------------------------------------------- the run

def _decoder_layers(model):
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner, inner.layers
    dec = model.get_decoder()
    return dec, dec.layers


def run(job: ReferenceJob, log=print) -> ReferenceOutput:
    import torch
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.time()
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target, budget = job.target, job.memory_budget_bytes
    dtype = getattr(torch, target.dtype)
    model_dir = Path(target.model)
    try:
        ckpt, prefix, text = _open_checkpoint(job)
    except CannotStream as e:
        return ReferenceOutput(skipped=str(e), seconds=round(time.time() - t0, 2))
    n, depth = int(text["num_hidden_layers"]), max(job.layer_ids)
    # h_0: the embedding rows, in the model dtype (as the model would compute them)
    hs = [ckpt.rows(prefix + "embed_tokens.weight", s.token_ids).to(dtype) for s in job.samples]  # each [T, H]
    captured: dict[int, list] = {0: [h.clone() for h in hs]} if 0 in job.layer_ids else {}
    baseline = peak_rss_bytes()
    log(f"reference: {len(job.samples)} samples, {depth} of {n} layers streamed from {model_dir} (prefix "
        f"{prefix!r}) in {target.dtype}; memory budget {_gib(budget)}, RSS before the first layer {_gib(baseline)}")
    remote_code = [p for p in model_dir.glob("*.py")] if target.trust_remote_code else []
    layer_dir = out_dir / "layer"
    layer_seconds, max_layer = [], 0
    for k in range(depth):
        tk = time.time()
        names = ckpt.layer_names(prefix, k)
        size, in_dtype = _layer_bytes(ckpt, names, dtype)
        max_layer = max(max_layer, size)
        if baseline + in_dtype > budget:
            raise BudgetExceeded(f"verify reference: layer {k} alone needs {_gib(in_dtype)} in {target.dtype} "
                                 f"on top of {_gib(baseline)} RSS, more than the memory budget "
                                 f"verify.reference_memory_gb = {_gib(budget)}")
        cfg = _write_layer(ckpt, prefix, k, text, layer_dir, remote_code)
        skipped = _through_layer(layer_dir, cfg, hs, target, k, budget)
        if skipped is not None:
            return ReferenceOutput(skipped=skipped, seconds=round(time.time() - t0, 2))
        if k + 1 in job.layer_ids:
            captured[k + 1] = [h.clone() for h in hs]
        layer_seconds.append(round(time.time() - tk, 3))
        log(f"reference: layer {k} ({len(names)} tensors, {_gib(size)} on disk) in {layer_seconds[-1]:.2f}s, "
            f"peak RSS {_gib(peak_rss_bytes())}")
    shutil.rmtree(layer_dir, ignore_errors=True)
    # [T, L, H] per row, layers in ascending id order
    tensors = {f"row_{s.row}": torch.stack([captured[lid][i] for lid in job.layer_ids], dim=1).contiguous()
               for i, s in enumerate(job.samples)}
    save_file(tensors, str(out_dir / HS_FILE))
    return ReferenceOutput(rows=[s.row for s in job.samples], hidden_states_path=str(out_dir / HS_FILE),
                           dtype=target.dtype, peak_rss_bytes=peak_rss_bytes(), baseline_rss_bytes=baseline,
                           max_layer_bytes=max_layer, layers_run=depth, layer_seconds=layer_seconds,
                           seconds=round(time.time() - t0, 2))


def _open_checkpoint(job: ReferenceJob) -> tuple[Checkpoint, str, dict]:
    """(the target's checkpoint, the weight prefix of its decoder layers, its text config). CannotStream where
    it cannot be streamed (the reference is skipped then), ValueError for layer ids outside the model."""
    model_dir = Path(job.target.model)
    if not (model_dir / "config.json").is_file():
        raise CannotStream(f"{job.target.model} is not a local model directory with a config.json (the "
                           "reference streams local safetensors; download the model first)")
    text = text_config(json.loads((model_dir / "config.json").read_text()))
    n = int(text["num_hidden_layers"])
    if not 0 <= min(job.layer_ids) or max(job.layer_ids) > n:
        raise ValueError(f"layer ids {job.layer_ids} outside [0, {n}] of {model_dir}")
    ckpt = Checkpoint(model_dir)
    prefix = ckpt.text_prefix(n)
    embed = prefix + "embed_tokens.weight"
    if embed not in ckpt.weight_map:
        raise CannotStream(f"{model_dir}: no {embed} in the checkpoint")
    return ckpt, prefix, text


def _layer_bytes(ckpt: Checkpoint, names: list[str], dtype) -> tuple[int, int]:
    """(bytes on disk, bytes once loaded in `dtype`: float tensors are cast to it) of the tensors `names`."""
    size = sum(ckpt.nbytes(x) for x in names)
    in_dtype = sum(ckpt.nbytes(x) // _ST_BYTES[ckpt.info(x)[1]["dtype"]] * dtype.itemsize
                   if ckpt.info(x)[1]["dtype"] in _FLOAT else ckpt.nbytes(x) for x in names)
    return size, in_dtype


def _write_layer(ckpt: Checkpoint, prefix: str, k: int, text: dict, layer_dir: Path, remote_code: list[Path]) -> dict:
    """Layer `k` of the checkpoint as layer 0 of a one-layer model in `layer_dir` (written afresh): its weights
    renamed, its config (returned) and the model's remote code."""
    shutil.rmtree(layer_dir, ignore_errors=True)
    layer_dir.mkdir(parents=True)
    src = f"{prefix}layers.{k}."
    ckpt.write_renamed({x: "model.layers.0." + x[len(src):] for x in ckpt.layer_names(prefix, k)},
                       layer_dir / "model.safetensors")
    cfg = known_model_type(layer_config(text, k))
    (layer_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for p in remote_code:
        shutil.copy(p, layer_dir / p.name)
    return cfg


def _through_layer(layer_dir: Path, cfg: dict, hs: list, target: TargetConfig, k: int, budget: int) -> str | None:
    """`hs` through layer `k` (the one-layer model in `layer_dir`, `cfg` its config), in place, within the
    memory budget. Returns why the reference is skipped (transformers cannot build the first layer here)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype, model_dir = getattr(torch, target.dtype), Path(target.model)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(layer_dir, dtype=dtype, output_loading_info=True,
                                                           trust_remote_code=target.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers cannot build this architecture here
        if k == 0:
            return f"transformers cannot load a layer of {model_dir} here ({type(e).__name__}: {e})"
        raise
    _loaded_whole(info, k, model_dir, cfg)
    model.eval()
    _check(budget, k, "loading")
    _forward(model, hs, dtype)
    del model
    gc.collect()
    _check(budget, k, "the forward")
    return None


def _loaded_whole(info: dict, k: int, model_dir: Path, cfg: dict) -> None:
    """A layer weight left at its random init (or one the model has no place for) would make a wrong
    reference that looks right: refuse."""
    missing = sorted(x for x in info.get("missing_keys") or [] if ".layers.0." in x)
    unused = sorted(info.get("unexpected_keys") or [])
    if missing or unused:
        raise RuntimeError(f"verify reference: layer {k} of {model_dir} did not load as layer 0 of a one-layer "
                           f"{cfg.get('model_type')} model: missing {missing[:8]}, unexpected {unused[:8]}")


def _forward(model, hs: list, dtype) -> None:
    """Each sample's states through the one-layer model's decoder layer, in place: hs[i] [T, H] becomes the
    layer's output in `dtype` (h_{k+1} from h_k)."""
    import torch

    inner, layers = _decoder_layers(model)
    got = {}

    def hook(mod, inp, output):
        got["h"] = output[0] if isinstance(output, tuple) else output

    handle = layers[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            for i, h in enumerate(hs):
                inner(inputs_embeds=h[None], use_cache=False)
                hs[i] = got.pop("h")[0].to(dtype)  # [T, H]: h_{k+1}
    finally:
        handle.remove()


def _check(budget: int, k: int, what: str) -> None:
    peak = peak_rss_bytes()
    if peak > budget:
        raise BudgetExceeded(f"verify reference: peak RSS {_gib(peak)} after {what} of layer {k} exceeds the "
                             f"memory budget verify.reference_memory_gb = {_gib(budget)}")


def _write(out_dir: Path, res: ReferenceOutput) -> None:
    write_json(Path(out_dir) / RESULT_FILE, res.model_dump(mode="json"))


def main(argv: list[str]) -> int:
    heap.tune()  # before the imports main makes
    job = ReferenceJob(**json.loads(Path(argv[0]).read_text()))
    t0 = time.time()
    try:
        res = run(job)
    except BudgetExceeded as e:
        print(str(e), flush=True)
        _write(job.out_dir, ReferenceOutput(error=str(e), peak_rss_bytes=peak_rss_bytes(),
                                            seconds=round(time.time() - t0, 2)))
        emit_event(kind="error", message=str(e))
        return BUDGET_EXIT
    except Exception as e:  # noqa: BLE001 - the parent reads the traceback from the log
        traceback.print_exc()
        emit_event(kind="error", message=f"{type(e).__name__}: {e}")
        return 1
    _write(job.out_dir, res)
    if res.skipped:
        print(f"reference: skipped: {res.skipped}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
