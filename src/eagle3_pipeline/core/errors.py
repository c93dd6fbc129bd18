"""Failure categories and the exit codes of the `eagle3` command.

Owns `ExitCode`, the category base classes (`ConfigError`, `InputError`, `GateFailed`,
`EnvironmentProblem`, `StageTimeout`, `DiskFull`) and `exit_code(exc)`. The stage exceptions that
existed before these categories (ContractError, SourceError, VerifyFailed, PreflightFailed, ...) keep
their names and their builtin bases (ValueError / RuntimeError, so existing `except` clauses still
catch them) and add one category base, which gives them their code. `exit_code` walks the
`__cause__` / `__context__` chain, because an orchestrator or a stage may wrap the error that says
what went wrong: the first exception in the chain with a specific code (not FAILED) decides.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1          # anything not classified below: a bug, an engine crash, a child that exited non-zero
    CONFIG = 2          # config file or --set override: unknown key, wrong type, bad value, unsafe store path
    INPUT = 3           # input data, model/tokenizer files or stored artifacts that break a contract
    GATE = 4            # a gate failed on results: verify, evaluate (acceptance floor), the draft export check
    ENVIRONMENT = 5     # the machine: preflight (versions, APIs, layer ids vs model, disk estimate), gpu-gate, disk full
    TIMEOUT = 6         # a stage or one of its child processes ran past its deadline
    INTERRUPTED = 130   # Ctrl-C, SIGTERM or a cancelled run (128 + SIGINT, the shell convention)


class PipelineError(Exception):
    """Base of the pipeline's own failures; `exit_code` is the category's code."""
    exit_code: int = ExitCode.FAILED


class ConfigError(PipelineError, ValueError):
    """The configuration is invalid; the message names the file and the dotted key."""
    exit_code = ExitCode.CONFIG


class InputError(PipelineError, ValueError):
    """Input data, a model/tokenizer directory or a stored file is unusable; the message names it."""
    exit_code = ExitCode.INPUT


class GateFailed(PipelineError, RuntimeError):
    """A gate checked results and they are wrong."""
    exit_code = ExitCode.GATE


class EnvironmentProblem(PipelineError, RuntimeError):
    """The machine cannot run the stage (packages, accelerator busy, no disk space)."""
    exit_code = ExitCode.ENVIRONMENT


class DiskFull(PipelineError, OSError):
    """A write ran out of space (ENOSPC, a quota, or the file size limit); nothing was published
    under the final name. An environment problem (exit code 5), and an OSError."""
    exit_code = ExitCode.ENVIRONMENT

    def __init__(self, message: str, err: int | None = errno.ENOSPC):
        super().__init__(message)
        self.errno = err


class StageTimeout(PipelineError, TimeoutError):
    """A stage or its child process ran past its deadline."""
    exit_code = ExitCode.TIMEOUT


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_disk_full(exc: BaseException) -> bool:
    """An OSError that means "no more bytes can be written here" (also when a library, like pyarrow,
    reports it without setting `errno` but with the system's message)."""
    if not isinstance(exc, OSError):
        return False
    if exc.errno in DISK_FULL_ERRNOS:
        return True
    text = str(exc)
    return any(msg in text for msg in ("No space left on device", "File too large", "Disk quota exceeded"))


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it: `__cause__`, else `__context__` unless suppressed (`from None`);
    the members of an exception group are walked too."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        if e.__cause__ is not None:
            todo.append(e.__cause__)
        elif e.__context__ is not None and not e.__suppress_context__:
            todo.append(e.__context__)


def _own_code(e: BaseException) -> int:
    code = getattr(e, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return int(code)
    if isinstance(e, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(e, TimeoutError):
        return ExitCode.TIMEOUT
    if is_disk_full(e):
        return ExitCode.ENVIRONMENT
    return ExitCode.FAILED


def _decisive(exc: BaseException, classify: Callable[[BaseException], int | None] | None) -> tuple[int, BaseException]:
    """(code, exception) of the first exception along the cause chain with a specific code, else
    (FAILED, exc)."""
    for e in chain(exc):
        code = classify(e) if classify else None
        if code is None:
            code = _own_code(e)
        if code != ExitCode.FAILED:
            return int(code), e
    return int(ExitCode.FAILED), exc


def exit_code(exc: BaseException, classify: Callable[[BaseException], int | None] | None = None) -> int:
    """The exit code for `exc`: the first specific code along its cause chain, else FAILED.
    `classify` lets an outer layer (the CLI, which may import Prefect) name codes for its own types."""
    return _decisive(exc, classify)[0]


def culprit(exc: BaseException, classify: Callable[[BaseException], int | None] | None = None) -> BaseException:
    """The exception whose code `exit_code` returns (the one whose message to show first)."""
    return _decisive(exc, classify)[1]


# Categories that are answers, not accidents: a retry would only repeat them (a failed gate, bad
# input, a bad config, a machine that cannot run the stage, a full disk).
NOT_TRANSIENT_CODES = frozenset({ExitCode.CONFIG, ExitCode.INPUT, ExitCode.GATE, ExitCode.ENVIRONMENT})


def is_transient(exc: BaseException, transient: tuple[type[BaseException], ...]) -> bool:
    """Whether a retry may help: something along `exc`'s cause chain is one of the `transient` types
    (e.g. OSError, proc.ChildFailed), and nothing along it belongs to a NOT_TRANSIENT_CODES category
    (GateFailed, InputError, ConfigError, EnvironmentProblem, DiskFull), whatever wraps what."""
    seen = list(chain(exc))
    if any(isinstance(getattr(e, "exit_code", None), int) and e.exit_code in NOT_TRANSIENT_CODES for e in seen):
        return False
    if any(isinstance(e, OSError) and is_disk_full(e) for e in seen):
        return False
    return any(isinstance(e, transient) for e in seen)
