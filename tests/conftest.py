import os
import sys

# Tests import helpers (tests/_dist.py, tests/models.py) as top-level modules,
# also inside spawned rank processes, which inherit PYTHONPATH.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")
