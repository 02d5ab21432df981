"""``tether run`` on several nodes with torchrun's dynamic forms: launchers on this machine act
as nodes on 127.0.0.1 and meet through torch's own c10d rendezvous (no ``--node-rank``),
with elastic node counts, restarts across nodes, a torchrun node in the same job, the
``PET_*`` forms schedulers use, SLURM's variables, and each kind of bad input."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import cmdline, descendants, wait_gone

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DDP = str(SCRIPTS / "ddp_train.py")
ELASTIC = str(SCRIPTS / "elastic_rank.py")
TRAINED = re.compile(r"rank=(\d+) local_rank=\d+ world=(\d+) epochs=\d+ params=(-?\d+\.\d{6})")
PLACE = re.compile(
    r"place RANK=(\d+) WORLD_SIZE=(\d+) GROUP_RANK=(\d+) .*"
    r"TORCHELASTIC_RESTART_COUNT=(\d+) TORCHELASTIC_USE_AGENT_STORE=(\w+)"
)
BIN = Path(sys.executable).parent
#: What a gloo rank prints when it aborts inside torch's C++ now and then on this machine,
#: under torchrun and tether alike: a fault of the peer library, not of a launcher.
GLOO_ABORT = "terminate called without an active exception"
#: Rendezvous settings that keep the tests short: a one-second last call, and a node
#: without heartbeats for 3 s is dead (torch's default is 15 s).
QUICK = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """One launcher acting as a node; its stdout and stderr go to files, read at any time."""

    def __init__(self, tmp: Path, name: str, argv: List[str], **env: str) -> None:
        self.out_path, self.err_path = tmp / f"{name}.out", tmp / f"{name}.err"
        self.env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", TMPDIR=str(tmp), **env)
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env)

    @property
    def out(self) -> str:
        return self.out_path.read_text()

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, pattern: str, limit: float = 120) -> None:
        deadline = time.monotonic() + limit
        while not re.search(pattern, self.out + self.err):
            assert self.proc.poll() is None, f"ended first: {self.out}{self.err}"
            assert time.monotonic() < deadline, f"no {pattern!r} in: {self.out}{self.err}"
            time.sleep(0.1)

    def end(self, limit: float = 200) -> int:
        try:
            return self.proc.wait(timeout=limit)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def places(self) -> List[Tuple[int, int, int, int, str]]:
        """(rank, world size, node rank, restart count, agent store) of each rank started."""
        return [(int(a), int(b), int(c), int(d), e) for a, b, c, d, e in PLACE.findall(self.out)]


def tether(*args: str) -> List[str]:
    return [str(BIN / "tether"), "run", *args]


def c10d(port: int, run_id: str = "job", nnodes: str = "2", conf: str = QUICK) -> List[str]:
    return [
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
    ]


def start(nodes: List[Node], tmp: Path, argv: List[str], **env: str) -> Node:
    node = Node(tmp, f"node{len(nodes)}", argv, **env)
    nodes.append(node)
    return node


def trained(nodes: List[Node]) -> Dict[int, Tuple[int, str]]:
    found: Dict[int, Tuple[int, str]] = {}
    for node in nodes:
        for rank, world, params in TRAINED.findall(node.out):
            found[int(rank)] = (int(world), params)
    return found


def train_together(tmp: Path, nodes: List[Node], argvs: List[List[str]]) -> None:
    """Starts one node per argv (a rank that aborted inside gloo: the job runs again)."""
    for _ in range(3):
        nodes.clear()
        for argv in argvs:
            start(nodes, tmp, argv)
        codes = [node.end() for node in nodes]
        if not any(GLOO_ABORT in node.out + node.err for node in nodes):
            break
    for code, node in zip(codes, nodes):
        assert code == 0, node.err


def test_c10d_nodes_take_their_ranks_from_torchs_handler_and_train_to_identical_weights(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    train_together(
        tmp_path,
        nodes,
        [
            tether(*c10d(port), "--nproc-per-node=2", "--node-rank=5", DDP),
            tether(*c10d(port), "--nproc-per-node=1", DDP),
        ],
    )
    found = trained(nodes)
    assert sorted(found) == [0, 1, 2], [n.out for n in nodes]
    assert {world for world, _ in found.values()} == {3}
    assert len({params for _, params in found.values()}) == 1, found
    assert "--node-rank 5 is ignored" in nodes[0].err
    # The node of 2 ranks holds 0-1 or 1-2... as the handler ranked the nodes; never mixed.
    ranks = [sorted(int(r) for r, _, _ in TRAINED.findall(n.out)) for n in nodes]
    assert sorted(map(len, ranks)) == [1, 2] and sorted(sum(ranks, [])) == [0, 1, 2], ranks


def listener_pid(port: int) -> Optional[int]:
    """The pid that listens on 127.0.0.1:`port` (from /proc/net/tcp and the fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in descendants(os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return pid
        except OSError:
            continue
    return None


def signal_each(pids: List[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def test_is_host_decides_which_node_hosts_the_store(tmp_path: Path, nodes: List[Node]) -> None:
    port = free_port()
    script = [ELASTIC, "--sleep", "3"]
    guest = start(nodes, tmp_path, tether(*c10d(port, conf=QUICK + ",is_host=false"), *script))
    time.sleep(1)  # the guest waits for a store nobody hosts yet
    host = start(nodes, tmp_path, tether(*c10d(port, conf=QUICK + ",is_host=true"), *script))
    host.wait_for("place RANK")
    guest.wait_for("place RANK")
    owner = listener_pid(port)
    assert owner in descendants(host.proc.pid), (owner, descendants(host.proc.pid))
    assert owner not in descendants(guest.proc.pid)
    assert [guest.end(), host.end()] == [0, 0], guest.err + host.err


@pytest.mark.parametrize("shared", ["shared store", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"])
def test_an_elastic_job_grows_when_a_node_joins_late_and_goes_on_when_one_is_killed(
    tmp_path: Path, nodes: List[Node], shared: str
) -> None:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if "=" in shared else {}
    port = free_port()
    marks = tmp_path / "marks"
    marks.mkdir()
    # Ranks end in a world of 4 seen after one of 6: 2 nodes, then 3, then 2 again.
    argv = tether(
        *c10d(port, "grow", "1:3"),
        "--nproc-per-node=2",
        "--grace-period=3",
        ELASTIC,
        "--finish-at",
        "4",
        "--after",
        f"{marks}:6",
    )
    first = [start(nodes, tmp_path, argv, **env) for _ in range(2)]
    for node in first:
        node.wait_for("place RANK=.* WORLD_SIZE=4")
    late = start(nodes, tmp_path, argv, **env)
    for node in nodes:
        node.wait_for("place RANK=.* WORLD_SIZE=6")
    time.sleep(0.5)
    left = descendants(late.proc.pid)
    late.proc.kill()
    assert late.end() == -signal.SIGKILL
    assert wait_gone(sorted(left), 10) == [], "the killed node's processes outlived it"
    for node in first:
        assert node.end() == 0, node.err
        # Rounds of 4 ranks, then 6, then 4 again (under load, a first node may also have
        # started a round of its own before the second joined: elastic, and allowed).
        worlds = [world for _, world, _, _, _ in node.places()]
        assert worlds[-2:] == [4, 4] and 6 in worlds, worlds
        assert worlds.index(4) < worlds.index(6) < len(worlds) - 2, worlds
        assert {restarts for _, _, _, restarts, _ in node.places()} == {0}
        assert node.err.count("not counted as a restart") >= 2, node.err
        assert re.search(r"node \d \(\S+\) (left the job|stopped answering)", node.err), node.err
    sums = sorted(re.findall(r"sum (\d+) rank (\d+)", first[0].out + first[1].out))
    assert sums == [("4", "0"), ("4", "1"), ("4", "2"), ("4", "3")], sums


def test_a_node_whose_machine_is_lost_is_noticed_by_its_heartbeats_without_spending_a_restart(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    marks = tmp_path / "marks"
    marks.mkdir()
    script = ["--nproc-per-node=2", "--max-restarts=0", "--grace-period=3", ELASTIC]
    script += ["--finish-at", "4", "--after", f"{marks}:6"]
    survivors = [start(nodes, tmp_path, tether(*c10d(port, "lost", "1:3"), *script))]
    survivors.append(start(nodes, tmp_path, tether(*c10d(port, "lost", "1:3"), *script)))
    # The lost node never hosts the store: a frozen host freezes every node's rendezvous.
    guest = c10d(port, "lost", "1:3", conf=QUICK + ",is_host=false")
    lost = start(nodes, tmp_path, tether(*guest, *script))
    for node in nodes:
        node.wait_for("place RANK=.* WORLD_SIZE=6")
    # The machine is lost: every process of that node stops at once (nothing says goodbye).
    frozen = sorted({lost.proc.pid} | descendants(lost.proc.pid))
    signal_each(frozen, signal.SIGSTOP)
    try:
        # --max-restarts 0: a change of membership that spent a restart would end the job.
        for node in survivors:
            assert node.end(limit=120) == 0, node.err
            assert re.search(r"node \d \(\S+\) stopped answering for 3 s", node.err), node.err
            assert {restarts for _, _, _, restarts, _ in node.places()} == {0}
            assert [world for _, world, _, _, _ in node.places()][-2:] == [4, 4]
    finally:
        signal_each(frozen, signal.SIGKILL)
    assert lost.end() == -signal.SIGKILL
    assert wait_gone(frozen, 10) == []
    sums = sorted(re.findall(r"sum (\d+) rank (\d+)", survivors[0].out + survivors[1].out))
    assert sums == [("4", "0"), ("4", "1"), ("4", "2"), ("4", "3")], sums


def test_a_rank_failure_restarts_every_node_and_the_last_one_ends_the_job_on_both(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    argv = tether(
        *c10d(port, "fails"),
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--grace-period=3",
        ELASTIC,
        "--fail-node",
        "1",
    )
    both = [start(nodes, tmp_path, argv) for _ in range(2)]
    codes = [node.end() for node in both]
    assert codes == [3, 3], [n.err for n in both]
    failing = next(n for n in both if "GROUP_RANK=1" in n.out)
    other = next(n for n in both if n is not failing)
    assert [c for _, _, g, c, _ in failing.places() if g == 1][::2] == [0, 1, 2]
    assert {c for _, _, _, c, _ in other.places()} == {0}, "a peer's failure spent its restarts"
    assert "this node's restart 2 of 2" in failing.err
    assert other.err.count("not counted as a restart") == 2, other.err
    host = socket.gethostname()
    for node in both:
        report = node.err[node.err.index("failed first") :]
        assert "rank 2" in report and "exit code 3" in report, report
        assert f"host {host}" in report and "node rank 1" in report, report
        assert "rank 2 fails on purpose" in report, report


def test_the_node_hosting_the_store_keeps_it_until_every_node_has_read_the_end_of_the_job(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    common = ["--nproc-per-node=1", "--max-restarts=0", "--grace-period=3", ELASTIC]
    # The host's rank fails once told to; the guest's waits to be stopped. A node is dead
    # after 6 s without heartbeats, longer than the guest's helper is frozen below.
    trigger = tmp_path / "fail now"
    failing = [*common, "--fail-here", "--fail-after", "0", "--fail-when", str(trigger)]
    conf = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"
    hosting, guesting = (c10d(port, "end", conf=f"{conf},is_host={h}") for h in ("true", "false"))
    host = start(nodes, tmp_path, tether(*hosting, *failing))
    guest = start(nodes, tmp_path, tether(*guesting, *common))
    for node in nodes:
        node.wait_for("place RANK=")
    # The guest's helper is frozen while the job ends: it cannot read the end before the
    # host's launcher has reported it, and a host that went at once would take the store.
    # The helper: `python -m tether.run.rendezvous`, or a fork of the node's zygote (warm).
    forms = ("tether.run.rendezvous", "tether rendezvous helper of pid")
    helper = [p for p in descendants(guest.proc.pid) if any(f in cmdline(p) for f in forms)]
    assert len(helper) == 1, helper
    signal_each(helper, signal.SIGSTOP)
    try:
        trigger.touch()
        host.wait_for("failed first", limit=30)
        time.sleep(1)
    finally:
        signal_each(helper, signal.SIGCONT)
    assert guest.end(limit=60) == 3, guest.err
    assert host.end(limit=60) == 3, host.err
    report = guest.err[guest.err.index("failed first") :]
    assert "exit code 3" in report and re.search(r"rank \d fails on purpose", report), report


def test_a_torchrun_node_and_a_tether_node_train_in_one_job(
    tmp_path: Path, nodes: List[Node]
) -> None:
    port = free_port()
    common = [*c10d(port, "mixed", conf=""), "--nproc-per-node=1", DDP]
    train_together(tmp_path, nodes, [[str(BIN / "torchrun"), *common], tether(*common)])
    found = trained(nodes)
    assert sorted(found) == [0, 1] and len({p for _, p in found.values()}) == 1, found


def test_pet_variables_alone_start_an_elastic_c10d_job(tmp_path: Path, nodes: List[Node]) -> None:
    env = {
        "PET_NNODES": "2:3",
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "PET_RDZV_ID": "pet",
        "PET_RDZV_CONF": QUICK,
    }
    both = [start(nodes, tmp_path, tether(ELASTIC, "--finish-at", "2"), **env) for _ in range(2)]
    assert [node.end() for node in both] == [0, 0], [n.err for n in both]
    sums = sorted(re.findall(r"sum (\d+) rank (\d+)", both[0].out + both[1].out))
    assert sums == [("2", "0"), ("2", "1")], sums


# -- SLURM: the command line wins, and a step's values win over the job's -------------------

SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu-[3-4]",
    "SLURM_NODELIST": "gpu-[3-4]",
}
SHOW = ["--no-python", "sh", "-c", 'echo "$RANK $WORLD_SIZE $MASTER_ADDR"']


@pytest.mark.parametrize(
    "form",
    [
        ["--standalone", "-n", "2"],
        ["--nnodes", "1", "-n", "2"],
        ["--nnodes", "1", "--node-rank", "0", "-n", "2"],
    ],
)
def test_one_node_forms_inside_a_slurm_allocation_run_locally(form: List[str]) -> None:
    proc = subprocess.run(
        tether(*form, *SHOW),
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **SLURM),
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split(": ", 1)[1] for line in proc.stdout.splitlines())
    assert lines == ["0 2 localhost", "1 2 localhost"], proc.stdout


def test_a_slurm_steps_node_count_wins_over_the_jobs() -> None:
    step = {"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "gpu-4", "SLURM_NODEID": "0"}
    env = dict(os.environ, **{**SLURM, **step})
    proc = subprocess.run(
        tether("-n", "1", *SHOW), capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(": ", 1)[1].split()[:2] == ["0", "1"], proc.stdout


# -- bad input and faults: a clear error on every node, no rank started --------------------


def fails_clearly(argv: List[str], *expected: str, limit: float = 90) -> str:
    began = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - began < limit
    assert "place RANK" not in proc.stdout, "a rank started"
    for words in expected:
        assert words in proc.stderr, proc.stderr
    assert "frame #" not in proc.stderr, "a C++ stack instead of a sentence"
    return proc.stderr


def test_an_endpoint_nobody_hosts_is_named_within_the_read_timeout() -> None:
    port = free_port()
    argv = tether(*c10d(port, conf="is_host=false,read_timeout=3"), ELASTIC)
    fails_clearly(argv, f"127.0.0.1:{port}", "read_timeout", "no node hosts the store")


class OtherService:
    """A TCP service on a free port: one that answers every connection with an HTTP error,
    or one that accepts and stays silent."""

    def __init__(self, answers: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answers, self.held, self.stop = answers, [], threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.answers:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.mark.parametrize("answers", [True, False], ids=["answers", "stays silent"])
def test_an_endpoint_where_another_service_listens_is_named(answers: bool) -> None:
    service = OtherService(answers)
    try:
        argv = tether(*c10d(service.port, conf="read_timeout=3"), ELASTIC)
        words = "not a c10d store" if answers else "did not answer as a c10d store within 8 s"
        fails_clearly(argv, f"127.0.0.1:{service.port}", words)
    finally:
        service.close()


def test_a_join_timeout_names_the_option() -> None:
    argv = tether(*c10d(free_port(), conf="join_timeout=3"), ELASTIC)
    fails_clearly(argv, "join_timeout (3 s)", "fewer than 2 node(s) joined")


def test_nodes_that_disagree_on_the_run_id_each_name_the_other(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            tether(*c10d(port, run_id, conf="join_timeout=5"), ELASTIC),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run_id in ("alpha", "beta")
    ]
    try:
        ends = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [1, 1], ends
    assert "other run ids: 'beta'" in ends[0][1], ends
    assert "other run ids: 'alpha'" in ends[1][1], ends
    for out, err in ends:
        assert "join_timeout (5 s)" in err and "place RANK" not in out, err
