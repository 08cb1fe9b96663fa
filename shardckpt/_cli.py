"""The ``shardckpt`` command: inspect, verify, diff, export/convert, reshard, import, gc, consolidate.

Exit status: 0 on success; 1 when ``verify`` finds damage (in the manifest
too) or ``diff`` finds differences; 2 on any other error (one line on stderr, no traceback; set
``SHARDCKPT_TRACEBACK=1`` to see one). Every command takes ``--json`` (one
JSON object on stdout) and ``-q`` (nothing on stdout: the exit status says
it). Progress bars (tqdm) go to stderr when it is a terminal, unless ``-q``.
``inspect`` and ``verify`` import no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence

# Each subcommand imports the format, storage or converters inside its
# function: `shardckpt --help` starts at once and inspect/verify never import torch.
from ._version import __version__
from .errors import CheckpointExistsError, CorruptCheckpointError

__all__ = ["main"]

EXIT_OK, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


class _CliError(Exception):
    """A user error with a message meant for the terminal."""


def _storage_options(pairs: Optional[Sequence[str]]) -> Optional[Dict[str, Any]]:
    """``key=value`` pairs; values read as JSON when they parse (numbers, booleans, objects)."""
    if not pairs:
        return None
    out: Dict[str, Any] = {}
    for p in pairs:
        key, sep, val = p.partition("=")
        if not sep or not key:
            raise _CliError(f"--storage-option expects key=value, got {p!r}")
        try:
            out[key] = json.loads(val)
        except ValueError:
            out[key] = val
        # Nested options: client_kwargs.endpoint_url=... -> {"client_kwargs": {"endpoint_url": ...}}
        if "." in key:
            head, _, rest = key.partition(".")
            out.setdefault(head, {})
            if isinstance(out[head], dict):
                out[head][rest] = out.pop(key)
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _progress(args) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


class _Bar:
    """A tqdm bar on stderr (bytes), or nothing; safe to update from several threads."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        self.lock = threading.Lock()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return  # progress bars are optional: pip install "shardckpt[progress]"
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------
# commands


def _open(url: str, opts):
    """The checkpoint's storage and manifest, without importing torch (``inspect`` and ``verify`` need none)."""
    from ._format import open_manifest
    from ._format.refs import follow
    from ._storage import Storage

    storage = follow(Storage(url, storage_options=opts))  # format v4 references
    return storage, open_manifest(storage)


def _describe(m) -> str:
    """What a checkpoint is, for a summary line."""
    from ._format import SOURCE_SAFETENSORS

    if m.source == SOURCE_SAFETENSORS:
        return "Hugging Face safetensors (no checksums)"
    return f"shardckpt format v{m.version}, saved by world size {m.world_size}"


