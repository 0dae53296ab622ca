"""Where the jobs write: a local directory or an object-store / HDFS URL, behind one small path-like type.

Spark writes the big outputs (facts Parquet, checkpoints) itself and needs the URL as Spark spells it
(``s3a://bucket/out``). The small files (redrive ledger, plans, audit, report HTML and PNGs, inventory tables) are
written by the driver; going through ``fsspec`` instead of ``open()`` means they land next to the big outputs on
S3, GCS, ADLS or HDFS too, instead of on a driver's local disk that a cluster throws away. ``s3a://`` is Hadoop's
name for S3; ``s3fs`` registers it as well, so one URL serves both.

Object stores have no append and no rename: :meth:`Location.write_bytes` replaces a whole object, and files that
grow (the ledger) are kept as many immutable objects instead of one appended file. :meth:`Location.create_exclusive`
is the one atomic primitive: a local ``O_EXCL`` create, or a conditional put where the store offers one.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

LOCAL_PROTOCOLS = ("file", "local")


class StorageError(RuntimeError):
    """An output location cannot be used (missing fsspec driver, refused write)."""


class Location:
    """A file or directory, local or remote; ``loc / "name"`` builds children like ``pathlib.Path``.

    ``str(loc)`` is the form Spark's readers and writers take (an absolute local path, or the URL unchanged).
    """

    __slots__ = ("_fs", "_path", "_protocol", "url")

    def __init__(self, url: str | os.PathLike[str]) -> None:
        text = os.fspath(url)
        protocol, _, rest = text.partition("://") if "://" in text else ("", "", text)
        if not protocol or protocol in LOCAL_PROTOCOLS:
            local = os.path.abspath(os.path.expanduser(rest))
            self.url = local
            self._protocol = "file"
            self._path = local
        else:
            self.url = text.rstrip("/") if text.rstrip("/") != f"{protocol}:/" else text
            self._protocol = protocol
            self._path = ""
        self._fs: Any = None

    # --- path arithmetic -------------------------------------------------------------------------------------

    def __truediv__(self, name: str) -> Location:
        if self.is_local:
            return Location(os.path.join(self.url, name))
        return Location(posixpath.join(self.url, name))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __fspath__(self) -> str:
        if not self.is_local:
            raise StorageError(f"{self.url} is not a local path; use the Location methods or Spark")
        return self.url

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url.rstrip("/")) if not self.is_local else os.path.basename(self.url)

    @property
    def is_local(self) -> bool:
        return self._protocol == "file"

    @property
    def protocol(self) -> str:
        return self._protocol

    # --- file system -----------------------------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec file system for this URL (imported lazily: local runs need no fsspec driver)."""
        if self._fs is None:
            try:
                import fsspec
            except ImportError as exc:  # pragma: no cover - fsspec is in the pipeline extra
                raise StorageError("the pipeline needs fsspec for its small output files: pip install fsspec") from exc
            try:
                self._fs = fsspec.filesystem(self._protocol)
            except (ImportError, ValueError) as exc:
                raise StorageError(
                    f"no fsspec driver for {self._protocol}:// ({exc}); install s3fs for s3a:// and s3://, gcsfs for "
                    "gs://, adlfs for abfs[s]://; HDFS uses pyarrow's client (libhdfs)"
                ) from exc
        return self._fs

    @property
    def fs_path(self) -> str:
        """The path as the fsspec driver wants it (``bucket/key`` for object stores)."""
        if self.is_local:
            return self.url
        return str(self.fs._strip_protocol(self.url))

    def exists(self) -> bool:
        return bool(self.fs.exists(self.fs_path))

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        """Create a directory; a no-op on object stores, where directories are only key prefixes."""
        if self.is_local:
            os.makedirs(self.url, exist_ok=exist_ok)

    @contextmanager
    def open(self, mode: str = "rb", encoding: str | None = None) -> Iterator[IO[Any]]:
        if "w" in mode or "x" in mode or "a" in mode:
            self.parent.mkdir()
        kwargs = {"encoding": encoding} if encoding and "b" not in mode else {}
        with self.fs.open(self.fs_path, mode, **kwargs) as fh:
            yield fh

    def read_bytes(self) -> bytes:
        with self.open("rb") as fh:
            data: bytes = fh.read()
            return data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        """Replace the file with ``data``; locally through a temporary file and a rename, so a reader never sees half."""
        if self.is_local:
            self.parent.mkdir()
            tmp = f"{self.url}.tmp-{os.getpid()}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.url)
            return
        with self.open("wb") as fh:  # an object store's put is atomic already
            fh.write(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def create_exclusive(self, data: bytes) -> bool:
        """Create the file with ``data`` only if it does not exist; False when it does. Atomic where possible.

        Locally that is ``O_CREAT | O_EXCL``. On object stores it is fsspec's ``"xb"`` mode, which s3fs carries out
        as a conditional put (``If-None-Match: *``, honoured by S3 since 2024); a driver without exclusive create
        raises :class:`StorageError` rather than pretending.
        """
        if self.is_local:
            self.parent.mkdir()
            try:
                fd = os.open(self.url, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            return True
        try:
            with self.fs.open(self.fs_path, "xb") as fh:
                fh.write(data)
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError) as exc:
            raise StorageError(f"{self.protocol}:// cannot create a file exclusively ({exc})") from exc
        return True

    def unlink(self, missing_ok: bool = True) -> None:
        try:
            self.fs.rm(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def glob(self, pattern: str) -> list[Location]:
        """Children matching ``pattern`` (fsspec glob), sorted; empty when the directory does not exist."""
        if self.is_local and not os.path.isdir(self.url):
            return []
        base = self.fs_path.rstrip("/")
        found = self.fs.glob(posixpath.join(base, pattern))
        # Rebuilt from this location's own URL, because drivers strip different parts (the host of hdfs://, the
        # s3a alias) and cannot be asked to put them back.
        return [self / str(p)[len(base) :].lstrip("/") for p in sorted(found) if str(p).startswith(base)]

    @property
    def parent(self) -> Location:
        if self.is_local:
            return Location(os.path.dirname(self.url))
        head, _, tail = self.url.partition("://")
        return Location(f"{head}://{posixpath.dirname(tail.rstrip('/'))}")


def location(value: str | os.PathLike[str] | Location) -> Location:
    return value if isinstance(value, Location) else Location(value)
