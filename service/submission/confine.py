"""Keeping a submitted spec inside its job: where it may write, what code it may run, and
which environment variables it may set. Checked at submission (`service.submission.intake.submit`),
with the server's settings and the submitter's role; each refusal is a SpecError naming the field.

- `checkpoint.dir` must resolve, after `..` and symlinks, inside one of the checkpoint roots
  (`TRIDENT_CHECKPOINT_ROOTS`, default the data directory), to a folder of the job's own: not a
  root itself, not the data directory nor anything Trident keeps there, not a folder recorded
  as another job's (`service.files.checkpoint_dirs`; the controller checks that again at start).
- every corpus of `data.train` and `data.valid` (its `.idx` and its `.bin`) must resolve, after
  `..` and symlinks, inside one of the data roots (`TRIDENT_DATA_ROOTS`, default the data
  directory): a job reads no file the server's operator did not put in a data root.
- `model.hf_config` and `init.from_hf` (a Hugging Face config and checkpoint the job reads)
  must be where a job's checkpoint folder may be, though a root itself may be read
  (`CheckpointPlaces.read_refusal`): inside one of the checkpoint roots, not the data
  directory nor anything Trident keeps there, not a folder recorded as a job's. Checked here,
  at submission, as `checkpoint.dir` is (the API read the config with the same rule).
- a `tokens` job's sample order must fit the per-user bound of the sample-order cache
  (`TRIDENT_ORDER_CACHE_USER_BYTES`, `service.files.order_cache`) by the bytes any order of its
  samples takes at least; the rank that builds it checks its exact size again.
- `entrypoint` must name a module under one of `TRIDENT_ENTRYPOINT_MODULES` when that is set.
- `command` runs only where the server has code roots (`TRIDENT_CODE_ROOTS`), and for a
  member only where the server allows members' commands (`TRIDENT_ALLOW_MEMBER_COMMANDS`;
  admins may always): a command runs whatever the workers' user may. Its `workdir` must
  resolve, after `..` and symlinks, to a folder inside one of the code roots.
- `env` and `secrets` (both go into the ranks' environment) may not set variables that change
  how the worker process itself loads (the dynamic loader's, the interpreter's, the shell's
  start-up files), unless they are in `TRIDENT_ENV_ALLOW` or an admin submits; NCCL_*,
  TORCH_*, CUDA_* and other names pass.
- `tracking.mlflow` must be an MLflow server the server allows (`TRIDENT_MLFLOW_URIS`, or
  `TRIDENT_MLFLOW_URI`): the exporter sends the server's own tracker credentials with every
  request (`service.tracking`), so a URI of the user's choosing would hand them over.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from service.contract.hf_config import folder_of
from service.contract.spec import JobSpec, SpecError, normal_uri
from service.files.checkpoint_dirs import CheckpointPlaces
from service.files.order_cache import user_refusal

DENIED_ENV_PREFIXES = ("LD_", "DYLD_", "PYTHON")
"""The dynamic loader's (`LD_PRELOAD`, `LD_LIBRARY_PATH`, `LD_AUDIT`, macOS's `DYLD_*`) and the
interpreter's (`PYTHONPATH`, `PYTHONSTARTUP`, `PYTHONHOME`, `PYTHONUSERBASE`, ...)."""
DENIED_ENV_NAMES = frozenset({"PATH", "BASH_ENV", "ENV", "PERL5LIB", "RUBYOPT", "NODE_OPTIONS",
                              "MALLOC_CONF", "GCONV_PATH"})
"""Other variables that choose which code a process loads or runs at start."""


