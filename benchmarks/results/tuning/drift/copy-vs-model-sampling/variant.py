"""klevict's CLI with the drift's continuation sampled on the model instead of the probe copy (same generator, so
the same uniforms: a paired comparison of where the drift's tokens are drawn).

    python variant.py modelsample ARGS...   # drift tokens sampled on the float32 model
    python variant.py default ARGS...       # as shipped (on the probe copy where there is one)
"""
import sys
import klevict_cli.engine as E
which = sys.argv.pop(1)
if which == "modelsample":
    f = E.Engine.drafts_for_drift
    def g(self, *a, **k):
        copy, self.probe_model = self.probe_model, None
        try:
            return f(self, *a, **k)
        finally:
            self.probe_model = copy
    E.Engine.drafts_for_drift = g
from klevict_cli.cli import app
app()
