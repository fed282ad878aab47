"""The embedded default model: a 4-layer Llama built from a config with a fixed seed.

Built once and saved with ``save_pretrained`` (weights, config and a byte-level tokenizer made
offline with the ``tokenizers`` library) under a cache folder, so local runs and vLLM workers load
the very same checkpoint. Head size 64 and float32 weights keep it usable by vLLM on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 259,  # 256 byte tokens + <pad>, <s>, </s>
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "pad_token_id": 256,
    "bos_token_id": 257,
    "eos_token_id": 258,
}
SEED = 0
_SPECIALS = ["<pad>", "<s>", "</s>"]
_lock = threading.Lock()


def _cache_root() -> Path:
    root = os.environ.get("ASYNCPP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "asyncpp"


def tiny_model_dir(config: dict[str, Any] | None = None, seed: int = SEED) -> Path:
    """The folder of the tiny model (built there on first use)."""
    cfg = dict(TINY_CONFIG, **(config or {}))
    return cached_folder("tiny-llama", [cfg, seed, 1], lambda path: _build(path, cfg, seed))


def cached_folder(prefix: str, key: Any, build: Callable[[Path], None]) -> Path:
    """``<cache>/<prefix>-<hash of key>``, made by ``build(folder)`` on first use: built in a
    folder of its own and renamed, so that concurrent builders (vLLM's workers, parallel tests)
    never see half a checkpoint."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = _cache_root() / f"{prefix}-{digest}"
    with _lock:
        if not (path / "config.json").exists():
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            build(tmp)
            try:
                tmp.rename(path)
            except OSError:  # another process built it first
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    return path


def _build(path: Path, cfg: dict[str, Any], seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32"))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i, tok in enumerate(_SPECIALS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def load_tiny(dtype: Any = None) -> tuple[Any, Any]:
    """The tiny model (eval mode, float32 by default) and its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = tiny_model_dir()
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
