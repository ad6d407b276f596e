"""A secured Apache Kafka node for tests: SASL_SSL, mTLS, StandardAuthorizer, no auto-create.

One KRaft node (broker and controller) started from the jars ``srl.broker.apache`` fetches,
with four listeners on 127.0.0.1:

* ``SASL_SSL``: SCRAM-SHA-512 (users stored in the cluster metadata, added when the node is
  formatted), PLAIN (users in the listener's JAAS line) and OAUTHBEARER with Kafka's unsecured
  validator (a token is an unsigned JWT whose ``sub`` is the principal);
* ``SSL`` with ``ssl.client.auth=required``: mTLS, the principal is the certificate's CN;
* ``PLAINTEXT``: the broker's own inter-broker listener (principal ``ANONYMOUS``, a super user
  as the controller listener's), and the baseline of the start-time comparison;
* ``CONTROLLER`` (PLAINTEXT).

``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``: a principal can do only
what an ACL allows, and every refusal is an ``is Denied Operation`` line of the node's log.
Certificates are made here with Python's ``cryptography`` (a CA, the node's certificate for
127.0.0.1, one client certificate per mTLS principal, and a second CA nobody trusts), as PEM
files: the node reads PEM key stores (KIP-651), librdkafka reads PEM files.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from srl.broker import apache
from srl.broker.process import kill, last_line, spawn
from srl.kafka.probe import SRL_MARK
from srl.ports import free_port, port_open

ADMIN = ("admin", "admin-secret-7c1e")  # PLAIN, a super user: the admin step of the tests


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class Authority:
    """A certificate authority that signs the node's and the clients' certificates."""

    name: str
    key: ec.EllipticCurvePrivateKey = field(default_factory=_key)

    def __post_init__(self) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(self.name))
            .issuer_name(_name(self.name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, cn: str, server: bool = False) -> tuple[bytes, bytes]:
        """(certificate PEM, PKCS#8 key PEM) of ``cn``; a server's names 127.0.0.1."""
        key, now = _key(), datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
        )
        if server:
            sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return _pem_cert(builder.sign(self.key, hashes.SHA256())), _pem_key(key)

    def write(self, path: Path) -> Path:
        path.write_bytes(_pem_cert(self.cert))
        return path


def oauth_token(config: str) -> tuple[str, float]:
    """A ``kafka_oauth_cb``: the token of the principal ``sasl.oauthbearer.config`` names
    (``principal=NAME``)."""
    settings = dict(kv.split("=", 1) for kv in config.split() if "=" in kv)
    return unsecured_jwt(settings.get("principal", "anonymous"))


