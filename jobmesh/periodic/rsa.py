r"""Periodic's RSA handshake and its three modes, as aio-periodic 1.0.0's ``RSATransport``
speaks them (docs/PERIODIC.md, "The RSA handshake").

Every key is RSA; every OAEP block uses SHA-256 for both the hash and MGF1, no label (at
most ``size - 66`` bytes of plaintext per block of ``size`` bytes, the key's length). A
key's fingerprint is the SHA-256 of its public key as DER PKCS#1 (``RSAPublicKey``).

::

    peer -> server   OAEP(server key, peer's fingerprint: 32)      one block, server key size
    server -> peer   OAEP(peer key, server's fingerprint: 32)      one block, peer key size
    peer -> server   OAEP(server key, mode: u8)                    0 Plain, 1 RSA, 2 AES
    peer -> server   OAEP(server key, session key: 32)             AES only

An unknown fingerprint, a block that does not decrypt, a mode other than 0-2 or a session
key of another length ends the handshake (the connection is closed without a reply).
Then the Periodic frames, starting with the connection type, flow in the chosen mode:

    Plain  as they are
    RSA    each direction cut into OAEP blocks for the receiver's key (the peer writes
           blocks of the server key's size, the server blocks of the peer key's size)
    AES    messages of length: u64 BE | IV: 16 | AES-256-CTR(session key, IV, data),
           one per write, in both directions with the same session key

This module is pure apart from key files and the random IVs: ``Handshake`` is fed the
bytes as they arrive and says what to send back; ``Session`` opens and seals what
follows. It imports ``cryptography`` (the optional ``periodic-rsa`` extra), so only a
coordinator started with ``--periodic-key`` imports it.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from enum import IntEnum
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from jobmesh.errors import ConfigError, PeriodicError
from jobmesh.periodic.codec import HEADER, MAGIC_REQ, MAX_BODY, PacketDecoder

FINGERPRINT_BYTES = 32
SESSION_KEY_BYTES = 32  # AES-256
IV_BYTES = 16
OAEP_OVERHEAD = 66  # 2 * SHA-256 + 2
MIN_KEY_BITS = 1024  # a block must hold a fingerprint: size - 66 >= 32
AES_LENGTH = struct.Struct(">Q")
# One AES message carries one write of the peer: aio-periodic writes a frame at a time,
# and a frame body is at most MAX_BODY bytes here (12 bytes of frame header, an IV).
MAX_AES_MESSAGE = MAX_BODY + 64
_OAEP = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
_PUBLIC_PEM = re.compile(rb"-----BEGIN ((?:RSA )?PUBLIC KEY)-----.*?-----END \1-----", re.S)


class Mode(IntEnum):
    """The mode byte the peer chooses (metro's ``RSAMode``)."""

    PLAIN = 0
    RSA = 1
    AES = 2


def fingerprint(key: rsa.RSAPublicKey) -> bytes:
    """SHA-256 of the public key as DER PKCS#1: what each side sends to name its key."""
    return hashlib.sha256(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)).digest()


def _check_size(key: rsa.RSAPublicKey | rsa.RSAPrivateKey, where: str) -> None:
    if key.key_size < MIN_KEY_BITS:
        raise ConfigError("%s: an RSA key of %d bits is too small (at least %d)" % (where, key.key_size, MIN_KEY_BITS))