def cmd_inspect(args) -> int:
    from ._format import plain_values, plural
    from ._format.refs import own_and_shared

    _, m = _open(args.url, _storage_options(args.storage_option))
    if args.json:
        out = m.to_json()
        out["own_bytes"], out["shared_bytes"] = own_and_shared({rel: f.size for rel, f in m.data_files.items()})
        out["url"] = args.url
        out["total_bytes"] = m.total_bytes
        out["source"] = m.source
        if args.values:
            out["plain_values"] = plain_values(m.values)
        _print_json(out)
        return EXIT_OK
    if not args.quiet:
        print(f"{args.url}: {_describe(m)}, {plural(len(m.tensors), 'tensor')}, "
              f"{plural(len(m.data_files), 'file')}, {_human(m.total_bytes)}")
    rows = [("name", "dtype", "shape", "chunks", "bytes")]
    for name in sorted(m.tensors):
        t = m.tensors[name]
        rows.append((name, t.dtype, "[" + ", ".join(str(s) for s in t.shape) + "]", str(len(t.chunks)), str(t.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]:>{widths[4]}}")
    if args.values:
        plain = plain_values(m.values)
        print("values: " + ("(none besides tensors)" if plain is None else json.dumps(plain, indent=1, sort_keys=True)))
    own, shared = own_and_shared({rel: f.size for rel, f in m.data_files.items()})
    if shared:
        print(f"files: {_human(own)} own, {_human(shared)} in files of other steps it references (incremental)")
    return EXIT_OK


def cmd_verify(args) -> int:
    from ._format import SOURCE_SAFETENSORS, plural
    from ._verify import verify_manifest

    bar = None
    try:
        # A damaged manifest (or a manifest.json that is a FIFO, a directory,
        # a link out of the checkpoint) is damage found, like a bad chunk: exit 1.
        storage, m = _open(args.url, _storage_options(args.storage_option))
        chunks = sum(len(t.chunks) for t in m.tensors.values())
        bar = _Bar(m.total_bytes, _progress(args), "verify")
        verify_manifest(storage, m, on_bytes=bar.update)
    except CorruptCheckpointError as e:
        if bar is not None:
            bar.close()
        if args.json:
            _print_json({"url": args.url, "ok": False, "error": type(e).__name__, "message": str(e)})
        elif not args.quiet:
            print(f"shardckpt: DAMAGED: {e}", file=sys.stderr)
        return EXIT_DIFFERENT
    bar.close()
    checked = m.source != SOURCE_SAFETENSORS
    if args.json:
        _print_json({
            "url": args.url, "ok": True, "source": m.source, "tensors": len(m.tensors), "chunks": chunks,
            "files": len(m.data_files), "total_bytes": m.total_bytes, "checksums": checked,
        })
    elif not args.quiet:
        how = "every checksum matches" if checked else "safetensors files have no checksums: headers, bounds and sizes checked"
        print(f"OK {args.url}: {plural(len(m.tensors), 'tensor')}, {plural(chunks, 'chunk')}, "
              f"{plural(len(m.data_files), 'file')}, {_human(m.total_bytes)}; {how}")
    return EXIT_OK


def cmd_diff(args) -> int:
    from shardckpt.converters._diff import diff

    report = diff(
        args.a,
        args.b,
        storage_options=_storage_options(args.storage_option),
        b_storage_options=_storage_options(args.b_storage_option) or _storage_options(args.storage_option),
        atol=args.atol,
        progress=_progress(args),
    )
    if args.json:
        _print_json(report.to_json())
    elif not args.quiet:
        for line in report.lines():
            print(line)
    return EXIT_OK if report.same else EXIT_DIFFERENT


def _keys(vals: Optional[List[str]]) -> Optional[List[str]]:
    if not vals:
        return None
    out: List[str] = []
    for v in vals:
        out.extend(x for x in v.split(",") if x)
    return out


def _rename(vals: Optional[List[str]]) -> Optional[Dict[str, str]]:
    if not vals:
        return None
    out = {}
    for v in vals:
        old, sep, new = v.partition("=")
        if not sep or not old or not new:
            raise _CliError(f"--rename expects old=new, got {v!r}")
        out[old] = new
    return out


def cmd_export(args) -> int:
    common = dict(
        storage_options=_storage_options(args.storage_option),
        dst_storage_options=_storage_options(args.dst_storage_option),
        overwrite=args.overwrite,
        progress=_progress(args),
    )
    key_map = _rename(getattr(args, "rename", None))
    from shardckpt import converters as _converters  # after the cheap checks: this imports torch

    # mypy cannot follow shardckpt.converters (mapped from converters/ at install).
    converters: Any = _converters

    to = args.to
    if to is None:
        if args.world_size is not None:
            to = "reshard"
        elif args.dst.lower().endswith((".safetensors", ".pt", ".pth", ".bin")):
            to = "full"
        else:
            to = "safetensors"
    if to == "reshard":
        if args.world_size is None:
            raise _CliError("--to reshard needs --world-size N")
        extra = [o for o in ("dtype", "keys", "rename", "copy_from", "quantize") if getattr(args, o, None)]
        if extra:
            flags = ", ".join("--" + o.replace("_", "-") for o in extra)
            raise _CliError(f"reshard keeps every tensor as it is: {flags} cannot be used with it")
        r = converters.reshard(args.src, args.dst, world_size=args.world_size, **common)
    elif to == "full":
        if getattr(args, "copy_from", None):
            raise _CliError("--copy-from adds config and tokenizer files beside a Hugging Face directory; "
                            "it cannot be used with --to full (one file): drop it or export to a directory")
        if getattr(args, "quantize", None):
            raise _CliError("--quantize writes a Hugging Face directory (weights, scales and config.json's "
                            "quantization_config); it cannot be used with --to full: export to a directory")
        r = converters.to_full(args.src, args.dst, dtype=args.dtype, keys=_keys(args.keys), key_map=key_map, **common)
    else:
        # No --prefix: the converter's default picks the model entry; a given
        # one must match (the converter refuses it otherwise, listing those that exist).
        pick = {"prefix": ""} if args.no_prefix else {} if args.prefix is None else {"prefix": args.prefix}
        r = converters.to_safetensors(
            args.src, args.dst, dtype=args.dtype, max_shard_size=args.max_shard_size, keys=_keys(args.keys),
            key_map=key_map, copy_from=getattr(args, "copy_from", None),
            quantize=getattr(args, "quantize", None), **pick, **common,
        )
    _done(args, r)
    return EXIT_OK


def cmd_gc(args) -> int:
    from ._manager import CheckpointManager

    mgr = CheckpointManager(args.root, storage_options=_storage_options(args.storage_option))
    removed = mgr.cleanup(dry_run=args.dry_run)
    if args.json:
        _print_json({"root": args.root, "dry_run": args.dry_run, "removed": removed})
    elif not args.quiet:
        verb = "would remove" if args.dry_run else "removed"
        print(f"{args.root}: {verb} {len(removed)} path(s)" + "".join(f"\n  {r}" for r in removed))
    return EXIT_OK


def cmd_consolidate(args) -> int:
    from shardckpt.converters import consolidate

    opts = _storage_options(args.storage_option)
    r = consolidate(args.src, args.dst, storage_options=opts, dst_storage_options=opts, overwrite=args.overwrite,
                    progress=_progress(args))
    _done(args, r)
    return EXIT_OK


def cmd_reshard(args) -> int:
    args.to = "reshard"
    return cmd_export(args)


def _detect_import(src: str, opts) -> str:
    from shardckpt._storage import Storage

    lower = src.lower().rstrip("/")
    if lower.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    if lower.endswith(".safetensors"):
        return "safetensors"
    st = Storage(src, storage_options=opts)
    names = st.listdir("")
    if ".metadata" in names:
        return "dcp"
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    raise _CliError(f"cannot tell what {src} is (no .metadata, no *.safetensors, not a .pt file); pass --from")


def cmd_import(args) -> int:
    opts = _storage_options(args.storage_option)
    kind = args.kind or _detect_import(args.src, opts)
    from shardckpt import converters as _converters  # after the cheap checks: this imports torch

    # mypy cannot follow shardckpt.converters (mapped from converters/ at install).
    converters: Any = _converters

    common = dict(
        storage_options=opts,
        dst_storage_options=_storage_options(args.dst_storage_option),
        overwrite=args.overwrite,
        progress=_progress(args),
        keys=_keys(args.keys),
        key_map=_rename(args.rename),
    )
    if kind == "dcp":
        r = converters.from_dcp(args.src, args.dst, prefix=args.prefix, **common)
    elif kind == "torch":
        r = converters.from_torch_save(args.src, args.dst, prefix=args.prefix, **common)
    else:
        r = converters.from_safetensors(args.src, args.dst, prefix="model." if args.prefix is None else args.prefix, **common)
    _done(args, r)
    return EXIT_OK


#: Below this many bytes a conversion's rate says nothing (it is all start-up): not shown.
RATE_MIN_BYTES = 64 << 20


def _done(args, r) -> None:
    from ._format import plural

    if args.json:
        _print_json({"url": r.url, "files": list(r.files), "tensors": r.tensors, "bytes": r.nbytes, "seconds": round(r.seconds, 3)})
    elif not args.quiet:
        rate = f" ({r.nbytes / 1e9 / r.seconds:.2f} GB/s)" if r.nbytes >= RATE_MIN_BYTES and r.seconds > 0 else ""
        print(f"wrote {r.url}: {plural(r.tensors, 'tensor')}, {plural(len(r.files), 'file')}, {_human(r.nbytes)} "
              f"in {r.seconds:.2f}s{rate}")


# --------------------------------------------------------------------------
# parser


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        help="fsspec option for the (source) URL, repeatable; dotted keys nest (client_kwargs.endpoint_url=...)")
    common.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bars, no summary: only the exit status (and errors on stderr)")
    common.add_argument("--json", action="store_true", help="the result as one JSON object on stdout")
    dst = argparse.ArgumentParser(add_help=False)
    dst.add_argument("--dst-storage-option", action="append", metavar="KEY=VALUE", help="fsspec option for the destination, repeatable")
    dst.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    sel = argparse.ArgumentParser(add_help=False)
    sel.add_argument("--keys", action="append", metavar="PATTERN", help="tensor names or glob patterns (repeatable, or comma-separated)")
    sel.add_argument("--rename", action="append", metavar="OLD=NEW", help="rename a tensor (repeatable)")

    p = argparse.ArgumentParser(
        prog="shardckpt",
        description="Inspect, verify, compare and convert shardckpt checkpoints (local paths or fsspec URLs).",
        epilog="Exit status: 0 ok; 1 damage (verify) or differences (diff); 2 error.",
    )
    p.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("inspect", parents=[common], help="list tensors (dtype, shape, chunks, bytes)")
    s.add_argument("url")
    s.add_argument("--values", action="store_true", help="also print the saved plain values (tensor references left out)")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("verify", parents=[common], help="re-read every byte and check every checksum")
    s.add_argument("url")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("diff", parents=[common], help="compare two checkpoints tensor by tensor (streaming)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--b-storage-option", action="append", metavar="KEY=VALUE", help="fsspec option for B (default: same as A)")
    s.add_argument("--atol", type=float, default=0.0, help="treat float differences up to this as equal (default 0: bit-exact)")
    s.set_defaults(fn=cmd_diff)

    for name in ("export", "convert"):
        s = sub.add_parser(name, parents=[common, dst, sel],
                           help="to Hugging Face safetensors, one full file, or resharded" + (" (same as export)" if name == "convert" else ""))
        s.add_argument("src")
        s.add_argument("dst")
        s.add_argument("--to", choices=["safetensors", "full", "reshard"],
                       help="default: full if DST ends in .safetensors/.pt, reshard with --world-size, else an HF directory")
        s.add_argument("--dtype", help="cast floating-point tensors (bf16, fp16, fp32, float8_e4m3fn...)")
        s.add_argument("--max-shard-size", default="5GB", help="HF shard size, e.g. 5GB (decimal) or 2GiB (default 5GB)")
        s.add_argument("--prefix", default=None,
                       help="state prefix to strip for HF export (default: the model entry, 'model.' or the only one; "
                            "a prefix no tensor lies under is refused)")
        s.add_argument("--no-prefix", action="store_true", help="export every tensor under its full name")
        s.add_argument("--world-size", type=int, help="reshard for this many FSDP2 ranks")
        s.add_argument("--copy-from", metavar="DIR",
                       help="Hugging Face model directory whose config.json, generation_config.json and tokenizer files "
                            "are copied beside the weights, so from_pretrained(DST) works (read with --storage-option)")
        s.add_argument("--quantize", choices=["fp8-block"],
                       help="fp8-block: Linear weights as float8_e4m3fn + <name>_scale_inv per 128x128 block (DeepSeek-V3's "
                            "layout, for vLLM/SGLang/transformers); quantization_config merged into the --copy-from config.json")
        s.set_defaults(fn=cmd_export)

    s = sub.add_parser("reshard", parents=[common, dst], help="rewrite for N FSDP2 ranks, offline (one file per rank)")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--world-size", type=int, required=True)
    s.set_defaults(fn=cmd_reshard)

    s = sub.add_parser("gc", parents=[common],
                       help="remove files of a run root no committed step names (reference-safe; incremental runs)")
    s.add_argument("root")
    s.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    s.set_defaults(fn=cmd_gc)

    s = sub.add_parser("consolidate", parents=[common, dst],
                       help="write a standalone copy of a step (no references to other steps)")
    s.add_argument("src")
    s.add_argument("dst")
    s.set_defaults(fn=cmd_consolidate)

    s = sub.add_parser("import", parents=[common, dst, sel], help="from safetensors, DCP or torch.save to a native checkpoint")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--from", dest="kind", choices=["safetensors", "dcp", "torch"], help="default: detected")
    s.add_argument("--prefix", default=None,
                   help="dotted prefix for imported names (default: 'model.' for safetensors and bare state dicts; see docs/interop.md)")
    s.set_defaults(fn=cmd_import)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``shardckpt`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("shardckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # one line, no traceback: these are user-facing errors
        if os.environ.get("SHARDCKPT_TRACEBACK") == "1":
            raise
        msg = str(e).replace("\n", " ") or type(e).__name__
        if isinstance(e, CheckpointExistsError):
            # The library names its keyword; here the switch is a flag.
            msg = msg.replace("overwrite=True", "--overwrite")
        print(f"shardckpt: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
