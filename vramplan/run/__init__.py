"""The product's torch side: the tracer (fake tensors, ``vramplan trace``), the live-tensor counter,
the measuring worker and its launcher (``vramplan measure``), the callback the emitted train.py and
users' trainers run, and the stand-ins for CUDA's code paths they share.

Everything under ``vramplan.run`` may import torch; nothing on the estimate path imports it. This
package's own ``__init__`` imports nothing heavy: the launchers (:mod:`vramplan.run.launch`,
:mod:`vramplan.truths.ranks`) use its helpers without loading torch. The truths that verify the
estimate run on this package from :mod:`vramplan.truths`.

May import: util, specs, setup, estimator.
"""

import glob as _glob
import os as _os
import socket as _socket

#: Where DeepSpeed's CPU accelerator puts the shared-memory all-reduce workspace of each rank
#: (csrc/cpu/comm/shm.cpp: ``deepspeed_allreduce_buffer_<n>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``,
#: about 64 MiB each). DeepSpeed never unlinks it, and /dev/shm is RAM: every DeepSpeed process
#: on a CPU leaks one until the machine reboots.
DEEPSPEED_SHM_GLOB = "/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_*"


def release_deepspeed_shm(port: int | str, addr: str = "127.0.0.1") -> int:
    """Unlink the shared-memory buffers DeepSpeed's CPU ranks of the launch on ``addr:port``
    created (call it once those processes have exited); returns how many were removed."""
    removed = 0
    for path in _glob.glob(DEEPSPEED_SHM_GLOB.format(addr=addr, port=port)):
        try:
            _os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it): MASTER_PORT for local ranks."""
    with _socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
