"""A draft's checkpoints, in one place.

Layout: ``<checkpoint_dir>/<draft_folder(draft_id)>/v<version>`` (one folder per version) and a
``LATEST`` file naming the version a serving process loads at start. A version is a whole draft
(``drafts.build.save_draft``) or, for a draft that learns adapters, its adapters alone on a
fingerprinted base (``drafts.build.save_adapter``; ``speculative.adapters.base_fingerprint``). A
folder appears whole or not at all (``speculative.publish.publish_folder``: written beside, then
renamed), ``LATEST`` is replaced atomically, and the newest ``keep`` versions stay.

:class:`DraftCheckpoints` saves and loads them for :class:`learner.trainer.DraftTrainer`;
``learner.ops`` (``osd draft versions`` / ``rollback``) reads the same layout offline.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import quote

import torch
from transformers import PreTrainedModel

from drafts.build import ADAPTER_META, load_draft, read_adapter, save_adapter, save_draft
from speculative.adapters import adapter_state, base_fingerprint, has_adapters

log = logging.getLogger("learner.trainer")

LATEST = "LATEST"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def draft_folder(draft_id: str) -> str:
    """The name of a draft's checkpoint folder: its id, quoted so that any id is one folder name
    (a per-language draft's ``/``, or a ``..`` in an isolated tenant's name, cannot nest or escape
    it); ``@``, ``:`` and the characters of the router's ids (``c3-en``) stay as they are.
    :func:`urllib.parse.unquote` reads it back."""
    name = quote(draft_id, safe="@:")
    return name.replace(".", "%2E") if name in (".", "..") else name


def checkpoint_versions(root: Path | None) -> list[int]:
    """The versions checkpointed in one draft's folder (``<checkpoint_dir>/<draft_folder(draft_id)>``), ascending."""
    if root is None or not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def latest_checkpoint(root: Path | None) -> int | None:
    """The version that one draft's ``LATEST`` file names (None: no such file)."""
    if root is None or not (root / LATEST).exists():
        return None
    m = _VERSION_DIR.match((root / LATEST).read_text().strip())
    return int(m.group(1)) if m else None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def all_finite(tensors) -> bool:
    """Every value of every tensor finite (no NaN, no Inf)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class DraftCheckpoints:
    """The versions of draft ``draft_id`` in ``root``, the newest ``keep`` of them kept."""

    def __init__(self, root: Path, draft_id: str, keep: int):
        self.root, self.draft_id, self.keep = Path(root), draft_id, keep
        self._base: dict | None = None

    def versions(self) -> list[int]:
        return checkpoint_versions(self.root)

    def latest(self) -> int | None:
        return latest_checkpoint(self.root)

    def base(self, model: torch.nn.Module) -> dict:
        """What an adapter draft's versions sit on (checked when one is loaded): its base's
        fingerprint, computed once (a trainer's base never changes)."""
        if self._base is None:
            self._base = {"fingerprint": base_fingerprint(model)}
        return self._base

    def save(self, model: PreTrainedModel, version: int, keep_ids: torch.Tensor | None, meta: dict | None = None) -> None:
        """Write version ``version`` of ``model``, point ``LATEST`` at it, drop the oldest beyond ``keep``."""
        self.root.mkdir(parents=True, exist_ok=True)
        meta = {"draft_id": self.draft_id, "version": version, **(meta or {})}
        if has_adapters(model):  # the base never changes: a version is its adapters (MBs, not the draft's 100+)
            save_adapter(model, self.root / f"v{version}", self.base(model), meta, dtype=torch.float32)
        else:
            save_draft(model, self.root / f"v{version}", keep_ids, meta)
        write_atomic(self.root / LATEST, f"v{version}\n")
        for old in self.versions()[: -self.keep]:
            if old != version:
                shutil.rmtree(self.root / f"v{old}", ignore_errors=True)

    def load_into(self, model: PreTrainedModel, version: int, keep_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Load version ``version`` into ``model`` (its adapters alone when it learns adapters: the
        base is shared with the other domains and never loaded into); returns the keep ids it goes
        with. Raises, ``model`` untouched, when the version is missing, unreadable, of another shape
        or base, or holds a NaN/Inf weight."""
        path = self.root / f"v{version}"
        if not path.is_dir():
            raise FileNotFoundError(f"draft {self.draft_id!r}: no checkpoint v{version} in {self.root}")
        if (path / ADAPTER_META).is_file():  # adapters alone, saved on this same base
            if not has_adapters(model):
                raise ValueError("a checkpoint of adapters, but this draft learns whole")
            state, _meta = read_adapter(path, self.base(model))
            if set(state) != set(adapter_state(model)):
                raise ValueError("not a version of this adapter draft (its adapters differ)")
            if not all_finite(state.values()):
                raise ValueError("non-finite weights")
            model.load_state_dict(state, strict=False)
            return keep_ids
        saved, keep, _meta = load_draft(path)  # a whole draft (the only form before adapter checkpoints)
        if not all_finite(saved.parameters()):
            raise ValueError("non-finite weights")
        n_head = model.get_output_embeddings().weight.shape[0]
        if keep is not None and len(keep) != n_head:
            raise ValueError(f"keep_ids has {len(keep)} ids but the draft head has {n_head} rows")
        if has_adapters(model):
            learned = adapter_state(saved)
            if set(learned) != set(adapter_state(model)):
                raise ValueError("not a version of this adapter draft (its adapters differ, or it has none)")
            model.load_state_dict(learned, strict=False)
        else:
            model.load_state_dict(saved.state_dict(), strict=True)
        return keep

    def load_newest(self, model: PreTrainedModel, keep_ids: torch.Tensor | None
                    ) -> tuple[int | None, list[int], torch.Tensor | None]:
        """Load the newest version that reads back whole into ``model``: ``(the version to serve
        it as, None if none loaded; the versions skipped; its keep ids)``.

        A folder newer than ``LATEST`` is one whose ``LATEST`` update a crash cut off: it is loaded
        (and re-announced by the learner). A folder that does not load (truncated, corrupt,
        non-finite, another base) is moved aside to ``corrupt-v<N>`` with the reason logged, and the
        newest good weights are saved again under a version above every skipped one, so that a
        replica still holding a skipped version takes them. Leftovers of a save cut short are removed."""
        skipped: list[int] = []
        if not self.root.is_dir():
            return None, skipped, keep_ids
        for tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        for v in sorted(self.versions(), reverse=True):
            try:
                keep_ids = self.load_into(model, v, keep_ids)
            except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is not served
                aside = self.root / f"corrupt-v{v}-{int(time.time())}"
                log.error("draft %r: checkpoint v%d is unreadable (%s: %s); skipped, moved to %s",
                          self.draft_id, v, type(e).__name__, e, aside.name)
                os.replace(self.root / f"v{v}", aside)
                skipped.append(v)
                continue
            version = v
            if skipped:
                version = max(skipped) + 1
                self.save(model, version, keep_ids, {"recovered_from": v, "skipped": skipped})
                log.warning("draft %r: serving the weights of v%d again, as v%d", self.draft_id, v, version)
            elif self.latest() != v:
                write_atomic(self.root / LATEST, f"v{v}\n")
            log.info("draft %r: loaded checkpoint v%d", self.draft_id, v)
            return version, skipped, keep_ids
        return None, skipped, keep_ids
