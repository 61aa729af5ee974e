"""Option parsing shared by the commands: budgets, the YAML config file, and checks on option values.

Every bad value is a ``UsageError`` whose one-line message names the option and says what would be accepted.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import yaml

from klevict_cli.errors import UsageError

BUDGET_FORMS = (
    "a share of the streamed tokens, written with % or a decimal point (5%, 12.5%, 0.05, 1.0 = all), or a whole "
    "number of entries per KV head (2048, 2k = 2048, 1.5k = 1536, 1m = 1048576)"
)
# Token counts and positions are int32 in a .kvc file: no count option may exceed this.
MAX_COUNT = 2**31 - 1
# Binary multiples, as in "a 4k context" = 4096 tokens.
_TOKEN_SUFFIXES = {"": 1, "k": 1024, "m": 1024 * 1024}
# A number in ASCII digits only: float() would also take "nan", "inf", "1e3", "1_000" and other scripts' digits ("١٠").
_NUMBER = r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+"
_BUDGET_RE = re.compile(rf"(?P<number>{_NUMBER})\s*(?P<unit>%|[km]?)", re.IGNORECASE)

OPTION_TYPES: dict[str, type] = {
    "model": str,
    "budget": str,
    "max_kl": float,
    "max_bytes": str,
    "estimate": bool,
    "method": str,
    "chunk_size": int,
    "device": str,
    "dtype": str,
    "cache_dtype": str,
    "seed": int,
    "threads": int,
    "max_new_tokens": int,
    "prompt": str,
    "temperature": float,
    "top_p": float,
    "repetition_penalty": float,
    "no_repeat": int,
    "position_mode": str,
    "probe_window": int,
    "probe_dtype": str,
    "json": bool,
    "quiet": bool,
    "output": str,
    "max_memory": str,
    "working_limit": str,
    "reconstruct": bool,
}
# --probe-dtype: the forwards whose tokens are only samples of what the model may see next (look-ahead drafts, the
# re-reading, the sampled continuation of the drift estimate) run on a copy of the model at this precision; the read
# and every measured logit stay at the model's. auto: bfloat16 where the device computes it natively and the model is
# float32 (docs/method.md, "Probe precision"), else the model itself.
# (no float16: its range overflows in some models' probes — Gemma-3-270M's went to NaN — where bfloat16 keeps
# float32's range at the same cost)
PROBE_DTYPE_CHOICES = ("auto", "float32", "bfloat16")
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "position_mode": ("auto", "original", "compact"),
    "probe_dtype": PROBE_DTYPE_CHOICES,
}
TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
# Where the command line keeps what the user typed for each option (cli.remember_typed): ctx.meta[TYPED][name] is
# (the text, the value parsed from it, or None where it did not parse).
TYPED = "klevict.typed"


@dataclass(frozen=True)
class Budget:
    """How much of the KV cache to keep: a fraction of the document's tokens, or a fixed token count. A fraction may
    have a floor, `at_least` entries per head (the default budget has one: see reading.DEFAULT_BUDGET)."""

    fraction: float | None = None
    tokens: int | None = None
    at_least: int = 0

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.tokens is None):
            raise ValueError("Budget needs exactly one of fraction and tokens")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"Budget fraction must be in (0, 1], got {self.fraction}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"Budget tokens must be at least 1, got {self.tokens}")
        if not isinstance(self.at_least, int) or self.at_least < 0:
            raise ValueError(f"Budget at_least must be a count of at least 0, got {self.at_least!r}")
        if self.at_least and self.fraction is None:
            raise ValueError("only a fraction budget has a floor (at_least)")

    def resolve(self, n_tokens: int) -> int:
        """The number of tokens to keep for a document of ``n_tokens`` tokens (never 0)."""
        if self.tokens is not None:
            return self.tokens
        # Round first so that 5% of 100 is 5, not ceil(5.000000000000001) = 6.
        share = max(1, math.ceil(round(self.fraction * n_tokens, 6)))
        return max(share, min(self.at_least, n_tokens))

    def __str__(self) -> str:
        if self.tokens is not None:
            return str(self.tokens)
        percent = f"{self.fraction * 100:.9f}".rstrip("0").rstrip(".")
        return f"{percent}% (at least {self.at_least})" if self.at_least else f"{percent}%"


def parse_budget(text: str) -> Budget:
    """Parse a budget: "5%", "12.5%", "0.05", "2048", "2k", "1.5k", "1m" (spaces and case ignored).

    The grammar has one reading for each string: a share is written with "%" or a decimal point (then it must be in
    (0, 1]); a number without either is a count of entries per KV head, so "1" keeps one entry and "1.0" keeps
    everything. Counts with a suffix are rounded to a whole entry. Only ASCII digits are numbers.
    """
    match = _BUDGET_RE.fullmatch(text.strip())
    if match is None:
        raise _bad_budget(text)
    number, unit = float(match["number"]), match["unit"].lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise _bad_budget(text, "a percentage must be in (0, 100]")
        return Budget(fraction=number / 100)
    if unit == "" and "." in match["number"]:
        if not 0 < number <= 1:
            raise _bad_budget(text, "a number with a decimal point is a share of the tokens and must be in (0, 1]")
        return Budget(fraction=number)
    if number * _TOKEN_SUFFIXES[unit] > MAX_COUNT:  # also a number too long to be a float (inf)
        raise _bad_budget(text, f"a count of entries must be at most {MAX_COUNT}")
    tokens = round(number * _TOKEN_SUFFIXES[unit])
    if tokens < 1:
        raise _bad_budget(text, "a count of entries must be at least 1")
    return Budget(tokens=tokens)


def _bad_budget(text: str, why: str = "") -> UsageError:
    reason = f" ({why})" if why else ""
    return UsageError(f"invalid --budget '{text}'{reason}; use {BUDGET_FORMS}")


def load_config(path: Path | None) -> dict:
    """Read option defaults from a YAML file such as ``klevict.yaml``; no path means no config ({}).

    Keys are option names, with dashes or underscores; the result uses underscores. Values must be scalars of
    the option's type: an int is fine for a float option, and a number for a string option (``budget: 2048``),
    but a bool is never taken for a number or a string (YAML reads ``yes``/``no``/``on``/``off`` as bools).
    """
    if path is None:
        return {}
    where = f"config file {path}"
    if str(path) == "-":  # not a missing file named "-": standard input holds a document or questions
        raise UsageError(f"{where}: give a file; - reads standard input for documents and questions only")
    try:
        source = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{where}: is a directory, not a file") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where}: is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(source, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise UsageError(f"{where}: malformed YAML{_yaml_position(exc)}") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{where}: the top level must be a mapping of option names to values")
    config: dict = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in OPTION_TYPES:
            valid = ", ".join(sorted(k.replace("_", "-") for k in OPTION_TYPES))
            raise UsageError(f"{where}: unknown key '{key}'; valid keys: {valid}")
        if name in config:
            raise UsageError(f"{where}: key '{key}' is given twice (dashes and underscores are the same)")
        config[name] = _check_config_value(where, key, name, value)
    return config


# PyYAML reads YAML 1.1, whose floats need a decimal point: `max-kl: 1e-2` came as the string '1e-2', refused though
# `--max-kl 1e-2` is a number. A float option takes such a string as the number it is.
_EXPONENT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+")


def _check_config_value(where: str, key: object, name: str, value: object) -> object:
    expected = OPTION_TYPES[name]
    wrong = UsageError(f"{where}: key '{key}' must be {TYPE_NAMES[expected]}, got {_describe(value)}")
    if isinstance(value, bool) and expected is not bool:
        raise wrong
    if expected is bool:
        if not isinstance(value, bool):
            raise wrong
    elif expected is int:
        if not isinstance(value, int):
            raise wrong
    elif expected is float:
        value = float(value) if isinstance(value, str) and _EXPONENT.fullmatch(value) else value
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise wrong
        value = float(value)
    elif isinstance(value, int | float):
        value = str(value)
    elif not isinstance(value, str):
        raise wrong
    if value == "":  # as on the command line: not "no value" (`model: ''` read with the default model)
        raise UsageError(f"{where}: key '{key}' is empty; give a value, or leave the key out")
    choices = OPTION_CHOICES.get(name)
    if choices is not None and value not in choices:
        raise UsageError(f"{where}: key '{key}' must be one of: {', '.join(choices)}; got '{value}'")
    return value


def _describe(value: object) -> str:
    """A config value as YAML wrote it, not as Python prints it (`True`, `datetime.date(2020, 1, 1)`, `b'...'`)."""
    if value is None:
        return "no value"
    if isinstance(value, dict | list):
        return f"a {'mapping' if isinstance(value, dict) else 'list'}"
    if isinstance(value, bool):  # `device: off` is YAML's false
        return f"{str(value).lower()} (YAML reads yes, no, on and off as true or false: quote the value)"
    if isinstance(value, datetime.date):  # `prompt: 2020-01-01`
        return f"a date ({value}: quote the value)"
    if isinstance(value, bytes):
        return "a binary value (!!binary)"
    return f"{value!r}"


MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently: a user who
    wrote `budget:` twice would not know which one counts)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue  # `<<: *defaults`: merged by the safe loader; the mapping's own keys win over merged ones
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # not an option name: refused later as an unknown key
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_position(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    position = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{position}: {problem}" if problem else position


def merge_options(cli: dict, config: dict, defaults: dict) -> dict:
    """Resolve every option: the command line wins when given (not None), then the config file, then defaults."""
    merged = dict(defaults)
    for name, value in config.items():
        if value is not None:
            merged[name] = value
    for name, value in cli.items():
        if value is not None or name not in merged:
            merged[name] = value
    return merged


def check_choice(name: str, value: object, choices: Collection) -> object:
    """Reject ``value`` unless it is one of ``choices``; returns it so calls can be chained."""
    if value not in choices:
        options = ", ".join(str(choice) for choice in choices)
        raise UsageError(f"invalid --{_flag(name)} '{value}'; choose from: {options}")
    return value


def check_positive_int(name: str, value: object, maximum: int = MAX_COUNT) -> int:
    """Reject anything but an integer in [1, maximum]; a bool is not an integer here."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"invalid --{_flag(name)} '{typed(name, value)}'; must be a positive integer")
    return check_int_range(name, value, 1, maximum)


