"""workers/transfer/pair.py:new_process_group, the one place that uses torch's private
process-group options: a real 2-rank gloo group outside torch.distributed's global state, its
timeout honoured, and a torch without those options refused with a message naming the place."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from workers.transfer import pair
from workers.transfer.pair import new_process_group


def _two_ranks(timeout_s: float = 30.0):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups: dict[int, dist.ProcessGroup] = {}

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
        groups[r] = new_process_group(
            dist.PrefixStore("t", store), r, 2, "gloo", datetime.timedelta(seconds=timeout_s), bind_host="127.0.0.1"
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return server, groups


def test_a_gloo_pair_sends_and_receives():
    _server, groups = _two_ranks()
    assert set(groups) == {0, 1} and not dist.is_initialized()  # no global state touched
    sent = torch.arange(1000, dtype=torch.float32)
    got = torch.zeros_like(sent)
    work = groups[0].send([sent], 1, 7)
    groups[1].recv([got], 0, 7).wait()
    work.wait()
    assert torch.equal(got, sent)


def test_its_timeout_bounds_a_receive_without_a_sender():
    _server, groups = _two_ranks(timeout_s=1.0)
    with pytest.raises(RuntimeError):  # the group's own 1 s timeout ends it (a hang fails by pytest's timeout)
        groups[1].recv([torch.zeros(4)], 0, 9).wait()


def test_a_torch_without_the_private_options_is_refused_by_name(monkeypatch):
    monkeypatch.delattr(pair.dist.ProcessGroupGloo, "_Options")
    store = dist.HashStore()
    with pytest.raises(RuntimeError, match="new_process_group"):
        new_process_group(store, 0, 1, "gloo", datetime.timedelta(seconds=1))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gloo or nccl"):
        new_process_group(dist.HashStore(), 0, 1, "mpi", datetime.timedelta(seconds=1))
