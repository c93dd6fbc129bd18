"""A record model made loose for reading a report: every field optional, nested models loose too. The report is
written for a failed or partial stage as well, so report.md reads a stage's record through `loose(<its model>)`
(report/record.py `StageEntry.record`), by attribute, with None where the record had nothing.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model


@cache
def loose(model: type[BaseModel]) -> type[BaseModel]:
    """`model` with every field optional (None when the record lacks it) and every nested model loose too, its
    computed fields among them: the report is written for a failed or partial stage too. Unknown keys are kept."""
    fields: dict[str, Any] = {k: (loose_annotation(f.annotation) | None, None) for k, f in model.model_fields.items()}
    fields |= {k: (loose_annotation(f.return_type) | None, None) for k, f in model.model_computed_fields.items()}
    return create_model(f"Loose{model.__name__}", __config__=ConfigDict(extra="allow"), __module__=__name__, **fields)


def loose_annotation(annotation: Any) -> Any:
    """An annotation with each model in it made `loose` (X | None, list[X], dict[str, X])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return loose(annotation)
    args = typing.get_args(annotation)
    if not args:
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [loose_annotation(a) for a in args])
    return origin[tuple(loose_annotation(a) for a in args)] if origin in (list, dict) else annotation
