"""What every layer needs to report a bad flag: ``ConfigError`` and the flag spellings (a leaf module, so the
speculative algorithms can check their own flags without importing the configuration object)."""

from __future__ import annotations

import os

SPEC_V2_ENV = ("SPECSERVE_ENABLE_SPEC_V2", "SGLANG_ENABLE_SPEC_V2")  # the overlap scheduler's switches
SPEC_V2_NAMES = "--enable-spec-v2 / SPECSERVE_ENABLE_SPEC_V2 / SGLANG_ENABLE_SPEC_V2"
#: --disable-speculative-auto-off from the environment: a launch command kept as written (SGLang's) that must speculate
AUTO_OFF_ENV = ("SPECSERVE_DISABLE_SPECULATIVE_AUTO_OFF",)


class ConfigError(ValueError):
    """A server argument has an invalid value. The message starts with the flag's name."""


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_flag(names: tuple[str, ...]) -> bool:
    """True when one of the environment variables (a SPECSERVE_ name and its SGLANG_ twin) is 1, true or yes."""
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes") for n in names)


def require_positive(args, name: str, allow_none: bool = False) -> None:
    """args.<name> must be a positive integer (or None when allowed); else ConfigError naming the flag."""
    value = getattr(args, name)
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{flag_name(name)} must be a positive integer, got {value!r}")


def require_choice(args, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(args, name)
    if value not in choices:
        raise ConfigError(f"{flag_name(name)} must be one of {', '.join(choices)}; got {value!r}")
