"""Secrets: a job's (`JobSpec.secrets`) sealed at rest, and the server's own kept from jobs.

A job's secrets are write-only. `service.submission.intake.submit` seals each value with the
server's key
(`SecretBox`, Fernet: AES-128-CBC with an HMAC-SHA256, from `cryptography`) and the store keeps
the sealed values in a table of their own (`job_secrets`), apart from the spec: a copy of the
database, a backup or a query of the spec holds no secret in clear. Only the controller opens
them, when it starts an attempt, and hands them to the ranks' environment; what the control
plane stores from the ranks (errors, events) passes through `redact` first
(`service.redaction`), and so does what the ranks write to their logs (`workers.runtime.ranklog`).
No route, page, event, export or tracker carries a value; the API shows their names.

The key: `TRIDENT_SECRETS_KEY` (a Fernet key, `SecretBox.new_key()`), or else a key file the
server makes once in its data directory (`secrets.key`, mode 600). The API (which seals) and
the controller (which opens) must share it: the same data directory, or the same
`TRIDENT_SECRETS_KEY`.

The server's own secrets for trackers (`SERVER_SECRETS`: `TRIDENT_MLFLOW_TOKEN`, ...) are read
into its settings and taken out of the environment of every process a job's code can run in
(`without_server_secrets`: the Ray head, a node, the daemon's own Ray), so no job reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from functools import partial
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from service.redaction import redact
from service.store import Store

KEY_FILE = "secrets.key"
"""The key file in the data directory, made on first use when `TRIDENT_SECRETS_KEY` is unset."""

SERVER_SECRETS = ("TRIDENT_MLFLOW_TOKEN", "TRIDENT_MLFLOW_USERNAME", "TRIDENT_MLFLOW_PASSWORD",
                  "TRIDENT_SECRETS_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
                  "MLFLOW_TRACKING_PASSWORD")
"""The server's secrets in its environment (its own, and MLflow's if an operator set them):
never passed on to a process that runs jobs."""

class SecretsUnreadable(RuntimeError):
    """A sealed secret this server's key cannot open (another key sealed it)."""


class SecretBox:
    """Seals and opens secret values with one key (read or made when first needed)."""

    def __init__(self, key: bytes | None = None, key_file: Path | None = None) -> None:
        assert key is not None or key_file is not None
        self._key_file = key_file
        self._fernet = self._make(key) if key is not None else None

    @staticmethod
    def _make(key: bytes) -> Fernet:
        try:
            return Fernet(key)
        except ValueError as exc:
            raise ValueError("the secrets key is not a Fernet key (32 url-safe base64-encoded"
                             " bytes; `python -c 'from cryptography.fernet import Fernet;"
                             " print(Fernet.generate_key().decode())'` makes one)") from exc

    @staticmethod
    def new_key() -> bytes:
        return Fernet.generate_key()

    @classmethod
    def of(cls, key: str | None, data_dir: Path) -> SecretBox:
        """The box of `key` (`TRIDENT_SECRETS_KEY`, checked now), or of the data directory's
        key file (`KEY_FILE`), read or made when a secret is first sealed or opened."""
        if key:
            return cls(key.encode())
        return cls(key_file=data_dir / KEY_FILE)

    def _box(self) -> Fernet:
        if self._fernet is None:
            assert self._key_file is not None
            self._fernet = self._make(_read_or_make(self._key_file))
        return self._fernet

    def seal(self, value: str) -> bytes:
        return self._box().encrypt(value.encode())

    def open(self, sealed: bytes, name: str = "a secret") -> str:
        try:
            return self._box().decrypt(sealed).decode()
        except InvalidToken:
            raise SecretsUnreadable(
                f"{name} was sealed with another key than this server's (TRIDENT_SECRETS_KEY,"
                " or the data directory's secrets.key): the API and the controller must"
                " share one") from None

    def seal_all(self, values: Mapping[str, str]) -> dict[str, bytes]:
        return {k: self.seal(v) for k, v in values.items()}

    def open_all(self, sealed: Mapping[str, bytes]) -> dict[str, str]:
        return {k: self.open(v, f"secret {k}") for k, v in sealed.items()}


def _read_or_make(path: Path) -> bytes:
    """The key in `path`, made now (mode 600, created exclusively, so that two processes
    starting at once agree on one) when there is none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes().strip()
    made = SecretBox.new_key()
    with os.fdopen(fd, "wb") as f:
        f.write(made)
    return made


class JobSecrets:
    """The controller's access to jobs' secrets: opened for an attempt's ranks, and the
    redaction of what it stores from them."""

    def __init__(self, store: Store, box: SecretBox | None) -> None:
        self.store = store
        self.box = box

    def open(self, job_id: int) -> dict[str, str]:
        """The job's secrets by name; SecretsUnreadable when this server cannot open them."""
        sealed = self.store.job_secrets(job_id=job_id)
        if not sealed:
            return {}
        if self.box is None:
            raise SecretsUnreadable("the job has secrets and this controller no key to open"
                                    " them")
        return self.box.open_all(sealed)

    def redactor(self, job_id: int, known: Mapping[str, str] | None = None
                 ) -> Callable[[str], str]:
        """`redact` with the job's secrets (`known`, or opened now; none it cannot open)."""
        if known is None:
            try:
                known = self.open(job_id)
            except SecretsUnreadable:  # its ranks never got them either
                known = {}
        return partial(redact, secrets=dict(known))


def forget_server_secrets(env: MutableMapping[str, str] = os.environ) -> None:
    """Take the server's secrets out of `env` (this process's environment, by default): for
    a process that starts others that run jobs (the daemon's own Ray), once its settings
    have read them."""
    for name in SERVER_SECRETS:
        env.pop(name, None)


def without_server_secrets(env: Mapping[str, str],
                           names: Iterable[str] = SERVER_SECRETS) -> dict[str, str]:
    """`env` without the server's secrets: the environment of a process that runs jobs."""
    drop = set(names)
    return {k: v for k, v in env.items() if k not in drop}