def load_private_key(path: str) -> rsa.RSAPrivateKey:
    """The server's RSA private key from a PEM file (PKCS#1 or PKCS#8, unencrypted)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("--periodic-key %s: cannot read it: %s" % (path, exc.strerror or exc)) from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError("--periodic-key %s: not an unencrypted PEM private key (%s)" % (path, exc)) from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigError("--periodic-key %s: not an RSA key" % path)
    _check_size(key, "--periodic-key %s" % path)
    return key


def _public_keys_in(path: Path) -> list[rsa.RSAPublicKey]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("--periodic-authorized-keys %s: cannot read it: %s" % (path, exc.strerror or exc)) from None
    keys = []
    for block in _PUBLIC_PEM.finditer(data):
        try:
            key = serialization.load_pem_public_key(block.group(0))
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise ConfigError("--periodic-authorized-keys %s: a %s block does not load (%s)"
                              % (path, block.group(1).decode(), exc)) from None
        if not isinstance(key, rsa.RSAPublicKey):
            raise ConfigError("--periodic-authorized-keys %s: a %s block is not an RSA key"
                              % (path, block.group(1).decode()))
        _check_size(key, "--periodic-authorized-keys %s" % path)
        keys.append(key)
    return keys


def load_authorized_keys(path: str) -> dict[bytes, rsa.RSAPublicKey]:
    """The authorized peers' public keys by fingerprint, from a PEM file (every
    ``RSA PUBLIC KEY`` or ``PUBLIC KEY`` block in it) or a directory's ``*.pem`` files."""
    where = Path(path)
    files = sorted(where.glob("*.pem")) if where.is_dir() else [where]
    keys = [key for file in files for key in _public_keys_in(file)]
    if not keys:
        raise ConfigError("--periodic-authorized-keys %s: no RSA public key in it" % path)
    return {fingerprint(key): key for key in keys}


class ServerKeys:
    """The server's private key, loaded once at start, and the public keys it accepts,
    read again by ``reload_authorized`` (SIGHUP)."""

    __slots__ = ("private", "authorized", "authorized_path", "own_fingerprint", "block")

    def __init__(self, private: rsa.RSAPrivateKey, authorized: dict[bytes, rsa.RSAPublicKey],
                 authorized_path: str = "") -> None:
        self.private = private
        self.authorized = authorized
        self.authorized_path = authorized_path  # where ``authorized`` was read from
        self.own_fingerprint = fingerprint(private.public_key())
        self.block = private.key_size // 8  # what the peer's blocks measure

    @classmethod
    def load(cls, key_path: str, authorized_path: str) -> ServerKeys:
        """Both files, checked; ``ConfigError`` naming the flag and the file otherwise."""
        return cls(load_private_key(key_path), load_authorized_keys(authorized_path), authorized_path)

    def reload_authorized(self) -> None:
        """Read the authorized keys again from where they were read at start; handshakes
        from now on use them. ``ConfigError`` (and the keys in force kept) if they do not load."""
        self.authorized = load_authorized_keys(self.authorized_path)

    def decrypt(self, block: bytes) -> bytes:
        try:
            return self.private.decrypt(block, _OAEP)
        except ValueError:
            raise PeriodicError("an RSA block does not decrypt with the server's key") from None


class Session:
    """One connection's mode after the handshake: ``open`` turns received bytes (any
    chunking) into plaintext, ``seal`` turns a write into what goes on the wire."""

    __slots__ = ("mode", "peer", "_keys", "_key", "_buf", "_chunk")

    def __init__(self, mode: Mode, keys: ServerKeys, peer: rsa.RSAPublicKey, session_key: bytes = b"") -> None:
        self.mode = mode
        self.peer = peer  # the peer's authorized public key
        self._keys = keys
        self._key = session_key
        self._buf = bytearray()  # received bytes not yet a whole block or message
        self._chunk = peer.key_size // 8 - OAEP_OVERHEAD  # plaintext per block we send

    def open(self, data: bytes | memoryview) -> bytes | memoryview:
        """The plaintext of every whole block or message received so far; PeriodicError on
        a block that does not decrypt or an AES message over the size limit."""
        if self.mode is Mode.PLAIN:
            return data
        buf = self._buf
        buf += data
        out = []
        pos = 0
        if self.mode is Mode.RSA:
            block = self._keys.block
            while len(buf) - pos >= block:
                out.append(self._keys.decrypt(bytes(buf[pos : pos + block])))
                pos += block
        else:
            while len(buf) - pos >= AES_LENGTH.size:
                (size,) = AES_LENGTH.unpack_from(buf, pos)
                if size <= IV_BYTES or size > MAX_AES_MESSAGE:
                    raise PeriodicError("an AES message of %d bytes (IV included) is outside 17..%d"
                                        % (size, MAX_AES_MESSAGE))
                end = pos + AES_LENGTH.size + size
                if len(buf) < end:
                    break
                start = pos + AES_LENGTH.size
                iv = bytes(buf[start : start + IV_BYTES])
                decryptor = Cipher(algorithms.AES(self._key), modes.CTR(iv)).decryptor()
                out.append(decryptor.update(bytes(buf[start + IV_BYTES : end])) + decryptor.finalize())
                pos = end
        del buf[:pos]
        return b"".join(out)

    def seal(self, data: bytes) -> bytes:
        """``data`` as the peer's reader expects it (Plain: unchanged)."""
        if self.mode is Mode.AES:
            iv = os.urandom(IV_BYTES)
            encryptor = Cipher(algorithms.AES(self._key), modes.CTR(iv)).encryptor()
            sealed = encryptor.update(data) + encryptor.finalize()
            return AES_LENGTH.pack(IV_BYTES + len(sealed)) + iv + sealed
        if self.mode is Mode.RSA:
            step = self._chunk
            return b"".join(self.peer.encrypt(data[i : i + step], _OAEP) for i in range(0, len(data), step))
        return data


