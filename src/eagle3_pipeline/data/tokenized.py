"""The tokenized dataset a prepare version holds, as the stages after prepare read it: its record
(`prepare.json`, `PrepareResult`), the names of its files, and the readers of its rows and of the tokenizer.

The prepare stage (prepare/stage.py) writes a version; every other stage reads it through this module, so no
stage imports the prepare stage (tests/unit/test_architecture.py). Layout: docs/store.md.
"""

from __future__ import annotations

from pydantic import BaseModel

from eagle3_pipeline.core.config import PrepareConfig, TargetConfig, hub_token

# the files that identify a tokenizer directory (its fingerprint in prepare's chunk keys, regenerate's version)
TOKENIZER_FILES = ("tokenizer*.json", "special_tokens_map.json", "*.jinja", "*.model", "vocab*", "merges.txt")
ROW_HASHES = "row_hashes.safetensors"  # each row's digest.row_hash as prepare judged it


class PrepareResult(BaseModel):
    version: str
    dir: str
    tokenized: str
    token_freq: str
    heldout: str
    quarantine: str
    rows_in: int
    rows_out: int
    rows_out_sources: int
    rows_heldout: int
    rows_quarantined: int
    rows_truncated: int
    turns_dropped: int
    rows_trimmed: int = 0            # kept rows that lost turns (formats.TRIM_*), and the turns by reason
    turns_trimmed: int = 0
    trim_reasons: dict[str, int] = {}
    mask_checks: dict[str, int] = {}  # rows whose mask a second method (mask_check.second_opinion) confirmed or left undecided
    damaged_sources: list[dict] = []  # JSON files cut part-way (on_damaged: keep_complete): offsets, records kept
    source_warnings: list[str] = []
    tokens: int
    supervised_tokens: int
    quarantine_reasons: dict[str, int]
    length_histogram: dict[str, int]
    chunks_total: int
    chunks_computed: int
    cached: bool = False
    row_hashes: str | None = None  # ROW_HASHES: each row's digest.row_hash as prepare judged it


def loss_warnings(res: PrepareResult, cfg: PrepareConfig) -> list[str]:
    """The rows a prepare lost when they are more than `warn_loss_share` of its input (quarantined, or kept with
    turns trimmed), or one reason is more than `warn_reason_share`: one line each, numbers and reasons first."""
    if not res.rows_in:
        return []
    share = lambda n: n / res.rows_in  # noqa: E731
    lost = res.rows_quarantined + res.rows_trimmed
    reasons = sorted({**{f"quarantined: {k}": v for k, v in res.quarantine_reasons.items()},
                      **{f"trimmed: {k}": v for k, v in res.trim_reasons.items()}}.items(), key=lambda kv: -kv[1])
    loud = [(k, v) for k, v in reasons if share(v) > cfg.warn_reason_share]
    if share(lost) <= cfg.warn_loss_share and not loud:
        return []
    top = ", ".join(f"{k} {v} ({share(v):.1%})" for k, v in (loud or reasons)[:6])
    return [f"prepare lost {lost} of {res.rows_in} input rows ({share(lost):.1%}: {res.rows_quarantined} quarantined, "
            f"{res.rows_trimmed} kept with turns trimmed; limits {cfg.warn_loss_share:.0%} in all, "
            f"{cfg.warn_reason_share:.0%} per reason): {top}; every row is in {res.quarantine} with its reason"]


def load_tokenized(path):
    """The tokenized dataset with plain Python rows. On disk it is torch-formatted, as speculators'
    own prepare-data saves it, so that its trainer reads our directory unchanged."""
    from datasets import load_from_disk

    return load_from_disk(str(path)).with_format(None)


def load_tokenizer(target: TargetConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target.tokenizer, revision=target.revision,
                                         trust_remote_code=target.trust_remote_code, token=hub_token(target))
