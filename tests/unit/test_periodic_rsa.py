"""Periodic's RSA handshake and its modes (jobmesh/periodic/rsa.py), fed by hand: the peer's
side is written here from the protocol (its interplay with the real aio-periodic is in
tests/integration/test_periodic_security.py)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, padding  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa as crsa  # noqa: E402
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: E402

from jobmesh.errors import ConfigError, PeriodicError  # noqa: E402
from jobmesh.periodic import codec as pc  # noqa: E402
from jobmesh.periodic import rsa  # noqa: E402

OAEP = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


@pytest.fixture(scope="module")
def keys():
    """A server key, an authorized peer key (of another size) and a stranger's."""
    server = crsa.generate_private_key(65537, 2048)
    peer = crsa.generate_private_key(65537, 1536)
    stranger = crsa.generate_private_key(65537, 2048)
    return server, peer, stranger


def server_keys(keys) -> rsa.ServerKeys:
    server, peer, _ = keys
    return rsa.ServerKeys(server, {rsa.fingerprint(peer.public_key()): peer.public_key()})


def pkcs1_fingerprint(key) -> bytes:
    return hashlib.sha256(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)).digest()


def peer_hello(keys, mode: rsa.Mode, session_key: bytes = b"k" * 32, who=None) -> bytes:
    """What aio-periodic's RSATransport writes before its first frame."""
    server, peer, _ = keys
    sender = who or peer
    out = server.public_key().encrypt(pkcs1_fingerprint(sender.public_key()), OAEP)
    out += server.public_key().encrypt(bytes([mode]), OAEP)
    if mode is rsa.Mode.AES:
        out += server.public_key().encrypt(session_key, OAEP)
    return out


def chunked(data: bytes, sizes) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        out.append(data[pos : pos + n])
        pos += n
        i += 1
    return out


def run_handshake(hs: rsa.Handshake, data: bytes, sizes) -> tuple[bytes, list[bytes]]:
    """Feed ``data`` in pieces of ``sizes`` until the handshake is over, as the port does:
    what it answered, and the pieces left for the session (``hs.rest`` first)."""
    replies = b""
    pieces = chunked(data, sizes)
    while hs.session is None:
        replies += hs.feed(pieces.pop(0))
    return replies, [hs.rest] + pieces


def aes(key: bytes, data: bytes, iv: bytes | None = None) -> bytes:
    iv = iv or os.urandom(16)
    enc = Cipher(algorithms.AES(key), modes.CTR(iv)).encryptor()
    body = enc.update(data) + enc.finalize()
    return struct.pack(">Q", 16 + len(body)) + iv + body


def aes_open(key: bytes, data: bytes) -> bytes:
    out, pos = [], 0
    while pos < len(data):
        (size,) = struct.unpack_from(">Q", data, pos)
        iv, body = data[pos + 8 : pos + 24], data[pos + 24 : pos + 8 + size]
        dec = Cipher(algorithms.AES(key), modes.CTR(iv)).decryptor()
        out.append(dec.update(body) + dec.finalize())
        pos += 8 + size
    return b"".join(out)


FIRST = pc.encode_handshake(pc.ConnType.WORKER) + pc.encode_request(pc.Ping(1))


@pytest.mark.parametrize("mode", list(rsa.Mode))
@pytest.mark.parametrize("sizes", [[10_000], [1], [7, 300, 2], [256]], ids=["whole", "bytewise", "mixed", "blocks"])
def test_handshake_in_any_chunking_then_frames_flow(keys, mode, sizes):
    server, peer, _ = keys
    hs = rsa.Handshake(server_keys(keys))
    key = os.urandom(32)
    # Given the peer's hello and its first frames, pipelined, in any chunking
    if mode is rsa.Mode.PLAIN:
        sealed = FIRST
    elif mode is rsa.Mode.RSA:
        step = 256 - 66
        sealed = b"".join(server.public_key().encrypt(FIRST[i : i + step], OAEP) for i in range(0, len(FIRST), step))
    else:
        sealed = aes(key, FIRST)
    reply, after = run_handshake(hs, peer_hello(keys, mode, key) + sealed, sizes)
    # Then the server answered with its fingerprint for the peer's key, once
    assert len(reply) == 1536 // 8
    assert peer.decrypt(reply, OAEP) == pkcs1_fingerprint(server.public_key())
    session = hs.session
    assert session is not None and session.mode is mode
    # And what followed the handshake opens to the peer's frames
    decoder = rsa.OpenedDecoder(session, pc.PacketDecoder())
    for piece in after:
        decoder.feed(piece)
    assert pc.decode_handshake(decoder.next_packet()).kind is pc.ConnType.WORKER
    assert pc.decode_request(decoder.next_packet()) == pc.Ping(1)
    assert decoder.next_packet() is None


