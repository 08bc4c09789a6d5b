"""Tests for the hosts-file parser: what it accepts, and the exact report for each mistake."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest

from clusterrun.config import hostsfile
from clusterrun.config.hostsfile import ClusterSpec, HostSpec, load_cluster, load_cluster_text
from clusterrun.core.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "hosts.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def load(tmp_path: Path, text: str) -> ClusterSpec:
    return load_cluster(write(tmp_path, text))


def fails(tmp_path: Path, text: str, line: int | None, key: str | None, message: str,
          hint: str | None = None) -> ConfigError:
    """Load ``text`` and check the error's fields and its rendered first line exactly."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    err = info.value
    assert (err.path, err.line, err.key, err.message) == (path, line, key, message)
    where = path + (f":{line}" if line is not None else "") + ": " + (f"{key}: " if key else "")
    rendered = err.render().splitlines()
    assert rendered[0] == where + message
    if hint is not None:
        assert len(rendered) == 2 and hint in rendered[1], err.render()
    return err


# -- what is accepted ---------------------------------------------------------------------------


def test_minimal_file_uses_defaults(tmp_path: Path) -> None:
    spec = load(tmp_path, "hosts: [node1]\n")
    assert spec == ClusterSpec(path=str(tmp_path / "hosts.yaml"), hosts=(HostSpec(host="node1", line=1),))
    host = spec.hosts[0]
    assert (host.transport, host.nproc, host.gpus, host.port, host.env) == ("ssh", 1, None, None, {})
    assert (spec.master_addr, spec.master_port, spec.state_dir, spec.ssh_config) == (None, None, None, None)


def test_every_key_is_read(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        state_dir: /var/tmp/cr
        ssh_config: ~/.ssh/cluster_config
        master:
          addr: 10.0.0.1
          port: 29500
        hosts:
          - host: a
            address: 10.0.0.1
            port: 2222
            user: alice
            identity_file: ~/.ssh/id_ed25519
            gpus: [0, "1", GPU-abc-123, MIG-GPU-x/1/0]
            python: /opt/venv/bin/python
            workdir: ~/proj
            env: {A: x}
            transport: ssh
          - host: b
            nproc: 3
            transport: local
        """)
    assert spec.state_dir == "/var/tmp/cr" and spec.ssh_config == "~/.ssh/cluster_config"
    assert (spec.master_addr, spec.master_port) == ("10.0.0.1", 29500)
    a, b = spec.hosts
    assert a == HostSpec(host="a", line=7, address="10.0.0.1", port=2222, user="alice",
                         identity_file="~/.ssh/id_ed25519", gpus=("0", "1", "GPU-abc-123", "MIG-GPU-x/1/0"), nproc=4,
                         python="/opt/venv/bin/python", workdir="~/proj", env={"A": "x"}, transport="ssh")
    assert (b.host, b.line, b.nproc, b.gpus, b.transport) == ("b", 17, 3, None, "local")


def test_master_port_auto_is_none(tmp_path: Path) -> None:
    assert load(tmp_path, "master: {port: auto}\nhosts: [a]\n").master_port is None


def test_defaults_apply_and_host_values_win(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        defaults:
          user: shared
          port: 2200
          python: python3
          transport: local
        hosts:
          - a
          - host: b
            user: own
            port: 22
        """)
    a, b = spec.hosts
    assert (a.user, a.port, a.python, a.transport) == ("shared", 2200, "python3", "local")
    assert (b.user, b.port, b.python, b.transport) == ("own", 22, "python3", "local")


