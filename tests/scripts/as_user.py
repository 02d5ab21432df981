"""``as_user.py UID NPROC PROGRAM ARGS...``: runs PROGRAM as user UID under RLIMIT_NPROC =
NPROC. The user keeps only the capabilities to read and write any file (through exec too,
so that it can still run this interpreter): the process limit binds it as it binds any
user, where it does not bind root."""

import ctypes
import os
import resource
import sys

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
PR_SET_KEEPCAPS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 8, 47, 2


def become(uid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    caps = 1 << CAP_DAC_OVERRIDE | 1 << CAP_DAC_READ_SEARCH
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)(caps, caps, caps, 0, 0, 0)
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_RAISE)")


def main() -> None:
    uid, limit = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    become(uid)
    os.execv(sys.argv[3], sys.argv[3:])


if __name__ == "__main__":
    main()
