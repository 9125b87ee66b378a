"""Operator commands on the learner's checkpoints: ``osd draft versions`` and ``osd draft rollback``.

The learner writes ``<checkpoint_dir>/<draft_id>/v<N>`` (a saved draft, or a draft's adapters alone)
and a ``LATEST`` file per draft (:class:`learner.trainer.DraftTrainer`); a serving process loads
``LATEST`` at start. A rollback re-publishes the weights of an earlier version under a NEW version
number, so versions stay monotonic for the serving side and the replay records, and the next start
serves them: a copy of the folder (its meta saying what it rolled back from), no model loaded.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote

from drafts.build import ADAPTER_META, DRAFT_META, read_meta
from learner.checkpoints import LATEST, checkpoint_versions, draft_folder, latest_checkpoint, write_atomic
from speculative.publish import publish_folder

__all__ = ["versions", "rollback", "main"]


def versions(checkpoint_dir: str | Path, draft_id: str | None = None) -> dict[str, dict]:
    """Per draft: its checkpointed versions (with their metadata) and the one ``LATEST`` names."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {root}")
    out = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (draft_id is None or p.name == draft_folder(draft_id))):
        latest = latest_checkpoint(d)
        out[unquote(d.name)] = {
            "latest": None if latest is None else f"v{latest}",
            "versions": {v: read_meta(d / f"v{v}") for v in checkpoint_versions(d) if _meta_file(d / f"v{v}") is not None},
        }
    if draft_id is not None and draft_id not in out:
        raise FileNotFoundError(f"no checkpoints of draft {draft_id!r} in {root}")
    return out


def _meta_file(folder: Path) -> Path | None:
    """A checkpoint's meta file: a whole draft's or an adapter's (None: not a checkpoint)."""
    return next((folder / name for name in (DRAFT_META, ADAPTER_META) if (folder / name).is_file()), None)


def rollback(checkpoint_dir: str | Path, draft_id: str, version: int) -> int:
    """Publish the weights of ``version`` as a new version; returns the new version number."""
    root = Path(checkpoint_dir) / draft_folder(draft_id)
    src = root / f"v{version}"
    meta_file = _meta_file(src) if src.is_dir() else None
    if meta_file is None:
        raise FileNotFoundError(f"draft {draft_id!r}: no checkpoint v{version} in {root}")
    new = max([version, *checkpoint_versions(root), latest_checkpoint(root) or 0]) + 1

    def write(tmp: Path) -> None:
        for f in src.iterdir():
            shutil.copy2(f, tmp / f.name)
        info = json.loads(meta_file.read_text())
        info["meta"] = {**info.get("meta", {}), "version": new, "rolled_back_from": version}
        (tmp / meta_file.name).write_text(json.dumps(info))

    publish_folder(root / f"v{new}", write, complete=lambda p: _meta_file(p) is not None, replace=True)
    write_atomic(root / LATEST, f"v{new}\n")
    return new


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osd draft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("versions", help="list the checkpointed versions of each draft")
    v.add_argument("--checkpoint-dir", required=True)
    v.add_argument("--draft", default=None)
    r = sub.add_parser("rollback", help="serve the weights of an earlier version again (as a new version)")
    r.add_argument("--checkpoint-dir", required=True)
    r.add_argument("--draft", required=True)
    r.add_argument("--version", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "versions":
        for d, info in versions(a.checkpoint_dir, a.draft).items():
            print(f"{d}: LATEST = {info['latest']}")
            for n, meta in info["versions"].items():
                extra = ", ".join(f"{k}={meta[k]}" for k in ("rolled_back_from",) if k in meta)
                print(f"  v{n}" + (f" ({extra})" if extra else ""))
        return 0
    new = rollback(a.checkpoint_dir, a.draft, a.version)
    print(f"{a.draft}: the weights of v{a.version} are published as v{new} (LATEST)")
    return 0
