"""Turning invoke inputs into one batch, and the batch's output back into per-invoke pieces.

Causal language models (Hugging Face style: a ``config`` and ``generate``) take prompts as strings
(with a tokenizer), lists of token ids, or 1-D/2-D id tensors; prompts of different lengths are
left-padded with an attention mask, so position -1 is every row's last token. Any other module
takes a tensor (or a tuple of positional tensors) per invoke, concatenated along dimension 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..kernel.errors import AsyncppError


class InputError(AsyncppError, ValueError):
    """An invoke's input cannot be batched."""


def token_rows(value: Any, tokenizer: Any, where: str) -> list[list[int]]:
    """One invoke's prompt(s) as lists of token ids."""
    if isinstance(value, str):
        if tokenizer is None:
            raise InputError(
                f"{where}: a string prompt needs a tokenizer: build the engine with "
                f"asyncpp.LocalEngine(model, tokenizer), or pass token ids"
            )
        return [list(tokenizer(value, add_special_tokens=False)["input_ids"])]
    if isinstance(value, Tensor):
        if value.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{where}: token ids must be an integer tensor, got {value.dtype}")
        if value.dim() == 1:
            return [value.tolist()]
        if value.dim() == 2:
            return value.tolist()
        raise InputError(f"{where}: token ids must be 1-D or 2-D, got shape {tuple(value.shape)}")
    if isinstance(value, (list, tuple)) and not value:
        raise InputError(
            f"{where}: the prompt is empty (an empty list of token ids); give it at least one token"
        )
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, int) for v in value):
            return [list(value)]
        if all(isinstance(v, str) for v in value):
            return [r for v in value for r in token_rows(v, tokenizer, where)]
        if all(isinstance(v, (list, tuple)) for v in value):
            return [list(v) for v in value]
    raise InputError(
        f"{where}: cannot use {type(value).__name__} as a prompt; pass a string, a list of token ids "
        f"or a tensor of token ids"
    )


def check_prompts(
    rows: list[list[int]], where: str, vocab: int | None, positions: int | None, new_tokens: int = 0
) -> None:
    """Refuse, before the model runs, prompts it cannot take: empty ones, token ids outside its
    vocabulary, and prompts (plus the tokens to generate) longer than its position range."""
    for k, r in enumerate(rows):
        label = where if len(rows) == 1 else f"{where}, prompt {k}"
        if not r:
            raise InputError(f"{label}: the prompt is empty; give it at least one token")
        if vocab is not None:
            low, high = min(r), max(r)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise InputError(
                    f"{label}: token id {bad} (at position {r.index(bad)}) is outside the model's "
                    f"vocabulary of {vocab} ids (0..{vocab - 1})"
                )
        if positions is not None and len(r) + new_tokens > positions:
            if new_tokens:
                raise InputError(
                    f"{label}: the prompt has {len(r)} tokens and {new_tokens} are to be generated, "
                    f"{len(r) + new_tokens} in all, but the model has {positions} positions "
                    f"(max_position_embeddings); shorten the prompt or lower max_new_tokens"
                )
            raise InputError(
                f"{label}: the prompt has {len(r)} tokens, but the model has {positions} positions "
                f"(max_position_embeddings); shorten the prompt"
            )


def position_ids(mask: Tensor) -> Tensor:
    """Position ids of left-padded rows: each row's first real token is at position 0 (as when
    it runs alone); padding gets 0."""
    pos = mask.cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def lm_batch(rows: list[list[int]], pad_id: int) -> dict[str, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for prompts of any lengths."""
    if any(len(r) == 0 for r in rows):
        raise InputError("an empty prompt cannot be run")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def tensor_batch(values: list[Any], where: Any) -> tuple[tuple, list[int]]:
    """Concatenate per-invoke positional tensors along dim 0; return args and each invoke's rows."""
    parts = [v if type(v) is tuple else (v,) for v in values]
    arity = len(parts[0])
    sizes = []
    for k, p in enumerate(parts):
        if len(p) != arity or not all(isinstance(x, Tensor) and x.dim() > 0 for x in p):
            raise InputError(
                f"{where[k]}: every invoke must pass the same number of tensors (with a batch dimension)"
            )
        sizes.append(p[0].shape[0])
    if len(parts) == 1:
        return parts[0], sizes
    try:
        if arity == 1:
            return (torch.cat([p[0] for p in parts]),), sizes
        return tuple(torch.cat([p[i] for p in parts]) for i in range(arity)), sizes
    except RuntimeError as err:
        raise InputError(f"invoke inputs cannot be batched along dimension 0: {err}") from None
