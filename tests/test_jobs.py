"""Runs as Ray jobs: the runs root, the refusal of Ray's job cache as a run directory, and a real
`ray job submit` with token authentication whose outputs outlive the job and its cluster."""

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest

from podray import config as config_lib
from podray import run_dirs
from podray.cli import main

REPO = pathlib.Path(__file__).resolve().parent.parent


def _config(**fields) -> config_lib.Config:
    return config_lib.load(None, [f"{k}={v}" for k, v in fields.items()], check=False)


def _fake_job_cache(tmp_path: pathlib.Path) -> pathlib.Path:
    """A directory laid out as Ray lays out a job's copy of its --working-dir."""
    cwd = tmp_path / "ray" / "session_2026-01-01_00-00-00_000000_1" / "runtime_resources"
    cwd = cwd / "working_dir_files" / "_ray_pkg_0123456789abcdef"
    cwd.mkdir(parents=True)
    return cwd


def test_run_dir_goes_under_the_runs_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(run_dirs.RUNS_ROOT_ENV, raising=False)
    config = _config(name="cartpole")
    # No root: the working directory, as ever.
    default = run_dirs.resolve(config)
    assert pathlib.Path(default).parent == tmp_path / "runs" and pathlib.Path(default).name.startswith("cartpole-")
    assert run_dirs.resolve(config, "mine") == str(tmp_path / "mine")
    # The environment variable, then the config field, which wins.
    monkeypatch.setenv(run_dirs.RUNS_ROOT_ENV, str(tmp_path / "env_root"))
    assert pathlib.Path(run_dirs.resolve(config)).parent == tmp_path / "env_root"
    assert run_dirs.resolve(config, "mine") == str(tmp_path / "env_root" / "mine")
    config.run.runs_root = str(tmp_path / "field_root")
    assert pathlib.Path(run_dirs.resolve(config)).parent == tmp_path / "field_root"
    config.run.run_dir = "a/b"
    assert run_dirs.resolve(config) == str(tmp_path / "field_root" / "a" / "b")
    # An absolute run directory is used as it is.
    assert run_dirs.resolve(config, tmp_path / "abs") == str(tmp_path / "abs")
    # A run named for --resume is looked for where --run-dir put it.
    assert run_dirs.existing("mine") == str(tmp_path / "env_root" / "mine")
    assert run_dirs.existing(tmp_path / "abs") == str(tmp_path / "abs")
    # Object-store roots join by '/' (podray.storage reaches them; tests/test_storage.py).
    assert run_dirs.join("gs://bucket/runs/", "x") == "gs://bucket/runs/x"
    config.run.runs_root = "gs://bucket/runs"
    assert run_dirs.resolve(config) == "gs://bucket/runs/a/b"
    assert run_dirs.resolve(config, "s3://other/run/") == "s3://other/run"


