"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and MLflow (``train.loggers``;
docs/runs.md "Loggers"). TensorBoard's event files are written by ``metrics.MetricsWriter``.

Each tracker receives the run's config once, every metrics record (training, evaluation)
and the tables of sampled completions. Their packages are optional extras
(``pip install 'policyopt[wandb]'``, ``'policyopt[mlflow]'``); ``check_loggers`` names the
missing one before a run writes anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import time
from typing import Any, Mapping, Sequence

# The names `train.loggers` accepts. metrics.jsonl is always written (runs resume from it);
# naming "jsonl" is allowed and changes nothing.
LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# Logger -> (the module it imports, the extra of setup.py that installs it).
_PACKAGES = {
    "tensorboard": ("tensorboardX", "policyopt"),
    "wandb": ("wandb", "policyopt[wandb]"),
    "mlflow": ("mlflow", "policyopt[mlflow]"),
}


def parse_loggers(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"jsonl,tensorboard"`` (or a sequence of names) -> ``("jsonl", "tensorboard")``.

    Raises:
      ValueError: naming ``config.train.loggers`` and the unknown name.
    """
    names = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(dict.fromkeys(name.strip() for name in names if name.strip()))
    for name in names:
        if name not in LOGGERS:
            raise ValueError(f"config.train.loggers: unknown logger {name!r} (choices: {LOGGERS})")
    return names


def check_loggers(value: str | Sequence[str]) -> tuple[str, ...]:
    """``parse_loggers``, and each logger's package importable.

    Raises:
      ValueError: naming the logger whose package is missing and the extra to install.
    """
    names = parse_loggers(value)
    for name in names:
        module, extra = _PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"config.train.loggers names {name!r}, but the {module!r} package is not "
                f"installed: pip install '{extra}'"
            )
    return names


def open_loggers(
    value: str | Sequence[str], workdir: str, config: Mapping[str, Any], *, kind: str = "rl"
) -> list:
    """The trackers of ``train.loggers`` other than jsonl and TensorBoard, each opened on
    ``workdir`` (a resumed run continues the tracker's run) with ``config`` logged.

    Args:
      value: ``config.train.loggers``.
      workdir: the run directory (its base name names the tracker's run).
      config: the resolved config as nested JSON values.
      kind: "rl" or "sft", a tag of the tracker's run.
    """
    loggers = []
    for name in check_loggers(value):
        if name == "wandb":
            loggers.append(WandbLogger(workdir, config, kind=kind))
        elif name == "mlflow":
            loggers.append(MlflowLogger(workdir, config, kind=kind))
    return loggers


def config_json(config) -> dict:
    """The run's config (a ConfigDict or the typed ``policyopt.config.RunConfig``) as nested
    JSON values (what the trackers record)."""
    if hasattr(config, "to_json_best_effort"):
        return json.loads(config.to_json_best_effort(sort_keys=True))
    return json.loads(config.to_json(sort_keys=True))


def _run_name(workdir: str) -> str:
    return os.path.basename(os.path.abspath(workdir)) or "run"


def _read_id(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write_id(path: str, run_id: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, anything else as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, ensure_ascii=False)


class WandbLogger:
    """A Weights & Biases run per run directory (``WANDB_MODE=offline`` writes it under
    ``workdir/wandb`` for ``wandb sync``). Its id is kept in ``workdir/wandb_run_id``, so a
    resumed run continues it. Records are logged against their ``step`` (the iteration, or
    the SFT update) as the x axis; the project is ``$WANDB_PROJECT`` or "policyopt"."""

    def __init__(self, workdir: str, config: Mapping[str, Any], *, kind: str = "rl"):
        import wandb

        self._wandb = wandb
        id_path = os.path.join(workdir, "wandb_run_id")
        run_id = _read_id(id_path) or secrets.token_hex(4)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "policyopt"),
            name=_run_name(workdir),
            dir=workdir,
            id=run_id,
            resume="allow",
            config=dict(config),
            job_type=kind,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        _write_id(id_path, run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log({"step": int(step), **scalars})

    def write_table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None:
        columns = [key for key in rows[0] if key != "step"]
        data = [[_cell(row.get(key)) for key in columns] for row in rows]
        self.run.log({"step": int(step), tag: self._wandb.Table(columns=columns, data=data)})

    def close(self) -> None:
        self.run.finish()


# MLflow's metric names: alphanumerics, "_", "-", ".", " ", ":" and "/".
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts and stores: ``eval/pass@1`` -> ``eval/pass_at_1``; a
    slash after the section's is a dot (``routing/volatility/layer_0`` ->
    ``routing/volatility.layer_0``: a file store keeps ``routing/volatility`` as a file)."""
    section, slash, rest = _MLFLOW_BAD.sub("_", name.replace("@", "_at_")).partition("/")
    return section + slash + rest.replace("/", ".")


class MlflowLogger:
    """An MLflow run per run directory, in ``$MLFLOW_TRACKING_URI`` or else a file store in
    ``workdir/mlruns`` (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
    workdir/mlruns``); the experiment
    is ``$MLFLOW_EXPERIMENT_NAME`` or "policyopt". The config's fields are the run's
    parameters, metric names are made MLflow's (``mlflow_key``), tables of samples are JSON
    artifacts (``<tag>/step_<N>.json``). Its id is kept in ``workdir/mlflow_run_id``, so a
    resumed run continues it."""

    def __init__(self, workdir: str, config: Mapping[str, Any], *, kind: str = "rl"):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + os.path.abspath(os.path.join(workdir, "mlruns"))
            # MLflow 3 keeps its filesystem backend in maintenance mode and refuses it unless
            # asked; a run directory's own store is what a run without a server wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "policyopt")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        id_path = os.path.join(workdir, "mlflow_run_id")
        self.run_id = _read_id(id_path)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return  # its parameters are logged (MLflow refuses to change them)
        run = self.client.create_run(
            experiment_id, run_name=_run_name(workdir), tags={"policyopt.kind": kind}
        )
        self.run_id = run.info.run_id
        _write_id(id_path, self.run_id)
        params = [
            Param(mlflow_key(key), str(value)[:MAX_PARAM_VAL_LENGTH])
            for key, value in _flatten(config).items()
        ]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(
                self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            )

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in scalars.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(
                self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH]
            )

    def write_table(self, step: int, tag: str, rows: Sequence[Mapping[str, Any]]) -> None:
        rows = [{key: _cell(value) for key, value in row.items()} for row in rows]
        self.client.log_dict(self.run_id, {"step": int(step), "rows": rows}, _artifact(tag, step))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _artifact(tag: str, step: int) -> str:
    """``samples/train`` at step 3 -> ``samples/train/step_000003.json``."""
    folder = "/".join(re.sub(r"[^\w.-]+", "_", part) for part in tag.split("/"))
    return f"{folder}/step_{int(step):06d}.json"


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
