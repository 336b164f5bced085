"""Bad input on every `qgpu` subcommand: one readable line naming the option (or file), the value
and the rule, a non-zero exit status, no traceback, and no unbounded work (a simulated-GPU count
of 10^9 once took the host's memory; /dev/zero as a trace never ended)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qgpu_runtime.cli import main
from qgpu_runtime.gpu.simulated import load_config, parse_spec, specs_from_option
from qgpu_runtime.node.pods import FilePodSource
from qgpu_runtime.sim.trace import MAX_LINE_CHARS, TraceError, load_nodes, load_pods

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,2,T4\nn2,64000,262144,4,V100M32\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n"
PODS = POD_HEADER + "p1,1000,1024,1,500,0,100\np2,1000,1024,2,1000,5,50\np3,1000,1024,1,1000,10,60\n"
POD_YAML = ("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: c\n    resources:\n"
            "      limits: {tke.cloud.tencent.com/qgpu-core: \"50\", tke.cloud.tencent.com/qgpu-memory: \"4\"}\n")


def qgpu(capsys, *args: str) -> tuple[int, str]:
    """Exit status and stderr of ``qgpu ARGS`` run in this process (argparse's and SystemExit's
    messages included)."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (print(exc.code, file=sys.stderr) or 1)
    return code, capsys.readouterr().err


def qgpu_process(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qgpu_runtime.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_line(code: int, err: str, *parts: str) -> None:
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    last = lines[-1]  # argparse prints its usage first, then the one message
    for part in parts:
        assert part in last, (part, err)


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(PODS)
    return tmp_path / "nodes.csv", tmp_path / "pods.csv"


# -- qgpu simulate -------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,parts", [
    (["--seeds", "99999999999999999999999999"], ["--seeds", "99999999999999999999999999", "0..9223372036854775807"]),
    (["--seeds", "1-99999999999999999999999999"], ["--seeds", "within 0..9223372036854775807"]),
    (["--gpu-memory", "1000000000000000000"], ["--gpu-memory", "1000000000000000000", "within 0..1048576"]),
    (["--variant-seed", "-1"], ["--variant-seed", "'-1'", "within 0..9223372036854775807"]),
    (["--preemption-seed", "1" * 30], ["--preemption-seed", "within 0..9223372036854775807"]),
    (["--expected", "results.csv"], ["--expected results.csv", "only with --plot"]),
    (["--replay-times"], ["--seeds '1' and --replay-times", "uses no seeds"]),
])
def test_simulate_refuses_out_of_bound_and_meaningless_options(capsys, trace, extra, parts):
    nodes, pods = trace
    code, err = qgpu(capsys, "simulate", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "1", "--no-progress",
                     "--workers", "1", *extra)
    assert code == 2
    one_line(code, err, *parts)


@pytest.mark.parametrize("plot,rule", [(".", "is a directory"), ("missing/x.png", "does not exist")])
def test_simulate_checks_the_plot_path_before_replaying(capsys, trace, tmp_path, plot, rule):
    nodes, pods = trace
    target = str(tmp_path / plot)
    code, err = qgpu(capsys, "simulate", "--nodes", str(nodes), "--pods", str(pods), "--seeds", "1", "--no-progress",
                     "--workers", "1", "--plot", target)
    assert code == 2
    one_line(code, err, f"--plot {target}", rule)


def test_simulate_replay_times_without_seeds_still_runs(capsys, trace):
    nodes, pods = trace
    code, err = qgpu(capsys, "simulate", "--nodes", str(nodes), "--pods", str(pods), "--replay-times", "--no-progress")
    assert code == 0, err


def test_a_trace_row_that_leaves_before_it_arrives_is_refused(tmp_path):
    bad = tmp_path / "pods.csv"
    bad.write_text(POD_HEADER + "p1,1000,1024,1,500,100,50\n")
    with pytest.raises(TraceError, match=r"pods.csv:2: column deletion_time: 50 is before creation_time 100"):
        load_pods(bad)


