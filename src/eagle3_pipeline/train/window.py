"""A bounded window of captured shards between capture and training (docs/decisions/capture-window.md).

More: docs/internals.md, "train/window.py".
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.store import file_lock, read_json, write_json

STATE, LOCK, SHARDS = "window.json", ".window.lock", "shards"


class WindowError(ValueError):
    """The window used in a way that cannot work (a shard that can never fit, a key published twice, ...)."""


class WindowFailed(WindowError):
    """Capture marked the window failed (`ShardWindow.fail`): the trainer stops instead of waiting for shards."""


class WindowStalled(EnvironmentProblem):
    """One side waited `wait_s` for the other: capture for room (the trainer released nothing), or the trainer for a
    shard (capture published nothing)."""


class Held(BaseModel):
    state: Literal["reserved", "published"]
    bytes: int
    seq: int = 0        # publication order (0 while reserved)
    consumed: int = 0   # passes the trainer has checkpointed over it


class WindowState(BaseModel):
    max_shards: int
    max_bytes: int | None
    passes: int
    shards: dict[str, Held] = {}
    seq: int = 0
    closed: bool = False
    peak_shards: int = 0
    peak_bytes: int = 0
    published: int = 0
    released: int = 0
    released_bytes: int = 0
    failed: str | None = None  # capture failed (a shard that failed verify, an engine that died): the trainer stops

    @property
    def held_bytes(self) -> int:
        return sum(h.bytes for h in self.shards.values())


def epoch_key(epoch: int, shard: str) -> str:
    """The window's key of `shard` captured for `epoch` (epochs over a stream: every epoch captures again)."""
    return f"e{epoch:04d}-{shard}"


class ShardWindow:
    def __init__(self, directory: Path, max_shards: int, max_bytes: int | None = None, passes: int = 1):
        """The window at `directory`, created with these limits or reopened (a reopened window must have them)."""
        if max_shards < 1 or passes < 1 or (max_bytes is not None and max_bytes < 1):
            raise WindowError(f"a window holds 1 shard or more, for 1 pass or more (max_shards {max_shards}, "
                              f"max_bytes {max_bytes}, passes {passes})")
        self.dir = Path(directory)
        want = (max_shards, max_bytes, passes)
        with self._locked() as st:
            if st is None:
                self._save(WindowState(max_shards=max_shards, max_bytes=max_bytes, passes=passes))
            elif (st.max_shards, st.max_bytes, st.passes) != want:
                raise WindowError(f"the window at {self.dir} has max_shards {st.max_shards}, max_bytes "
                                  f"{st.max_bytes}, passes {st.passes}; this run asks {want}: one window, one setting")

    # -------------------------------------------------------------------------------- state

    @contextlib.contextmanager
    def _locked(self) -> Iterator[WindowState | None]:
        """The window's state, read under its lock (held until the `with` ends: a change is `_save`d inside)."""
        with file_lock(self.dir / LOCK, f"shard window {self.dir}", log=None):
            raw = read_json(self.dir / STATE)
            yield None if raw is None else WindowState.model_validate(raw)

    def _save(self, st: WindowState) -> None:
        st.peak_shards = max(st.peak_shards, len(st.shards))
        st.peak_bytes = max(st.peak_bytes, st.held_bytes)
        write_json(self.dir / STATE, st.model_dump(mode="json"))

    def state(self) -> WindowState:
        with self._locked() as st:
            return st

    def shard_dir(self, key: str) -> Path:
        return self.dir / SHARDS / key

    def records_dir(self, key: str) -> Path:
        """Where shard `key`'s row records are: `shard_dir(key)/hidden_states` when capture wrote the shard as an
        extract version dir (pipeline/window_training.py: manifest, fingerprints, verify record beside), else the
        shard dir itself."""
        d = self.shard_dir(key)
        return d / "hidden_states" if (d / "hidden_states").is_dir() else d

    # -------------------------------------------------------------------------------- capture

    def try_reserve(self, key: str, nbytes: int) -> bool:
        """Room for shard `key` of about `nbytes` (counted from now: it is being written), or False when full."""
        with self._locked() as st:
            if st.closed:
                raise WindowError(f"shard {key}: capture closed the window at {self.dir}")
            if key in st.shards:
                raise WindowError(f"shard {key} is already in the window ({st.shards[key].state})")
            if st.max_bytes is not None and nbytes > st.max_bytes:
                raise WindowError(f"shard {key} of {nbytes} bytes can never fit a window of {st.max_bytes} bytes: "
                                  f"a larger window, or smaller shards")
            if len(st.shards) >= st.max_shards or (st.max_bytes is not None and st.held_bytes + nbytes > st.max_bytes):
                return False
            st.shards[key] = Held(state="reserved", bytes=int(nbytes))
            self._save(st)
            return True

    def reserve(self, key: str, nbytes: int, wait_s: float, poll_s: float = 0.5) -> None:
        """`try_reserve`, waiting while the window is full; WindowStalled after `wait_s` without room."""
        end = time.monotonic() + wait_s
        while not self.try_reserve(key, nbytes):
            if time.monotonic() >= end:
                st = self.state()
                raise WindowStalled(f"shard {key}: the window at {self.dir} stayed full for {wait_s:.0f}s ("
                                    f"{len(st.shards)} of {st.max_shards} shards, {st.held_bytes} bytes held): the "
                                    f"trainer released nothing")
            time.sleep(poll_s)

    def publish(self, key: str, nbytes: int) -> None:
        """Shard `key` is complete in `shard_dir(key)` with `nbytes` on disk: the trainer may read it."""
        with self._locked() as st:
            h = st.shards.get(key)
            if h is None or h.state != "reserved":
                raise WindowError(f"shard {key} was not reserved in the window at {self.dir}: reserve it first")
            st.seq += 1
            st.shards[key] = Held(state="published", bytes=int(nbytes), seq=st.seq)
            st.published += 1
            self._save(st)

    def abandon(self, key: str) -> None:
        """Capture failed on shard `key`: its room and any partial files go."""
        with self._locked() as st:
            if key in st.shards and st.shards[key].state == "reserved":
                del st.shards[key]
                shutil.rmtree(self.shard_dir(key), ignore_errors=True)
                self._save(st)

    def close(self) -> None:
        with self._locked() as st:
            st.closed = True
            self._save(st)

    def fail(self, why: str) -> None:
        """Capture cannot go on (`why` names the shard and the reason): nothing more will be published, and the
        trainer's next look at the window raises WindowFailed with `why` instead of waiting."""
        with self._locked() as st:
            st.failed = why
            self._save(st)

    # -------------------------------------------------------------------------------- trainer

    def ready(self) -> list[str] | None:
        """The published shards the trainer may read, oldest first; None once capture is closed and nothing is
        left to read."""
        with self._locked() as st:
            if st.failed:
                raise WindowFailed(f"capture failed, the window at {self.dir} gets no more shards: {st.failed}")
            out = sorted((h.seq, k) for k, h in st.shards.items() if h.state == "published")
            if not out and st.closed and not st.shards:
                return None
            return [k for _, k in out]

    def wait_published(self, wait_s: float, poll_s: float = 0.5) -> list[str]:
        """`ready`, waiting for a first shard; [] at the end; WindowStalled after `wait_s` with nothing."""
        end = time.monotonic() + wait_s
        while True:
            keys = self.ready()
            if keys is None:
                return []
            if keys:
                return keys
            if time.monotonic() >= end:
                raise WindowStalled(f"the window at {self.dir} had no shard for {wait_s:.0f}s: capture published "
                                    f"nothing")
            time.sleep(poll_s)

    def consume(self, key: str) -> bool:
        """One pass over shard `key` is covered by a step checkpoint; after `passes` the shard is released (files
        deleted, room given back). True when released."""
        with self._locked() as st:
            h = st.shards.get(key)
            if h is None or h.state != "published":
                raise WindowError(f"shard {key} is not published in the window at {self.dir}")
            h.consumed += 1
            done = h.consumed >= st.passes
            if done:
                del st.shards[key]
                st.released += 1
                st.released_bytes += h.bytes
                shutil.rmtree(self.shard_dir(key), ignore_errors=True)
            self._save(st)
            return done


