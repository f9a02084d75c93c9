"""A claim's finished runs kept in the repository (``docs/claims/runs/<claim>.jsonl``), one
JSON line per run, so that a sweep of many hours resumes on another machine and a verdict
can be judged again from a fresh clone (docs/claims.md, "Runs kept in the repository").

A record names its arm, SFT start and seed, the SFT start's identity (``start_id``: a
digest of the start's saved parameters), the run's config (``config_key``) and holds the
figures ``ablate.summarise_run`` read from its logs. A run matches a record only when all
of these agree: a start trained again to other bits (another CPU, another JAX), or an arm
whose recipe changed, trains anew and is recorded beside the old record.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Collection

from policyopt.checkpoint import Checkpointer
from policyopt.rl.loop.build import RESUME_FREE_FIELDS

#: In an SFT cache directory restored from the repository (``experiments.starts``).
KEPT_MARKER = "kept_start.json"
LEDGER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "claims", "runs")

# Resume-free fields that still change what a record reports: the budget, the
# evaluation that gives pass@1, the routing metrics a premise reads, the asynchronous
# generator's rows (fewer than n_async: another staleness).
_KEPT = ("train.num_iterations", "train.routing_metrics", "eval.", "async_mode.num_slots")


def ledger_path(claim_directory: str) -> str:
    """The ledger of the claim whose runs go to ``claim_directory`` (``claim_dir``):
    ``docs/claims/runs/<its name>.jsonl``."""
    return os.path.join(LEDGER_DIR, os.path.basename(os.path.normpath(claim_directory)) + ".jsonl")


def _free(field: str) -> bool:
    if any(field == k or (k.endswith(".") and field.startswith(k)) for k in _KEPT):
        return False
    return any(field == k or (k.endswith(".") and field.startswith(k)) for k in RESUME_FREE_FIELDS)


#: Config fields added after runs were first recorded, with the value every earlier run
#: had: left out of the digest at that value, so that a new field whose default changes
#: nothing keeps the recorded runs found (tests/experiments/test_ledger.py checks the
#: repository's records against the current configs).
LATER_FIELDS = {"critic.init_checkpoint": None}


def config_key(record: dict) -> str:
    """A digest of what a run trains and measures: its resolved config (``record``, flat:
    ``build.resolved_record``) without the fields a resumed run may change
    (``RESUME_FREE_FIELDS``: layout, cadence, the start's path) and the ``LATER_FIELDS``
    at their earlier value, keeping the budget, the evaluation and the routing metrics.
    A critic of its own (``critic.init_checkpoint``) counts by its checkpoint's
    ``start_id``, not its path: the same record on any machine that holds those bits."""
    kept = {
        k: v
        for k, v in sorted(record.items())
        if not _free(k) and not (k in LATER_FIELDS and v == LATER_FIELDS[k])
    }
    source = kept.get("critic.init_checkpoint")
    if source:
        if not os.path.isdir(source):  # a Checkpointer would create it
            raise FileNotFoundError(f"critic.init_checkpoint={source!r} is not a directory")
        kept["critic.init_checkpoint"] = f"start {start_id(source)}"
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def start_id(checkpoint_dir: str) -> str:
    """The identity of an SFT start: its latest step and a digest of the checksums saved
    with that checkpoint's parameters (bit for bit; nothing is read but the checksums).
    The optimiser state is left out: RL starts from the parameters alone, and a start kept
    in the repository (``experiments.starts``) holds nothing else."""
    checkpointer = Checkpointer(checkpoint_dir)
    try:
        step = checkpointer.latest_step()
        sums = checkpointer.checksums(step)
    finally:
        checkpointer.close()
    if not sums:
        raise ValueError(
            f"{checkpoint_dir}: its checkpoint carries no checksums (saved before they were "
            "kept), so its runs cannot be recorded; train the start again"
        )
    params = {k: v for k, v in sums.items() if k.startswith("train/params/")}
    if not params:
        raise ValueError(f"{checkpoint_dir}: its checkpoint holds no parameters (train/params)")
    return _digest(step, params)


def _digest(step: int, sums: dict[str, int]) -> str:
    text = json.dumps(sums, sort_keys=True, separators=(",", ":"))
    return f"{step}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def legacy_start_id(checkpoint_dir: str) -> str | None:
    """The identity ``start_id`` gave this start before it left out the optimiser state
    (8d752f2: records and run directories written before name the start so): a digest
    of all the checksums of its latest checkpoint. For a start restored from the
    repository (``experiments.starts``: no optimiser state) it is the one saved where the
    start was kept (its ``KEPT_MARKER``). None where unknown or the same as ``start_id``'s
    (a checkpoint of parameters only)."""
    checkpointer = Checkpointer(checkpoint_dir)
    try:
        step = checkpointer.latest_step()
        sums = checkpointer.checksums(step) or {}
    finally:
        checkpointer.close()
    if all(k.startswith("train/params/") for k in sums):
        try:
            with open(os.path.join(os.path.dirname(checkpoint_dir), KEPT_MARKER)) as f:
                return json.load(f).get("legacy_id")
        except (OSError, ValueError, AttributeError):
            return None
    return _digest(step, sums)


class Ledger:
    """The records of one claim's ledger file (read once; ``add`` appends a line)."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []
        # {(start, identity): the identities its records named before (``alias``)}
        self.aliases: dict[tuple[int, str], set[str]] = {}
        if os.path.exists(path):
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        self._key(record)
                        for field in ("regime", "figures"):  # what a judged run reads
                            if not isinstance(record[field], dict):
                                raise TypeError(f"{field} is not an object")
                    except (json.JSONDecodeError, KeyError, TypeError) as error:
                        raise ValueError(
                            f"{path}:{number} is not a run record ({error}); fix or remove "
                            "that line"
                        ) from None
                    self.records.append(record)

    @staticmethod
    def _key(record: dict) -> tuple:
        return (
            record["arm"],
            int(record["start"]),
            int(record["seed"]),
            record["start_id"],
            record["config"],
        )

    def alias(self, start: int, legacy: str | None, identity: str) -> None:
        """Reads the records of SFT start ``start`` that name it ``legacy`` (as
        ``start_id`` did before, ``legacy_start_id``) as records of ``identity``, in
        memory (the file keeps them as written); records of other starts stay theirs."""
        if not legacy or legacy == identity:
            return
        self.aliases.setdefault((start, identity), set()).add(legacy)
        for record in self.records:
            if int(record["start"]) == start and record["start_id"] == legacy:
                record["start_id"] = identity

    def find(self, arm: str, start: int, seed: int, start_id: str, config: str) -> dict | None:
        """The record of that run, or None."""
        key = (arm, start, seed, start_id, config)
        return next((r for r in self.records if self._key(r) == key), None)

    def start_ids(self, start: int, configs: Collection[str] | None = None) -> list[str]:
        """The identities of SFT start ``start`` that the records (of a config in
        ``configs``, default any) name, first seen first."""
        ids = [
            r["start_id"]
            for r in self.records
            if int(r["start"]) == start and (configs is None or r["config"] in configs)
        ]
        return list(dict.fromkeys(ids))

    def add(
        self, arm: str, start: int, seed: int, start_id: str, config: str, run: dict[str, Any]
    ) -> dict:
        """Appends the record of a finished run (``run``: ``ablate.run_ablation``'s entry:
        regime, wall and CPU seconds, ``summarise_run``'s figures); one already recorded is
        returned as it is."""
        found = self.find(arm, start, seed, start_id, config)
        if found is not None:
            return found
        skip = ("start", "seed", "run_dir", "regime", "wall_s", "cpu_s")
        record = {
            "arm": arm,
            "start": start,
            "seed": seed,
            "start_id": start_id,
            "config": config,
            "regime": run["regime"],
            "wall_s": run.get("wall_s"),
            "cpu_s": run.get("cpu_s"),
            "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "figures": {k: v for k, v in run.items() if k not in skip},
        }
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        # One line per write: two sweeps of one claim (different arms) may append at once.
        # After a line cut off (a process killed mid-write), a line of its own.
        with open(self.path, "ab+") as f:  # appended at the end whatever the position
            cut = False
            if f.seek(0, os.SEEK_END):
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
            f.write((("\n" if cut else "") + line).encode())
        self.records.append(record)
        return record

    @staticmethod
    def run_of(record: dict) -> dict:
        """``run_ablation``'s entry for a recorded run (no run directory on this machine)."""
        return {
            "start": int(record["start"]),
            "seed": int(record["seed"]),
            "run_dir": None,
            "wall_s": record.get("wall_s"),
            "cpu_s": record.get("cpu_s"),
            "regime": record["regime"],
            **record["figures"],
            "recorded": record.get("recorded"),
        }
