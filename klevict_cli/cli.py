"""The `klevict` command line: results on stdout, progress and notes on stderr, `--json` for machines.

Every option may also come from `--config klevict.yaml`; the command line wins. User mistakes end with one line
`error: …` and the exit code of their class (see `klevict --help`), never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer import _click as click  # typer vendors its own click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from klevict_cli import __version__
from klevict_cli.display import (Count, TextStream, counted, drift_against, drift_words, err, json_text, shown,
                                 visible)
from klevict_cli.errors import DocumentError, KlevictError, ModelError, OutputError, ResourceError, UsageError
from klevict_cli.files import (
    CLOSED_PIPE,
    STDOUT_NAME,
    GuardedStdout,
    check_destination,
    is_html_file,
    is_json_file,
    is_stdout,
    same_file,
    silence_stdout,
    write_stdout,
)
from klevict_cli.options import (
    DTYPE_CHOICES, MAX_COUNT, PROBE_DTYPE_CHOICES, TYPE_NAMES, TYPED, check_choice, check_int_range,
    check_positive_int, check_real, load_config, merge_options, parse_budget, parse_byte_limit, parse_size,
    parse_working_limit, resolve_device, resolve_dtype, typed,
)
from klevict_cli.reading import prepare_session, read_options, read_settings, release_sessions, session_for

EXIT_CODES = """Exit codes: 0 ok; 1 unexpected error; 2 bad option, budget or config; 3 unreadable document;
4 bad .kvc file; 5 model cannot be loaded; 6 does not fit the model's context or memory; 7 cannot write the output;
8 some documents or caches of a batch failed (the rest were done); 129 hung up (the terminal closed); 130 interrupted
(Ctrl-C); 143 terminated (SIGTERM)."""

app = typer.Typer(
    name="klevict",
    help="Stream long documents through an LLM with KL-guided KV-cache eviction; save and reuse the compressed cache."
    "\n\n" + EXIT_CODES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
out = Console(highlight=False, soft_wrap=True)

DEFAULTS: dict[str, Any] = {
    "model": None,
    "budget": None,  # reading.DEFAULT_BUDGET, unless --max-kl decides the size (then --budget is only a cap)
    "max_kl": None,
    "max_bytes": None,  # compress: keys and values within this many bytes, the dtype chosen (--cache-dtype: that one)
    "method": "kl",
    "chunk_size": 512,
    "device": "cpu",
    "dtype": "float32",
    "cache_dtype": None,
    "seed": 0,
    "threads": None,  # torch's own choice: one per core
    "max_new_tokens": 256,
    "prompt": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "repetition_penalty": 1.1,
    "no_repeat": 8,
    "position_mode": "auto",
    "probe_window": 32,
    "probe_dtype": "auto",
    "json": False,
    "quiet": False,
    "max_memory": None,
    "working_limit": None,
    "reconstruct": None,  # None: on for compress (a saved cache serves questions), off for summarize
    "estimate": None,  # the same
}
MAX_THREADS = 1024  # more would only add threads that wait
CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")

# ---- shared options ------------------------------------------------------------------------------------------
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Packaged alias (smollm2-135m, the default; "
                                               "for ask, the model that made the cache), a local HF folder, a .gguf "
                                               "file or a hub id.")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", "-b", help="Entries kept per KV head: a share of the "
                                                "streamed tokens, with % or a decimal point (5%, 0.05), or a count "
                                                "(2048, 2k = 2048). Default 10%, at least 96.")]
# Kept in step with klevict_cli.policies.POLICIES by a test: importing it takes seconds (torch, transformers), and
# an option must be checked, and a bad document refused, without that wait.
METHOD_NAMES = ("kl", "kl-fisher", "kl-layer", "kl-reconstruct", "none", "streaming", "snapkv", "kvzip", "kvgrad",
                "expected_attention", "observed_attention", "pyramidkv", "h2o", "tova", "value", "caote", "keydiff",
                "knorm", "random")
METHODS = ", ".join({"kl": "kl (default)", "none": "none (the full cache)"}.get(m, m) for m in METHOD_NAMES)
MethodOpt = Annotated[str | None, typer.Option("--method", help=f"Eviction policy: {METHODS}.")]
ChunkOpt = Annotated[int | None, typer.Option("--chunk-size", help="Tokens per prefill chunk (default 512).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:N, mps or auto.")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="Model dtype: float32, bfloat16, float16, auto.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed for sampling and seeded policies (0 to 2^64-1; "
                                              "default 0: the same sampled answer each run unless it changes).")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads, 1 to 1024 (default: one per "
                                                "core; give fewer when other work shares the machine).")]
MaxNewOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Longest answer (default 256).")]
TempOpt = Annotated[float | None, typer.Option("--temperature", help="0 = greedy (default), or 0.01 to 100.")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling mass when --temperature > 0.")]
RepeatOpt = Annotated[float | None, typer.Option("--repetition-penalty", help="Discourage repeating the answer's last "
                                                 "64 tokens (1 = off; default 1.1).")]
NoRepeatOpt = Annotated[int | None, typer.Option("--no-repeat", help="Never write the same run of this many answer "
                                                 "tokens twice (0 = off; default 8).")]
ModeOpt = Annotated[str | None, typer.Option("--position-mode", help="auto (default), original or compact.")]
ProbeOpt = Annotated[int | None, typer.Option("--probe-window", help="Last tokens of a chunk used as probes and "
                                              "always kept (default 32).")]
ProbeDtypeOpt = Annotated[str | None, typer.Option("--probe-dtype", help="Precision of the forwards that only inform "
                                                   "the choice (drafts, re-reading, the drift's samples): auto "
                                                   "(bfloat16 where the device computes it natively, for a float32 "
                                                   "model), float32 or bfloat16.")]
JsonOpt = Annotated[bool | None, typer.Option("--json", help="Print one JSON object on stdout.")]
QuietOpt = Annotated[bool | None, typer.Option("--quiet", "-q", help="No progress or notes on stderr.")]
MemoryOpt = Annotated[str | None, typer.Option("--max-memory", help="Refuse up front if reading would, by klevict's "
                                                "estimate, need more memory than this (e.g. 4G; long reads can pass "
                                                "it by a fifth).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML file with any of these options.")]
BENCH_CONFIG = ("model", "chunk_size", "device", "dtype", "seed", "threads", "probe_window", "probe_dtype", "quiet",
                "json")
BenchConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML file of the model and reading options ("
                                                     + ", ".join(k.replace("_", "-") for k in BENCH_CONFIG)
                                                     + "); bench's own options (--budgets, --windows, ...) are "
                                                     "flags only. A note names the config's other keys, which bench"
                                                     " ignores.")]
EstimateOpt = Annotated[bool | None, typer.Option("--estimate/--no-estimate", help="Measure how far the last eviction "
                                                 "moved the model (estimated_kl; 16 x 16 sampled tokens: on a CPU "
                                                 "about twice a short read's time). Default: on for compress of "
                                                 "1,024 tokens or more, off for summarize.")]
MaxKlOpt = Annotated[float | None, typer.Option("--max-kl", help="Keep the smallest cache whose estimated drift "
                                               "(mean next-token KL, nats per token) is at most this; a --budget "
                                               "given is then only a cap (the default budget does not apply).")]
WorkingOpt = Annotated[str | None, typer.Option("--working-limit", help="Entries per KV head held while reading "
                                                 "before evicting: a multiple of the budget (4x, the default) or a "
                                                 "count (8k).")]
ReconstructOpt = Annotated[bool | None, typer.Option("--reconstruct/--no-reconstruct", help="kl: also judge entries "
                                                     "by the model re-reading the document (default: on for "
                                                     "compress, off for summarize).")]


def handle_errors(fn):
    """Turn user errors and interrupts into one line on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = {}
        try:
            for signum in STOPPING:
                # a hangup is caught only where it would kill: under nohup (ignored) klevict goes on
                if signum == signal.SIGTERM or signal.getsignal(signum) == signal.SIG_DFL:
                    previous[signum] = signal.signal(signum, _raise_terminated)
        except ValueError:  # not the main thread (e.g. some test runners)
            pass
        try:
            return fn(*args, **kwargs)
        except KlevictError as exc:
            say(f"error: {exc}")
            raise typer.Exit(exc.exit_code) from None
        except BrokenPipeError:  # a result (an answer, a table) to a reader that stopped early
            silence_stdout()
            say(f"error: {CLOSED_PIPE}")
            raise typer.Exit(OutputError.exit_code) from None
        except KeyboardInterrupt:
            say("interrupted")
            raise typer.Exit(130) from None
        except Terminated as exc:
            try:
                say("terminated" if exc.signum == signal.SIGTERM else "hung up")
            except OSError:  # the terminal that hung up is gone
                pass
            raise typer.Exit(128 + exc.signum) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    return wrapper


