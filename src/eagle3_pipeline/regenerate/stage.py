"""The regenerate stage (optional, before prepare): the target answers the conversations' turns itself.

How it works, what it reads and writes, its test hooks: docs/internals.md, `regenerate/stage.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from pydantic import BaseModel

from eagle3_pipeline import FORMAT_VERSION
from eagle3_pipeline.core.config import (
    PipelineConfig,
    PrepareConfig,
    RegenerateConfig,
    SourceConfig,
    TargetConfig,
    hub_token,
)
from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.core.stage_spec import CHILD, IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import (
    atomic_write_text,
    content_key,
    dir_fingerprint,
    dir_lock,
    model_fingerprint,
    read_json,
    slug,
    within,
    write_json,
)
from eagle3_pipeline.data.tokenized import TOKENIZER_FILES, load_tokenizer
from eagle3_pipeline.engine.build import cpu_build_kwargs, engine_env
from eagle3_pipeline.engine.start import refusal_of
from eagle3_pipeline.records.results import RegenerateResult  # the stage's record (records/results.py)
from eagle3_pipeline.records.shardrun import Child, ShardEntry, ShardRun, hashes, published_ok, tool_versions
from eagle3_pipeline.regenerate.job import (
    QUARANTINE_DIR,
    ROWS_DIR,
    RegenerateJob,
    ShardInput,
    input_sha,
    shard_file,
    source_rows,
)

WORKER = "eagle3_pipeline.regenerate.worker"
REGENERATED_DIR = "regenerated"  # <store>/<dataset>/regenerated/<version>/
DONE = "regenerate.json"
# Bump when the same inputs and settings give different rows or quarantine decisions.
REGENERATE_FORMAT = 3  # 2: a row names its answers cut short (regenerated.cut_turns); 3: and those that loop
SINGLE_PASS_GAP = ("this pipeline regenerates and extracts in two passes: the rows extract records are prepare's "
                   "rendering of each whole regenerated conversation (templates re-render history, e.g. drop the "
                   "reasoning of earlier turns; re-tokenized text can split differently from the generated ids; the "
                   "end-of-turn markup after the stop token is never generated; every answered turn is a request of "
                   "its own), so the hidden states of a generation request do not line up with those rows")


class RegenerateFailed(RuntimeError):
    """Some shards are not published after the child; the message names them and the child's error."""


# ------------------------------------------------------------------------------------ planning

def thinking_kwargs(cfg: RegenerateConfig, template: str) -> tuple[dict, dict]:
    """The chat template's extra variables and a note on thinking: `cfg.thinking` is passed as
    `cfg.thinking_kwarg` only where the template reads that variable."""
    kwargs = dict(cfg.chat_template_kwargs)
    note: dict = {"requested": cfg.thinking, "variable": cfg.thinking_kwarg, "applied": False}
    if cfg.thinking is None:
        note["why"] = "regenerate.thinking is not set: the template's default"
        return kwargs, note
    if cfg.thinking_kwarg in template_variables(template):
        kwargs[cfg.thinking_kwarg] = cfg.thinking
        note.update(applied=True, why=f"passed as the template variable {cfg.thinking_kwarg!r}")
    else:
        note["why"] = (f"the chat template has no variable {cfg.thinking_kwarg!r} (no thinking switch): it renders "
                       f"as it always does")
    return kwargs, note


