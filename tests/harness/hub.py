"""A loopback Hugging Face hub for tests: enough of `/resolve/` for `hf_hub_download`, and of the
write API for `HfApi.create_repo` and `HfApi.create_commit`.

The real `huggingface_hub` client talks to it over HTTP when `HF_ENDPOINT` points at
`HubServer.endpoint`. It serves `HEAD` and `GET` on `/<repo>/resolve/<revision>/<file>`
with the headers the client needs (`X-Repo-Commit`, `ETag`, `Content-Length`) and
answers failures the way the hub does, with an `X-Error-Code` header the client turns
into its typed errors:

- unknown repo: 404 `RepoNotFound` (`RepositoryNotFoundError`);
- private repo without `Authorization: Bearer <token>`: 401 `RepoNotFound`;
- gated repo: 403 `GatedRepo` (`GatedRepoError`), whatever the token;
- forbidden repo: a plain 403 without an error code (as for a token lacking read access);
- unknown revision: 404 `RevisionNotFound` (`RevisionNotFoundError`);
- unknown file: 404 `EntryNotFound` (`RemoteEntryNotFoundError`).

Writes (POST) need `Authorization: Bearer <token>` (else 401): `/api/repos/create` makes an
empty repo (409 if it exists), `/api/validate-yaml` accepts any model card,
`/api/models/<repo>/preupload/<revision>` takes every file as a regular one (no LFS), and
`/api/models/<repo>/commit/<revision>` applies the NDJSON commit as one new commit on the
branch, whose sha then resolves too; with `refuse_commits` set it answers 403 and changes
nothing, as the hub does for a token without write access.

Repo ids must be `namespace/name`; dataset repos are keyed `datasets/namespace/name`.
Every other path gets a bare 404. Every request is
recorded (`HubServer.requests`). With `delay_s`, every answer waits that long (a slow
hub); stopping the server releases the waiting requests.

`hub_call` runs code in a fresh interpreter against a hub: the client reads HF_ENDPOINT,
HF_TOKEN, HF_HUB_OFFLINE and its cache location when it is imported.

Usage::

    with serve_hub({"org/repo": {"main": (sha, {"file.json": b"{}"})}}) as hub:
        env["HF_ENDPOINT"] = hub.endpoint
        ...
    assert hub.requests[0].method == "HEAD"
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

Files = Mapping[str, bytes]
"""File name (path inside the repo) -> content."""
Revisions = Mapping[str, tuple[str, Files]]
"""Revision name (branch or tag) -> (40-hex commit sha, files at that commit)."""

DEFAULT_TOKEN = "hf_loopback_test_token"
TIMEOUT_ENV = "STAGETRAIN_HUB_TIMEOUT_S"
PUSH_TIMEOUT_ENV = "STAGETRAIN_HUB_PUSH_TIMEOUT_S"
NO_BACKOFF_SLEEP = """
import time
time.sleep = lambda seconds: None  # the client's retry backoff (1+2+4+8+8 s); requests stay real
"""


@dataclass(frozen=True, slots=True)
class Request:
    """One request the server received."""

    method: str
    path: str
    """The request target as sent (URL-quoted)."""
    authorization: str | None
    """The `Authorization` header, or None when absent."""


def git_blob_sha(content: bytes) -> str:
    """The git blob id of `content`, which the hub sends as the ETag of a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def commit_sha(seed: str) -> str:
    """A deterministic 40-hex commit id for tests."""
    return hashlib.sha1(seed.encode()).hexdigest()


