"""MLflow: every job a run, made and fed through MLflow's own client (`MlflowClient`).

Imported only when a job goes to MLflow (MLflow takes a second and 170 MB to import). The
client talks to the server with the server's own credentials (`TRIDENT_MLFLOW_TOKEN`, or
`TRIDENT_MLFLOW_USERNAME` and `_PASSWORD`), given to this client's store alone: they are never
put in the process's environment, which Ray's processes could inherit. MLflow's own retries
are turned off (its default retries for minutes): the exporter retries with its backoff, and
each request waits at most `REQUEST_TIMEOUT_S`.

A run is found again by its tags (`trident.job_id`, and `trident.url` when the server has a
public URL), so a run made just before a crash is not made twice. Metrics go with
`log_batch` in MLflow's batch limits (1,000 values, 100 parameters or tags a request); a value
MLflow has already (same name, step, time and value) is kept once by the server. An ended job's
goodput ledger goes once, as metrics at its last step and end time (`goodput.ettr`,
`goodput.training_s`, ...: `exporter.goodput_metrics`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.store import Job
from service.store.tracking_exports import Export, Sink
from service.tracking.scalars import StepScalars
from service.tracking.sinks import (
    RUN_STATUS,
    TAG_VALUE_MAX,
    TrackerDown,
    TrackerRefused,
    experiment_of,
    params,
    tags,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10
METRICS_PER_REQUEST = 1000
TAGS_PER_REQUEST = 100
_QUIET = ("mlflow.tracking._tracking_service.client", "mlflow.tracking.client",
          "mlflow.utils.requests_utils")
"""MLflow's loggers that would log a line per request or retry."""


@dataclass(frozen=True)
class MlflowCreds:
    """The server's credentials for its MLflow servers (never a job's)."""

    token: str | None = None
    username: str | None = None
    password: str | None = None


def _environment() -> None:
    # MLflow reads these per request; an operator's own values win.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # a line a run
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


def client(uri: str, creds: MlflowCreds) -> Any:
    """An `MlflowClient` of `uri` whose requests carry `creds` (and MLflow's TLS settings)."""
    _environment()
    from mlflow import MlflowClient
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.tracking._tracking_service.client import TrackingServiceClient
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import MlflowHostCreds

    def host_creds() -> MlflowHostCreds:
        base = get_default_host_creds(uri)
        return MlflowHostCreds(
            host=uri, token=creds.token, username=creds.username, password=creds.password,
            ignore_tls_verification=base.ignore_tls_verification,
            client_cert_path=base.client_cert_path, server_cert_path=base.server_cert_path)

    class _Tracking(TrackingServiceClient):  # type: ignore[misc]
        """MLflow's tracking client on a store of ours: the one place credentials go."""

        _store = RestStore(host_creds)

        @property
        def store(self) -> Any:
            return self._store

    made = MlflowClient(tracking_uri=uri)
    made._tracking_client = _Tracking(uri)
    return made


RETRIED = frozenset({401, 403, 408, 429})
"""4xx answers that say nothing about the batch (credentials, time-out, rate): tried again."""


def _classify(exc: Exception) -> Exception:
    """TrackerRefused for MLflow's refusals of what was sent (a 4xx but `RETRIED`),
    TrackerDown for the rest: a batch is dropped only when MLflow will never take it."""
    from mlflow.exceptions import RestException

    if isinstance(exc, RestException):
        status = exc.get_http_status_code()
        if status not in RETRIED and 400 <= status < 500:
            return TrackerRefused(f"MLflow refused it: {exc}"[:2000])
    return TrackerDown(f"{type(exc).__name__}: {exc}"[:2000])


class MlflowSink:
    """One MLflow server: makes each job's run and sends its steps, tags and state."""

    kind = Sink.MLFLOW

    def __init__(self, uri: str, creds: MlflowCreds, public_url: str | None = None) -> None:
        self.target = uri
        self.public_url = public_url
        self.client = client(uri, creds)
        self._experiments: dict[str, str] = {}

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as exc:  # every failure is one of the two kinds
            raise _classify(exc) from exc

    def _experiment(self, name: str) -> str:
        if name in self._experiments:
            return self._experiments[name]
        from mlflow.exceptions import RestException

        found = self._call(self.client.get_experiment_by_name, name)
        if found is None:
            try:
                made = str(self.client.create_experiment(name))
            except RestException as exc:  # made meanwhile by another client
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise _classify(exc) from exc
                made = str(self._call(self.client.get_experiment_by_name, name).experiment_id)
            except Exception as exc:
                raise _classify(exc) from exc
        else:
            made = str(found.experiment_id)
        self._experiments[name] = made
        return made

    def open(self, job: Job) -> tuple[str | None, str | None]:
        from mlflow.entities import Param

        experiment = self._experiment(experiment_of(job))
        run_tags = tags(job, self.public_url)
        query = f"tags.`trident.job_id` = '{job.id}'"
        if "trident.url" in run_tags:
            query += f" and tags.`trident.url` = '{run_tags['trident.url']}'"
        runs = self._call(self.client.search_runs, [experiment], query, max_results=1)
        if runs:
            return runs[0].info.run_id, experiment
        run = self._call(self.client.create_run, experiment, tags=run_tags,
                         run_name=job.name)
        run_id = run.info.run_id
        items = sorted(params(job).items())
        for i in range(0, len(items), TAGS_PER_REQUEST):
            self._call(self.client.log_batch, run_id,
                       params=[Param(k, v) for k, v in items[i:i + TAGS_PER_REQUEST]])
        return run_id, experiment

    def discard(self, run_id: str) -> None:
        self._call(self.client.delete_run, run_id)

    def send(self, job: Job, export: Export, steps: Sequence[StepScalars]) -> None:
        from mlflow.entities import Metric

        assert export.run_id is not None
        metrics = [Metric(name, value, int(s.time.timestamp() * 1000), s.step)
                   for s in steps for name, value in sorted(s.values.items())]
        for i in range(0, len(metrics), METRICS_PER_REQUEST):
            self._call(self.client.log_batch, export.run_id,
                       metrics=metrics[i:i + METRICS_PER_REQUEST])

    def tell(self, job: Job, export: Export, *, final: bool) -> None:
        from mlflow.entities import RunTag

        assert export.run_id is not None
        run_tags = [RunTag("trident.state", job.state.value)]
        if job.error:
            run_tags.append(RunTag("trident.error", job.error[:TAG_VALUE_MAX]))
        self._call(self.client.log_batch, export.run_id, tags=run_tags)
        status = RUN_STATUS[job.state]
        if final and job.state.terminal:
            end = job.finished_at or job.updated_at
            self._call(self.client.set_terminated, export.run_id, status,
                       int(end.timestamp() * 1000))
        else:
            self._call(self.client.update_run, export.run_id, status=status)

    def summarize(self, job: Job, export: Export, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        assert export.run_id is not None
        end = job.finished_at or job.updated_at
        at = int(end.timestamp() * 1000)
        self._call(self.client.log_batch, export.run_id, metrics=[
            Metric(name, value, at, export.step) for name, value in sorted(values.items())])

    def close(self) -> None:
        pass
