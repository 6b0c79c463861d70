"""The engine's step loop: ``LLMEngine`` (schedule, run the model, process outputs), the scheduler, the
input processor (tokenize, validate against the limits, anchors) and the output processor (detokenize,
stop strings), the executor, and the engine's stats."""
