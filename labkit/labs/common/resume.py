"""Resuming the FSDP2 language model of fsdp_lm from the newest intact checkpoint of a folder:
shared by the crash lab (labkit.labs.checkpoint, --resume) and the elastic lab, which resumes on
every start. Checkpoints are labkit.parallel.checkpoint's (DCP, with sizes and sha256s).
"""
from __future__ import annotations

from labkit.labs.common.fsdp_lm import CONFIG
from labkit.parallel import checkpoint


def config(args) -> dict:
    return {k: getattr(args, k) for k in CONFIG}


class LoadError(RuntimeError):
    """A checkpoint that passed the checks and still cannot be loaded (one line for the learner)."""


def intact(ckpt_dir) -> tuple[tuple[int, str] | None, list[tuple[int, str]]]:
    """((step, path) of the newest intact checkpoint or None, [(step, what is wrong)] of the
    damaged ones newer than it), by the sizes and sha256 recorded at save time."""
    skipped = []
    for step, path in checkpoint.checkpoints(ckpt_dir):
        why = checkpoint.damaged(path)
        if why is None:
            return (step, path), skipped
        skipped.append((step, why))
    return None, skipped


def other_flags(path, args) -> str:
    """'hidden: saved 64, now 128' for each flag the run that saved `path` had otherwise."""
    saved = checkpoint.info(path)["extra"].get("config", {})
    return ", ".join(f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in config(args).items()
                     if saved.get(k) != v)


def resume(args, model, opt, flag: str = "--resume") -> tuple[int, list]:
    """(step, losses) of the newest intact checkpoint, loaded into model and opt (`flag`: the
    lab's flag that asked for it, named in the errors)."""
    found = getattr(args, "resume_from", None) or intact(args.ckpt_dir)[0]
    if found is None:          # parse_args checked it, but a rank may race a deletion
        raise FileNotFoundError(f"{flag}: no intact checkpoint in {args.ckpt_dir!r}")
    if other_flags(found[1], args):
        raise ValueError(f"{flag}: the checkpoint {found[1]!r} was saved by a run with other "
                         f"flags ({other_flags(found[1], args)}); "
                         "allowed: the same flags (the world size may differ)")
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    try:
        step = checkpoint.load(model, opt, found[1])
    except (Exception, CheckpointException) as exc:   # saved without sha256s, or damaged since
        raise LoadError(f"{flag}: the checkpoint {found[1]!r} cannot be loaded ("
                        f"{type(exc).__name__}): it is damaged; move it out of --ckpt-dir to "
                        "resume from an older one") from exc
    return step, [list(x) for x in checkpoint.info(found[1])["extra"]["losses"]]
