"""Object-store URLs (``s3://bucket/prefix``, ``gs://bucket/prefix``), parsed strictly.

Keys become folder names in the node-local cache and prefixes decide allow-list
membership, so empty, ``.`` and ``..`` segments are refused rather than normalised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidAdapterSourceError

# fsspec protocol per URL scheme; "gcs" is gcsfs's other name for gs.
OBJECT_STORE_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}
# S3 and GCS bucket names: lowercase letters, digits, '.', '-', '_' (GCS), 3-222 characters.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(source: str) -> str | None:
    """The ``scheme`` of ``scheme://...``, lower-cased; None for a path or a hub repo id."""
    match = _SCHEME_RE.match(source)
    return match.group(1).lower() if match else None


@dataclass(frozen=True)
class ObjectURL:
    scheme: str     # "s3" or "gs"
    bucket: str
    key: str        # the prefix inside the bucket, no leading or trailing '/', may be ""

    @property
    def protocol(self) -> str:
        return OBJECT_STORE_SCHEMES[self.scheme]

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    @property
    def fs_path(self) -> str:
        """The path fsspec filesystems take: bucket/key."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def child(self, name: str) -> "ObjectURL":
        return parse_object_url(f"{self.url}/{name}")

    def is_within(self, prefix: "ObjectURL") -> bool:
        if (self.scheme, self.bucket) != (prefix.scheme, prefix.bucket):
            return False
        return not prefix.key or self.key == prefix.key or self.key.startswith(prefix.key + "/")


def parse_object_url(source: str) -> ObjectURL:
    """``s3://bucket/a/b/`` -> ObjectURL("s3", "bucket", "a/b"); anything malformed is refused by name."""
    scheme = url_scheme(source)
    if scheme not in OBJECT_STORE_SCHEMES:
        raise InvalidAdapterSourceError(
            f"adapter source {source!r}: unsupported URL scheme {scheme!r}; lorafleet reads local folders, "
            f"hub repo ids, s3://bucket/prefix and gs://bucket/prefix")
    rest = source[len(scheme) + 3:]
    bucket, _, key = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket):
        raise InvalidAdapterSourceError(f"adapter source {source!r}: {bucket!r} is not a valid bucket name")
    key = key.rstrip("/")
    segments = key.split("/") if key else []
    bad = [s for s in segments if s in ("", ".", "..") or any(ord(c) < 32 for c in s)]
    if bad:
        raise InvalidAdapterSourceError(
            f"adapter source {source!r}: empty, '.', '..' or control-character path segments are not allowed")
    return ObjectURL("gs" if scheme == "gcs" else scheme, bucket, key)
