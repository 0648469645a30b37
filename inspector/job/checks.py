"""The range checks every record makes of a size or count, each naming the flag the user typed."""

from __future__ import annotations

from inspector.errors import ConfigError

# The largest size or count a flag may give: shapes beyond it overflow torch's index type (and no
# GPU holds a dimension that long), so a larger value is an error naming the flag, not C++ frames.
MAX_SIZE = 2**31 - 1


def check_at_least_one(flag: str, value: int | None) -> None:
    """Raise ConfigError when a size or count given as `flag` is below one or too large to build.

    None means not given.
    """
    if value is None:
        return
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1, got {value}")
    check_at_most(flag, value)


def check_at_most(flag: str, value: int | None) -> None:
    """Raise ConfigError when `flag`'s integer is larger than this tool can simulate."""
    if value is not None and value > MAX_SIZE:
        raise ConfigError(
            f"{flag} {value} is larger than this tool can simulate (at most {MAX_SIZE})"
        )


def check_heads(hidden: int, heads: int, kv_channels: int | None) -> None:
    """Raise ConfigError unless heads split the hidden size (or --kv-channels sets the head size)."""
    if kv_channels is None and hidden % heads:
        raise ConfigError(
            f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads} "
            f"({hidden} % {heads} = {hidden % heads}); pass --kv-channels to set the head size"
        )


def check_query_groups(heads: int, groups: int) -> None:
    """Raise ConfigError unless the key/value groups split the attention heads."""
    if heads % groups:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups} "
            f"({heads} % {groups} = {heads % groups})"
        )
