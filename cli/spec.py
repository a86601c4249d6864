"""Reading a job spec for the CLI: the file, then `--set FIELD=VALUE` overrides
(`train.steps=100`, `parallel.tp=2`), then validation, every error naming its field.

A value is read as a YAML scalar, as it would be in the file (`100` an integer, `3e-4` a
float, `bf16` a string, `true` a boolean). An override names a field the spec has: an unknown
one is refused before anything is sent, naming the fields its parent does have.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import typer
import yaml
from pydantic import BaseModel, ValidationError

from cli.common import fail
from service.contract import hf_config
from service.contract.spec import JobSpec
from service.contract.specfile import load_yaml, set_field

FIELD_PREFIX = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)*): (.*)$", re.S)
"""A spec check across fields says which field it refuses first: `parallel.tp: tp(3) ...`."""

SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="FIELD=VALUE",
    help="Override a spec field (repeat), e.g. --set train.steps=100 --set parallel.tp=2;"
         " the value is read as YAML.")]


def read_spec_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML (or JSON) spec file."""
    try:
        raw = load_yaml(path.read_text())
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    except yaml.YAMLError as exc:
        fail(f"{path} is not valid YAML: {yaml_problem(exc)}")
    if not isinstance(raw, dict):
        fail(f"{path}: a spec is a mapping of fields, got {type(raw).__name__}")
    return raw


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's several-line error as one line: where, then what (`line 3, column 4:
    expected ',' or ']', but got ':'`)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    context = getattr(exc, "context", None)
    return (f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
            + (f" ({context})" if context else ""))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through `X | None`, `Annotated` and the like)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType, Annotated):
        for arg in typing.get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is dict:
        return True
    return origin in (Union, types.UnionType, Annotated) and any(
        _is_mapping(a) for a in typing.get_args(annotation))


def check_path(field: str) -> None:
    """Refuse a `--set` field the spec does not have, naming the ones it has there."""
    model: type[BaseModel] | None = JobSpec
    parts = field.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the spec"
        if model is None:
            fail(f"--set {field}: {where} has no fields")
        info = model.model_fields.get(part)
        if info is None:
            fail(f"--set {field}: unknown field {'.'.join(parts[:i + 1])} ({where} has:"
                 f" {', '.join(model.model_fields)})")
        if _is_mapping(info.annotation) and i + 1 < len(parts):
            if i + 2 < len(parts):
                fail(f"--set {field}: {'.'.join(parts[:i + 2])} is a plain value")
            return  # `env.NAME`: any key
        model = _model_in(info.annotation)


def apply_sets(raw: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """`raw` with each `FIELD=VALUE` applied in order (a field that held a scalar, like
    `parallel: auto`, becomes a mapping when one of its fields is set)."""
    for item in sets:
        field, eq, text = item.partition("=")
        field = field.strip()
        if not eq or not field or any(not p for p in field.split(".")):
            fail(f"--set {item!r}: expected FIELD=VALUE, e.g. train.steps=100")
        check_path(field)
        try:
            value = load_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            fail(f"--set {field}: {text!r} is not a YAML value")
        set_field(raw, field, value)
    return raw


def validate_spec(raw: dict[str, Any], origin: str, sets: list[str] | None = None) -> JobSpec:
    """`raw` as a `JobSpec`; errors name the field (and the `--set` that made it, if any)."""
    try:
        with hf_config.reading(hf_config.local_reader):  # model.hf_config: the user's file
            return JobSpec.model_validate(raw)
    except ValidationError as exc:
        set_fields = {s.partition("=")[0].strip(): s for s in sets or []}
        lines = []
        for e in exc.errors():
            loc = ".".join(str(p) for p in e["loc"])
            msg = str(e["msg"]).removeprefix("Value error, ")
            if not loc and (named := FIELD_PREFIX.match(msg)):
                loc, msg = named.group(1), named.group(2)  # a check across fields names one
            loc = loc or "spec"
            made = next((s for f, s in set_fields.items()
                         if loc == f or loc.startswith(f + ".") or f.startswith(loc + ".")),
                        None)
            lines.append(f"{loc}: {msg}" + (f" (from --set {made})" if made else ""))
        fail(f"{origin}: invalid spec: {'; '.join(lines)}")


def load_spec(path: Path, sets: list[str] | None = None) -> JobSpec:
    """Read a spec file, apply `--set` overrides and validate it, naming the field of any
    error."""
    return validate_spec(apply_sets(read_spec_file(path), sets or []), str(path), sets)
