"""Run directories on an object store: a real S3-compatible server (moto's, on 127.0.0.1) started by the
test holds a multi-host run that loses a host and resumes, a Tune study that is interrupted and
resumed, and every file of a run directory; bad URIs are one line before anything compiles."""

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid

import pytest
from ray import tune

from podray import cli, storage
from podray import config as config_lib
from podray.cluster import train_on_ray
from podray.metrics import JsonlSink, read_jsonl, truncate_jsonl
from podray.training import load_run_config, read_summary

BUCKET = "podray-test"


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server on a free loopback port with one bucket; the AWS_* variables point this
    process at it (the Ray layer passes them on to host workers and trials). Yields s3://BUCKET."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "podray",
        "AWS_SECRET_ACCESS_KEY": "podray-secret",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in storage.STORAGE_ENV}
    for k in storage.STORAGE_ENV:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _unique(s3: str, name: str) -> str:
    return f"{s3}/{name}-{uuid.uuid4().hex[:8]}"


def test_metrics_files_on_the_store_are_rewritten_whole_and_truncated_on_resume(s3):
    path = storage.run_path(_unique(s3, "jsonl")) / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2, 3):
        sink.write(step, {"mean_return": float(step)})
        assert [r["step"] for r in read_jsonl(path)] == list(range(1, step + 1))  # every row, at once
    sink.close()
    truncate_jsonl(path, 2)
    again = JsonlSink(path)  # a resumed run continues after the rows it keeps
    again.write(3, {"mean_return": 30.0})
    assert [(r["step"], r["mean_return"]) for r in read_jsonl(path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_save_cut_short_on_the_store_is_never_listed_and_is_written_again(s3):
    import jax.numpy as jnp

    from podray.checkpoint import Checkpointer

    directory = f"{_unique(s3, 'ckpt')}/checkpoints"
    checkpointer = Checkpointer(directory)
    checkpointer.save(4, {"w": jnp.arange(4.0)}, {"updates": 4})
    checkpointer.close()
    partial = storage.run_path(directory) / "8" / "state"  # a host died while writing step 8
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "manifest.ocdbt").write_text("cut short")
    checkpointer = Checkpointer(directory)
    assert checkpointer.latest_step() == 4 and storage.step_dirs(directory) == [4]
    assert checkpointer.restore({"w": jnp.zeros(4)})[1] == {"updates": 4}
    checkpointer.save(8, {"w": jnp.arange(4.0) * 2}, {"updates": 8})  # the resumed run reaches step 8
    assert storage.step_dirs(directory) == [4, 8]
    state, meta = checkpointer.restore({"w": jnp.zeros(4)})
    assert meta == {"updates": 8} and state["w"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_bad_object_store_run_dirs_are_one_line_before_compiling(s3, capsys, monkeypatch, compile_counter):
    assert cli.main(["train", "--in-process", "--run-dir", "s3://no-such-bucket-podray/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--run-dir s3://no-such-bucket-podray/run: bucket no-such-bucket-podray" in err
    assert cli.main(["train", "--resume", f"{s3}/never-ran"]) == 2
    assert "no config.yaml there" in capsys.readouterr().err
    real = storage.importlib.util.find_spec
    monkeypatch.setattr(storage.importlib.util, "find_spec", lambda n: None if n == "gcsfs" else real(n))
    assert cli.main(["train", "--in-process", "--run-dir", "gs://bucket/run"]) == 2
    err = capsys.readouterr().err
    assert "gs://bucket/run: gs:// needs the gcsfs package" in err and "pip install 'podray[gcs]'" in err
    assert cli.main(["tune", "tune_configs/anakin_cartpole_batch_depth.yaml", "--storage", "ftp://x/y"]) == 2
    assert "unknown storage scheme 'ftp://'" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    assert cli.main(["train", "--in-process", "--run-dir", f"{s3}/run"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach bucket {BUCKET} (EndpointConnectionError" in err and err.count("\n") == 1
    assert compile_counter == []


@pytest.mark.slow
def test_multi_host_run_on_s3_loses_a_host_resumes_and_the_driver_reads_the_summary(s3, ray_cluster):
    """Two host workers (2 fake devices each) write checkpoints, logs and TensorBoard events to s3://;
    host 1 is killed after a checkpoint; the group restarts from s3 and finishes; the driver reads
    run_log.jsonl, metrics.jsonl and summary.json back from the store; `podray train --resume` of the
    URI extends the run."""
    upc = 4
    config = config_lib.load(
        None,
        [
            "env.num_envs=8",
            "anakin.rollout_length=16",
            f"anakin.updates_per_call={upc}",
            f"total_env_steps={8 * 16 * upc * 4}",  # 4 calls
            f"run.checkpoint_every={upc}",
            "run.hosts=2",
            "run.cpu_devices=2",
            "run.progress=false",
            "run.max_restarts=1",
            "network.width=16",
        ],
    )
    uri = _unique(s3, "pod")
    run_dir = storage.run_path(uri)
    killed = []

    def kill_host_1_after_a_checkpoint(group):
        if killed:
            return  # the restarted group runs to the end

        def kill():
            while not storage.step_dirs(run_dir / "checkpoints"):
                time.sleep(0.1)
            os.kill(group.nodes[1]["pid"], signal.SIGKILL)

        killed.append(group.nodes[1]["pid"])
        threading.Thread(target=kill, daemon=True).start()

    (result,) = train_on_ray(config, run_dir=uri, on_group=kill_host_1_after_a_checkpoint)
    assert killed
    summary = read_summary(uri)
    assert summary["env_steps"] == result["env_steps"] == config.total_env_steps
    assert summary["run_dir"] == uri
    log = read_jsonl(run_dir / "run_log.jsonl")
    restarts = [e for e in log if e["event"] == "restart"]
    assert len(restarts) == 1 and log[-1]["event"] == "finish"
    assert restarts[0]["resumed_from_updates"] >= upc  # from a checkpoint on the store
    assert [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [upc * (i + 1) for i in range(4)]
    assert storage.step_dirs(run_dir / "checkpoints")[-1] == 4 * upc
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())
    assert load_run_config(uri) == config

    # `podray train --resume s3://...` with a larger budget continues from the last s3 checkpoint.
    more = 8 * 16 * upc * 5
    assert cli.main(["train", "--resume", uri, "--set", f"total_env_steps={more}"]) == 0
    assert read_summary(uri)["env_steps"] == more
    assert [r["updates"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [upc * (i + 1) for i in range(5)]
    assert [e["event"] for e in read_jsonl(run_dir / "run_log.jsonl")][-2:] == ["start", "finish"]

    # `podray eval s3://...` plays the last checkpoint from the store and writes eval.json there.
    assert cli.main(["eval", uri, "--episodes", "2", "--greedy"]) == 0
    result = json.loads(storage.read_text(run_dir / "eval.json"))
    assert result["episodes"] == 2 and result["checkpoint_step"] == 5 * upc


class _InterruptOnce(tune.Callback):
    """Interrupts the study (as Ctrl+C does) after `after` results, once (the marker survives the
    pickling of the restored study)."""

    def __init__(self, marker: str, after: int):
        self.marker, self.after, self.seen = marker, after, 0

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.seen += 1
        if self.seen >= self.after and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGUSR1)  # Tune's SIGINT handler also handles SIGUSR1


@pytest.mark.slow
def test_tune_study_on_s3_is_interrupted_resumed_and_read_back(s3, ray_cluster, tmp_path):
    from podray.tuning import load_study, resume_study, run_study, trainable

    overrides = {
        "total_env_steps": 2048,
        "env.envs_per_device": 4,
        "anakin.rollout_length": 16,
        "anakin.updates_per_call": 4,
        "agent.epochs": 1,
        "agent.num_minibatches": 1,
        "network.width": 16,
    }
    study_yaml = tmp_path / "s3study.yaml"
    data = {"name": "s3study", "base": "anakin_cartpole", "overrides": overrides}
    data.update(search={"network.depth": {"grid": [1, 2]}}, concurrency=2)
    study_yaml.write_text(json.dumps(data))
    spec = load_study(str(study_yaml))
    storage_uri = _unique(s3, "tune")
    marker = str(tmp_path / "interrupted")
    first = run_study(spec, storage=storage_uri, name="s3study", callbacks=[_InterruptOnce(marker, 3)], verbose=0)
    assert os.path.exists(marker) and first.unfinished >= 1
    assert str(first.study_dir) == f"{storage_uri}/s3study"

    second = resume_study(f"{storage_uri}/s3study")
    rows = second.outputs.rows
    assert second.unfinished == 0 and {r["status"] for r in rows} == {"TERMINATED"} and len(rows) == 2
    assert all(r["env_steps"] == 2048 for r in rows)
    assert any(r["restores"] >= 1 for r in rows), rows  # continued from a checkpoint on the store
    study_dir = storage.run_path(f"{storage_uri}/s3study")
    listed = json.loads((study_dir / "trials.json").read_text())
    assert {t["trial"] for t in listed["trials"]} == {r["trial"] for r in rows}
    for row in rows:
        assert row["run_dir"].startswith("s3://")
        assert read_summary(row["run_dir"])["env_steps"] == 2048
        for record in trainable.read_restores(row["run_dir"]):
            assert record["from_trial"] == row["trial"]


def test_orbax_gets_tensorstores_s3_driver_for_s3_and_keeps_its_own_choice_elsewhere(monkeypatch, tmp_path):
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    storage.enable_orbax_s3()
    s3 = ts_utils.build_kvstore_tspec("s3://bucket/run/checkpoints/4/state", use_ocdbt=True)["base"]
    assert s3 == {
        "driver": "s3",
        "bucket": "bucket",
        "path": "run/checkpoints/4/state",
        "endpoint": "http://127.0.0.1:9000",
        "aws_region": "eu-west-1",
        "aws_credentials": {"type": "environment"},
    }
    gs = ts_utils.build_kvstore_tspec("gs://bucket/run/checkpoints/4/state", use_ocdbt=True)["base"]
    assert gs["driver"] == "gcs" and gs["bucket"] == "bucket"
    local = ts_utils.build_kvstore_tspec(str(tmp_path / "state"), use_ocdbt=False)
    assert local == {"driver": "file", "path": str(tmp_path / "state")}