def test_env_merges_top_then_defaults_then_host(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        env: {A: top, B: top, C: top}
        defaults:
          env: {B: defaults, C: defaults}
        hosts:
          - host: h
            env: {C: host, D: host}
          - g
        """)
    assert spec.hosts[0].env == {"A": "top", "B": "defaults", "C": "host", "D": "host"}
    assert spec.hosts[1].env == {"A": "top", "B": "defaults", "C": "defaults"}


def test_env_values_become_strings_as_written(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        hosts: [a]
        env:
          INT: 4
          FLOAT: 1.50
          OCTAL_LOOKING: 010
          CLOCK: 12:30
          QUOTED: "yes"
          SHELLY: 'a b; echo $HOME "x" `id`'
          EMPTY: ""
        """)
    assert spec.hosts[0].env == {"INT": "4", "FLOAT": "1.50", "OCTAL_LOOKING": "010", "CLOCK": "12:30",
                                 "QUOTED": "yes", "SHELLY": 'a b; echo $HOME "x" `id`', "EMPTY": ""}


@pytest.mark.parametrize(("gpus", "expected"), [
    ("2", ("0", "1")),
    ("[3, 1]", ("3", "1")),
    ('["0", "GPU-8f6c2a4e", "MIG-1a2b"]', ("0", "GPU-8f6c2a4e", "MIG-1a2b")),
])
def test_gpus_list_or_count(tmp_path: Path, gpus: str, expected: tuple[str, ...]) -> None:
    host = load(tmp_path, f"hosts:\n  - host: a\n    gpus: {gpus}\n").hosts[0]
    assert host.gpus == expected and host.nproc == len(expected)


def test_nproc_resolution(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        defaults: {nproc: 3}
        hosts:
          - plain
          - {host: counted, nproc: 5}
          - {host: agree, gpus: 3}
          - {host: both, gpus: [4, 5], nproc: 2}
        """)
    assert [h.nproc for h in spec.hosts] == [3, 5, 3, 2]
    spec = load(tmp_path, "hosts:\n  - a\n  - {host: b, gpus: 2}\n")
    assert [h.nproc for h in spec.hosts] == [1, 2]


def test_same_host_on_different_ports_is_allowed(tmp_path: Path) -> None:
    spec = load(tmp_path, "hosts:\n  - {host: a, port: 2201}\n  - {host: a, port: 2202}\n")
    assert [h.port for h in spec.hosts] == [2201, 2202]


def test_anchors_and_aliases_work(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        env: &common {A: "1"}
        hosts:
          - host: a
            env: *common
        """)
    assert spec.hosts[0].env == {"A": "1"}


def test_load_cluster_text_names_the_path(tmp_path: Path) -> None:
    assert load_cluster_text("hosts: [a]\n", "x.yaml").path == "x.yaml"
    with pytest.raises(ConfigError) as info:
        load_cluster_text("hosts: []\n", "x.yaml")
    assert info.value.render().startswith("x.yaml:1: hosts: ")


def test_example_file_loads() -> None:
    spec = load_cluster(str(ROOT / "hosts" / "example.yaml"))
    assert len(spec.hosts) == 4
    used = {name for host in spec.hosts for name in ("address", "port", "user", "identity_file", "gpus",
                                                     "python", "workdir") if getattr(host, name) is not None}
    assert used == {"address", "port", "user", "identity_file", "gpus", "python", "workdir"}
    assert spec.master_addr and spec.state_dir and spec.ssh_config and spec.hosts[0].env


def test_local_file_loads() -> None:
    spec = load_cluster(str(ROOT / "hosts" / "local.yaml"))
    assert [h.host for h in spec.hosts] == ["local-a", "local-b"]
    assert all(h.nproc == 2 and h.transport == "local" for h in spec.hosts)


# -- unknown keys -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line", "key", "name", "hint"), [
    ("host: [a]\n", 1, "host", "host", "did you mean 'hosts'?"),
    ("hosts:\n  - host: a\n    gpu: 2\n", 3, "hosts[0].gpu", "gpu", "did you mean 'gpus'?"),
    ("hosts: [a]\ndefaults:\n  nprocs: 2\n", 3, "defaults.nprocs", "nprocs", "did you mean 'nproc'?"),
    ("hosts: [a]\nmaster:\n  adress: x\n", 3, "master.adress", "adress", "did you mean 'addr'?"),
    ("hosts: [a]\nmaster:\n  zzz: x\n", 3, "master.zzz", "zzz", "valid keys: addr, port"),
    ("hosts: [a]\nbanana: 1\n", 2, "banana", "banana",
     "valid keys: hosts, defaults, env, master, state_dir, ssh_config"),
])
def test_unknown_keys(tmp_path: Path, text: str, line: int, key: str, name: str, hint: str) -> None:
    fails(tmp_path, text, line, key, f"unknown key '{name}'", hint)


