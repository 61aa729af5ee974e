"""klevict: stream long documents through an LLM, evicting the KV-cache entries whose loss changes the model least."""

import os

# OpenMP threads that spin while they wait hand their core to nobody: beside one other busy process (a second klevict,
# a build), torch's default threads made a 400-token compress 18x slower on 2 cores, and passive waiting costs about a
# tenth when the machine is idle (docs/method.md, "Threads"). Read once, when torch loads; a wait the user chose wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

__version__ = "0.1.0"
