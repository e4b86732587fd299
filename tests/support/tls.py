"""A throwaway CA and a server certificate for ``localhost``/``127.0.0.1`` (trustme), for
the proxy over HTTPS."""

from __future__ import annotations

import ssl
from pathlib import Path


class Certs:
    """PEM files of a throwaway CA and of a server certificate it issued."""

    def __init__(self, root: Path) -> None:
        import trustme

        root.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        leaf = ca.issue_cert("localhost", "127.0.0.1")
        self.ca = root / "ca.pem"
        self.cert = root / "cert.pem"  # the leaf, then its chain
        self.key = root / "key.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        for i, pem in enumerate(leaf.cert_chain_pems):
            pem.write_to_path(str(self.cert), append=i > 0)
        leaf.private_key_pem.write_to_path(str(self.key))
        other = trustme.CA().issue_cert("localhost")  # a key that does not match self.cert
        self.other_key = root / "other-key.pem"
        other.private_key_pem.write_to_path(str(self.other_key))

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def args(self) -> tuple[str, ...]:
        return ("--tls-cert", str(self.cert), "--tls-key", str(self.key))