def check_int_range(name: str, value: int, low: int, high: int) -> int:
    """An integer option within [low, high]; the command line takes integers of any size."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"invalid --{_flag(name)} '{typed(name, value)}'; must be an integer from {low} to {high}")
    return value


def check_real(name: str, value: float, accepted: bool, rule: str, text: str | None = None) -> float:
    """A number option: `accepted` is its rule written positively, so that NaN, which fails every comparison, is
    refused with it; infinities are refused here. `text`: what the user wrote for it, where it was one item of a
    list (`bench --max-kl 0.01,-1`)."""
    if not (accepted and math.isfinite(value)):
        raise UsageError(f"invalid --{_flag(name)} '{text or typed(name, value)}'; it must be {rule}")
    return value


def typed(name: str, value: object) -> str:
    """`value` as the user typed it on the command line (`-1`, `1e3`), not as parsed (`-1.0`, `1000.0`), so that a
    message quotes what the user can find in the command; from elsewhere (a config file's `-1`), a whole number
    without the `.0` that reading it as a float added."""
    from typer._click.globals import get_current_context  # typer vendors its own click

    ctx = get_current_context(silent=True)
    text, parsed = (ctx.meta.get(TYPED, {}) if ctx is not None else {}).get(name, (None, None))
    if text is not None and repr(parsed) == repr(value):
        return text
    return str(value).removesuffix(".0") if isinstance(value, float) else str(value)


def _flag(name: str) -> str:
    return name.replace("_", "-")


_SIZE_RE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?)\s*(?P<unit>[kmgt]?)i?b?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(name: str, text: str) -> int:
    """Bytes from '512M', '4G', '1.5GiB', '2000000'."""
    match = _SIZE_RE.fullmatch(str(text).strip())
    size = float(match["number"]) * _SIZE_UNITS[match["unit"].lower()] if match else 0.0
    if not 0 < size <= _SIZE_UNITS["t"] * 2**20:  # an exabyte: also refuses a number too long to be a float (inf)
        raise UsageError(f"invalid --{_flag(name)} '{text}'; use a size like 512M, 4G or 1.5GiB")
    return int(size)


@dataclass(frozen=True)
class ByteLimit:
    """What a cache's keys and values may take: a size in bytes, or a share of the full cache's (every token read,
    in the model's dtype)."""

    size: int | None = None
    share: float | None = None

    def resolve(self, full_bytes: int) -> int:
        return self.size if self.size is not None else int(self.share * full_bytes)

    def __str__(self) -> str:
        if self.size is not None:
            return format_size(self.size)
        return f"{self.share * 100:.9f}".rstrip("0").rstrip(".") + "%"


def parse_byte_limit(text: str) -> ByteLimit:
    """`--max-bytes`: a size ('40M', '1.5GiB') or a share of the full cache ('5%')."""
    value = str(text).strip()
    if value.endswith("%"):
        number = value[:-1].strip()
        share = float(number) / 100 if re.fullmatch(_NUMBER, number) else float("nan")
        if not (math.isfinite(share) and 0 < share <= 1):
            raise UsageError(f"invalid --max-bytes '{text}'; a share of the full cache is in (0, 100]%")
        return ByteLimit(share=share)
    return ByteLimit(size=parse_size("max_bytes", value))


def parse_working_limit(text: str | None) -> Budget | float | None:
    """`--working-limit`: a multiple of the budget (`4x`, returned as a float) or an entry count (`8k`, `8192`,
    returned as a Budget); None for the default."""
    if text is None:
        return None
    value = str(text).strip().lower()
    if value.endswith("x"):
        number = value[:-1].strip()
        factor = float(number) if re.fullmatch(_NUMBER, number) else float("nan")
        if not (math.isfinite(factor) and factor >= 1):
            raise UsageError(f"invalid --working-limit '{text}'; a multiple of the budget is at least 1x (e.g. 4x)")
        return factor
    try:
        budget = parse_budget(value)
    except UsageError:
        budget = None
    if budget is None or budget.tokens is None:
        raise UsageError(f"invalid --working-limit '{text}'; give a multiple of the budget (4x) or a count (8k)")
    return budget


def format_size(size: int) -> str:
    """'512 MiB', '1.50 GiB': the inverse of `parse_size`, readable at any scale (not '0.00 GiB')."""
    for unit in ("T", "G", "M", "K"):
        if size >= _SIZE_UNITS[unit.lower()]:
            value = size / _SIZE_UNITS[unit.lower()]
            return f"{value:.2f} {unit}iB" if value < 10 else f"{value:.0f} {unit}iB"
    return "1 byte" if size == 1 else f"{size} bytes"


DTYPE_CHOICES = ("float32", "bfloat16", "float16", "auto")  # auto: float32 on CPU (fast and exact), bfloat16 on CUDA


def native_bfloat16(device) -> bool:
    """Whether `device` multiplies bfloat16 natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX),
    so that a bfloat16 product costs less than a float32 one instead of more."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, check, lambda: False)()
                   for check in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def resolve_probe_dtype(name: str, device, model_dtype):
    """The dtype of the probe copy for --probe-dtype, or None where the probes run on the model itself."""
    import torch

    check_choice("probe_dtype", name, PROBE_DTYPE_CHOICES)
    if name == "auto":
        wanted = torch.bfloat16 if model_dtype == torch.float32 and native_bfloat16(device) else model_dtype
    else:
        wanted = getattr(torch, name)
    return None if wanted == model_dtype else wanted


def resolve_device(name: str):
    """The torch device for --device, refusing one this machine does not have: a bad option, found before the model
    loads."""
    import torch  # here, so that `klevict --help` does not wait for it

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"invalid --device '{name}'; unknown device (choose cpu, cuda, cuda:N, mps or auto)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"invalid --device '{name}': no CUDA GPU is available (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"invalid --device '{name}': it does not exist ({torch.cuda.device_count()} CUDA GPU(s)"
                             " found)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"invalid --device '{name}': Apple MPS is not available (use --device cpu)")
    return device


def resolve_dtype(name: str, device):
    """The torch dtype for --dtype; "auto" picks what is fast and accurate on `device`."""
    import torch

    check_choice("dtype", name, DTYPE_CHOICES)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
