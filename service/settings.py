"""Server settings: one object, read from `TRIDENT_*` environment variables.

Used by the API, the controller daemon and `trident up`. In production (`TRIDENT_ENV=prod`)
it refuses the embedded defaults that are only safe on a laptop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.contract.hardware import PROFILES
from service.contract.prices import ProfilePrice


def default_data_dir() -> Path:
    return Path.cwd() / "var"


class Settings(BaseSettings):
    """Everything the control plane is configured with."""

    model_config = SettingsConfigDict(env_prefix="TRIDENT_", extra="ignore",
                                      use_attribute_docstrings=True)

    env: Literal["dev", "test", "prod"] = "dev"
    """Deployment kind; `prod` refuses SQLite and a missing Ray address."""
    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the embedded database, checkpoints and logs live."""
    database_url: str = ""
    """SQLAlchemy URL; empty means a SQLite file in `data_dir`."""
    ray_address: str = ""
    """Address of an existing Ray cluster. Empty: `trident up` starts a local Ray head as a
    supervised process of its own (`service.cluster.rayhead`); the daemon run alone starts one
    inside
    itself, which ends with it."""
    stop_jobs: bool = False
    """Whether a controller stopped by a signal stops its jobs' worker groups too. By default
    they train on, detached, and the next controller re-attaches them (`trident up
    --stop-jobs` sets it)."""
    stop_grace_s: float = Field(default=30.0, ge=5, le=600)
    """How long a stop of `trident up` (SIGTERM, Ctrl-C) may take, from the signal, whatever
    the database or Ray is doing: by then every process it started and stops has ended,
    killed if it had to be (`cli.stopping`)."""
    poll_interval_s: float = Field(default=0.5, gt=0, le=60)
    """How often the controller steps (0.1 s at most while a job's group starts; longer,
    up to `poll_max_interval_s`, while every group trains and nothing changes:
    `service.control.pace`)."""
    poll_max_interval_s: float = Field(default=2.0, gt=0, le=60)
    """The longest wait between controller passes while every group trains and nothing
    changes (never over a third of `lease_s`, nor a quarter of a running job's
    `monitor.hang_timeout_s`; `service.control.pace`): a cancel or a new job that fits beside the
    running ones may wait this long."""
    cancel_grace_s: float = Field(default=5.0, ge=0, le=600)
    """How long workers get to stop by themselves before they are killed."""
    start_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a worker group may take to claim resources and rendezvous."""
    nonfinite_loss_steps: int = Field(default=10, ge=1, le=1_000_000)
    """A job whose ranks finish but whose last this many step losses (or every loss of its
    last attempt, when it ran fewer steps) were NaN or infinite ends FAILED, not SUCCEEDED:
    its weights diverged or were damaged, and the checkpoints it saved hold them."""
    prices: dict[str, ProfilePrice] = Field(default_factory=dict, max_length=256)
    """What an hour of a node profile's devices costs, by profile name (`cpu`, `a100-80gb`,
    ...), as JSON: `{"a100-80gb": {"gpu_hour": 1.8}, "cpu": {"cpu_hour": 0.04}}`. The goodput
    ledger's costs, the plan's cost and the projects' money budgets read them; empty, the
    default: no money is shown anywhere (docs/goodput.md)."""
    lemon_failures: int = Field(default=0, ge=0, le=1000)
    """The lemon rule: a node whose ranks failed this many attempts within `lemon_window_s`
    is cordoned by itself (`trident node uncordon` lets ranks back); 0, the default: never."""
    lemon_window_s: float = Field(default=3600.0, gt=0, le=30 * 86400)
    """The lemon rule's window: the failed attempts counted against a node are those that
    failed this recently."""
    lease_s: float = Field(default=15.0, gt=0, le=600)
    """How long the controller's lease lasts unrenewed: a standby controller (or the one
    `trident up` restarts) takes over at most this long after the leader dies. The leader
    renews it every pass (`poll_interval_s`), well inside it."""
    rank_log_max_bytes: int = Field(default=16 << 20, ge=64 << 10, le=1 << 34)
    """The most bytes of stdout and stderr kept per rank and attempt (16 MiB): the newest
    output, in two halves (`<data_dir>/logs/job-<id>/attempt-<n>/rank-<r>.log` and `.log.1`),
    with their time index (`.log.times`, `.log.times.1`) counted in; held while the disk
    refuses writes too (`workers.runtime.ranklog`)."""
    tag_steps_max_bytes: int = Field(default=64 << 20, ge=1 << 20, le=1 << 34)
    """The most bytes the controller reads of one rank's step reports in a checkpoint tag
    (`<tag>/trident-steps/rank<r>.json`; 64 MiB holds a rank's whole buffer, 50,000 reports,
    at 0.7 to 1.0 KB a report as a dp2 job's measured); a larger file is passed over with a
    warning in the controller's log (docs/checkpoints.md)."""
    data_dir_min_free: float = Field(default=0.05, ge=0, le=1)
    """`GET /api/v1/healthz` names the data directory `nearly full` when less than this
    fraction of its filesystem is free (default 0.05: 5 %). A full disk costs a checkpoint
    save and the log lines it refuses, not the control plane, but it costs them."""
    export_max_concurrent: int = Field(default=2, ge=1, le=64)
    """How many exports (`POST /api/v1/jobs/{id}/exports`, `trident export`) the controller
    runs at once, each a task on the cluster (`service.control.export_run`); the others wait,
    `pending`, for one to end. Each writes the model's Hugging Face folder under an export
    root (`export_roots`) and holds about one shard and one tensor in memory."""
    order_cache_user_bytes: int = Field(default=4 << 30, ge=1 << 20, le=1 << 50)
    """The most bytes of the sample-order cache (`<data_dir>/sample-orders/`, the index of
    each `tokens` job's global sample order, about 30 bytes a sample) that one user's jobs may
    hold (4 GiB): a user's least recently used entries that no running job reads make room
    first; a job whose order would still pass it is refused, at submission when its order
    alone is bigger (`service.files.order_cache`)."""
    order_cache_bytes: int = Field(default=16 << 30, ge=1 << 20, le=1 << 50)
    """The most bytes the whole sample-order cache may hold (16 GiB): past it, the least
    recently used entries that no running job reads are deleted; a build that would still
    pass it is refused."""
    metrics_per_rank: bool = True
    """Whether `GET /metrics` has per-rank series (`trident_rank_*`: one per rank of every
    active job); turn off for very large jobs."""
    api_workers: int = Field(default=0, ge=0, le=64)
    """API processes `trident up` and `python -m api.serve` start (0: the machine's cores,
    at most 4; `api.serve`)."""
    debug_pid_header: bool = False
    """Answer every request with `X-Trident-Pid` (the API process that answered): for the
    tests of several API processes; never in production."""
    allow_faults: bool = False
    """Accept jobs with `faults` (fault injection for tests); never in production."""
    light_ranks: bool = False
    """Accept jobs with `program: light` and run their ranks as the light rank program
    (`workers.rank.light`: steps on the clock, numbers not measured, no torch): for the tests
    of the control plane; never in production."""
    checkpoint_roots: str = ""
    """Comma-separated directories a spec's `checkpoint.dir` must resolve inside (after `..`
    and symlinks); empty means `data_dir` alone."""
    data_roots: str = ""
    """Comma-separated directories a spec's corpora (`data.train`, `data.valid`) must resolve
    inside, `.idx` and `.bin` alike (after `..` and symlinks); empty means `data_dir` alone."""
    export_roots: str = ""
    """Comma-separated directories exports are written under (`trident export`): a requested
    destination must resolve inside one of them (after symlinks; `..` refused), in the job
    owner's folder `<root>/<owner>/`; the default destination is
    `<first root>/<owner>/job-<id>-step<N>`. Empty means `data_dir/exports` alone."""
    spec_file_max_bytes: int = Field(default=1 << 20, ge=4 << 10, le=64 << 20)
    """The largest file a spec names that the API reads at submission (`model.hf_config`'s
    `config.json`, 1 MiB; real ones are a few KiB): a larger one, or one that is not a
    regular file (a FIFO, a device), is a 422 naming the field."""
    spec_file_read_s: float = Field(default=5.0, gt=0, le=300)
    """How long the API waits for a file a spec names (`model.hf_config`) to be read, in a
    thread off its event loop while other requests go on: a read that takes longer (a hung
    network mount) is a 422 naming the field."""
    spec_file_readers: int = Field(default=4, ge=1, le=64)
    """Files a spec names that one API process reads at once (a read past
    `spec_file_read_s` keeps its thread until the file system answers: this bounds the
    threads a hung mount holds; a submission that finds none free within
    `spec_file_read_s` is refused the same way)."""
    data_checks: int = Field(default=4, ge=1, le=256)
    """Corpus checks (a submission's `data.train` and `data.valid` read at submission,
    `service.files.data_check`) the server runs at once, across its API processes; a submission
    that finds none free within `data_check_wait_s` is a 503."""
    data_checks_per_user: int = Field(default=2, ge=1, le=256)
    """Corpus checks one user's submissions run at once; a submission that finds none of its
    user's free within `data_check_wait_s` is a 429."""
    data_check_wait_s: float = Field(default=10.0, ge=0, le=600)
    """How long a submission waits for a corpus check slot (its user's, then the server's)."""
    entrypoint_modules: str = ""
    """Comma-separated module prefixes a spec's `entrypoint` must be under (`examples` allows
    `examples.custom_entrypoint:train`); empty allows any module."""
    code_roots: str = ""
    """Comma-separated directories a command job's `workdir` must resolve inside (after `..`
    and symlinks), where the operator puts the training code the workers run; empty: no job
    may give a `command` (`docs/command.md`)."""
    allow_member_commands: bool = False
    """Whether members may submit `command` jobs (a command runs whatever the workers' user
    may); by default only admins may."""
    env_allow: str = ""
    """Comma-separated variable names that a spec's `env` or `secrets` may set although they
    change how the worker process loads (`LD_PRELOAD`, `PYTHONPATH`, ...); admins may always
    set them."""
    session_hours: float = Field(default=12.0, gt=0, le=24 * 30)
    """How long a dashboard log-in lasts."""
    public_url: str = ""
    """The dashboard's address as people reach it (`https://trident.example.org`): each
    MLflow run links back to its job's page with it (`trident.url`); empty: no link."""
    mlflow_uri: str = ""
    """Every job's MLflow tracking server (`http(s)://host[:port][/path]`): its steps,
    parameters, tags and final state go there as a run (`docs/tracking.md`); empty: none."""
    mlflow_uris: str = ""
    """Comma-separated other MLflow servers a spec's `tracking.mlflow` may name (the server's
    credentials below go to them too)."""
    mlflow_token: SecretStr | None = None
    """The server's bearer token for its MLflow servers; no job can read it."""
    mlflow_username: str = ""
    """The server's user name for its MLflow servers (HTTP basic auth, with the password)."""
    mlflow_password: SecretStr | None = None
    """The server's password for its MLflow servers; no job can read it."""
    tensorboard: bool = True
    """Whether every job's scalars are written as TensorBoard event files under
    `data_dir/tensorboard/job-<id>/` (`trident tensorboard`)."""
    secrets_key: SecretStr | None = None
    """The key (Fernet, 32 url-safe base64 bytes) jobs' secrets are sealed with in the
    database; unset: a key file the server makes in `data_dir` (`secrets.key`, mode 600).
    The API and the controller must share it (`service.secrets`). Checked when they start
    (a wrong one is a message without the value, never pydantic's, which quotes it)."""

    @field_validator("prices")
    @classmethod
    def _priced_profiles(cls, v: dict[str, ProfilePrice]) -> dict[str, ProfilePrice]:
        unknown = sorted(set(v) - set(PROFILES))
        if unknown:
            raise ValueError(f"prices: unknown node profile(s) {unknown}; known:"
                             f" {sorted(PROFILES)}")
        return v

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, v: str) -> str:
        from service.contract.spec import check_uri

        return check_uri(v) if v else v

    @field_validator("mlflow_uris")
    @classmethod
    def _mlflow_uris(cls, v: str) -> str:
        from service.contract.spec import check_uri

        return ",".join(check_uri(u.strip()) for u in v.split(",") if u.strip())

    @model_validator(mode="after")
    def _safe_in_prod(self) -> Settings:
        if self.lease_s < 3 * self.poll_interval_s:
            raise ValueError(f"TRIDENT_LEASE_S ({self.lease_s:g}) must be at least three"
                             f" controller passes (TRIDENT_POLL_INTERVAL_S"
                             f" {self.poll_interval_s:g}), so that a renewal is never late")
        if self.env == "prod":
            if not self.database_url or self.database_url.startswith("sqlite"):
                raise ValueError("TRIDENT_DATABASE_URL must name a server database in prod")
            if not self.ray_address:
                raise ValueError("TRIDENT_RAY_ADDRESS must be set in prod")
            if self.allow_faults:
                raise ValueError("TRIDENT_ALLOW_FAULTS must not be set in prod")
            if self.light_ranks:
                raise ValueError("TRIDENT_LIGHT_RANKS must not be set in prod")
            if self.debug_pid_header:
                raise ValueError("TRIDENT_DEBUG_PID_HEADER must not be set in prod")
        return self

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'trident.db'}"

    @property
    def checkpoint_root_dirs(self) -> list[Path]:
        """`checkpoint_roots` as paths (the data directory when empty)."""
        roots = [Path(p.strip()) for p in self.checkpoint_roots.split(",") if p.strip()]
        return roots or [self.data_dir]

    @property
    def data_root_dirs(self) -> list[Path]:
        """`data_roots` as paths (the data directory when empty)."""
        roots = [Path(p.strip()) for p in self.data_roots.split(",") if p.strip()]
        return roots or [self.data_dir]

    @property
    def code_root_dirs(self) -> list[Path]:
        """`code_roots` as paths (none when empty: no command may run)."""
        return [Path(p.strip()) for p in self.code_roots.split(",") if p.strip()]

    @property
    def export_root_dirs(self) -> list[Path]:
        """`export_roots` as paths (`data_dir/exports` when empty)."""
        roots = [Path(p.strip()) for p in self.export_roots.split(",") if p.strip()]
        return roots or [self.data_dir / "exports"]

    @property
    def mlflow_uri_list(self) -> list[str]:
        return [u for u in self.mlflow_uris.split(",") if u]

    @property
    def entrypoint_prefixes(self) -> list[str]:
        return [p.strip() for p in self.entrypoint_modules.split(",") if p.strip()]

    @property
    def env_allowed(self) -> frozenset[str]:
        return frozenset(p.strip() for p in self.env_allow.split(",") if p.strip())

    @property
    def checkpoint_root(self) -> Path:
        return self.data_dir / "checkpoints"

    @property
    def log_root(self) -> Path:
        """Where rank logs live (`service.files.ranklogs`)."""
        return self.data_dir / "logs"
