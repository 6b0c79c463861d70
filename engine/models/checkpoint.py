"""Reading a Hugging Face checkpoint's safetensors straight into (sharded, fused) tensors.

No transformers module is built: each tensor is read by name (through ``model.safetensors.index.json``
when the checkpoint is split into several files) and, for tensor parallelism, only this rank's slice
of it is materialised (``safe_open(...).get_slice``), so a rank never holds the whole matrix.

Sharding follows DeepSpeed AutoTP's split of a Llama block (what the transformers path uses with
``world_size > 1``): rank ``r`` of ``n`` keeps a contiguous chunk of the output rows of the q/k/v and
gate/up projections (heads ``r * H/n .. (r+1) * H/n - 1``) and the matching chunk of the input columns
of o_proj and down_proj, whose partial products are all-reduced::

    q_proj [Hq*D, hidden]  rank 0 -> rows [0, Hq*D/2)    o_proj [hidden, Hq*D]  rank 0 -> cols [0, Hq*D/2)
                           rank 1 -> rows [Hq*D/2, ..)                          rank 1 -> cols [Hq*D/2, ..)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.errors import ModelLoadError

INDEX_NAME = "model.safetensors.index.json"


class Checkpoint:
    """Name -> tensor access over a model directory's safetensors files (single or split)."""

    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / INDEX_NAME
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{model_dir}: no *.safetensors files (the native forward reads safetensors only)")
        self._handles = [safe_open(str(root / f), framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        self.device = device
        self.dtype = dtype

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dim: int | None = None, rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """Tensor ``name`` in the model dtype on the device; with ``dim``, only chunk ``rank`` of
        ``world_size`` equal chunks along that dimension."""
        if name not in self._where:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        if dim is None or world_size == 1:
            t = self._where[name].get_tensor(name)
        else:
            sl = self._where[name].get_slice(name)
            size = sl.get_shape()[dim]
            if size % world_size:
                raise ModelLoadError(f"{name}: dimension {dim} of size {size} does not split over {world_size} ranks")
            n = size // world_size
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(rank * n, (rank + 1) * n)
            t = sl[tuple(index)]
        return t.to(device=self.device, dtype=self.dtype)
