"""The tuning cache file: one JSON object of tuned entries, shared by the processes of a machine.

Writers hold an fcntl lock on `<file>.lock`, re-read the file under it, tune only the keys still missing
and replace the file atomically (temp file + os.replace), so concurrent processes never corrupt it nor tune
one key twice; readers need no lock. Files are created with the permissions the umask leaves (0666 & ~umask).

Reading trusts nothing: a file that is not the expected JSON object, and each entry that is not an object
with a "config" object and (where present) finite numeric times, is ignored with a RuntimeWarning, and a
later write leaves it out. Whether an entry's config fits its stage is the lookup's check.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from jax_mamba2._files import write_atomically
from jax_mamba2.bridge.tuning.cache_keys import CACHE_SCHEMA


class TuningCache:
    """One JSON file of tuned entries ({"schema", "entries": {key: entry}})."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> dict[str, dict]:
        """The valid stored entries: {} when the file is missing, unreadable, malformed or of another
        schema (a warning says which, except for a missing file); malformed entries left out, with a
        warning."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting too deep for json
            self._ignored(f"not readable as JSON ({type(e).__name__}: {e})", "the file")
            return {}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            self._ignored('not a JSON object with an "entries" object', "the file")
            return {}
        if data.get("schema") != CACHE_SCHEMA:
            self._ignored(f"schema={data.get('schema')!r}, not {CACHE_SCHEMA}", "the file")
            return {}
        entries = {}
        for key, entry in data["entries"].items():
            problem = _entry_problem(entry)
            if problem is None:
                entries[key] = entry
            else:
                self._ignored(f"entry {key!r} {problem}", "that entry")
        return entries

    def _ignored(self, problem: str, what: str) -> None:
        warnings.warn(f"jax_mamba2 tuning cache {self.path}: {problem}; {what} is ignored", RuntimeWarning,
                      stacklevel=4)

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
        write_atomically(self.path, json.dumps({"schema": CACHE_SCHEMA, "entries": entries}, indent=1,
                                               sort_keys=True).encode())

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


# The entry fields that hold times (us): each, where present, a finite number (or None where a
# measurement may be missing).
_TIMES = {"mean_us": False, "default_mean_us": True, "tuning_s": False}


def _finite(value: int | float) -> bool:
    """A finite float, or an int a float holds (JSON's integers have any number of digits)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _entry_problem(entry) -> Optional[str]:
    """What is wrong with a stored entry's form (None when nothing is)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return 'is not an object with a "config" object'
    for field, may_be_none in _TIMES.items():
        if field not in entry or (may_be_none and entry[field] is None):
            continue
        value = entry[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            return f"has {field}={value!r:.40}, not a finite number"
    return None
