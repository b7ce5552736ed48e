"""`rl-train` as a Ray job on a real two-node Ray cluster.

The test makes a second "host" on this machine: two network namespaces joined by a veth pair
(10.77.0.1 and 10.77.0.2, no other link and no route out), and in each a Ray node with its own
hostname (UTS namespace), its own /dev/shm and /etc/hosts (mount namespace) and its own PID
namespace. `ray start --head` runs in one, `ray start --address` in the other. The trainer
pool is placed on the head node and the rollout pool on the worker node by Ray custom
resources (ray.trainer_resources / ray.rollout_resources), so the weight sync crosses the veth
(no shared memory) and must pass its probe check. `ray job stop` must end a run with nothing
left behind and no restart. Everything made here is removed at the end.

The cluster, its two jobs and the stop are driven from a process of their own (python -m this
module), started with the integration tests (tests/early.py): they are start-ups and waits,
which leave cores idle beside the other tests. It writes what the tests check to out.json.
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.early import early
from tests.procs import processes, with_descendants

pytestmark = pytest.mark.slow  # the fast tier: pytest -m "not slow"

ROOT = Path(__file__).parents[2]
HEAD_IP, WORKER_IP = "10.77.0.1", "10.77.0.2"
GCS_PORT, DASHBOARD_PORT = 6380, 8266
# PID 1 of a node's namespace, as init is on a real host: runs `ray start`, reaps every orphan
# (a job's entrypoint outlives the supervisor that stopped it), exits with ray start
INIT = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:])\n"
        "while True:\n pid, status = os.wait()\n if pid == p.pid: sys.exit(1)")
ACTOR_NAMES = ("ray::TrainerWorker", "ray::RolloutWorker", "ray::ColocatedWorker", "rl-train")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class TwoNodes:
    """The namespaces, the veth pair and one Ray node in each."""

    def __init__(self, tmp: Path):
        tag = f"rl{os.getpid() % 100000}"
        self.tmp, self.head_ns, self.worker_ns = tmp, f"{tag}-head", f"{tag}-work"
        self.links = (f"{tag}h", f"{tag}w")
        # Ray's session directories hold AF_UNIX sockets (paths < 108 bytes): keep them short
        self.ray_dirs = {role: Path(f"/tmp/{tag}-ray-{role}") for role in ("head", "worker")}
        self.hosts = {"head": f"{tag}-head", "worker": f"{tag}-work"}
        self.nodes: dict[str, subprocess.Popen] = {}
        self.token = token = tmp / "auth_token"  # Ray 2.60 clusters take a shared token
        token.write_text(secrets.token_hex(16))
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                        RL_CACHE_DIR=str(tmp / "cache"), RAY_USAGE_STATS_ENABLED="0",
                        # as docs/ray-clusters.md says for machines shared with other work
                        RAY_worker_niceness="0",
                        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        for key in ("RAY_ADDRESS", "WANDB_API_KEY"):
            self.env.pop(key, None)

    def make_network(self) -> None:
        head, work = self.links
        steps = [("netns", "add", self.head_ns), ("netns", "add", self.worker_ns),
                 ("link", "add", head, "type", "veth", "peer", "name", work),
                 ("link", "set", head, "netns", self.head_ns),
                 ("link", "set", work, "netns", self.worker_ns),
                 ("-n", self.head_ns, "addr", "add", f"{HEAD_IP}/24", "dev", head),
                 ("-n", self.worker_ns, "addr", "add", f"{WORKER_IP}/24", "dev", work),
                 ("-n", self.head_ns, "link", "set", head, "up"),
                 ("-n", self.worker_ns, "link", "set", work, "up"),
                 ("-n", self.head_ns, "link", "set", "lo", "up"),
                 ("-n", self.worker_ns, "link", "set", "lo", "up")]
        for step in steps:
            _ip(*step)

    def start_node(self, role: str, ray_args: list[str]) -> None:
        ns = self.head_ns if role == "head" else self.worker_ns
        ip = HEAD_IP if role == "head" else WORKER_IP
        hosts = self.tmp / f"hosts-{role}"
        hosts.write_text(f"127.0.0.1 localhost\n{ip} {self.hosts[role]}\n")
        script = (f"set -e; hostname {self.hosts[role]}; mount -t tmpfs -o size=2g tmpfs /dev/shm; "
                  f"mount --bind {hosts} /etc/hosts; exec {sys.executable} -c '{INIT}' "
                  f"ray start --block --disable-usage-stats "
                  f"--node-ip-address {ip} --temp-dir {self.ray_dirs[role]} "
                  f"--object-store-memory 200000000 " + " ".join(ray_args))
        # --kill-child: killing unshare kills the node's PID 1, and with it the whole namespace
        cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--pid", "--fork",
               "--mount-proc", "--kill-child", "--propagation", "private", "bash", "-c", script]
        with open(self.tmp / f"{role}.log", "w") as log:
            self.nodes[role] = subprocess.Popen(cmd, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT)

    def in_head(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """A command run in the head node's network namespace (the Ray CLI reaching it)."""
        return subprocess.run(["ip", "netns", "exec", self.head_ns, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    def api(self, path: str) -> dict | None:
        """GET the head's dashboard REST API (with the cluster's token), from inside the head's
        namespace; None while nothing answers. curl, not the Ray CLI: a CLI call costs ~2 s of
        CPU, and polls every few seconds took that from the run under test."""
        out = self.in_head("curl", "-sf", "-m", "10", "-H",
                           f"Authorization: Bearer {self.token.read_text().strip()}",
                           f"http://{HEAD_IP}:{DASHBOARD_PORT}{path}")
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout else None

    def wait_for_nodes(self, count: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        alive = []
        while time.time() < deadline:
            found = self.api("/nodes?view=summary")
            alive = [n for n in (found or {}).get("data", {}).get("summary", [])
                     if n.get("raylet", {}).get("state") == "ALIVE"]
            if len(alive) >= count:
                return
            for role, proc in self.nodes.items():
                assert proc.poll() is None, (role, (self.tmp / f"{role}.log").read_text()[-3000:])
            time.sleep(1)
        raise AssertionError(f"the cluster did not reach {count} nodes: {alive}")

    def job(self, command: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.in_head("ray", "job", command, "--address",
                            f"http://{HEAD_IP}:{DASHBOARD_PORT}", *args, timeout=timeout)

    def job_status(self, job_id: str) -> str:
        """PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED (the Jobs REST API's status)."""
        job = self.api(f"/api/jobs/{job_id}")
        return job["status"] if job else "UNKNOWN (the dashboard did not answer)"

    def wait_job(self, job_id: str, timeout: float = 900) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            status = self.job_status(job_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                return status
            time.sleep(1)
        return "TIMEOUT"

    def logs(self, job_id: str) -> str:
        found = self.api(f"/api/jobs/{job_id}/logs")
        return found["logs"] if found else ""

    def remove(self) -> None:
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
        _ip("netns", "del", self.worker_ns, check=False)  # takes the veth pair with it
        _ip("netns", "del", self.head_ns, check=False)
        _ip("link", "del", self.links[0], check=False)  # if set-up failed before moving it
        for path in self.ray_dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def run_processes(nodes: "TwoNodes") -> dict[int, str]:
    """{pid: command} of the run's live processes: the job's entrypoint (rl-train), its actors,
    and every descendant of either (reward workers, sandboxes); zombies do not count. Only the
    two nodes' processes are searched (everything the cluster starts stays below them, in their
    PID namespaces): not the processes of other tests on this machine."""
    procs = processes()
    node = with_descendants({p.pid for p in nodes.nodes.values()}, procs)
    # not the Ray CLI calls of this test, which name rl-train in their arguments
    run = {pid for pid in node if any(name in procs[pid][2] for name in ACTOR_NAMES)
           and "bin/ray job " not in procs[pid][2]}
    return {pid: procs[pid][2] for pid in with_descendants(run, procs) if procs[pid][1] != "Z"}


def cluster_unavailable() -> str | None:
    """Why this machine cannot make the second host, or None."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return "needs root, ip and unshare to make the second host's namespaces"
    return None


def start_cluster(nodes: TwoNodes) -> None:
    # the two jobs run at once; room for both pools of both on the head: only the custom
    # resources send the engines to the other node
    nodes.start_node("head", ["--head", f"--port {GCS_PORT}", f"--dashboard-host {HEAD_IP}",
                              f"--dashboard-port {DASHBOARD_PORT}", "--include-dashboard true",
                              "--num-cpus 4", "--resources '{\"trainer_node\": 2}'"])
    nodes.wait_for_nodes(1)
    nodes.start_node("worker", [f"--address {HEAD_IP}:{GCS_PORT}", "--num-cpus 2",
                                "--resources '{\"rollout_node\": 2}'"])
    nodes.wait_for_nodes(2)


def submit(nodes: TwoNodes, job_id: str, out_dir: Path, *overrides: str) -> None:
    cmd = ["--submission-id", job_id, "--working-dir", ".", "--no-wait", "--",
           "rl-train", "recipes/quickstart_disaggregated.yaml", "ray.address=auto",
           f"run.output_dir={out_dir}", "run.name=cluster", "warmup.sft_steps=0",
           "data.eval_fraction=0", "trainer.eval_every=0",  # the cluster test is about syncs
           "ray.num_workers=1", "ray.num_rollout_workers=1",
           "ray.trainer_resources={trainer_node: 1}", "ray.rollout_resources={rollout_node: 1}",
           "rollout.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=16",
           *overrides]
    out = nodes.job("submit", *cmd)
    assert out.returncode == 0, out.stdout + out.stderr


def two_nodes_job(nodes: TwoNodes, out_dir: Path) -> dict:
    """What the 2-step job left: its status, logs and metrics."""
    status = nodes.wait_job("rl-two-nodes")
    metrics = out_dir / "cluster" / "metrics.jsonl"
    return {"status": status, "logs": nodes.logs("rl-two-nodes"), "hosts": nodes.hosts,
            "metrics": [json.loads(x) for x in metrics.read_text().splitlines()]
            if metrics.exists() else None,
            "final_model": (out_dir / "cluster" / "final_model" / "config.json").exists()}


def stopped_job(nodes: TwoNodes, out_dir: Path) -> dict:
    """`ray job stop` of the endless job, once it has logged 2 steps, and what it left."""
    # the other job first: nothing of it may be left when this one's processes are counted
    assert nodes.wait_job("rl-two-nodes") != "TIMEOUT"
    metrics = out_dir / "cluster" / "metrics.jsonl"
    deadline = time.time() + 900  # bounds below only stop a hung run: CI machines can be slow
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        status = nodes.job_status("rl-stopped")  # UNKNOWN: a loaded dashboard did not answer
        assert time.time() < deadline and status.split()[0] in ("RUNNING", "PENDING", "UNKNOWN"), \
            (status, nodes.logs("rl-stopped")[-4000:])
        time.sleep(2)
    seen = {"before": run_processes(nodes)}
    out = nodes.job("stop", "rl-stopped", timeout=120)
    seen["stop"] = [out.returncode, out.stdout + out.stderr]
    seen["status_after_stop"] = nodes.wait_job("rl-stopped", timeout=60)
    seen["logs"] = nodes.logs("rl-stopped")
    deadline = time.time() + 60
    while run_processes(nodes) and time.time() < deadline:
        time.sleep(1)
    seen["left"] = run_processes(nodes)
    now = processes()
    seen["before_alive"] = {pid: args for pid, args in seen["before"].items()
                            if pid in now and now[pid][1] != "Z"}
    steps = metrics.read_text().count("\n")
    time.sleep(5)  # no restart: nothing writes to the run any more
    seen["steps"] = [steps, metrics.read_text().count("\n")]
    seen["status_later"] = nodes.job_status("rl-stopped")
    return seen


def cluster_main(out_dir: str) -> None:
    """Makes the cluster, submits both jobs at once (their start-ups overlap: `rl-two-nodes`
    runs 2 steps, `rl-stopped` until it is stopped), and writes what each test checks to
    out.json, or why it could not (`skip`, or each part's error)."""
    tmp = Path(out_dir)
    result: dict = {"skip": cluster_unavailable()}
    if result["skip"] is None:
        nodes = TwoNodes(tmp)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop still cleans up
        try:
            try:
                nodes.make_network()
            except subprocess.CalledProcessError as e:
                result["skip"] = f"cannot make network namespaces here: {e.stderr.strip()}"
            else:
                start_cluster(nodes)
                dirs = {job: tmp / job for job in ("rl-two-nodes", "rl-stopped")}
                submit(nodes, "rl-two-nodes", dirs["rl-two-nodes"], "trainer.total_steps=2")
                submit(nodes, "rl-stopped", dirs["rl-stopped"], "trainer.total_steps=100000")
                for part, job, check in (("two_nodes", "rl-two-nodes", two_nodes_job),
                                         ("stopped", "rl-stopped", stopped_job)):
                    try:
                        result[part] = check(nodes, dirs[job])
                    except Exception:  # the part's test shows it; the other part goes on
                        result[part] = {"error": traceback.format_exc()}
        finally:
            nodes.remove()
            result["left"] = {"netns": _ip("netns", "list").stdout, "links": _ip("link").stdout,
                              "names": [nodes.head_ns, nodes.worker_ns, nodes.links[0]]}
    (tmp / "out.json").write_text(json.dumps(result))


# the cluster's set-up and jobs are start-ups and waits: started with the integration tests
CLUSTER = early("ray_cluster", __file__, with_integration=True, command=lambda tmp: [
    sys.executable, "-m", "tests.integration.test_ray_cluster", str(tmp)])


@pytest.fixture(scope="module")
def cluster() -> dict:
    CLUSTER.passed()
    result = json.loads((CLUSTER.dir / "out.json").read_text())
    if result["skip"]:
        pytest.skip(result["skip"])
    left = result["left"]  # everything made here is removed
    assert not any(name in left["netns"] for name in left["names"][:2]), left["netns"]
    assert left["names"][2] not in left["links"], left["links"]
    return result


def part(result: dict, name: str) -> dict:
    assert "error" not in result[name], result[name]["error"]
    return result[name]


@pytest.mark.integration
def test_job_on_two_nodes_syncs_across_hosts(cluster):
    job = part(cluster, "two_nodes")
    logs = job["logs"]
    assert job["status"] == "SUCCEEDED", logs[-6000:]
    head, worker = job["hosts"]["head"], job["hosts"]["worker"]
    assert f"placement: trainer rank 0 on {head}, rollout engine 0 on {worker}" in logs, logs[-3000:]
    assert [m["step"] for m in job["metrics"]] == [1, 2]
    for m in job["metrics"]:
        assert m["sync/cross_host"] == 1.0  # the buckets crossed the veth pair
        assert m["sync/logprob_max_abs_diff"] <= 1e-3  # and the probe check passed
        assert m["sync/policy_version"] == m["step"]
    assert job["final_model"]


@pytest.mark.integration
def test_job_stop_ends_the_run_and_leaves_nothing(cluster):
    seen = part(cluster, "stopped")
    names = " ".join(seen["before"].values())
    assert "rl-train" in names and "ray::TrainerWorker" in names and "ray::RolloutWorker" in names, \
        seen["before"]
    code, out = seen["stop"]
    assert code == 0, out
    assert seen["status_after_stop"] == "STOPPED"
    # a deliberate stop: rl-train took SIGTERM like Ctrl-C, not as a crash
    assert "rl-train: stopped by a signal" in seen["logs"]
    assert not seen["left"], seen["left"]
    assert not seen["before_alive"], seen["before_alive"]
    steps, later = seen["steps"]
    assert later == steps  # no restart: nothing wrote to the run any more
    assert seen["status_later"] == "STOPPED"


if __name__ == "__main__":
    cluster_main(sys.argv[1])