def closed_port() -> int:
    """A loopback port with nothing listening on it (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HubServer:
    """A threaded loopback HTTP server that imitates the hub's file-resolve endpoint."""

    def __init__(
        self,
        repos: Mapping[str, Revisions],
        *,
        private: frozenset[str] | set[str] = frozenset(),
        gated: frozenset[str] | set[str] = frozenset(),
        forbidden: frozenset[str] | set[str] = frozenset(),
        token: str = DEFAULT_TOKEN,
        delay_s: float = 0.0,
    ) -> None:
        """Serve `repos`; those in `private` need `Authorization: Bearer <token>`."""
        unknown = (set(private) | set(gated) | set(forbidden)) - set(repos)
        if unknown:
            raise ValueError(f"private/gated/forbidden repos not in repos: {sorted(unknown)}")
        for repo, revisions in repos.items():
            for revision, (sha, _) in revisions.items():
                if len(sha) != 40 or any(c not in "0123456789abcdef" for c in sha):
                    raise ValueError(f"{repo}@{revision}: commit {sha!r} is not 40 lowercase hex")
        self.repos = {repo: dict(revisions) for repo, revisions in repos.items()}
        self.refuse_commits = False
        self.private = frozenset(private)
        self.gated = frozenset(gated)
        self.forbidden = frozenset(forbidden)
        self.token = token
        self.delay_s = delay_s
        self.stopping = threading.Event()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._httpd.server_address[1]

    @property
    def endpoint(self) -> str:
        """The value for HF_ENDPOINT."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve in a background thread."""
        # A short poll interval: shutdown() waits for the serving loop to notice it.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket (the port then refuses connections)."""
        self.stopping.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def record(self, request: Request) -> None:
        """Remember one request (thread-safe)."""
        with self._lock:
            self.requests.append(request)

    def resolve(self, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and body for a HEAD or GET of `path`."""
        parts = urlsplit(path).path.split("/")
        # Dataset repos live under /datasets/; they are keyed "datasets/<org>/<name>".
        prefix = ""
        if len(parts) > 1 and parts[1] == "datasets":
            prefix, parts = "datasets/", ["", *parts[2:]]
        # ['', org, name, 'resolve', revision, *file]
        if len(parts) < 6 or parts[3] != "resolve":
            return 404, {}, b"Not Found"
        repo = f"{prefix}{unquote(parts[1])}/{unquote(parts[2])}"
        revision = unquote(parts[4])
        filename = unquote("/".join(parts[5:]))
        if repo not in self.repos:
            return _error(404, "RepoNotFound", f"Repository {repo} not found")
        if repo in self.gated:
            return _error(403, "GatedRepo", f"Access to model {repo} is restricted")
        if repo in self.forbidden:
            return 403, {"X-Error-Message": "Forbidden"}, b"Forbidden"
        if repo in self.private and authorization != f"Bearer {self.token}":
            return _error(401, "RepoNotFound", f"Repository {repo} not found")
        found = self._revision(repo, revision)
        if found is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        sha, files = found
        if filename not in files:
            status, headers, body = _error(404, "EntryNotFound", f"{filename} does not exist")
            return status, {**headers, "X-Repo-Commit": sha}, body
        content = files[filename]
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(content)),
            "ETag": f'"{git_blob_sha(content)}"',
            "X-Repo-Commit": sha,
        }
        return 200, headers, content

    def write(
        self, path: str, authorization: str | None, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and body for a POST of `path` (the write API)."""
        if authorization != f"Bearer {self.token}":
            return _error(401, "Unauthorized", "Invalid credentials in Authorization header")
        parts = [unquote(p) for p in urlsplit(path).path.split("/")]
        if parts[1:] == ["api", "repos", "create"]:
            request = json.loads(body)
            repo = "/".join(p for p in (request.get("organization"), request["name"]) if p)
            if repo in self.repos:  # the hub's body names the repo's url, which the client reads
                status, headers, _ = _error(
                    409, "RepoExists", f"You already created this model repo: {repo}"
                )
                return (
                    status,
                    {**headers, "Content-Type": "application/json"},
                    json.dumps(
                        {
                            "error": "You already created this model repo",
                            "url": f"{self.endpoint}/{repo}",
                        }
                    ).encode(),
                )
            with self._lock:
                self.repos[repo] = {"main": (commit_sha(f"{repo}:created"), {})}
            return _json(200, {"url": f"{self.endpoint}/{repo}", "name": repo})
        if parts[1:] == ["api", "validate-yaml"]:
            return _json(200, {"errors": [], "warnings": []})
        # ['', 'api', 'models', org, name, 'preupload' | 'commit', revision]
        if len(parts) != 7 or parts[1:3] != ["api", "models"]:
            return 404, {}, b"Not Found"
        repo, action, revision = f"{parts[3]}/{parts[4]}", parts[5], parts[6]
        if repo not in self.repos:
            return _error(404, "RepoNotFound", f"Repository {repo} not found")
        if action == "preupload":
            files = json.loads(body)["files"]
            return _json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                          "shouldIgnore": False, "oid": None} for f in files]})  # fmt: skip
        if action != "commit":
            return 404, {}, b"Not Found"
        if self.refuse_commits:
            return _error(403, "Forbidden", "Your token does not have write access to this repo")
        with self._lock:
            found = self._revision(repo, revision)
            if found is None:
                return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            parent, files = found
            files = dict(files)
            for line in body.splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "deletedFile":
                    files.pop(item["value"]["path"], None)
            sha = commit_sha(f"{parent}:{hashlib.sha256(body).hexdigest()}")
            self.repos[repo][revision] = (sha, files)
            self.repos[repo][sha] = (sha, files)
        return _json(200, {"commitOid": sha, "commitUrl": f"{self.endpoint}/{repo}/commit/{sha}"})

    def _revision(self, repo: str, revision: str) -> tuple[str, Files] | None:
        revisions = self.repos[repo]
        if revision in revisions:
            return revisions[revision]
        for sha, files in revisions.values():
            if sha == revision:
                return sha, files
        return None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_POST(self) -> None:
                authorization = self.headers.get("Authorization")
                server.record(Request(self.command, self.path, authorization))
                content = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, answer = server.write(self.path, authorization, content)
                self.send_response(status)
                for name, value in {"Content-Length": str(len(answer)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(answer)

            def _answer(self, *, body: bool) -> None:
                authorization = self.headers.get("Authorization")
                server.record(Request(self.command, self.path, authorization))
                if server.stopping.wait(server.delay_s):
                    self.close_connection = True  # stopped while a slow answer was pending
                    return
                status, headers, content = server.resolve(self.path, authorization)
                self.send_response(status)
                headers = {"Content-Length": str(len(content)), **headers}
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output quiet

        return Handler


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], bytes]:
    body = message.encode()
    return status, {"X-Error-Code": code, "X-Error-Message": message}, body


