"""The GPU view: the agent's ``gpus`` (nvidia-smi read and parsed), its decoding, the poller and the words shown."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import pytest

from clusterrun.agent import gpus as agent_gpus
from clusterrun.agent import serve
from clusterrun.agent.wire import GpusRequest
from clusterrun.config.hostsfile import load_cluster_text
from clusterrun.core.events import GpuReading, NodeGpus
from clusterrun.transports.fake import FakeCluster
from clusterrun.views.gpus import BROKEN, MISSING, GpuPoller, cell, decode, per_gpu

NVIDIA = Path(__file__).parent / "_support" / "nvidia"
REAL = "0, 87, 30123, 81920\n1, 85, 29876, 81920\n"  # nvidia-smi's own output for the query, two A100s


def test_nvidia_smis_rows_are_parsed_with_na_fields_as_none() -> None:
    assert agent_gpus.parse_gpus(REAL + "2, [N/A], 100, [Not Supported]\n") == [
        {"index": 0, "util": 87, "mem_used": 30123, "mem_total": 81920},
        {"index": 1, "util": 85, "mem_used": 29876, "mem_total": 81920},
        {"index": 2, "util": None, "mem_used": 100, "mem_total": None}]
    with pytest.raises(ValueError, match=r"nvidia-smi printed '\| NVIDIA-SMI 470"):
        agent_gpus.parse_gpus("| NVIDIA-SMI 470.57.02 |\n")


@pytest.mark.parametrize(("folder", "found", "count", "problem"), [
    ("good", True, 2, ""),
    ("broken", True, 0, "nvidia-smi exited with status 9: NVIDIA-SMI has failed because it couldn't communicate"),
    ("garbage", True, 0, "nvidia-smi printed '+-----"),
    (None, False, 0, ""),
])
def test_the_agent_runs_the_first_nvidia_smi_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     folder: str | None, found: bool, count: int,
                                                     problem: str) -> None:
    monkeypatch.setenv("PATH", f"{NVIDIA / folder}:/usr/bin:/bin" if folder else str(tmp_path))
    answer = serve.answer(json.dumps(GpusRequest().to_json()).encode())
    assert answer is not None and answer["ok"] is True and answer["found"] is found
    assert len(answer["gpus"]) == count and answer["problem"].startswith(problem)
    reading = decode(0, "h", answer)
    assert reading.missing is not found and len(reading.gpus) == count


def test_a_hung_nvidia_smi_is_killed_after_the_timeout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hung = tmp_path / "nvidia-smi"
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    answer = agent_gpus.op_gpus(GpusRequest(timeout=0.2))
    assert answer["gpus"] == [] and answer["problem"] == "nvidia-smi did not answer within 0.2 s"


def test_the_cell_and_the_per_gpu_words() -> None:
    two = NodeGpus(0, host="h", gpus=(GpuReading(0, 87, 30123, 81920), GpuReading(1, 85, 29876, 81920)))
    assert cell(two) == "2× 86% 59/160G"
    assert per_gpu(two) == ["gpu0 87% 29/80G", "gpu1 85% 29/80G"]
    small = NodeGpus(0, host="h", gpus=(GpuReading(0, None, 512, 8192),))
    assert cell(small) == "1× ? 0.5/8.0G"
    assert cell(NodeGpus(0, host="h", missing=True)) == MISSING
    broken = NodeGpus(0, host="h", problem="nvidia-smi exited with status 9")
    assert cell(broken) == BROKEN and per_gpu(broken) == ["nvidia-smi exited with status 9"]
    assert cell(None) == "" and per_gpu(None) == []


def test_the_poller_reads_each_host_and_marks_only_the_broken_ones() -> None:
    fake = FakeCluster()
    fake.host("a").gpu_query = REAL
    fake.host("b").gpu_query, fake.host("b").gpu_problem = REAL, "nvidia-smi exited with status 9"
    fake.host("c")  # no nvidia-smi
    fake.host("d").gpu_query = "garbage\n"
    fake.host("e").gpu_query = REAL
    fake.host("e").drop()  # unreachable: its node's state says so; no GPU reading, not a GPU problem
    spec = load_cluster_text("hosts: [a, b, c, d, e]\n")
    got: queue.SimpleQueue[NodeGpus] = queue.SimpleQueue()
    transports = [fake.transport(h) for h in spec.hosts]
    poller = GpuPoller(lambda: transports, got.put, interval=0.05)
    poller.start()
    seen = {}
    while len(seen) < 4:
        event = got.get(timeout=10)
        seen[event.node] = event
    assert seen[3].problem.startswith("nvidia-smi printed 'garbage'")
    fake.host("d").gpu_query = REAL  # mended: the poller goes on reading past a broken nvidia-smi
    while cell(seen[3]) == BROKEN:
        event = got.get(timeout=10)
        seen[event.node] = event
    poller.stop()
    assert 4 not in seen and fake.host("e").connects >= 1
    assert [cell(seen[rank]) for rank in range(4)] == ["2× 86% 59/160G", BROKEN, MISSING, "2× 86% 59/160G"]
    assert [seen[rank].host for rank in range(4)] == ["a", "b", "c", "d"]


def test_a_node_shows_only_its_own_gpus_where_they_are_indices() -> None:
    from clusterrun.core.events import AttemptStarted
    from clusterrun.views.board import Board
    from clusterrun.views.gpus import only

    four = NodeGpus(0, host="h", gpus=tuple(GpuReading(i, 10 * i, 1024, 8192) for i in range(4)))
    assert [g.index for g in only(four, ("2", "3")).gpus] == [2, 3]
    assert only(four, None) == four and only(four, ("GPU-aaaa",)) == four  # UUIDs: every GPU of the host
    board = Board(ring=10)
    board.apply(AttemptStarted(None, job_id="j", name="j", attempt=1, master_addr="a", master_port=1, world_size=2,
                               nodes=(("h", 2, "2,3"),)))
    board.apply(four)
    assert cell(board.nodes[0].gpus) == "2× 25% 2.0/16G"  # GPUs 2 and 3, not the host's other two
