"""Load the language model: the packaged default, a ``.gguf`` file, a local Hugging Face folder, or a hub id.

A GGUF file is dequantised once into a plain safetensors folder in the cache: dequantising costs about 30 s a
load, reading the converted folder about 1 s. The fingerprints let a saved KV cache be matched to the model that
made it, whichever way (alias, GGUF or folder; any device or dtype) that model was loaded.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from klevict_cli.errors import ModelError
from klevict_cli.options import resolve_device, resolve_dtype
from klevict_cli.files import write_atomically
from klevict_cli.packaged import DEFAULT_MODEL, PACKAGED_MODELS, _packaged_gguf, _packaged_parts



# Config keys that say how the model runs or was stored, not what it computes; leaving them out lets the same
# model hash the same whether it came from GGUF or a folder, in any dtype. Keys starting with "_" are dropped too.
_RUNTIME_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "quantization_config",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "architectures",  # a class-name label, absent from GGUF configs; model_type names the architecture
    }
)

# The files whose bytes are a model folder's weights, and where their digests are kept (inside the folder).
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_WEIGHT_DIGESTS = ".klevict-weights.json"

# "org/name" or "name": on POSIX a hub id contains os.sep, so the separator alone cannot mean "this is a path".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

_NETWORK_HINT = "no network? pass a local folder or .gguf file"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    source: str
    config_sha256: str
    tokenizer_sha256: str
    weights_sha256: str


def load_model(
    spec: str | None,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str | None = None,
    quiet: bool = False,
) -> LoadedModel:
    """Load ``spec`` (None means the packaged default) ready for inference: eval mode, no gradients.

    Device and dtype are checked first so a typo fails before a 30 s conversion.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    _silence_transformers()
    model_id = spec or DEFAULT_MODEL
    source, local = _weights_source(model_id, quiet)
    model, tokenizer = _load_pretrained(model_id, source, local, torch_dtype, attn_implementation)
    model.to(torch_device)
    model.eval()
    model.requires_grad_(False)
    folder = source if local else _hub_snapshot(source)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        source=folder,
        config_sha256=fingerprint_config(model.config),
        tokenizer_sha256=fingerprint_tokenizer(tokenizer),
        weights_sha256=fingerprint_files(Path(folder)) if Path(folder).is_dir() else fingerprint_weights(model),
    )


def cache_dir() -> Path:
    """Where converted models live: $KLEVICT_CACHE_DIR, else $XDG_CACHE_HOME/klevict, else ~/.cache/klevict."""
    if explicit := os.environ.get("KLEVICT_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "klevict"
    return Path.home() / ".cache" / "klevict"


# --- finding the weights ----------------------------------------------------------------------------------------


def _weights_source(spec: str, quiet: bool) -> tuple[str, bool]:
    """Return (folder or hub id, whether it is a local folder) for ``spec``; GGUF files are converted first."""
    if spec in PACKAGED_MODELS:
        if PACKAGED_MODELS[spec].parts:
            return str(_converted_parts(spec, quiet)), True
        return str(converted_folder(_packaged_gguf(spec), quiet)), True
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{spec}: folder has no config.json (not a Hugging Face model folder)")
        return str(path.resolve()), True
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"{spec}: not a model (pass a .gguf file, a model folder or a hub id)")
        return str(converted_folder(path.resolve(), quiet)), True
    if _looks_like_path(spec):
        raise ModelError(f"no such model file or folder: {spec}")
    return spec, False


def _looks_like_path(spec: str) -> bool:
    """True for strings that can only mean a file, so a typo is reported as missing rather than as a hub failure."""
    if spec.startswith((".", "~", os.sep)) or spec.lower().endswith(".gguf"):
        return True
    has_separator = os.sep in spec or (os.altsep is not None and os.altsep in spec)
    return has_separator and not _HUB_ID.fullmatch(spec)