def template_variables(template: str) -> set[str]:
    """Variables a chat template reads from its context (jinja2's own analysis; a word search when
    the template uses tags plain jinja2 does not know)."""
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return set(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return set(re.findall(r"[A-Za-z_]\w*", template))


def plan_shards(sources: list[SourceConfig], rows_per_shard: int, token: str | None) -> list[ShardInput]:
    """Shards of `rows_per_shard` consecutive input rows, each with the sha256 of its raw rows."""
    shards: list[ShardInput] = []
    h, start, count = hashlib.sha256(), 0, 0
    for n, _, raw in source_rows(sources, token):
        if n - start == rows_per_shard:
            shards.append(ShardInput(index=len(shards), row_start=start, row_end=n, input_sha=h.hexdigest()))
            h, start = hashlib.sha256(), n
        input_sha(h, raw)
        count = n + 1
    if count > start:
        shards.append(ShardInput(index=len(shards), row_start=start, row_end=count, input_sha=h.hexdigest()))
    return shards


def _count(shards: list[ShardInput]) -> int:
    return shards[-1].row_end if shards else 0


def version_key(cfg: RegenerateConfig, shards: list[ShardInput], target: TargetConfig, tok, kwargs: dict) -> dict:
    """Everything that decides the rows of a version (its content key is the version)."""
    tok_id = (dir_fingerprint(Path(target.tokenizer), TOKENIZER_FILES) if Path(target.tokenizer).exists()
              else f"{target.tokenizer}@{target.revision}")
    return {"inputs": [s.input_sha for s in shards], "rows_per_shard": cfg.rows_per_shard,
            "model": model_fingerprint(target.model, target.revision), "revision": target.revision,
            "dtype": target.dtype, "tokenizer": tok_id, "template": tok.chat_template, "template_kwargs": kwargs,
            "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                         "seed": cfg.seed},
            "turns": {"max_turns": cfg.max_turns, "on_length": cfg.on_length,
                      "max_history_tokens": cfg.max_history_tokens, "on_repetition": cfg.on_repetition},
            "reasoning_parser": cfg.reasoning_parser, "max_model_len": cfg.max_model_len,
            "format": REGENERATE_FORMAT, **({"engine": e} if (e := cpu_build_kwargs()) else {})}


def prepare_config(prep: PrepareConfig, res: RegenerateResult) -> PrepareConfig:
    """`prep` reading the regenerated rows (OpenAI format) instead of its configured sources."""
    return prep.model_copy(update={"sources": res.sources()})


# ------------------------------------------------------------------------------------ manifest

@dataclass
class _Request:
    """One regenerate call, passed whole: the settings, inputs and template of the version."""
    cfg: RegenerateConfig
    sources: list[SourceConfig]
    shards: list[ShardInput]
    target: TargetConfig
    tok: Any
    kwargs: dict  # the chat template's extra variables (thinking_kwargs)
    note: dict    # how thinking was applied (thinking_kwargs)


def _lineage(req: _Request) -> dict:
    cfg, target, tok = req.cfg, req.target, req.tok
    model = str(Path(target.model).resolve()) if Path(target.model).exists() else target.model
    return {
        "sources": [s.model_dump() for s in req.sources], "source_rows": _count(req.shards),
        "source_fingerprint": content_key([s.input_sha for s in req.shards], 16),
        "target": {"model": model, "revision": target.revision, "dtype": target.dtype,
                   "model_fingerprint": model_fingerprint(target.model, target.revision),
                   "tokenizer": target.tokenizer,
                   "chat_template_sha256": hashlib.sha256((tok.chat_template or "").encode()).hexdigest()},
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
                     "seed": cfg.seed, "request_seed": "sha256(seed|conversation id|turn)"},
        "turns": {"max_turns": cfg.max_turns, "on_length": cfg.on_length, "max_history_tokens": cfg.max_history_tokens,
                  "on_repetition": cfg.on_repetition,
                  "policy": "text replies answered in order, each on the regenerated history; assistant turns with "
                            "tool calls, system prompts, tools, user turns and tool results kept verbatim; a "
                            "conversation ending in a user turn or tool result gets one more answer"},
        "template_kwargs": req.kwargs, "thinking": req.note, "reasoning_parser": cfg.reasoning_parser,
        "max_model_len": cfg.max_model_len, "engine": cfg.engine().model_dump(), "versions": tool_versions(),
    }