def unsecured_jwt(principal: str, lifetime_s: float = 3600.0) -> tuple[str, float]:
    """An unsigned JWT (``alg: none``) Kafka's unsecured OAUTHBEARER validator accepts, and its
    expiry in seconds since the epoch: what an ``oauth_cb`` returns."""

    def b64(d: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    now = time.time()
    claims = {"sub": principal, "iat": int(now), "exp": int(now + lifetime_s)}
    return f"{b64({'alg': 'none'})}.{b64(claims)}.", now + lifetime_s


@dataclass
class SecureNode:
    """The node's addresses, files and users (see the module docstring)."""

    root: Path
    scram: dict[str, str]  # SCRAM-SHA-512 users
    plain: dict[str, str]  # PLAIN users (the admin among them)
    mtls: tuple[str, ...]  # CNs of the client certificates
    ports: dict[str, int] = field(default_factory=dict)
    pid: int | None = None

    @property
    def sasl_ssl(self) -> str:
        return f"127.0.0.1:{self.ports['SASL_SSL']}"

    @property
    def ssl(self) -> str:
        return f"127.0.0.1:{self.ports['SSL']}"

    @property
    def plaintext(self) -> str:
        return f"127.0.0.1:{self.ports['PLAINTEXT']}"

    @property
    def log(self) -> Path:
        return self.root / "kafka.log"

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    @property
    def other_ca(self) -> Path:
        return self.root / "other-ca.pem"

    def client_cert(self, cn: str) -> tuple[Path, Path]:
        return self.root / f"{cn}.crt", self.root / f"{cn}.key"

    # -- client settings ---------------------------------------------------------------------
    def scram_settings(self, user: str) -> dict[str, str]:
        return self.sasl_settings("SCRAM-SHA-512", user, self.scram[user])

    def plain_settings(self, user: str) -> dict[str, str]:
        return self.sasl_settings("PLAIN", user, self.plain[user])

    def sasl_settings(self, mechanism: str, user: str, password: str) -> dict[str, str]:
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": mechanism,
            "sasl.username": user,
            "sasl.password": password,
            "ssl.ca.location": str(self.ca),
        }

    def oauth_settings(self, principal: str) -> dict[str, str]:
        """OAUTHBEARER over SASL_SSL; the token comes from ``kafka_oauth_cb``
        (:func:`oauth_token`)."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": "OAUTHBEARER",
            "sasl.oauthbearer.config": f"principal={principal}",
            "ssl.ca.location": str(self.ca),
        }

    def mtls_settings(self, cn: str) -> dict[str, str]:
        cert, key = self.client_cert(cn)
        return {
            "security.protocol": "SSL",
            "ssl.ca.location": str(self.ca),
            "ssl.certificate.location": str(cert),
            "ssl.key.location": str(key),
        }

    def denied(self) -> list[str]:
        """The authorizer's refusals in the node's log so far (``Principal = User:x is Denied
        operation = …``)."""
        return [line for line in _log(self).splitlines() if "is Denied" in line]


def _write_certificates(node: SecureNode) -> None:
    ca = Authority("srl-test-ca")
    ca.write(node.ca)
    Authority("some-other-ca").write(node.other_ca)
    cert, key = ca.issue("kafka-node", server=True)
    (node.root / "node.pem").write_bytes(key + cert)  # a PEM key store: the key, then the chain
    for cn in node.mtls:
        cert, key = ca.issue(cn)
        crt_path, key_path = node.client_cert(cn)
        crt_path.write_bytes(cert)
        key_path.write_bytes(key)


def _jaas_plain(users: dict[str, str]) -> str:
    admin, password = ADMIN
    pairs = " ".join(f'user_{u}="{p}"' for u, p in users.items())
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{admin}" password="{password}" {pairs};'
    )


def properties(node: SecureNode) -> dict[str, str]:
    p = node.ports
    names = ("PLAINTEXT", "SASL_SSL", "SSL")
    listeners = ",".join(f"{n}://127.0.0.1:{p[n]}" for n in names)
    return apache.server_settings() | {
        "node.id": "1",
        "listeners": f"{listeners},CONTROLLER://127.0.0.1:{p['CONTROLLER']}",
        "advertised.listeners": listeners,
        "listener.security.protocol.map": (
            "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL"
        ),
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.quorum.voters": f"1@127.0.0.1:{p['CONTROLLER']}",
        "log.dirs": str(node.root / "data"),
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "auto.create.topics.enable": "false",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{ADMIN[0]};User:ANONYMOUS",
        "sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN,OAUTHBEARER",
        "listener.name.sasl_ssl.sasl.enabled.mechanisms": "SCRAM-SHA-512,PLAIN,OAUTHBEARER",
        "listener.name.sasl_ssl.plain.sasl.jaas.config": _jaas_plain(node.plain),
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "listener.name.sasl_ssl.oauthbearer.sasl.jaas.config": (
            "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
            'unsecuredLoginStringClaim_sub="admin";'
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(node.root / "node.pem"),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(node.ca),
        "listener.name.ssl.ssl.client.auth": "required",
        "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
    }


def _java(node: SecureNode, main: str, args: list[str], opts: list[str]) -> list[str]:
    return [
        apache.check_java(),
        *opts,
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={apache.dist_file('log4j2.properties')}",
        f"-Dkafka.logs.dir={node.root}",
        "-cp",
        apache.classpath(),
        main,
        *args,
    ]


def foreign_cluster_id() -> str:
    """A cluster id srl's would not be (``srl.kafka.probe.SRL_MARK``): a cluster someone else
    runs, where roles create no topic unless told to."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith(("-", SRL_MARK)):
            return cid


def _format(node: SecureNode, props: Path) -> None:
    args = ["format", "-t", foreign_cluster_id(), "-c", str(props)]
    for user, password in node.scram.items():
        args += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
    cmd = _java(node, "kafka.tools.StorageTool", args, apache.TOOL_JVM_OPTS.split())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-2000:]


JVM_OPTS = "-Xms96m -Xmx512m -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:TieredStopAtLevel=1"


@contextmanager
def secure_node(
    root: Path,
    scram: dict[str, str],
    plain: dict[str, str],
    mtls: tuple[str, ...] = (),
    timeout_s: float = 120.0,
) -> Iterator[SecureNode]:
    """The node for the ``with`` block, stopped (SIGTERM, then SIGKILL) after it."""
    root.mkdir(parents=True, exist_ok=True)
    node = SecureNode(root, scram, {ADMIN[0]: ADMIN[1], **plain}, mtls)
    node.ports = {n: free_port() for n in ("PLAINTEXT", "SASL_SSL", "SSL", "CONTROLLER")}
    _write_certificates(node)
    props = root / "server.properties"
    props.write_text("".join(f"{k}={v}\n" for k, v in properties(node).items()))
    _format(node, props)
    node.pid = spawn(_java(node, apache.MAIN_CLASS, [str(props)], JVM_OPTS.split()), node.log, root)
    marker = str(props).encode()
    try:
        deadline = time.monotonic() + timeout_s
        while not (port_open(node.ports["SASL_SSL"]) and "Kafka Server started" in _log(node)):
            assert time.monotonic() < deadline, f"secure node did not start: {last_line(node.log)}"
            time.sleep(0.2)
        yield node
    finally:
        kill([node.pid], marker, 30.0)


def _log(node: SecureNode) -> str:
    try:
        return node.log.read_text()
    except OSError:
        return ""