@pytest.mark.parametrize("name", ["host", "address"])
def test_defaults_cannot_name_a_host(tmp_path: Path, name: str) -> None:
    fails(tmp_path, f"hosts: [a]\ndefaults:\n  {name}: x\n", 3, f"defaults.{name}",
          f"'{name}' cannot be set in defaults")


# -- wrong types --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line", "key", "expected"), [
    ("hosts:\n  - host: 1234\n", 2, "hosts[0].host", "expected a string, got 1234"),
    ("hosts:\n  - {host: a, address: [x]}\n", 2, "hosts[0].address", "expected a string, got a list"),
    ("hosts:\n  - {host: a, port: '22'}\n", 2, "hosts[0].port", "expected a port number from 1 to 65535, got '22'"),
    ("hosts:\n  - {host: a, user: {x: 1}}\n", 2, "hosts[0].user", "expected a string, got a mapping"),
    ("hosts:\n  - {host: a, identity_file: yes}\n", 2, "hosts[0].identity_file",
     "expected a string, got yes (YAML reads it as a boolean)"),
    ("hosts:\n  - host: a\n    gpus: four\n", 3, "hosts[0].gpus", "expected a list of GPU ids or a count, got 'four'"),
    ("hosts:\n  - {host: a, gpus: '0,1'}\n", 2, "hosts[0].gpus", "expected a list of GPU ids or a count, got '0,1'"),
    ("hosts:\n  - {host: a, nproc: '2'}\n", 2, "hosts[0].nproc",
     "expected a number of processes from 1 to 1024, got '2'"),
    ("hosts:\n  - {host: a, nproc: 2.5}\n", 2, "hosts[0].nproc",
     "expected a number of processes from 1 to 1024, got 2.5"),
    ("hosts:\n  - host: a\n    python:\n", 3, "hosts[0].python", "expected a string, got an empty value"),
    ("hosts:\n  - {host: a, workdir: 1}\n", 2, "hosts[0].workdir", "expected a string, got 1"),
    ("hosts:\n  - {host: a, env: [A=1]}\n", 2, "hosts[0].env", "expected a mapping of NAME: value, got a list"),
    ("hosts:\n  - {host: a, transport: 1}\n", 2, "hosts[0].transport", "expected 'ssh' or 'local', got 1"),
    ("hosts: [a]\nmaster: here\n", 2, "master", "expected a mapping with 'addr' and/or 'port', got 'here'"),
    ("hosts: [a]\nmaster: {addr: 7}\n", 2, "master.addr", "expected a string, got 7"),
    ("hosts: [a]\nmaster: {port: fast}\n", 2, "master.port",
     "expected 'auto' or a port number from 1 to 65535, got 'fast'"),
    ("hosts: [a]\nstate_dir: [x]\n", 2, "state_dir", "expected a string, got a list"),
    ("hosts: [a]\nssh_config: no\n", 2, "ssh_config", "expected a string, got no (YAML reads it as a boolean)"),
    ("hosts: [a]\ndefaults: [x]\n", 2, "defaults", "expected a mapping, got a list"),
    ("hosts: [a]\nenv: x\n", 2, "env", "expected a mapping of NAME: value, got 'x'"),
    ("hosts: {a: 1}\n", 1, "hosts", "expected a non-empty list of hosts, got a mapping"),
    ("hosts:\n  - 12\n", 2, "hosts[0]", "expected a host name or a mapping with 'host', got 12"),
    ("hosts:\n  - [a]\n", 2, "hosts[0]", "expected a host name or a mapping with 'host', got a list"),
    ("hosts:\n  - {host: a, port: 2022-01-01}\n", 2, "hosts[0].port",
     "expected a port number from 1 to 65535, got 2022-01-01 (YAML reads it as a date)"),
])
def test_wrong_types(tmp_path: Path, text: str, line: int, key: str, expected: str) -> None:
    fails(tmp_path, text, line, key, expected)


