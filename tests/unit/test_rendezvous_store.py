"""Ports bound, not guessed: a launcher's store binds port 0 and hands over the port it got; the ranks join it and
wait for each other; port 0 without a launcher's store is refused for more than one process."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

pytest.importorskip("torch")
from slime_ext.training.parallel import JOINED_KEY, host_store, hosted_store_env, join_store  # noqa: E402

TIMEOUT = timedelta(seconds=30)


def test_ranks_join_the_launchers_store_on_the_port_it_was_given():
    store = host_store()
    assert store.port > 0  # bound by the OS before anyone was told
    joined: dict[int, object] = {}

    def rank(r: int) -> None:
        joined[r] = join_store("127.0.0.1", store.port, r, 2, store_hosted=True, timeout=TIMEOUT)

    late = threading.Thread(target=rank, args=(1,))
    late.start()
    rank(0)  # returns only once rank 1 has arrived too
    late.join(timeout=60)
    assert sorted(joined) == [0, 1]
    assert store.get(f"{JOINED_KEY}/0") == b"1" and store.get(f"{JOINED_KEY}/1") == b"1"


def test_a_one_process_job_serves_its_own_store_on_port_0():
    store = join_store("127.0.0.1", 0, 0, 1, store_hosted=False, timeout=TIMEOUT)
    assert store.port > 0


def test_port_0_for_several_ranks_without_a_launchers_store_is_refused():
    with pytest.raises(ValueError, match="master_port=0 with world_size=2: .*host_store"):
        join_store("127.0.0.1", 0, 0, 2, store_hosted=False, timeout=TIMEOUT)


def test_env_rendezvous_ranks_are_told_to_join_as_clients():
    store = host_store()
    assert hosted_store_env(store) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                                       "TORCHELASTIC_USE_AGENT_STORE": "True"}
