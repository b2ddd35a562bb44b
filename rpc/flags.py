"""Command-line flags generated from frozen dataclasses, so every default is written once: in the field.

`add_flags(parser, cls)` adds one ``--kebab-case`` flag per field of ``cls``; `config_from_args(cls,
args)` builds the config back from the parsed arguments; `to_argv(config)` gives the flags that reproduce
a config (only those whose value differs from the default), so a launcher starts a child with a typed
config instead of hand-written flag strings. The three serving CLIs (`baton worker`, `gateway`,
`scheduler`) and `baton up` are built this way.

* **Types** come from the annotations: ``int``, ``float``, ``str``; ``bool`` is ``--x/--no-x``
  (`argparse.BooleanOptionalAction`); ``X | None`` parses as ``X``; ``tuple[X, ...]`` is a
  comma-separated list.
* **Nesting**: a field whose type is a dataclass contributes that dataclass's fields, recursively, with
  their plain names (`WorkerConfig.engine.dtype` is ``--dtype``): the nested configs of one command are
  one flag namespace, and these are the names people already type. Their defaults are the nested
  field's default *instance* (so a worker's ``--kv-cache-memory`` defaults to the worker's engine
  default, not `EngineConfig`'s). Where names would clash, the nested field's ``prefix`` metadata
  prefixes its flags (``"prefix": "engine-"`` gives ``--engine-dtype``); a clash without one is an error
  when the parser is built, never a silently shadowed flag. A flag's ``dest`` is the field path
  (``engine.dtype``) after `add_flags`' own prefix (``candidate-`` → ``candidate_engine.dtype``),
  whatever the flag is called.
* **Metadata** (``dataclasses.field(metadata={...})``, plain string keys, so configs below ``rpc`` —
  `engine.config` — need not import this module):

  ``help``      the flag's help; ``(default: …)`` is appended from the field unless the help explains
                the default itself (``(default …`` in it, or it starts with "default")
  ``choices``   the allowed values
  ``parse``     text → value, in place of the annotation's type (e.g. `core.units.parse_bytes`;
                byte sizes parsed with it are also written and shown as ``256MiB``)
  ``none``      the text that means None, for an optional field whose default is not None
                (``"-1"`` for "no metrics port", ``""`` for "no default tenant")
  ``flag``      False: the field is no flag (it keeps its default, or its class derives it); a
                string: the flag's name instead of the field's (``"threads"`` for ``num_threads``)
  ``metavar``   the value's name in the help
  ``prefix``    on a nested dataclass field: the prefix of its flags' names (see Nesting)
  ``exclude``   on a nested dataclass field: names of its fields that are no flags of this parent
                (the parent sets them itself; see `services.worker.config`)

Values are checked twice: by the flag (type, choices) and by the dataclass's own ``__post_init__``; with
``parser`` given, `config_from_args` reports the latter as a usage error too (exit 2, no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from core.units import parse_bytes

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

KEYS = frozenset({"help", "choices", "parse", "none", "flag", "metavar", "prefix", "exclude"})
_SCALARS: tuple[type, ...] = (int, float, str)
_OPTION_LIKE = re.compile(r"-(?!\d+$|\d*\.\d+$)")  # argparse's negative-number rule, negated
_SAYS_DEFAULT = re.compile(r"(^|\()default\b")  # the help explains the default itself


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """One leaf field of a (nested) config and the flag that sets it."""

    path: tuple[str, ...]  # field names from the top config: ("engine", "dtype")
    name: str  # the flag without its dashes: "dtype"
    kind: type  # int, float, str, bool or tuple
    item: type  # a tuple's element type; else kind
    optional: bool  # the annotation admits None
    default: Any
    required: bool  # the field has no default
    meta: Mapping[str, Any]
    group: str = ""  # the help section of a nested config's flags: "engine (EngineConfig)"
    dest_prefix: str = ""  # add_flags' prefix, as an identifier

    @property
    def dest(self) -> str:
        return self.dest_prefix + ".".join(self.path)

    @property
    def option(self) -> str:
        return "--" + self.name

    def parse(self, text: str) -> Any:
        """The flag's text → the field's value; a bad value raises `argparse.ArgumentTypeError`."""
        if self.optional and "none" in self.meta and text == self.meta["none"]:
            return None
        parse = self.meta.get("parse")
        try:
            if parse is not None:
                return parse(text)
            if self.kind is tuple:
                return tuple(self.item(t.strip()) for t in text.split(",") if t.strip())
            return self.kind(text)
        except (ValueError, TypeError) as e:
            if parse is not None and str(e):
                raise argparse.ArgumentTypeError(str(e)) from None
            raise argparse.ArgumentTypeError(f"not {_a(self.item.__name__)}: {text!r}") from None

    def format(self, value: Any) -> str:
        """A value as this flag's text (`parse` reads it back)."""
        if value is None:
            if "none" not in self.meta:
                raise ValueError(f"{self.option} has no spelling for None")
            return str(self.meta["none"])
        if self.kind is tuple:
            return ",".join(self._scalar(v) for v in value)
        return self._scalar(value)

    def _scalar(self, value: Any) -> str:
        if self.meta.get("parse") is parse_bytes and isinstance(value, int):
            return bytes_text(value)
        return str(value)

    def help(self) -> str:
        text = str(self.meta.get("help", ""))
        if self.required or _SAYS_DEFAULT.search(text):
            return _escape(text)
        if self.kind is bool:
            shown = "on" if self.default else "off"
        elif self.default is None or self.default == ():
            shown = "none"
        else:
            shown = self.format(self.default)
        return _escape(f"{text} (default: {shown})".strip())


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help