def say(line: str) -> None:
    """One unwrapped line on stderr (rich would wrap long messages at the terminal width); file names in it may hold
    escape sequences, which are shown, not obeyed."""
    sys.stderr.write(visible(" ".join(line.split())) + "\n")
    sys.stderr.flush()


def echo(text: str) -> None:
    """A result on stdout as plain text: no rich markup or emoji codes, control characters shown, not obeyed."""
    put(text + "\n")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised like KeyboardInterrupt so that atomic writes clean up their temp files."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


# the signals that stop a command as Ctrl-C does (SIGHUP: the terminal closed; none on Windows)
STOPPING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _show_usage_error(self, file=None) -> None:
    """Option-parser mistakes (unknown flag, missing value) get the same one-line form as every other error; a value
    that is not a number says so as klevict's own checks do ("invalid --seed 'x'; must be an integer"), not in
    click's words."""
    ctx = getattr(self, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    message = self.format_message()
    not_parsed = _not_parsed(self, ctx)
    if not_parsed is not None:
        message, hint = not_parsed, ""
    elsewhere = _taken_elsewhere(self, ctx)
    if elsewhere is not None:
        message = elsewhere
    missing = getattr(getattr(self, "param", None), "name", "") if not_parsed is None else ""
    if ctx is not None and ctx.info_name == "ask" and missing == "cache_files":
        # given one argument, click takes it for QUESTION and says CACHE is missing, though the question is
        message = "ask needs a cache and a question: klevict ask CACHE QUESTION (- reads questions from stdin)"
    say(f"error: {message}{hint}")


def _taken_elsewhere(error, ctx) -> str | None:
    """An unknown option that other commands take (`ask --budget`) is said to be theirs; click would offer the
    closest spelling among this command's options instead ("Possible options: --quiet")."""
    if not isinstance(error, click.exceptions.NoSuchOption) or ctx is None or ctx.parent is None:
        return None
    group = ctx.parent.command
    takers = [name for name, command in getattr(group, "commands", {}).items()
              if name != ctx.info_name and any(error.option_name in (*param.opts, *param.secondary_opts)
                                               for param in command.params)]
    if not takers:
        return None
    return (f"{ctx.info_name} has no {error.option_name}: it is an option of {_listed(takers)}"
            + (" (the cache's size and method were chosen when it was compressed)" if ctx.info_name == "ask" else ""))


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


click.exceptions.UsageError.show = _show_usage_error


def _not_parsed(error, ctx) -> str | None:
    """An option's text that its type refused (`--temperature abc`, `--max-new-tokens 1.5`), or an empty value, in
    klevict's words; None for any other parser error."""
    param = getattr(error, "param", None)
    if ctx is None or not isinstance(error, click.exceptions.BadParameter) or param is None:
        return None
    text, parsed = ctx.meta.get(TYPED, {}).get(param.name, (None, None))
    if text == "":
        return (f"{param.opts[0]} is empty; give a value, or leave {param.opts[0]} out"
                if param.param_type_name == "option" else f"an empty {param.metavar or param.name} argument ('')")
    kind = TYPE_NAMES.get(getattr(getattr(param, "type_descriptor", None), "annotation", None))
    if text is None or parsed is not None or kind is None or param.param_type_name != "option":
        return None
    return f"invalid {param.opts[0]} '{text}'; must be {kind}"


_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")  # what an integer option takes: digits, as a config's integer keys


def _remember_typed() -> None:
    """Keep each option's text as typed (options.TYPED), for messages that quote it: click keeps only the value
    parsed from it, and `-1.0` or `1000.0` is not what the user wrote (`-1`, `1e3`). An empty value is refused here,
    for every option and argument: click reads '' as a name for the current folder (`ask "$CACHE" q` with CACHE
    unset asked every cache there) and several options as "not given" (`--model ''`: the default model)."""
    parameter = getattr(typer.core, "_TyperParameter", None)
    if parameter is None or not hasattr(parameter, "process_value"):
        return  # another typer: messages show parsed values, harmless
    plain = parameter.process_value

    def process_value(self, ctx, value):
        texts = [value] if isinstance(value, str) else list(value) if isinstance(value, tuple | list) else []
        if not (texts and self.name
                and ctx.get_parameter_source(self.name) == click.core.ParameterSource.COMMANDLINE):
            return plain(self, ctx, value)
        seen = ctx.meta.setdefault(TYPED, {})
        if "" in texts:
            seen[self.name] = ("", None)
            raise click.exceptions.BadParameter("empty", ctx=ctx, param=self)
        if not isinstance(value, str):
            return plain(self, ctx, value)
        seen[self.name] = (value, None)
        if getattr(getattr(self, "type_descriptor", None), "annotation", None) is int and not _INTEGER.fullmatch(value):
            raise click.exceptions.BadParameter("not an integer", ctx=ctx, param=self)  # `2.0`, `1_000`: as a config
        parsed = plain(self, ctx, value)
        seen[self.name] = (value, parsed)
        return parsed

    parameter.process_value = process_value


_remember_typed()


def _patch_argument_help() -> None:
    """Arguments in --help as FILE... or CACHE (their metavar, with ... when several may be given), not typer's
    `files... <list[str]>`: the help text says what an argument is, a Python type name does not."""
    argument = getattr(typer.core, "TyperArgument", None)
    if argument is None or not hasattr(argument, "display_type_rich") or not hasattr(argument, "_rich_display_name"):
        return  # another typer: its own display, harmless
    plain_type, plain_name = argument.display_type_rich, argument._rich_display_name

    def display_type(self, ctx):
        return None if self.metavar else plain_type(self, ctx)

    def display_name(self):
        return self.metavar + ("..." if self.nargs != 1 else "") if self.metavar else plain_name(self)

    argument.display_type_rich, argument._rich_display_name = display_type, display_name


_patch_argument_help()


def resolve_options(config: Path | None, from_file: dict | None = None, answers: bool = False, **cli: Any
                    ) -> dict[str, Any]:
    """Every option, from the command line, then the config file, then the defaults; checked. A bad value from the
    file is refused naming the file and its key (the file's values that the command line leaves in force are
    checked alone first), not a flag the user never typed. `from_file`: the config already read (load_config).
    `answers`: the command writes an answer (`ask`, `summarize`), so --max-new-tokens is at least 1."""
    from_file = load_config(config) if from_file is None else from_file
    in_force = {key: value for key, value in from_file.items() if cli.get(key) is None}
    try:
        check_options(merge_options({}, in_force, DEFAULTS), answers)
    except UsageError as err:
        raise UsageError(f"config file {config}: {config_words(str(err), in_force)}") from None
    try:
        return check_options(merge_options(cli, from_file, DEFAULTS), answers)
    except UsageError as err:  # the command line against the file (--max-kl given, method: none in the file)
        named = [key for key in in_force if f"--{key.replace('_', '-')}" in str(err)]
        raise UsageError(f"{err} ({', '.join(named)}: from config file {config})" if named else str(err)) from None


def config_words(message: str, from_file: dict) -> str:
    """A checker's message about a flag, said of the config key it came from ("invalid --chunk-size" -> "invalid
    chunk_size"): the flag names in it are those of keys the file sets."""
    for key in sorted(from_file, key=len, reverse=True):
        message = message.replace(f"--{key.replace('_', '-')}", key)
    return message


def check_options(opts: dict[str, Any], answers: bool = False) -> dict[str, Any]:
    """Refuse a malformed option with a UsageError that names it; returns `opts`. `answers`: the command writes an
    answer, which --max-new-tokens 0 (a planned answer length for `compress`) would leave empty."""
    if opts.get("budget") is not None:
        parse_budget(str(opts["budget"]))
    parse_working_limit(opts.get("working_limit"))
    if opts.get("max_memory"):
        parse_size("max_memory", opts["max_memory"])
    if opts.get("chunk_size") is not None:
        check_positive_int("chunk_size", opts["chunk_size"])
    check_positive_int("probe_window", opts["probe_window"])
    if opts.get("max_new_tokens") is not None:
        if answers and opts["max_new_tokens"] == 0:
            raise UsageError("--max-new-tokens 0 leaves no room for an answer; give at least 1")
        check_int_range("max_new_tokens", opts["max_new_tokens"], 1 if answers else 0, MAX_COUNT)
    if opts.get("prompt") is not None and not str(opts["prompt"]).strip():
        raise UsageError("--prompt is empty; give an instruction, or leave --prompt out for a summary")
    check_int_range("seed", opts["seed"], 0, 2**64 - 1)  # what torch's generators take
    if opts.get("threads") is not None:
        check_positive_int("threads", opts["threads"], MAX_THREADS)
    if opts["device"] == "cpu":  # the default: no need to import torch (seconds) to know that a CPU exists
        check_choice("dtype", opts["dtype"], DTYPE_CHOICES)
    else:
        resolve_dtype(opts["dtype"], resolve_device(opts["device"]))
    check_choice("position_mode", opts["position_mode"], ("auto", "original", "compact"))
    check_choice("probe_dtype", opts["probe_dtype"], PROBE_DTYPE_CHOICES)
    if opts.get("cache_dtype") is not None:
        check_choice("cache_dtype", opts["cache_dtype"], CACHE_DTYPES)
    check_choice("method", opts["method"], METHOD_NAMES)
    if opts.get("max_kl") is not None:
        check_real("max_kl", float(opts["max_kl"]), float(opts["max_kl"]) > 0, "a positive number of nats per token")
    if opts.get("max_kl") is not None and opts["method"] == "none":
        raise UsageError("--max-kl needs an eviction method; --method none keeps every entry")
    if opts.get("max_bytes") is not None:
        parse_byte_limit(str(opts["max_bytes"]))
        if opts.get("max_kl") is not None:
            raise UsageError("--max-bytes and --max-kl each choose the cache's size: give one of them")
        if opts["method"] == "none":
            raise UsageError("--max-bytes needs an eviction method; --method none keeps every entry")
    top_p, penalty, temperature = opts["top_p"], opts["repetition_penalty"], opts["temperature"]
    check_real("top_p", top_p, 0 < top_p <= 1, "in (0, 1]")
    check_real("repetition_penalty", penalty, 1 <= penalty <= 100, "from 1 (off) to 100")
    check_int_range("no_repeat", opts["no_repeat"], 0, MAX_COUNT)
    if opts["no_repeat"] == 1:  # a run of one token is a token: the answer could use each once only
        raise UsageError("invalid --no-repeat '1'; must be 0 (off) or a run of 2 tokens or more")
    # Below 0.01 sampling is all but greedy, and near 0 logits / temperature overflows to NaN probabilities.
    check_real("temperature", temperature, temperature == 0 or 0.01 <= temperature <= 100,
               "0 (greedy) or from 0.01 to 100")
    return opts


def progress_bar(quiet: bool, unit: str = "tokens") -> Progress:
    """A transient bar on stderr, only on a terminal; descriptions are markup, so names in them must be `shown`."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), Count(unit), TimeRemainingColumn(), console=err,
        transient=True, disable=quiet or not err.is_terminal,
        redirect_stdout=False, redirect_stderr=False,  # results stream to stdout while the bar runs on stderr
    )


def note(opts: dict, message: str) -> None:
    if not opts["quiet"]:
        say(message)


def read_document(opts: dict, source: str, prompt: str | None = None, reconstruct_default: bool = False):
    """Read `source` as the options say. `prompt`: the instruction that will follow the document (summarize), for
    which the read leaves room."""
    from klevict_cli.documents import load_document

    read_options(opts, reconstruct_default)  # a bad option is exit 2 before the document is read
    document = load_document(source)  # and a bad document exit 3 before the model or torch loads
    settings = read_settings(opts, reconstruct_default)
    for line in document.notes:
        note(opts, f"note: {line}")
    session = session_for(opts)
    reserve = None if prompt is None else prompt_room(session, prompt, opts["max_new_tokens"])
    prepare_session(session, settings)
    # Counted in document tokens, as every report of the read is, not with the chat frame's prefix.
    prefix = len(session.frame.prefix_ids(session.lm.tokenizer))
    with progress_bar(opts["quiet"]) as bar:
        task = bar.add_task(f"tokenising {shown(document.name)}", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=max(done - prefix, 0), total=total - prefix,
                       description=f"reading {shown(document.name)}")

        result = session.read(document, settings, advance, reserve=reserve)
    for line in result.notes + below_floor(result) + beyond_tolerance(result, opts.get("max_kl")):
        note(opts, f"note: {line}")
    return session, result


def unused_by_full_cache(opts: dict) -> None:
    """--method none keeps every entry: a --budget, --working-limit or --estimate given beside it does nothing, and
    is said rather than dropped (--max-kl and --max-bytes, which choose the size, are refused)."""
    given = [f"--{name.replace('_', '-')}" for name in ("budget", "working_limit", "estimate") if opts.get(name)]
    if opts["method"] == "none" and given:
        note(opts, f"note: --method none keeps every entry: {', '.join(given)} not used")


def prompt_room(session, prompt: str, max_new_tokens: int) -> int:
    """The positions a read leaves for `prompt` and its answer: as for a question (QUESTION_ROOM) or, for a longer
    prompt, its length, so that `auto` reads in compact positions rather than fail at the answer. A prompt that can
    never fit is refused before a read that may take minutes."""
    from klevict_cli.session import QUESTION_ROOM

    length, positions = len(session.frame.suffix_ids(session.lm.tokenizer, prompt)), session.adapter.max_positions
    if length >= positions:
        raise ResourceError(f"--prompt is {length} tokens with the chat frame, more than the model's {positions}"
                            " positions on its own; shorten it")
    return max(length, QUESTION_ROOM) + max_new_tokens


def beyond_tolerance(result, max_kl: float | None) -> list[str]:
    """`--max-kl` that no cache met: the largest was kept (docs/method.md), and the user is told so."""
    drift = result.stream.drift
    if max_kl is None or drift is None or drift["kl"] <= float(max_kl):
        return []
    return [f"no cache within the budget meets --max-kl {typed('max_kl', max_kl)}: kept the largest,"
            f" {result.kept_budget} entries per KV head, estimated drift {drift['kl']:.3g}"]


def below_floor(result) -> list[str]:
    """A share asked for that keeps fewer entries than the default's floor: said, as the share is kept (a count is
    asked for as it is)."""
    from klevict_cli.reading import DEFAULT_BUDGET

    asked, kept, floor = result.settings.budget, result.plan.budget, DEFAULT_BUDGET.at_least
    if asked is None or asked.fraction is None or asked.at_least or kept is None or kept >= floor:
        return []
    return [f"--budget {asked} keeps {kept} entries per KV head; below {floor} a short document loses facts the full"
            f" cache answers (leave --budget out, or --budget {floor}, to keep at least {floor})"]


def generate(opts: dict, session, stream, question: str, mode: str, **policy) -> dict:
    """Answer `question`. Plain output is printed token by token as it is written; --json waits for the whole
    answer, and meanwhile a terminal on stderr shows a count of the tokens generated."""
    from klevict_cli.session import GenerateSettings

    gen = GenerateSettings(opts["max_new_tokens"], opts["temperature"], opts["top_p"], opts["repetition_penalty"],
                           opts["no_repeat"])
    text = None if opts["json"] else TextStream(session.lm.tokenizer)
    counting = opts["json"] or not sys.stdout.isatty()  # on a terminal the streamed text is progress enough
    with progress_bar(opts["quiet"] or not counting) as bar:
        task = bar.add_task("generating", total=None)

        def on_token(tokens: list[int]) -> None:
            bar.update(task, completed=len(tokens))
            if text is not None:
                put(text.update(tokens))

        answer = session.answer(stream, question, gen, mode, seed=opts["seed"], on_token=on_token, **policy)
    if text is not None:
        put(text.finish(answer["text"]) + "\n")
    if answer["new_tokens"] == 0 and opts["max_new_tokens"] > 0:  # an empty result should not pass for success
        note(opts, "note: the model ended its answer at once: no text")
    if answer.get("truncated_to_fit") and answer["new_tokens"] >= answer["token_room"]:
        note(opts, f"note: the answer was cut at {answer['token_room']} tokens: the model's positions hold no more"
                   " after the cache and the question")
    return answer


def parse_list(flag: str, text: str | None, parse: Callable[[str], Any], item: str) -> list:
    """A bench option's comma-separated values, each checked by `parse` (which returns it), none twice."""
    if text is None:
        return []
    values = [parse(part) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise UsageError(f"invalid {flag} '{text}': {item} is listed twice")
    return values


def parse_cache_dtypes(text: str | None) -> list[str]:
    """bench --cache-dtype: CACHE_DTYPES."""
    return parse_list("--cache-dtype", text, lambda part: check_choice("cache_dtype", part.strip(), CACHE_DTYPES),
                      "a dtype")


def parse_byte_limits(text: str | None) -> list[str]:
    """bench --max-bytes: byte limits, as given."""
    def limit(part: str) -> str:
        parse_byte_limit(part)  # refuses what is not a size or a share
        return part.strip()

    return parse_list("--max-bytes", text, limit, "a limit")


def put(piece: str) -> None:
    """Part of a result on stdout, shown at once; like `echo`, control characters are shown, not obeyed."""
    sys.stdout.write(visible(piece, keep="\n\t"))
    sys.stdout.flush()


def emit_json(payload: dict) -> None:
    sys.stdout.write(json_text(payload) + "\n")
    sys.stdout.flush()


# ---- commands ------------------------------------------------------------------------------------------------
@app.command()
@handle_errors
def summarize(
    file: Annotated[str, typer.Argument(help="Document (.txt, .md, .pdf) or - for stdin.", metavar="FILE")],
    prompt: Annotated[str | None, typer.Option("--prompt", help="Instruction after the document.")] = None,
    model: ModelOpt = None, budget: BudgetOpt = None, method: MethodOpt = None, chunk_size: ChunkOpt = None,
    device: DeviceOpt = None, dtype: DtypeOpt = None, seed: SeedOpt = None, threads: ThreadsOpt = None,
    max_new_tokens: MaxNewOpt = None, temperature: TempOpt = None, top_p: TopPOpt = None,
    repetition_penalty: RepeatOpt = None, no_repeat: NoRepeatOpt = None, position_mode: ModeOpt = None,
    probe_window: ProbeOpt = None, working_limit: WorkingOpt = None, reconstruct: ReconstructOpt = None,
    max_kl: MaxKlOpt = None, estimate: EstimateOpt = None, probe_dtype: ProbeDtypeOpt = None,
    max_memory: MemoryOpt = None, json_out: JsonOpt = None, quiet: QuietOpt = None, config: ConfigOpt = None,
):
    """Read a document with eviction between chunks, then summarise it."""
    from klevict_cli.prompts import DEFAULT_SUMMARY_PROMPT

    opts = resolve_options(config, model=model, budget=budget, method=method, chunk_size=chunk_size, device=device,
                           dtype=dtype, seed=seed, threads=threads, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty,
                           no_repeat=no_repeat, position_mode=position_mode, probe_window=probe_window, json=json_out,
                           working_limit=working_limit, reconstruct=reconstruct, quiet=quiet, prompt=prompt,
                           max_memory=max_memory, max_kl=max_kl, estimate=estimate, probe_dtype=probe_dtype,
                           answers=True)
    unused_by_full_cache(opts)
    prompt_text = typed_text(opts, "the prompt", opts["prompt"]) if opts["prompt"] is not None \
        else DEFAULT_SUMMARY_PROMPT
    session, result = read_document(opts, file, prompt=prompt_text, reconstruct_default=False)
    if not opts["json"] and (result.stream.drift is not None or opts.get("max_kl") is not None):
        # asked for (--estimate, --max-kl) and paid for: said, as compress's line says it (--json carries it)
        note(opts, f"note: kept {counted(result.kept_budget, 'entry', 'entries')} per KV head"
                   f"{drift_text(result.stream.drift)}")
    answer = generate(opts, session, result.stream, prompt_text, result.plan.mode,
                      method=result.settings.method, budget=result.plan.budget)
    if opts["json"]:
        emit_json({"summary": answer["text"], "model": session.lm.model_id, **result.summary(),
                   "new_tokens": answer["new_tokens"], "generate_seconds": round(answer["seconds"], 3)})


@app.command()
@handle_errors
def compress(
    files: Annotated[list[str], typer.Argument(help="Document (.txt, .md, .pdf) or - for stdin; or several "
                                               "documents, folders and globs ('docs/*.md') for a batch into -o "
                                               "OUTDIR/.", show_default=False, metavar="FILE")],
    output: Annotated[str | None, typer.Option("--output", "-o", help="Where to write the .kvc file; - (or "
                                               "/dev/stdout) writes it to standard output. For a batch, a folder "
                                               "(OUTDIR/): one .kvc per document plus manifest.jsonl.")] = None,
    shard: Annotated[str | None, typer.Option("--shard", help="Batch: take only shard i of n (i/n, i from 0), "
                                              "chosen by each document's sha256.")] = None,
    engine: Annotated[str, typer.Option("--engine", help="Batch: local (this process) or ray (a Ray cluster; "
                                        "pip install 'klevict[ray]').")] = "local",
    ray_address: Annotated[str | None, typer.Option("--ray-address", envvar="RAY_ADDRESS", help="Ray cluster to "
                                                    "join (default: $RAY_ADDRESS, else a local one starts).")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Ray: model-holding actors (default: one per "
                                                "CPU of the cluster, at most one per document).")] = None,
    model: ModelOpt = None, budget: BudgetOpt = None, method: MethodOpt = None, chunk_size: ChunkOpt = None,
    device: DeviceOpt = None, dtype: DtypeOpt = None, seed: SeedOpt = None, threads: ThreadsOpt = None,
    position_mode: ModeOpt = None, probe_window: ProbeOpt = None, working_limit: WorkingOpt = None,
    reconstruct: ReconstructOpt = None,
    cache_dtype: Annotated[str | None, typer.Option("--cache-dtype", help="Store keys/values as float32, float16, "
                                                    "bfloat16, int8 or int4 (per-group codes; default: the model's "
                                                    "dtype).")] = None,
    max_bytes: Annotated[str | None, typer.Option("--max-bytes", help="Keep keys and values within this size (40M"
                                                  " = 40 MiB, or 5% of the full cache's), choosing float16, int8 or "
                                                  "int4 and the entries each fits by the drift their cache gives; "
                                                  "with --cache-dtype, that dtype.")] = None,
    max_kl: MaxKlOpt = None, estimate: EstimateOpt = None, probe_dtype: ProbeDtypeOpt = None,
    max_memory: MemoryOpt = None, json_out: JsonOpt = None, quiet: QuietOpt = None, config: ConfigOpt = None,
):
    """Read and compress a document; write the cache to a .kvc file (atomically) or, with -o -, to stdout. Many
    documents: one .kvc each in OUTDIR/ and a line each in OUTDIR/manifest.jsonl, one model load, resumable."""
    from klevict_cli.batch import is_batch

    opts = resolve_options(config, model=model, budget=budget, method=method, chunk_size=chunk_size, device=device,
                           dtype=dtype, seed=seed, threads=threads, position_mode=position_mode,
                           probe_window=probe_window, cache_dtype=cache_dtype, max_bytes=max_bytes, json=json_out,
                           quiet=quiet, output=output, max_memory=max_memory, working_limit=working_limit,
                           reconstruct=reconstruct, max_kl=max_kl, estimate=estimate, probe_dtype=probe_dtype)
    check_choice("engine", engine, ("local", "ray"))
    unused_by_full_cache(opts)
    if workers is not None:
        check_positive_int("workers", workers)
        if engine != "ray":  # the local engine reads one document at a time: a count it would ignore is refused
            raise UsageError("--workers counts Ray actors: add --engine ray (the local engine reads one document"
                             " at a time)")
    if is_batch(files, opts.get("output")) or shard is not None or engine != "local":
        compress_batch(opts, files, shard, engine, ray_address, workers)
        return
    file = files[0]
    if not opts.get("output"):
        raise UsageError("missing --output/-o: where to write the .kvc file (- for standard output)")
    output = Path(opts["output"])
    to_stdout = is_stdout(opts["output"])
    if to_stdout:
        check_stdout_for_binary(opts)
    else:
        from klevict_cli.kvc import is_kvc_file

        check_destination(output, "-o", inputs=[file], folder_hint=f": give a .kvc file name, or {output}/ to write"
                          " one .kvc per document in it", replaces=("a .kvc cache", is_kvc_file), takes_stdout=True)
    session, result = read_document(opts, file, reconstruct_default=True)
    from klevict_cli.kvc import encode_kvc, save_kvc

    cache = session.cache_file(result, cache_dtype=opts["cache_dtype"])
    size = write_stdout(encode_kvc(cache, STDOUT_NAME)) if to_stdout else save_kvc(output, cache)
    where = STDOUT_NAME if to_stdout else str(output)
    # `source` and `status` as a batch's lines carry them, so that a script need not know which it got
    summary = {"source": result.document.name, "status": "ok", "output": where, "file_bytes": size,
               **session.stored_summary(result, cache)}
    stored = f" as {cache.metadata['cache_dtype']}" if opts["max_bytes"] is not None else ""
    line = (f"wrote {where}: {counted(summary['document']['tokens'], 'document token', 'document tokens')} +"
            f" {result.prefix_tokens} of the chat frame -> {counted(result.kept_budget, 'entry', 'entries')} per"
            f" head{stored}{sliding_words(session, result)} ({result.settings.method},"
            f" {result.plan.mode} positions), {size / 1e6:.2f} MB, read in {result.seconds:.1f} s")
    line += drift_text(result.stream.drift)
    if opts["json"]:
        emit_json(summary)
    elif to_stdout:
        note(opts, line)
    else:
        echo(line)


def compress_batch(opts: dict, inputs: list[str], shard: str | None, engine: str, ray_address: str | None,
                   workers: int | None) -> None:
    """Wire `compress`'s options to klevict_cli.batch: one result line per document on stdout (--json: one JSON
    line each), a summary, and exit 8 if any document failed."""
    from klevict_cli import batch

    shard_ = batch.parse_shard(shard)
    folder = batch.output_folder(inputs, opts.get("output"))
    paths = batch.expand_inputs(inputs)
    sources = batch.plan_sources(paths, shard_, folder)
    if shard_ is not None and not sources:  # "0 compressed, 0 already done, 0 failed" alone reads like a fault
        taken = counted(len(paths), "document", "documents")
        note(opts, f"note: shard {shard_[0]}/{shard_[1]} takes none of the {taken} given (each goes to the shard its"
                   " sha256 chooses)")
    batch.prepare_folder(folder)
    with progress_bar(opts["quiet"], unit="documents") as bar:
        docs = bar.add_task("documents", total=len(sources))
        reading = bar.add_task("", total=None, visible=False)

        def on_tokens(path: str, done: int, total: int) -> None:
            bar.update(reading, completed=done, total=total, visible=True, description=f"reading {shown(path)}")

        kept: list[dict] = []  # the caches in OUTDIR, for what an interrupt says

        def on_record(record: dict) -> None:
            bar.advance(docs)
            bar.update(reading, visible=False)
            report_record(opts, record, folder)
            if record["status"] != "failed":
                kept.append(record)

        if engine == "ray":
            from klevict_cli.batch_ray import RayEngine

            runner = RayEngine(opts, address=ray_address, workers=workers, documents=len(sources),
                               note=lambda line: note(opts, line))
        else:
            runner = batch.LocalEngine(opts, on_tokens)
        try:
            counts = batch.run_batch(sources, folder, runner, on_record)
        except (KeyboardInterrupt, Terminated):
            if kept:  # the caches written are not lost: said, with how to go on
                note(opts, f"note: {folder} keeps the {counted(len(kept), 'cache', 'caches')} done of"
                           f" {len(sources)}; the same command goes on from there")
            raise
        finally:
            runner.close()
    summary = (f"{counts['ok']} compressed, {counts['skipped']} already done, {counts['failed']} failed;"
               f" manifest {folder / batch.MANIFEST}")
    (note(opts, summary) if opts["json"] else echo(summary))
    if counts["failed"]:
        raise typer.Exit(batch.EXIT_SOME_FAILED)


def sliding_words(session, result) -> str:
    """Where a model's sliding-window layers keep their window whatever the budget (Gemma 3: 15 of 18 layers), the
    budget is not what the cache holds: '96 entries per head' beside a cache of 87 % of the full one, said so."""
    windows = [shape.window for shape in session.adapter.layer_shapes() if shape.window is not None]
    if not windows or result.kept_budget is None:
        return ""
    return f", the {len(windows)} sliding-window layers their last {min(windows):,} tokens"


def drift_text(drift: dict | None) -> str:
    """A compress line's end: the cache's estimated drift, where it was measured, and against what where that was
    not the whole read (a compact read's estimate leaves out its earlier evictions: it reads low)."""
    if drift is None:
        return ""
    partial = "" if drift.get("covers") == "read" else f", against {drift_against(drift)} alone"
    return f"; estimated drift {drift_words(drift)}{partial}"


def report_record(opts: dict, record: dict, folder: Path) -> None:
    """A batch document's line: --json, its manifest record with `output` and `file_bytes` as one document's
    `compress --json` names them (a document read now carries that summary's every field)."""
    for line in record.get("notes", ()):
        note(opts, f"note: {line}")
    if opts["json"]:
        written = {"output": str(folder / record["kvc"]), "file_bytes": record["bytes"]} \
            if record["status"] != "failed" else {}
        emit_json({**record, **written})
    elif record["status"] == "failed":
        echo(f"failed {record['source']}: {(record['message'].splitlines() or [record['error']])[0]}")
    elif record["status"] == "skipped":
        echo(f"skipped {record['source']}: {record['kvc']} is up to date")
    else:
        echo(f"wrote {record['kvc']} from {record['source']}: {record['document_tokens']} tokens, "
             f"{record['kept_entries']} entries kept, {record['bytes'] / 1e6:.2f} MB in {record['seconds']:.1f} s"
             + drift_text(record.get("estimated_kl")))


def check_stdout_for_binary(opts: dict) -> None:
    """`-o -` puts the .kvc bytes on stdout: nothing else may go there, and a terminal is no place for them."""
    if opts["json"]:
        raise UsageError("-o - writes the cache to standard output, where --json would go too; drop one of them")
    if sys.stdout.isatty():
        raise UsageError("-o - would write binary .kvc data to the terminal; redirect it (> doc.kvc) or give a"
                         " file name")


@app.command()
@handle_errors
def ask(
    cache_files: Annotated[list[Path], typer.Argument(help="A .kvc file made by `klevict compress`; or several, or "
                                                      "a folder of them (a batch's OUTDIR/): one result per cache, "
                                                      "model by model where several models made them.",
                                                      show_default=False, metavar="CACHE")],
    question: Annotated[str, typer.Argument(help="The question, or - to read one question per line from stdin "
                                            "(several: each answer under a 'Q: question' line).",
                                            metavar="QUESTION")],
    model: ModelOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None, seed: SeedOpt = None,
    threads: ThreadsOpt = None, max_new_tokens: MaxNewOpt = None, temperature: TempOpt = None, top_p: TopPOpt = None,
    repetition_penalty: RepeatOpt = None, no_repeat: NoRepeatOpt = None, json_out: JsonOpt = None,
    quiet: QuietOpt = None, config: ConfigOpt = None,
):
    """Answer questions from a compressed cache, without re-reading the document."""
    opts = resolve_options(config, model=model, device=device, dtype=dtype, seed=seed, threads=threads,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           repetition_penalty=repetition_penalty, no_repeat=no_repeat, json=json_out, quiet=quiet,
                           answers=True)
    if any(str(path) == "-" for path in cache_files):  # a cache is checked whole before use: it must be a file
        raise UsageError("ask reads a cache from a file, not standard input (- is for the questions); save it with"
                         " compress -o FILE.kvc")
    check_unquoted(cache_files, question)
    questions = _questions(opts, question)
    if len(cache_files) > 1 or cache_files[0].is_dir():
        ask_many(opts, cache_files, questions)
        return
    cache_file = cache_files[0]
    if opts["model"] is None:
        opts["model"] = model_of(cache_file)
    else:  # a missing or broken cache is said before a model load that may take minutes
        from klevict_cli.kvc import read_metadata

        read_metadata(cache_file)
    session = session_for(opts)
    stream, meta = session.load(cache_file)
    # --json lines carry the same fields whether one cache or many is asked (a script need not know which)
    answer_all(opts, session, stream, meta, questions, cache=str(cache_file), source=meta.get("source_name"),
               status="ok")


def check_unquoted(caches: list[Path], question: str) -> None:
    """`klevict ask doc.kvc What is it?`: the words of a question left unquoted are taken for caches, and all but the
    last failed as missing files after the model had answered 'it?'. A missing argument not named .kvc is refused
    first, with the quoted form."""
    words = [path for path in caches[1:] if path.suffix.lower() != ".kvc" and not path.exists()]
    if words and caches[0].exists():
        asked = " ".join([*map(str, caches[caches.index(words[0]):]), question])
        raise UsageError(f"{words[0]}: no such cache; a question of several words is one argument: klevict ask"
                         f" {caches[0]} \"{asked}\"")


def answer_all(opts: dict, session, stream, meta: dict, questions: list[str], **tag) -> None:
    """Answer each question from one loaded cache; --json lines carry `tag` (which cache) first."""
    budget = None if meta.get("budget_tokens", "all") == "all" else int(meta["budget_tokens"])
    for i, q in enumerate(questions):  # one too long is said before any is answered (not after half of them)
        try:
            session.fitting_question(stream, q, meta["position_mode"])
        except ResourceError as exc:
            which = f"question {i + 1} of {len(questions)} on standard input: " if len(questions) > 1 else ""
            raise ResourceError(f"{which}{exc}") from None
    for i, q in enumerate(questions):
        if len(questions) > 1 and not opts["json"]:  # answers hold blank lines: say where each one begins
            echo(("\n" if i else "") + f"Q: {' '.join(q.split())}")
        answer = generate(opts, session, stream, q, meta["position_mode"],
                          method=meta.get("method", "none") if budget else "none", budget=budget)
        if opts["json"]:
            emit_json({**tag, "question": q, "answer": answer["text"], "new_tokens": answer["new_tokens"],
                       "first_token_seconds": round(answer["first_token_seconds"], 4),
                       "seconds": round(answer["seconds"], 3)})


def ask_many(opts: dict, paths: list[Path], questions: list[str]) -> None:
    """The same questions to every cache, each answered by the model that made it, or all by --model. A folder may
    hold caches of several models: they are answered model by model (in the order each model first appears), each
    model loaded once and let go before the next, so that two large models are never held at once. A cache that
    cannot be used is reported (an error line, or a JSON line with status failed) and the others are still
    answered; then the exit code is 8."""
    from klevict_cli.batch import EXIT_SOME_FAILED, cache_paths

    caches = by_model(cache_paths(paths), opts["model"])
    sessions = {} if opts["model"] is None else {opts["model"]: session_for(opts)}  # --model: loaded up front
    failures = answered = 0
    for path, model in caches:
        source = None
        try:
            if isinstance(model, KlevictError):
                raise model
            done = [m for m, s in sessions.items() if m != model and not isinstance(s, KlevictError)]
            if done:  # their caches are answered: their memory goes before the next model loads
                for m in done:
                    del sessions[m]
                release_sessions()
            session = model_session(sessions, opts, model)
            stream, meta = session.load(path)
            source = meta.get("source_name")
            if not opts["json"]:  # a blank line between caches' answers, none before the first printed
                echo(("\n" if answered else "") + f"==> {path} ({source}) <==")
            answered += 1
            answer_all(opts, session, stream, meta, questions, cache=str(path), source=source, status="ok")
        except KlevictError as exc:  # a bad cache, or a question that does not fit after this one
            failures += 1
            if opts["json"]:
                emit_json({"cache": str(path), "source": source, "status": "failed", "error": type(exc).__name__,
                           "message": str(exc)})
            else:
                say(f"error: {exc}")
    if failures:
        raise typer.Exit(EXIT_SOME_FAILED)


def by_model(caches: list[Path], forced: str | None) -> list[tuple[Path, str | KlevictError]]:
    """Each cache with the model to answer it (`forced`, or the one that made it; the error saying why there is
    none), grouped by model in the order each first appears, the caches of one model in their own order."""
    made = []
    for path in caches:
        try:
            made.append((path, forced or model_of(path)))
        except KlevictError as exc:
            made.append((path, exc))
    groups: dict[object, list] = {}  # in order of first appearance; a cache without a model is a group of its own
    for n, (path, model) in enumerate(made):
        groups.setdefault(model if isinstance(model, str) else n, []).append((path, model))
    return [item for group in groups.values() for item in group]


def model_session(sessions: dict, opts: dict, model: str):
    """`model`'s session from `sessions`, loaded on first use; a model that failed to load fails again at once."""
    if model not in sessions:
        try:
            sessions[model] = session_for({**opts, "model": model})
        except KlevictError as exc:
            sessions[model] = exc
    if isinstance(sessions[model], KlevictError):
        raise sessions[model]
    return sessions[model]


def model_of(cache_file: Path) -> str:
    """The model that made a cache, for when --model is not given: a packaged alias, or a folder or file that exists
    here. A hub id is never downloaded because a file named it."""
    from klevict_cli.kvc import read_metadata
    from klevict_cli.models import PACKAGED_MODELS

    made = read_metadata(cache_file).get("model_id", "")
    if made in PACKAGED_MODELS or (made and Path(made).expanduser().exists()):
        return made
    raise ModelError(f"{cache_file}: made by model '{made}', which is neither a packaged model nor a folder or file"
                     " here; pass --model to say which model to use")


def typed_text(opts: dict, name: str, typed: str | bytes) -> str:
    """A question or prompt as text the tokenizer takes (documents.decode_typed), with a note on how it was read;
    text that cannot be read is a bad argument (exit 2)."""
    from klevict_cli.documents import decode_typed

    try:
        text, notes = decode_typed(name, typed)
    except DocumentError as exc:
        raise UsageError(str(exc)) from None
    for line in notes:
        note(opts, f"note: {line}")
    return text


def _questions(opts: dict, question: str) -> list[str]:
    if question != "-":
        if not question.strip():
            raise UsageError("the question is empty")
        return [typed_text(opts, "the question", question)]
    if sys.stdin is None or sys.stdin.closed:
        raise UsageError("standard input is closed; pass the question as an argument")
    typed = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    # one question a line: split at line ends only (str.splitlines also splits at U+2028, form feeds and other
    # separators a pasted question may hold)
    lines = [line.strip() for line in re.split(r"\r\n|\r|\n", typed_text(opts, "standard input", typed))]
    lines = [line for line in lines if line]
    if not lines:
        raise UsageError("no questions on standard input (one per line)")
    return lines


@app.command()
@handle_errors
def inspect(
    cache_file: Annotated[Path, typer.Argument(help="A .kvc file.", metavar="CACHE")],
    text: Annotated[bool, typer.Option("--text", help="Render the document with the kept spans highlighted.")] = False,
    html_path: Annotated[Path | None, typer.Option("--html", help="Also write one self-contained HTML page: the "
                                                   "document with each token shaded by the share of heads that "
                                                   "kept it, kept entries per layer, the metadata.")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Tokenizer for --text and --html (default: "
                                              "the model that made the cache).")] = None,
    json_out: JsonOpt = None, quiet: QuietOpt = None,
):
    """Show what a .kvc file kept, where, and how big it is."""
    from klevict_cli.report import inspect_file

    if text and json_out:
        raise UsageError("--text shows the document on a terminal and --json has no text view: choose one")
    if html_path is not None:
        check_destination(html_path, "--html", inputs=[cache_file], replaces=("an HTML page", is_html_file))
    decode = text or html_path is not None
    model = (model or model_of(cache_file)) if decode else None
    html_out = functools.partial(write_output, {"quiet": bool(quiet)}, "--html", html_path) if html_path else None
    inspect_file(cache_file, text=text, as_json=bool(json_out), console=out, model=model, html_out=html_out)


@app.command()
@handle_errors
def bench(
    file: Annotated[str, typer.Argument(help="Document (.txt, .md, .pdf) or - for stdin.", metavar="FILE")],
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated methods, or all (every method but "
                                         "none, which is always measured as the reference); methods: "
                                         f"{METHODS}.")] = "all",
    budgets: Annotated[str, typer.Option("--budgets", help="Comma-separated budgets, each a fraction of --context "
                                         "(20%) or a token count.")] = "20%,10%,5%,2%",
    windows: Annotated[int, typer.Option("--windows", help="Document windows (and needle haystacks) to measure."
                                         )] = 8,
    context: Annotated[int, typer.Option("--context", help="Tokens read (and compressed) per window.")] = 2048,
    continuation: Annotated[int, typer.Option("--continuation", help="Tokens teacher-forced after the context."
                                              )] = 256,
    task: Annotated[str, typer.Option("--task", help="fidelity (KL, top-1, perplexity, cost), needle (retrieval "
                                      "of planted facts), recall (details the text states once), both (fidelity "
                                      "+ needle) or all three.")] = "fidelity",
    out_path: Annotated[Path | None, typer.Option("--out", help="Write every raw per-window number and the "
                                                  "settings to this JSON file.")] = None,
    json_out: Annotated[bool | None, typer.Option("--json", help="Print those raw numbers as one JSON object on "
                                                  "stdout instead of the tables.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run saved in --out (stopped, or with fewer "
                                         "--windows): its windows are kept, the rest are measured.")] = False,
    needles: Annotated[int, typer.Option("--needles", help="Facts planted per needle haystack.")] = 4,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Tokens each needle answer may use.")] = 32,
    working: Annotated[float | None, typer.Option("--working", help="Working limit while reading, as a multiple of"
                                                  " the budget (default 4; 1 evicts after every chunk).")] = None,
    reconstruct: Annotated[bool, typer.Option("--reconstruct/--no-reconstruct", help="kl: judge entries by "
                                              "reconstruction probes too, as compress does.")] = False,
    max_kl: Annotated[str | None, typer.Option("--max-kl", help="Comma-separated tolerances (nats per token), each "
                                               "measured beside the budgets: the cache kept and the KL measured.")
                      ] = None,
    estimate: Annotated[bool, typer.Option("--estimate", help="Every read also measures its drift (estimated_kl "
                                           "per window; its cost counts in the read time).")] = False,
    cache_dtypes: Annotated[str | None, typer.Option("--cache-dtype", help="Comma-separated dtypes (float32, "
                                                     "float16, bfloat16, int8, int4): each read's cache is measured "
                                                     "as compress --cache-dtype stores it (a row per method and "
                                                     "dtype), with its bytes.")] = None,
    max_bytes: Annotated[str | None, typer.Option("--max-bytes", help="Comma-separated byte limits (5%,40M), each "
                                                  "measured beside the budgets as compress --max-bytes stores the "
                                                  "cache: the dtype chosen, its bytes and KL.")] = None,
    sampled: Annotated[int, typer.Option("--sampled", help="Also measure each cache on this many continuations "
                                         "(of --continuation tokens) that the full cache's model writes itself: "
                                         "kl_sampled, the KL of what the model would write (0: not measured; at "
                                         "most 8).")] = 0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw the results into this .png/.svg/.pdf: KL "
                                              "against budget with 95% intervals, cost against KL, retrieval "
                                              "accuracy. Needs the plot extra: pip install 'klevict[plot]'.")] = None,
    model: ModelOpt = None, chunk_size: ChunkOpt = None, device: DeviceOpt = None, dtype: DtypeOpt = None,
    seed: SeedOpt = None, threads: ThreadsOpt = None, probe_window: ProbeOpt = None,
    probe_dtype: ProbeDtypeOpt = None, quiet: QuietOpt = None, config: BenchConfigOpt = None,
):
    """Measure eviction methods side by side: KL to the full cache, top-1, perplexity, cost, needle retrieval."""
    from klevict_cli.bench import TASKS, BenchSettings, parse_budgets, parse_methods, render, run_bench
    from klevict_cli.documents import load_document
    from klevict_cli.policies import POLICIES

    from_file = load_config(config)
    opts = resolve_options(config, from_file, model=model, chunk_size=chunk_size, device=device, dtype=dtype,
                           seed=seed, threads=threads, probe_window=probe_window, probe_dtype=probe_dtype,
                           quiet=quiet, json=json_out)
    ignored = sorted(set(from_file) - set(BENCH_CONFIG))  # e.g. a compress config's max_kl: not a list
    if ignored:
        note(opts, f"note: bench ignores {', '.join(ignored)} in {config}: its own options (--budgets, --max-kl,"
                   " ...) are flags; see klevict bench --help")
    for name, value in (("windows", windows), ("context", context), ("continuation", continuation),
                        ("needles", needles), ("answer_tokens", answer_tokens)):
        check_positive_int(name, value)
    # each continuation's distributions are held through a window: Gemma-3's 262,144-token vocabulary makes that
    # about 1.3 GB per continuation of 256 tokens
    check_int_range("sampled", sampled, 0, 8)
    if working is not None:
        check_real("working", working, working >= 1, "a multiple of the budget, at least 1")
    check_choice("task", task, TASKS)
    settings = BenchSettings(
        methods=parse_methods(methods, POLICIES), budgets=[str(b) for b in parse_budgets(budgets)], windows=windows,
        context=context, continuation=continuation, seed=opts["seed"], chunk_size=opts["chunk_size"],
        probe_window=opts["probe_window"], probe_dtype=opts["probe_dtype"], task=task, needles=needles,
        answer_tokens=answer_tokens, working=working,
        reconstruct=reconstruct, max_kl=parse_tolerances(max_kl), estimate=estimate,
        cache_dtypes=parse_cache_dtypes(cache_dtypes), max_bytes=parse_byte_limits(max_bytes), sampled=sampled,
    )
    if settings.cache_dtypes and settings.max_bytes:
        raise UsageError("--max-bytes chooses the dtype: measure it in a run without --cache-dtype")
    if out_path is not None:
        check_destination(out_path, "--out", inputs=[file], replaces=("a bench result", is_json_file))
    saved = load_saved_bench(out_path) if resume else None
    if out_path is not None and not resume:
        refuse_stopped_run(out_path)
    if plot is not None:
        from klevict_cli.plots import check_plot_target

        check_plot_target(plot)
        check_destination(plot, "--plot", inputs=[file] + ([out_path] if out_path else []))
        if out_path is not None and same_file(plot, out_path):  # neither written yet: the plot replaced the result
            raise UsageError(f"--plot {plot} and --out {out_path} name one file; give each its own")
    document = load_document(file)
    session = session_for(opts)
    kept: list[dict] = []  # the windows this run saved in --out, for what an interrupt says

    def checkpoint(partial: dict) -> None:
        if save_bench(partial, out_path):
            kept[:] = [partial]

    with progress_bar(opts["quiet"], unit="steps") as bar:
        job = bar.add_task("bench", total=None)
        try:
            result = run_bench(session, document, settings,
                               lambda done, total, label: bar.update(job, completed=done, total=total,
                                                                     description=shown(label)),
                               checkpoint=checkpoint if out_path else None, resume=saved,
                               note=lambda line: note(opts, f"note: {line}"))
        except (KeyboardInterrupt, Terminated):
            if kept:  # the windows are not lost: said, with how to go on
                note(opts, f"note: {out_path} keeps the windows measured so far ({windows_done(kept[0])} of"
                           f" {settings.windows}); the same command with --resume continues")
            raise
    if opts["json"]:
        emit_json(result)
    else:
        render(result, out)
    if out_path is not None:
        write_output(opts, "--out", out_path, bench_json(result))
    if plot is not None:
        from klevict_cli.plots import plot_bytes

        write_output(opts, "--plot", plot, plot_bytes(result, plot))


