"""The base of every settings model: the daemon's config sections and root
(:mod:`mergestream.config`, :mod:`mergestream.config_policy`) and every policy's parameters
(:class:`mergestream.policies.PolicyParams`). Torch-free and imports nothing of the package, so
both sides can build on it.
"""

from __future__ import annotations

import difflib
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator


def is_number(annotation: Any) -> bool:
    """``annotation`` is int or float, or an optional, union, ``Annotated`` or ``Literal`` of numbers."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return is_number(get_args(annotation)[0])
    if origin is Literal:
        return any(type(a) in (int, float) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return any(is_number(a) for a in get_args(annotation))
    return annotation in (int, float)


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The settings model that holds the last name of an error location ``loc`` under ``root``
    (list indices and optional/union wrappers are looked through); None where no single model does
    (a plain mapping, a union of several models)."""
    model: type[BaseModel] = root
    for part in loc[:-1]:
        if not isinstance(part, str):
            continue  # a list index: the list's item model is already in hand
        field = model.model_fields.get(part)
        if field is None:
            return None
        found = _models_in(field.annotation)
        if len(found) != 1:
            return None
        model = found[0]
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The settings models an annotation names (through ``list``, optional, union, ``Annotated``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def unknown_key_hint(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """What to say of a key at ``loc`` that ``root`` does not know: ``unknown key (did you mean
    'retention'?)``, or the keys that level takes when none is close."""
    model = model_at(root, loc)
    if model is None:
        return "unknown key"
    known = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return f"unknown key (did you mean {close[0]!r}?)" if close else f"unknown key (known here: {', '.join(known)})"


class NumbersNotBooleans(BaseModel):
    """Base of every settings model (config sections, :class:`~mergestream.config.Config`, policy
    parameters): a boolean given for a number field is an error.

    Pydantic's lax mode reads ``true`` as 1 and ``false`` as 0, so ``k: true`` would keep TIES's top
    1 % and ``patch_format: true`` would pick format 1 without a word. Strings from the environment are
    untouched (``"true"`` is no number either and fails as such).

    Raises:
        pydantic.ValidationError: located at the field, "expects a number, not a boolean".
    """

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and is_number(field.annotation):
            raise ValueError(f"expects a number, not a boolean ({str(value).lower()})")
        return value