def bytes_text(n: int) -> str:
    """Bytes as people write them (``256MiB``), read back by `core.units.parse_bytes`."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def port_or_off(text: str) -> int | None:
    """A port flag where a negative number (``-1``) means "none": 0 is any free port."""
    port = int(text)
    return None if port < 0 else port


def metrics_port_field() -> Any:
    """The ``metrics_port`` field of a serving process's config: 0 = any free port, None (``-1``) = no
    metrics endpoint."""
    return dataclasses.field(
        default=0,
        metadata={
            "parse": port_or_off,
            "none": "-1",
            "help": "port of GET /metrics (default 0: any free port, printed at start; -1: no metrics)",
        },
    )


def _check_meta(cls: type, f: dataclasses.Field[Any]) -> None:
    unknown = set(f.metadata) - KEYS
    if unknown:
        raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")


def _field_default(f: dataclasses.Field[Any]) -> tuple[Any, bool]:
    """(the field's default, whether it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default, False
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory(), False
    return None, True


def _kind(cls: type, name: str, hint: Any) -> tuple[type, type, bool]:
    """(kind, item type, optional) of a field's annotation; TypeError for one no flag can carry."""
    args = typing.get_args(hint)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{cls.__name__}.{name}: no flag for the union {hint}")
        hint, optional = rest[0], True
        args = typing.get_args(hint)
    if hint is bool or hint in _SCALARS:
        return hint, hint, optional
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        return tuple, args[0], optional
    raise TypeError(f"{cls.__name__}.{name}: no flag for the type {hint}; give it metadata 'parse'")


def flags(cls: type[DataclassInstance], prefix: str = "", default: Any = None) -> Iterator[Flag]:
    """The flags of ``cls`` and of its nested dataclass fields, in field order. Defaults come from
    ``default`` (an instance of ``cls``) where given, else from the fields."""
    for flag in _walk(cls, prefix, default, (), frozenset()):
        yield dataclasses.replace(flag, dest_prefix=prefix.replace("-", "_"))


def _walk(
    cls: type[DataclassInstance], prefix: str, default: Any, path: tuple[str, ...], exclude: frozenset[str]
) -> Iterator[Flag]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _check_meta(cls, f)
        if not f.init or f.name in exclude or f.metadata.get("flag", True) is False:
            continue
        value, required = (getattr(default, f.name), False) if default is not None else _field_default(f)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            assert isinstance(hint, type)
            inner = frozenset(f.metadata.get("exclude", ()))
            nested_prefix = prefix + str(f.metadata.get("prefix", ""))
            yield from _walk(hint, nested_prefix, value, (*path, f.name), inner)
            continue
        kind, item, optional = _kind(cls, f.name, hint)
        name = f.metadata.get("flag")
        name = prefix + (name if isinstance(name, str) else f.name.replace("_", "-"))
        group = f"{'.'.join(path)} ({cls.__name__})" if path else ""
        yield Flag((*path, f.name), name, kind, item, optional, value, required, f.metadata, group)


def add_flags(parser: argparse.ArgumentParser, cls: type[DataclassInstance], prefix: str = "") -> None:
    """One flag per (nested) field of ``cls``, named ``--<prefix><field-name>``; see the module doc."""
    seen: dict[str, str] = {}
    groups: dict[str, Any] = {"": parser}
    for flag in flags(cls, prefix):
        if flag.name in seen:
            raise TypeError(
                f"{cls.__name__}: {flag.dest} and {seen[flag.name]} would both be {flag.option}; "
                "give the nested field a 'prefix' (or 'exclude' one of them)"
            )
        seen[flag.name] = flag.dest
        kw: dict[str, Any] = {"dest": flag.dest, "help": flag.help(), "required": flag.required}
        if not flag.required:
            kw["default"] = flag.default
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        group = groups[flag.group]
        if flag.kind is bool:
            group.add_argument(flag.option, action=argparse.BooleanOptionalAction, **kw)
            continue
        if "choices" in flag.meta:
            kw["choices"] = tuple(flag.meta["choices"])
        else:
            kw["metavar"] = flag.meta.get("metavar", flag.name.upper().replace("-", "_"))
        group.add_argument(flag.option, type=flag.parse, **kw)


def config_from_args(
    cls: type[T], args: argparse.Namespace, parser: argparse.ArgumentParser | None = None, prefix: str = ""
) -> T:
    """The (nested) config the flags of `add_flags` were given for. A value the dataclass rejects
    (ValueError from its ``__post_init__``) is ``parser.error`` where ``parser`` is given (exit 2)."""
    values = {".".join(flag.path): getattr(args, flag.dest) for flag in flags(cls, prefix)}
    try:
        return _build(cls, values, None, ())
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))