def _ensure_manifest(run: ShardRun, version: str, req: _Request, log: Callable[[str], None]) -> None:
    """Create the manifest, or take over the one a previous call left: its `running` attempts were
    abandoned (we hold the version's lock, so their parent is gone)."""
    run.ensure(version, lambda m: None if m else dict(
        format_version=FORMAT_VERSION, regenerate_format=REGENERATE_FORMAT, content_key=version,
        lineage=_lineage(req), single_pass=False, single_pass_reason=None, output_token_states=None,
        children=[], shards=[{**s.model_dump(), "status": "pending", "attempts": 0, "error": None}
                             for s in req.shards]))
    run.recover_abandoned([s.index for s in req.shards], lambda c: log(
        f"regenerate: child attempt {c.attempt} was abandoned (its parent was killed?)"))


def _check_published(out: Path, e: ShardEntry) -> str | None:
    """None if both files of a published shard are present and hash to the manifest, else why not."""
    return published_ok({out / ROWS_DIR / shard_file(e.index): e.rows_sha256,
                         out / QUARANTINE_DIR / shard_file(e.index): e.quarantine_sha256})


def _remove_leftovers(out: Path) -> None:
    """Half-written files of killed attempts (only the lock holder writes here)."""
    for d in (ROWS_DIR, QUARANTINE_DIR):
        for tmp in (out / d).glob("*.tmp-*"):
            tmp.unlink(missing_ok=True)
    (out / DONE).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ the stage

def regenerate(cfg: RegenerateConfig, prep: PrepareConfig, target: TargetConfig, store_root: Path,
               log: Callable[[str], None] = print) -> RegenerateResult:
    """Regenerate `prep.sources` with the target, or return the complete version already in the store.
    Raises RegenerateFailed naming the unpublished shards (the published ones stay for the retry)."""
    tok = load_tokenizer(target)
    if not getattr(tok, "chat_template", None):
        raise InputError(f"tokenizer {target.tokenizer}: no chat template, so the target cannot be asked to answer "
                         f"the conversations (regenerate needs the target's own template)")
    kwargs, note = thinking_kwargs(cfg, tok.chat_template)
    shards = plan_shards(prep.sources, cfg.rows_per_shard, hub_token(target))
    if not shards:
        raise InputError(f"regenerate: the sources {[s.path for s in prep.sources]} hold no rows")
    version = content_key(version_key(cfg, shards, target, tok, kwargs))
    out = within(store_root, slug(prep.dataset), REGENERATED_DIR, version)
    done = _complete(out)
    if done is not None:
        log(f"regenerate: version {version} already complete at {out}")
        return done
    with dir_lock(out, f"regenerate version {version}", log):
        done = _complete(out)  # a concurrent run may have finished it while we waited
        if done is not None:
            log(f"regenerate: version {version} already complete at {out}")
            return done
        if note["requested"] is not None and not note["applied"]:
            log(f"regenerate: thinking={note['requested']} not applied: {note['why']}")
        run = ShardRun(out, "regenerate", RegenerateFailed)
        req = _Request(cfg, prep.sources, shards, target, tok, kwargs, note)
        _ensure_manifest(run, version, req, log)
        _remove_leftovers(out)
        todo = []
        for e in run.read().shards:
            if e.status == "published":
                why = _check_published(out, e)
                if why is None:
                    continue
                log(f"regenerate: shard {e.index} was published but {why}; regenerating it")
            todo.append(shards[e.index])
        engine_s = None
        if todo:
            log(f"regenerate: {len(todo)} of {len(shards)} shards to regenerate -> {out}")
            engine_s = _run_child(req, run, todo, log)
        res = _assemble(run, note, shards_computed=len(todo), engine_start_s=engine_s)
    log(f"regenerate: {res.rows_in} rows in, {res.rows_out} out, {res.rows_quarantined} quarantined, "
        f"{res.tokens_generated} tokens generated ({res.tokens_per_s} tok/s, {res.rows_per_s} rows/s) -> {out}")
    return res


def _complete(out: Path) -> RegenerateResult | None:
    """The version's result when it is complete and every shard's files still hash to the manifest."""
    data = read_json(out / DONE)
    if data is None:
        return None
    entries = ShardRun(out, "regenerate").read(missing_ok=True).shards
    if not entries or any(e.status != "published" or _check_published(out, e) for e in entries):
        return None
    return RegenerateResult(**{**data, "cached": True, "shards_computed": 0, "engine_start_s": None})


