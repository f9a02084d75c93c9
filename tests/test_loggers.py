"""Loggers of `train.loggers`: Weights & Biases offline and an MLflow file store receive the
config, every record (evaluations included) and the tables of samples; a logger whose
package is missing is one line naming the extra, before anything is written.

The wandb and mlflow tests run where their packages are installed (`pip install
-e '.[test]'` installs both) and are skipped otherwise."""

import glob
import importlib.util
import json
import os
import struct
import time

import pytest

from configs import grpo
from policyopt import loggers
from policyopt.metrics import MetricsWriter
from policyopt.rl.loop import trainer
from tests.rl.test_trainer import tiny

CONFIG = {"algo": {"method": "ppo", "clip_low": 0.2}, "seed": 3}
ROWS = [{"step": 2, "prompt": "1+1=", "completion": "2", "reward": 1.0, "tokens": [5, 6]}]


def test_unknown_logger_and_missing_package_are_one_line(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"config.train.loggers: unknown logger 'wandbb'"):
        grpo.get_config("train.loggers='jsonl,wandbb'")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a),
    )
    for name in ("wandb", "mlflow"):
        with pytest.raises(ValueError) as error:
            grpo.get_config(f"train.loggers='jsonl,{name}'")
        message = str(error.value)
        assert "\n" not in message and f"pip install 'policyopt[{name}]'" in message
    assert loggers.parse_loggers(" jsonl, tensorboard ,jsonl") == ("jsonl", "tensorboard")
    assert loggers.mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert loggers.mlflow_key("routing/volatility/layer_0") == "routing/volatility.layer_0"
    assert not os.listdir(tmp_path)


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))


def _wandb_records(workdir):
    """The protobuf records of the offline runs under ``workdir`` (W&B's ``.wandb`` file: a
    7-byte header, then LevelDB log blocks of 32 KiB holding records in fragments)."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb"))):
        with open(path, "rb") as f:
            data = f.read()
        assert data[:4] == b":W&B"
        at, pending = 7, b""
        while at + 7 <= len(data):
            left = 32768 - at % 32768
            _, length, kind = struct.unpack("<IHB", data[at : at + 7])
            if left < 7 or (kind == 0 and length == 0):  # the block's padding
                at += left
                continue
            piece, at = data[at + 7 : at + 7 + length], at + 7 + length
            pending += piece
            if kind in (1, 4):  # FULL, LAST
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
    return records


def _finished_records(workdir, runs: int = 1, timeout_s: float = 60.0):
    """``_wandb_records`` once ``runs`` runs have written their exit record (W&B's service
    process may still be writing the file when ``finish`` returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(workdir)
        exits = sum(record.WhichOneof("record_type") == "exit" for record in records)
        if exits >= runs or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_history(workdir) -> tuple[dict, list[dict]]:
    """(the run's config, its history rows) as JSON values."""
    config, rows = {}, []
    for record in _finished_records(workdir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})  # fmt: skip
    return config, rows


def test_wandb_offline_receives_config_records_and_tables(offline_wandb, tmp_path):
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    logger = loggers.WandbLogger(workdir, CONFIG)
    with MetricsWriter(workdir, tensorboard=False, resume_step=-1, loggers=[logger]) as writer:
        writer.write(1, {"reward/mean": 0.5, "eval/pass@1": 0.25})
        writer.write_text(2, "samples/train", ROWS)
    run_id = open(os.path.join(workdir, "wandb_run_id")).read().strip()
    config, rows = _wandb_history(workdir)
    assert config["algo"] == CONFIG["algo"] and config["seed"] == 3
    assert rows[0]["step"] == 1 and rows[0]["reward/mean"] == 0.5
    assert rows[0]["eval/pass@1"] == 0.25
    assert rows[1]["step"] == 2 and rows[1]["samples/train/nrows"] == 1
    run_files = os.path.join(workdir, "wandb", "offline-run-*", "files")
    (table,) = glob.glob(os.path.join(run_files, "media", "table", "**", "*.table.json"),
                         recursive=True)  # fmt: skip
    with open(table) as f:
        saved = json.load(f)
    assert saved["columns"] == ["prompt", "completion", "reward", "tokens"]
    assert saved["data"] == [["1+1=", "2", 1.0, "[5, 6]"]]
    # A resumed run continues the same W&B run.
    logger = loggers.WandbLogger(workdir, CONFIG)
    logger.write(3, {"reward/mean": 0.75})
    logger.close()
    assert open(os.path.join(workdir, "wandb_run_id")).read().strip() == run_id
    records = _finished_records(workdir, runs=2)
    assert {r.run.run_id for r in records if r.HasField("run")} == {run_id}


def _mlflow_run(workdir):
    from mlflow import MlflowClient

    client = MlflowClient("file:" + os.path.join(workdir, "mlruns"))
    with open(os.path.join(workdir, "mlflow_run_id")) as f:
        return client, client.get_run(f.read().strip())


def test_mlflow_file_store_receives_config_records_and_tables(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    logger = loggers.MlflowLogger(workdir, CONFIG)
    with MetricsWriter(workdir, tensorboard=False, resume_step=-1, loggers=[logger]) as writer:
        writer.write(1, {"reward/mean": 0.5, "eval/pass@1": 0.25})
        writer.write(2, {"reward/mean": 0.75})
        writer.write_text(2, "samples/train", ROWS)
    logger = loggers.MlflowLogger(workdir, CONFIG)  # a resumed run
    with MetricsWriter(workdir, tensorboard=False, resume_step=2, loggers=[logger]) as writer:
        writer.write(3, {"reward/mean": 1.0})
    client, run = _mlflow_run(workdir)
    assert run.data.params == {"algo.method": "ppo", "algo.clip_low": "0.2", "seed": "3"}
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert run.data.metrics["eval/pass_at_1"] == 0.25
    path = client.download_artifacts(
        run.info.run_id, "samples/train/step_000002.json", str(tmp_path)
    )
    with open(path) as f:
        assert json.load(f) == {
            "step": 2,
            "rows": [{**ROWS[0], "tokens": "[5, 6]"}],
        }


def test_rl_run_sends_config_samples_and_evaluations_to_each_logger(
    offline_wandb, monkeypatch, tmp_path
):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = tiny("grpo", extra="train.sample_every=1")
    with config.unlocked():
        config.train.loggers = "jsonl,wandb,mlflow"
    workdir = str(tmp_path / "grpo")
    trainer.run_rl(config, workdir, quiet=True)
    saved, rows = _wandb_history(workdir)
    assert saved["algo"]["method"] == "ppo" and saved["train"]["loggers"] == "jsonl,wandb,mlflow"
    assert [row["step"] for row in rows if "eval/pass@1" in row] == [0, 2]
    assert {row["step"] for row in rows if "samples/train/nrows" in row} == {1, 2}
    assert any("reward/mean" in row for row in rows)
    client, run = _mlflow_run(workdir)
    assert run.data.params["algo.method"] == "ppo"
    evals = client.get_metric_history(run.info.run_id, "eval/pass_at_1")
    assert [m.step for m in evals] == [0, 2]
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "samples/train")]
    assert tables == ["samples/train/step_000001.json", "samples/train/step_000002.json"]
