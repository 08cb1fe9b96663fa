"""The engine's public functions, gathered from the modules that implement them.

``_save`` (plan, write, commit), ``_load`` (validate, read, agree, apply) and
``_verify`` (inspect, verify) hold the code; this module is the one place the
package's lazy ``__init__`` points at.
"""

from __future__ import annotations

from ._load import LoadResult, load
from ._save import save
from ._verify import inspect, verify

__all__ = ["save", "load", "inspect", "verify", "LoadResult"]
