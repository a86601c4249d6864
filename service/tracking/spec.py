"""The job spec's `tracking` section (`JobSpec.tracking`), and the server's confinement of it.

A spec may name an MLflow server only among those the server allows (`TRIDENT_MLFLOW_URIS`,
plus `TRIDENT_MLFLOW_URI`): the exporter sends the server's own tracker credentials
(`TRIDENT_MLFLOW_TOKEN`, ...) with every request, so a URI of the user's choosing would hand
them over.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

_URI = re.compile(r"^https?://[^\s/?#@]+(?::\d+)?(?:/[^\s?#]*)?$")
"""http(s), a host (no user:password@), an optional port and path; no query or fragment."""
EXPERIMENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,249}$"
DEFAULT_EXPERIMENT = "trident"


def normal_uri(uri: str) -> str:
    """`uri` as compared with the allowed ones: without a trailing slash."""
    return uri.rstrip("/")


def check_uri(uri: str) -> str:
    """`uri` normalised, or ValueError saying what an MLflow URI here must look like."""
    if not _URI.match(uri):
        raise ValueError(f"{uri[:200]!r} is not an http(s) URI without credentials, query or"
                         " fragment (http(s)://host[:port][/path])")
    return normal_uri(uri)


class TrackingSpec(BaseModel):
    """Where the job's metrics go besides Trident's own store (`docs/tracking.md`): sent by
    the control plane from the store, never by the ranks."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    mlflow: Annotated[str, Field(max_length=2048)] | None = None
    """An MLflow tracking server for this job (`http(s)://host[:port][/path]`), one of those
    the server allows (`TRIDENT_MLFLOW_URIS`); default: the server's `TRIDENT_MLFLOW_URI`,
    if it has one."""
    experiment: Annotated[str, Field(pattern=EXPERIMENT_PATTERN)] | None = None
    """The MLflow experiment the job's run goes into (default: the job's project, or
    `trident`)."""
    enabled: bool = True
    """False: this job goes to no tracker (neither MLflow nor TensorBoard files)."""

    @field_validator("mlflow")
    @classmethod
    def _http_uri(cls, v: str | None) -> str | None:
        return None if v is None else check_uri(v)


def mlflow_refusal(uri: str | None, allowed: Collection[str]) -> str | None:
    """Why a spec may not name `uri` on a server that allows `allowed`; None when it may."""
    if uri is None or normal_uri(uri) in {normal_uri(a) for a in allowed}:
        return None
    if not allowed:
        return ("this server allows no MLflow server of a spec's choosing (TRIDENT_MLFLOW_URIS"
                " is empty): leave tracking.mlflow out to use the server's own")
    return (f"{uri[:200]} is not among the MLflow servers this server allows"
            f" (TRIDENT_MLFLOW_URIS): {', '.join(sorted(allowed))}")
