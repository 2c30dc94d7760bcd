"""`meshrl certs DIR`: a certificate authority and one key and certificate signed by it, for mutual
TLS between a controller and its Monarch workers. Whoever holds a key the CA signed is trusted by
the others (the controller and every worker hold one, and the CA's certificate to check theirs):
keep DIR private, and create a new one for each cluster or group of users.

Files (PEM, written by the `cryptography` package, readable by their owner only):
  ca.crt   the CA's certificate: what every side checks the others' certificates against
  ca.key   the CA's key: only needed to sign more certificates (`meshrl certs DIR --hosts ...` again)
  tls.crt  a certificate for the listed host names and IP addresses, signed by the CA
  tls.key  its private key
"""

import datetime
import ipaddress
import os
from pathlib import Path

FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key")


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _names(hosts: list[str]):
    from cryptography import x509

    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_certs(where: Path, hosts: list[str], days: int = 365) -> list[Path]:
    """Write a CA (unless `where` has one: then its key signs) and a key and certificate for `hosts`
    (host names or IP addresses the workers and the controller are reached by). Returns the files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    where.mkdir(parents=True, exist_ok=True)
    os.chmod(where, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    pem = serialization.Encoding.PEM
    private = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
                   encryption_algorithm=serialization.NoEncryption())
    if (where / "ca.key").is_file() and (where / "ca.crt").is_file():
        ca_key = serialization.load_pem_private_key((where / "ca.key").read_bytes(), password=None)
        ca = x509.load_pem_x509_certificate((where / "ca.crt").read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshrl CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=days))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False, data_encipherment=False,
                                           key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
              .sign(ca_key, hashes.SHA256()))
        _write(where / "ca.key", ca_key.private_bytes(**private))
        _write(where / "ca.crt", ca.public_bytes(pem))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "meshrl")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(_names(hosts or ["localhost", "127.0.0.1"])), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(where / "tls.key", key.private_bytes(**private))
    _write(where / "tls.crt", cert.public_bytes(pem))
    return [where / name for name in FILES]


def tls_environment(where: Path) -> dict[str, str]:
    """The environment that makes Monarch's `tls` transport use the files in `where`."""
    missing = [name for name in ("ca.crt", "tls.crt", "tls.key") if not (where / name).is_file()]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)}: create them with `meshrl certs {where}`")
    return tls_files_environment(where / "ca.crt", where / "tls.crt", where / "tls.key")


def tls_files_environment(ca: Path, cert: Path, key: Path) -> dict[str, str]:
    """The environment that makes Monarch's `tls` transport check peers against `ca` and present `cert`
    and `key` (it reads these at import: a process already running must reload them)."""
    return {"HYPERACTOR_TLS_CA": str(ca), "HYPERACTOR_TLS_CERT": str(cert), "HYPERACTOR_TLS_KEY": str(key)}