def test_a_trace_without_line_breaks_is_refused_after_one_bounded_line(tmp_path):
    long = tmp_path / "nodes.csv"
    long.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "n" * (MAX_LINE_CHARS + 10))
    with pytest.raises(TraceError, match=f"nodes.csv:2: a line longer than {MAX_LINE_CHARS} characters"):
        load_nodes(long)


def test_dev_zero_as_a_trace_is_refused_not_read_for_ever(capsys, trace):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    _, pods = trace
    code, err = qgpu(capsys, "simulate", "--nodes", "/dev/zero", "--pods", str(pods), "--seeds", "1", "--no-progress")
    assert code == 2
    one_line(code, err, "/dev/zero:1: a line longer than")


def test_a_trace_with_an_unterminated_quote_or_a_byte_order_mark(tmp_path):
    truncated = tmp_path / "nodes.csv"
    truncated.write_text('sn,cpu_milli,memory_mib,gpu,model\nn1,1000,1,1,"T4')
    with pytest.raises(TraceError, match="nodes.csv:2: not CSV"):
        load_nodes(truncated)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + NODES.encode())
    assert [n.name for n in load_nodes(bom)] == ["n1", "n2"]


# -- qgpu validate -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value,rule", [
    ("--gib-per-shared-pod", "0", "within 1..1024 (GiB)"),
    ("--gib-per-shared-pod", "1000000000000000000", "within 1..1024 (GiB)"),
    ("--max-card-memory", "-5", "within 1..1024 (GiB"),
    ("--max-card-memory", "1000000000000000000", "within 1..1024 (GiB"),
    ("--max-cards-per-node", "17", "within 1..16 (cards of one node)"),
    ("--max-cards-per-node", "nan", "within 1..16"),
])
def test_validate_limits_name_the_option_the_value_and_the_bound(capsys, tmp_path, flag, value, rule):
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(POD_YAML)
    code, err = qgpu(capsys, "validate", flag, value, str(manifest))
    assert code == 2
    one_line(code, err, flag, repr(value), rule)


@pytest.mark.parametrize("content,kind", [("[1, 2, 3]", "a list"), ('"hello"', "a string"), ("5", "a number")])
def test_validate_a_document_that_is_no_object_is_unreadable(capsys, tmp_path, content, kind):
    manifest = tmp_path / "odd.json"
    manifest.write_text(content)
    code, err = qgpu(capsys, "validate", str(manifest))
    assert code == 3
    assert f"{manifest}: document 1 is {kind}, not a Kubernetes object" in err.splitlines()[0]


def test_validate_empty_documents_are_still_nothing(capsys, tmp_path):
    manifest = tmp_path / "pod.yaml"
    manifest.write_text("---\n---\n" + POD_YAML)
    assert qgpu(capsys, "validate", str(manifest))[0] == 0


# -- qgpu run --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a\nb", "x" * 254])
def test_run_refuses_an_empty_long_or_multi_line_name(capsys, tmp_path, name):
    code, err = qgpu(capsys, "run", "--dbfile", str(tmp_path / "meta.db"), "--gpu-backend", "simulated",
                     "--simulated-gpus", "1xT4-16G", "--name", name, "--core", "10", "--memory", "1", "--", "true")
    assert code == 2
    one_line(code, err, "--name", "must have 1..253 printable characters")


@pytest.mark.parametrize("spec,rule", [
    ("1000000000xT4-16G", "count 1000000000 makes 1000000000 cards; a node has at most 16"),
    ("8xT4-16G,9xA10-24G", "'9xA10-24G': count 9 makes 17 cards; a node has at most 16"),
    ("2xT4-100000000000G", "must be within 1..1048576 (1 TiB)"),
    ("9" * 5000 + "xT4-16G", "a node has at most 16"),
    ("1xT4-" + "9" * 5000 + "G", "must be within 1..1048576"),
])
def test_run_bounds_the_simulated_cards(capsys, tmp_path, spec, rule):
    code, err = qgpu(capsys, "run", "--dbfile", str(tmp_path / "meta.db"), "--gpu-backend", "simulated",
                     "--simulated-gpus", spec, "--core", "10", "--memory", "1", "--", "true")
    assert code == 2
    one_line(code, err, "--simulated-gpus", rule)


