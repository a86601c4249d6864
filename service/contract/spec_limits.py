"""What Ray and the operating system refuse, checked where a spec is read
(`service.contract.spec`), so
that a job that passes the check does not fail at start, and each refusal names its field.

- A resource quantity is a whole number of Ray's units (0.0001): Ray refuses a fraction below
  one unit when it creates an actor (after the placement group is made) and rounds others
  down, so the job would claim another quantity than the one planned.
- A path is text the OS takes: no NUL (or other control character), at most `PATH_MAX - 1`
  bytes in UTF-8 and `NAME_MAX` bytes per component (Linux's limits); so is an environment
  value. (Lone surrogates, which JSON can carry and no OS takes, pydantic refuses itself.)

These limits came after specs were first stored: a job's row may hold a spec written before
one of them. Such a row must still read (listings, the job page, the API), so a stored spec
is validated with the context `{"stored": True}` (`service.store.views.Job`), under which the
resource and path limits here are not enforced; the controller checks a stored spec against
them with `recheck` before every attempt (a spec that fails one fails the job without a
start), and a resubmission does too. Environment values are always checked: revision 0012
wrote the control characters older rows held as escapes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, Field, ValidationInfo

RAY_UNIT = 0.0001
"""Ray counts resources in fixed point with 4 decimals (`ray._raylet.RESOURCE_UNIT_SCALING`)."""
PATH_MAX = 4096
"""Bytes of a path with its terminating NUL (Linux)."""
NAME_MAX = 255
"""Bytes of one path component (Linux)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
STORED = "stored"
"""The validation context key of a stored spec read back (see the module's docstring)."""

M = TypeVar("M", bound=BaseModel)


def ray_quantity(value: float) -> float:
    """`value` when Ray can claim exactly that much of a resource; ValueError otherwise."""
    units = value / RAY_UNIT
    if round(units) < 1 or abs(units - round(units)) > 1e-6:
        raise ValueError(f"{value!r} is not a whole number of Ray's resource units"
                         f" ({RAY_UNIT:g}): use a multiple of {RAY_UNIT:g}, at least"
                         f" {RAY_UNIT:g}")
    return value


def env_value(key: str, value: str) -> None:
    """ValueError when `value`, the value of environment variable `key`, is not printable
    text (the OS takes no NUL in it)."""
    if _CONTROL.search(value):
        raise ValueError(f"the value of {key} holds a control character (NUL, newline, ...);"
                         " environment values are printable text")


def os_path(value: str) -> str:
    """`value` when the OS would take it as a path; ValueError naming what it would refuse."""
    if len(value) > PATH_MAX - 1:
        raise ValueError(f"the path has {len(value)} characters; it may have at most"
                         f" {PATH_MAX - 1} characters")
    if "\x00" in value:
        raise ValueError(f"{value!r} holds a NUL byte, which no path can hold")
    if _CONTROL.search(value):
        raise ValueError(f"{value!r} holds a control character (newline, tab, ...); a path"
                         " here is printable text")
    size = len(value.encode())  # valid Unicode: pydantic refuses lone surrogates
    if size > PATH_MAX - 1:
        raise ValueError(f"the path is {size} bytes long in UTF-8; the OS takes at most"
                         f" {PATH_MAX - 1}")
    for part in value.split("/"):
        if (n := len(part.encode())) > NAME_MAX:
            raise ValueError(f"its component {part[:32]!r}... is {n} bytes long in UTF-8; the"
                             f" OS takes at most {NAME_MAX} per component")
    return value


def recheck(spec: M) -> M:
    """`spec`, a stored spec read back (its limits here not enforced), validated again as a
    new submission is; ValidationError naming each field that fails a limit of today."""
    return type(spec).model_validate(spec.model_dump(mode="json"))


def _unless_stored(check: Callable[[Any], Any]) -> AfterValidator:
    """`check` as a validator that a stored spec read back skips."""

    def validate(value: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(STORED):
            return value
        return check(value)

    return AfterValidator(validate)


RayQuantity = Annotated[float, Field(json_schema_extra={"multipleOf": RAY_UNIT}),
                        _unless_stored(ray_quantity)]
"""A resource quantity Ray can claim exactly (the limit is stated in the JSON schema too)."""
OsPath = Annotated[str, Field(max_length=PATH_MAX, json_schema_extra={"maxLength": PATH_MAX - 1}),
                   _unless_stored(os_path)]
"""A path the OS takes: its length and byte limits are checked by `os_path` (and the length
stated in the JSON schema). `max_length` is the bound paths had before those limits, which a
stored spec keeps; pydantic refuses lone surrogates under it."""