def test_number_where_a_string_is_expected_hints_to_quote(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: [a]\nstate_dir: 5\n", 2, "state_dir", "expected a string, got 5",
          'put the value in quotes: "5"')


def test_empty_value_for_a_string_hints_to_give_one(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - host: a\n    python:\n", 3, "hosts[0].python", "expected a string, got an empty value",
          "give a value, or remove the key")


def test_non_decimal_integers_are_refused(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - {host: a, port: 0x16}\n", 2, "hosts[0].port",
          "expected a port number from 1 to 65535, got 0x16", "plain decimal")


# -- hosts and host entries ---------------------------------------------------------------------


def test_missing_hosts(tmp_path: Path) -> None:
    fails(tmp_path, "env: {A: b}\n", None, None, "missing required key 'hosts'", "hosts: [node1, node2]")


@pytest.mark.parametrize(("text", "got"), [("hosts: []\n", "an empty list"), ("hosts:\n", "an empty value")])
def test_empty_host_list(tmp_path: Path, text: str, got: str) -> None:
    fails(tmp_path, text, 1, "hosts", f"expected a non-empty list of hosts, got {got}")


def test_entry_without_host(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - a\n  - user: bob\n    nproc: 2\n", 3, "hosts[1]", "missing required key 'host'",
          "'- node1' also works")


@pytest.mark.parametrize(("value", "message"), [
    ('""', "must not be empty"),
    ('"   "', "must not be empty"),
    ('"a b"', "must not contain spaces or control characters, got 'a b'"),
    ('"-oProxyCommand=touch${IFS}/tmp/x"', "must not start with '-', got '-oProxyCommand=touch${IFS}/tmp/x'"),
    ("bob@a", "must not contain '@', got 'bob@a'"),
])
def test_bad_host_names(tmp_path: Path, value: str, message: str) -> None:
    fails(tmp_path, f"hosts:\n  - host: {value}\n", 2, "hosts[0].host", message)


