"""klevict's CLI with one part of the bfloat16 probes undone, to tell which part changes a result:

    python variant.py nosampled ARGS...   # the read's sampled rows on the model's head again
    python variant.py f32score ARGS...    # kl's scoring products at float32 again (the copy's sampled rows kept)
    python variant.py default ARGS...     # as shipped
"""
import sys
import klevict_cli.engine as E
which = sys.argv.pop(1)
if which == "nosampled":
    f = E.Engine.forward
    def g(self, *a, **k):
        k["sampled"] = False
        return f(self, *a, **k)
    E.Engine.forward = g
elif which == "f32score":
    init = E.Engine.__init__
    def i(self, *a, **k):
        k["score_dtype"] = __import__("torch").float32
        init(self, *a, **k)
    E.Engine.__init__ = i
from klevict_cli.cli import app
app()
