"""Model forwards: native ones (Llama family, ``llama.py``) and the transformers fallback (``hf.py``),
chosen per architecture by ``registry.py``."""

from engine.models.registry import NATIVE_ARCHITECTURES, load_model, register_architecture

__all__ = ["NATIVE_ARCHITECTURES", "load_model", "register_architecture"]

# Architectures whose native forward lives in its own module register themselves on import.
import engine.models.attnres  # noqa: E402,F401  AttnResForCausalLM
