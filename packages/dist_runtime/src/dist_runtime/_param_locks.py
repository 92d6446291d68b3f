"""Per-parameter-set locks for optimizer steps that run on RPC threads.

torch serialises every Python local optimizer on a worker behind one global lock, and takes no
lock at all on its TorchScript path (concurrent trainers then lose updates). Here every local
optimizer holds the locks of the parameters it updates, so steps on the same (or overlapping)
parameters are serialised while steps on disjoint parameters run concurrently.

Design:

* A parameter is known by two keys: its tensor object and its storage (device, data pointer), so
  that two views of one storage, or two RRefs to one tensor, meet on a common key.
* Every registered key maps to one lock. A new parameter set reuses the locks of the keys it
  already shares with live sets and gives its new keys the lowest of those locks (or a fresh lock
  when it shares nothing). A key keeps its lock for as long as a live set contains it, so every
  set that touches a parameter holds that parameter's lock.
* A set acquires its locks in ascending creation order, so overlapping sets cannot deadlock.
  The common case (one trainer, or several trainers on the same parameters) is one lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Iterable, Sequence
from types import TracebackType

import torch

__all__ = ["ParamLockRegistry", "ParamLockSet"]


class _OrderedLock:
    """A lock with a global acquisition rank (smaller ranks are taken first)."""

    __slots__ = ("lock", "rank")

    def __init__(self, rank: int) -> None:
        self.lock = threading.Lock()
        self.rank = rank


class _Entry:
    """A registered key: its lock and how many live sets contain it."""

    __slots__ = ("lock", "refs")

    def __init__(self, lock: _OrderedLock) -> None:
        self.lock = lock
        self.refs = 0


class ParamLockSet:
    """The locks guarding one parameter set; a context manager that holds all of them.

    Created by :meth:`ParamLockRegistry.register`; call :meth:`close` (or let the owner's
    finaliser call it) when the parameter set is gone.
    """

    def __init__(
        self, registry: ParamLockRegistry, keys: tuple[Hashable, ...], locks: Sequence[_OrderedLock]
    ) -> None:
        self._registry: ParamLockRegistry | None = registry
        self._keys = keys
        self._locks = tuple(lock.lock for lock in sorted(locks, key=lambda lock: lock.rank))
        self.ranks = tuple(sorted(lock.rank for lock in locks))

    def __enter__(self) -> ParamLockSet:
        taken = 0
        try:
            for lock in self._locks:
                lock.acquire()
                taken += 1
        except BaseException:
            for lock in reversed(self._locks[:taken]):
                lock.release()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for lock in reversed(self._locks):
            lock.release()

    def close(self) -> None:
        """Unregister the keys (idempotent); the locks stay valid for holders."""
        registry, self._registry = self._registry, None
        if registry is not None:
            registry.unregister(self._keys)


def param_keys(param: torch.Tensor) -> tuple[Hashable, ...]:
    """The identity keys of a parameter: its tensor object and, if it has one, its storage."""
    keys: list[Hashable] = [("tensor", id(param))]
    if param.layout == torch.strided:
        storage = param.untyped_storage()
        if storage.nbytes() > 0:
            keys.append(("storage", str(param.device), storage.data_ptr()))
    return tuple(keys)


class ParamLockRegistry:
    """Hands out lock sets so that steps on intersecting parameter sets are serialised.

    Thread-safe. One registry per process is enough (see :data:`dist_runtime.rpc_optim`).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._ranks = itertools.count()
        self._entries: dict[Hashable, _Entry] = {}

    def register(self, params: Iterable[torch.Tensor]) -> ParamLockSet:
        """Return the lock set for ``params``, creating or reusing locks as needed.

        Args:
            params: the tensors one optimizer updates.

        Returns:
            A :class:`ParamLockSet`; hold it (``with lock_set:``) around every update.
        """
        keys = tuple(dict.fromkeys(key for param in params for key in param_keys(param)))
        with self._mutex:
            shared: dict[int, _OrderedLock] = {}
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    shared[entry.lock.rank] = entry.lock
            if shared:
                target = shared[min(shared)]
            else:
                target = _OrderedLock(next(self._ranks))
                shared[target.rank] = target
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry(target)
                entry.refs += 1
            return ParamLockSet(self, keys, list(shared.values()))

    def unregister(self, keys: Iterable[Hashable]) -> None:
        """Drop one reference to each key; forget keys no live set contains."""
        with self._mutex:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.refs -= 1
                if entry.refs <= 0:
                    del self._entries[key]

    def __len__(self) -> int:
        """Number of registered keys (for tests)."""
        with self._mutex:
            return len(self._entries)
