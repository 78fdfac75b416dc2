"""``fedapp deploy``: a real SuperLink and SuperNodes, with TLS and SuperNode authentication.

Everything a deployment needs lives in one folder (``--dir``, default ``./deployment``)::

    certs/ca.crt, ca.key         the certificate authority (ca.key never leaves this machine)
    certs/server.pem, server.key the SuperLink's TLS certificate, with SANs for its names
    keys/NAME.key, NAME.pub      a SuperNode's ECDSA P-384 key pair (OpenSSH format)
    superlink.db                 the SuperLink's state (registered SuperNodes, runs)
    flwr-home/config.toml        how ``flwr`` reaches the SuperLink (``fedapp deploy connect``)
    superlink-home/, nodes/NAME/ FLWR_HOME of the SuperLink and of SuperNode NAME (the apps
                                 they installed)

Keys and certificates are made with the ``cryptography`` package that Flower already
depends on, so no ``openssl``/``ssh-keygen`` is needed. ``superlink`` and ``supernode`` replace
this process with Flower's own command (``exec``; the SuperNode's through
``fedapp.cli.prompt_supernode``, Flower's with a shorter idle wait), so that stopping them
(Ctrl-C, ``kill``, a service manager) stops Flower itself.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from fedapp.cli.flower import BIN, flower_env, run_status, stage_app, stream_run
from fedapp.cli.prompt_supernode import DEFAULT_POLL_SECONDS, POLL_ENV
from fedapp.cli.run import report_run, resolve_run, resolve_settings, write_run_config
from fedapp.config import PROJECT_ROOT, ConfigError

DEFAULT_DIR = Path("deployment")
CONNECTION = "fedapp"  # the name of the SuperLink connection in flwr-home/config.toml
DEFAULT_SUPERLINK_PORT = 9092
DEFAULT_SUPERNODE_PORT = 9094
IN_MEMORY_STATE = ":flwr-in-memory:"  # flwr 1.41's name for its in-process link state
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


# -- keys and certificates ----------------------------------------------------------------------
def _write_secret(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (created so, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _san(name: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def make_certificates(out: Path, hosts: Sequence[str] = (), days: int = 365) -> dict[str, Path]:
    """A CA and a SuperLink certificate signed by it, valid for loopback and ``hosts``.

    The SAN list always includes localhost and 127.0.0.1: the SuperLink's own ServerApp
    process connects to it there, over the same TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    # Backdated an hour, so that a node whose clock is a little behind accepts it.
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedapp deployment CA")])
    ca_cert = (x509.CertificateBuilder()
               .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA384()))

    names = list(dict.fromkeys([*LOOPBACK_NAMES, *hosts]))  # ordered, without repeats
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(
                       NameOID.COMMON_NAME, hosts[0] if hosts else "localhost")]))
                   .issuer_name(ca_name).public_key(server_key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                  critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA384()))

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    out.mkdir(parents=True, exist_ok=True)
    paths = {"ca": out / "ca.crt", "ca-key": out / "ca.key", "cert": out / "server.pem",
             "key": out / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(paths["ca-key"], key_pem(ca_key))
    paths["cert"].write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(paths["key"], key_pem(server_key))
    return paths


def make_node_key(out: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's ECDSA P-384 key pair in OpenSSH format (what Flower's SuperNode
    authentication reads): ``out/NAME.key`` (private) and ``out/NAME.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private, public = out / f"{name}.key", out / f"{name}.pub"
    _write_secret(private, key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.OpenSSH,
                                             serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH)
                       + f" {name}\n".encode())
    return private, public


# -- the flwr CLI's connection to the SuperLink --------------------------------------------------
def write_connection(flwr_home: Path, address: str, ca: Path) -> Path:
    """``flwr_home/config.toml`` with one SuperLink connection, made the default, so that
    ``FLWR_HOME=flwr_home flwr ls`` (or ``supernode list``, ``log``, ``stop``) reach it."""
    if not ca.is_file():
        raise ConfigError(f"CA certificate {ca} not found (make it with `fedapp deploy certs`)")
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                    f'[superlink.{CONNECTION}]\naddress = "{address}"\n'
                    f'root-certificates = "{ca.resolve()}"\n')
    return path


