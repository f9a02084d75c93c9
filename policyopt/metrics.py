"""Run metrics: one JSON line per step, TensorBoard event files, a console progress line.

A metrics record is a flat dict of scalars (``STYLE.md`` convention 2). ``MetricsWriter``
sends each record to every sink at once (and to the trackers of ``policyopt.loggers``:
Weights & Biases, MLflow); ``read_jsonl`` reads a run back for plots and tests. Nothing
here touches JAX arrays beyond converting them to Python floats once per logged step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Iterable, Mapping, Sequence, TextIO

import numpy as np

#: Keys shown on the console progress line, in this order, when present.
CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "acc"),
    ("eval/pass@1", "pass@1"),
    ("response/length_mean", "len"),
    ("loss/clip_frac", "clip"),
    ("loss/gate_mean", "gate"),
    ("routing/volatility", "vol"),
    ("update/skipped", "skip"),
    ("time/iteration_s", "s/it"),
)


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Converts a dict of scalar arrays / numbers to Python floats (one host transfer).

    Raises:
      ValueError: naming the key of a value that is not a scalar.
    """
    out = {}
    for key, value in metrics.items():
        array = np.asarray(value)
        if array.size != 1:
            raise ValueError(f"metric {key!r} is not a scalar (shape {array.shape})")
        out[key] = float(array.reshape(()))
    return out


class MetricsWriter:
    """Writes metric records to ``<workdir>/metrics.jsonl`` and TensorBoard event files.

    Args:
      workdir: run directory (created if missing).
      filename: name of the JSONL file inside ``workdir``.
      tensorboard: also write TensorBoard events under ``<workdir>/tensorboard``.
      enabled: when False, ``write`` only converts the record and nothing is written (the
        processes other than 0 of a multi-process job, ``policyopt.sharding.is_primary``).
      resume_step: the step a run continues from. Records of the JSONL file with a later
        step (written after the checkpoint the run resumed from, so about to be written
        again) are removed, and TensorBoard purges its events after that step. A run
        that starts from scratch passes -1 (every old record goes); None keeps the file
        as it is and appends.
      loggers: further sinks (``policyopt.loggers.open_loggers``: Weights & Biases,
        MLflow), each given every record (``write``) and table (``write_text``) and closed
        with the writer. Their records after ``resume_step`` stay (those services keep
        what they received): a resumed run logs those steps again.
    """

    def __init__(
        self,
        workdir: str,
        *,
        filename: str = "metrics.jsonl",
        tensorboard: bool = True,
        enabled: bool = True,
        resume_step: int | None = None,
        loggers: Sequence = (),
    ):
        self.path = os.path.join(workdir, filename)
        self._file: TextIO | None = None
        self._tb = None
        self._loggers = list(loggers) if enabled else []
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: slow import

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=purge)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Logs one record at ``step``; returns it as Python floats."""
        scalars = to_scalars(metrics)
        if self._file is None:
            return scalars
        record = {
            "step": int(step),
            **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()},
        }
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb_scalars(int(step), scalars)
        for logger in self._loggers:
            logger.write(int(step), scalars)
        return scalars

    def _tb_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        r"""One TensorBoard summary per record, each tag the metric's own name
        (``eval/pass@1`` stays ``eval/pass@1``: ``SummaryWriter.add_scalar`` would rewrite
        characters outside ``[-/\w.]`` to ``_``, which TensorBoard itself does not need)."""
        from tensorboardX.proto.summary_pb2 import Summary  # imported lazily: slow import

        values = [Summary.Value(tag=key, simple_value=value) for key, value in scalars.items()]
        self._tb._get_file_writer().add_summary(Summary(value=values), global_step=step)

    def write_rows(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Appends JSON records (any JSON values, e.g. sampled completions) at ``step``."""
        if self._file is None:
            return
        for row in rows:
            self._file.write(json.dumps({"step": int(step), **row}, ensure_ascii=False) + "\n")
        self._file.flush()

    def write_text(self, step: int, tag: str, rows: list[Mapping[str, Any]]) -> None:
        """``rows`` as a Markdown table in TensorBoard's text tab, and as a table to each of
        ``loggers`` (nothing without either)."""
        if not rows:
            return
        for logger in self._loggers:
            logger.write_table(int(step), tag, rows)
        if self._tb is None:
            return
        keys = [key for key in rows[0] if key != "step"]
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", "<br>")
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(cell(row.get(key, "")) for key in keys) + " |" for row in rows]
        self._tb.add_text(tag, "\n".join(lines), global_step=int(step))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        loggers, self._loggers = self._loggers, []
        for logger in loggers:
            logger.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_jsonl(path: str, max_step: int) -> int:
    """Keeps the records of a metrics JSONL file with ``step <= max_step`` (and lines that
    are not JSON records, e.g. a last line cut short by a crash, go too); returns how many
    records were removed. The file is replaced atomically."""
    kept, removed, unterminated = [], 0, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            unterminated = not line.endswith("\n")
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                removed += bool(line.strip())
                continue
            if step <= max_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                removed += 1
    if removed or unterminated:  # (a kept last line without its newline would join the next)
        temporary = path + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, path)
    return removed


