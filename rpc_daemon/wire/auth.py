"""Shared-secret mutual authentication of a connection, sans I/O.

With a secret configured on the daemon, HELLO becomes a four-message
challenge-response (docs/security.md has the rationale):

    C -> S  HELLO  {version, features, auth_nonce: Nc}
    S -> C  reply  status NOT_AUTHORIZED, auth: {method: "hmac-sha256", nonce: Ns}
                   ("pending": the connection stays open for exactly one AUTH)
    C -> S  AUTH   {proof: HMAC-SHA256(K, CLIENT_LABEL || Nc || Ns)}
    S -> C  reply  status SUCCESS, the usual HELLO fields,
                   proof: HMAC-SHA256(K, SERVER_LABEL || Nc || Ns)

Nc and Ns are 32 fresh random bytes each (secrets.token_bytes). The client
proves it knows K first; the server reveals its own proof only to a client that
did, so an unauthenticated peer learns nothing it could attack offline. The
labels differ, so one side's proof can never be reflected as the other's. A
recorded handshake replayed on a new connection fails: the server picks a new
Ns for every connection. Proofs are compared with hmac.compare_digest.

A HELLO without auth_nonce, a wrong proof, or anything but AUTH after the
challenge gets NOT_AUTHORIZED and the connection is closed; nothing is ever
allocated for a connection before it is authenticated.

Everything here is pure: nonces come from `secrets`, no sockets.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import math
import os
import secrets as _secrets
import stat

from rpc_daemon.wire.protocol import PROTOCOL_VERSION, ProtocolError, Status

METHOD = "hmac-sha256"
NONCE_LEN = 32
PROOF_LEN = hashlib.sha256().digest_size
MIN_SECRET_LEN = 32
ENV_VAR = "GGML_RPC_SECRET"
CLIENT_LABEL = f"ggml-rpc/{PROTOCOL_VERSION} auth client\0".encode()
SERVER_LABEL = f"ggml-rpc/{PROTOCOL_VERSION} auth server\0".encode()


class SecretError(ValueError):
    """The configured secret is unusable (missing file, too short, empty)."""


class AuthFailed(Exception):
    """The peer did not prove knowledge of the secret."""


def proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


# ---------------------------------------------------------------- secrets

MIN_SECRET_BITS = 64  # a secret whose own byte frequencies carry less is a pattern, not random
CREDENTIAL = "rpc-secret"  # its name among systemd's credentials (LoadCredential=rpc-secret:PATH)
MAKE_ONE = "make one with `openssl rand -hex 32`"
# Values that appeared in examples (deploy/*.example, docs): known to everyone, so no secret.
EXAMPLE_SECRETS = frozenset({b"change-me-to-a-long-random-string"})


def _estimated_bits(secret: bytes) -> float:
    """Length times the Shannon entropy of the secret's byte frequencies: a
    generous estimate (it cannot see words or order) that is low only for a
    secret made of few distinct bytes, e.g. one repeated character."""
    n = len(secret)
    return -sum(c * math.log2(c / n) for c in collections.Counter(secret).values())


def _period(secret: bytes) -> int:
    """The length of the shortest unit the secret repeats (its length if none):
    KMP's failure function."""
    fail = [0] * len(secret)
    k = 0
    for i in range(1, len(secret)):
        while k and secret[i] != secret[k]:
            k = fail[k - 1]
        if secret[i] == secret[k]:
            k += 1
        fail[i] = k
    return len(secret) - fail[-1] if secret else 0


def check_secret(secret: bytes) -> bytes:
    """The secret if it is fit to use; else SecretError saying what is wrong
    with it. The one rule for the daemon and the coordinator alike: at least
    MIN_SECRET_LEN bytes, not an example value, not a short pattern repeated,
    not made of a handful of distinct bytes."""
    if secret in EXAMPLE_SECRETS:
        raise SecretError(f"the shared secret is the example value from the documentation, which everyone knows; "
                          f"{MAKE_ONE}")
    if len(secret) < MIN_SECRET_LEN:
        raise SecretError(f"the shared secret is {len(secret)} bytes; use at least {MIN_SECRET_LEN} ({MAKE_ONE})")
    period = _period(secret)
    if period <= len(secret) // 2:
        raise SecretError(f"the shared secret is a {period}-byte pattern repeated, easy to guess; {MAKE_ONE}")
    if _estimated_bits(secret) < MIN_SECRET_BITS:
        raise SecretError(f"the shared secret is made of only {len(set(secret))} distinct bytes, easy to guess; "
                          f"{MAKE_ONE}")
    return secret


def read_secret_file(path: str) -> bytes:
    """The secret in `path`, without trailing whitespace (a final newline is common)."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(1 << 16)
    except OSError as exc:
        raise SecretError(f"cannot read secret file {path}: {exc.strerror or exc}") from None
    try:
        return check_secret(data.rstrip(b"\r\n\t "))
    except SecretError as exc:
        raise SecretError(f"{path}: {exc}") from None


def secret_file_too_open(path: str) -> bool:
    """True if group or others may read the file (worth a warning)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))
    except OSError:
        return False