def _run_child(req: _Request, run: ShardRun, shards: list[ShardInput], log: Callable[[str], None]) -> float | None:
    """One engine child for `shards`; each is published as the child reports it. Returns the child's
    engine start-up seconds; raises RegenerateFailed when some shard is not published."""
    cfg, out = req.cfg, run.dir
    attempt = run.open_attempt([s.index for s in shards])
    job = RegenerateJob(target=req.target, engine=cfg.engine(), regenerate=cfg, template_kwargs=req.kwargs,
                        sources=req.sources, shards=shards, out_dir=str(out.resolve()), attempt=attempt.number)
    job_path = write_json(out / "jobs" / f"regenerate-{attempt.number}.json", job.model_dump(mode="json"))
    log_path = out / "logs" / f"regenerate-{attempt.number}.log"
    log(f"regenerate: child {attempt.number} for shards {[s.index for s in shards]} (log {log_path})")

    def on_event(ev: dict) -> None:
        if ev.get("kind") == "capability":
            with run.edit() as m:
                m.update(output_token_states=bool(ev["output_token_states"]),
                         single_pass=False, single_pass_reason=single_pass_reason(ev["output_token_states"],
                                                                                  ev["reason"]))
        elif ev.get("kind") == "engine_ready":
            log(f"regenerate: engine ready after {ev['seconds']:.1f}s (max_model_len {ev.get('max_model_len')})")
        elif ev.get("kind") == "shard_done":
            _publish(run, ev)
            attempt.published.add(int(ev["shard"]))
            log(f"regenerate: shard {ev['shard']} published ({ev['rows_out']} rows, {ev['rows_quarantined']} "
                f"quarantined, {ev['tokens_generated']} tokens in {ev['generate_s']:.2f}s)")

    run.run_child(attempt, Child(module=WORKER, job_path=job_path, log_path=log_path, timeout_s=cfg.timeout_s,
                                 env=engine_env(cfg),
                                 refusal=lambda e, p: refusal_of(e, p, "regenerate", cfg, "regenerate.max_model_len")),
                  on_event, log)
    return attempt.engine_start_s


def single_pass_reason(can: bool, why: str) -> str:
    if can:
        return f"{why}, but {SINGLE_PASS_GAP}"
    return f"{why}: two passes (regenerate, then prepare + extract on the regenerated rows)"


def _publish(run: ShardRun, ev: dict) -> None:
    k = int(ev["shard"])
    name = shard_file(k)
    rows, quarantine = run.dir / ROWS_DIR / name, run.dir / QUARANTINE_DIR / name
    for p in (rows, quarantine):
        if not p.is_file():
            raise RegenerateFailed(f"shard {k}: the child reported it done but {p} is missing")
    n_rows = sum(1 for _ in rows.open()) if rows.stat().st_size else 0
    n_q = sum(1 for _ in quarantine.open()) if quarantine.stat().st_size else 0
    if (n_rows, n_q) != (ev["rows_out"], ev["rows_quarantined"]) or n_rows + n_q != ev["rows_in"]:
        raise RegenerateFailed(f"shard {k}: {n_rows} rows + {n_q} quarantined on disk, the child reported "
                               f"{ev['rows_out']} + {ev['rows_quarantined']} of {ev['rows_in']}")
    keys = ("rows_in", "rows_out", "rows_quarantined", "quarantine_kinds", "turns_regenerated", "kept_tool_turns",
            "tokens_generated", "prompt_tokens", "rounds", "turns_rendered_differently", "first_difference",
            "answers_cut", "conversations_ended", "answers_repeating",
            "generate_s", "seconds")

    def same_rows(m: dict) -> None:
        e = m["shards"][k]
        if e["row_end"] - e["row_start"] != ev["rows_in"]:
            raise RegenerateFailed(f"shard {k}: the child read {ev['rows_in']} rows, the plan has "
                                   f"{e['row_end'] - e['row_start']}")

    sha = hashes({"rows": rows, "quarantine": quarantine})
    run.publish(k, {"rows_sha256": sha["rows"], "quarantine_sha256": sha["quarantine"],
                    **{key: ev.get(key) for key in keys}}, also=same_rows)


