"""The server's trackers: where a job's steps go, chosen at submission, and the sinks that
send them.

`TrackingConfig.of(settings)` reads `TRIDENT_MLFLOW_URI` (every job's MLflow, unless its spec
names another or turns tracking off), `TRIDENT_MLFLOW_URIS` (the others a spec may name), the
server's MLflow credentials and `TRIDENT_TENSORBOARD` (event files under the data directory).
The API confines a spec's `tracking.mlflow` to `mlflow_allowed` (`service.submission.confine`).
`targets` is what `service.submission.intake.submit` stores with a job (a cursor per tracker, the
job's for good: a later change of the settings does not move a job's run); `make_sink` is what the
exporter sends through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from service.contract.spec import TrackingSpec, normal_uri
from service.store.tracking_exports import Sink

if TYPE_CHECKING:
    from service.settings import Settings
    from service.tracking.mlflow_sink import MlflowCreds
    from service.tracking.sinks import TrackerSink

TENSORBOARD_DIR = "tensorboard"
"""Under the data directory: `tensorboard/job-<id>/`."""


@dataclass(frozen=True)
class TrackingConfig:
    mlflow_uri: str | None = None
    """Every job's MLflow server (`TRIDENT_MLFLOW_URI`), unless its spec says otherwise."""
    mlflow_allowed: frozenset[str] = frozenset()
    """The MLflow servers a spec may name: `TRIDENT_MLFLOW_URIS` and `mlflow_uri`."""
    tensorboard_root: Path | None = None
    """Where jobs' event files go (None: no TensorBoard files)."""
    public_url: str | None = None
    """The dashboard's address, for each run's `trident.url` tag."""
    token: str | None = field(default=None, repr=False)
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, settings: Settings) -> TrackingConfig:
        uri = normal_uri(settings.mlflow_uri) if settings.mlflow_uri else None
        allowed = {normal_uri(u) for u in settings.mlflow_uri_list} | ({uri} if uri else set())
        token, password = settings.mlflow_token, settings.mlflow_password
        return cls(mlflow_uri=uri, mlflow_allowed=frozenset(allowed),
                   tensorboard_root=settings.data_dir / TENSORBOARD_DIR
                   if settings.tensorboard else None,
                   public_url=settings.public_url or None,
                   token=token.get_secret_value() if token is not None else None,
                   username=settings.mlflow_username or None,
                   password=password.get_secret_value() if password is not None else None)

    def targets(self, tracking: TrackingSpec) -> dict[str, str]:
        """The trackers a job with this `tracking` goes to: sink -> the MLflow URI, or
        `tensorboard` (the directory of that name in the data directory of the controller
        that writes the files)."""
        if not tracking.enabled:
            return {}
        out = {}
        uri = tracking.mlflow or self.mlflow_uri
        if uri:
            out[Sink.MLFLOW.value] = uri
        if self.tensorboard_root is not None:
            out[Sink.TENSORBOARD.value] = TENSORBOARD_DIR
        return out

    def allows(self, kind: Sink, target: str) -> bool:
        """Whether a stored target may still be sent to: an MLflow server the server allows
        now (its credentials go there), the TensorBoard root while files are written."""
        if kind == Sink.MLFLOW:
            return normal_uri(target) in self.mlflow_allowed
        return self.tensorboard_root is not None

    def creds(self) -> MlflowCreds:
        from service.tracking.mlflow_sink import MlflowCreds

        return MlflowCreds(token=self.token, username=self.username, password=self.password)

    def make_sink(self, kind: Sink, target: str) -> TrackerSink:
        """A sink of `kind` to `target` (MLflow is imported here, the first time)."""
        if kind == Sink.MLFLOW:
            from service.tracking.mlflow_sink import MlflowSink

            return MlflowSink(target, self.creds(), self.public_url)
        from service.tracking.tensorboard_sink import TensorBoardSink

        assert self.tensorboard_root is not None, "allows() said no"
        return TensorBoardSink(self.tensorboard_root)