def connected_env(flwr_home: Path) -> dict[str, str]:
    """The environment for ``flwr`` commands against the connected SuperLink."""
    if not (flwr_home / "config.toml").is_file():
        raise ConfigError(f"no SuperLink connection in {flwr_home}: run `fedapp deploy connect "
                          "HOST:PORT` first")
    return flower_env(flwr_home)


# -- commands -------------------------------------------------------------------------------------
def _exec(cmd: list[str], env: dict[str, str]) -> int:
    """Replace this process with ``cmd`` (see the module doc for why)."""
    print("fedapp:", " ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, env)
    return 1  # not reached


def cmd_certs(args: argparse.Namespace) -> int:
    paths = make_certificates(args.dir / "certs", args.host, args.days)
    print(f"fedapp: CA {paths['ca']} (copy it to every SuperNode and to where you run "
          f"`fedapp deploy run`); SuperLink certificate {paths['cert']} for "
          f"{', '.join(dict.fromkeys([*LOOPBACK_NAMES, *args.host]))}; keep {paths['ca-key']} "
          f"and {paths['key']} private")
    return 0


def cmd_node_key(args: argparse.Namespace) -> int:
    for name in args.names:
        private, public = make_node_key(args.dir / "keys", name)
        print(f"fedapp: {private} (copy to SuperNode {name!r} only) and {public} (register it "
              "on the SuperLink)")
    return 0


def cmd_superlink(args: argparse.Namespace) -> int:
    certs = args.dir / "certs"
    missing = [p for p in ("ca.crt", "server.pem", "server.key") if not (certs / p).is_file()]
    if missing:
        print(f"fedapp: {certs} lacks {missing}; run `fedapp deploy certs` first",
              file=sys.stderr)
        return 2
    cmd = [str(BIN / "flower-superlink"),
           "--ssl-ca-certfile", str(certs / "ca.crt"),
           "--ssl-certfile", str(certs / "server.pem"),
           "--ssl-keyfile", str(certs / "server.key"),
           "--enable-supernode-auth",
           # Else every run `uv sync`s the app's dependencies into a fresh env (~5.5 GB).
           "--disable-runtime-dependency-installation",
           "--host", args.host, "--port", str(args.port),
           # Flower keeps its link state and every message's objects in this database: SQL
           # reads and writes for each object a node sends or fetches. ":flwr-in-memory:" is
           # the state a simulation uses, Python objects in the process, lost with it (Flower's
           # ":memory:" is SQLite in memory, which fails its concurrent commits on 1.41).
           "--database", (IN_MEMORY_STATE if args.state == "memory"
                          else str(args.dir / "superlink.db"))]
    if args.log_file:
        cmd += ["--log-file", str(args.log_file)]
    return _exec(cmd, flower_env(args.dir / "superlink-home"))


def cmd_connect(args: argparse.Namespace) -> int:
    ca = args.ca or args.dir / "certs" / "ca.crt"
    path = write_connection(args.dir / "flwr-home", args.address, ca)
    print(f"fedapp: wrote {path}; plain flwr works with FLWR_HOME={path.parent} "
          f"(e.g. `flwr ls`, `flwr supernode list`)")
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    env = connected_env(args.dir / "flwr-home")
    for key in args.public_keys:
        proc = subprocess.run([str(BIN / "flwr"), "supernode", "register", str(key),
                               "--format", "json"],
                              env=env, capture_output=True, text=True, timeout=120)
        reply = _json_reply(proc.stdout)
        if proc.returncode != 0 or not reply.get("success"):
            why = reply.get("error-message") or (proc.stdout + proc.stderr).strip()
            print(f"fedapp: registering {key} failed: {why}", file=sys.stderr)
            return 1
        print(f"fedapp: registered {key} as SuperNode {reply.get('node-id')}")
    return 0


def _json_reply(stdout: str) -> dict:
    """The JSON object a ``flwr ... --format json`` command printed ({} if none)."""
    try:
        return json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return {}


def cmd_supernode(args: argparse.Namespace) -> int:
    ca = args.ca or args.dir / "certs" / "ca.crt"
    for path in (ca, args.key):
        if not Path(path).is_file():
            print(f"fedapp: {path} not found", file=sys.stderr)
            return 2
    if not args.poll_seconds > 0:
        print(f"fedapp: --poll-seconds {args.poll_seconds} is not a positive number of seconds",
              file=sys.stderr)
        return 2
    if args.threads < 0:
        print(f"fedapp: --threads {args.threads} is not a number of threads (0: all cores)",
              file=sys.stderr)
        return 2
    # Flower's SuperNode looks for a new message every 3 s; ours as often as --poll-seconds
    # says (fedapp/cli/prompt_supernode.py), the same program otherwise.
    cmd = [sys.executable, "-m", "fedapp.cli.prompt_supernode", "--superlink", args.superlink,
           "--root-certificates", str(ca), "--auth-supernode-private-key", str(args.key),
           "--port", str(args.port), "--node-config", args.node_config]
    if args.max_retries is not None:
        cmd += ["--max-retries", str(args.max_retries)]
    # Each SuperNode installs the apps it runs in its own FLWR_HOME, so that several nodes on
    # one machine never write the same folder.
    env = flower_env(args.dir / "nodes" / Path(args.key).stem)
    env[POLL_ENV] = str(args.poll_seconds)
    if args.threads:
        # Read by torch when it starts, in the SuperExec and so in every ClientApp process.
        # Nodes that share a machine's cores need it: two nodes of two threads each on two
        # cores trained several times slower than with one thread each (benchmarks.md, "A
        # deployed round"); simulation gives each virtual client one CPU.
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    if args.clientapp == "forked":
        # Flower's SuperExec would start a fresh interpreter per message; ours forks a warm one
        # (fedapp/cli/warm_superexec.py). It watches this PID, which exec gives the SuperNode,
        # and stops with it; in the same process group, a Ctrl-C stops both at once.
        cmd += ["--isolation", "process"]
        subprocess.Popen([sys.executable, "-m", "fedapp.cli.warm_superexec", "--insecure",
                          "--runtime-api-address", f"127.0.0.1:{args.port}",
                          "--parent-pid", str(os.getpid())], env=env)
    return _exec(cmd, env)


def cmd_run(args: argparse.Namespace) -> int:
    flwr_home = args.dir / "flwr-home"
    try:
        env = connected_env(flwr_home)
        # The dataset is checked by the ServerApp on the SuperLink's machine, not here: this
        # machine may not hold it.
        cfg, changed, run_dir = resolve_run(args)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = write_run_config(changed, run_dir / "run-config.toml")
    print(f"fedapp: {cfg.method} on {cfg.dataset}, {cfg.num_clients} SuperNodes, "
          f"{cfg.num_server_rounds} rounds -> {run_dir}", flush=True)
    app = stage_app(PROJECT_ROOT, flwr_home / "app")
    cmd = [str(BIN / "flwr"), "run", str(app), CONNECTION, "--stream",
           "--run-config", str(overrides)]
    try:
        run_id = stream_run(cmd, env, run_dir / "flwr.log", args.verbose)
        status = run_status(env, run_id) if run_id else "unknown (no run id)"
    except KeyboardInterrupt:
        # Only our view of it stops; the run goes on on the SuperLink (`flwr stop` ends it).
        status = "interrupted"
    return report_run(status, run_dir, results_elsewhere=True)


def cmd_export_shard(args: argparse.Namespace) -> int:
    from fedapp.data.local_data import export_shard
    from strategies import load_config
    try:
        cfg = load_config(resolve_settings(args.preset, args.set)[0])
        out = export_shard(cfg, args.partition_id, args.out)
    except (ConfigError, OSError, RuntimeError, ValueError) as exc:
        print(f"fedapp: {exc}", file=sys.stderr)
        return 2
    print(f"fedapp: partition {args.partition_id} of {cfg.num_clients} ({cfg.dataset}) written "
          f"to {out} (train.npz, test.npz)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``fedapp deploy ...``."""
    deploy = sub.add_parser("deploy", help="a real SuperLink and SuperNodes (TLS, node auth)",
                            description=__doc__.split("\n\n")[0])
    steps = deploy.add_subparsers(dest="step", required=True)

    def step(name: str, func, help: str) -> argparse.ArgumentParser:
        parser = steps.add_parser(name, help=help, description=help)
        # Absolute, because Flower's processes run in other working directories.
        parser.add_argument("--dir", type=lambda p: Path(p).expanduser().resolve(),
                            default=str(DEFAULT_DIR),
                            help="the deployment folder (default: ./deployment)")
        parser.set_defaults(func=func)
        return parser

    def run_settings(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("preset", nargs="?", default=None,
                            help="a preset name in conf/ or a .toml path")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help='override a setting (TOML value: --set method="fedavg")')

    p = step("certs", cmd_certs, "make a CA and the SuperLink's TLS certificate")
    p.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="a name or IP address SuperNodes use to reach the SuperLink "
                        "(repeatable; localhost and 127.0.0.1 are always included)")
    p.add_argument("--days", type=int, default=365, help="validity (default: 365)")

    p = step("node-key", cmd_node_key, "make SuperNode key pairs (ECDSA P-384, OpenSSH)")
    p.add_argument("names", nargs="+", help="one name per SuperNode, e.g. site0 site1")

    p = step("superlink", cmd_superlink,
             "start the SuperLink (TLS, SuperNode authentication, no dependency installation)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 for SuperNodes on other machines")
    p.add_argument("--port", type=int, default=DEFAULT_SUPERLINK_PORT,
                   help=f"its one port for all APIs (default: {DEFAULT_SUPERLINK_PORT})")
    p.add_argument("--log-file", type=Path, help="also write the log there")
    p.add_argument("--state", choices=("database", "memory"), default="database",
                   help="where the SuperLink keeps registered keys, runs and messages: "
                        "DIR/superlink.db (default; they survive a restart) or its memory "
                        "(no database work per message; lost when it stops: register the "
                        "keys again after a restart)")

    p = step("connect", cmd_connect, "tell flwr where the SuperLink is (flwr-home/config.toml)")
    p.add_argument("address", help="the SuperLink as HOST:PORT (a name in its certificate)")
    p.add_argument("--ca", type=Path, help="the CA certificate (default: DIR/certs/ca.crt)")

    p = step("register", cmd_register, "register SuperNode public keys on the SuperLink")
    p.add_argument("public_keys", nargs="+", type=Path, help="NAME.pub files")

    p = step("supernode", cmd_supernode, "start a SuperNode")
    p.add_argument("--superlink", required=True, help="the SuperLink as HOST:PORT")
    p.add_argument("--key", required=True, type=Path, help="this node's private key")
    p.add_argument("--ca", type=Path, help="the CA certificate (default: DIR/certs/ca.crt)")
    p.add_argument("--port", type=int, default=DEFAULT_SUPERNODE_PORT,
                   help=f"its local ClientApp API port, one per node on a machine "
                        f"(default: {DEFAULT_SUPERNODE_PORT})")
    p.add_argument("--node-config", required=True,
                   help="TOML pairs: 'partition-id=0 num-partitions=2', plus optionally "
                        "data-dir=\"/srv/data\" and device=\"cuda:0\"")
    p.add_argument("--max-retries", type=int,
                   help="give up after this many failed connection attempts (default: never)")
    p.add_argument("--clientapp", choices=("forked", "fresh"), default="forked",
                   help="how each message's ClientApp process starts: forked from a process "
                        "that has imported torch and Flower once (default), or a fresh "
                        "interpreter per message, as Flower's own SuperExec does")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of each ClientApp's torch (default 0: torch's own, all "
                        "cores); 1 where several nodes share a machine's cores")
    p.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_SECONDS,
                   help="how long an idle SuperNode waits before it asks the SuperLink for a "
                        f"message again (default: {DEFAULT_POLL_SECONDS}; Flower's own idle wait: 3); right "
                        "after a message it looks after a tenth of it, doubling back")

    p = step("run", cmd_run, "submit an experiment to the SuperLink and follow it")
    run_settings(p)
    p.add_argument("--output-dir", help="results root on the SuperLink's machine "
                                        "(default: ./results)")
    p.add_argument("--verbose", action="store_true", help="show Flower's whole log")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a run started with checkpoint-every > 0 after its last "
                        "checkpoint, e.g. after the SuperLink died (its own settings, read from "
                        "RUN_DIR/config.json: run it where the run folder is)")

    p = step("export-shard", cmd_export_shard,
             "write one partition of a dataset as a SuperNode data-dir")
    run_settings(p)
    p.add_argument("--partition-id", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="the data-dir to write")
