"""A real Ray head on 127.0.0.1 with token authentication, as a user's cluster: `ray job submit -- python
examples/finetune.py` against it, and a driver in another working directory joining it with relative paths.

The head runs in its own temp dir (also its working directory, like a head started elsewhere) and on its own
ports, so it never meets the pytest session's local Ray (``ray_session``). It is started with ``ray start
--block`` and stopped by signalling that one process, which takes down the processes it started: ``ray stop``
would end every Ray on the machine, the session's included. One head serves the module's tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 240
STEPS = 4


def generate_token(home: Path) -> str:
    """`ray get-auth-token --generate` with HOME pointed at ``home``: the user's ~/.ray is left alone."""
    env = {**os.environ, "HOME": str(home)}
    out = subprocess.run(
        [BIN / "ray", "get-auth-token", "--generate"], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    token = out.stdout.strip()
    assert len(token) >= 32 and (home / ".ray" / "auth_token").read_text().strip() == token
    return token


def ray_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return env


@contextmanager
def ray_head(env: dict[str, str], temp_dir: Path, listen_port: Callable[[], int]):
    """A head node with 8 CPUs and a dashboard on 127.0.0.1, started in ``temp_dir`` on ports from
    ``listen_port`` (conftest's: outside the kernel's ephemeral range, so no connection takes one before the
    head binds it); yields the dashboard URL and the cluster's address."""
    dashboard, gcs, agent = listen_port(), listen_port(), listen_port()
    command = [
        BIN / "ray", "start", "--head", "--block", "--disable-usage-stats",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=8",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={listen_port()}",
        f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    log_path = temp_dir.parent / "ray-start.log"
    log = log_path.open("w")
    head = subprocess.Popen(
        command, env=env, cwd=temp_dir.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{dashboard}"
        wait_for_dashboard(url, f"http://127.0.0.1:{agent}", env["RAY_AUTH_TOKEN"], head, log_path)
        yield url, f"127.0.0.1:{gcs}"
    finally:
        stop_head(head)
        log.close()


def wait_for_dashboard(
    url: str, agent_url: str, token: str, head: subprocess.Popen, log: Path, timeout_s: float = 90
) -> None:
    """Until the dashboard answers the Jobs API and the head node's dashboard agent (which runs the jobs) answers its
    health check. The dashboard comes up first; a job submitted before the agent is up waits for it only 10 s
    (Ray's ``WAIT_AVAILABLE_AGENT_TIMEOUT``), which a loaded machine can exceed. The agent registers its address
    right after its HTTP server starts, so once it answers, a submission finds it. Either failure shows the end of
    ``log`` (what `ray start` printed) and of the head's component logs that mention an error."""
    deadline = time.monotonic() + timeout_s
    pending = [f"{url}/api/jobs/", f"{agent_url}/api/healthz"]
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{head_logs(log)}")
        try:
            while pending and get(pending[0], token) == 200:
                pending.pop(0)
            if not pending:
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(1)
    raise TimeoutError(
        f"{pending[0]} (the Ray head's dashboard or its agent) did not answer within {timeout_s}s:\n{head_logs(log)}"
    )


def head_logs(log: Path, lines: int = 40) -> str:
    """The last ``lines`` of `ray start`'s output and of every component log under the head's temp dir (beside
    ``log``) that mentions an error: a test that cannot start its head says why."""
    parts = [(log, log.read_text(errors="replace"))]
    for path in sorted((log.parent / "ray").glob("session_*/logs/*")):
        if path.is_file() and "session_latest" not in path.parts:
            text = path.read_text(errors="replace")
            if "Error" in text or "error" in text:
                parts.append((path, text))
    return "\n".join(f"--- {path.name}:\n" + "\n".join(text.splitlines()[-lines:]) for path, text in parts)


def stop_head(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` makes it stop the Ray processes it started; SIGKILL its group if stuck."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)


def get(url: str, token: str | None) -> int:
    """The HTTP status of a GET, with the token as bearer when given."""
    try:
        with urllib.request.urlopen(request(url, token), timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def get_json(url: str, token: str) -> dict:
    with urllib.request.urlopen(request(url, token), timeout=10) as response:
        return json.loads(response.read())


def request(url: str, token: str | None) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})


def ray_cli(env: dict[str, str], *args: str, timeout_s: float = 120) -> str:
    out = subprocess.run([BIN / "ray", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, f"ray {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def wait_for_job(url: str, token: str, job_id: str) -> tuple[str, str]:
    """The job's final status (or TIMEOUT) and its logs, through the Jobs REST API."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    status = "PENDING"
    while time.monotonic() < deadline:
        status = get_json(f"{url}/api/jobs/{job_id}", token)["status"]
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            break
        time.sleep(2)
    else:
        status = "TIMEOUT"
    return status, get_json(f"{url}/api/jobs/{job_id}/logs", token)["logs"]


@pytest.fixture(scope="module")
def head(tmp_path_factory, listen_ports):
    """``(dashboard url, cluster address, env)`` of a head shared by this module's tests."""
    home = tmp_path_factory.mktemp("home")
    env = ray_env(generate_token(home))
    # A short temp dir: Ray's unix sockets live under it and their paths must stay under 108 bytes.
    with (
        tempfile.TemporaryDirectory(prefix="rmj") as temp_dir,
        ray_head(env, Path(temp_dir) / "ray", listen_ports) as (url, address),
    ):
        yield url, address, env


@pytest.mark.slow
@pytest.mark.ray
def test_ray_job_submit_runs_the_example_on_the_cluster(head, tmp_path):
    url, _, env = head
    out_dir = tmp_path / "out"
    assert get(f"{url}/api/jobs/", token=None) == 401  # token authentication is on
    job_id = "raymoe-finetune-test"
    ray_cli(
        env, "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait",
        "--working-dir", str(REPO), "--",
        "python", "examples/finetune.py", "--steps", str(STEPS), "--eval-every", "0",
        "--tp-size", "1", "--fsdp-size", "2", "--ep-size", "2",  # two ranks: token dispatch, FSDP
        "--output-dir", str(out_dir), "--no-progress",
    )  # fmt: skip
    state, logs = wait_for_job(url, env["RAY_AUTH_TOKEN"], job_id)
    assert state == "SUCCEEDED", logs

    assert "Connected to Ray cluster" in logs  # the driver joined the cluster it was submitted to
    assert "train loss" in logs and "checkpoint" in logs
    checkpoint = out_dir / "checkpoint"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in checkpoint.iterdir()}
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert all(r["num_tokens"] > 0 and r["tokens_per_s"] > 0 for r in records if "loss" in r)
    assert (out_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.ray
def test_relative_paths_work_from_any_working_directory(head, tmp_path):
    """A driver in its own directory joins the running cluster (as a notebook does) and passes ``--model`` as a
    path relative to it: the ranks, started by the head in another directory, read the same checkpoint."""
    import raymoe

    _, address, env = head
    here = tmp_path / "driver"
    raymoe.build_tiny_checkpoint(here / "runs" / "relative-ckpt")
    command = [
        sys.executable, str(REPO / "examples" / "generate.py"), "--model", "runs/relative-ckpt",
        "--prompt", "ab", "--max-new-tokens", "3", "--fsdp-size", "2", "--cpus-per-rank", "1",
    ]  # fmt: skip
    out = subprocess.run(
        command, cwd=here, env={**env, "RAY_ADDRESS": address}, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "does not exist" not in out.stderr