def test_bare_empty_host(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - ''\n", 2, "hosts[0].host", "must not be empty")


def test_user_cannot_look_like_an_option(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - {host: a, user: -x}\n", 2, "hosts[0].user", "must not start with '-', got '-x'")


def test_duplicate_host(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - a\n  - b\n  - host: a\n", 4, "hosts[2].host",
          "host 'a' is listed twice (also at line 2)", "list each machine once")


def test_duplicate_host_and_port_after_defaults(tmp_path: Path) -> None:
    fails(tmp_path, "defaults: {port: 2222}\nhosts:\n  - a\n  - {host: a, port: 2222}\n", 4, "hosts[1].host",
          "host 'a' on port 2222 is listed twice (also at line 3)")


# -- gpus and nproc -----------------------------------------------------------------------------


def test_gpus_and_nproc_disagree(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - a\n  - host: b\n    gpus: 4\n    nproc: 2\n", 5, "hosts[1]",
          "gpus gives 4 processes but nproc is 2", "drop nproc, or make it equal the number of GPUs")


def test_gpus_from_defaults_and_nproc_on_host_disagree(tmp_path: Path) -> None:
    fails(tmp_path, "defaults:\n  gpus: [0, 1]\nhosts:\n  - host: b\n    nproc: 3\n", 5, "hosts[0]",
          "gpus (from defaults, line 2) gives 2 processes but nproc is 3")


def test_nproc_from_defaults_and_gpus_on_host_disagree(tmp_path: Path) -> None:
    fails(tmp_path, "defaults:\n  nproc: 3\nhosts:\n  - host: b\n    gpus: 2\n", 5, "hosts[0]",
          "gpus gives 2 processes but nproc (from defaults, line 2) is 3")


def test_both_from_defaults_disagree_points_at_the_entry(tmp_path: Path) -> None:
    fails(tmp_path, "defaults: {nproc: 3, gpus: 2}\nhosts:\n  - b\n", 3, "hosts[0]",
          "gpus (from defaults, line 1) gives 2 processes but nproc (from defaults, line 1) is 3")


@pytest.mark.parametrize(("value", "key", "message"), [
    ("0", "hosts[0].gpus", "expected a GPU count from 1 to 1024, got 0"),
    ("-2", "hosts[0].gpus", "expected a GPU count from 1 to 1024, got -2"),
    ("100000", "hosts[0].gpus", "expected a GPU count from 1 to 1024, got 100000"),
    ("[]", "hosts[0].gpus", "expected a list of GPU ids or a count, got an empty list"),
    ("[-1]", "hosts[0].gpus[0]", "expected a GPU index (0, 1, ...) or UUID ('GPU-...', 'MIG-...'), got -1"),
    ("[cuda:0]", "hosts[0].gpus[0]", "expected a GPU index (0, 1, ...) or UUID ('GPU-...', 'MIG-...'), got 'cuda:0'"),
    ("[true]", "hosts[0].gpus[0]",
     "expected a GPU index (0, 1, ...) or UUID ('GPU-...', 'MIG-...'), got true (YAML reads it as a boolean)"),
    ("[0, 1, 0]", "hosts[0].gpus[2]", "GPU '0' is listed twice (also at line 3)"),
])
def test_bad_gpus(tmp_path: Path, value: str, key: str, message: str) -> None:
    fails(tmp_path, f"hosts:\n  - host: a\n    gpus: {value}\n", 3, key, message)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_nproc_must_be_positive(tmp_path: Path, value: str) -> None:
    fails(tmp_path, f"hosts:\n  - host: a\n    nproc: {value}\n", 3, "hosts[0].nproc",
          f"expected a number of processes from 1 to 1024, got {value}")


# -- ports and transport ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "65536", "-22"])
def test_port_out_of_range(tmp_path: Path, value: str) -> None:
    fails(tmp_path, f"hosts:\n  - {{host: a, port: {value}}}\n", 2, "hosts[0].port",
          f"expected a port number from 1 to 65535, got {value}")
    fails(tmp_path, f"hosts: [a]\nmaster: {{port: {value}}}\n", 2, "master.port",
          f"expected a port number from 1 to 65535, got {value}")


def test_bad_transport(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: [a]\ndefaults:\n  transport: lcoal\n", 3, "defaults.transport",
          "expected 'ssh' or 'local', got 'lcoal'", "did you mean 'local'?")


# -- env ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "where"), [("1ABC", "env"), ("MY-VAR", "defaults.env"), ("A B", "hosts[0].env")])
def test_bad_env_names(tmp_path: Path, name: str, where: str) -> None:
    text = {"env": f"hosts: [a]\nenv:\n  {name}: x\n",
            "defaults.env": f"hosts: [a]\ndefaults:\n  env:\n    {name}: x\n",
            "hosts[0].env": f"hosts:\n  - host: a\n    env:\n      {name}: x\n"}[where]
    line = text.count("\n")
    fails(tmp_path, text, line, f"{where}.{name}", f"invalid environment variable name {name!r}", "letters, digits")


@pytest.mark.parametrize(("value", "got", "hint"), [
    ("yes", "yes (YAML reads it as a boolean)", 'quote the value: DEBUG: "yes"'),
    ("off", "off (YAML reads it as a boolean)", 'quote the value: DEBUG: "off"'),
    ("", "an empty value", 'quote the value: DEBUG: ""'),
    ("~", "an empty value", 'quote the value: DEBUG: ""'),
    ("[1, 2]", "a list", None),
    ("{a: 1}", "a mapping", None),
])
def test_bad_env_values(tmp_path: Path, value: str, got: str, hint: str | None) -> None:
    fails(tmp_path, f"hosts: [a]\nenv:\n  DEBUG: {value}\n", 3, "env.DEBUG",
          f"expected a string or number, got {got}", hint)


# -- secrets ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line", "key"), [
    ("hosts: [a]\npassword: x\n", 2, "password"),
    ("hosts:\n  - host: a\n    password: hunter2\n", 3, "hosts[0].password"),
    ("hosts: [a]\ndefaults:\n  passphrase: x\n", 3, "defaults.passphrase"),
    ("hosts: [a]\nmaster:\n  sudo_password: x\n", 3, "master.sudo_password"),
    ("hosts:\n  - {host: a, SSH_Password: x}\n", 2, "hosts[0].SSH_Password"),
])
def test_passwords_are_refused(tmp_path: Path, text: str, line: int, key: str) -> None:
    fails(tmp_path, text, line, key, "passwords are not accepted in hosts files", "SSH key")