def _json(status: int, obj: Any) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(obj).encode()


@contextmanager
def serve_hub(
    repos: Mapping[str, Revisions],
    *,
    private: frozenset[str] | set[str] = frozenset(),
    gated: frozenset[str] | set[str] = frozenset(),
    forbidden: frozenset[str] | set[str] = frozenset(),
    token: str = DEFAULT_TOKEN,
    delay_s: float = 0.0,
) -> Iterator[HubServer]:
    """A started `HubServer`, stopped (port closed) on exit."""
    hub = HubServer(
        repos, private=private, gated=gated, forbidden=forbidden, token=token, delay_s=delay_s
    )
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()


@contextmanager
def silent_hub(limit_s: float = 60.0) -> Iterator[str]:
    """The HF_ENDPOINT of a loopback server that accepts every connection and never answers (a
    hub that hangs). It stops itself after `limit_s` seconds whatever happens (closing what it
    holds), and on exit."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)
    stop = threading.Event()

    def hold() -> None:
        held: list[socket.socket] = []
        end = time.monotonic() + limit_s
        while not stop.is_set() and time.monotonic() < end:
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
        for conn in held:
            conn.close()
        listener.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)


def hub_call(
    tmp_path: Path,
    endpoint: str,
    args: list[str],
    *,
    code: str,
    token: str | None = None,
    offline: bool = False,
    cache: Path | None = None,
    prelude: str = "",
    timeout_s: float | str | None = None,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run `code` (with `args`) in a fresh interpreter against `endpoint`; its JSON output.

    `timeout_s` sets stagetrain's bound on one fetch (STAGETRAIN_HUB_TIMEOUT_S); `env` adds
    variables (e.g. the push's bound, STAGETRAIN_HUB_PUSH_TIMEOUT_S).
    """
    extra = dict(env or {})
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING_FACE", "HUGGINGFACE"))
        and k not in ("TRANSFORMERS_OFFLINE", TIMEOUT_ENV, PUSH_TIMEOUT_ENV)
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf_home"),  # no stored token from the user's home
        HF_HUB_CACHE=str(cache or tmp_path / "cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    if token is not None:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if timeout_s is not None:
        env[TIMEOUT_ENV] = str(timeout_s)
    env.update(extra)
    proc = subprocess.run(
        [sys.executable, "-c", prelude + code, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
