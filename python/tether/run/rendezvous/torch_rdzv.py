"""torch's pieces of the rendezvous helper (``helper``): the handler's parameters, built from
the same options as torchrun builds them, the c10d handler (torch's, reading the shared
state more often), and torch's agent's own assignment of ranks."""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Dict, List, Tuple


def quiet_cpp_logs() -> None:
    """torch's C++ logs at FATAL only (unless the user chose a level): as
    ``TORCH_CPP_LOG_LEVEL=FATAL``, which torch reads when its library loads; in a helper forked
    from a zygote that has loaded it already, the level is set where c10 keeps it."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        import ctypes

        lib = os.path.join(os.path.dirname(str(torch.__file__)), "lib", "libc10.so")
        c10 = ctypes.CDLL(lib)
        ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level").value = 3  # FATAL
    except (OSError, ValueError, AttributeError):
        pass  # another torch: its C++ logs stay as they are


def rendezvous_conf(opts: Dict[str, Any]) -> Dict[str, Any]:
    """The handler's configuration (``--rdzv-conf``), with torchrun's default timeout."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    conf: Dict[str, Any] = _parse_rendezvous_config(opts.get("conf") or "")
    conf.setdefault("timeout", 900)
    return conf


def parameters(opts: Dict[str, Any], conf: Dict[str, Any]) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend=opts["backend"],
        endpoint=opts["endpoint"],
        run_id=opts["run_id"],
        min_nodes=opts["min_nodes"],
        max_nodes=opts["max_nodes"],
        local_addr=opts.get("local_addr"),
        **conf,
    )


def c10d_handler(params: Any, max_nodes: int) -> Tuple[Any, Any]:
    """torch's handler of a c10d rendezvous, and the store it made at the endpoint."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    poll = poll_interval(max_nodes)
    poll_sooner(dynamic_rendezvous, poll)

    backend, store = create_backend(params)
    handler = dynamic_rendezvous.create_handler(store, backend, params)
    holder = getattr(handler, "_state_holder", None)
    if holder is not None and hasattr(holder, "_cache_duration"):
        holder._cache_duration = poll  # torch keeps a read state for 1 s
    return handler, store


def poll_interval(max_nodes: int) -> float:
    """How often a node reads the rendezvous's shared state while a round forms or runs:
    torch's handler reads it at most once a second; a read is one small get from the store,
    so up to 16 nodes read it every 0.1 s (a round forms within a tenth of a second of its
    last node), and larger jobs less often, up to torch's second."""
    return min(1.0, 0.1 * max(1.0, max_nodes / 16))


def poll_sooner(module: Any, every: float) -> None:
    """The handler's state machine stays torch's; only its waits shrink, in one proportion:
    the wait between two reads of the shared state (1 s) becomes `every`, and the random skew
    before a node joins a round (up to 0.3 s, which spreads many nodes' first writes) shrinks
    by the same factor. A backoff the user asked for (``cas_backoff_max_seconds``) is kept."""
    delay = getattr(module, "_delay", None)
    if delay is None:  # another torch: its own timing
        return

    def quicker(seconds: Any) -> None:  # torch passes it by name
        if seconds == 1:
            seconds = every
        elif isinstance(seconds, tuple) and sys._getframe(1).f_code.co_name == "next_rendezvous":
            seconds = (seconds[0] * every, seconds[1] * every)
        delay(seconds=seconds)

    module._delay = quicker


def assign_ranks(store: Any, group_rank: int, nodes: int, role: str, nproc: int) -> List[int]:
    """Base global rank, world size, base role rank, role world size of a node's ranks:
    torch's agent's own assignment (the same store keys), so torchrun's nodes agree."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    spec = SimpleNamespace(role=role, local_world_size=nproc)
    workers = SimpleElasticAgent._assign_worker_ranks(None, store, group_rank, nodes, spec)
    first = workers[0]
    return [first.global_rank, first.world_size, first.role_rank, first.role_world_size]


def master(
    handler: Any, info: Any, group_rank: int, round_number: int, local_addr: Any
) -> Tuple[str, int, bool]:
    """Where the ranks' store is, and whether it is the agent's (torch's shared one): torch
    publishes the master address once, so in later rounds node 0 publishes a new one under
    ``tether.master`` in the round's store."""
    shared = bool(getattr(handler, "use_agent_store", False))
    boot = info.bootstrap_store_info
    if not shared or round_number == 0:
        return boot.master_addr, int(boot.master_port), shared
    if group_rank == 0:
        from torch.distributed.elastic.utils.distributed import get_free_port

        addr = local_addr or socket.getfqdn()
        info.store.set("tether.master", json.dumps([addr, get_free_port()]))
    addr, port = json.loads(info.store.get("tether.master"))
    return addr, int(port), False
