"""Environments the rollout worker plays and the reward worker scores, and how config names one.

``load_env(entry, options)`` builds the environment that ``[env] entry``
names: ``"package.module:ClassName"`` imports the class (any importable
module, inside the repository or not); a bare name is looked up among the
entry points of the group ``libra.envs`` (built in: ``calc``, the calculator
task, and ``guess``, a guessing game with feedback). Every stage process
calls it once at start.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from workers.envs.base import Environment

ENTRY_POINT_GROUP = "libra.envs"


class EnvError(ValueError):
    """An ``[env] entry`` that names nothing loadable; the message says the fix."""


def available() -> dict[str, str]:
    """Entry-point name -> ``module:Class`` of every registered environment."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve(entry: str) -> type:
    """The environment class ``entry`` names."""
    target = entry if ":" in entry else available().get(entry)
    if target is None:
        names = ", ".join(sorted(available())) or "none installed"
        raise EnvError(f"env.entry = {entry!r}: no environment of that name (registered: {names}); "
                       "or give \"package.module:ClassName\"")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"env.entry = {entry!r}: cannot import {module_name!r} ({exc}); "
                       "is its directory on PYTHONPATH?") from None
    except Exception as exc:   # the module itself is broken: a syntax error, or it raised while importing
        raise EnvError(f"env.entry = {entry!r}: importing {module_name!r} raised {_named(exc)}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvError(f"env.entry = {entry!r}: {target} is not a subclass of workers.envs.base.Environment")
    return cls


def load_env(entry: str, options: dict | None = None) -> Environment:
    """The environment ``entry`` names, built with ``options`` as keyword arguments."""
    cls = resolve(entry)
    try:
        return cls(**(options or {}))
    except TypeError as exc:
        raise EnvError(f"env.options for {entry!r}: {exc}") from None
    except Exception as exc:   # the user's __init__ failed (a missing data file, a bad option value)
        raise EnvError(f"env.entry = {entry!r}: building it with env.options {options or {}} raised "
                       f"{_named(exc)}") from None


def _named(exc: BaseException) -> str:
    """An exception as one line: its type, its message, and where a syntax error is."""
    where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
    return f"{type(exc).__name__}: {exc}{where}"


def env_from_config(cfg) -> Environment:
    """The environment of a job's config (``[env] entry`` and ``options``)."""
    return load_env(cfg.env.entry, cfg.env.options)


def chat_template_setting(cfg) -> bool | None:
    """``env.chat_template`` as the episode loop takes it: None (auto), True or False."""
    return {"auto": None, "on": True, "off": False}[cfg.env.chat_template]
