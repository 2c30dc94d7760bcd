"""Dotted command-line overrides of a named config, parsed by tyro as torchtitan's command line is:
`--trainer.lr 1e-5 --controller.steps=5 --trainer.bf16_autocast false`.

tyro types every field from the dataclasses and documents it from their comments (`--help`). Two
things are ours: booleans keep taking a value in any case (true/false, yes/no, 1/0), and tyro's
boxed error becomes the single line that meshrl prints for bad input.
"""

import contextlib
import copy
import dataclasses
import io
import re
import typing

import tyro

TYRO_OPTIONS = dict(config=(tyro.conf.FlagConversionOff,), use_underscores=True)
_BOOLEANS = {"1": "True", "true": "True", "yes": "True", "0": "False", "false": "False", "no": "False"}


class ConfigError(ValueError):
    pass


MOVED = {"replay_buffer.max_policy_age": "controller.max_policy_age"}  # old key -> where it is now


def _moved(args: list[str]) -> None:
    for arg in args:
        key = arg.removeprefix("--").partition("=")[0]
        if arg.startswith("--") and key in MOVED:
            raise ConfigError(f"--{key} is now --{MOVED[key]}")


# tyro builds its parser of the whole config anew on every call (about 0.1 s here, most of it reading the
# fields' comments); a study plans and reports the same few runs many times over: each parse is kept.
_PARSED: dict[tuple, object] = {}
_KEEP = 256


def apply_overrides(config, args: list[str]):
    """A copy of `config` with `args` applied; a ConfigError with one line on bad input."""
    key = (type(config), repr(config), tuple(args))  # a config's repr shows every field
    if key not in _PARSED:
        if len(_PARSED) >= _KEEP:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = _parse(config, args)
    return copy.deepcopy(_PARSED[key])


def _parse(config, args: list[str]):
    _moved(args)
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            return tyro.cli(type(config), default=config, args=_booleans(config, args), **TYRO_OPTIONS)
    except SystemExit:
        raise ConfigError(one_line(text.getvalue())) from None


def help_text(config, prog: str) -> str:
    """Every field of `config` with its type, default (this config's value) and comment."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        tyro.cli(type(config), default=config, args=["--help"], prog=prog, **TYRO_OPTIONS)
    return text.getvalue()


def _field_type(config, dotted: str):
    target, kind = config, None
    for name in dotted.split("."):
        fields = {f.name: f for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else {}
        if name not in fields:
            return None
        kind = typing.get_type_hints(type(target))[name]
        target = getattr(target, name)
    return kind


def _booleans(config, args: list[str]) -> list[str]:
    """`--x.flag false` and `--x.flag=YES` as tyro's True/False, for boolean fields only."""
    out = list(args)
    for i, arg in enumerate(out):
        key, has_value, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or _field_type(config, key) is not bool:
            continue
        if has_value:
            out[i] = f"--{key}={_BOOLEANS.get(value.lower(), value)}"
        elif i + 1 < len(out):
            out[i + 1] = _BOOLEANS.get(out[i + 1].lower(), out[i + 1])
    return out


_RULE = re.compile(r"^[\s\-─━│╭╮╰╯┃]*$")


def one_line(box: str) -> str:
    """tyro's error box as one line: its title and message, and its first suggestion if any."""
    lines = [line.strip(" │┃╭╮╰╯") for line in box.splitlines()]
    parts, current = [], []
    for line in lines:
        if _RULE.match(line):
            if current:
                parts.append(" ".join(current))
            current = []
        else:
            current.append(" ".join(line.split()))
    if current:
        parts.append(" ".join(current))
    parts = [p for p in parts if p and not p.startswith("For full helptext")]
    if not parts:
        return "bad command line"
    title, message = parts[0], parts[1] if len(parts) > 1 else ""
    if title == "Unrecognized options":
        message = "unknown config key or bad override: " + message.removeprefix("Unrecognized options: ")
        suggestion = next((p for p in parts[2:] if p.startswith("Perhaps you meant:")), "")
        flags = re.findall(r"--[\w.]+", suggestion)
        return message + (f" (did you mean {flags[0]}?)" if flags else "")
    return f"{title.lower()}: {message}" if message else title.lower()
