"""The tuning cache file: one JSON object of tuned entries, shared by the processes of a machine.

Writers hold an fcntl lock on `<file>.lock`, re-read the file under it, tune only the keys still missing
and replace the file atomically (temp file + os.replace), so concurrent processes never corrupt it nor tune
one key twice; readers need no lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

from jax_mamba2.bridge.tuning.cache_keys import CACHE_SCHEMA


class TuningCache:
    """One JSON file of tuned entries ({"schema", "entries": {key: entry}})."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> dict[str, dict]:
        """The stored entries ({} when the file is missing, unreadable or of another schema)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("schema") != CACHE_SCHEMA:
            return {}
        return dict(data.get("entries", {}))

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, entries: dict[str, dict]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"schema": CACHE_SCHEMA, "entries": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def fill(self, keys: Iterable[str], tune: Callable[[list[str]], Iterator[tuple[str, dict]]],
             usable: Callable[[str, dict], bool] = lambda key, entry: True) -> dict[str, dict]:
        """Entries for `keys`, tuning the missing (or not `usable`) ones under the file lock.

        Under the lock the file is re-read (another process may have tuned meanwhile); `tune(missing)`
        yields (key, entry) pairs, each stored as soon as it arrives. Returns the entries of `keys`
        that exist afterwards.
        """
        keys = list(keys)
        with self._locked():
            entries = self.read()
            missing = [k for k in keys if k not in entries or not usable(k, entries[k])]
            if missing:
                for key, entry in tune(missing):
                    entries[key] = entry
                    self._write(entries)
        return {k: entries[k] for k in keys if k in entries}
