"""``to_safetensors(quantize="fp8-block")``: which weights become block FP8, their scales, and the config that says so.

DeepSeek-V3's layout, which transformers (``FineGrainedFP8Config``), vLLM
and SGLang read: each quantized Linear weight ``W`` is written as
``float8_e4m3fn`` beside ``W_scale_inv`` (float32, one value per 128 x 128
block, edge blocks smaller), ``W ~ W_fp8.float() * W_scale_inv[block]``, and
``config.json`` gets ``quantization_config = {"quant_method": "fp8", "fmt":
"e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
...}``.

Streaming, as every converter: a quantized weight is read twice, block by
block (the first pass folds each block's max |x| into its scale, the second
writes the FP8 codes); memory beyond the converter's blocks is the scale
grids (1/16384 of the quantized elements, float32).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from shardckpt import _fp8
from shardckpt._format import torch_dtype
from shardckpt._format.chunk import Chunk
from shardckpt._format.hf import DEFAULT_FP8_BLOCK, FP8_QUANT_METHOD, HF_CONFIG_NAME, SCALE_SUFFIX, scale_shape
from shardckpt.errors import CorruptCheckpointError, UnsupportedStateError

from ._common import Reader
from ._source import BLOCK_BYTES, OutEntry, SrcTensor, plan_blocks, whole_entry

__all__ = ["QUANTIZE_CHOICES", "FP8_BLOCK", "Fp8Weight", "quantized", "fp8_entries", "fp8_config", "not_converted"]

#: ``to_safetensors(quantize=...)`` / ``shardckpt export --quantize``.
QUANTIZE_CHOICES = ("fp8-block",)
FP8_BLOCK: Tuple[int, int] = DEFAULT_FP8_BLOCK
#: Left in their dtype by default (transformers' FP8 quantizer replaces Linear
#: layers only and keeps the head): embeddings, norms, the output head, MoE routers.
_DEFAULT_KEEP_PARTS = ("lm_head",)
_KEEP_SUBSTRINGS = ("embed", "norm")
_ROUTER_MODULE = "gate"  # DeepSeek's ``mlp.gate`` (``gate_proj`` is a Linear and is quantized)
_FLOATS = ("F32", "BF16", "F16", "F64")


def _module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else ""


def _listed(module: str, patterns: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``patterns`` or lies under/at the end of one (dotted components)."""
    dotted = f".{module}."
    return any(p and (f".{p}." in dotted or module.startswith(p + ".") or module.endswith("." + p)) for p in patterns)


def quantized(name: str, dtype: str, shape: Sequence[int], not_convert: Optional[Sequence[str]] = None) -> bool:
    """Whether the output tensor ``name`` is written as block FP8.

    A 2-D floating-point ``*.weight`` (a Linear's) whose module is not in
    ``not_convert`` (the source config's ``modules_to_not_convert``, matched
    by dotted components) and is not an embedding, a norm, ``lm_head`` or a
    MoE router (``*.gate``). 1-D and 3-D tensors, biases, integers never.

        >>> quantized("model.layers.0.mlp.down_proj.weight", "BF16", [64, 256])
        True
        >>> [quantized(n, "BF16", [64, 64]) for n in ("lm_head.weight", "model.embed_tokens.weight", "x.mlp.gate.weight")]
        [False, False, False]
    """
    module = _module_of(name)
    if not module or dtype not in _FLOATS or len(shape) != 2 or not math.prod(shape):
        return False
    parts = module.split(".")
    if any(s in p for p in parts for s in _KEEP_SUBSTRINGS) or parts[-1] == _ROUTER_MODULE:
        return False
    return not _listed(module, list(_DEFAULT_KEEP_PARTS) + list(not_convert or ()))