def _assemble(run: ShardRun, note: dict, shards_computed: int, engine_start_s: float | None) -> RegenerateResult:
    """Every shard is published: the combined quarantine file and the version's record."""
    out, m = run.dir, run.read()
    es = m.shards
    atomic_write_text(out / "quarantine.jsonl",
                      "".join((out / QUARANTINE_DIR / shard_file(e.index)).read_text() for e in es))
    kinds, cut = Counter(), Counter()
    for e in es:
        kinds.update(e.quarantine_kinds or {})
        cut.update(e.answers_cut or {})

    def total(key: str):
        return sum(e.count(key) for e in es)

    gen_s, seconds = total("generate_s"), total("seconds")
    res = RegenerateResult(
        version=m.content_key, dir=str(out.resolve()), rows_dir=str((out / ROWS_DIR).resolve()),
        quarantine=str((out / "quarantine.jsonl").resolve()), manifest=str(run.path.resolve()),
        rows_in=total("rows_in"), rows_out=total("rows_out"), rows_quarantined=total("rows_quarantined"),
        tokens_generated=total("tokens_generated"), prompt_tokens=total("prompt_tokens"),
        turns_regenerated=total("turns_regenerated"), kept_tool_turns=total("kept_tool_turns"),
        quarantine_kinds=dict(kinds), turns_rendered_differently=total("turns_rendered_differently"),
        answers_cut=dict(cut),
        conversations_ended=total("conversations_ended"), answers_repeating=total("answers_repeating"),
        on_repetition=(m.lineage.get("turns") or {}).get("on_repetition") or "keep",
        shards_total=len(es), shards_computed=shards_computed, single_pass=m.single_pass,
        single_pass_reason=m.single_pass_reason or "", output_token_states=m.output_token_states,
        thinking=note, generate_s=round(gen_s, 3),
        rows_per_s=round(total("rows_in") / seconds, 2) if seconds else 0.0,
        tokens_per_s=round(total("tokens_generated") / gen_s, 1) if gen_s else 0.0,
        engine_start_s=engine_start_s)
    if res.rows_in != res.rows_out + res.rows_quarantined or res.rows_in != m.lineage["source_rows"]:
        raise RegenerateFailed(f"{out}: {res.rows_in} rows in (sources: {m.lineage['source_rows']}), "
                               f"{res.rows_out} out + {res.rows_quarantined} quarantined")
    write_json(out / DONE, res.model_dump(exclude={"cached", "shards_computed", "engine_start_s"}))
    return res


def read_rows(res: RegenerateResult) -> list[dict]:
    """Every regenerated row of a version, in input order (tests, inspection)."""
    return [json.loads(line) for p in sorted(Path(res.rows_dir).glob("*.jsonl")) for line in p.read_text().splitlines()]


def read_quarantine(res: RegenerateResult) -> list[dict]:
    return [json.loads(line) for line in Path(res.quarantine).read_text().splitlines()]


__all__ = ["RegenerateFailed", "RegenerateResult", "prepare_config", "read_quarantine", "read_rows", "regenerate"]


class RegenerateInputs(BaseModel):
    """Nothing from an earlier stage: regenerate reads prepare.sources from the config."""


def run(cfg: PipelineConfig, inputs: RegenerateInputs, log: Log) -> RegenerateResult:
    """The stage's entry (StageSpec.run): the target answers the sources' turns."""
    return regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=log)


RETRY = Retry(2, 30, (*IO, *CHILD, RuntimeError),
              "engine child that answers the sources' turns (crash, OOM, lost node, timeout); a retry regenerates "
              "only the shards not yet published", count="regenerate.retries")
STAGE = StageSpec(name="regenerate", run=run, result=RegenerateResult, failure=RegenerateFailed,
                  worker="eagle3_pipeline.regenerate.worker", accelerators=True, retry=RETRY)