def test_password_in_env_is_refused(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: [a]\nenv:\n  DB_PASSWORD: x\n", 3, "env.DB_PASSWORD",
          "passwords are not accepted in hosts files", "set them on the host")


# -- YAML itself --------------------------------------------------------------------------------


def test_yaml_syntax_error(tmp_path: Path) -> None:
    err = fails(tmp_path, "hosts:\n  - a\n  - [b\n", 4, None,
                "invalid YAML: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence)")
    assert err.__cause__ is not None


def test_tabs(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n\t- a\n", 2, None,
          "invalid YAML: found character '\\t' that cannot start any token (while scanning for the next token)",
          "spaces, not tabs")


def test_nul_and_lone_surrogates_are_refused(tmp_path: Path) -> None:
    fails(tmp_path, 'hosts: [a]\nenv:\n  A: "x\\0y"\n', 3, "env.A", "must not contain NUL characters")
    fails(tmp_path, 'hosts: ["\\ud800"]\n', 1, "hosts[0]", "is not valid text (it holds a lone surrogate)")


def test_control_character(tmp_path: Path) -> None:
    fails(tmp_path, 'hosts: [a]\nenv: {A: "x\x01"}\n', 2, None, "invalid YAML: unacceptable character #x0001")


def test_several_documents(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: [a]\n---\nhosts: [b]\n", 2, None,
          "invalid YAML: found another document (expected a single document in the stream)")


@pytest.mark.parametrize(("text", "line", "key", "tag"), [
    ("hosts: !!python/object/apply:os.system [echo hi]\n", 1, "hosts", "!!python/object/apply:os.system"),
    ("hosts:\n  - !!python/name:os.system x\n", 2, "hosts[0]", "!!python/name:os.system"),
    ("hosts: [a]\nenv:\n  A: !vault x\n", 3, "env.A", "!vault"),
    ("hosts: [a]\nstate_dir: !!binary aGk=\n", 2, "state_dir", "!!binary"),
])
def test_unsafe_or_unknown_tags(tmp_path: Path, text: str, line: int, key: str, tag: str) -> None:
    fails(tmp_path, text, line, key, f"YAML tag '{tag}' is not allowed", "safe")


@pytest.mark.parametrize(("text", "line", "key", "name", "first"), [
    ("hosts: [a]\nhosts: [b]\n", 2, "hosts", "hosts", 1),
    ("hosts:\n  - host: a\n    nproc: 1\n    nproc: 2\n", 4, "hosts[0].nproc", "nproc", 3),
    ("hosts: [a]\nenv:\n  A: 1\n  B: 2\n  A: 3\n", 5, "env.A", "A", 3),
])
def test_duplicate_mapping_keys(tmp_path: Path, text: str, line: int, key: str, name: str, first: int) -> None:
    fails(tmp_path, text, line, key, f"duplicate key '{name}' (also at line {first})", "keep only the last one")


def test_merge_keys_are_refused(tmp_path: Path) -> None:
    fails(tmp_path, "hosts:\n  - &a {host: a, user: x}\n  - <<: *a\n    host: b\n", 3, "hosts[1]",
          "YAML merge keys ('<<') are not supported", "defaults")