def credential_path(environ=os.environ) -> str | None:
    """$CREDENTIALS_DIRECTORY/rpc-secret when systemd passed that credential
    (LoadCredential=rpc-secret:PATH), else None."""
    directory = environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = os.path.join(directory, CREDENTIAL)
    return path if os.path.exists(path) else None


def load_secret(secret: str | bytes | None = None, secret_file: str | None = None,
                environ=os.environ) -> bytes | None:
    """The secret to use, the first of: `secret`; the contents of
    `secret_file`; systemd's credential $CREDENTIALS_DIRECTORY/rpc-secret; the
    environment variable GGML_RPC_SECRET; else None (authentication off).
    Whichever it is must pass check_secret."""
    if secret is not None and secret_file is not None:
        raise SecretError("give the secret or a secret file, not both")
    if secret is not None:
        return check_secret(secret.encode() if isinstance(secret, str) else bytes(secret))
    secret_file = secret_file if secret_file is not None else credential_path(environ)
    if secret_file is not None:
        return read_secret_file(secret_file)
    value = environ.get(ENV_VAR)
    if value:
        try:
            return check_secret(value.encode())
        except SecretError as exc:
            raise SecretError(f"${ENV_VAR}: {exc}") from None
    return None


# ---------------------------------------------------------------- server side

class ServerAuth:
    """One connection's handshake on the daemon: challenge(), then verify()."""

    def __init__(self, secret: bytes, token_bytes=_secrets.token_bytes):
        self._secret = secret
        self._token_bytes = token_bytes
        self.client_nonce: bytes | None = None
        self.server_nonce: bytes | None = None
        self.done = False
        self.failed = False

    @property
    def pending(self) -> bool:
        return self.server_nonce is not None and not self.done and not self.failed

    def challenge(self, hello: dict) -> dict:
        """The `auth` field of the pending HELLO reply. Raises ProtocolError
        (NOT_AUTHORIZED, fatal) if the client offered no nonce or asks twice."""
        if self.server_nonce is not None:
            raise ProtocolError(Status.NOT_AUTHORIZED, "HELLO repeated during authentication", fatal=True)
        nonce = hello.get("auth_nonce")
        if nonce is None:
            raise ProtocolError(Status.NOT_AUTHORIZED,
                                "this worker requires authentication with a shared secret "
                                "(--secret-file or GGML_RPC_SECRET on the client)", fatal=True)
        if not isinstance(nonce, (bytes, bytearray)) or len(nonce) != NONCE_LEN:
            raise ProtocolError(Status.NOT_AUTHORIZED, f"auth_nonce must be {NONCE_LEN} bytes", fatal=True)
        self.client_nonce = bytes(nonce)
        self.server_nonce = self._token_bytes(NONCE_LEN)
        return {"method": METHOD, "nonce": self.server_nonce}

    def verify(self, auth: dict) -> bytes:
        """Check the client's AUTH request; returns the server's proof for the
        reply. Raises ProtocolError (NOT_AUTHORIZED, fatal) on any mismatch."""
        if not self.pending:
            raise ProtocolError(Status.NOT_AUTHORIZED, "AUTH without a pending challenge", fatal=True)
        got = auth.get("proof")
        want = proof(self._secret, CLIENT_LABEL, self.client_nonce, self.server_nonce)
        if not isinstance(got, (bytes, bytearray)) or not hmac.compare_digest(bytes(got), want):
            self.failed = True  # one attempt per connection
            raise ProtocolError(Status.NOT_AUTHORIZED, "authentication failed: wrong shared secret", fatal=True)
        self.done = True
        return proof(self._secret, SERVER_LABEL, self.client_nonce, self.server_nonce)


# ---------------------------------------------------------------- client side

class ClientAuth:
    """One connection's handshake on the client: hello_fields(), answer(),
    then verify_server()."""

    def __init__(self, secret: bytes, token_bytes=_secrets.token_bytes):
        self._secret = secret
        self.client_nonce = token_bytes(NONCE_LEN)
        self.server_nonce: bytes | None = None

    def hello_fields(self) -> dict:
        return {"auth_nonce": self.client_nonce}

    def answer(self, reply: dict) -> dict:
        """The AUTH request's fields for the daemon's pending HELLO reply."""
        challenge = reply.get("auth")
        if not isinstance(challenge, dict) or challenge.get("method") != METHOD:
            raise AuthFailed(f"the worker asks for an authentication method this client does not speak "
                             f"({challenge!r:.80})")
        nonce = challenge.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_LEN:
            raise AuthFailed("the worker's challenge nonce is malformed")
        if nonce == self.client_nonce:
            raise AuthFailed("the worker echoed our own nonce (reflection attempt?)")
        self.server_nonce = nonce
        return {"proof": proof(self._secret, CLIENT_LABEL, self.client_nonce, nonce)}

    def verify_server(self, reply: dict) -> None:
        """Check the proof in the daemon's final reply: it knows the secret too."""
        if self.server_nonce is None:
            raise AuthFailed("the worker accepted the connection without authenticating "
                             "(is it running without a shared secret?)")
        got = reply.get("proof")
        want = proof(self._secret, SERVER_LABEL, self.client_nonce, self.server_nonce)
        if not isinstance(got, bytes) or not hmac.compare_digest(got, want):
            raise AuthFailed("the worker could not prove it knows the shared secret")
