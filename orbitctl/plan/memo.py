"""Cache keys for the planner's per-process caches (``functools.lru_cache``).

One ``orbitctl plan`` evaluates the same architecture, stored base and adapters dozens of times: the
largest-micro-batch search, the advice's and the layouts' re-plans, the other node count. What does
not depend on the micro-batch or the changed keys is computed once per process from these keys;
nothing is kept between processes.
"""

from __future__ import annotations

from typing import Any


class Same:
    """A key standing for one object by identity: an ArchSpec or AdapterPlan is immutable, and hashing its
    thousands of weights by value would cost what the cache saves. The cache holding the key holds the
    object too, so its id stays unique while the entry lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


class Values:
    """A key standing for a profile section (a pydantic model) by its values, lists as tuples; a cached
    computation reads ``section``, the one the key was made from (any with equal values gives the same)."""

    __slots__ = ("section", "values")

    def __init__(self, section: Any) -> None:
        self.section = section
        self.values = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in section.model_dump().items())

    def __hash__(self) -> int:
        return hash(self.values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Values) and other.values == self.values