def parse_tolerances(text: str | None) -> list[float]:
    """`bench --max-kl 0.01,0.03`: positive finite numbers."""
    def tolerance(part: str) -> float:
        try:
            value = float(part)
        except ValueError:
            raise UsageError(f"invalid --max-kl '{text}'; give tolerances in nats per token such as 0.01,0.03")
        return check_real("max_kl", value, value > 0, "a positive number of nats per token", text=part.strip())

    return parse_list("--max-kl", text, tolerance, "a tolerance")


def bench_json(result: dict) -> bytes:
    return (json.dumps(result, ensure_ascii=False, indent=1) + "\n").encode()


def load_saved_bench(path: Path | None) -> dict | None:
    """The run `--resume` continues: the JSON in --out, or None when there is none yet (a fresh start)."""
    if path is None:
        raise UsageError("--resume continues the run saved in --out: give --out")
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--resume: cannot read {path}: {exc.__class__.__name__}") from None


def refuse_stopped_run(path: Path) -> None:
    """A run without --resume replaces --out at its first window: where --out holds a stopped run (hours of windows,
    perhaps), that is refused. A finished result, or a file that is no bench result, is replaced as asked."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if not isinstance(saved, dict) or saved.get("complete") is not False or not isinstance(saved.get("settings"), dict):
        return
    raise UsageError(f"--out {path} holds a stopped bench run (windows measured: {windows_done(saved)} of"
                     f" {saved['settings'].get('windows', '?')}), which this run would replace: add --resume to"
                     " continue it, or remove the file or choose another --out to start afresh")


def windows_done(result: dict) -> str:
    """How far a saved bench run got, per task: "fidelity 3" ("fidelity 8, needle 2")."""
    return ", ".join(f"{task} {block['windows_done']}" for task, block in result.items()
                     if isinstance(block, dict) and isinstance(block.get("windows_done"), int)) or "none"


def save_bench(partial: dict, path: Path) -> bool:
    """After each bench window: the results so far, quietly (a failure here surfaces at the final write); whether
    they were saved."""
    from klevict_cli.files import write_atomically

    try:
        write_atomically(path, bench_json(partial))
    except OSError:
        return False
    return True


def write_output(opts: dict, flag: str, path: Path, blob: bytes) -> None:
    """Write one output file of a command atomically; a failure is exit 7, naming the option."""
    from klevict_cli.files import write_atomically

    try:
        write_atomically(path, blob)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
    note(opts, f"wrote {path}")


def version_callback(value: bool):
    if value:
        out.print(f"klevict {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
):
    """klevict: stream long documents through an LLM with KL-guided KV-cache eviction."""


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.stdout = GuardedStdout(sys.stdout)
    try:
        app()
    except OutputError as exc:  # --help or --version to an output that takes no more (commands say it themselves)
        say(f"error: {exc}")
        sys.exit(exc.exit_code)
