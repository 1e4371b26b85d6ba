"""Adapters under an object-store prefix (``s3://``, ``gs://``) through fsspec.

Credentials and endpoints come from the environment exactly as s3fs/gcsfs (boto, google
auth) read them: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``GOOGLE_APPLICATION_CREDENTIALS``,
``STORAGE_EMULATOR_HOST``... A listing names the files and their ETag/generation; only
``adapter_config.json`` and ``adapter_model.safetensors`` are fetched, into the node-local
cache under the content version those tags define, so a changed object is a new entry and
an unchanged one is never downloaded twice on a node.
"""

from __future__ import annotations

import base64
import hashlib
import posixpath
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from ..adapter import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from ..errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    LoRAFleetError,
    PickleWeightsRefusedError,
    SourceAccessDeniedError,
    SourceBackendMissingError,
    SourceUnavailableError,
    UnsupportedAdapterFeatureError,
)
from .node_cache import NodeDownloadCache
from .resolved import ResolvedSource
from .urls import ObjectURL

FETCHED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_EXTRAS = {"s3": ("s3fs", "s3"), "gcs": ("gcsfs", "gcs")}
T = TypeVar("T")


def object_filesystem(protocol: str) -> Any:
    """A fresh fsspec filesystem (no instance cache: credentials and endpoint are read now)."""
    import fsspec

    package, extra = _EXTRAS[protocol]
    try:
        return fsspec.filesystem(protocol, skip_instance_cache=True)
    except ImportError as exc:
        raise SourceBackendMissingError(
            f"{protocol} adapter sources need the {package} package: pip install 'lorafleet[{extra}]'") from exc


def _store_call(url: ObjectURL, what: str, fn: Callable[[], T]) -> T:
    """Run one object-store operation; its failures become this project's typed errors."""
    try:
        return fn()
    except LoRAFleetError:
        raise
    except FileNotFoundError as exc:
        raise AdapterNotFoundError(f"adapter source {url.url}: {what}: not found ({exc})") from exc
    except PermissionError as exc:
        raise SourceAccessDeniedError(f"adapter source {url.url}: {what}: access denied ({exc})") from exc
    except Exception as exc:  # network, throttling, 5xx: the SDKs raise many unrelated types
        raise SourceUnavailableError(f"adapter source {url.url}: {what} failed: {type(exc).__name__}: {exc}") from exc


def _tag(info: dict) -> str:
    """The store's version tag of one object: GCS generation, else the ETag, else size+mtime."""
    for key in ("generation", "ETag", "etag"):
        if info.get(key):
            return str(info[key]).strip('"')
    return f"{info.get('size')}:{info.get('LastModified') or info.get('mtime') or info.get('updated')}"


def content_version(files: dict[str, dict]) -> str:
    """One short version for the fetched files, from their tags and sizes."""
    digest = hashlib.sha256()
    for name in FETCHED_FILES:
        info = files[name]
        digest.update(f"{name}\t{_tag(info)}\t{info.get('size')}\n".encode())
    return digest.hexdigest()[:16]


def _list_adapter_files(fs: Any, url: ObjectURL) -> dict[str, dict]:
    entries = _store_call(url, "listing", lambda: fs.ls(url.fs_path, detail=True, refresh=True))
    files = {posixpath.basename(e["name"].rstrip("/")): e for e in entries if e.get("type") == "file"}
    if not files:
        raise AdapterNotFoundError(f"adapter source {url.url} holds no files")
    if "added_tokens.json" in files:
        raise UnsupportedAdapterFeatureError(
            f"adapter {url.url} adds tokens to the vocabulary (added_tokens.json)")
    if WEIGHTS_FILE not in files:
        pickled = [p for p in PICKLE_FILES if p in files]
        if pickled:
            raise PickleWeightsRefusedError(
                f"adapter {url.url} ships pickle-format weights ({pickled[0]}); only {WEIGHTS_FILE} is accepted")
        raise AdapterFormatError(f"adapter {url.url}: {WEIGHTS_FILE} missing")
    if CONFIG_FILE not in files:
        raise AdapterFormatError(f"adapter {url.url}: {CONFIG_FILE} missing")
    return {name: files[name] for name in FETCHED_FILES}


def _download(fs: Any, url: ObjectURL, files: dict[str, dict], folder: Path) -> None:
    """Fetch the listed files and check each is the object that was listed, whole."""
    for name, info in files.items():
        remote = f"{url.fs_path}/{name}"
        local = folder / name
        _store_call(url, f"downloading {name}", lambda: fs.get_file(remote, str(local)))
        size = local.stat().st_size
        if info.get("size") is not None and size != int(info["size"]):
            raise SourceUnavailableError(
                f"adapter source {url.url}: {name} arrived with {size} bytes, the listing said {info['size']}")
        md5 = info.get("md5Hash")  # GCS: base64 MD5 of the content (absent for composite objects)
        if md5 and base64.b64encode(hashlib.md5(local.read_bytes()).digest()).decode() != md5:
            raise SourceUnavailableError(f"adapter source {url.url}: {name} failed its MD5 check")
        fs.invalidate_cache(url.fs_path)
        now = _store_call(url, f"checking {name}", lambda: fs.info(remote))
        if _tag(now) != _tag(info):
            raise SourceUnavailableError(
                f"adapter source {url.url}: {name} changed while it was downloaded; retry")


def check_listed_sizes(url: ObjectURL, files: dict[str, dict], max_bytes: Optional[int]) -> None:
    """Refuse, before any byte is downloaded, files the listing says are larger than ``max_bytes`` (the largest
    file a valid adapter for this pool could be): a hostile or mistaken source must not fill the node's disk."""
    if max_bytes is None:
        return
    for name, info in files.items():
        size = info.get("size")
        if size is not None and int(size) > max_bytes:
            raise AdapterTooLargeError(f"adapter source {url.url}: {name} is {int(size)} bytes, above the limit of "
                                       f"{max_bytes} bytes for this pool (nothing was downloaded)")


def resolve_object_source(url: ObjectURL, revision: Optional[str], cache: NodeDownloadCache,
                          max_bytes: Optional[int] = None) -> ResolvedSource:
    """The adapter under ``url`` in the node-local cache, downloaded by this node's first asker; a listed file
    above ``max_bytes`` is refused before the download.

    ``revision``, when given, must equal the content version found now (it pins what a
    fleet-wide registration loads); object stores keep no older versions to go back to.
    """
    fs = object_filesystem(url.protocol)
    files = _list_adapter_files(fs, url)
    check_listed_sizes(url, files, max_bytes)
    version = content_version(files)
    if revision is not None and revision != version:
        raise AdapterNotFoundError(
            f"adapter source {url.url} is at version {version}, not the requested {revision!r}")
    key_hash = hashlib.sha256(url.key.encode()).hexdigest()[:16]
    fetch = cache.get((url.scheme, url.bucket, key_hash, version), lambda tmp: _download(fs, url, files, tmp))
    return ResolvedSource(fetch.folder, url.scheme, version, fetch.downloaded)
