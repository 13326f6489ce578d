"""Fetching one file from the Hugging Face hub, with every failure as one line.

huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and its cache from
the environment; the token is never passed around or written. Failures are told
apart (repo or revision or file not found, unauthorised, unreachable or offline
and not cached) because the user's fix differs for each.

Two things the client does not do on its own:

- Bound the wait. Its timeouts are per request, and a hub that does not answer
  costs a 10 s metadata request, then up to six more of 60 s each with pauses of
  up to 8 s between them. Every request of one `fetch` runs on a client that
  holds them all to one deadline, `STAGETRAIN_HUB_TIMEOUT_S` seconds (default
  30) from the start: each request's timeouts are cut to the time left, and a
  failure that the client would retry after a pause longer than the time left
  ends the fetch as "hub unreachable" at once.
- Refuse its cache when the hub refuses. After a 401, 403 or 404 the client
  falls back to a cached copy of the file, silently. A cache can be shared
  between users with different rights, and a refusal means this user may not
  read the file now, so `fetch` fails as the refusal says instead. Only an
  answer about the file counts (a `/resolve/` request): the client also asks
  `/api/agent-harnesses` for its user-agent header, which a mirror or a hub
  without that API answers 404, and that says nothing about the file.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from stagetrain.errors import StageError

TIMEOUT_ENV = "STAGETRAIN_HUB_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
PUSH_TIMEOUT_ENV = "STAGETRAIN_HUB_PUSH_TIMEOUT_S"
DEFAULT_PUSH_TIMEOUT_S = 600.0
"""The bound on a whole `publish` (create the repo, read the layout table, upload the commit):
longer than a fetch's, as the commit carries the model's weights."""
LONGEST_PAUSE_S = 8.0
"""huggingface_hub's longest pause between two retries (without a Retry-After header)."""
REFUSED = (401, 403, 404)
RETRIED = (408, 429, 500, 502, 503, 504)
"""Statuses huggingface_hub retries after a pause."""


class HubError(Exception):
    """A file could not be fetched; the message says why in one line."""


class _GiveUp(Exception):
    """The deadline leaves no time for the request or retry the client is about to make.

    Not an httpx error, so none of the client's handlers retries it or falls back on it.
    """


@dataclass(slots=True)
class _Watch:
    """The deadline of one `fetch`, and the hub's refusal if it answered with one."""

    limit_s: float
    deadline: float = field(init=False)
    refusal: Any = None
    """The last response with a status in REFUSED (a response of `_http()`), or None."""

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.limit_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


_WATCH: ContextVar[_Watch | None] = ContextVar("stagetrain_hub_watch", default=None)


def timeout_s(env: str = TIMEOUT_ENV, default: float = DEFAULT_TIMEOUT_S) -> float:
    """The bound on one fetch's total wait, from STAGETRAIN_HUB_TIMEOUT_S (or another bound's
    variable `env`, e.g. the push's)."""
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise StageError(f"{env}: expected a positive number of seconds, got {raw!r}")
    return value


def _pause_after(response: Any) -> float:
    """The longest pause the client may take before retrying after `response`."""
    from huggingface_hub.utils import parse_ratelimit_headers

    pause = LONGEST_PAUSE_S
    retry_after = response.headers.get("Retry-After", "").strip()
    if retry_after.isdigit():
        pause = max(pause, int(retry_after) + 1.0)
    limits = parse_ratelimit_headers(response.headers)
    if limits is not None and limits.remaining == 0:
        pause = max(pause, limits.reset_in_seconds + 1.0)
    return pause


@cache
def _http() -> ModuleType:
    """The HTTP library huggingface_hub is built on: httpx2 from its 2.0 on, httpx in 1.x.

    Both have the same API; 1.x is what the GPU machine's image holds (tools/gpu/image.txt).
    """
    import huggingface_hub

    return importlib.import_module(type(huggingface_hub.get_session()).__module__.split(".")[0])


@cache
def _watched_client_class() -> type:
    """A client of `_http()` that holds each request of a watched fetch to the fetch's deadline."""
    http: Any = _http()  # a module chosen at run time: its classes are known only then
    retried = (http.TimeoutException, http.NetworkError, http.RemoteProtocolError)

    class WatchedClient(http.Client):
        def send(self, request: Any, **kwargs: Any) -> Any:
            watch = _WATCH.get()
            if watch is None:  # not inside `fetch` (e.g. transformers loading a model)
                return super().send(request, **kwargs)
            left = watch.left()
            if left <= 0:
                raise _GiveUp("no answer in time")
            given = request.extensions.get("timeout") or {}
            request.extensions = {
                **request.extensions,
                "timeout": {
                    k: left if given.get(k) is None else min(given[k], left)
                    for k in ("connect", "read", "write", "pool")
                },
            }
            try:
                response = super().send(request, **kwargs)
            except retried as err:
                if watch.left() < LONGEST_PAUSE_S:
                    raise _GiveUp(type(err).__name__) from err
                raise
            status = response.status_code
            # the file's refusal, not a side request's
            if status in REFUSED and "/resolve/" in request.url.path:
                watch.refusal = response
            elif status in RETRIED and watch.left() < _pause_after(response):
                response.close()
                raise _GiveUp(f"HTTP {status}")
            return response

    return WatchedClient


