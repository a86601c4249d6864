"""Health checks for containers (docker-compose's `healthcheck`):
`python -m api.compose_check api [URL] | controller | ray [URL]`. Exit status 0 when healthy;
otherwise 1, with the reason on stderr (which `docker inspect` shows).

- `api`: the API answers `GET /api/v1/healthz` and reaches the database. A 503 `degraded`
  that is only about the controller counts as healthy here: the controller's lease is the
  controller's health, not the API's, and the controller's container starts only once the
  API is healthy (the API brings the schema up to date first), so judging the API by the
  lease would keep both down for good.
- `controller`: some controller holds an unexpired lease on the configured database (read
  straight from the store, as healthz does, so no API is needed). A standby is healthy while a
  leader acts; with none, every controller replica is unhealthy.
- `ray`: the local Ray node's dashboard agent says its raylet (and on the head, the GCS) is
  alive.
"""

from __future__ import annotations

import json
import sys

import httpx

from api.routes.health import health
from service.settings import Settings
from service.store import Store

API_URL = "http://127.0.0.1:8000"
RAY_AGENT_URL = "http://127.0.0.1:52365"
"""Ray's dashboard agent, on every node (its default `--dashboard-agent-listen-port`)."""
TIMEOUT_S = 5.0


def check_api(client: httpx.Client) -> str | None:
    """None when the API behind `client` is up and reaches its database; else why not."""
    try:
        r = client.get("/api/v1/healthz")
        body = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        return f"the API does not answer: {exc}"
    if r.status_code not in (200, 503) or not isinstance(body, dict):
        return f"healthz answered {r.status_code}"
    if body.get("database") != "ok":
        return f"the API does not reach the database: {body.get('database')}"
    return None


def check_controller(settings: Settings) -> str | None:
    """None when a controller holds an unexpired lease on the settings' database."""
    store = Store(settings.db_url)
    try:
        r = health(store)
    finally:
        store.close()
    if r.status_code == 200:
        return None
    body = json.loads(bytes(r.body))
    if body.get("database") != "ok":
        return f"the database does not answer: {body.get('database')}"
    return f"no controller leads: {body['controller'].get('error')}"


def check_ray(client: httpx.Client) -> str | None:
    """None when the Ray node's agent behind `client` reports it healthy."""
    try:
        r = client.get("/api/healthz")
    except httpx.HTTPError as exc:
        return f"the Ray node's agent does not answer: {exc}"
    if r.status_code != 200:
        return f"the Ray node is unhealthy ({r.status_code}): {r.text.strip()[:200]}"
    return None


def main(argv: list[str]) -> int:
    what, url = (argv + [""])[:2] if argv else ("", "")
    if what == "api":
        with httpx.Client(base_url=url or API_URL, timeout=TIMEOUT_S) as client:
            problem = check_api(client)
    elif what == "controller":
        problem = check_controller(Settings())
    elif what == "ray":
        with httpx.Client(base_url=url or RAY_AGENT_URL, timeout=TIMEOUT_S) as client:
            problem = check_ray(client)
    else:
        print("usage: python -m api.compose_check api [URL] | controller | ray [URL]",
              file=sys.stderr)
        return 2
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
