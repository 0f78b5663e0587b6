"""The command-line pieces every lab shares: argparse types that refuse bad values with the flag's
allowed range (`positive_int`, `between`, `parse_size`), a folder's check (`unwritable`), the
model-size flags and their check (`model_flags`, `check_heads`), and `run_and_report`, a lab's
main inside a rank.
"""
from __future__ import annotations

import argparse
import errno
import os
import tempfile

from labkit.runtime import dist


def positive_int(text: str) -> int:
    if not str(text).isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def unwritable(folder, create: bool = True) -> str | None:
    """Why a lab cannot write files in `folder` (made first if `create`), or None. It writes and
    removes a probe file: os.access passes root on /proc and /sys, where nothing can be made."""
    folder = os.fspath(folder) or "."
    if os.path.exists(folder) and not os.path.isdir(folder):
        return f"{folder!r} is a file, not a folder"
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        elif not os.path.isdir(folder):
            return f"the folder {folder!r} does not exist"
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".labkit-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return f"{folder!r} is under a file, not a folder"
        return f"no file can be written in {folder!r} ({exc.strerror or exc})"
    return None


def model_flags(p: argparse.ArgumentParser, *, layers: int, hidden: int, heads: int,
                vocab: int = 1024, seq: int, batch: int = 2) -> None:
    """The size flags of a lab's transformers Llama (--layers --hidden --heads --kv-heads --vocab
    --seq --batch), with these defaults; check_heads validates them after parsing."""
    p.add_argument("--layers", type=positive_int, default=layers, help=f"blocks (default {layers})")
    p.add_argument("--hidden", type=positive_int, default=hidden,
                   help=f"hidden size (default {hidden})")
    p.add_argument("--heads", type=positive_int, default=heads,
                   help=f"attention heads (default {heads})")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="Llama key/value heads (default half the heads, or all when odd)")
    p.add_argument("--vocab", type=positive_int, default=vocab,
                   help=f"vocabulary (default {vocab})")
    p.add_argument("--seq", type=positive_int, default=seq,
                   help=f"tokens per sequence (default {seq})")
    p.add_argument("--batch", type=positive_int, default=batch,
                   help=f"sequences per rank (default {batch})")


def run_and_report(run, show, args, check=None) -> None:
    """A lab's main, inside a rank: set up, check(world_size) (refuse a world the part cannot
    lay out), result = run(args, ctx), show(result) on rank 0, report it, shut down."""
    ctx = dist.setup()
    if check is not None:
        check(ctx.world_size)
    result = run(args, ctx)
    if ctx.rank == 0:
        show(result)
    dist.report(**result)
    dist.shutdown()


def check_heads(p: argparse.ArgumentParser, args, kv: bool = True) -> None:
    """Refuse --heads that do not divide --hidden and (kv) --kv-heads that do not divide --heads;
    a missing --kv-heads becomes half the heads (all of them when odd), as debug-llama has."""
    if args.hidden % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --hidden {args.hidden}; allowed: "
                f"a divisor of {args.hidden}")
    if not kv:
        return
    if args.kv_heads is None:
        args.kv_heads = args.heads // 2 if args.heads % 2 == 0 else args.heads
    if args.heads % args.kv_heads:
        p.error(f"argument --kv-heads: {args.kv_heads} does not divide --heads {args.heads}; "
                f"allowed: a divisor of {args.heads}")


def between(low: float, high: float, what: str):
    """An argparse type: a number from low to high (nan and inf refused)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} from {low:g} to {high:g}")
        return value
    return parse


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}



def parse_size(text: str) -> int:
    """'1K' -> 1024, '16M' -> 16777216, '1G', '512': binary units as nccl-tests' -b/-e flags."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B") or "0"
    unit = t[-1] if t[-1] in _UNITS else ""
    number = t[:-1] if unit else t
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"size {text!r} is not a size; write bytes or a number with K, M or G "
                         "(binary: 1K = 1024), e.g. 64K or 16M") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be > 0 bytes")
    return int(value)
