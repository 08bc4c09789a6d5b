"""Node sets: ClusterShell's expansion in the order written, and our errors with the position."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from clusterrun.config.hostsfile import load_cluster
from clusterrun.config.nodesets import MAX_HOSTS, NodeSetError, expand, fold, fold_ranks, size
from clusterrun.config.selection import load_hosts
from clusterrun.core.errors import ConfigError


@pytest.mark.parametrize(("expression", "names"), [
    ("gpu[01-08]", [f"gpu0{i}" for i in range(1, 9)]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("rack[1-2]-n[1-4]", [f"rack{r}-n{n}" for r in (1, 2) for n in (1, 2, 3, 4)]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),  # the padding is kept across the carry
    ("b,a,gpu[2-3]", ["b", "a", "gpu2", "gpu3"]),  # the order written: node ranks follow it
    ("a,a", ["a"]),
    ("gpu01:[0-1]", ["gpu01:0", "gpu01:1"]),
    ("single", ["single"]),
])
def test_expansion_keeps_padding_and_order(expression: str, names: list[str]) -> None:
    assert expand(expression) == names


@pytest.mark.parametrize(("expression", "column", "reason"), [
    ("gpu[01-", 4, "missing bracket"),
    ("gpu[3-1]", 5, 'bad range "3-1"'),
    ("a,gpu[1-x]", 7, 'bad range "1-x"'),
    ("x,gpu]", 6, "illegal closing bracket"),
    ("a,,b", 3, "an empty name"),
    ("a!b", 2, "'!' is not allowed in a node set"),
    ("@racks", 1, "'@' is not allowed in a node set"),
    ("a b", 2, "a space is not allowed in a node set"),
])
def test_errors_name_the_position(expression: str, column: int, reason: str) -> None:
    with pytest.raises(NodeSetError) as info:
        expand(expression)
    assert (info.value.column, info.value.reason) == (column, reason)
    assert info.value.pointer.splitlines()[1] == " " * (column - 1) + "^"


def test_fold_is_the_short_form() -> None:
    assert fold(["gpu01", "gpu02", "gpu03", "gpu07"]) == "gpu[01-03,07]"


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_fold_of_names_with_one_number_is_clustershells_without_importing_its_node_sets() -> None:
    """``fold`` folds ``prefix`` + one unpadded number itself (``up``'s status lines past FOLD_PAST
    nodes): the same text as ClusterShell's ``NodeSet`` for any names, padded, mixed or suffixed
    ones too, and no import of ``ClusterShell.NodeSet`` for the simple ones."""
    import random
    import subprocess
    import sys

    from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet

    rng = random.Random(26)
    prefixes = ["sim", "gpu", "n", "node-", "a.b", "x_", "rack1-n", "", "GPU", "h."]
    for _ in range(500):
        chosen = rng.sample(prefixes, rng.randint(1, 2))
        names = [rng.choice(chosen) + (str(n) if rng.random() < 0.9 else f"{n:03d}")
                 + ("" if rng.random() < 0.95 else rng.choice([".lan", "a", "-ib"]))
                 for n in (rng.randint(0, rng.choice([9, 40, 5000])) for _ in range(rng.randint(1, 40)))]
        assert fold(names) == str(NodeSet.fromlist(names, resolver=RESOLVER_NOGROUP)), names
    check = ("import sys; from clusterrun.config.nodesets import fold; "
             "assert fold([f'sim{i}' for i in range(64, 0, -1)] + ['sim9']) == 'sim[1-64]'; "
             "assert fold(['gpu7', 'gpu7']) == 'gpu7'; assert 'ClusterShell.NodeSet' not in sys.modules")
    subprocess.run([sys.executable, "-c", check], check=True)


def test_a_hosts_file_entry_may_be_a_node_set(tmp_path: Path) -> None:
    spec = load_cluster(_write(tmp_path, """\
        defaults: {user: trainer}
        hosts:
          - gpu[01-02]
          - host: rack[1-2]-n1
            gpus: [0, 1, 2]
          - "login,head"
    """))
    assert [(h.host, h.nproc, h.line) for h in spec.hosts] == [
        ("gpu01", 1, 3), ("gpu02", 1, 3), ("rack1-n1", 3, 4), ("rack2-n1", 3, 4), ("login", 1, 6), ("head", 1, 6)]
    assert {h.user for h in spec.hosts} == {"trainer"}
    assert spec.hosts[2].gpus == ("0", "1", "2")


@pytest.mark.parametrize(("text", "line", "key", "message"), [
    ("hosts:\n  - gpu[01-\n", 2, "hosts[0].host", "invalid node set: missing bracket at position 4 of 'gpu[01-'"),
    ("hosts:\n  - a\n  - host: 'x,n[5-2]'\n", 3, "hosts[1].host",
     "invalid node set: bad range \"5-2\" at position 5 of 'x,n[5-2]'"),
    ("hosts:\n  - gpu[1-3]\n  - gpu2\n", 3, "hosts[1].host",
     "host 'gpu2' is listed twice (also at line 2, as 'gpu[1-3]')"),
    ("hosts:\n  - {host: 'n[1-2]', address: 10.0.0.1}\n", 2, "hosts[0].address",
     "'address' names one machine, but 'n[1-2]' is 2 hosts"),
])
def test_node_set_mistakes_name_file_and_line(tmp_path: Path, text: str, line: int, key: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert (info.value.path, info.value.line, info.value.key, info.value.message) == (path, line, key, message)


def test_ranks_fold_into_runs_in_words() -> None:
    assert fold_ranks([3]) == "node 3"
    assert fold_ranks(list(range(62))) == "nodes 0-61"
    assert fold_ranks([9, 0, 1, 2, 5, 7, 8]) == "nodes 0-2,5,7-9"


def test_a_set_is_counted_before_it_is_expanded_and_capped() -> None:
    """ClusterShell expands a set before it counts it (a million names: seconds and most of a GB)."""
    assert [size(e) for e in ("a", "gpu[01-08]", "r[1-2]-n[1-4]", "gpu[01-04,07],login", "x[1-10/2]")] == [
        1, 8, 8, 6, 5]
    assert size("h[1-99999999999999999999]") == 99999999999999999999  # counted, never expanded
    with pytest.raises(NodeSetError) as info:
        expand("h[1-99999999999999999999]")
    assert info.value.reason == "99,999,999,999,999,999,999 names, more than the 10,000 allowed"
    assert len(expand("h[1-3],g[1-9997]")) == MAX_HOSTS


def test_a_hosts_file_holds_at_most_ten_thousand_hosts(tmp_path: Path) -> None:
    assert len(load_cluster(_write(tmp_path, "hosts: ['h[1-9999]', login]\n")).hosts) == MAX_HOSTS
    with pytest.raises(ConfigError) as info:
        load_cluster(_write(tmp_path, "hosts: ['h[1-9999]', login, extra]\n"))
    assert (info.value.line, info.value.key, info.value.message) == (
        1, "hosts[2].host", "'extra' makes 10,001 hosts in all; a hosts file may have at most 10,000")


def test_w_refuses_a_set_bigger_than_any_hosts_file_before_expanding_it(tmp_path: Path) -> None:
    path = _write(tmp_path, "hosts: ['h[1-3]']\n")
    with pytest.raises(ConfigError) as info:
        load_hosts(path, "h[1-99999999999999999999]", None)
    assert info.value.render() == ("--nodes: 'h[1-99999999999999999999]' is 99,999,999,999,999,999,999 names; a node "
                                   "set may have at most 10,000")