def test_a_run_dir_in_rays_job_cache_is_refused_before_compiling(tmp_path, monkeypatch, capsys, compile_counter):
    cwd = _fake_job_cache(tmp_path)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv(run_dirs.RUNS_ROOT_ENV, raising=False)
    job = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {"job_submission_id": "j1"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    assert run_dirs.ray_job_id() == "j1"
    assert run_dirs.ray_cache_dir(cwd / "runs") == str(cwd.parents[1])
    assert run_dirs.ray_cache_dir(tmp_path / "elsewhere") is None
    # Reached through a symlink (Ray's session_latest is one): still the cache.
    (tmp_path / "ray" / "session_latest").symlink_to(cwd.parents[2])
    assert run_dirs.ray_cache_dir(tmp_path / "ray" / "session_latest" / "runtime_resources" / "x") is not None
    with pytest.raises(config_lib.ConfigError, match=r"^run\.runs_root: the run directory .* Ray's runtime-resources"):
        run_dirs.resolve(_config())
    with pytest.raises(config_lib.ConfigError, match=r"^run\.run_dir \(--run-dir\): "):
        run_dirs.resolve(_config(), cwd / "abs")
    # The command: exit status 2, one line naming the field to set, before anything compiles.
    assert main(["train", "--in-process", "--set", "total_env_steps=512"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("podray: error: run.runs_root: the run directory")
    assert "(j1)" in err and "PODRAY_RUNS_ROOT" in err
    assert not list(cwd.glob("runs*"))  # nothing was created in the cache
    assert compile_counter == []
    # With a root outside the cache, the same job's run goes there.
    monkeypatch.setenv(run_dirs.RUNS_ROOT_ENV, str(tmp_path / "durable"))
    assert run_dirs.resolve(_config()).startswith(str(tmp_path / "durable") + os.sep)


def test_a_study_dir_in_rays_job_cache_is_refused_before_ray_starts(tmp_path, monkeypatch):
    import ray

    from podray import tuning

    spec = tuning.load_study(str(REPO / "tune_configs" / "anakin_cartpole_batch_depth.yaml"))
    monkeypatch.chdir(_fake_job_cache(tmp_path))
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))
    with pytest.raises(config_lib.ConfigError, match=r"^--storage: the study directory .* give --storage an"):
        tuning.run_study(spec)  # the default storage, tune_runs, is relative


def test_connect_without_an_address_never_joins_another_ray(monkeypatch, tmp_path):
    """A stale or foreign `ray_current_cluster` file (what `ray start` writes, and `ray.init()` without an
    address follows) must not make `podray train` attach to that cluster: it starts its own Ray."""
    import ray

    from podray.cluster import driver

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs) or _Context())
    driver.connect(None)
    assert calls[-1]["address"] == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")  # an explicit address is followed
    driver.connect(None)
    assert calls[-1]["address"] == "10.0.0.9:6379"


def test_the_ray_line_names_the_dashboard_and_the_jobs_page(monkeypatch):
    from podray.cluster.driver import RayConnection, where_line

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert where_line(RayConnection(True, None)) == "podray: on a local Ray started by this command (no dashboard)"
    url = "http://127.0.0.1:8265"
    assert where_line(RayConnection(True, url)).endswith(f"| dashboard {url}")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_x"}}))
    assert where_line(RayConnection(True, url)).endswith(
        f"| dashboard {url} | job raysubmit_x: {url}/#/jobs/raysubmit_x"
    )


class _Context:
    dashboard_url = None


# --------------------------------------------------------------------------------------------------
# A real head started with `ray start --head`, token authentication on, and `ray job submit`

_TAG = "PODRAY_JOB_TEST_TAG"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _tagged_processes(tag: str) -> list[int]:
    """PIDs of the processes whose environment carries `tag` (everything the test's head started)."""
    found = []
    for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{_TAG}={tag}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            pass
    return found


