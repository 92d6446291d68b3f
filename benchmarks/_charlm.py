"""A byte-level transformer language model on the Python standard library's own sources.

The corpus needs no download: the ``.py`` files directly in ``sysconfig.get_paths()["stdlib"]``,
sorted by name, read as bytes and concatenated (a ``\\x00`` after each file) up to a byte
budget. Every tenth file goes to the held-out set, so held-out text comes from files never seen
in training, spread over the whole library. The vocabulary is the 256 byte values.

- :func:`load_corpus`: the train and held-out byte tensors (deterministic for a Python version).
- :class:`CharTransformer`: a small pre-norm decoder-only transformer with tied embeddings.
- :class:`ShardSampler`: random context windows from this rank's contiguous shard of the
  training bytes, from a generator seeded by (seed, rank): every method sees the same batches.
- :func:`held_out_loss`: mean next-byte cross-entropy (nats) on fixed held-out windows.

The module is private (``_``-prefixed), so ``run_all.py`` does not take it for a benchmark.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

VOCAB = 256
SEPARATOR = 0  # the byte between two files (never occurs in a .py source)


@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes plus where they came from."""

    train: torch.Tensor  # uint8, 1-D
    held_out: torch.Tensor  # uint8, 1-D
    files: int
    held_out_files: int
    sha256: str  # of train + held-out bytes: two runs on the same Python read the same text


def load_corpus(budget_bytes: int, held_out_every: int = 10) -> Corpus:
    """``budget_bytes`` of the sorted stdlib ``.py`` files, every ``held_out_every``-th held out.

    Files go in name order: every ``held_out_every``-th one to the held-out set until it holds
    ``budget_bytes // held_out_every`` bytes, the others to the training set until it holds the
    rest (the file that crosses a budget is cut to fit; a file meant for a full set is
    skipped). No file is split between the two sets.

    Args:
        budget_bytes: total bytes, exactly.
        held_out_every: the held-out share is one file in this many, and of the bytes.

    Returns:
        The :class:`Corpus`.

    Raises:
        RuntimeError: if the standard library has too few sources for the budget.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    room = {
        True: budget_bytes // held_out_every,
        False: budget_bytes - budget_bytes // held_out_every,
    }
    chunks: dict[bool, list[bytes]] = {True: [], False: []}
    for index, path in enumerate(sorted(stdlib.glob("*.py"))):
        held = index % held_out_every == held_out_every - 1
        if room[held] < 2:
            if room[not held] < 2:
                break
            continue
        text = path.read_bytes().replace(bytes([SEPARATOR]), b"")[: room[held] - 1]
        chunks[held].append(text + bytes([SEPARATOR]))
        room[held] -= len(text) + 1
    if room[True] or room[False]:
        raise RuntimeError(
            f"{stdlib} holds too few .py sources for {budget_bytes} bytes with one file in "
            f"{held_out_every} held out; lower the byte budget"
        )
    train, held_out = b"".join(chunks[False]), b"".join(chunks[True])
    return Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        held_out=torch.frombuffer(bytearray(held_out), dtype=torch.uint8),
        files=len(chunks[False]) + len(chunks[True]),
        held_out_files=len(chunks[True]),
        sha256=hashlib.sha256(train + held_out).hexdigest()[:12],
    )


class _Block(nn.Module):
    """Pre-norm block: causal self-attention then a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).split(width, dim=-1)
        )
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Decoder-only byte-level language model (learned positions, tied output embedding).

    Args:
        context: the longest input it accepts.
        width: model width (``d_model``).
        layers: number of blocks.
        heads: attention heads (must divide ``width``).
    """

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)
        for block in self.blocks:
            assert isinstance(block, _Block)
            # GPT-2's scaling of the residual projections by depth.
            for out in (block.proj, block.mlp[2]):
                assert isinstance(out, nn.Linear)
                nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, length, 256)`` for ``tokens`` ``(batch, length)`` (int64)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return functional.linear(self.norm(x), self.embed.weight)


def next_byte_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``windows[:, 1:]`` from ``windows[:, :-1]``."""
    logits = model(windows[:, :-1])
    return functional.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))


class ShardSampler:
    """Random ``context + 1``-byte windows from one rank's contiguous shard of ``data``.

    Args:
        data: the training bytes.
        rank: this rank; the shard is the ``rank``-th of ``world_size`` equal slices.
        world_size: number of shards.
        context: model context (each window holds one more byte, the last target).
        batch: windows per call.
        seed: with ``rank``, seeds the generator, so every method draws the same windows.
    """

    def __init__(
        self, data: torch.Tensor, rank: int, world_size: int, context: int, batch: int, seed: int
    ) -> None:
        shard = len(data) // world_size
        self.data = data[rank * shard : (rank + 1) * shard].long()
        self.span = context + 1
        self.batch = batch
        self.generator = torch.Generator().manual_seed(1_000_003 * seed + rank)

    def __call__(self) -> torch.Tensor:
        """The next batch, ``(batch, context + 1)`` int64."""
        starts = torch.randint(
            0, len(self.data) - self.span, (self.batch,), generator=self.generator
        )
        return self.data[starts[:, None] + torch.arange(self.span)]


def held_out_windows(held_out: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced non-overlapping-if-possible windows of the held-out bytes."""
    span = context + 1
    starts = torch.linspace(0, len(held_out) - span, count).long()
    return held_out.long()[starts[:, None] + torch.arange(span)]


@torch.no_grad()
def held_out_loss(model: nn.Module, windows: torch.Tensor, batch: int = 64) -> float:
    """Mean next-byte cross-entropy (nats) of ``model`` over ``windows``."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        total += float(next_byte_loss(model, chunk)) * len(chunk)
    model.train(was_training)
    return total / len(windows)


def lr_factor(config: Any) -> Callable[[int], float]:
    """The LM benchmarks' ``LambdaLR`` factor: linear warm-up over ``config.warmup`` steps, then
    cosine decay to a tenth at ``config.steps``."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
