"""The trained lightning indexer (DeepSeek-V3.2's DSA indexer, distilled for a frozen model).

Per full-attention layer, a few small heads read the layer's own query and key projections (after RoPE,
so the indexer sees positions the way attention does) and score every cached token::

    qi[t]  = Wq . q[t]        [Hi, Di]    q[t] = the layer's query, all heads flattened (Hq * D)
    w[t]   = Ww . q[t]        [Hi]        per-head weights from the query side
    ki[p]  = Wk . k[p]        [Di]        k[p] = the layer's key, all KV heads flattened (Hkv * D)
    score[t, p] = sum_h w[t, h] * relu(qi[t, h] . ki[p])

The index key ``ki`` (one ``Di``-vector per token) lives in a paged int8 cache beside K/V (same block
ids; one fp32 scale per token, ``sinkserve_kernels/indexer.py``'s layout). ``training/train_indexer.py`` fits
``Wq, Wk, Ww`` so that ``softmax(score[t, :])`` over the positions outside the forced set matches the
model's own head-averaged attention there (KL, the dense warm-up stage of DSA), with the model frozen.

Worked example (Hi 2, Di 2): q -> qi = [[1, 0], [0, 1]], w = [2, 1]; keys ki[0] = [3, -1], ki[1] = [-1, 2]::

    score[t, 0] = 2 * relu(3) + 1 * relu(-1) = 6        score[t, 1] = 2 * relu(-1) + 1 * relu(2) = 2
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LightningIndexer:
    """Per-layer projections ``wq [L][Hi * Di, Hq * D]``, ``wk [L][Di, Hkv * D]``, ``ww [L][Hi, Hq * D]``."""

    wq: tuple[torch.Tensor, ...]
    wk: tuple[torch.Tensor, ...]
    ww: tuple[torch.Tensor, ...]
    heads: int
    dim: int

    @property
    def num_layers(self) -> int:
        return len(self.wq)

    def queries(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]`` -> indexer queries ``[T, Hi, Di]`` and weights ``[T, Hi]`` (fp32)."""
        qf = q.reshape(q.shape[0], -1).float()
        return (qf @ self.wq[layer].T).view(-1, self.heads, self.dim), qf @ self.ww[layer].T

    def keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> index keys ``[T, Di]`` (fp32)."""
        return k.reshape(k.shape[0], -1).float() @ self.wk[layer].T

    def to(self, device: torch.device | str) -> "LightningIndexer":
        mv = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
        return LightningIndexer(mv(self.wq), mv(self.wk), mv(self.ww), self.heads, self.dim)

    @classmethod
    def load(cls, path: str | Path, num_layers: int | None = None) -> "LightningIndexer":
        """Weights from ``indexer.safetensors`` (``layers.<i>.{wq,wk,ww}``); ``ConfigError`` naming
        ``sparse.indexer`` when the file is missing or does not fit the model's ``num_layers``."""
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise ConfigError("sparse.indexer", f"'trained' needs indexer weights at {path} (none found); "
                              "use 'block_bounds' for a model without a trained indexer")
        t = load_file(str(path))
        n = 1 + max(int(k.split(".")[1]) for k in t)
        if num_layers is not None and n != num_layers:
            raise ConfigError("sparse.indexer", f"{path} has {n} layers, the model {num_layers}")
        wq = tuple(t[f"layers.{i}.wq"].float() for i in range(n))
        wk = tuple(t[f"layers.{i}.wk"].float() for i in range(n))
        ww = tuple(t[f"layers.{i}.ww"].float() for i in range(n))
        dim = wk[0].shape[0]
        return cls(wq, wk, ww, wq[0].shape[0] // dim, dim)


def head_products(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    """Each indexer head's ``qi[.., t, h] . ki[.., p]`` before the ReLU: ``[..., T, Hi, P]`` (``scores``
    weighs them; training also reads where they are positive, ``train_indexer.Indexer.alive``)."""
    return torch.einsum("...thd,...pd->...thp", qi, ki)


def scores(qi: torch.Tensor, w: torch.Tensor, ki: torch.Tensor, products: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_h w[.., t, h] * relu(qi[.., t, h] . ki[.., p])``: ``qi [..., T, Hi, Di]``, ``w [..., T, Hi]``,
    ``ki [..., P, Di]`` -> ``[..., T, P]`` (the training loss and the torch reference use this); ``products``:
    ``head_products(qi, ki)`` when the caller already has them."""
    logits = (head_products(qi, ki) if products is None else products).relu()
    return (w.unsqueeze(-1) * logits).sum(-2)


def quantize_keys(ki: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token: ``ki [T, Di]`` -> ``(codes int8 [T, Di], scale fp32 [T])``."""
    scale = ki.abs().amax(-1).clamp(min=1e-8) / 127.0
    return torch.round(ki / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def index_dim(path: str | Path) -> int:
    """The index-key width ``Di`` of an ``indexer.safetensors`` (its header only; ``ConfigError`` naming
    ``sparse.indexer`` when the file is missing)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError("sparse.indexer", f"'trained' needs indexer weights at {path} (none found); "
                          "use 'block_bounds' for a model without a trained indexer")
    with safe_open(str(path), "pt") as f:
        return int(f.get_slice("layers.0.wk").get_shape()[0])