def read_jsonl(path: str) -> list[dict[str, float]]:
    """Reads a metrics JSONL file back (non-finite values written as strings become floats)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: not a JSON line ({e})") from e
            records.append({k: float(v) for k, v in record.items()})
    return records


def read_step_record(path: str, step: int, *, prefix: str = "") -> dict[str, float] | None:
    """The last record of a metrics JSONL file at ``step`` that has a key starting with
    ``prefix`` (e.g. ``"eval/"``), without its ``step``; None when there is none or no
    file. Lines that are not JSON records (a last line cut short by a crash) are skipped:
    a resumed run reads what an earlier run logged at its checkpoint's step (its
    evaluation) before deciding whether to do it again."""
    found = None
    for record in _records(path):
        try:
            at = int(record.pop("step"))
            if at == step and any(key.startswith(prefix) for key in record):
                found = {key: float(value) for key, value in record.items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return found


def read_last_value(path: str, key: str) -> tuple[int, float] | None:
    """``(step, value)`` of the last record of a metrics JSONL file holding ``key``; None
    when there is none or no file (lines that are not JSON records are skipped)."""
    found = None
    for record in _records(path):
        try:
            if key in record:
                found = (int(record["step"]), float(record[key]))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return found


def _records(path: str):
    """The JSON objects of a JSONL file, one per line; lines that are not (a last line cut
    short by a crash) are skipped, and a missing file has none."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    yield record
    except FileNotFoundError:
        return


def console_line(
    step: int,
    total: int,
    metrics: Mapping[str, float],
    keys: Iterable[tuple[str, str]] = CONSOLE_KEYS,
) -> str:
    """Formats one progress line: ``[ 12/100] reward 0.41 acc 0.40 ... s/it 1.9``."""
    width = len(str(total))
    parts = [f"[{step:>{width}}/{total}]"]
    for key, label in keys:
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.3g}")
    return " ".join(parts)


class Progress:
    """Prints a progress line per logged step, with the elapsed time and an ETA.

    The ETA is measured from steps that compiled nothing: the time up to the first logged
    step (which holds the compilation of every jitted step, 10-100x a later step on a
    small model) is left out, and so is every later stretch between two logged steps in
    which XLA compiled (``compiles``, default ``policyopt.runtime.compile_count``: a new
    evaluation bucket, a phase with other shapes). The first line has no ETA; later ones
    extrapolate the mean time per step of the stretches kept."""

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        start_step: int = 0,
        keys: Iterable[tuple[str, str]] = CONSOLE_KEYS,
        clock=time.perf_counter,
        compiles=None,
    ):
        if compiles is None:
            from policyopt.runtime import compile_count as compiles
        self.total = total
        self.keys = tuple(keys)
        self.stream = stream or sys.stdout
        self._clock = clock
        self._compiles = compiles
        self._start_time = clock()
        self._start_step = start_step
        compiles()  # starts counting
        # (step, time, compilations) of the last logged step; None before the first.
        self._mark: tuple[int, float, int] | None = None
        self._steady_steps, self._steady_seconds = 0, 0.0

    def start_steady(self, step: int) -> None:
        """Marks ``step`` as done with compilation (the ETA counts from here on); the
        first logged step otherwise."""
        if self._mark is None:
            self._mark = (step, self._clock(), self._compiles())

    def _advance(self, step: int, now: float) -> None:
        """Ends the stretch since the last logged step; kept when nothing compiled."""
        count = self._compiles()
        if self._mark is not None:
            last_step, last_time, last_count = self._mark
            if count == last_count and step > last_step:
                self._steady_steps += step - last_step
                self._steady_seconds += now - last_time
        self._mark = (step, now, count)

    def eta(self, step: int) -> float | None:
        """Seconds left at the mean time of the steps that compiled nothing; None before
        there is one."""
        if not self._steady_steps:
            return None
        rate = self._steady_seconds / self._steady_steps
        return rate * max(self.total - step, 0)

    def update(self, step: int, metrics: Mapping[str, float], *, suffix: str = "") -> str:
        now = self._clock()
        elapsed = now - self._start_time
        self._advance(step, now)
        eta = self.eta(step)
        if eta is None and step >= self.total:
            eta = 0.0
        eta_text = "eta after compile" if eta is None else f"eta {eta:.0f}s"
        line = console_line(step, self.total, metrics, self.keys) + (f" {suffix}" if suffix else "")
        line += f" | {elapsed:.0f}s {eta_text}"
        print(line, file=self.stream, flush=True)
        return line


def quiet_library_logging() -> None:
    """absl logging at WARNING unless ``--verbosity`` was given on the command line:
    orbax logs every checkpoint step at INFO, which buries the progress lines.
    Call from an ``app.run`` main."""
    from absl import flags, logging

    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
