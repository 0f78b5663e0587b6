"""Checkpoints of a sharded (FSDP2) model and its optimizer with torch.distributed.checkpoint.

    from labkit.parallel import checkpoint
    checkpoint.save(model, optimizer, step, "ckpt")          # every rank: ckpt/step_000040/
    found = checkpoint.latest("ckpt")                        # (40, "ckpt/step_000040") or None
    if found:
        step = checkpoint.load(model, optimizer, found[1])   # every rank; any world size

The directory layout, and why a crash mid-save is never resumed from: `save`. What resumes (the
model, the optimizer, the step; DCP reshards on load): `load`. A file damaged later: `damaged`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

from labkit.parallel import require_process_group

INFO = "labkit.json"
METADATA = ".metadata"                   # DCP's index, written after every rank's data
PARTIAL = ".partial"
_NAME = re.compile(r"^step_(\d{6,})$")


def step_dir(ckpt_dir, step: int) -> str:
    """Where the checkpoint of `step` lives: ckpt_dir/step_000040."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a whole number >= 0 (the optimizer steps done)")
    return os.path.join(os.fspath(ckpt_dir), f"step_{step:06d}")


def state_dict(model, optimizer, options=None) -> dict:
    """{"model": ..., "optim": ...}: `get_state_dict`'s two dicts, what `save` writes. Sharded
    (DTensors, each rank its shards) unless `options` (StateDictOptions) asks otherwise."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd}


def _barrier() -> None:
    import torch.distributed as dist
    if dist.get_world_size() > 1:
        dist.barrier()


def save(model, optimizer, step: int, ckpt_dir, extra: dict | None = None) -> str:
    """Save `model` (FSDP2 or plain) and `optimizer` as the checkpoint of `step`, on every rank
    (a collective); return its directory. Each rank writes its own shards; `extra` (a dict of
    JSON values) is stored beside them by rank 0.

    Layout: `ckpt_dir/step_XXXXXX/` holds DCP's files (one `__R_0.distcp` per rank that wrote,
    and `.metadata`, the index DCP writes last) and `labkit.json` (the step, the world size that
    saved it, `extra`, and the size and sha256 of every DCP file, for `damaged`). A directory
    is complete when it has that name: `save` writes into `step_XXXXXX.partial` and rank 0
    renames it only after every rank's data and the metadata are on disk (dcp.save returns on
    every rank only then) and labkit.json is written. A crash mid-save leaves a
    `.partial` directory, which `latest` never picks (and the next save of that step
    removes)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    require_process_group("checkpoint.save")
    final = step_dir(ckpt_dir, step)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra={extra!r} must be a dict of JSON values or None")
    info = {"step": step, "world_size": dist.get_world_size(), "extra": extra or {}}
    json.dumps(info)                            # refuse what JSON cannot hold before any work
    partial = final + PARTIAL
    rank0 = dist.get_rank() == 0
    if rank0:                                   # a save that crashed earlier left this
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    dcp.save(state_dict(model, optimizer), checkpoint_id=partial)
    if rank0:
        info["files"] = {name: _digest(os.path.join(partial, name))
                         for name in sorted(os.listdir(partial)) if name != INFO}
        with open(os.path.join(partial, INFO), "w", encoding="utf-8") as f:
            json.dump(info, f)
        if os.path.exists(final):               # a rerun saving the same step again
            shutil.rmtree(final)
        os.rename(partial, final)               # atomic: now, and only now, it is complete
    _barrier()
    return final


def complete(path) -> bool:
    """True if `path` is a finished checkpoint: its name, DCP's .metadata and labkit.json."""
    path = os.fspath(path)
    return (bool(_NAME.match(os.path.basename(path.rstrip(os.sep))))
            and os.path.isfile(os.path.join(path, METADATA))
            and os.path.isfile(os.path.join(path, INFO)))


def checkpoints(ckpt_dir) -> list[tuple[int, str]]:
    """[(step, path)] of the complete checkpoints in `ckpt_dir`, newest first ([] if none)."""
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(((int(m.group(1)), os.path.join(ckpt_dir, m.group(0)))
                   for m in map(_NAME.match, os.listdir(ckpt_dir))
                   if m and complete(os.path.join(ckpt_dir, m.group(0)))), reverse=True)


def latest(ckpt_dir) -> tuple[int, str] | None:
    """(step, path) of the newest complete checkpoint in `ckpt_dir`, or None if it has none
    (or does not exist). Partial directories of a crashed save are skipped."""
    return next(iter(checkpoints(ckpt_dir)), None)


def _digest(path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def damaged(path) -> str | None:
    """What is wrong with complete checkpoint `path` (a file missing, cut short or changed since
    `save` recorded its size and sha256), or None if nothing is. A checkpoint saved before
    labkit recorded them is only checked for labkit.json."""
    try:
        with open(os.path.join(path, INFO), encoding="utf-8") as f:
            files = {os.path.basename(name): (int(saved["bytes"]), str(saved["sha256"]))
                     for name, saved in json.load(f).get("files", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        return f"{INFO}: unreadable, {type(exc).__name__}"
    for name, (size, sha256) in files.items():
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name}: missing"
        now = _digest(os.path.join(path, name))
        if now["bytes"] != size:
            return f"{name}: {now['bytes']:,} B, saved {size:,} B"
        if now["sha256"] != sha256:
            return f"{name}: sha256 differs from the one saved"
    return None


def info(path) -> dict:
    """What labkit.json of checkpoint `path` says: step, world_size (that saved it), extra."""
    if not complete(path):
        raise FileNotFoundError(f"{os.fspath(path)!r} is not a complete checkpoint (a "
                                f"step_XXXXXX directory with {METADATA} and {INFO})")
    with open(os.path.join(path, INFO), encoding="utf-8") as f:
        return json.load(f)


def load(model, optimizer, path) -> int:
    """Load checkpoint `path` into `model` and `optimizer` on every rank (a collective) and
    return its step. The world size may differ from the one that saved it.

    What resumes: the model and optimizer state (`get_state_dict` / `set_state_dict`: each rank
    saves its shards, DCP reshards on load, so a checkpoint of 4 ranks loads on 2) and the
    step. The data of a step is a function of the step alone in the labs (a seed of the step),
    so the step is the whole data position; anything else a run needs goes into `extra`
    (JSON)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    require_process_group("checkpoint.load")
    meta = info(path)
    state = state_dict(model, optimizer)           # the shapes to load into: this rank's shards
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return meta["step"]