class Fp8Weight:
    """One weight to quantize: its scale grid (first pass, :meth:`scales`), and :meth:`encode` of a streamed block.

    Thread-safe enough for the converters' use: :meth:`scales` runs once,
    before any file is written (:func:`fp8_entries`).
    """

    def __init__(self, src: SrcTensor, block: Tuple[int, int] = FP8_BLOCK):
        self.src = src
        self.block = block
        self.scale: Optional[torch.Tensor] = None

    def compute_scales(self, reader: Reader, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
        """Stream the weight once (whole row bands per block), folding each block's max |x| into its scale."""
        rows, cols = self.src.shape
        amax = torch.zeros(scale_shape(self.src.shape, self.block), dtype=torch.float32)
        isz = torch.empty((), dtype=torch_dtype(self.src.dtype)).element_size()
        band = self.block[0] * cols * isz
        aligned = max(band, (block_bytes // band) * band)  # blocks start on a band: whole rows
        for blk in plan_blocks(self.src, 0, self.src.numel, aligned):
            raw = reader.read(self.src, blk)
            x = raw.view(torch_dtype(self.src.dtype)).view(-1, cols)
            _fp8.block_amax(amax, x, row0=blk.start // cols, col0=0, block=self.block)
        if not bool(torch.isfinite(amax).all()):
            raise UnsupportedStateError(
                f"{self.src.name}: holds NaN or infinite values; block FP8 cannot encode them (its scale would be "
                "NaN/inf). Fix the weights, or export without quantize= (or leave it out with keys=)"
            )
        self.scale = _fp8.scales_from_amax(amax)
        return self.scale

    def encode(self, raw: torch.Tensor, start: int, count: int, out: torch.Tensor) -> None:
        """FP8 codes of elements ``[start, start + count)`` (row-major) of the weight, from ``raw`` (its source bytes) into ``out``."""
        if self.scale is None:
            raise RuntimeError(f"{self.src.name}: scales not computed before encoding")  # a bug, not user input
        cols = self.src.shape[1]
        x = raw.view(torch_dtype(self.src.dtype))
        q = out.view(_fp8.FP8_DTYPE)
        # The block may begin and end inside a row: a partial first row, whole rows, a partial last row.
        at, end = start, start + count
        while at < end:
            r, c = divmod(at, cols)
            if c or end - at < cols:
                n, m = 1, min(cols - c, end - at)
            else:
                n, m = (end - at) // cols, cols
            lo = at - start
            _fp8.quantize_into(q[lo : lo + n * m].view(n, m), x[lo : lo + n * m].view(n, m), self.scale,
                               row0=r, col0=c, block=self.block)
            at += n * m

    def scale_source(self, out_name: str) -> SrcTensor:
        """The scale grid as a source tensor (held in memory), written as ``<weight>_scale_inv``."""
        shape = tuple(scale_shape(self.src.shape, self.block))
        nbytes = math.prod(shape) * 4
        t = SrcTensor(name=out_name, dtype="F32", shape=shape, chunks=[])
        t.add(Chunk(file="", byte_offset=0, nbytes=nbytes, offsets=(0, 0), sizes=shape, tensor=out_name),
              loader=lambda: self.scale if self.scale is not None else torch.empty(0))
        return t


def fp8_entries(reader: Reader, src: SrcTensor, out: str, *,
                not_convert: Optional[Sequence[str]] = None) -> Optional[List[OutEntry]]:
    """``[weight entry (FP8), scale entry]`` of output tensor ``out`` when it is quantized, else None.

    The scales are computed here (the first streaming pass over ``src``).
    """
    if not quantized(out, src.dtype, src.shape, not_convert):
        return None
    w = Fp8Weight(src)
    w.compute_scales(reader)
    weight = whole_entry(src, out, "F8_E4M3")
    weight.quant = w
    scale = w.scale_source(out + SCALE_SUFFIX)
    return [weight, whole_entry(scale, out + SCALE_SUFFIX)]


def fp8_config(config: Optional[bytes], kept: Sequence[str], *, where: str) -> bytes:
    """``config.json`` with block FP8's ``quantization_config`` merged in (the rest of the config as it was).

    ``kept``: modules whose 2-D weights stay unquantized, listed in
    ``modules_to_not_convert`` (with what the source config listed), so
    that transformers builds plain Linear layers for them. A source already
    block FP8 keeps its other quantization keys; another quantization method
    is replaced (the weights written are FP8 now).

    Raises:
        CorruptCheckpointError: ``config`` is not a JSON object.
    """
    if config is None:
        cfg: Dict[str, Any] = {}
    else:
        try:
            cfg = json.loads(config.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"{where}: {HF_CONFIG_NAME} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise CorruptCheckpointError(f"{where}: {HF_CONFIG_NAME} is not a JSON object")
    old = cfg.get("quantization_config")
    qc: Dict[str, Any] = dict(old) if isinstance(old, dict) and old.get("quant_method") == FP8_QUANT_METHOD else {}
    listed = list(qc.get("modules_to_not_convert") or [])
    qc.update({
        "quant_method": FP8_QUANT_METHOD,
        "fmt": "e4m3",
        "activation_scheme": qc.get("activation_scheme", "dynamic"),
        "weight_block_size": list(FP8_BLOCK),
    })
    qc["modules_to_not_convert"] = sorted(set(listed) | set(kept)) or None
    cfg["quantization_config"] = qc
    return (json.dumps(cfg, indent=2, sort_keys=False) + "\n").encode()


def not_converted(config: Optional[bytes]) -> List[str]:
    """The source config's ``quantization_config.modules_to_not_convert`` (empty when it has none)."""
    if config is None:
        return []
    try:
        cfg = json.loads(config.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    got = qc.get("modules_to_not_convert") if isinstance(qc, dict) else None
    return [m for m in got if isinstance(m, str)] if isinstance(got, list) else []