def test_rsa_mode_both_ways(keys):
    server, peer, _ = keys
    hs = rsa.Handshake(server_keys(keys))
    hs.feed(peer_hello(keys, rsa.Mode.RSA))
    session = hs.session
    data = bytes(random.Random(1).getrandbits(8) for _ in range(5000))
    # peer -> server: blocks of the server key's size, opened in any chunking
    step = 256 - 66
    sealed = b"".join(server.public_key().encrypt(data[i : i + step], OAEP) for i in range(0, len(data), step))
    assert b"".join(session.open(piece) for piece in chunked(sealed, [1, 99, 1000])) == data
    # server -> peer: blocks of the peer key's size, each at most size - 66 bytes of plaintext
    out = session.seal(data)
    block = 1536 // 8
    assert len(out) % block == 0 and len(out) // block == -(-len(data) // (block - 66))
    assert b"".join(peer.decrypt(out[i : i + block], OAEP) for i in range(0, len(out), block)) == data


def test_aes_mode_both_ways(keys):
    key = os.urandom(32)
    hs = rsa.Handshake(server_keys(keys))
    hs.feed(peer_hello(keys, rsa.Mode.AES, key))
    session = hs.session
    messages = [b"a", b"frame" * 1000, os.urandom(70_000)]
    sealed = b"".join(aes(key, m) for m in messages)
    assert b"".join(session.open(piece) for piece in chunked(sealed, [3, 8, 17, 5000])) == b"".join(messages)
    # each write is one message with a fresh IV
    one, two = session.seal(b"same"), session.seal(b"same")
    assert one != two and aes_open(key, one + two) == b"samesame"


def test_plain_mode_is_the_identity(keys):
    hs = rsa.Handshake(server_keys(keys))
    hs.feed(peer_hello(keys, rsa.Mode.PLAIN))
    assert hs.session.open(b"abc") == b"abc" and hs.session.seal(b"abc") == b"abc"


def test_a_key_not_authorized_is_refused(keys):
    _, _, stranger = keys
    hs = rsa.Handshake(server_keys(keys))
    with pytest.raises(PeriodicError, match="not authorized"):
        hs.feed(peer_hello(keys, rsa.Mode.AES, who=stranger))
    assert hs.session is None


@pytest.mark.parametrize("case", ["garbage", "mode-3", "mode-two-bytes", "short-session-key", "fingerprint-short"])
def test_bad_handshakes_are_refused(keys, case):
    server, peer, _ = keys
    pub = server.public_key()
    fp = pub.encrypt(pkcs1_fingerprint(peer.public_key()), OAEP)
    data = {
        "garbage": os.urandom(256),
        "mode-3": fp + pub.encrypt(b"\x03", OAEP),
        "mode-two-bytes": fp + pub.encrypt(b"\x02\x00", OAEP),
        "short-session-key": fp + pub.encrypt(b"\x02", OAEP) + pub.encrypt(b"k" * 16, OAEP),
        "fingerprint-short": pub.encrypt(pkcs1_fingerprint(peer.public_key())[:31], OAEP),
    }[case]
    with pytest.raises(PeriodicError):
        rsa.Handshake(server_keys(keys)).feed(data)


def test_a_plain_registration_is_recognized_at_once(keys):
    # A peer that skipped the handshake sends 13 bytes and waits: refused without waiting for a block.
    hs = rsa.Handshake(server_keys(keys))
    with pytest.raises(PeriodicError, match="without the RSA handshake"):
        hs.feed(pc.encode_handshake(pc.ConnType.CLIENT))
    hs = rsa.Handshake(server_keys(keys))
    with pytest.raises(PeriodicError, match="without the RSA handshake"):
        for byte in pc.encode_handshake(pc.ConnType.WORKER, b"name", b"token"):
            hs.feed(bytes([byte]))