def _build(cls: type[T], values: Mapping[str, Any], default: Any, path: tuple[str, ...]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dest = ".".join((*path, f.name))
        if dest in values:
            kwargs[f.name] = values[dest]
        elif dataclasses.is_dataclass(hints[f.name]):
            nested = getattr(default, f.name) if default is not None else _field_default(f)[0]
            kwargs[f.name] = _build(hints[f.name], values, nested, (*path, f.name))
        elif default is not None:  # no flag here: the nested default's value
            kwargs[f.name] = getattr(default, f.name)
    return cls(**kwargs)


def to_argv(
    config: DataclassInstance, cls: type[DataclassInstance] | None = None, prefix: str = ""
) -> list[str]:
    """The flags that make `config_from_args` give ``config``: only those whose value is not the flag's
    default (what a child's parser assumes anyway). Fields that are no flags are not reproduced: they are
    defaults or derived (like a worker's engine ``heavy_prefill_chunk``)."""
    argv: list[str] = []
    for flag in flags(cls or type(config), prefix):
        value: Any = config
        for name in flag.path:
            value = getattr(value, name)
        if not flag.required and value == flag.default:
            continue
        if flag.kind is bool:
            argv.append(flag.option if value else "--no-" + flag.option[2:])
            continue
        text = flag.format(value)
        # A value argparse would take for an option (not a negative number) goes after "=".
        argv += [f"{flag.option}={text}"] if _OPTION_LIKE.match(text) else [flag.option, text]
    return argv


def field_like(cls: type[DataclassInstance], path: str, **metadata: Any) -> Any:
    """A dataclass field with the default and metadata of ``cls``'s field at ``path`` (``"a.b"`` for a
    nested one, whose default is the nested default's), metadata overridden by keywords: for a command
    (`baton up`) whose flags are its children's, so their defaults are not copied."""
    owner: Any = cls
    instance: Any = None
    for name in path.split("."):
        f = next(f for f in dataclasses.fields(owner) if f.name == name)
        instance = getattr(instance, name) if instance is not None else _field_default(f)[0]
        owner = type(instance)
    return dataclasses.field(default=instance, metadata={**f.metadata, **metadata})
