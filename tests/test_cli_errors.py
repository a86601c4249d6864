"""Every `trident` error is one line, tried as a new user would: `error: ...` on stderr, a
non-zero exit, what went wrong and what to do, never a box of several lines or a traceback.
Usage errors, a spec that is not YAML, a refused cancel, a cancel with nobody to answer its
question, a server URL with the API's path in it, an export whose download breaks off or whose
folder cannot be made, a data dir that cannot be made (`bootstrap`, `controller`, `up`); and
`trident --help`, whose command lines are whole sentences. Through Typer's CliRunner against
a live API server (the `live` fixture), and as a real process where the terminal (or its
absence) matters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from cli.common import first_sentence
from cli.main import app
from service.contract.states import JobState
from tests.cli_stack import Live
from tests.conftest import user_token
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "examples/tiny.yaml")
runner = CliRunner()


def trident(*args: str, server: str | None = None) -> Result:
    """`trident ARGS [--server URL]` as a user types it."""
    return runner.invoke(app, [*args, *(["--server", server] if server else [])],
                         prog_name="trident")


def one_line(r: Result, code: int) -> str:
    """The one error line of a failed command (checked: stderr is that line alone)."""
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output and "╭" not in r.output and "│" not in r.output
    return lines[0]


def test_usage_errors_are_one_line_with_the_help_to_read() -> None:
    assert one_line(trident("status", "abc"), 2) == (
        "error: Invalid value for 'job_id': Input should be a valid integer, unable to parse"
        " string as an integer (`trident status --help` shows the usage)")
    assert one_line(trident("describe", "0"), 2) == (
        "error: Invalid value for 'job_id': Input should be greater than or equal to 1"
        " (`trident describe --help` shows the usage)")
    assert one_line(trident("submit"), 2) == (
        "error: Missing argument 'spec' (`trident submit --help` shows the usage)")
    assert one_line(trident("stauts"), 2).startswith("error: No such command 'stauts'")
    assert one_line(trident("user", "add", "bob", "--colour", "red"), 2) == (
        "error: No such option: --colour (`trident user add --help` shows the usage)")
    assert trident("--help").exit_code == 0  # asking for help is no error


def test_a_spec_that_is_not_yaml_is_one_line_naming_where(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: [a\n  b: c\n")
    for args in (["validate", str(bad)], ["plan", str(bad)],
                 ["submit", str(bad), "--server", "http://127.0.0.1:9"]):
        assert one_line(trident(*args), 2) == (
            f"error: {bad} is not valid YAML: line 3, column 4: expected ',' or ']', but got"
            " ':' (while parsing a flow sequence)")
    bad.write_text("name: x\n\tmodel: y\n")
    assert "is not valid YAML: line 2, column 1: found character '\\t'" in one_line(
        trident("validate", str(bad)), 2)


def test_a_spec_error_names_its_field_once(tmp_path: Path) -> None:
    line = one_line(trident("validate", TINY, "--set", "parallel.tp=3"), 2)
    assert line == (f"error: {TINY}: invalid spec: parallel.tp: tp(3) does not divide"
                    " heads(4) (from --set parallel.tp=3)")
    assert line.count("spec:") == 1
    # Several fields wrong: one line still, each field named.
    bad = tmp_path / "two.yaml"
    bad.write_text("name: x\nmodel: {preset: gpt-tiny}\ntrain: {steps: 0, stepz: 1}\n")
    assert one_line(trident("validate", str(bad)), 2) == (
        f"error: {bad}: invalid spec: train.steps: Input should be greater than or equal to 1;"
        " train.stepz: Extra inputs are not permitted")


def test_a_refused_cancel_is_an_error_line_naming_the_job(
        live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    ok, ended = (int(trident("submit", TINY, "-d", server=live.url).stdout) for _ in range(2))
    live.store.request_cancel(job_id=ended)
    r = trident("cancel", str(ended), str(ok), "--yes", server=live.url)
    assert one_line(r, 1) == f"error: job {ended}: 409: job {ended} is already CANCELLED"
    assert r.stdout == f"job {ok}: CANCELLED (cancel requested)\n"
    monkeypatch.setenv("TRIDENT_TOKEN", user_token(live.store, "vic", "viewer"))
    assert one_line(trident("cancel", str(ok), "--yes", server=live.url), 1).startswith(
        f"error: job {ok}: 403: jobs:cancel")


def test_cancel_without_a_terminal_says_to_use_yes(live: Live) -> None:
    """No one can answer the question (stdin is not a terminal, and empty): nothing is
    cancelled, and the line says how to cancel without being asked."""
    job_id = int(trident("submit", TINY, "-d", server=live.url).stdout)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(Path(sys.executable).parent / "trident"), "cancel", str(job_id),
                           "--server", live.url], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 1, done
    assert done.stderr == "error: no answer on stdin: nothing cancelled (--yes cancels" \
                          " without asking)\n"
    assert done.stdout.startswith(f"cancel 1 job(s):\n  {job_id}\nproceed? [y/N]")
    assert "Aborted" not in done.stdout + done.stderr
    assert live.store.get_job(job_id=job_id).state == JobState.QUEUED


def test_a_server_url_with_the_apis_path_is_named(live: Live) -> None:
    line = one_line(trident("status", server=live.url + "/api/v1"), 2)
    assert line == (f"error: --server: {live.url}/api/v1 ends in /api/v1: give the server's"
                    f" base URL, {live.url}")
    line = one_line(trident("status", server=live.url + "/trident"), 2)
    assert line.startswith(f"error: {live.url}/trident/api/v1/jobs?")
    assert "404: no such route of the Trident API (GET); is the server URL the base URL of a" \
           " Trident server?" in line
    assert one_line(trident("whoami", server="127.0.0.1:8000"), 2) == (
        "error: --server: '127.0.0.1:8000' is not an http(s) URL (e.g. http://127.0.0.1:8000)")


def test_help_lists_each_command_by_its_first_sentence_whole() -> None:
    """`trident --help` (and a group's) gives each command the first sentence of its
    docstring, on one line where the terminal is wide enough, never a sentence cut at the
    docstring's line breaks."""
    group = typer.main.get_command(app)
    for prefix, cmds in [([], group.commands),  # type: ignore[attr-defined]
                         *(([name], cmd.commands) for name, cmd in
                           group.commands.items()  # type: ignore[attr-defined]
                           if hasattr(cmd, "commands"))]:
        r = runner.invoke(app, [*prefix, "--help"], prog_name="trident",
                          env={"COLUMNS": "400"})
        assert r.exit_code == 0, r.output
        for name, cmd in cmds.items():
            if hasattr(cmd, "commands"):
                continue
            sentence = first_sentence(cmd.callback.__doc__)
            assert sentence == cmd.short_help and sentence[-1] in ".?", (name, sentence)
            assert "\n" not in sentence and len(sentence) > 20, (name, sentence)
            assert re.search(rf"│ {name} +{re.escape(sentence)} +│", r.output), (
                prefix, name, r.output)
    assert first_sentence("Do a thing, e.g. this one.\n  Then more.\n\nExample: x") == \
        "Do a thing, e.g. this one."


@pytest.mark.parametrize("args", [["status", "abc"], ["cancel", "1", "--yes"]])
def test_a_real_process_prints_no_box(args: list[str]) -> None:
    """As a user's shell runs it (no CliRunner): the same one line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    done = subprocess.run([str(Path(sys.executable).parent / "trident"), *args, "--server",
                           "http://127.0.0.1:9/api/v1"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("error: "), done


def test_an_export_whose_answer_breaks_off_is_one_line_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server dies mid-download (`kill -9` of `trident up`): here a server that takes the
    # export, says it is done with one file of 1 MB, then sends 4 KB of that file and closes.
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    record = {"id": 1, "job_id": 7, "step": 3, "state": "done", "destination": "/x",
              "max_shard_bytes": 5 * 10**9, "files": ["model.safetensors"], "bytes": 10**6,
              "created_at": "2026-01-01T00:00:00Z"}

    class Answer(BaseHTTPRequestHandler):
        def _json(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._json(202, {**record, "state": "pending", "files": [], "bytes": None})

        def do_GET(self) -> None:  # noqa: N802
            if self.path.endswith("/files"):
                self._json(200, {"export_id": 1, "items": [
                    {"name": "model.safetensors", "bytes": 10**6}]})
            elif "/files/" in self.path:
                self.send_response(200)
                self.send_header("Content-Length", str(10**6))
                self.end_headers()
                self.wfile.write(b"\0" * 4096)
                self.close_connection = True
            else:
                self._json(200, record)

        def log_message(self, *args: object) -> None:
            pass

    monkeypatch.setenv("TRIDENT_TOKEN", "t" * 43)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        server = f"http://127.0.0.1:{srv.server_address[1]}"
        line = one_line(trident("export", "7", "--out", str(tmp_path / "model"),
                                server=server), 2)
    finally:
        srv.shutdown()
        srv.server_close()
    assert line.startswith(f"error: cannot reach the Trident API at {server}: the export of"
                           " job 7 broke off: "), line
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the partial files


def test_an_export_to_a_folder_it_cannot_make_is_one_line(live: Live, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    line = one_line(trident("export", "1", "--out", str(tmp_path / "file" / "model"),
                            server=live.url), 2)
    assert line == f"error: --out {tmp_path}/file/model: Not a directory ({tmp_path}/file)"


def test_a_data_dir_it_cannot_make_is_one_line_naming_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    var = tmp_path / "file" / "var"
    expected = f"error: {var}: Not a directory"
    assert one_line(trident("bootstrap", "--data-dir", str(var)), 2) == expected
    # The controller says so once, instead of a daemon restarted over it forever.
    monkeypatch.setenv("TRIDENT_DATA_DIR", str(var))
    assert one_line(trident("controller"), 2) == expected
    # `trident up` as a user's shell runs it (it sets its settings in its own environment).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    done = subprocess.run([str(Path(sys.executable).parent / "trident"), "up", "--port",
                           str(free_port())], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected + "\n"), done
