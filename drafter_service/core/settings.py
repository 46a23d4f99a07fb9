"""Settings declared once, on config dataclass fields: each gives a flag, an environment variable and a docs row."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

METADATA_KEY = "setting"
"""Key of a field's ``metadata`` that holds its Setting."""


def env_var(flag: str) -> str:
    """The environment variable of a flag: ``--max-nodes`` reads DRAFTER_MAX_NODES."""
    return "DRAFTER_" + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class Setting:
    """One setting: a command-line flag, the environment variable that sets its default, and its documentation.

    Declared on a dataclass field with :func:`setting` (the field then supplies ``field``, ``name`` and
    ``default``), or on its own for a flag that is not one-to-one with a field.

    Attributes:
        flag: the command-line flag, e.g. ``--max-nodes``.
        help: what it means, for ``--help`` and docs/configuration.md.
        group: the --help section and the docs table it belongs to.
        default: the flag's default (a field's default, with booleans as 0/1 and an empty tuple as "").
        kind: parses the flag's text and the environment variable's (None: from the default's type).
        parse: turns the flag's value into the field's when a config is built (None: the value as is, ``bool``
            for boolean fields); a ValueError it raises is a bad configuration.
        env: the environment variable whose value replaces the default ("": DRAFTER_<FLAG>).
        field: the dataclass field (keyword) it fills.
        name: how the docs name it, e.g. ``ServiceConfig.address``.
    """

    flag: str
    help: str
    group: str
    default: Any = None
    kind: Callable[[str], Any] | None = None
    parse: Callable[[Any], Any] | None = None
    env: str = ""
    field: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if not self.flag.startswith("--"):
            raise ValueError(f"setting flag {self.flag!r} must start with --")
        if not self.env:
            object.__setattr__(self, "env", env_var(self.flag))
        if self.kind is None and self.default is not None:
            object.__setattr__(self, "kind", type(self.default))

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments that holds its value."""
        return self.flag.lstrip("-").replace("-", "_")

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value from parsed arguments (``parse`` applied).

        Raises:
            ValueError: ``parse`` rejects the value.
        """
        raw = getattr(args, self.dest)
        return self.parse(raw) if self.parse is not None else raw


def setting(flag: str, help: str, group: str, *, kind: Callable[[str], Any] | None = None,
            parse: Callable[[Any], Any] | None = None, env: str = "") -> dict[str, Setting]:
    """Field metadata declaring a setting: ``field(default=32, metadata=setting("--max-nodes", "...", "drafting"))``.

    The field's default is the flag's; its type gives the flag's (booleans are 0/1 flags, and a field holding
    a tuple needs ``parse`` to build it from the flag's text).
    """
    return {METADATA_KEY: Setting(flag, help, group, kind=kind, parse=parse, env=env)}


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings declared on a dataclass's fields, in field order, completed from the fields."""
    found = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(METADATA_KEY)
        if declared is None:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a setting needs a plain default")
        default, parse = f.default, declared.parse
        if isinstance(default, bool):
            default, parse = int(default), parse or bool
        elif isinstance(default, tuple):
            if default or parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a tuple setting needs an empty default and a parse")
            default = ""
        found.append(dataclasses.replace(declared, default=default, parse=parse, field=f.name,
                                         name=f"{cls.__name__}.{f.name}"))
    return tuple(found)


def env_default(var: str, kind: Callable[[str], Any], default: Any, environ: Mapping[str, str] | None = None) -> Any:
    """``kind(value)`` of the environment variable ``var`` when it is set, else ``default``.

    Raises:
        SystemExit: the variable's value does not parse (the message names it).
    """
    raw = (os.environ if environ is None else environ).get(var)
    try:
        return kind(raw) if raw is not None else default
    except ValueError as exc:
        raise SystemExit(f"{var}={raw!r}: {exc}") from None


def add_settings(parser: argparse.ArgumentParser, settings: Iterable[Setting], *, sections: bool = True,
                 environ: Mapping[str, str] | None = None) -> None:
    """Add a flag per setting, its default read from its environment variable when set (now).

    Args:
        parser: the parser (or subcommand parser) to add to.
        settings: the settings, in the order --help lists them.
        sections: list them under a --help section per group (False: with the parser's other options).
        environ: the environment (default ``os.environ``).

    Raises:
        SystemExit: an environment variable's value does not parse.
    """
    groups: dict[str, Any] = {}
    for s in settings:
        kind = s.kind or str
        target = parser
        if sections:
            if s.group not in groups:
                groups[s.group] = parser.add_argument_group(s.group)
            target = groups[s.group]
        target.add_argument(s.flag, type=kind, default=env_default(s.env, kind, s.default, environ),
                            help=f"{s.help} [env {s.env}; default {s.default!r}]".replace("%", "%%"))


def values_from_args(settings: Iterable[Setting], args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments {field: value} of the settings that fill a field, from parsed arguments.

    Raises:
        ValueError: a setting's ``parse`` rejects its value.
    """
    return {s.field: s.value(args) for s in settings if s.field}
