# Type stub of the C extension shardckpt/_format/_crccopy.c (optional: built where a compiler was).
from typing import Any, List, Optional, Sequence, Tuple

HARDWARE: int
STREAM_MIN_BYTES: int

def copy_crc32c(dst: Any, src: Any, keep: Optional[Any] = None, value: int = 0) -> int: ...
def copy_stream(dst: Any, src: Any) -> None: ...
def check_copy(src: Any, lo: int, units: Sequence[Tuple[int, int, int]], outs: Sequence[Tuple[int, Any]], step: int,
               streaming: bool = True) -> Tuple[List[int], int]: ...