@dataclass(frozen=True)
class Confinement:
    """The server's limits on a spec, and whether the submitter is an admin."""

    checkpoint_roots: list[Path]
    data_dir: Path | None = None
    """The server's data directory: no job's checkpoint folder is in it but under its
    `checkpoints/`."""
    entrypoint_modules: list[str] = field(default_factory=list)
    data_roots: list[Path] = field(default_factory=list)
    """Where corpora may be (`Settings.data_root_dirs`); empty: no corpus may be named."""
    env_allow: frozenset[str] = frozenset()
    admin: bool = False
    mlflow_uris: frozenset[str] = frozenset()
    """The MLflow servers a spec may name (normalised: `service.contract.spec.normal_uri`)."""
    order_cache_user_bytes: int | None = None
    """The per-user bound of the sample-order cache (`Settings.order_cache_user_bytes`;
    None: not checked here)."""
    code_roots: list[Path] = field(default_factory=list)
    """Where a command job's `workdir` may be (`Settings.code_root_dirs`); empty: no
    command may run."""
    member_commands: bool = False
    """Whether a member may give a `command` (`Settings.allow_member_commands`)."""

    def check(self, spec: JobSpec) -> None:
        """Raise SpecError for the first field that reaches outside the job."""
        if spec.checkpoint.dir is not None:
            self._checkpoint_dir(spec.checkpoint.dir)
        places = CheckpointPlaces(self.checkpoint_roots, self.data_dir)
        for name, folder in (("model.hf_config", spec.model.hf_config if spec.model else None),
                             ("init.from_hf", spec.init.from_hf)):
            if folder is not None and (why := places.read_refusal(folder_of(folder))):
                raise SpecError(name, why)
        for name in ("train", "valid"):
            for i, ref in enumerate(getattr(spec.data, name)):
                if why := data_refusal(ref.path, self.data_roots, spec.data.kind == "chat"):
                    raise SpecError(f"data.{name}.{i}.path", why)
        self._order_cache(spec)
        if spec.entrypoint is not None:
            self._entrypoint(spec.entrypoint)
        if spec.command is not None:
            self._command(spec.workdir)
        for name, variables in (("env", spec.env), ("secrets", spec.secrets)):
            self._env(name, variables)
        if (why := mlflow_refusal(spec.tracking.mlflow, self.mlflow_uris)) is not None:
            raise SpecError("tracking.mlflow", why)

    def _checkpoint_dir(self, raw: str) -> None:
        places = CheckpointPlaces(self.checkpoint_roots, self.data_dir)
        if why := places.refusal(raw) or places.taken(raw):
            raise SpecError("checkpoint.dir", why)

    def _order_cache(self, spec: JobSpec) -> None:
        d, t = spec.data, spec.train
        if not d.corpora or self.order_cache_user_bytes is None:
            return
        samples = t.steps * t.global_batch
        if d.valid or d.valid_fraction:
            samples += d.eval_batches * t.global_batch
        if why := user_refusal(samples, self.order_cache_user_bytes):
            raise SpecError("train.steps", why)

    def _entrypoint(self, entrypoint: str) -> None:
        if not self.entrypoint_modules:
            return
        module = entrypoint.split(":", 1)[0]
        if not any(module == p or module.startswith(p + ".") for p in self.entrypoint_modules):
            raise SpecError("entrypoint", f"module {module!r} is not under the modules this"
                            f" server allows (TRIDENT_ENTRYPOINT_MODULES):"
                            f" {', '.join(self.entrypoint_modules)}")

    def _command(self, workdir: str | None) -> None:
        if not self.code_roots:
            raise SpecError("command", "this server runs no commands: it has no code roots"
                            " (TRIDENT_CODE_ROOTS), the folders a command's workdir must be in")
        if not self.admin and not self.member_commands:
            raise SpecError("command", "only an admin may run a command on this server"
                            " (TRIDENT_ALLOW_MEMBER_COMMANDS is off): a command runs whatever"
                            " the workers' user may")
        if workdir is not None and (why := code_refusal(workdir, self.code_roots)):
            raise SpecError("workdir", why)

    def _env(self, field: str, names: Iterable[str]) -> None:
        """The deny-list for the variables a job's ranks get, from `env` or `secrets` (both
        end up in the same environment): a SpecError naming `field`."""
        if self.admin:
            return
        denied = sorted(k for k in names if k not in self.env_allow
                        and (k.startswith(DENIED_ENV_PREFIXES) or k in DENIED_ENV_NAMES))
        if denied:
            raise SpecError(field, f"{', '.join(denied)} would change how the worker process"
                            " itself loads (LD_*, DYLD_*, PYTHON*, PATH, ...); only an admin may"
                            " set them, or allow them for everyone with TRIDENT_ENV_ALLOW")


def data_refusal(prefix: str, roots: list[Path], chat: bool = False) -> str | None:
    """Why a spec may not name the corpus `prefix` on a server whose data roots are `roots`:
    its `.idx` or `.bin` (with `chat`, those of its loss mask `PREFIX_loss_mask` too) resolves
    outside them. None when all lie inside."""
    real_roots = [os.path.realpath(r) for r in roots]
    allowed = ", ".join(real_roots) or "none (TRIDENT_DATA_ROOTS)"
    prefixes = [prefix, prefix + "_loss_mask"] if chat else [prefix]
    for path in (p + ext for p in prefixes for ext in (".idx", ".bin")):
        real = os.path.realpath(path)
        if not any(real.startswith(r.rstrip(os.sep) + os.sep) for r in real_roots):
            return (f"{path!r} resolves to {real}, outside the server's data roots"
                    f" (TRIDENT_DATA_ROOTS): {allowed}")
    return None


def code_refusal(workdir: str, roots: list[Path]) -> str | None:
    """Why a command may not start in `workdir` on a server whose code roots are `roots`:
    not absolute, not a folder, or resolving outside them. None when it may."""
    real_roots = [os.path.realpath(r) for r in roots]
    allowed = ", ".join(real_roots) or "none"
    if not workdir.startswith("/"):
        return f"{workdir[:200]!r} is not an absolute path"
    real = os.path.realpath(workdir)
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in real_roots):
        return (f"{workdir[:200]!r} resolves to {real[:200]}, outside the server's code roots"
                f" (TRIDENT_CODE_ROOTS): {allowed}")
    if not os.path.isdir(real):
        return f"{workdir[:200]!r} is not a folder on the server"
    return None


def mlflow_refusal(uri: str | None, allowed: frozenset[str]) -> str | None:
    """Why a spec may not name the MLflow server `uri` on a server that allows `allowed`."""
    if uri is None or normal_uri(uri) in allowed:
        return None
    if not allowed:
        return ("this server allows no MLflow server of a spec's choosing (TRIDENT_MLFLOW_URIS"
                " is empty): leave tracking.mlflow out to use the server's own")
    return (f"{uri[:200]} is not among the MLflow servers this server allows"
            f" (TRIDENT_MLFLOW_URIS): {', '.join(sorted(allowed))}")
