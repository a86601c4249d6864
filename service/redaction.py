"""Secret values taken out of text: `redact`, for what the controller stores from a job's
ranks (`service.secrets.JobSecrets.redactor`: errors, events, its own log lines) and for
the ranks' own logs as they are written (`workers.runtime.ranklog`). Apart from
`service.secrets` so that
a rank's process imports no store nor cipher to use it."""

from __future__ import annotations

from collections.abc import Mapping

REDACT_MIN_CHARS = 6
"""Values shorter than this are not searched for in text (they would garble it)."""


def redact(text: str, secrets: Mapping[str, str]) -> str:
    """`text` with every secret value (of at least `REDACT_MIN_CHARS`) replaced by its name."""
    for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1])):
        if len(value) >= REDACT_MIN_CHARS and value in text:
            text = text.replace(value, f"[secret {name}]")
    return text
