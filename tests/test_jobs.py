"""The controller's job records: naming jobs, a state directory that cannot be written, damaged records."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from clusterrun.core.errors import DamagedRecord, JobNotFound
from clusterrun.store.jobs import RECORD_VERSION, Found, JobRecord, JobStore


def record(job_id: str, name: str, created: float, state: str = "running") -> JobRecord:
    return JobRecord(job_id=job_id, name=name, created=created, hosts_file="hosts.yaml", hosts_text="",
                     script="train.py", script_args=[], env_overrides={}, local_cwd="/", grace=1.0,
                     ssh_config=None, plan={}, state=state)


def test_a_reused_name_means_the_job_not_ended_else_the_newest_and_says_which(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    store.create(record("slow-20261123-100000-aaaa", "slow", 1.0, state="succeeded"))
    store.create(record("slow-20261123-110000-bbbb", "slow", 2.0, state="running"))
    store.create(record("slow-20261123-120000-cccc", "slow", 3.0, state="failed"))
    store.create(record("slow-20261123-130000-dddd", "slow", 4.0, state="stopped"))
    store.create(record("solo-20261123-110000-cccc", "solo", 3.0))
    found = store.find("slow")
    assert found.job_id == "slow-20261123-110000-bbbb"
    assert found.note == ("'slow' is job slow-20261123-110000-bbbb (running), the one of 4 jobs of that name that "
                          "has not ended (`clusterrun ps -a` lists them by id)")
    store.update("slow-20261123-110000-bbbb", lambda r: setattr(r, "state", "stopped"))
    found = store.find("slow")
    assert found.job_id == "slow-20261123-130000-dddd" and found.note is not None
    assert "(stopped), the newest of 4 jobs of that name, all ended" in found.note
    assert store.find("solo") == Found("solo-20261123-110000-cccc")  # a name of one job: no note
    assert store.resolve("slow-20261123-100000-aaaa") == "slow-20261123-100000-aaaa"
    assert store.resolve("slow-20261123-11") == "slow-20261123-110000-bbbb"
    with pytest.raises(JobNotFound) as ambiguous:
        store.resolve("slow-2026")
    text = ambiguous.value.render()
    assert "'slow-2026' is ambiguous: it matches 4 jobs: slow-20261123-130000-dddd (stopped), " in text
    assert "hint: name the job by its id" in text


GOOD = "good-20261123-100000-aaaa"
BAD = "bad-20261123-100000-bbbb"


def damage(store: JobStore, how: str) -> Path:
    """Job BAD's record, damaged as ``how`` says."""
    store.create(record(BAD, "bad", 2.0))
    path = store.dir(BAD) / "job.json"
    data = path.read_bytes()
    damaged = {"truncated": data[:100], "empty": b"", "not utf-8": data[:10] + b"\xff" + data[10:],
               "a list": b"[1, 2]", "newer": json.dumps({**json.loads(data), "version": 99}).encode(),
               "another job's": json.dumps({**json.loads(data), "job_id": GOOD}).encode(),
               "unknown field": json.dumps({**json.loads(data), "colour": "red"}).encode(),
               "deleted": b""}[how]
    path.write_bytes(damaged)
    if how == "deleted":  # by a cleanup, after its owner took the job's lock
        store.release(store.try_own(BAD))  # type: ignore[arg-type]
        path.unlink()
    return path


