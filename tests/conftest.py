"""Tiny, randomly initialised models and a tiny tokenizer, built in-process: unit tests never touch real weights."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse.",
    "The quick brown fox jumps over the lazy dog. What is the answer? Summarize the text above in a few sentences.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()-",
]


def make_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    base.update(overrides)
    return LlamaConfig(**base)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**overrides)).eval()
    # Random init makes attention nearly uniform; sharper queries make eviction choices matter in tests.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def tiny_session(seed: int = 5, **overrides):
    """A `Session` over `tiny_llama(seed, **overrides)` with klevict's attention set, as the commands load a model."""
    from klevict_cli.attention import ATTENTION_NAME
    from klevict_cli.models import LoadedModel
    from klevict_cli.session import Session

    model = tiny_llama(seed, **overrides)
    model.set_attn_implementation(ATTENTION_NAME)
    return Session(LoadedModel(model, make_tokenizer(), "tiny-llama", "memory", "c", "t", "w"))


@pytest.fixture(scope="session", autouse=True)
def test_device():
    """KLEVICT_TEST_DEVICE=cuda runs the unit tests with every tensor they create (tiny models included) on that
    device, to check the engine, kernels and file format on a GPU. Unset, everything stays on the CPU."""
    name = os.environ.get("KLEVICT_TEST_DEVICE")
    if name:
        torch.set_default_device(name)
    yield
    if name:
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from threads: on a busy 2-core box OpenMP hand-offs and spin-waits make small calls
    tens of times slower. Modules of tiny-model tests opt in with `pytestmark = pytest.mark.usefixtures(...)`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama + tokenizer saved as a local HF folder, usable as `--model <dir>`."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