def test_complex_key(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: [a]\n? [x, y]\n: 1\n", 2, None, "a key must be a plain name, got a list")


def test_alias_cycle_does_not_hang(tmp_path: Path) -> None:
    fails(tmp_path, "hosts: &h [*h]\n", 1, "hosts[0]", "expected a host name or a mapping with 'host', got a list")


# -- the file itself ----------------------------------------------------------------------------


def test_file_not_found(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert info.value.render().splitlines()[0] == f"{path}: no such file"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_cluster(str(tmp_path))
    assert info.value.render() == f"{tmp_path}: is a directory, not a hosts file"


def test_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod 000 means nothing to root, so make open() refuse instead.
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(hostsfile, "open", refuse, raising=False)
    with pytest.raises(ConfigError) as info:
        load_cluster(str(tmp_path / "hosts.yaml"))
    assert info.value.message == "cannot read the file: Permission denied"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    fails(tmp_path, text, None, None, "the file is empty")


@pytest.mark.parametrize(("text", "got"), [("- a\n- b\n", "a list"), ("just words\n", "'just words'"),
                                           ("42\n", "42")])
def test_top_level_not_a_mapping(tmp_path: Path, text: str, got: str) -> None:
    fails(tmp_path, text, 1, None, f"the top level must be a mapping with a 'hosts' key, got {got}")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_bytes(b"hosts:\n  - caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_cluster(str(path))
    assert info.value.render() == f"{path}:2: the file is not UTF-8 text"


# -- nothing but ConfigError escapes ------------------------------------------------------------

GARBAGE = [
    "{", "]", "hosts: [", "hosts: {", ": :", "- - -", "? ? ?", "&a *a", "*nope", "hosts: *nope", "%YAML 9.9\n---\n",
    "hosts: !!int x", "hosts: [!!int x]", "hosts: [{host: !!float x}]", "hosts: [{host: a, port: !!int nope}]",
    "hosts: [{host: a, gpus: !!bool maybe}]", "hosts: [{host: a, env: {A: !!bool nope}}]",
    "hosts: !!set {a}", "hosts: !!omap [a: 1]", "hosts: [a]\nenv: !!pairs [a: 1]", "[" * 1000, "a:\n" + " " * 3 + "b",
    "hosts: [a]\n" * 3, "\x00", "\ufeff", "hosts: [null, ~, 1, 1.5, true, [], {}]", "hosts: [{? [a]: 1}]",
    "hosts: [{host: {a: 1}}]", "hosts: [{host: a, gpus: [[0]]}]", "hosts: [{host: a, env: {A: \"\\0\"}}]",
    "hosts: [{host: a, env: {1: 1}}]", "hosts: [{host: a, env: {~: x}}]",
    "hosts: [{host: a, port: 99999999999999999999}]",
    "hosts: [{host: a, gpus: 999999999999999}]", "hosts: [{host: a, nproc: 1e9999}]", "hosts: &x {a: *x}",
    "master: &m {addr: *m}\nhosts: [a]", "hosts: [a]\nmaster: {port: !!str 80}", "hosts: [\"\\ud800\"]",
]


@pytest.mark.parametrize("text", GARBAGE, ids=[text[:40] for text in GARBAGE])
def test_garbage_raises_only_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        load_cluster_text(text, "g.yaml")


def test_mangled_documents_raise_only_config_error() -> None:
    # Cut, duplicate and swap pieces of a valid file; each result must load or fail with ConfigError.
    pieces = (ROOT / "hosts" / "example.yaml").read_text(encoding="utf-8").splitlines(keepends=True)
    rng = random.Random(1234)
    for _ in range(300):
        lines = list(pieces)
        for _ in range(rng.randint(1, 4)):
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            op = rng.randrange(4)
            if op == 0:
                lines[i], lines[j] = lines[j], lines[i]
            elif op == 1:
                del lines[i]
            elif op == 2:
                lines.insert(i, lines[j])
            else:
                cut = rng.randrange(len(lines[i]) + 1)
                lines[i] = lines[i][:cut] + rng.choice(":-[]{}&*!|>'\"#\t ") + lines[i][cut:]
        try:
            load_cluster_text("".join(lines), "m.yaml")
        except ConfigError:
            pass