def _converted_parts(alias: str, quiet: bool) -> Path:
    """The converted folder of a split GGUF. The first time, the parts are concatenated into a temporary GGUF in the
    cache, checked against the pinned sha256, converted exactly as a single-file GGUF would be (same folder name),
    and the temporary GGUF is deleted; afterwards the parts are not even read."""
    entry = PACKAGED_MODELS[alias]
    target = _converted_target(Path(entry.file), entry.sha256)
    if (target / "config.json").is_file():
        return target
    parts = _packaged_parts(alias)
    scratch = _scratch_beside(target, f".{Path(entry.file).stem}.", ".gguf.tmp")
    try:
        gguf = scratch / entry.file
        digest = hashlib.sha256()
        try:
            with gguf.open("wb") as out:
                for part in parts:
                    with part.open("rb") as handle:
                        while block := handle.read(1 << 20):
                            digest.update(block)
                            out.write(block)
        except OSError as exc:
            raise ModelError(f"model '{alias}': cannot assemble {entry.file}: {_short_reason(exc)}") from exc
        if digest.hexdigest() != entry.sha256:
            raise ModelError(f"model '{alias}': the installed parts do not make the expected {entry.file} (sha256"
                             f" mismatch); reinstall it with: {entry.install}")
        return converted_folder(gguf, quiet, sha256=entry.sha256)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- GGUF conversion --------------------------------------------------------------------------------------------


def _converted_target(gguf: Path, sha256: str) -> Path:
    return cache_dir() / "models" / f"{gguf.stem}-{sha256[:16]}"


def converted_folder(gguf: Path, quiet: bool = False, sha256: str | None = None) -> Path:
    """Return the converted folder for ``gguf``, converting it first if this is the first time.

    The folder name carries a hash of the file bytes (``sha256`` when the caller has just checked it), so a changed
    file is converted anew. The folder is built in a temporary folder beside it and renamed into place, so a reader
    never sees half a model.
    """
    target = _converted_target(gguf, sha256 or _file_sha256(gguf))
    if (target / "config.json").is_file():
        return target
    console = Console(stderr=True, quiet=quiet)
    _say(console, f"converting {gguf.name} once (about 30 s) into {target}")
    started = time.monotonic()
    building = _scratch_beside(target, f".{target.name}.", ".tmp")
    try:
        _convert_gguf(gguf, building)
        publish_folder(building, target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    _say(console, f"converted in {time.monotonic() - started:.0f} s")
    return target


def _scratch_beside(target: Path, prefix: str, suffix: str) -> Path:
    """A new temporary folder beside `target`, creating the cache folder first. A cache folder that cannot be made
    or written (a file in its path, a read-only home) is a model that cannot be loaded, said in one line."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=target.parent))
    except OSError as exc:
        raise ModelError(f"cannot write converted model to {target.parent}: {exc.strerror or _short_reason(exc)};"
                         " set KLEVICT_CACHE_DIR to a folder you can write") from None


def _say(console: Console, text: str) -> None:
    """Print plain text: paths may contain [brackets] that rich would read as markup, and must not wrap."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def publish_folder(building: Path, target: Path) -> Path:
    """Rename ``building`` to ``target``; if another process got there first, keep theirs and drop ours."""
    try:
        os.replace(building, target)
    except OSError as exc:
        if not (target / "config.json").is_file():
            raise ModelError(f"cannot write converted model to {target}: {_short_reason(exc)}") from exc
        shutil.rmtree(building, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` and save it as a plain safetensors model folder with its tokenizer."""
    try:
        # transformers draws the dequantisation progress bar with tqdm directly, out of reach of its own switch.
        with contextlib.redirect_stderr(io.StringIO()):
            gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        plain = dequantised_copy(gguf_model)
        del gguf_model
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except Exception as exc:  # any failure here means the file is not a model transformers can read
        raise ModelError(f"cannot convert {gguf}: {_short_reason(exc)}") from exc


def dequantised_copy(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """Rebuild a GGUF-loaded model without its quantization config, which transformers refuses to save.

    Loading the state dict into a fresh model keeps tied embeddings tied: both names point at one tensor.
    """
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    return plain


def probe_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """`model` with its parameters in `dtype`, for the forwards whose tokens are only probes (`--probe-dtype`,
    Session.probe_model). Buffers (rotary frequencies) stay as they are; tied parameters stay tied."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in model.parameters()}
    copied = copy.deepcopy(model, memo)
    copied.eval()
    return copied


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- loading ----------------------------------------------------------------------------------------------------


def _load_pretrained(
    model_id: str, source: str, local: bool, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer; a hub id is tried from the local HF cache before the network."""
    kwargs: dict = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return _from_pretrained(source, local_files_only=True, **kwargs)
    except Exception as exc:
        if local:
            raise ModelError(f"cannot load model '{model_id}': {_short_reason(exc)}") from exc
    if not _hub_reachable():
        raise ModelError(f"cannot load model '{model_id}': not in the local cache and the hub is unreachable "
                         f"({_NETWORK_HINT})")
    try:
        return _from_pretrained(source, **kwargs)
    except Exception as exc:
        raise ModelError(f"cannot load model '{model_id}': {_short_reason(exc)} ({_NETWORK_HINT})") from exc


def _from_pretrained(source: str, **kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    tokenizer_kwargs = {"local_files_only": True} if kwargs.get("local_files_only") else {}
    tokenizer = AutoTokenizer.from_pretrained(source, **tokenizer_kwargs)
    return model, tokenizer


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Probe the hub host once, because an offline from_pretrained retries for about 30 s before failing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct probe says nothing about a proxy; let the real request find out
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _hub_snapshot(hub_id: str) -> str:
    """The local folder a hub model was read from, or the id itself if it cannot be found."""
    from transformers.utils import cached_file

    try:
        config_file = cached_file(hub_id, "config.json", local_files_only=True)
    except Exception:
        return hub_id
    return str(Path(config_file).parent) if config_file else hub_id


def _silence_transformers() -> None:
    """The CLI draws its own progress; library bars and advice would interleave with it."""
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hub_utils.logging.set_verbosity_error()
    hub_utils.disable_progress_bars()


def _short_reason(exc: BaseException) -> str:
    """First line of an exception, capped, so the CLI's one-line error stays one line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    return reason if len(reason) <= 200 else reason[:197] + "..."


# --- fingerprints -----------------------------------------------------------------------------------------------


def fingerprint_config(config) -> str:
    """Hash what the architecture computes, ignoring how it was stored, named or set up to run."""
    return _sha256_json(_semantic_config(config.to_dict()))


def _semantic_config(value):
    if isinstance(value, dict):
        return {
            key: _semantic_config(item)
            for key, item in value.items()
            if not str(key).startswith("_") and key not in _RUNTIME_CONFIG_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_semantic_config(item) for item in value]
    return value


def fingerprint_tokenizer(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash everything that decides which ids a text becomes: vocabulary, special tokens, chat template."""
    special_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    return _sha256_json(
        {
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special_tokens": tokenizer.special_tokens_map,
            "special_ids": special_ids,
            "chat_template": tokenizer.chat_template,
        }
    )


def fingerprint_files(folder: Path) -> str:
    """Hash every weight file of a model folder, so that a fine-tune changing any one weight is told apart.

    A file is read (streamed) once: its sha256 is kept in the folder, keyed by the file's size and mtime, so a
    later load only stats the files (a weight edited in place that keeps both would go unseen). A read-only folder
    is hashed on every load. The GGUF models' converted folders make the alias, the file and the folder agree.
    """
    known = _read_json(folder / _WEIGHT_DIGESTS)
    record = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns]
        entry = known.get(path.name)
        record[path.name] = entry if isinstance(entry, list) and entry[:2] == key and len(entry) == 3 else [
            *key, _file_sha256(path)]
    if not record:
        raise ModelError(f"{folder}: no weight files ({', '.join('*' + s for s in _WEIGHT_SUFFIXES)}) to fingerprint")
    if record != known:
        with contextlib.suppress(OSError):
            write_atomically(folder / _WEIGHT_DIGESTS, json.dumps(record).encode())
    return _sha256_json({name: entry[2] for name, entry in record.items()})


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def fingerprint_weights(model: PreTrainedModel) -> str:
    """Hash every parameter as float32 on the CPU: for a hub model whose files cannot be found after loading."""
    digest = hashlib.sha256()
    for name, tensor in model.named_parameters():
        digest.update(f"{name}:{list(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _sha256_json(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
