"""The exceptions tierkv raises.

Each names what went wrong and, where there is one, the fix. Catch `TierKVError`
to catch them all.
"""

from __future__ import annotations

from typing import TypeVar


class TierKVError(Exception):
    """Base of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A configuration (YAML or object) is invalid.

    `problems` holds one line per problem, each starting with the YAML path
    (`tiers[1].capacity: '12 parsecs' is not a size ...`).
    """

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"invalid tierkv config{f' in {source}' if source else ''}"
        body = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}")


class UnknownTierType(ConfigError):
    """No installed plugin provides the requested tier type."""


class PluginImportError(ConfigError):
    """A tier plugin is installed but failed to import or is malformed."""


class TierUnavailable(TierKVError):
    """A tier cannot serve requests now (closed, unreachable, circuit open)."""


class CorruptBlock(TierKVError):
    """Bytes read back from a tier fail the frame check (header, key, length, checksum)."""


class ForeignBlock(CorruptBlock):
    """A well-formed frame signed by a MAC key this tier does not hold (another trust
    domain sharing the storage), or unsigned where this tier requires a signature.

    Not ours to serve and not ours to delete: the key fails (a miss) and the stored
    value stays for the servers that hold its key. It subclasses `CorruptBlock` so a
    tier written before it existed still refuses to serve it; a tier that shares its
    storage catches it first and leaves the block in place."""


class BlockStateError(TierKVError):
    """An operation was asked of a block in a state that does not allow it
    (loading a block that is still being written, completing a load never prepared)."""


E = TypeVar("E", bound=BaseException)


def detached(exc: E) -> E:
    """`exc` without its traceback (nor those of the exceptions it chains to), for an
    error kept as a per-key outcome.

    A traceback keeps every frame it passed through alive, with their locals: the slot
    `memoryview`s of a job among them. An outcome stored in a list that one of those
    frames also holds is a reference cycle only the garbage collector frees, and while
    it lives the primary slab cannot be unmapped (vLLM keeps its region mapped while
    any view of it exists). The message and the type, all a result reports, stay."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc
