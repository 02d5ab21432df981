"""Changes this process's attributes after tether is up (the warden thread, and the zygote
for "forkserver"), then starts children and prints one JSON line: what this process has,
and what each child saw. The CPU affinity is set on the calling thread only, as a user's
thread would, so that a child made from another thread would show it."""

import json
import multiprocessing
import os
import resource
import sys
import tempfile
import threading

import tether


def attributes():
    with open("/proc/self/status") as f:
        umask = next(line.split()[1] for line in f if line.startswith("Umask:"))
    return {
        "umask": umask,
        "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "core": list(resource.getrlimit(resource.RLIMIT_CORE)),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "cwd": os.getcwd(),
        "env": os.environ.get("TETHER_TEST_ATTRIBUTE"),
    }


def report(i, queue, path):
    with open(os.path.join(path, f"file-{i}"), "w"):
        pass
    seen = attributes()
    seen["file_mode"] = oct(os.stat(os.path.join(path, f"file-{i}")).st_mode & 0o777)
    queue.put(seen)


def noop(i):
    pass


def main():
    method = sys.argv[1]
    options = {"start_method": method}
    if method == "forkserver":
        options["preload"] = []
    tether.start_processes(noop, nprocs=1, **options)  # warden (and zygote) running
    path = tempfile.mkdtemp()
    os.umask(0o077)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1000), hard))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(path)
    os.environ["TETHER_TEST_ATTRIBUTE"] = "set after start"
    queue = multiprocessing.get_context("spawn").SimpleQueue()
    result = {}

    def start():
        os.nice(3)  # the calling thread's, as Linux keeps it
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        result["parent"] = attributes()
        tether.start_processes(report, args=(queue, path), nprocs=2, **options)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    result["children"] = [queue.get() for _ in range(2)]
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.chdir("/")
    os.rmdir(path)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