@cache
def _install() -> None:
    """Make huggingface_hub build its shared client as a WatchedClient (once per process).

    The client keeps the settings of the one the library builds by default (its
    request hook, which enforces HF_HUB_OFFLINE, redirects and timeouts).
    """
    import huggingface_hub

    template = huggingface_hub.get_session()
    hooks = {name: list(hooks) for name, hooks in template.event_hooks.items()}
    follow, timeout = template.follow_redirects, template.timeout
    watched = _watched_client_class()
    huggingface_hub.set_client_factory(
        lambda: watched(event_hooks=hooks, follow_redirects=follow, timeout=timeout)
    )


@contextmanager
def deadline(
    where: str, env: str = PUSH_TIMEOUT_ENV, default: float = DEFAULT_PUSH_TIMEOUT_S
) -> Iterator[None]:
    """Every hub request made inside holds to one deadline, `timeout_s(env, default)` seconds
    from entry, as `fetch`'s do: a hub that accepts and never answers ends the block as one
    HubError naming `where` and the limit, instead of the client's per-request waits and
    retries (a write to a silent hub waited 153 s and more)."""
    watch = _Watch(timeout_s(env, default))
    _install()
    reset = _WATCH.set(watch)
    try:
        yield
    except _GiveUp as err:
        raise HubError(
            f"{where}: hub unreachable ({err}; gave up within the {watch.limit_s:g} s limit of {env})"
        ) from None
    except _http().RequestError as err:  # refused, DNS, a reset: the client's retries are spent
        raise HubError(f"{where}: hub unreachable ({type(err).__name__})") from None
    finally:
        _WATCH.reset(reset)


def _reason(err: Exception, filename: str) -> str:
    """What a huggingface_hub or transport error means for the user, in a few words."""
    from huggingface_hub import errors

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, errors.HFValidationError):  # e.g. a local path that does not exist
        return "not a valid hub repo id (namespace/name)"
    if isinstance(err, errors.GatedRepoError):
        return "unauthorised (gated repo; set HF_TOKEN)"
    if isinstance(err, errors.RepositoryNotFoundError):
        if status in (401, 403):
            return f"unauthorised (HTTP {status}; check HF_TOKEN)"
        return "repository not found (or private without a token)"
    if isinstance(err, errors.RevisionNotFoundError):
        return "revision not found"
    if isinstance(err, errors.RemoteEntryNotFoundError):
        return f"has no {filename}"
    if isinstance(err, errors.LocalEntryNotFoundError):
        # An HTTP error on the metadata request that the client does not raise as such (a
        # plain 403, a 5xx) arrives wrapped in this error, as its cause.
        status = getattr(getattr(err.__cause__, "response", None), "status_code", None)
        if status is None:
            return f"hub unreachable or offline (HF_HUB_OFFLINE) and {filename} not in the cache"
    if status in (401, 403):
        return f"unauthorised (HTTP {status}; check HF_TOKEN)"
    if status is not None:
        return f"HTTP error {status}"
    if isinstance(err, OSError) and err.errno is not None:  # e.g. a full disk under the cache
        return f"cannot fetch {filename} ({err.strerror})"
    if isinstance(err, (_http().RequestError, OSError)):  # any transport error, refused, DNS
        return f"hub unreachable ({type(err).__name__}) and {filename} not in the cache"
    raise err  # not a failure this module knows how to explain: a bug, keep the traceback


def fetch(repo: str, filename: str, *, revision: str, repo_type: str = "model") -> tuple[Path, str]:
    """The local path of `filename` in `repo` at `revision`, and the commit it resolved to.

    Waits at most `timeout_s()` seconds for the hub in all (plus at most one second of
    the client's pause before resuming a stalled download).
    """
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import hf_raise_for_status

    where = f"hub {'dataset' if repo_type == 'dataset' else 'repo'} {repo!r}@{revision}"
    watch = _Watch(timeout_s())
    _install()
    reset = _WATCH.set(watch)
    suffix = ""
    try:
        path = Path(
            huggingface_hub.hf_hub_download(repo, filename, revision=revision, repo_type=repo_type)
        )
        if watch.refusal is not None:  # the hub said no and the cache answered instead
            suffix = "; the cached copy is not used"
            hf_raise_for_status(watch.refusal)
    except _GiveUp as err:
        try:  # the client's own fallback after an unanswered request: a cached copy
            path = Path(
                huggingface_hub.hf_hub_download(
                    repo, filename, revision=revision, repo_type=repo_type, local_files_only=True
                )
            )
        except errors.LocalEntryNotFoundError:
            raise HubError(
                f"{where}: hub unreachable ({err}; gave up within the {watch.limit_s:g} s limit of "
                f"{TIMEOUT_ENV}) and {filename} not in the cache"
            ) from None
    except (errors.HfHubHTTPError, errors.HFValidationError, _http().RequestError, OSError) as err:
        raise HubError(f"{where}: {_reason(err, filename)}{suffix}") from None
    finally:
        _WATCH.reset(reset)
    # The cache stores files under snapshots/<commit>/<filename>, which pins what was read.
    snapshot = path
    for _ in Path(filename).parts:
        snapshot = snapshot.parent
    return path, snapshot.name
