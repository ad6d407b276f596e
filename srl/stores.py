"""Opening a store by URL: ``file://DIR`` (``srl.store.LocalStore``) or ``s3://bucket/prefix``
(``srl.s3store.S3Store``).

``store_from_config(cfg)`` is what roles call: the S3 settings (endpoint, region, profile,
create-only mode) come from that config, never from process-wide state, so a role started
from Python gets the same store as one started from the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from srl.errors import ConfigError, StoreError
from srl.s3store import S3Settings, S3Store, parse_url
from srl.store import LocalStore, ObjectStore

if TYPE_CHECKING:
    from srl.config import StoreSettings


def open_store(url: str, s3: S3Settings | None = None) -> ObjectStore:
    """The store for ``url``: ``file://DIR`` (relative to the working directory) or ``s3://…``
    (reached with ``s3``; None: boto3's defaults, the AWS variables)."""
    if url.startswith("file://"):
        return LocalStore(url[len("file://") :] or ".")
    if url.startswith("s3://"):
        return S3Store.from_url(url, s3)
    if "://" not in url:
        return LocalStore(url)
    raise ConfigError(f"store: unsupported URL {url!r}; use file://DIR or s3://bucket/prefix")


def store_from_config(cfg: StoreSettings) -> ObjectStore:
    """``cfg.store``, with ``cfg``'s S3 settings."""
    return open_store(cfg.store, S3Settings.from_config(cfg))


def store_for_uri(uri: str, default: ObjectStore | None = None) -> tuple[ObjectStore, str]:
    """(store, key) for an object URI, reusing ``default`` when the URI lies in it (an S3 URI
    elsewhere is reached with ``default``'s S3 settings)."""
    if default is not None and uri.startswith(default.uri("")):
        return default, default.key_of(uri)
    if uri.startswith("file://"):
        path = Path(uri[len("file://") :])
        return LocalStore(path.parent), path.name
    if uri.startswith("s3://"):
        bucket, key = parse_url(uri)
        settings = default.settings if isinstance(default, S3Store) else None
        return S3Store(bucket, settings=settings), key
    raise StoreError(f"cannot open object {uri}: not in the configured store")