@pytest.mark.parametrize(("how", "reason"), [
    ("truncated", "not JSON at byte 100 of 100: "), ("empty", "empty: 0 bytes"),
    ("not utf-8", "not UTF-8 at byte 10 of "), ("a list", "not a job record: a JSON list, not an object"),
    ("newer", "record version 99, written by a newer clusterrun; this one reads version 1"),
    ("another job's", f"not this job's record: it names job '{GOOD}'"),
    ("unknown field", "unknown field 'colour' (written by a newer clusterrun?)"),
    ("deleted", "missing: the job's directory has no job.json"),
])
def test_a_damaged_record_says_where_and_what_and_is_still_found_by_its_id(tmp_path: Path, how: str,
                                                                           reason: str) -> None:
    store = JobStore(tmp_path / "jobs")
    store.create(record(GOOD, "good", 1.0))
    path = damage(store, how)
    with pytest.raises(DamagedRecord) as caught:
        store.load(BAD)
    assert caught.value.reason.startswith(reason), caught.value.reason
    text = caught.value.render()
    assert text.startswith(f"damaged record: {path} ({reason}") and f"`clusterrun rm {BAD}`" in text
    good, damaged = store.scan()
    assert [r.job_id for r in good] == [GOOD] and [d.job_id for d in damaged] == [BAD]
    assert [r.job_id for r in store.all()] == [GOOD]
    assert store.resolve(BAD) == BAD and store.resolve("bad-2026") == BAD  # by its id or a prefix, not its name
    with pytest.raises(JobNotFound, match="matches 2 jobs: bad-20261123-100000-bbbb \\(damaged\\), "
                                          "good-20261123-100000-aaaa \\(running\\)"):
        store.resolve("")


def test_an_unreadable_record_is_damaged_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = JobStore(tmp_path / "jobs")
    store.create(record(BAD, "bad", 1.0))
    path = store.dir(BAD) / "job.json"
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:  # root reads any file: the EACCES a user meets is made here
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(DamagedRecord) as caught:
        store.load(BAD)
    assert caught.value.reason == "unreadable: Permission denied"
    assert f"chmod 600 {path}" in caught.value.render() and f"clusterrun rm {BAD}" in caught.value.render()
    assert [d.job_id for d in store.scan()[1]] == [BAD]


def test_a_record_without_a_version_is_version_1_and_a_written_one_has_it(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    store.create(record(GOOD, "good", 1.0))
    path = store.dir(GOOD) / "job.json"
    assert json.loads(path.read_bytes())["version"] == RECORD_VERSION
    old = json.loads(path.read_bytes())
    del old["version"]
    path.write_text(json.dumps(old))
    assert store.load(GOOD).version == 1


def test_a_job_directory_being_made_is_no_job_yet_and_a_removed_job_is_gone(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs")
    store.dir(GOOD).mkdir(parents=True)  # `create` between its mkdir and the record's write
    assert store.scan() == ([], [])
    with pytest.raises(JobNotFound):
        store.load(GOOD)
    store.dir(GOOD).rmdir()
    store.create(record(GOOD, "good", 1.0))
    assert store.owned(GOOD) is False  # took and let go of its lock: owner.lock exists now
    store.remove(GOOD)
    assert store.scan() == ([], []) and not store.dir(GOOD).exists()


def test_a_preparing_note_whose_up_is_gone_is_not_listed_and_removed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    from clusterrun.store import preparing

    mine = preparing.Preparing("a-1", "a", ["h0"])
    mine.say("node 0 (h0): setup runs for 45 s")
    gone = preparing.Preparing("b-1", "b", ["h0"])
    gone.data["owner"] = "999999999 1"  # no such process
    gone.say("anything")
    assert [(e.job_id, e.said) for e in preparing.live()] == [("a-1", "node 0 (h0): setup runs for 45 s")]
    assert not gone.path.exists() and oct(mine.path.stat().st_mode & 0o777) == "0o600"
    mine.close()
    assert preparing.live() == []


def test_the_state_dir_is_made_for_this_user_alone_whichever_writes_first(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` writes its preparing note before the job's record: each makes the missing directories 0700."""
    from clusterrun.store import preparing

    for first in ("preparing", "record"):
        home = tmp_path / first
        monkeypatch.setenv("XDG_STATE_HOME", str(home))
        if first == "preparing":
            preparing.Preparing("a-1", "a", ["h0"]).close()
        JobStore().create(record("a-1", "a", 1.0))
        made = [home / "clusterrun", home / "clusterrun" / "jobs", home / "clusterrun" / "jobs" / "a-1"]
        assert [oct(p.stat().st_mode & 0o777) for p in made] == ["0o700"] * 3, first