class OpenedDecoder:
    """A ``PacketDecoder`` fed through a ``Session``: received bytes are opened first."""

    __slots__ = ("session", "inner")

    def __init__(self, session: Session, inner: PacketDecoder) -> None:
        self.session = session
        self.inner = inner

    def feed(self, data: bytes | memoryview) -> None:
        self.inner.feed(self.session.open(data))

    def next_packet(self) -> bytes | None:
        return self.inner.next_packet()


def plain_registration(data: bytes) -> bool:
    """Whether ``data`` starts with a whole, checked Periodic frame: a peer that skipped
    the handshake (it then waits for an answer, while a block would still be short).
    A ciphertext would have to match the magic and the CRC: 8 bytes by chance."""
    if len(data) < HEADER.size:
        return False
    _, size, crc = HEADER.unpack_from(data)
    end = HEADER.size + size
    return len(data) >= end and zlib.crc32(data[HEADER.size : end]) == crc


class Handshake:
    """The server's side of the handshake, fed as bytes arrive.

    ``feed(data)`` returns the bytes to send now (the server's fingerprint, once the
    peer's is known) and raises ``PeriodicError`` when the handshake fails. Once
    ``session`` is set the handshake is over; ``rest`` holds what the peer sent after it
    (its first frames, still sealed), for ``session.open``, and ``peer_fingerprint``
    names the authorized key the peer proved it holds.
    """

    __slots__ = ("keys", "session", "rest", "peer_fingerprint", "_buf", "_peer", "_mode")

    def __init__(self, keys: ServerKeys) -> None:
        self.keys = keys
        self.session: Session | None = None
        self.rest = b""
        self.peer_fingerprint = b""
        self._buf = b""
        self._peer: rsa.RSAPublicKey | None = None
        self._mode: Mode | None = None

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        reply = b""
        block = self.keys.block
        if self._peer is None and self._buf[:4] == MAGIC_REQ and plain_registration(self._buf):
            raise PeriodicError("a Periodic registration without the RSA handshake")
        while self.session is None and len(self._buf) >= block:
            plain = self.keys.decrypt(self._buf[:block])
            self._buf = self._buf[block:]
            if self._peer is None:
                peer = self.keys.authorized.get(plain) if len(plain) == FINGERPRINT_BYTES else None
                if peer is None:
                    raise PeriodicError("the peer's key is not authorized (fingerprint %s)" % plain[:32].hex())
                self._peer = peer
                self.peer_fingerprint = plain
                reply = peer.encrypt(self.keys.own_fingerprint, _OAEP)
            elif self._mode is None:
                if len(plain) != 1 or plain[0] > Mode.AES:
                    raise PeriodicError("the mode must be one byte 0, 1 or 2 (Plain, RSA, AES), got %s" % plain.hex())
                self._mode = Mode(plain[0])
                if self._mode is not Mode.AES:
                    self.session = Session(self._mode, self.keys, peer=self._peer)
            else:
                if len(plain) != SESSION_KEY_BYTES:
                    raise PeriodicError("the AES session key must be %d bytes, got %d" % (SESSION_KEY_BYTES, len(plain)))
                self.session = Session(Mode.AES, self.keys, self._peer, plain)
        if self.session is not None:
            self.rest, self._buf = self._buf, b""
        return reply