# -- simulated GPUs (qgpu run, qgpu manager serve) ---------------------------------------------------
def test_simulated_gpu_specs_within_the_bounds_still_parse():
    assert sum(s.count for s in parse_spec("8xT4-16G,8xH200-143771M")) == 16
    assert parse_spec("1xB-1048576M")[0].memory_mib == 1 << 20


@pytest.mark.parametrize("content,message", [
    (b"\xcf\xff\x00binary", "not UTF-8 text"),
    (b"cards:\n- {model: T4, memory_mib: 16384, count: 1000000000}\n", "cards[0]: count 1000000000 makes 1000000000 cards"),
    (b"cards:\n- {model: T4, memory_mib: \"x\"}\n", "cards[0] needs model (a string), memory_mib and count (integers)"),
    (b"cards: [{model: T4, memory_mib: 16384}]\ncontrol: [1]\n", "control must be a file name"),
    (b"cards: [\n", "not valid YAML/JSON"),
])
def test_a_simulated_gpu_config_file_is_checked(tmp_path, content, message):
    config = tmp_path / "gpus.yaml"
    config.write_bytes(content)
    with pytest.raises(ValueError, match="--simulated-gpus: .*" + message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(config)


def test_a_spec_too_long_for_a_path_is_read_as_a_spec():
    with pytest.raises(ValueError, match="a node has at most 16"):
        specs_from_option("9" * 5000 + "xT4-16G")


# -- qgpu manager serve ----------------------------------------------------------------------------
MANAGER = ["manager", "serve", "--nodename", "n1", "--gpu-backend", "simulated", "--simulated-gpus", "1xT4-16G",
           "--no-isolation", "--no-node-labels"]


@pytest.mark.parametrize("extra,parts", [
    (["--metrics-port", "70000"], ["--metrics-port 70000", "1..65535, or -1 for none"]),
    (["--metrics-port", "-2"], ["--metrics-port -2", "1..65535"]),
    (["--log-level", "BOGUS"], ["--log-level 'BOGUS'", "not a level"]),
    (["--metrics-address", "999.1.1.1"], ["--metrics-address '999.1.1.1'", "not an address to listen on"]),
    (["--metrics-address", ""], ["--metrics-address ''", "0.0.0.0 for all interfaces"]),
    (["--nodename", "a b/../c"], ["--nodename 'a b/../c'", "a DNS subdomain"]),
])
def test_manager_refuses_bad_flags_before_it_starts(capsys, tmp_path, extra, parts):
    code, err = qgpu(capsys, *MANAGER, "--dbfile", str(tmp_path / "meta.db"), "--pods-file", str(tmp_path / "pods.json"),
                     *extra)
    assert code == 2
    one_line(code, err, *parts)


@pytest.mark.parametrize("extra,parts", [
    (["--sample-interval", "nan"], ["--sample-interval: nan", "at most 3600 seconds"]),
    (["--sample-interval", "inf"], ["--sample-interval: inf", "at most 3600 seconds"]),
    (["--simulated-gpus", "1000000000xT4-16G"], ["--simulated-gpus", "a node has at most 16"]),
    (["--pods-file", "DIR"], ["--pods-file", "cannot read"]),
    (["--pods-file", "LIST"], ["--pods-file", "must be a JSON list of pod objects"]),
    (["--pods-file", "BINARY"], ["--pods-file", "not UTF-8 text"]),
])
def test_manager_refuses_bad_values_with_one_line(tmp_path, extra, parts):
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    (tmp_path / "binary.json").write_bytes(b"\xcf\xff\x00")
    files = {"DIR": str(tmp_path), "LIST": str(tmp_path / "list.json"), "BINARY": str(tmp_path / "binary.json")}
    extra = [files.get(a, a) for a in extra]
    args = [*MANAGER, "--dbfile", str(tmp_path / "meta.db"), "--metrics-port", "-1",
            "--device-plugin-dir", str(tmp_path), "--state-dir", str(tmp_path)]
    if "--pods-file" not in extra:
        args += ["--pods-file", str(tmp_path / "pods.json")]
    out = qgpu_process(*args, *extra, timeout=60)
    one_line(out.returncode, out.stderr, *parts)
    assert out.returncode == 2


def test_a_pods_file_not_there_yet_is_no_pods(tmp_path):
    assert FilePodSource(tmp_path / "later.json").pods_on_node("n1") == []


# -- qgpu extender serve / qgpu webhook serve ------------------------------------------------------
EXTENDER = ["extender", "serve", "--insecure-plain-http", "--address", "127.0.0.1"]


@pytest.mark.parametrize("extra,parts", [
    (["--max-holds", "1000000000000000000"], ["--max-holds 1000000000000000000", "must be >= 1, at most 100000"]),
    (["--assume-timeout", "nan"], ["--assume-timeout nan", "must be > 0 seconds, at most 3600"]),
    (["--assume-timeout", "inf"], ["--assume-timeout inf", "must be > 0 seconds, at most 3600"]),
    (["--assume-timeout", "1e18"], ["--assume-timeout 1e+18", "must be > 0 seconds, at most 3600"]),
    (["--binder-identity", "a\nb"], ["--binder-identity 'a\\nb'", "printable characters"]),
])
def test_extender_refuses_unbounded_values(capsys, tmp_path, extra, parts):
    code, err = qgpu(capsys, *EXTENDER, "--record-signing-key", str(tmp_path / "key.pem"), *extra)
    one_line(code, err, "qgpu extender serve:", *parts)


def test_extender_names_an_unloadable_kubeconfig(capsys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = tmp_path / "key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    missing = tmp_path / "missing-kubeconfig"
    code, err = qgpu(capsys, *EXTENDER, "--record-signing-key", str(key), "--kubeconfig", str(missing))
    one_line(code, err, f"--kubeconfig {missing}", "cannot load the Kubernetes client configuration")


def test_extender_refuses_an_address_it_cannot_listen_on(capsys, tmp_path):
    code, err = qgpu(capsys, "extender", "serve", "--address", "999.9.9.9", "--record-signing-key", str(tmp_path / "k"),
                     "--tls-cert-file", "c", "--tls-private-key-file", "k", "--client-ca-file", "ca")
    one_line(code, err, "--address '999.9.9.9'", "not an address to listen on")


WEBHOOK = ["webhook", "serve", "--tls-cert-file", "cert.pem", "--tls-private-key-file", "key.pem", "--address", "127.0.0.1"]


@pytest.mark.parametrize("extra,parts", [
    (["--address", "999.9.9.9", "--insecure-no-client-auth"], ["--address '999.9.9.9'", "not an address to listen on"]),
    (["--scheduler-name", "", "--insecure-no-client-auth"], ["--scheduler-name ''", "a DNS subdomain"]),
    (["--scheduler-name", "Bad Name", "--insecure-no-client-auth"], ["--scheduler-name 'Bad Name'", "a DNS subdomain"]),
    (["--pod-quota", "--client-ca-file", "ca.pem", "--quota-ledger-namespace", "BAD"],
     ["--quota-ledger-namespace 'BAD'", "a namespace name"]),
    (["--dra", "--client-ca-file", "ca.pem", "--dra-card-memory-mib", "1000000000000000000"],
     ["--dra-card-memory-mib", "1000000000000000000", "at most 1048576"]),
])
def test_webhook_refuses_bad_values_before_it_reads_anything(capsys, extra, parts):
    code, err = qgpu(capsys, *WEBHOOK, *extra)
    one_line(code, err, "qgpu webhook serve:", *parts)


# -- qgpu status -------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,parts", [
    (["--record-verify-key", "key.pem"], ["--record-verify-key with the store", "only when reading a cluster"]),
    (["--manager-namespace", "qgpu-system"], ["--manager-namespace with the store", "only when reading a cluster"]),
    (["--manager-namespace", "BAD"], ["--manager-namespace 'BAD'", "a namespace name"]),
    (["--node", ""], ["--node ''", "must name a node"]),
])
def test_status_refuses_options_a_store_would_ignore(capsys, tmp_path, extra, parts):
    code, err = qgpu(capsys, "status", "--standalone-db", str(tmp_path / "meta.db"), *extra)
    assert code == 2
    one_line(code, err, *parts)
