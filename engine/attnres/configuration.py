"""``AttnResConfig``: a Llama config plus the block count of its Attention Residuals."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

MODEL_TYPE = "attnres_llama"


@strict
class AttnResConfig(LlamaConfig):
    """Llama decoder whose residual stream is replaced by Attention Residuals (Kimi, arXiv 2603.15031).

    Every sub-layer (each layer's attention and its MLP: ``2 * num_hidden_layers`` of them) is one
    *step* of depth. ``attn_res_num_blocks`` groups the steps into equal blocks:

    - ``None`` (or ``2 * num_hidden_layers``): Full AttnRes, every step's output is its own source;
    - ``N``: Block AttnRes, ``2 * num_hidden_layers / N`` consecutive steps are summed into one block
      summary and only the summaries (plus the running sum of the current block) are attended.

    Worked example, 3 layers = 6 steps, ``attn_res_num_blocks=3`` (2 steps per block)::

        sources before step:  0:[e]  1:[e, a0]  2:[e, b0]  3:[e, b0, a1]  4:[e, b0, b1]  5:[e, b0, b1, a2]
        b0 = a0 + m0,  b1 = a1 + m1,  final norm reads mix([e, b0, b1, b2])      (a: attention, m: MLP)
    """

    model_type = MODEL_TYPE

    attn_res_num_blocks: int | None = None

    @property
    def attn_res_steps(self) -> int:
        """Sub-layers in depth order: attention and MLP of every layer."""
        return 2 * self.num_hidden_layers

    @property
    def attn_res_block_size(self) -> int:
        """Consecutive sub-layers summed into one source (1: Full AttnRes)."""
        return self.attn_res_steps // (self.attn_res_num_blocks or self.attn_res_steps)

    def validate_architecture(self):
        """``@strict`` validation: the block count must split the sub-layers evenly."""
        super().validate_architecture()
        n = self.attn_res_num_blocks
        if n is not None and (n < 1 or self.attn_res_steps % n):
            raise ValueError(
                f"attn_res_num_blocks ({n}) must divide the {self.attn_res_steps} sub-layers "
                f"(2 x num_hidden_layers={self.num_hidden_layers})"
            )


__all__ = ["AttnResConfig", "MODEL_TYPE"]
