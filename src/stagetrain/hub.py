"""Fetching one file from the Hugging Face hub, with every failure as one line.

huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE and its cache from
the environment; the token is never passed around or written. Failures are told
apart (repo or revision or file not found, unauthorised, unreachable or offline
and not cached) because the user's fix differs for each.
"""

from __future__ import annotations

from pathlib import Path


class HubError(Exception):
    """A file could not be fetched; the message says why in one line."""


def fetch(repo: str, filename: str, *, revision: str, repo_type: str = "model") -> tuple[Path, str]:
    """The local path of `filename` in `repo` at `revision`, and the commit it resolved to."""
    import huggingface_hub
    from huggingface_hub import errors

    where = f"hub {'dataset' if repo_type == 'dataset' else 'repo'} {repo!r}@{revision}"
    try:
        path = Path(
            huggingface_hub.hf_hub_download(repo, filename, revision=revision, repo_type=repo_type)
        )
    except errors.HFValidationError:  # e.g. a local path that does not exist, taken for an id
        raise HubError(f"{where}: not a valid hub repo id (namespace/name)") from None
    except errors.GatedRepoError:
        raise HubError(f"{where}: unauthorised (gated repo; set HF_TOKEN)") from None
    except errors.RepositoryNotFoundError as err:
        status = getattr(err.response, "status_code", None)
        if status in (401, 403):
            raise HubError(f"{where}: unauthorised (HTTP {status}; check HF_TOKEN)") from None
        raise HubError(f"{where}: repository not found (or private without a token)") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{where}: revision not found") from None
    except errors.RemoteEntryNotFoundError:
        raise HubError(f"{where}: has no {filename}") from None
    except errors.LocalEntryNotFoundError as err:
        # An HTTP error on the metadata request that the client does not raise as such (a
        # plain 403, a 5xx) arrives wrapped in this error, as its cause.
        status = getattr(getattr(err.__cause__, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"{where}: unauthorised (HTTP {status}; check HF_TOKEN)") from None
        if status is not None:
            raise HubError(f"{where}: HTTP error {status}") from None
        raise HubError(
            f"{where}: hub unreachable or offline (HF_HUB_OFFLINE) and {filename} not in the cache"
        ) from None
    except errors.HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status in (401, 403):
            raise HubError(f"{where}: unauthorised (HTTP {status}; check HF_TOKEN)") from None
        raise HubError(f"{where}: HTTP error {status}") from None
    except OSError as err:  # connection refused, DNS, timeouts surface as OSError subclasses
        raise HubError(f"{where}: hub unreachable ({type(err).__name__})") from None
    # The cache stores files under snapshots/<commit>/<filename>, which pins what was read.
    snapshot = path
    for _ in Path(filename).parts:
        snapshot = snapshot.parent
    return path, snapshot.name
