"""`meshrl certs` and `meshrl worker`: a CA and a certificate its key signed, files only their owner
reads, and a worker that will not start without TLS unless told to trust every connection. (The
network-namespace hosts of tests/test_multihost.py train over TLS and refuse a stranger's key.)"""

import stat

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from meshrl.runtime.certs import make_certs, tls_environment


def test_certs_are_signed_by_their_ca_for_the_hosts_named_and_readable_by_their_owner_only(tmp_path):
    files = make_certs(tmp_path / "tls", ["node1", "10.0.0.2"])
    assert [f.name for f in files] == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate(files[0].read_bytes())
    cert = x509.load_pem_x509_certificate(files[2].read_bytes())
    ca.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["node1"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.2"]
    again = make_certs(tmp_path / "tls", ["node3"])  # a second host's certificate, from the same CA
    assert again[0].read_bytes() == files[0].read_bytes()
    assert tls_environment(tmp_path / "tls")["HYPERACTOR_TLS_CA"] == str(files[0])


def test_the_cli_makes_certs_and_a_worker_needs_tls_or_insecure(tmp_path, cli):
    code, out, _ = cli("certs", tmp_path / "c", "--hosts", "a,b")
    assert code == 0 and out.split() == [str(tmp_path / "c" / n) for n in
                                                            ("ca.crt", "ca.key", "tls.crt", "tls.key")]
    for args, message in [
            (["--address", "tls://127.0.0.1:1"], "meshrl worker needs --tls DIR (from `meshrl certs DIR`) or, to "
                                                 "trust every connection, --insecure"),
            (["--address", "tcp://127.0.0.1:1", "--tls", str(tmp_path / "c")],
             "--address tcp://127.0.0.1:1: a worker listens on tls://HOST:PORT (or tcp:// with --insecure)"),
            (["--address", "tls://127.0.0.1:1", "--tls", str(tmp_path)],
             f"{tmp_path} has no ca.crt, tls.crt, tls.key: create them with `meshrl certs {tmp_path}`")]:
        code, _, err = cli("worker", *args)
        assert code == 2 and err.strip().splitlines() == [f"meshrl: error: {message}"]
