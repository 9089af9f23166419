from __future__ import annotations

import os
import sys

# The repo is not installed; make `engine` and this folder's helper modules importable here and
# in the processes the multi-rank tests spawn (they inherit sys.path).
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)
