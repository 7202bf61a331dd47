"""Which LoRA adapters a model serves, by name (docs/adapters.md): the ``lora`` entry's named
adapters and the subfolders of its directory, read again when a name is not found there.

The directory is the catalog every process shares: the gateway's ingress replicas, each model's
own application, on every node that mounts it. Loading an adapter at runtime links its folder in
there, unloading unlinks it, so every process sees the same adapters without a message between
them, and they outlive a restart. A request carries the adapter's name and folder
(``contract.Adapter``) to the replica, which loads it on first use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from contract import Adapter
from engines.kit.config import Lora, plain_adapter_name
from engines.kit.lora import ADAPTER_CONFIG, AdapterInvalid, read_adapter

__all__ = ["MAX_LISTED", "AdapterCatalog"]

# Folders read from a directory at most: a bound on a listing and on the catalog's memory.
MAX_LISTED = 4096
# A name not found is looked for in the directory at most this often (seconds): a client
# naming unknown models cannot make every request list a (network) folder.
RESCAN_S = 1.0


class AdapterCatalog:
    """The adapters of model ``model`` (module docstring). Reads the file system when asked
    (a name not seen within ``RESCAN_S``, a listing); the callers are request handlers, and
    the reads are a folder listing and a ``stat``."""

    def __init__(self, model: str, lora: Lora, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.lora = lora
        self._clock = clock
        self._found: dict[str, str] = {}
        self._scanned_at: float | None = None

    def find(self, name: str) -> Adapter | None:
        """The adapter named ``name``: one the config names (whatever its folder holds: the
        replica's check says what is wrong with it), or a folder in the directory now."""
        path = self.lora.adapters.get(name)
        if path is not None:
            return Adapter(name=name, path=path, version=_version(path) or 0)
        if not plain_adapter_name(name):
            return None
        path = self._found.get(name)
        version = _version(path) if path is not None else None
        if version is None:
            self._found.pop(name, None)  # unlinked or removed since the last listing
            self._rescan(due_only=True)
            path = self._found.get(name)
            version = _version(path) if path is not None else None
        return None if path is None or version is None else \
            Adapter(name=name, path=path, version=version)

    def names(self) -> list[str]:
        self._rescan(due_only=True)
        return sorted(set(self.lora.adapters) | set(self._found))

    def link(self, name: str, path: str) -> Adapter | None:
        """Serve the adapter in folder ``path`` as ``name`` from now on, in every process
        (a link in the directory). :class:`AdapterInvalid` if it cannot be."""
        directory = self._writable_directory()
        if not plain_adapter_name(name) or name == self.model:
            raise AdapterInvalid(f"`{name}` cannot name an adapter of model `{self.model}` "
                                 "(letters, digits and '._-', not the model's own name)")
        if self.find(name) is not None:
            raise AdapterInvalid(f"adapter `{name}` is already loaded for model `{self.model}`")
        if not os.path.isdir(path):
            raise AdapterInvalid(f"adapter `{name}`: no folder at the path given")
        read_adapter(name, path, self.lora.max_rank)
        try:
            os.symlink(os.path.abspath(path), os.path.join(directory, name))
        except FileExistsError:
            raise AdapterInvalid(f"adapter `{name}` is already loaded for model "
                                 f"`{self.model}`") from None
        self._rescan(due_only=False)
        return self.find(name)

    def unlink(self, name: str) -> bool:
        """Stop serving adapter ``name`` (False: no adapter of that name was linked in).
        Requests already running keep it until they end."""
        directory = self._writable_directory()
        entry = os.path.join(directory, name)
        if not plain_adapter_name(name) or not os.path.islink(entry):
            return False
        os.unlink(entry)
        self._found.pop(name, None)
        return True

    def _writable_directory(self) -> str:
        if self.lora.directory is None:
            raise AdapterInvalid(f"model `{self.model}` has no adapter directory "
                                 "(lora.directory) to load adapters into at runtime")
        return self.lora.directory

    def _rescan(self, due_only: bool) -> None:
        now = self._clock()
        if self.lora.directory is None or (
                due_only and self._scanned_at is not None and now - self._scanned_at < RESCAN_S):
            return
        self._scanned_at = now
        found: dict[str, str] = {}
        try:
            with os.scandir(self.lora.directory) as entries:
                for entry in entries:
                    if len(found) >= MAX_LISTED:
                        break
                    path = entry.path
                    if plain_adapter_name(entry.name) and \
                            os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
                        found[entry.name] = path
        except OSError:  # the directory is missing or unreadable now: no adapters from it
            pass
        self._found = found


def _version(path: str) -> int | None:
    """When ``path`` (a folder, or a link to one) was made, in ns; None: no folder there."""
    try:
        if not os.path.isdir(path):
            return None
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None