# ------------------------------------------------------------------------------------ the arithmetic

class WindowPlan(BaseModel):
    policy: Literal["stream", "passes"]
    dataset_bytes: int        # what the store would hold offline (every record at once)
    window_bytes: int         # what it holds at most with the window
    shards: int               # shards of one epoch
    captured_tokens: int      # what capture computes over the run (stream: once per epoch)
    capture_passes: int
    pass_order: str


def plan(tokens: int, bytes_per_token: int, shard_tokens: int, window_shards: int, epochs: int,
         policy: Literal["stream", "passes"] = "stream") -> WindowPlan:
    """The store and capture cost of training `epochs` over `tokens` captured at `bytes_per_token`, in shards of
    `shard_tokens`, through a window of `window_shards`. A window as large as the dataset is the offline store."""
    if min(tokens, bytes_per_token, shard_tokens, window_shards, epochs) < 1:
        raise WindowError("tokens, bytes per token, shard tokens, window shards and epochs are all 1 or more")
    shards = math.ceil(tokens / shard_tokens)
    held = min(window_shards, shards)
    passes = 1 if policy == "stream" or held == shards else epochs
    capture = epochs if policy == "stream" and held < shards else 1
    order = ("epochs over the whole dataset (the window holds it)" if held == shards else
             "epochs over a stream: every epoch captures every shard again" if policy == "stream" else
             f"{epochs} passes over each block of {held} shards, then the next block")
    return WindowPlan(policy=policy, dataset_bytes=tokens * bytes_per_token,
                      window_bytes=min(held * shard_tokens, tokens) * bytes_per_token, shards=shards,
                      captured_tokens=tokens * capture, capture_passes=capture, pass_order=order + (
                          f" (each shard read {passes} times before release)" if passes > 1 else ""))