@pytest.mark.parametrize("size", [0, 16, rsa.MAX_AES_MESSAGE + 1, 2**64 - 1])
def test_an_aes_message_outside_the_limits_is_refused(keys, size):
    hs = rsa.Handshake(server_keys(keys))
    hs.feed(peer_hello(keys, rsa.Mode.AES))
    with pytest.raises(PeriodicError, match="AES message"):
        hs.session.open(struct.pack(">Q", size))


def test_an_rsa_block_that_does_not_decrypt_is_refused(keys):
    hs = rsa.Handshake(server_keys(keys))
    hs.feed(peer_hello(keys, rsa.Mode.RSA))
    with pytest.raises(PeriodicError, match="does not decrypt"):
        hs.session.open(os.urandom(256))


# ---- key files -------------------------------------------------------------------------------


def pem_public(key, fmt) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, fmt)


def pem_private(key, fmt) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


def test_authorized_keys_from_a_directory_in_both_formats(keys, tmp_path):
    server, peer, stranger = keys
    (tmp_path / "a.pem").write_bytes(pem_public(peer, serialization.PublicFormat.PKCS1))
    (tmp_path / "b.pem").write_bytes(pem_public(stranger, serialization.PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "c.txt").write_bytes(b"not a key, not read")
    found = rsa.load_authorized_keys(str(tmp_path))
    assert set(found) == {pkcs1_fingerprint(peer.public_key()), pkcs1_fingerprint(stranger.public_key())}
    assert b"-----BEGIN RSA PUBLIC KEY-----" in (tmp_path / "a.pem").read_bytes()
    assert b"-----BEGIN PUBLIC KEY-----" in (tmp_path / "b.pem").read_bytes()


def test_several_keys_in_one_file(keys, tmp_path):
    server, peer, stranger = keys
    path = tmp_path / "keys.pem"
    path.write_bytes(b"# peers\n" + pem_public(peer, serialization.PublicFormat.PKCS1)
                     + pem_public(stranger, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert len(rsa.load_authorized_keys(str(path))) == 2


@pytest.mark.parametrize("fmt", [serialization.PrivateFormat.TraditionalOpenSSL, serialization.PrivateFormat.PKCS8])
def test_private_key_in_pkcs1_or_pkcs8(keys, tmp_path, fmt):
    server = keys[0]
    path = tmp_path / "server.pem"
    path.write_bytes(pem_private(server, fmt))
    assert rsa.fingerprint(rsa.load_private_key(str(path)).public_key()) == pkcs1_fingerprint(server.public_key())


def test_bad_key_files_name_the_flag_and_file(keys, tmp_path):
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(pem_private(ec_key, serialization.PrivateFormat.PKCS8))
    (tmp_path / "ec_pub.pem").write_bytes(ec_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    small = shutil.which("openssl") and subprocess.run(  # cryptography makes no key under 1024 bits
        ["openssl", "genrsa", "768"], capture_output=True).stdout
    (tmp_path / "junk.pem").write_bytes(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    (tmp_path / "empty").mkdir()
    cases = [
        (rsa.load_private_key, "missing.pem", "--periodic-key .*missing.pem: cannot read it"),
        (rsa.load_private_key, "ec.pem", "--periodic-key .*ec.pem: not an RSA key"),
        (rsa.load_private_key, "junk.pem", "--periodic-key .*junk.pem: not an unencrypted PEM private key"),
        (rsa.load_authorized_keys, "ec_pub.pem", "--periodic-authorized-keys .*ec_pub.pem: a PUBLIC KEY block is not"),
        (rsa.load_authorized_keys, "junk.pem", "--periodic-authorized-keys .*junk.pem: a PUBLIC KEY block does not"),
        (rsa.load_authorized_keys, "empty", "--periodic-authorized-keys .*empty: no RSA public key in it"),
        (rsa.load_authorized_keys, "missing.pem", "--periodic-authorized-keys .*missing.pem: cannot read it"),
    ]
    if small:
        (tmp_path / "small.pem").write_bytes(small)
        cases.append((rsa.load_private_key, "small.pem", "--periodic-key .*small.pem: an RSA key of 768 bits is too"))
    for load, name, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            load(str(tmp_path / name))
        assert "\n" not in str(err.value)
