"""The record files written without the safetensors library's own writer, and the extract worker's
checks of a connector's file: bytes identical to `safetensors.torch.save_file`, the header check that
decides whether a file is already a record, the fingerprint from vLLM's flat logprobs equal to the
one from its per-position dicts, and the shard's files made durable together."""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.core.store import durable_files
from eagle3_pipeline.records.contracts import (
    fingerprint_from_flat,
    fingerprint_from_logprobs,
    record_file_problem,
    record_metadata,
    save_safetensors,
    to_record,
    write_record,
)

LAYERS = [2, 4, 5, 8]


def _cases():
    g = torch.Generator().manual_seed(0)
    out = []
    for T in (1, 7, 300):
        hs, tok = torch.randn(T, 4, 96, generator=g), torch.randint(0, 1000, (T,), generator=g)
        for dtype in ("bf16", "fp8"):
            out.append((f"record {dtype} T={T}", to_record(hs, tok, dtype), record_metadata(LAYERS, dtype)))
        out.append((f"fingerprint T={T}", {"top_ids": torch.randint(0, 9, (T, 2), generator=g),
                                           "top_logprobs": torch.randn(T, 2, generator=g)}, None))
    out.append(("empty tensor, escaped non-ASCII metadata", {"a": torch.zeros(0, dtype=torch.int64),
                                                             "b": torch.ones(3, dtype=torch.float16)},
                {"k": 'välue "q" \\ x'}))
    return out


@pytest.mark.parametrize("name,tensors,meta", _cases(), ids=[c[0] for c in _cases()])
def test_save_safetensors_writes_the_bytes_the_library_writes(tmp_path, name, tensors, meta):
    save_file(tensors, str(tmp_path / "lib"), metadata=meta)
    save_safetensors(tmp_path / "ours", tensors, meta)
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "lib").read_bytes()
    back = load_file(str(tmp_path / "ours"))
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())


def test_record_file_problem_accepts_a_record_and_names_what_differs(tmp_path):
    hs, tok = torch.randn(5, 4, 16), torch.arange(5)
    p = tmp_path / "r"
    write_record(p, to_record(hs, tok, "bf16"), LAYERS, "bf16")
    assert record_file_problem(p, list(range(5)), LAYERS, 16, "bf16") is None
    assert "token_ids" in record_file_problem(p, list(range(1, 6)), LAYERS, 16, "bf16")
    assert "metadata" in record_file_problem(p, list(range(5)), [2, 4, 5, 9], 16, "bf16")  # other layer ids
    assert "expected BF16 [5, 4, 32]" in record_file_problem(p, list(range(5)), LAYERS, 32, "bf16")
    assert "metadata" in record_file_problem(p, list(range(5)), LAYERS, 16, "fp8")
    save_file({"hidden_states": hs.bfloat16(), "token_ids": tok}, str(p))  # vLLM's layout: no metadata
    assert "metadata None" in record_file_problem(p, list(range(5)), LAYERS, 16, "bf16")
    write_record(p, to_record(hs, tok, "fp8"), LAYERS, "fp8")
    assert record_file_problem(p, list(range(5)), LAYERS, 16, "fp8") is None
    with open(p, "r+b") as f:  # cut short by one byte
        f.truncate(os.path.getsize(p) - 1)
    assert "the header describes" in record_file_problem(p, list(range(5)), LAYERS, 16, "fp8")
    p.write_bytes(b"\x00" * 4)
    assert "no safetensors header" in record_file_problem(p, [0], LAYERS, 16, "bf16")


def _random_logprobs(rng: random.Random, T: int):
    """The same prompt and generated-token logprobs as vLLM gives them flat and as per-position dicts."""
    from vllm.logprobs import FlatLogprobs, Logprob

    flat, dicts = FlatLogprobs(), [None]
    flat.append(None)
    for _ in range(T - 1):
        top = rng.sample(range(50), 2)
        scored = rng.choice(top + [rng.randint(0, 49)])
        rank = 1 + top.index(scored) if scored in top else rng.randint(3, 40)
        l1, l2 = -rng.random(), -1 - rng.random()
        ls = {top[0]: l1, top[1]: l2}.get(scored, -3.0)
        flat.append_fast([scored, *top], [ls, l1, l2], iter([rank, 1, 2]), [None] * 3)
        d = {scored: Logprob(ls, rank)}
        d[top[0]], d[top[1]] = Logprob(l1, 1), Logprob(l2, 2)
        dicts.append(d)
    g, o = rng.sample(range(50), 2)
    last = FlatLogprobs()
    last.append_fast([g, g, o], [-0.1, -0.1, -2.0], iter([1, 1, 2]), [None] * 3)
    return flat, last, dicts, {g: Logprob(-0.1, 1), o: Logprob(-2.0, 2)}


def test_fingerprint_from_flat_logprobs_equals_the_one_from_dicts():
    rng = random.Random(0)
    for _ in range(200):
        T = rng.randint(1, 30)
        flat, last, dicts, last_dict = _random_logprobs(rng, T)
        a, b = fingerprint_from_flat(flat, last, T), fingerprint_from_logprobs(dicts, last_dict, T)
        assert torch.equal(a["top_ids"], b["top_ids"])
        assert torch.allclose(a["top_logprobs"], b["top_logprobs"], equal_nan=True)
    # a prompt with no logprobs (engine without prompt logprobs): every row but the last stays invalid
    a = fingerprint_from_flat(None, last, 4)
    assert (a["top_ids"][:3] == -1).all() and a["top_ids"][3].tolist() == [g for g in last.token_ids[1:]]


def test_durable_files_puts_every_file_in_place_or_none(tmp_path):
    pairs = []
    for i in range(5):
        tmp = tmp_path / f"f{i}.tmp-1-0"
        tmp.write_bytes(b"x" * (i + 1))
        pairs.append((tmp, tmp_path / f"f{i}"))
    durable_files(pairs)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"f{i}" for i in range(5)]
    assert (tmp_path / "f3").read_bytes() == b"xxxx"
    # a temporary file that is gone: nothing of the batch is renamed, the others are removed
    pairs = [(tmp_path / "g0.tmp", tmp_path / "g0"), (tmp_path / "g1.tmp", tmp_path / "g1")]
    pairs[0][0].write_bytes(b"a")
    with pytest.raises(FileNotFoundError):
        durable_files(pairs)
    assert not any(p.name.startswith("g") for p in tmp_path.iterdir())
