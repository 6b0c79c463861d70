"""Fault injection for the chaos suite's engine processes (test code, never shipped).

Python imports ``sitecustomize`` at start-up from ``sys.path``; the chaos tests put this folder on
``PYTHONPATH`` and set ``SINKSERVE_CHAOS_INJECT=1`` for the processes they start (an engine child, or a
whole local Ray cluster), so a request can carry its own fault through the real request path -- no
product flag. The fault rides on a stop string, which every endpoint accepts:

- ``CHAOS-POISON``: the request's detokenization raises (a per-request failure: the request must fail
  alone, with an error naming it, while the engine goes on);
- ``CHAOS-ADMIT``: admitting the request raises (it must fail alone, before it runs);
- ``CHAOS-HANG``: the engine's step blocks forever (the watchdog must kill and replace the engine).
"""

import os

if os.environ.get("SINKSERVE_CHAOS_INJECT") == "1":
    import sys
    import time

    sys.path.insert(0, os.environ["SINKSERVE_CHAOS_REPO"])
    from engine.core import detokenizer, output_processor

    _update = detokenizer.IncrementalDetokenizer.update

    def _faulty_update(self, output_ids, finished=False):
        if "CHAOS-HANG" in self.stop:
            time.sleep(3600)
        if "CHAOS-POISON" in self.stop:
            raise RuntimeError("poisoned by the chaos suite")
        return _update(self, output_ids, finished)

    detokenizer.IncrementalDetokenizer.update = _faulty_update

    _register = output_processor.OutputProcessor.register

    def _faulty_register(self, seq):
        if "CHAOS-ADMIT" in seq.params.stop:
            raise KeyError("admission poisoned by the chaos suite")
        return _register(self, seq)

    output_processor.OutputProcessor.register = _faulty_register