def _http_status(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _stop_head(head: subprocess.Popen, tag: str, timeout_s: float = 30.0) -> list[int]:
    """Stops exactly the head this test started (SIGTERM to `ray start --block`, which stops its Ray
    processes); returns the PIDs still alive after `timeout_s`, having killed them."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    deadline = time.monotonic() + timeout_s
    while _tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _tagged_processes(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def test_ray_job_submit_with_token_auth_keeps_its_outputs(tmp_path):
    from ray._common.utils import get_ray_address_file

    # Ray's socket paths must stay short: its temp dir lives directly under /tmp.
    base = pathlib.Path(tempfile.mkdtemp(prefix="podray-job-", dir="/tmp"))
    temp_dir = base / "ray"
    token_file = base / "auth_token"
    token = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes one
    token_file.write_text(token)
    runs_root = tmp_path / "runs"
    tag = uuid.uuid4().hex
    gcs, dash, client, node, objects, metrics, agent_grpc, agent_http, runtime_env = _free_ports(9)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "XLA_FLAGS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    }
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # `ray`, `python`
    env[_TAG] = tag
    # The head requires the token (RAY_AUTH_MODE=token) and reads it from a file of this test, not ~/.ray.
    head_env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    head_log = (base / "head.log").open("w")
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", "--temp-dir", str(temp_dir), "--num-cpus", "2"]
        + ["--node-ip-address", "127.0.0.1"]
        + ["--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)]
        + ["--ray-client-server-port", str(client), "--node-manager-port", str(node)]
        + ["--object-manager-port", str(objects), "--metrics-export-port", str(metrics)]
        + ["--dashboard-agent-grpc-port", str(agent_grpc), "--dashboard-agent-listen-port", str(agent_http)]
        + ["--runtime-env-agent-port", str(runtime_env), "--disable-usage-stats"],
        env=head_env,
        stdout=head_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C in the test's terminal goes to the test, not to this head
    )
    try:
        # The client of docs/operations.md: the dashboard's address, token mode and the token itself.
        client_env = {
            **env,
            "RAY_ADDRESS": f"http://127.0.0.1:{dash}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
        }
        url = f"http://127.0.0.1:{dash}/api/jobs/"
        deadline = time.monotonic() + 120
        current = temp_dir / "ray_current_cluster"  # written last by `ray start`
        while not current.exists() or _http_status(url, token) != 200:
            assert head.poll() is None, (base / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the head's job API did not come up in 120 s"
            time.sleep(1.0)
        assert _http_status(url, None) == 401  # token authentication is on
        # `ray start` names its cluster in its own temp dir; the machine's default file, which a
        # `ray.init()` without an address follows, does not point at this head.
        assert current.read_text().strip().endswith(f":{gcs}")
        default_file = pathlib.Path(get_ray_address_file(None))
        assert not default_file.exists() or not default_file.read_text().strip().endswith(f":{gcs}")

        def submit(*args: str) -> subprocess.Popen:
            command = ["ray", "job", "submit", "--working-dir", str(REPO), "--"]
            command += ["python", "clusters/train_entry.py", "--set", "run.tensorboard=false"]
            command += ["--set", "run.progress=false", *args]
            return subprocess.Popen(command, env=client_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        # One update of a small network: the test is about where the outputs go, not about learning.
        small = ["env.num_envs=8", "anakin.rollout_length=16", "anakin.updates_per_call=1", "agent.epochs=1"]
        small += ["agent.num_minibatches=1", "network.depth=1", "total_env_steps=128"]
        # Two jobs at once: one with a runs root, and one without, whose run would land in the job's
        # copy of the working directory: refused.
        jobs = [submit("--set", *small, f"run.runs_root={runs_root}"), submit("--set", *small)]
        (done, done_err), (refused, refused_err) = (job.communicate(timeout=240) for job in jobs)
        assert jobs[1].returncode == 1, refused + refused_err
        assert "podray: error: run.runs_root: the run directory" in refused, refused
        assert "runtime_resources" in refused and "PODRAY_RUNS_ROOT" in refused
        # The job trains and says, at its start, where its outputs go and where to watch it.
        assert jobs[0].returncode == 0, done[-4000:] + done_err[-2000:]
        assert f"podray: run dir {runs_root}{os.sep}anakin_cartpole-" in done
        assert f":{gcs} | dashboard http://127.0.0.1:{dash} | job raysubmit_" in done
        assert "done (ray): final mean return" in done
        caches = list(temp_dir.glob("session_*/runtime_resources/working_dir_files/*"))
        assert caches  # the job ran in Ray's copy of the working directory
    finally:
        left = _stop_head(head, tag)
        head_log.close()
        shutil.rmtree(base, ignore_errors=True)  # Ray's temp dir: its working-dir cache goes with it
    assert left == [], f"processes of the test's Ray left running (killed now): {left}"
    assert not caches[0].exists()
    (run,) = runs_root.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert f"| run dir {run}" in done  # the summary line says where the outputs are
    assert summary["env_steps"] == 128 and summary["run_dir"] == str(run)
    assert (run / "metrics.jsonl").exists() and (run / "checkpoints").is_dir()
