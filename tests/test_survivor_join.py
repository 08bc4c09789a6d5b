"""The survivor's move into its attempt's cgroup, written by a child while the survivor goes on with
the start (survivor.Survivor._start_joining/_joined): where the move fails, the start goes on with no
cgroup and says why, as it did when the survivor wrote it itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

from clusterrun.agent.survivor import Survivor


def _survivor(tmp_path: Path, cgroup: Path) -> Survivor:
    folder = tmp_path / "attempt1"
    folder.mkdir()
    (folder / "spec.json").write_text(json.dumps({"job": "j", "node": 0, "attempt": 1, "argv": ["true"],
                                                  "env": {}, "cgroup": str(cgroup), "fallbacks": []}))
    return Survivor(str(folder))


def test_a_move_that_fails_leaves_no_cgroup_and_says_why(tmp_path: Path) -> None:
    cgroup = tmp_path / "not-a-cgroup"  # a directory without cgroup.procs: the child's open fails
    (cgroup / "job").mkdir(parents=True)
    survivor = _survivor(tmp_path, cgroup)
    child = survivor._start_joining()
    assert child > 0
    survivor._joined(child)
    assert survivor.cgroup is None and survivor.job_cgroup is None and survivor.state["cgroup"] is None
    assert survivor.state["fallbacks"] == [f"no cgroup: cannot join {cgroup}: {os.strerror(2)}"]
    assert not cgroup.exists()  # removed, as the agent made it for nothing


def test_without_a_cgroup_nothing_is_forked(tmp_path: Path) -> None:
    folder = tmp_path / "attempt1"
    folder.mkdir()
    (folder / "spec.json").write_text(json.dumps({"job": "j", "node": 0, "attempt": 1, "argv": ["true"],
                                                  "env": {}, "cgroup": None, "fallbacks": ["no cgroup: x"]}))
    survivor = Survivor(str(folder))
    assert survivor._start_joining() == 0
    survivor._joined(0)
    assert survivor.state["cgroup"] is None and survivor.state["fallbacks"] == ["no cgroup: x"]
