"""Attention Residuals (Kimi, arXiv 2603.15031) as a transformers model, registered with the Auto classes.

Importing this package registers ``model_type: attnres_llama`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (no remote code), so a checkpoint directory like ``assets/reference-model``
with ``"architectures": ["AttnResForCausalLM"]`` loads with ``AutoModelForCausalLM.from_pretrained``
in plain transformers and in the engine (``engine/worker/model_runner.py`` imports this package).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from engine.attnres.configuration import MODEL_TYPE, AttnResConfig
from engine.attnres.modeling import AttnResForCausalLM, AttnResModel

AutoConfig.register(MODEL_TYPE, AttnResConfig, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

__all__ = ["AttnResConfig", "AttnResForCausalLM", "AttnResModel", "MODEL_TYPE"]
