"""Where a launcher's train ranks meet: a torch.distributed ``TCPStore`` served on a port the OS gives it.

A port picked, released and bound again later can be taken in between by another process (``EADDRINUSE``); a store
that binds port 0 itself and hands over the port it got cannot. The ranks join it as clients
(``TrainWorker(..., store_hosted=True)``, which waits for all of them under the rendezvous timeout).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

#: how long the store waits on a rank's request: the training side's rendezvous bound
#: (``slime_ext.training.parallel.RENDEZVOUS_TIMEOUT_S``; the training layer is not imported from here)
STORE_TIMEOUT_S = 600.0


def host_store(master_addr: str = "127.0.0.1") -> Any:
    """A ``TCPStore`` this process serves on a free port (its ``.port``); keep it alive until the ranks have
    joined."""
    import torch.distributed as dist

    return dist.TCPStore(master_addr, 0, None, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=STORE_TIMEOUT_S))
